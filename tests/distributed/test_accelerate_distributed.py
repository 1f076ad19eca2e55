"""accelerate() with two ranks (xlarun, gloo on the CPU): DDP, FSDP2 (also with cpu_offload), gradient
accumulation (also with accel.amp.GradScaler and a sync-free optimizer), the loader's sharding; and HSDP with four
ranks. The reference is one process training the same model on the concatenated batches."""
import functools
import os

import pytest
import torch
from torch.utils.data import DataLoader

import accel
from tests.distributed._model import Points, inject_inf, new_model, optimizer_for
from tests.distributed._worker import BATCH, INF_STEP, MICRO, STEPS
from tests.xla._helpers import free_port, run_python

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_worker.py")
MODES = ("ddp", "ddp_compiled", "ddp_accumulate", "fsdp", "fsdp_named", "fsdp_accumulate", "fsdp_offload",
         "ddp_accumulate_scaler", "fsdp_accumulate_scaler")
WORLD = 2
# HSDP: dist.dp.size=2 x dist.fsdp.size=2. Four processes on a small machine are slow: one launch, few steps.
HSDP_MODES = ("hsdp", "hsdp_accumulate")
HSDP_WORLD = 4


XLA_MODES = ("xla_dp", "xla_accumulate", "xla_optimizer_step")


def _launch(out, modes, world=WORLD, worker=WORKER):
    run_python(["-m", "accel.launch", f"--nproc_per_node={world}", f"--master_port={free_port()}", worker,
                str(out), ",".join(modes)],
               env_extra={"PJRT_DEVICE": "CPU"},
               drop_env=("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR", "CPU_NUM_DEVICES"),
               timeout=600)
    runs = {mode: torch.load(out / f"{mode}.pt", weights_only=True) for mode in modes}
    for mode in modes:
        runs[mode]["model_dir"] = out / f"{mode}_model"  # accel.save_model's
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("accel_dist"), MODES)


@pytest.fixture(scope="module")
def xla_runs(tmp_path_factory):
    pytest.importorskip("torch_xla", reason="the xla backend needs torch_xla")
    return _launch(tmp_path_factory.mktemp("accel_dist_xla"), XLA_MODES)


@pytest.fixture(scope="module")
def hsdp_runs(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("accel_dist_hsdp"), HSDP_MODES, world=HSDP_WORLD)


def reference(mode: str, world: int = WORLD) -> tuple[dict, list]:
    """One process, one batch per step holding every rank's micro-batches of that step: the state dict, and
    the GradScaler's scale after each step in the scaler modes (where the step INF_STEP overflows, as one of
    the ranks' gradients did)."""
    return _reference(MICRO if "accumulate" in mode else 1, "scaler" in mode, world)


@functools.lru_cache(maxsize=None)  # the tests only read it
def _reference(micro: int, scaling: bool, world: int) -> tuple[dict, list]:
    model = new_model()
    optimizer = optimizer_for(model, syncfree=scaling)
    scaler = accel.amp.GradScaler("cpu") if scaling else None
    scales = []
    loader = DataLoader(Points(world * BATCH * STEPS * MICRO), batch_size=world * BATCH * micro, shuffle=False)
    for step, batch in enumerate(loader):
        if step == STEPS:
            break
        batch.pop("id")
        loss = model(**batch)["loss"]
        if scaling:
            scaler.scale(loss).backward()
            if step == INF_STEP:
                inject_inf(model)
            scaler.step(optimizer)
            scaler.update()
            scales.append(scaler.get_scale())
        else:
            loss.backward()
            optimizer.step()
        optimizer.zero_grad()
    return model.state_dict(), scales


def reference_state(mode: str, world: int = WORLD) -> dict:
    return reference(mode, world)[0]


def assert_same_state(got, expected, mode):
    assert list(got) == list(expected)  # the user's model's keys, not the wrapper's
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=2e-5, atol=2e-6, msg=f"{mode}: {key}")


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_same_weights_as_one_process_on_the_concatenated_batches(runs, mode):
    assert_same_state(runs[mode]["state"], reference_state(mode), mode)


@pytest.mark.slow
@pytest.mark.parametrize("mode", HSDP_MODES)
def test_hsdp_same_weights_as_one_process_on_the_concatenated_batches(hsdp_runs, mode):
    assert_same_state(hsdp_runs[mode]["state"], reference_state(mode, world=HSDP_WORLD), mode)


@pytest.mark.slow
@pytest.mark.parametrize("mode", XLA_MODES)
def test_xla_data_parallel_averages_once_per_step(xla_runs, mode):
    # Gradients averaged over the xla group in one all-reduce per optimizer step, from the step pre-hook,
    # also when the loop calls accel.xla.optimizer_step (which then does not reduce again).
    got = xla_runs[mode]["state"]
    expected = reference_state(mode)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=2e-5, atol=2e-6, msg=f"{mode}: {key}")
    assert all(r["reductions"] == STEPS and r["wrapper"] == "TinyNet" for r in xla_runs[mode]["ranks"])


def _assert_saved_model_is_the_gathered_state(run, mode):
    """accel.save_model wrote the user's module's weights, whole (FSDP's shards gathered), as model.safetensors."""
    from safetensors.torch import load_file

    assert sorted(os.listdir(run["model_dir"])) == ["model.safetensors"]
    saved = load_file(run["model_dir"] / "model.safetensors")
    assert set(saved) == set(run["state"]), mode  # safetensors lists keys sorted
    for key, value in run["state"].items():
        assert torch.equal(saved[key], value), f"{mode}: {key}"


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_save_model_writes_the_gathered_weights(runs, mode):
    _assert_saved_model_is_the_gathered_state(runs[mode], mode)


@pytest.mark.slow
@pytest.mark.parametrize("mode", HSDP_MODES)
def test_save_model_writes_the_gathered_weights_hsdp(hsdp_runs, mode):
    _assert_saved_model_is_the_gathered_state(hsdp_runs[mode], mode)


@pytest.mark.slow
@pytest.mark.parametrize("mode", XLA_MODES)
def test_save_model_writes_the_xla_weights(xla_runs, mode):
    _assert_saved_model_is_the_gathered_state(xla_runs[mode], mode)


@pytest.mark.slow
@pytest.mark.parametrize("mode,wrapper", [("ddp", "DistributedDataParallel"), ("fsdp", "FSDPTinyNet")])
def test_the_configured_wrapper(runs, mode, wrapper):
    assert all(r["wrapper"] == wrapper for r in runs[mode]["ranks"])


@pytest.mark.slow
@pytest.mark.parametrize("mode,per_sync", [("ddp_accumulate", 1), ("fsdp_accumulate", 4),
                                           ("ddp_accumulate_scaler", 1), ("fsdp_accumulate_scaler", 4)])
def test_accumulation_communicates_only_on_the_last_micro_batch(runs, mode, per_sync):
    # DDP: one bucket for this small model; FSDP2: one reduce-scatter per unit (3 blocks + the root).
    for r in runs[mode]["ranks"]:
        assert r["per_micro_batch"] == ([0] * (MICRO - 1) + [per_sync]) * STEPS


@pytest.mark.slow
def test_every_step_communicates_without_accumulation(runs):
    for r in runs["ddp"]["ranks"]:
        assert r["per_micro_batch"] == [1] * STEPS


@pytest.mark.slow
def test_ranks_agree_only_where_every_rank_votes_yes(runs):
    # accelerate()'s compute.cpu_gemm="auto": each rank probes oneDNN; all use it only where all found it faster
    for result in runs.values():
        assert [r["agree"] for r in result["ranks"]] == [[True, False]] * WORLD


def test_ranks_read_disjoint_shares_and_reshuffle_per_epoch(runs):
    ranks = runs["ddp"]["ranks"]
    for epoch in range(2):
        shares = [set(r["epochs"][epoch]) for r in ranks]
        assert shares[0].isdisjoint(shares[1])
        assert shares[0] | shares[1] == set(range(len(Points())))
    assert ranks[0]["epochs"][0] != ranks[0]["epochs"][1]  # set_epoch at every pass
    assert [r["ids"][:4] for r in ranks] == [[0, 2, 4, 6], [1, 3, 5, 7]]  # DistributedSampler's split


@pytest.mark.slow
def test_cpu_offload_reaches_every_fsdp_unit(runs):
    # accelerate() hands fully_shard a CPUOffloadPolicy for each block and the root: FSDP2 keeps each
    # parameter's shard (hence its gradient and the optimizer state) in host memory and copies it to the
    # compute device for the all-gather. Unpinned on the cpu backend: torch pins only where an accelerator
    # exists (FSDP2's default pin_memory=True fails in fully_shard on a machine without a GPU).
    for r in runs["fsdp_offload"]["ranks"]:
        units = r["layout"]["units"]
        assert sorted(units) == ["", "blocks.0", "blocks.1", "blocks.2"]
        for name, unit in units.items():
            assert (unit["offload_policy"], unit["pin_memory"]) == ("CPUOffloadPolicy", False), name
            assert unit["offload_to_cpu"] == [True, True] and unit["shard_devices"] == ["cpu", "cpu"], name
    for r in runs["fsdp"]["ranks"]:  # without cpu_offload: the policy that offloads nothing
        for name, unit in r["layout"]["units"].items():
            assert (unit["offload_policy"], unit["offload_to_cpu"]) == ("OffloadPolicy", [False, False]), name


@pytest.mark.slow
def test_fsdp_alone_shards_over_a_1d_mesh(runs):
    for r in runs["fsdp"]["ranks"]:
        for name, p in r["layout"]["params"].items():
            assert p == {"placements": "(Shard(dim=0),)", "mesh": [0, 1], "mesh_dim_names": ("fsdp",)}, name


@pytest.mark.slow
def test_hsdp_replicates_over_dp_and_shards_over_fsdp(hsdp_runs):
    ranks = hsdp_runs["hsdp"]["ranks"]
    for r in ranks:
        assert r["wrapper"] == "FSDPTinyNet"
        for name, p in r["layout"]["params"].items():  # the default topology: a shard group's ranks are contiguous
            assert p == {"placements": "(Replicate(), Shard(dim=0))", "mesh": [[0, 1], [2, 3]],
                         "mesh_dim_names": ("dp", "fsdp")}, name
    # Ranks 0 and 2 hold shard 0 of every parameter, 1 and 3 shard 1: equal within a replica group after training.
    for a, b in ((0, 2), (1, 3)):
        assert all(torch.equal(x, y) for x, y in zip(ranks[a]["local"], ranks[b]["local"]))
    assert not torch.equal(ranks[0]["local"][0], ranks[1]["local"][0])


@pytest.mark.slow
def test_hsdp_accumulation_communicates_only_on_the_last_micro_batch(hsdp_runs):
    for r in hsdp_runs["hsdp_accumulate"]["ranks"]:  # reduce-scatters counted: one per unit
        assert r["per_micro_batch"] == ([0] * (MICRO - 1) + [4]) * STEPS


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp_accumulate_scaler", "fsdp_accumulate_scaler"])
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(runs, mode):
    # Only the last rank's gradients hold an inf at step INF_STEP, put there after the gradient reduction (which
    # would otherwise spread it to every rank): an overflow one rank sees and the other does not. Every rank
    # must skip that step and back off the scale, so the weights equal the reference that skips it (the test
    # above), and the ranks agree on the scale and (DDP) on their whole copies of the weights.
    # DDP: this rests on accel's GradScaler all-reducing found_inf (without it rank 0 steps and these fail).
    # FSDP2: each rank checks only its own shard; torch's DTensor already max-reduces found_inf over the mesh
    # in the unscale op, and accel's all-reduce then sums an agreed flag.
    expected = reference(mode)[1]
    assert expected == [2.0**16, 2.0**15, 2.0**15]
    ranks = runs[mode]["ranks"]
    assert [r["scales"] for r in ranks] == [expected] * WORLD
    if mode.startswith("ddp"):
        assert all(torch.equal(x, y) for x, y in zip(ranks[0]["local"], ranks[1]["local"]))


def test_sizes_that_do_not_fit_the_world_are_refused():
    config = accel.Config(backend="cpu")
    config.dist.fsdp.size = 2
    with pytest.raises(ValueError, match="dist.fsdp.size=2 does not divide the world size 1"):
        accel.accelerate(torch.nn.Linear(2, 2), config=config)
    config = accel.Config(backend="cpu")
    config.dist.dp.size = 2
    with pytest.raises(ValueError, match=r"dist.dp.size \* dist.fsdp.size = 2 \* 1 = 2, but the world size is 1"):
        accel.accelerate(torch.nn.Linear(2, 2), config=config)
