"""The kernel accel.runtime.nn.varlen_attention.flash_varlen_attention calls, for tests on any machine.

On the CPU torch's FlashAttention varlen kernel does not exist: `varlen_kernel` puts its plain reference
(reference_varlen_attn) in its place and lets fp32/fp64 through, so what accel hands the kernel (offsets,
causality, windows, grouped heads) and makes of its output is checked exactly. On a GPU that has the kernel it is
torch's own; elsewhere the test is skipped. Either way each call is recorded as (args, kwargs).
"""
import pytest
import torch

NO_CUDA_VARLEN = "needs a CUDA GPU of compute capability 8.0+ and torch 2.10+ (torch.nn.attention.varlen)"


def varlen_kernel(monkeypatch, device: str = "cpu") -> list:
    import accel.runtime.nn.varlen_attention as va

    if device == "cpu":
        kernel = va.reference_varlen_attn
        monkeypatch.setattr(va, "flash_varlen_runs_on", lambda device: True)
        monkeypatch.setattr(va, "_FLASH_DTYPES", va._FLASH_DTYPES + (torch.float32, torch.float64))
    elif not va.flash_varlen_runs_on(torch.device(device)):
        pytest.skip(NO_CUDA_VARLEN)
    else:
        kernel = va.torch_varlen
    calls = []

    def recorded(*args, **kwargs):
        calls.append((args, kwargs))
        return kernel(*args, **kwargs)

    monkeypatch.setattr(va, "torch_varlen", recorded)
    return calls
