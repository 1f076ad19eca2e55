"""memory.fused_lm_loss under DDP and FSDP2 (two ranks, xlarun, gloo on the CPU): the fused loss reads lm_head's
weight without calling lm_head, so FSDP2 must still have gathered it (the root unit's) and reduce its gradient.
The reference is one process training the plain model on the concatenated batches."""
import os

import pytest
import torch
from torch.utils.data import DataLoader

from tests.distributed._lm_worker import BATCH, LR, new_lm, samples
from tests.distributed.test_accelerate_distributed import WORLD, _launch, assert_same_state

pytest.importorskip("transformers", reason="the fused loss replaces a transformers model's head")

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_lm_worker.py")
MODES = ("ddp", "fsdp")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("fused_lm_loss_dist"), MODES, worker=WORKER)


def _reference() -> dict:
    model = new_lm()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for batch in DataLoader(samples(), batch_size=WORLD * BATCH):
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
