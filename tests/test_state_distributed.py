"""accel.save_state / accel.load_state with 2 processes (gloo, CPU): DDP resumes bit-identically; FSDP2 saves
sharded, resumes at world size 2, loads at world size 1, and saves asynchronously.

One spawn runs every scenario (starting processes is the slow part); each scenario writes "ok" or its
traceback per rank, and the tests read those. The spawn has a deadline, so a hang fails instead of blocking.
"""
from __future__ import annotations

import datetime
import os
import random
import threading
import time
import traceback

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from tests._spawn import run_processes

WORLD = 2
EPOCHS, PER_RANK_BATCH, SAMPLES = 2, 4, 32  # 4 steps per epoch on each rank
STOP_AT = 5  # mid-epoch 1
DEADLINE_S = 240  # the whole spawn; the machine may be shared, a hang is far longer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in"),
]


# ---------------------------------------------------------------- what each rank runs
def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.25), nn.Linear(16, 2))


def _loader():
    from accel.data.resumable import ResumableLoader

    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(SAMPLES, 4, generator=gen), torch.randn(SAMPLES, 2, generator=gen),
                         torch.arange(SAMPLES))
    return ResumableLoader(DataLoader(data, batch_size=PER_RANK_BATCH, sampler=DistributedSampler(data, seed=1)))


def _seed_rank(base: int) -> None:
    rank = dist.get_rank()
    torch.manual_seed(base + rank)  # dropout differs per rank: each rank's RNG must come back
    random.seed(base + rank)


class _Run:
    def __init__(self, kind: str, seed: int, scaler: bool = True):
        model = _model(seed)
        if kind == "ddp":
            self.model = nn.parallel.DistributedDataParallel(model)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (WORLD,))
            for layer in (model[0], model[3]):
                fully_shard(layer, mesh=mesh)
            self.model = fully_shard(model, mesh=mesh)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=2, gamma=0.5)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=16.0, growth_interval=2) if scaler else None
        self.loader = _loader()
        self.batches: list = []

    def objects(self):
        return self.model, self.optimizer, self.scaler, self.scheduler, self.loader

    def train(self, start_epoch=0, step=0, stop_at=None, path=None):
        from accel.state import save_state

        for epoch in range(start_epoch, EPOCHS):
            self.loader.set_epoch(epoch)
            for x, y, index in self.loader:
                self.batches.append(index)
                loss = (self.model(x) - y).pow(2).mean()
                if self.scaler is not None:
                    self.scaler.scale(loss).backward()
                    self.scaler.step(self.optimizer)
                    self.scaler.update()
                else:
                    loss.backward()
                    self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad()
                step += 1
                if step == stop_at:
                    save_state(path, *self.objects(), step=step, epoch=epoch)
                    return

    def full_state(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        return get_state_dict(self.model, self.optimizer,
                              options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _equal_nested(a, b, where="") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), where
        for key in a:
            _equal_nested(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _equal_nested(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def _resume_matches(kind: str, out: str) -> None:
    path = os.path.join(out, f"{kind}_ckpt" + (".pt" if kind == "ddp" else ""))
    scaler = kind == "ddp"
    whole = _Run(kind, 0, scaler)
    _seed_rank(0)
    whole.train()
    want = whole.full_state()

    first = _Run(kind, 0, scaler)
    _seed_rank(0)
    first.train(stop_at=STOP_AT, path=path)
    if kind == "fsdp" and dist.get_rank() == 0:  # the world-size-1 test compares against this
        torch.save(first.full_state(), os.path.join(out, "fsdp_reference.pt"))
    elif kind == "fsdp":
        first.full_state()  # a collective: every rank takes part

    second = _Run(kind, 7, scaler)
    _seed_rank(999)
    from accel.state import load_state

    extra = load_state(path, *second.objects())
    assert extra == {"step": STOP_AT, "epoch": 1}
    second.train(start_epoch=extra["epoch"], step=extra["step"])
    got = second.full_state()
    assert len(first.batches) + len(second.batches) == len(whole.batches)
    for i, (a, b) in enumerate(zip(first.batches + second.batches, whole.batches)):
        assert torch.equal(a, b), f"batch {i}"
    _equal_nested(got, want, "state")
    if scaler:
        assert second.scaler.state_dict() == whole.scaler.state_dict()
    assert second.scheduler.state_dict() == whole.scheduler.state_dict()
    if kind == "ddp" and dist.get_rank() == 0:
        ranks = torch.load(path, weights_only=True)["ranks"]
        assert len(ranks) == WORLD
        assert not torch.equal(ranks[0]["rng"]["host"]["torch"], ranks[1]["rng"]["host"]["torch"])


def _async_save_waits(out: str) -> None:
    from torch.distributed.checkpoint import FileSystemWriter

    import accel.state

    gate = threading.Event()

    class GatedWriter(FileSystemWriter):
        def write_data(self, plan, planner):
            assert gate.wait(60), "never released"
            return super().write_data(plan, planner)

    path = os.path.join(out, "fsdp_async")
    run = _Run("fsdp", 0, scaler=False)
    run.train()  # optimizer state to save
    want = run.full_state()[0]
    real_writer = accel.state._storage_writer
    accel.state._storage_writer = GatedWriter
    try:
        started = time.monotonic()
        accel.state.save_state(path, run.model, run.optimizer, step=2, async_save=True)
        assert time.monotonic() - started < 30
        assert not os.path.exists(os.path.join(path, "latest"))  # returned before the shards were written
        with torch.no_grad():
            for p in run.model.parameters():
                p.fill_(5.0)  # after the call: must not reach the checkpoint
        gate.set()
        fresh = _Run("fsdp", 3, scaler=False)
        assert accel.state.load_state(path, fresh.model, fresh.optimizer) == {"step": 2}  # waits, then reads
        assert os.path.exists(os.path.join(path, "latest"))
        _equal_nested(fresh.full_state()[0], want, "model")

        # A later save waits for a pending one, too; and the older version is removed once the new one is in.
        gate.clear()
        accel.state.save_state(path, fresh.model, fresh.optimizer, step=3, async_save=True)
        threading.Timer(1.0, gate.set).start()
        accel.state.save_state(path, fresh.model, fresh.optimizer, step=4)
        versions = sorted(n for n in os.listdir(path) if n.startswith("state-"))
        with open(os.path.join(path, "latest")) as f:
            assert versions == [f.read().strip()], versions
        assert accel.state.load_state(path, fresh.model) == {"step": 4}

        # A failed save names the path asked for on every rank, and leaves the previous checkpoint loadable.
        missing = os.path.join(out, "missing", "ckpt")
        try:
            accel.state.save_state(missing, fresh.model, fresh.optimizer)
        except (FileNotFoundError, RuntimeError) as exc:
            assert missing in str(exc), str(exc)
        else:
            raise AssertionError("no error for a missing parent directory")
        broken = threading.Event()

        class FailingWriter(FileSystemWriter):
            def write_data(self, plan, planner):
                broken.set()
                raise OSError("disk full")

        accel.state._storage_writer = FailingWriter
        try:
            accel.state.save_state(path, fresh.model, fresh.optimizer, step=5)
        except RuntimeError as exc:
            assert broken.is_set() and path in str(exc) and "disk full" in str(exc), str(exc)
        else:
            raise AssertionError("the failing write went unnoticed")
        accel.state._storage_writer = real_writer
        assert accel.state.load_state(path, fresh.model) == {"step": 4}
    finally:
        accel.state._storage_writer = real_writer


def _ddp_async(out: str) -> None:
    from accel.state import load_state, save_state, wait_for_save

    path = os.path.join(out, "ddp_async.pt")
    run = _Run("ddp", 0)
    want = {k: v.clone() for k, v in run.model.module.state_dict().items()}
    save_state(path, run.model, run.optimizer, async_save=True, step=1)
    with torch.no_grad():
        for p in run.model.parameters():
            p.add_(1.0)
    wait_for_save()
    fresh = _Run("ddp", 5)
    assert load_state(path, fresh.model, fresh.optimizer) == {"step": 1}
    _equal_nested(dict(fresh.model.module.state_dict()), want, "model")


SCENARIOS = {
    "ddp_resume": lambda out: _resume_matches("ddp", out),
    "ddp_async": _ddp_async,
    "fsdp_resume": lambda out: _resume_matches("fsdp", out),
    "fsdp_async": _async_save_waits,
}


def _worker(rank: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out, 'rendezvous')}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=120))
    try:
        for name, scenario in SCENARIOS.items():
            try:
                scenario(out)
                result = "ok"
            except Exception:  # noqa: BLE001 - reported by the test that reads it
                result = traceback.format_exc()
            with open(os.path.join(out, f"{name}.rank{rank}.txt"), "w") as f:
                f.write(result)
            dist.barrier()
        from accel.state import wait_for_save

        wait_for_save()
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("state_dist"))
    run_processes(_worker, (out,), WORLD, DEADLINE_S)
    return out


def _scenario(out: str, name: str) -> None:
    for rank in range(WORLD):
        with open(os.path.join(out, f"{name}.rank{rank}.txt")) as f:
            result = f.read()
        assert result == "ok", f"rank {rank}:\n{result}"


def test_ddp_resume_is_bit_identical(spawned):
    _scenario(spawned, "ddp_resume")


def test_ddp_async_save(spawned):
    _scenario(spawned, "ddp_async")


def test_fsdp_resume_at_the_same_world_size(spawned):
    _scenario(spawned, "fsdp_resume")


def test_fsdp_async_save_returns_before_writing_and_load_waits(spawned):
    _scenario(spawned, "fsdp_async")


def test_fsdp_checkpoint_loads_at_world_size_1(spawned):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from accel.state import load_state

    path = os.path.join(spawned, "fsdp_ckpt")
    assert sorted(os.listdir(path)) == ["latest", "state-000001"]
    shards = os.listdir(os.path.join(path, "state-000001"))
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "accel_state.pt"} <= set(shards)
    want_model, want_optimizer = torch.load(os.path.join(spawned, "fsdp_reference.pt"), weights_only=True)

    model = _model(42)  # plain, no process group
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    with pytest.raises(ValueError, match="^dataloader.*2 ranks"):
        load_state(path, model, optimizer, scheduler=scheduler, dataloader=_loader_plain())
    with pytest.warns(UserWarning, match="saved by 2 ranks"):
        extra = load_state(path, model, optimizer, scheduler=scheduler)
    assert extra == {"step": STOP_AT, "epoch": 1}
    got_model, got_optimizer = get_state_dict(model, optimizer)
    _equal_nested(dict(got_model), dict(want_model), "model")
    _equal_nested(got_optimizer, want_optimizer, "optimizer")
    assert scheduler.last_epoch == STOP_AT


def _loader_plain():
    from accel.data.resumable import ResumableLoader

    data = TensorDataset(torch.randn(SAMPLES, 4))
    return ResumableLoader(DataLoader(data, batch_size=PER_RANK_BATCH))
