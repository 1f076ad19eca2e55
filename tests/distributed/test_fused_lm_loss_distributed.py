"""memory.fused_lm_loss under DDP and FSDP2 (two ranks, xlarun, gloo on the CPU): the fused loss reads lm_head's
weight without calling lm_head, so FSDP2 must still have gathered it (the root unit's) and reduce its gradient.
The reference is one process training the plain model on the concatenated batches."""
import importlib.util
import os

import pytest
import torch
from torch.utils.data import DataLoader

from tests.distributed._lm_worker import BATCH, LR, masked_samples, new_lm, new_lora_lm, new_mlm, samples
from tests.distributed.test_accelerate_distributed import WORLD, _launch, assert_same_state

pytest.importorskip("transformers", reason="the fused loss replaces a transformers model's head")

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_lm_worker.py")
MODES = ("ddp", "fsdp")
LORA_MODES = ("ddp_lora", "fsdp_lora")  # the same with peft's LoRA adapters: the fused loss and FSDP2 through peft
MLM_MODES = ("ddp_mlm", "fsdp_mlm")  # a masked LM: its decoder, tied to the embeddings, passes its input through
NO_PEFT = importlib.util.find_spec("peft") is None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("fused_lm_loss_dist"),
                   MODES + MLM_MODES + (() if NO_PEFT else LORA_MODES), worker=WORKER)


def _reference(lora: bool = False, masked: bool = False) -> dict:
    model = new_lora_lm() if lora else new_mlm() if masked else new_lm()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for batch in DataLoader(masked_samples() if masked else samples(), batch_size=WORLD * BATCH):
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_same_weights_as_one_process_without_logits(runs, mode):
    assert runs[mode]["no_logits"]
    assert_same_state(runs[mode]["state"], _reference(), mode)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MLM_MODES)
def test_masked_lm_same_weights_as_one_process_without_logits(runs, mode):
    assert runs[mode]["no_logits"]
    assert_same_state(runs[mode]["state"], _reference(masked=True), mode)


@pytest.mark.slow
@pytest.mark.skipif(NO_PEFT, reason="needs peft (in the test dependencies)")
@pytest.mark.parametrize("mode", LORA_MODES)
def test_lora_trains_as_one_process_and_saves_its_adapters(runs, mode):
    """A LoRA model under DDP / FSDP2 (frozen base weights next to trainable adapters in each unit) with the fused
    loss installed through peft: the same weights as one process, the base untouched, no logits; save_model writes
    the adapters, which peft loads over a fresh base model with the trained values."""
    import peft

    assert runs[mode]["no_logits"]
    reference = _reference(lora=True)
    assert_same_state(runs[mode]["state"], reference, mode)
    base = new_lora_lm().state_dict()
    assert all(torch.equal(runs[mode]["state"][k], v) for k, v in base.items() if "lora_" not in k)
    loaded = peft.PeftModel.from_pretrained(new_lm(), runs[mode]["model_dir"]).state_dict()
    for key, value in reference.items():
        if "lora_" in key:
            torch.testing.assert_close(loaded[key], value, rtol=2e-5, atol=2e-6, msg=f"{mode}: {key}")


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_save_model_gives_from_pretrained_the_trained_weights(runs, mode):
    """accel.save_model of the DDP / FSDP2 model (every rank calls it, rank 0 writes save_pretrained's files):
    from_pretrained loads the gathered trained weights, under the model's own class name (not FSDP's)."""
    import json

    import transformers

    folder = runs[mode]["model_dir"]
    with open(folder / "config.json") as f:
        assert json.load(f)["architectures"] == ["LlamaForCausalLM"]
    loaded = transformers.LlamaForCausalLM.from_pretrained(folder).state_dict()
    assert set(loaded) == set(runs[mode]["state"])
    for key, value in runs[mode]["state"].items():
        assert torch.equal(loaded[key], value), f"{mode}: {key}"
