"""accel.utils.threads_at_exit: a script that ends while a device loader's thread is inside a torch call exits
cleanly (it used to abort with status 134, "terminate called without an active exception")."""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Each batch is a matmul that runs without the GIL for a while, so the reading thread is inside one when the
# main thread ends (the abort happened every time with this loader before the fix).
SCRIPT = textwrap.dedent("""
    import sys
    import torch
    sys.path.insert(0, {root!r})

    class Slow:
        def __iter__(self):
            while True:
                a = torch.ones(1500, 1500)
                yield {{"x": a @ a}}

    if {kind!r} == "Prefetcher":
        from accel.runtime.io.prefetcher import Prefetcher
        passes = iter(Prefetcher(Slow(), device="cpu", background=True))
    else:
        from accel.data.device_loader import MpDeviceLoader
        passes = iter(MpDeviceLoader(Slow(), torch.device("cpu")))
    next(passes)
    batch = next(passes)  # the first two are read in this thread; the thread starts on the third
    print("read", tuple(batch["x"].shape), float(batch["x"][0, 0]))
""")


@pytest.mark.parametrize("kind", ["Prefetcher", "MpDeviceLoader"])
def test_a_script_ending_mid_read_exits_cleanly(kind):
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(root=str(ROOT), kind=kind)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["read", "(1500,", "1500)", "1500.0"]
    assert "terminate called" not in done.stderr
