"""accel.save_state / accel.load_state in one process: resuming is bit-identical, the file behaves like
torch.save's, and bad input gets errors naming the argument."""
from __future__ import annotations

import os
import random
import stat
import subprocess
import sys
import threading
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

import accel.state
from accel.data.resumable import ResumableLoader
from accel.state import load_state, save_state, wait_for_save

N_SAMPLES, BATCH, EPOCHS = 24, 4, 2
STEPS_PER_EPOCH = N_SAMPLES // BATCH


class _Indexed(Dataset):
    """(x, y, index) samples; records which indices were read."""

    def __init__(self):
        gen = torch.Generator().manual_seed(1)
        self.x = torch.randn(N_SAMPLES, 4, generator=gen)
        self.y = torch.randn(N_SAMPLES, 1, generator=gen)
        self.reads: list[int] = []

    def __len__(self):
        return N_SAMPLES

    def __getitem__(self, i):
        self.reads.append(int(i))
        return self.x[i], self.y[i], torch.tensor(i)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.3), nn.Linear(8, 1))


def _loader(kind: str, dataset=None) -> ResumableLoader:
    dataset = _Indexed() if dataset is None else dataset
    if kind == "shuffle":
        inner = DataLoader(dataset, batch_size=BATCH, shuffle=True)
    elif kind == "workers":
        inner = DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=2)
    elif kind == "persistent":
        inner = DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=2, persistent_workers=True)
    elif kind == "generator":
        inner = DataLoader(dataset, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(7))
    elif kind == "distributed":  # rank 0 of 2, no process group needed when both are given
        sampler = DistributedSampler(dataset, num_replicas=2, rank=0, shuffle=True, seed=3)
        inner = DataLoader(dataset, batch_size=BATCH // 2, sampler=sampler)
    else:
        raise AssertionError(kind)
    return ResumableLoader(inner)


class _Run:
    """Model, AdamW, LR schedule, GradScaler and loader, built the same way in every 'process'."""

    def __init__(self, kind: str, seed: int = 0):
        self.model = _model(seed)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=3, gamma=0.5)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=16.0, growth_interval=2)
        self.loader = _loader(kind)
        self.batches: list[torch.Tensor] = []

    def objects(self):
        return self.model, self.optimizer, self.scaler, self.scheduler, self.loader

    def train(self, start_epoch: int = 0, step: int = 0, stop_at: int | None = None, path=None,
              save_after_epoch: bool = False) -> None:
        for epoch in range(start_epoch, EPOCHS):
            self.loader.set_epoch(epoch)
            for x, y, index in self.loader:
                self.batches.append(index)
                loss = (self.model(x) - y).pow(2).mean()
                self.scaler.scale(loss).backward()
                self.scaler.step(self.optimizer)
                self.scaler.update()
                self.scheduler.step()
                self.optimizer.zero_grad()
                step += 1
                if step == stop_at and not save_after_epoch:
                    save_state(path, *self.objects(), step=step, epoch=epoch)
                    return
            if step == stop_at and save_after_epoch:
                save_state(path, *self.objects(), step=step, epoch=epoch + 1)
                return


def _scramble_rngs() -> None:
    torch.manual_seed(12345)
    random.seed(12345)
    np.random.seed(12345)


def _assert_same_training_state(a: _Run, b: _Run) -> None:
    for (name, p), q in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.equal(p, q), name
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for key in sa["state"]:
        for field, value in sa["state"][key].items():
            assert torch.equal(value, sb["state"][key][field]), (key, field)
    assert a.scheduler.state_dict() == b.scheduler.state_dict()
    assert a.scaler.state_dict() == b.scaler.state_dict()


@pytest.mark.parametrize("kind,stop_at,after_epoch", [
    ("shuffle", 3, False),                       # mid-epoch 0
    ("shuffle", STEPS_PER_EPOCH + 2, False),     # mid-epoch 1
    ("shuffle", STEPS_PER_EPOCH, False),         # last batch of epoch 0, saved inside the loop
    ("shuffle", STEPS_PER_EPOCH, True),          # epoch boundary, saved after the loop
    ("generator", 4, False),                     # the loader's own torch.Generator
    ("distributed", 7, False),                   # order from seed + epoch, set_epoch forwarded
    ("workers", STEPS_PER_EPOCH + 1, False),     # num_workers=2: bit-identical for a dataset without RNG
    ("persistent", STEPS_PER_EPOCH + 1, False),  # the saved pass reused workers started in epoch 0
    ("persistent", 2, False),                    # the saved pass started them; the next pass reuses them
])
def test_resume_is_bit_identical(tmp_path, kind, stop_at, after_epoch):
    path = tmp_path / "ckpt.pt"
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    whole = _Run(kind)
    whole.train()

    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    first = _Run(kind)
    first.train(stop_at=stop_at, path=path, save_after_epoch=after_epoch)

    _scramble_rngs()
    second = _Run(kind, seed=99)  # other weights: everything must come from the checkpoint
    extra = load_state(path, *second.objects())
    assert extra["step"] == stop_at
    second.train(start_epoch=extra["epoch"], step=extra["step"])

    assert len(first.batches) + len(second.batches) == len(whole.batches)
    for i, (got, want) in enumerate(zip(first.batches + second.batches, whole.batches)):
        assert torch.equal(got, want), f"batch {i}"
    _assert_same_training_state(whole, second)


def test_skipped_batches_are_not_read(tmp_path):
    path = tmp_path / "ckpt.pt"
    run = _Run("shuffle")
    run.train(stop_at=4, path=path)
    dataset = _Indexed()
    loader = ResumableLoader(DataLoader(dataset, batch_size=BATCH, shuffle=True))
    load_state(path, _model(), dataloader=loader)
    assert loader.epoch == 0 and loader.position == 4
    seen = [int(i) for _, _, idx in loader for i in idx]
    assert len(seen) == N_SAMPLES - 4 * BATCH
    assert dataset.reads == seen  # only the rest of the pass was read
    assert loader.position == STEPS_PER_EPOCH


def test_read_ahead_wrappers_count_what_the_loop_takes(tmp_path):
    from accel.data.device_loader import MpDeviceLoader

    def build():
        resumable = _loader("shuffle")
        return resumable, resumable.counting(MpDeviceLoader(resumable, "cpu"))

    torch.manual_seed(0)
    resumable, loader = build()
    whole = [idx for _, _, idx in loader]

    torch.manual_seed(0)
    resumable, loader = build()
    taken = []
    for _, _, idx in loader:
        taken.append(idx)
        if len(taken) == 2:
            break
    assert resumable.position == 2  # the device loader has read further ahead
    save_state(tmp_path / "ckpt.pt", _model(), dataloader=loader)

    _scramble_rngs()
    resumable, loader = build()
    load_state(tmp_path / "ckpt.pt", _model(), dataloader=loader)
    rest = [idx for _, _, idx in loader]
    assert all(torch.equal(a, b) for a, b in zip(taken + rest, whole)) and len(taken + rest) == len(whole)


def test_loader_found_through_prefetcher(tmp_path):
    from accel.runtime.io.prefetcher import Prefetcher

    resumable = _loader("shuffle")
    wrapped = resumable.counting(Prefetcher(resumable, device="cpu"))
    save_state(tmp_path / "ckpt.pt", _model(), dataloader=wrapped)
    payload = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert payload["ranks"][0]["dataloader"]["kind"] == "ResumableLoader"


def test_bucketing_loader_resumes(tmp_path):
    from accel.data.bucketing import BucketingLoader

    samples = [{"input_ids": torch.arange(1 + i % 7)} for i in range(20)]

    def build():
        return ResumableLoader(BucketingLoader(samples, batch_size=3, buckets=(4, 8), seed=5))

    loader = build()
    loader.set_epoch(1)
    whole = [b["input_ids"] for b in loader]
    loader = build()
    loader.set_epoch(1)
    it = iter(loader)
    head = [next(it)["input_ids"] for _ in range(3)]
    save_state(tmp_path / "ckpt.pt", _model(), dataloader=loader)
    loader = build()
    load_state(tmp_path / "ckpt.pt", _model(), dataloader=loader)  # restores and forwards epoch 1
    rest = [b["input_ids"] for b in loader]
    assert len(head + rest) == len(whole)
    assert all(torch.equal(a, b) for a, b in zip(head + rest, whole))


def test_rng_states_are_restored(tmp_path):
    path = tmp_path / "ckpt.pt"
    save_state(path, _model())
    want = (random.random(), np.random.rand(), torch.rand(3))
    xla = "torch_xla" in sys.modules
    if xla:
        import accel.xla

        want_xla = accel.xla.get_rng_state()
    _scramble_rngs()
    load_state(path, _model())
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == want[0] and got[1] == want[1] and torch.equal(got[2], want[2])
    rng = torch.load(path, weights_only=True)["ranks"][0]["rng"]
    assert ("xla" in rng) == xla
    if xla:
        assert accel.xla.get_rng_state() == want_xla


@pytest.mark.slow
def test_save_does_not_import_torch_xla(tmp_path):
    code = ("import sys, torch, accel.state; accel.state.save_state(sys.argv[1], torch.nn.Linear(2, 2)); "
            "assert 'torch_xla' not in sys.modules, 'imported'")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "c.pt")], check=True, timeout=120)


@pytest.mark.parametrize("scaler_cls", ["torch", "accel"])
def test_scaler_and_scheduler_round_trip(tmp_path, scaler_cls):
    from accel.amp import GradScaler as AccelGradScaler

    def scaler():
        if scaler_cls == "torch":
            return torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=3)
        return AccelGradScaler(init_scale=8.0, growth_interval=3)

    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    s = scaler()
    s.load_state_dict({"scale": 2.0, "growth_factor": 3.0, "backoff_factor": 0.25, "growth_interval": 5,
                       "_growth_tracker": 2})
    for _ in range(3):
        optimizer.step()
        sched.step()
    save_state(tmp_path / "c.pt", model, optimizer, s, sched)
    s2 = scaler()
    optimizer2 = torch.optim.SGD(model.parameters(), lr=0.1)
    sched2 = torch.optim.lr_scheduler.LambdaLR(optimizer2, lambda s: 1.0 / (1 + s))
    load_state(tmp_path / "c.pt", model, optimizer2, s2, sched2)
    assert s2.state_dict() == s.state_dict()
    assert sched2.last_epoch == 3 and optimizer2.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]


# ---------------------------------------------------------------- the file
def test_file_mode_matches_torch_save(tmp_path):
    old = os.umask(0o027)
    try:
        torch.save({}, tmp_path / "plain.pt")
        save_state(tmp_path / "ckpt.pt", _model())
    finally:
        os.umask(old)
    mode = stat.S_IMODE(os.stat(tmp_path / "ckpt.pt").st_mode)
    assert mode == stat.S_IMODE(os.stat(tmp_path / "plain.pt").st_mode) == 0o640


def test_writes_through_a_symlink(tmp_path):
    target = tmp_path / "real.pt"
    target.write_bytes(b"old")
    link = tmp_path / "link.pt"
    link.symlink_to(target)
    save_state(link, _model(), step=5)
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert load_state(link, _model()) == {"step": 5}
    assert torch.load(target, weights_only=True)["extra"] == {"step": 5}


def test_missing_directory_error_names_the_path(tmp_path):
    path = tmp_path / "no" / "ckpt.pt"
    with pytest.raises(FileNotFoundError) as info:
        save_state(path, _model())
    assert str(path) in str(info.value) and ".tmp" not in str(info.value)


def test_failed_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    save_state(path, _model(), step=1)
    before = path.read_bytes()
    with pytest.raises(TypeError, match=r"extra\['fn'\]"):
        save_state(path, _model(), fn=lambda: 0)

    def broken_fsync(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="disk full"):
        save_state(path, _model(), step=2)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]  # no temporary file left


def test_weights_only_load_and_plain_keys(tmp_path):
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    save_state(tmp_path / "c.pt", model, optimizer, step=torch.tensor(3), note="x")
    payload = torch.load(tmp_path / "c.pt", weights_only=True)
    assert list(payload["model"]) == list(model.state_dict())
    assert payload["extra"]["note"] == "x" and torch.equal(payload["extra"]["step"], torch.tensor(3))
    fresh = torch.optim.AdamW(model.parameters())
    fresh.load_state_dict(payload["optimizer"])  # plain torch can use it too


@pytest.mark.parametrize("wrapper", ["compile", "autocast", "both"])
def test_plain_model_loads_a_wrapped_models_checkpoint(tmp_path, wrapper):
    from accel.accelerate import _AutocastForward

    model = _model(seed=3)
    wrapped = model
    if wrapper in ("autocast", "both"):
        object.__setattr__(model, "forward", _AutocastForward(model, "cpu", torch.bfloat16))
    if wrapper in ("compile", "both"):
        wrapped = torch.compile(model)  # never called: only its state_dict keys matter
    save_state(tmp_path / "c.pt", wrapped)
    plain = _model(seed=4)
    load_state(tmp_path / "c.pt", plain)
    for p, q in zip(plain.state_dict().values(), model.state_dict().values()):
        assert torch.equal(p, q)
    reloaded = _model(seed=5)
    reloaded.load_state_dict(torch.load(tmp_path / "c.pt", weights_only=True)["model"])


def test_async_save_returns_before_writing(tmp_path, monkeypatch):
    path = tmp_path / "c.pt"
    release = threading.Event()
    real = accel.state.atomic_write

    def slow_atomic_write(*args, **kwargs):
        assert release.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(accel.state, "atomic_write", slow_atomic_write)
    model = _model()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    save_state(path, model, async_save=True, step=1)
    assert not path.exists()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)  # after the call: must not reach the checkpoint
    release.set()
    fresh = _model(seed=8)
    assert load_state(path, fresh) == {"step": 1}  # waits for the write
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, want[key])
    wait_for_save()  # nothing pending: returns at once


# ---------------------------------------------------------------- bad input
def test_argument_errors(tmp_path):
    path = tmp_path / "c.pt"
    model = _model()
    with pytest.raises(TypeError, match="^path"):
        save_state(123, model)
    with pytest.raises(TypeError, match="^model"):
        save_state(path, "model")
    with pytest.raises(TypeError, match="^optimizer"):
        save_state(path, model, optimizer=object())
    with pytest.raises(TypeError, match="^scheduler"):
        save_state(path, model, scheduler=3)
    with pytest.raises(TypeError, match="^async_save"):
        save_state(path, model, async_save="yes")
    with pytest.raises(TypeError, match="ResumableLoader"):
        save_state(path, model, dataloader=DataLoader(_Indexed(), batch_size=2))
    with pytest.raises(TypeError, match="^dataloader"):
        save_state(path, model, dataloader=[1, 2])
    with pytest.raises(ValueError, match="^path.*directory"):
        save_state(tmp_path, model)
    assert not path.exists()

    with pytest.raises(FileNotFoundError) as info:
        load_state(path, model)
    assert str(path) in str(info.value)
    save_state(path, model)
    with pytest.raises(ValueError, match="^scheduler"):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        load_state(path, model, scheduler=torch.optim.lr_scheduler.StepLR(opt, 1))
    with pytest.raises(ValueError, match="^dataloader"):
        load_state(path, model, dataloader=_loader("shuffle"))
    other = tmp_path / "other.pt"
    torch.save({"a": 1}, other)
    with pytest.raises(ValueError, match="not a checkpoint written by accel.save_state"):
        load_state(other, model)
    other.write_bytes(b"garbage")
    with pytest.raises(RuntimeError, match=str(other)):
        load_state(other, model)


def test_resumable_loader_errors_and_epoch():
    with pytest.raises(TypeError, match="^loader"):
        ResumableLoader([1, 2, 3])

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(4))

    with pytest.raises(TypeError, match="IterableDataset"):
        ResumableLoader(DataLoader(Stream()))
    loader = _loader("distributed")
    with pytest.raises(TypeError, match="^epoch"):
        loader.set_epoch(1.0)
    with pytest.raises(ValueError, match="^epoch"):
        loader.set_epoch(-1)
    loader.set_epoch(4)
    assert loader.sampler.epoch == 4 and loader.epoch == 4
    with pytest.raises(TypeError, match="^state_dict"):
        loader.load_state_dict([])
    with pytest.raises(ValueError, match="^state_dict"):
        loader.load_state_dict({"epoch": 1})
    state = loader.state_dict()
    short = ResumableLoader(DataLoader(_Indexed(), batch_size=BATCH * 2, shuffle=True))
    with pytest.raises(ValueError, match="batches per pass"):
        short.load_state_dict(dict(state, num_batches=2))


def test_wrap_for_accelerate():
    loader = _loader("shuffle")
    assert ResumableLoader.wrap(loader) is loader
    assert isinstance(ResumableLoader.wrap(loader.loader), ResumableLoader)
    assert ResumableLoader.wrap([1, 2]) is None

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(4))

    stream = DataLoader(Stream())
    assert ResumableLoader.wrap(stream) is None
    with pytest.raises(TypeError, match="StatefulDataLoader"):
        save_state("unused.pt", _model(), dataloader=stream)


def test_set_epoch_to_another_epoch_drops_the_position():
    loader = _loader("shuffle")
    loader.set_epoch(2)
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    fresh = _loader("shuffle")
    fresh.load_state_dict(state)
    assert fresh.position == 2 and fresh.epoch == 2
    with pytest.warns(UserWarning, match="dropped"):
        fresh.set_epoch(3)
    assert len(list(fresh)) == STEPS_PER_EPOCH
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = _loader("shuffle")
        again.load_state_dict(state)
        again.set_epoch(2)  # the same epoch: keeps the position
        assert len(list(again)) == STEPS_PER_EPOCH - 2


def _noisy_collate(samples):
    """default_collate plus noise from torch's generator: random augmentation in a main-process collate_fn."""
    x, y, index = torch.utils.data.default_collate(samples)
    return x + 0.1 * torch.randn(x.shape), y, index


def _accelerated(seed: int = 0, collate_fn=None):
    import accel

    config = accel.Config(backend="cpu")
    config.compute.compile = False
    loader = DataLoader(_Indexed(), batch_size=BATCH, shuffle=True, collate_fn=collate_fn)
    model, loader = accel.accelerate(_model(seed), loader, config)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), loader


def _train_accelerated(model, optimizer, loader, steps, path=None, epochs=EPOCHS):
    seen, step = [], 0
    for _ in range(epochs):  # no set_epoch: the loader counts its epochs itself
        for x, y, index in loader:
            seen.append(index)
            (model(x) - y).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step == steps:  # saved after the step that used the batch
                save_state(path, model, optimizer, dataloader=loader)
                return seen
    return seen


@pytest.mark.parametrize("collate_fn", [None, _noisy_collate], ids=["plain", "random_collate"])
@pytest.mark.parametrize("stop_at", [3, STEPS_PER_EPOCH, STEPS_PER_EPOCH + 2])
def test_accelerate_loader_resumes_without_set_epoch_calls(tmp_path, stop_at, collate_fn):
    # The loader accelerate() returns is resumable as it is, and numbers its epochs itself; a collate_fn that
    # draws from torch's generator (which the model's dropout draws from too) resumes exactly as well.
    torch.manual_seed(0)
    model, optimizer, loader = _accelerated(collate_fn=collate_fn)
    whole = _train_accelerated(model, optimizer, loader, steps=None)
    torch.manual_seed(0)
    a_model, a_optimizer, a_loader = _accelerated(collate_fn=collate_fn)
    head = _train_accelerated(a_model, a_optimizer, a_loader, steps=stop_at, path=tmp_path / "ckpt.pt")
    _scramble_rngs()
    b_model, b_optimizer, b_loader = _accelerated(seed=1, collate_fn=collate_fn)
    load_state(tmp_path / "ckpt.pt", b_model, b_optimizer, dataloader=b_loader)
    # the rest of the interrupted pass (empty when it stopped at its last batch), then the epochs after it
    interrupted = (stop_at - 1) // STEPS_PER_EPOCH
    rest = _train_accelerated(b_model, b_optimizer, b_loader, steps=None, epochs=EPOCHS - interrupted)
    assert len(head + rest) == len(whole) and all(torch.equal(a, b) for a, b in zip(head + rest, whole))
    for p, q in zip(model.parameters(), b_model.parameters()):
        assert torch.equal(p, q)


def test_passes_without_set_epoch_count_epochs():
    loader = _loader("distributed")
    orders = [[int(i) for _, _, idx in loader for i in idx] for _ in range(3)]
    assert loader.epoch == 2 and orders[0] != orders[1] != orders[2]
    fresh = _loader("distributed")
    fresh.set_epoch(1)
    assert [int(i) for _, _, idx in fresh for i in idx] == orders[1]


def _masking_collate(samples):
    """Masked-LM batches masked at random from torch's generator, as transformers' DataCollatorForLanguageModeling
    does in the main process (num_workers=0)."""
    ids = torch.stack(samples)
    masked = torch.bernoulli(torch.full(ids.shape, 0.15)).bool()
    return {"input_ids": ids.masked_fill(masked, 3), "attention_mask": torch.ones_like(ids),
            "labels": ids.masked_fill(~masked, -100)}


@pytest.mark.slow
def test_compiled_masked_lm_resumes_bit_identically(tmp_path):
    # accelerate()'s whole CPU path (compiled graphs drawing dropout masks with accel's op, the loader reading
    # a randomly masking collate_fn) stopped mid-epoch and resumed equals the uninterrupted run, loss by loss.
    # Under torch.use_deterministic_algorithms: without it Inductor's CPU kernels add an embedding's gradient
    # rows in thread order, and two uninterrupted same-seed runs (plain torch.compile too) differ in the last bits.
    from transformers import BertConfig, BertForMaskedLM

    import accel

    config = BertConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64)
    samples = [torch.randint(5, 300, (16,), generator=torch.Generator().manual_seed(i)) for i in range(24)]

    def build(seed):
        torch.manual_seed(seed)
        loader = DataLoader(samples, batch_size=4, shuffle=True, collate_fn=_masking_collate)
        model, loader = accel.accelerate(BertForMaskedLM(config), loader, accel.Config(backend="cpu"))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3), loader

    def train(model, optimizer, loader, epochs, stop_at=None):
        losses = []
        for _ in range(epochs):
            for batch in loader:
                loss = model(**batch).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss.item())
                if len(losses) == stop_at:
                    save_state(tmp_path / "ckpt.pt", model, optimizer, dataloader=loader)
                    return losses
        return losses

    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        model, optimizer, loader = build(0)
        whole = train(model, optimizer, loader, epochs=2)
        head = train(*build(0), epochs=2, stop_at=4)  # mid-epoch 0 (6 batches a pass)
        _scramble_rngs()
        b_model, b_optimizer, b_loader = build(1)
        load_state(tmp_path / "ckpt.pt", b_model, b_optimizer, dataloader=b_loader)
        rest = train(b_model, b_optimizer, b_loader, epochs=2)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    assert head + rest == whole and len(whole) == 12
    for p, q in zip(model.parameters(), b_model.parameters()):
        assert torch.equal(p, q)
