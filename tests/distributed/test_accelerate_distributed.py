"""accelerate() with two ranks (xlarun, gloo on the CPU): DDP, FSDP2, gradient accumulation, the loader's
sharding. The reference is one process training the same model on the concatenated batches."""
import os

import pytest
import torch
from torch.utils.data import DataLoader

import accel
from tests.distributed._model import Points, new_model, optimizer_for
from tests.distributed._worker import BATCH, MICRO, STEPS
from tests.xla._helpers import free_port, run_python

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_worker.py")
MODES = ("ddp", "ddp_compiled", "ddp_accumulate", "fsdp", "fsdp_named", "fsdp_accumulate")
WORLD = 2


XLA_MODES = ("xla_dp", "xla_accumulate", "xla_optimizer_step")


def _launch(out, modes):
    run_python(["-m", "accel.launch", f"--nproc_per_node={WORLD}", f"--master_port={free_port()}", WORKER,
                str(out), ",".join(modes)],
               env_extra={"PJRT_DEVICE": "CPU"},
               drop_env=("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR", "CPU_NUM_DEVICES"),
               timeout=600)
    return {mode: torch.load(out / f"{mode}.pt", weights_only=True) for mode in modes}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("accel_dist"), MODES)


@pytest.fixture(scope="module")
def xla_runs(tmp_path_factory):
    pytest.importorskip("torch_xla", reason="the xla backend needs torch_xla")
    return _launch(tmp_path_factory.mktemp("accel_dist_xla"), XLA_MODES)


def reference_state(micro: int) -> dict:
    """One process, one batch per step holding every rank's micro-batches of that step."""
    model = new_model()
    optimizer = optimizer_for(model)
    loader = DataLoader(Points(WORLD * BATCH * STEPS * MICRO), batch_size=WORLD * BATCH * micro, shuffle=False)
    for step, batch in enumerate(loader):
        if step == STEPS:
            break
        batch.pop("id")
        model(**batch)["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_same_weights_as_one_process_on_the_concatenated_batches(runs, mode):
    got = runs[mode]["state"]
    expected = reference_state(MICRO if "accumulate" in mode else 1)
    assert list(got) == list(expected)  # the user's model's keys, not the wrapper's
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=2e-5, atol=2e-6, msg=f"{mode}: {key}")


@pytest.mark.slow
@pytest.mark.parametrize("mode", XLA_MODES)
def test_xla_data_parallel_averages_once_per_step(xla_runs, mode):
    # Gradients averaged over the xla group in one all-reduce per optimizer step, from the step pre-hook,
    # also when the loop calls accel.xla.optimizer_step (which then does not reduce again).
    got = xla_runs[mode]["state"]
    expected = reference_state(MICRO if "accumulate" in mode else 1)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=2e-5, atol=2e-6, msg=f"{mode}: {key}")
    assert all(r["reductions"] == STEPS and r["wrapper"] == "TinyNet" for r in xla_runs[mode]["ranks"])


@pytest.mark.slow
@pytest.mark.parametrize("mode,wrapper", [("ddp", "DistributedDataParallel"), ("fsdp", "FSDPTinyNet")])
def test_the_configured_wrapper(runs, mode, wrapper):
    assert all(r["wrapper"] == wrapper for r in runs[mode]["ranks"])


@pytest.mark.slow
@pytest.mark.parametrize("mode,per_sync", [("ddp_accumulate", 1), ("fsdp_accumulate", 4)])
def test_accumulation_communicates_only_on_the_last_micro_batch(runs, mode, per_sync):
    # DDP: one bucket for this small model; FSDP2: one reduce-scatter per unit (3 blocks + the root).
    for r in runs[mode]["ranks"]:
        assert r["per_micro_batch"] == ([0] * (MICRO - 1) + [per_sync]) * STEPS


@pytest.mark.slow
def test_every_step_communicates_without_accumulation(runs):
    for r in runs["ddp"]["ranks"]:
        assert r["per_micro_batch"] == [1] * STEPS


@pytest.mark.slow
def test_ranks_read_disjoint_shares_and_reshuffle_per_epoch(runs):
    ranks = runs["ddp"]["ranks"]
    for epoch in range(2):
        shares = [set(r["epochs"][epoch]) for r in ranks]
        assert shares[0].isdisjoint(shares[1])
        assert shares[0] | shares[1] == set(range(len(Points())))
    assert ranks[0]["epochs"][0] != ranks[0]["epochs"][1]  # set_epoch at every pass
    assert [r["ids"][:4] for r in ranks] == [[0, 2, 4, 6], [1, 3, 5, 7]]  # DistributedSampler's split


def test_sizes_that_do_not_fit_the_world_are_refused():
    config = accel.Config(backend="cpu")
    config.dist.fsdp.size = 2
    with pytest.raises(ValueError, match="dist.fsdp.size=2 does not divide the world size 1"):
        accel.accelerate(torch.nn.Linear(2, 2), config=config)
    config = accel.Config(backend="cpu")
    config.dist.dp.size = 2
    with pytest.raises(ValueError, match=r"dist.dp.size \* dist.fsdp.size = 2 \* 1 = 2, but the world size is 1"):
        accel.accelerate(torch.nn.Linear(2, 2), config=config)
