"""Shared parameters for kernel tests: the devices with kernels, and per-dtype tolerances."""
import pytest
import torch

NO_CUDA = "CUDA kernels need a CUDA device; this machine has none (they are compile-checked by tests/test_cuda_compiles.py)"

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)),
]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# (rtol, atol) against an fp32-computed reference rounded to the dtype: one or two ulps of the output.
TOL = {
    torch.float64: (1e-12, 1e-12),
    torch.float32: (1e-5, 1e-6),
    torch.float16: (2e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
}


def tol(dtype):
    rtol, atol = TOL[dtype]
    return {"rtol": rtol, "atol": atol}
