"""Every CUDA source compiles with nvcc against the installed torch headers (no GPU needed)."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CU_FILES = sorted((ROOT / "csrc").rglob("*.cu"))
HAVE_NVCC = shutil.which("nvcc") is not None or os.path.exists("/usr/local/cuda/bin/nvcc")


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_NVCC and not os.environ.get("CI"),
                    reason="nvcc is not installed on this machine (CI has it and runs this test)")
@pytest.mark.skipif(torch.version.cuda is None,
                    reason="this torch is a CPU-only build: its ATen/cuda headers include the CUDA libraries' "
                           "headers (cusparse.h, ...), which come with torch's CUDA builds only")
@pytest.mark.parametrize("cu", CU_FILES, ids=[p.name for p in CU_FILES])
def test_cuda_source_compiles(cu):
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "check_cuda_compiles.py"), "-j", "1", str(cu)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"nvcc failed on {cu.name}:\n{proc.stdout}\n{proc.stderr}"


# host_memory is accel's allocator of CPU memory (accel.runtime.host_memory): nothing of it runs on a GPU.
HOST_ONLY = {"host_memory"}


def test_every_cpu_op_has_a_cuda_source():
    cpu = {p.stem for p in (ROOT / "csrc" / "cpu").glob("*.cpp")} - HOST_ONLY
    cuda = {p.stem for p in (ROOT / "csrc" / "cuda").glob("*.cu")}
    assert cpu == cuda, f"ops without a CUDA source: {sorted(cpu - cuda)}; without a CPU source: {sorted(cuda - cpu)}"
