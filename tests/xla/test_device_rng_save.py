"""xla_device/set_replication, the rng seed helpers, and save()."""
import os

import pytest
import torch

pytest.importorskip("torch_xla", reason="torch_xla is not installed")

import accel.xla as xm  # noqa: E402
from accel.xla import _save  # noqa: E402


def test_xla_device_and_replication():
    dev = xm.xla_device()
    assert dev.type == "xla"
    xm.set_replication(dev, [dev])
    assert xm.get_replication() == (dev, (dev,))
    with pytest.raises(ValueError, match="devices"):
        xm.set_replication(dev, dev)
    with pytest.raises(ValueError, match="devices must contain"):
        xm.set_replication(dev, [torch.device("cpu")])
    with pytest.raises(ValueError, match="n must be"):
        xm.xla_device(-1)


def test_same_seed_gives_same_init_and_same_xla_random_numbers():
    dev = xm.xla_device()

    def init_and_draw(seed):
        xm.set_rng_state(seed)
        model = torch.nn.Linear(5, 3).to(dev)
        noise = torch.rand(4, device=dev)
        return model.weight.detach().cpu(), noise.cpu()

    w1, n1 = init_and_draw(101)
    w2, n2 = init_and_draw(101)
    w3, n3 = init_and_draw(102)
    torch.testing.assert_close(w1, w2, rtol=0, atol=0)
    torch.testing.assert_close(n1, n2, rtol=0, atol=0)
    assert not torch.equal(w1, w3) and not torch.equal(n1, n3)
    torch.manual_seed(101)  # the torch half is exactly torch.manual_seed
    torch.testing.assert_close(torch.nn.Linear(5, 3).weight.detach(), w1, rtol=0, atol=0)


def test_get_rng_state_reports_the_seed_and_bad_seeds_are_rejected():
    xm.set_rng_state(4242)
    assert xm.get_rng_state() == 4242
    for bad in (-1, 1.5, True, "7"):
        with pytest.raises(ValueError, match="seed"):
            xm.set_rng_state(bad)
    with pytest.raises(ValueError, match="device"):
        xm.set_rng_state(1, device="cpu")


def test_save_moves_xla_tensors_to_cpu(tmp_path):
    dev = xm.xla_device()
    w = torch.arange(6.0).reshape(2, 3)
    path = tmp_path / "ckpt.pt"
    xm.save({"w": w.to(dev) * 2, "step": 3, "nested": [w.to(dev)]}, path)
    loaded = torch.load(path)
    assert loaded["step"] == 3
    assert loaded["w"].device.type == "cpu" and loaded["nested"][0].device.type == "cpu"
    torch.testing.assert_close(loaded["w"], w * 2)
    torch.testing.assert_close(loaded["nested"][0], w)
    assert os.listdir(tmp_path) == ["ckpt.pt"]  # no temporary file left behind


def test_only_the_master_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(_save, "is_master_ordinal", lambda local=True: False)
    xm.save({"x": 1}, tmp_path / "a.pt")
    assert not (tmp_path / "a.pt").exists()
    xm.save({"x": 1}, tmp_path / "b.pt", master_only=False)  # every worker writes
    assert torch.load(tmp_path / "b.pt") == {"x": 1}


def test_a_failed_save_leaves_the_old_file_intact(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    xm.save({"version": 1}, path)

    def broken_save(obj, f):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(_save.torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        xm.save({"version": 2}, path)
    monkeypatch.undo()
    assert torch.load(path) == {"version": 1}
    assert os.listdir(tmp_path) == ["ckpt.pt"]


def test_save_rejects_bad_paths(tmp_path):
    with pytest.raises(ValueError, match="path"):
        xm.save({}, 3)
    with pytest.raises(ValueError, match="path"):
        xm.save({}, tmp_path)


def test_save_writes_like_torch_save_would(tmp_path):
    """open()'s mode (not a private 0600 temp file), through a symlink, and errors naming the path asked for."""
    import stat

    old = os.umask(0o022)
    try:
        real, link = tmp_path / "real.pt", tmp_path / "ck.pt"
        real.write_bytes(b"")
        link.symlink_to(real)
        xm.save({"x": torch.ones(2)}, link)
        xm.save({"x": 1}, tmp_path / "fresh.pt")
    finally:
        os.umask(old)
    assert link.is_symlink()
    assert torch.equal(torch.load(real)["x"], torch.ones(2))
    assert stat.S_IMODE((tmp_path / "fresh.pt").stat().st_mode) == 0o644  # mkstemp alone would give 0600
    missing = tmp_path / "nope" / "ck.pt"
    with pytest.raises(FileNotFoundError) as info:
        xm.save({}, missing)
    assert info.value.filename == str(missing)


def test_a_backward_before_torch_xla_is_imported_is_named_at_the_device():
    """torch's autograd engine sizes its device queues at the process's first backward: one run before the XLA
    runtime started (importing torch_xla is not enough) leaves XLA none, and XLA backwards fail with an internal
    assert (pytorch/xla#4174). xla_device() says so, and what to do, instead."""
    import subprocess
    import sys

    from tests.xla._helpers import REPO

    script = ("import torch\n"
              "x = torch.ones(2, requires_grad=True); x.sum().backward()\n"
              "import torch_xla, accel.xla\n"
              "accel.xla.xla_device()\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": REPO, "PJRT_DEVICE": "CPU"})
    assert proc.returncode != 0
    assert "before the XLA device did" in proc.stderr and "pytorch/xla#4174" in proc.stderr, proc.stderr[-2000:]


def test_backward_on_the_device_after_its_check():
    dev = xm.xla_device()
    y = torch.arange(3.0, device=dev, requires_grad=True)
    (y * y).sum().backward()
    torch.testing.assert_close(y.grad.cpu(), torch.tensor([0.0, 2.0, 4.0]))
