"""accel.Config: TorchAcc's field names, validation at construction and in validate(), no shared defaults."""
import pytest

import accel
from accel.config import DEFAULT_PAD_VALUES, ComputeConfig, Config, DataLoaderConfig, MemoryConfig


def test_defaults_use_torchacc_names_and_ours():
    c = Config()
    assert c.backend == "auto"
    assert (c.compute.fp16, c.compute.bf16) == (False, False)
    assert (c.compute.compile, c.compute.cuda_graphs, c.compute.kernels) == (True, True, True)
    assert (c.memory.gc, c.memory.gc_cls, c.memory.gc_cnt) == (False, None, None)
    assert (c.dataloader.buckets, c.dataloader.max_length, c.dataloader.num_buckets) == (None, None, None)
    assert c.dataloader.pad_value_dict == {"input_ids": 0, "attention_mask": 0, "labels": -100}
    assert c.dataloader.pack is False
    assert accel.Config is Config


def test_no_state_is_shared_between_configs():
    a, b = Config(), Config()
    a.dataloader.pad_value_dict["input_ids"] = 5
    a.compute.bf16 = True
    assert b.dataloader.pad_value_dict == DEFAULT_PAD_VALUES
    assert b.compute.bf16 is False
    assert DEFAULT_PAD_VALUES["input_ids"] == 0


@pytest.mark.parametrize("build, field", [
    (lambda: ComputeConfig(fp16=True, bf16=True), "compute.fp16 and compute.bf16 are exclusive"),
    (lambda: ComputeConfig(compile="yes"), "compute.compile"),
    (lambda: Config(backend="tpu"), "backend"),
    (lambda: Config(compute=MemoryConfig()), "compute"),
    (lambda: MemoryConfig(gc_cls={"BertLayer"}), "memory.gc_cls and memory.gc_cnt take effect only"),
    (lambda: MemoryConfig(gc=True, gc_cls=[""]), "memory.gc_cls"),
    (lambda: MemoryConfig(gc=True, gc_cnt=0), "memory.gc_cnt"),
    (lambda: MemoryConfig(gc=1), "memory.gc"),
    (lambda: DataLoaderConfig(buckets=[0, 8]), "dataloader.buckets"),
    (lambda: DataLoaderConfig(buckets=[]), "dataloader.buckets"),
    (lambda: DataLoaderConfig(max_length=2.5), "dataloader.max_length"),
    (lambda: DataLoaderConfig(num_buckets=4), "dataloader.num_buckets needs dataloader.max_length"),
    (lambda: DataLoaderConfig(buckets=[128, 1024], max_length=512), "dataloader.buckets"),
    (lambda: DataLoaderConfig(pad_value_dict={"input_ids": "0"}), "dataloader.pad_value_dict"),
    (lambda: DataLoaderConfig(pack=True), "dataloader.pack needs dataloader.max_length"),
    (lambda: DataLoaderConfig(pack=True, max_length=64, buckets=[64]), "dataloader.pack and dataloader.buckets"),
])
def test_bad_values_name_the_field(build, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        build()


def test_fields_assigned_later_are_caught_by_validate():
    c = Config()
    c.compute.fp16 = c.compute.bf16 = True
    with pytest.raises(ValueError, match="exclusive"):
        c.validate()


def test_bucket_lengths():
    assert DataLoaderConfig().bucket_lengths() is None
    assert DataLoaderConfig(buckets=[256, 64, 64]).bucket_lengths() == [64, 256]
    assert DataLoaderConfig(max_length=512).bucket_lengths() == [512]
    assert DataLoaderConfig(max_length=512, num_buckets=4).bucket_lengths() == [128, 256, 384, 512]
    # multiples of 8 (tensor-core friendly), never past max_length
    assert DataLoaderConfig(max_length=100, num_buckets=3).bucket_lengths() == [40, 72, 100]
    assert DataLoaderConfig(max_length=64, pack=True).bucket_lengths() is None
    assert MemoryConfig(gc=True, gc_cls="BertLayer").gc_cls == {"BertLayer"}
