"""accel.Config: TorchAcc's field names, validation at construction and in validate(), no shared defaults."""
import pytest

import accel
from accel.config import DEFAULT_PAD_VALUES, ComputeConfig, Config, DataLoaderConfig, MemoryConfig


def test_defaults_use_torchacc_names_and_ours():
    c = Config()
    assert c.backend == "auto"
    assert (c.compute.fp16, c.compute.bf16) == (False, False)
    assert (c.compute.compile, c.compute.cuda_graphs, c.compute.kernels) == (True, True, True)
    assert (c.compute.recompile_guard, c.compute.first_token_only, c.compute.cpu_gemm, c.compute.cpu_attention) == (
        False, True, "auto", "auto")
    assert (c.memory.gc, c.memory.gc_cls, c.memory.gc_cnt, c.memory.keep_freed_memory) == (False, None, None, True)
    assert (c.dataloader.buckets, c.dataloader.max_length, c.dataloader.num_buckets) == (None, None, None)
    assert c.dataloader.pad_value_dict == {"input_ids": 0, "attention_mask": 0, "labels": -100}
    assert c.dataloader.pack is False and c.compute.cuda_packed_attention == "auto"
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
    (lambda: ComputeConfig(first_token_only=1), "compute.first_token_only"),
    (lambda: ComputeConfig(cuda_graphs=False, optimizer_cuda_graphs=True),
     "compute.optimizer_cuda_graphs needs compute.cuda_graphs"),
    (lambda: Config(backend="tpu"), "backend"),
    (lambda: Config(compute=MemoryConfig()), "compute"),
    (lambda: MemoryConfig(gc_cls={"BertLayer"}), "memory.gc_cls and memory.gc_cnt take effect only"),
    (lambda: MemoryConfig(gc=True, gc_cls=[""]), "memory.gc_cls"),
    (lambda: MemoryConfig(gc=True, gc_cnt=0), "memory.gc_cnt"),
    (lambda: MemoryConfig(gc=1), "memory.gc"),
    (lambda: MemoryConfig(keep_freed_memory="yes"), "memory.keep_freed_memory"),
    (lambda: DataLoaderConfig(buckets=[0, 8]), "dataloader.buckets"),
    (lambda: DataLoaderConfig(buckets=[]), "dataloader.buckets"),
    (lambda: DataLoaderConfig(max_length=2.5), "dataloader.max_length"),
    (lambda: DataLoaderConfig(num_buckets=4), "dataloader.num_buckets needs dataloader.max_length"),
    (lambda: DataLoaderConfig(buckets=[128, 1024], max_length=512), "dataloader.buckets"),
    (lambda: DataLoaderConfig(pad_value_dict={"input_ids": "0"}), "dataloader.pad_value_dict"),
    (lambda: DataLoaderConfig(pack=True), "dataloader.pack needs dataloader.max_length"),
    (lambda: DataLoaderConfig(pack=True, max_length=64, buckets=[64]), "dataloader.pack and dataloader.buckets"),
    (lambda: DataLoaderConfig(drop_full_masks="yes"), "dataloader.drop_full_masks"),
    (lambda: DataLoaderConfig(background_prefetch=0), "dataloader.background_prefetch"),
    (lambda: ComputeConfig(inductor_options=["max_autotune"]), "compute.inductor_options: expected a dict"),
    (lambda: ComputeConfig(inductor_options={"no_such_setting": True}), "'no_such_setting' is not a torch._inductor"),
    (lambda: ComputeConfig(inductor_options={"triton.cudagraphs": True}), "compute.cuda_graphs"),
    (lambda: ComputeConfig(inductor_options={"max_autotune": [True]}), "'max_autotune' expects a bool"),
    (lambda: ComputeConfig(cpu_gemm="mkl"), "compute.cpu_gemm: expected one of 'auto', 'onednn', 'torch'"),
    (lambda: ComputeConfig(cpu_attention="flash"), "compute.cpu_attention: expected one of 'auto', 'plain', 'sdpa'"),
    (lambda: ComputeConfig(cuda_packed_attention=True),
     "compute.cuda_packed_attention: expected one of 'auto', 'mask', 'varlen', 'flex', got True"),
    (lambda: DataLoaderConfig(drop_full_masks=True, buckets=[64]), "dataloader.drop_full_masks is for loaders"),
    (lambda: DataLoaderConfig(drop_full_masks=True, max_length=64, pack=True), "dataloader.drop_full_masks"),
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


class TestDistConfig:
    def test_defaults_and_sizes(self):
        config = accel.Config()
        assert config.dist.topology == ["dp", "fsdp"] and config.dist.fsdp.size == 1 and config.dist.dp.size is None
        assert config.dist.sizes(8) == (8, 1)
        config.dist.fsdp.size = 4
        assert config.dist.sizes(8) == (2, 4)
        config.dist.dp.size = 2
        assert config.dist.sizes(8) == (2, 4)

    @pytest.mark.parametrize("dp,fsdp,world,message", [
        (3, 2, 8, r"dist.dp.size \* dist.fsdp.size = 3 \* 2 = 6, but the world size is 8"),
        (None, 3, 8, "dist.fsdp.size=3 does not divide the world size 8"),
    ])
    def test_sizes_that_do_not_fit(self, dp, fsdp, world, message):
        config = accel.Config()
        config.dist.dp.size, config.dist.fsdp.size = dp, fsdp
        with pytest.raises(ValueError, match=message):
            config.dist.sizes(world)

    @pytest.mark.parametrize("section,field,value,message", [
        ("fsdp", "size", 0, "dist.fsdp.size: expected an int >= 1"),
        ("fsdp", "size", None, "dist.fsdp.size: expected an int >= 1"),
        ("dp", "size", 1.5, "dist.dp.size: expected None or an int >= 1"),
        ("fsdp", "wrap_layer_cls", [], "dist.fsdp.wrap_layer_cls: expected a non-empty set"),
        ("fsdp", "cpu_offload", "yes", "dist.fsdp.cpu_offload: expected a bool"),
        ("fsdp", "flatten_parameters", 1, "dist.fsdp.flatten_parameters: expected a bool"),
    ])
    def test_bad_fields_named(self, section, field, value, message):
        config = accel.Config()
        setattr(getattr(config.dist, section), field, value)
        with pytest.raises(ValueError, match=message):
            config.validate()

    def test_wrap_layer_cls_string_becomes_a_set(self):
        config = accel.Config()
        config.dist.fsdp.wrap_layer_cls = "BertLayer"
        config.validate()
        assert config.dist.fsdp.wrap_layer_cls == {"BertLayer"}

    @pytest.mark.parametrize("topology", [["dp"], ["dp", "tp"], "dp,fsdp", ["fsdp", "fsdp"]])
    def test_bad_topology(self, topology):
        config = accel.Config()
        config.dist.topology = topology
        with pytest.raises(ValueError, match="dist.topology: expected an ordering of"):
            config.validate()

    def test_no_section_shared_between_configs(self):
        a, b = accel.Config(), accel.Config()
        a.dist.topology.reverse()
        a.dist.fsdp.size = 2
        assert b.dist.topology == ["dp", "fsdp"] and b.dist.fsdp.size == 1
