"""The portable (non-AVX-512) loops of the CPU kernels, on any machine.

fmha, bias_dropout_add and fused_adam pick AVX-512 code at run time when the CPU has it, so on such a
machine (CI's included) the other loops would go untested. ATEN_CPU_CAPABILITY=avx2, torch's own switch,
makes accel's kernels (csrc/cpu/vec_math.h: avx512_enabled) take the portable loops; the same tests then
run again in a subprocess against the same references. torch.compile cases are left out: Inductor's
cache does not key on that variable. The random keep masks are integer arithmetic, so the two paths must
also draw the same bits: a seed gives the same dropout on every x86 machine.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
FILES = ["test_fmha.py", "test_bias_dropout_add.py", "test_philox_dropout.py", "test_fused_adam.py"]


@pytest.mark.slow
def test_kernel_tests_pass_on_the_portable_loops(tmp_path):
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
           "-k", "not compile and not fullgraph and not cuda",
           *[str(ROOT / "tests" / "runtime" / f) for f in FILES]]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert " passed" in proc.stdout


# Draws masks of sizes around the 64-element chunk and the parallel grain, after fixed seeds, and saves them.
DRAW = """
import sys, torch
from accel.runtime.nn.bias_dropout_add import _ops, bias_dropout_add
out = {}
for seed, n, p in [(0, 1, 0.5), (1, 63, 0.1), (2, 64, 0.5), (3, 65, 0.9), (4, 100_003, 0.3)]:
    torch.manual_seed(seed)
    out["mask", seed] = _ops().dropout_mask([n], p, device=torch.device("cpu"))
    torch.manual_seed(seed)
    x = torch.ones(n, 3)
    out["bias_dropout_add", seed] = bias_dropout_add(x, torch.zeros(3), torch.zeros_like(x), p, True) != 0
torch.save(out, sys.argv[1])
"""


def test_portable_loops_draw_the_same_masks_as_the_avx512_ones(tmp_path):
    """The "native" process takes the AVX-512 loops where the CPU has them, the "portable" one the portable
    loops. On a CPU without AVX-512 both take the portable loops and agree trivially."""
    masks = {}
    for name, cap in (("portable", "avx2"), ("native", None)):
        env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
        if cap is not None:
            env["ATEN_CPU_CAPABILITY"] = cap
        path = tmp_path / f"{name}.pt"
        proc = subprocess.run([sys.executable, "-c", DRAW, str(path)], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        masks[name] = torch.load(path)
    assert masks["portable"].keys() == masks["native"].keys()
    for key, mask in masks["native"].items():
        assert mask.any() and not mask.all() or mask.numel() < 64, key  # a real draw, not a fill
        assert torch.equal(mask, masks["portable"][key]), key
