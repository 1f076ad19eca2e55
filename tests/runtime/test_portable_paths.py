"""The portable (non-AVX-512) loops of the CPU kernels, on any machine.

fmha, bias_dropout_add and fused_adam pick AVX-512 code at run time when the CPU has it, so on such a
machine (CI's included) the other loops would go untested. ATEN_CPU_CAPABILITY=avx2, torch's own switch,
makes accel's kernels (csrc/cpu/vec_math.h: avx512_enabled) take the portable loops; the same tests then
run again in a subprocess against the same references. torch.compile cases are left out: Inductor's
cache does not key on that variable.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FILES = ["test_fmha.py", "test_bias_dropout_add.py", "test_fused_adam.py"]


@pytest.mark.slow
def test_kernel_tests_pass_on_the_portable_loops(tmp_path):
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
           "-k", "not compile and not fullgraph and not cuda",
           *[str(ROOT / "tests" / "runtime" / f) for f in FILES]]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert " passed" in proc.stdout
