"""accel.save_model and accel.unwrap_model in one process: an accelerated (compiled, packed) transformers model
loads back with from_pretrained, trained weights equal; any other module as model.safetensors (tied weights too)
or pytorch_model.bin; a save replaces an earlier one's weight files and keeps other files; a failed save leaves the
folder as it was; bad arguments are named. DDP, FSDP2, HSDP and XLA data parallel: tests/distributed
(test_accelerate_distributed, test_fused_lm_loss_distributed)."""
import json
import os

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import accel

transformers = pytest.importorskip("transformers", reason="save_model writes a transformers model as save_pretrained")
VOCAB = 64


def _bert():
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, num_labels=3))


def _trained(pack: bool):
    """A BERT classifier through accelerate() (compiled; packed rows or padded batches), two steps of AdamW."""
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(1, VOCAB, (int(n),), generator=g).tolist(), "labels": int(n) % 3}
            for n in torch.randint(4, 12, (8,), generator=g)]
    config = accel.Config(backend="cpu")
    config.compute.kernels = False
    if pack:
        config.dataloader.pack, config.dataloader.max_length = True, 32
    collate = transformers.DataCollatorWithPadding(transformers.BertTokenizerFast(vocab={"[PAD]": 0, "[UNK]": 1}))
    model, loader = accel.accelerate(_bert(), DataLoader(data, batch_size=4, collate_fn=collate), config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for batch in loader:
        model(**batch)["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


@pytest.mark.filterwarnings("ignore:dataloader.pack. the loader's collate_fn")
@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_an_accelerated_model_loads_back_with_from_pretrained(tmp_path, pack):
    model = _trained(pack)
    own = accel.unwrap_model(model)
    assert type(own) is transformers.BertForSequenceClassification
    assert (own is model.model) if pack else (own is model)
    accel.save_model(model, tmp_path / "out")
    with open(tmp_path / "out" / "config.json") as f:
        config = json.load(f)
    assert config["architectures"] == ["BertForSequenceClassification"]
    assert "accel" not in json.dumps(config)  # accelerate()'s "accel_sdpa" is not what a fresh load should use
    loaded = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "out")
    trained = own.state_dict()
    assert set(loaded.state_dict()) == set(trained)
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, trained[key]), key
    assert not _bert().state_dict()["classifier.weight"].equal(trained["classifier.weight"])  # it did train
    assert [name for name in os.listdir(tmp_path) if name != "out"] == []  # no staging folder left


class _Tied(nn.Module):
    """A module whose two layers share one weight (as tied embeddings do), and a buffer."""

    def __init__(self):
        super().__init__()
        self.encode = nn.Linear(4, 4, bias=False)
        self.decode = nn.Linear(4, 4, bias=False)
        self.decode.weight = self.encode.weight
        self.register_buffer("steps", torch.tensor(3))


def test_any_other_module_is_saved_as_safetensors_tied_weights_included(tmp_path):
    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = _Tied()
    compiled = torch.compile(model)
    assert accel.unwrap_model(compiled) is model
    accel.save_model(compiled, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]
    saved = load_file(tmp_path / "model.safetensors")
    fresh = _Tied()
    fresh.load_state_dict(saved)
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key


class _WithExtraState(nn.Linear):
    def get_extra_state(self):
        return {"note": "kept"}

    def set_extra_state(self, state):
        self.note = state["note"]


def test_a_state_dict_safetensors_cannot_hold_goes_to_pytorch_model_bin(tmp_path):
    model = _WithExtraState(3, 2)
    accel.save_model(model, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["pytorch_model.bin"]
    fresh = _WithExtraState(3, 2)
    fresh.load_state_dict(torch.load(tmp_path / "pytorch_model.bin", weights_only=True))
    assert fresh.note == "kept" and torch.equal(fresh.weight, model.weight)


def test_a_new_save_replaces_earlier_weight_files_and_keeps_the_rest(tmp_path):
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                 "model.safetensors.index.json", "pytorch_model.bin", "notes.txt"):
        (tmp_path / name).write_text("old")
    accel.save_model(nn.Linear(2, 2), tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors", "notes.txt"]
    assert (tmp_path / "notes.txt").read_text() == "old"


def test_a_failed_save_leaves_the_folder_as_it_was(tmp_path, monkeypatch):
    import accel.export

    (tmp_path / "model.safetensors").write_text("the previous weights")

    def fail(state, folder):
        open(os.path.join(folder, "model.safetensors"), "w").close()  # half written
        raise OSError("disk full")

    monkeypatch.setattr(accel.export, "_save_state_dict", fail)
    with pytest.raises(OSError, match="disk full"):
        accel.save_model(nn.Linear(2, 2), tmp_path)
    assert (tmp_path / "model.safetensors").read_text() == "the previous weights"
    assert os.listdir(tmp_path) == ["model.safetensors"]
    assert [name for name in os.listdir(tmp_path.parent) if name.startswith(f".{tmp_path.name}.")] == []


def test_bad_arguments_are_named(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="directory: .* is a file"):
        accel.save_model(nn.Linear(2, 2), tmp_path / "file")
    with pytest.raises(FileNotFoundError, match="missing"):
        accel.save_model(nn.Linear(2, 2), tmp_path / "missing" / "out")
    with pytest.raises(TypeError, match="directory: expected a path"):
        accel.save_model(nn.Linear(2, 2), 3)
    with pytest.raises(TypeError, match="model: expected an nn.Module, got dict"):
        accel.save_model({"weight": torch.zeros(1)}, tmp_path)
    with pytest.raises(TypeError, match="model: expected an nn.Module"):
        accel.unwrap_model(None)
