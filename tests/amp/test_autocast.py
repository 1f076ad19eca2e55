"""accel.amp.autocast: default device/dtype rule and bf16 compute, against torch.autocast."""
from __future__ import annotations

import pytest
import torch

import accel.amp.autocast_mode as autocast_mode
from accel.amp import autocast

from ._xla import requires_xla, sync, xla_device


def test_default_device_rule(monkeypatch):
    monkeypatch.setattr(autocast_mode, "xla_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    assert autocast_mode.default_device_type() == "xla"
    monkeypatch.delenv("PJRT_DEVICE")
    assert autocast_mode.default_device_type() == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert autocast_mode.default_device_type() == "cpu"
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.setattr(autocast_mode, "xla_available", lambda: False)
    assert autocast_mode.default_device_type() == "cpu"


def test_default_dtypes():
    assert autocast_mode.default_dtype("xla") is torch.bfloat16
    assert autocast_mode.default_dtype("cpu") is torch.bfloat16
    assert autocast_mode.default_dtype("cuda") is torch.float16


def test_no_arguments_on_cpu_is_bf16(monkeypatch):
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ctx = autocast()
    assert (ctx.device, ctx.fast_dtype) == ("cpu", torch.bfloat16)


def test_explicit_arguments_are_kept():
    assert autocast("cuda", dtype=torch.bfloat16, enabled=False).fast_dtype is torch.bfloat16
    assert autocast("cuda").fast_dtype is torch.float16
    assert autocast(torch.device("cpu"), dtype=torch.float16).fast_dtype is torch.float16
    assert autocast("cuda:0").device == "cuda"


def test_bf16_matmul_under_cpu_autocast_matches_manual_cast():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, 32, generator=g), torch.randn(32, 8, generator=g)
    with autocast("cpu"):
        assert torch.is_autocast_enabled("cpu")
        out = a @ b
        summed = out.float().sum()  # reductions of fp32 tensors stay fp32
    assert not torch.is_autocast_enabled("cpu")
    assert out.dtype is torch.bfloat16
    assert summed.dtype is torch.float32
    assert torch.equal(out, a.bfloat16() @ b.bfloat16())


def test_decorator_and_disabled():
    @autocast("cpu")
    def matmul(a, b):
        return a @ b

    a = torch.ones(4, 4)
    assert matmul(a, a).dtype is torch.bfloat16
    with autocast("cpu", enabled=False):
        assert (a @ a).dtype is torch.float32
    with autocast("cpu"):
        with autocast("cpu", enabled=False):  # nested disable, as with torch.autocast
            assert (a @ a).dtype is torch.float32
        assert (a @ a).dtype is torch.bfloat16


@pytest.mark.parametrize(
    "kwargs,argname",
    [
        (dict(device_type="not-a-device"), "device_type"),
        (dict(device_type=3), "device_type"),
        (dict(device_type="meta"), "device_type"),
        (dict(device_type="cpu", dtype="bf16"), "dtype"),
        (dict(device_type="cpu", enabled=1), "enabled"),
    ],
)
def test_bad_arguments(kwargs, argname):
    with pytest.raises(ValueError, match=argname):
        autocast(**kwargs)


@requires_xla
def test_xla_default_is_bf16_and_casts_matmuls():
    ctx = autocast()
    assert (ctx.device, ctx.fast_dtype) == ("xla", torch.bfloat16)
    device = xla_device()
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(8, 16, generator=g), torch.randn(16, 4, generator=g)
    with autocast():
        out = a.to(device) @ b.to(device)
    sync()
    assert out.dtype is torch.bfloat16
    expected = (a.bfloat16().float() @ b.bfloat16().float()).bfloat16()
    torch.testing.assert_close(out.cpu(), expected, atol=0, rtol=1e-2)


def test_no_arguments_warns_once_on_a_cpu_without_native_bf16(monkeypatch):
    import warnings

    import accel.utils.cpu as cpu

    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(autocast_mode, "native_bf16", lambda: False)
    monkeypatch.setattr(cpu, "_warned", set())
    with pytest.warns(RuntimeWarning, match="no native bf16"):
        autocast()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        autocast()                                   # once only
        autocast("cpu", dtype=torch.bfloat16)        # an explicit dtype is the user's choice: no warning
    monkeypatch.setattr(cpu, "_warned", set())
    monkeypatch.setattr(autocast_mode, "native_bf16", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        autocast()                                   # native bf16: nothing to say


def test_native_bf16_and_fp16_follow_the_cpu_flags(monkeypatch):
    import accel.utils.cpu as cpu

    monkeypatch.setattr(cpu, "_torch_probes", lambda names: None)   # fall back to /proc/cpuinfo
    cpu.native_bf16.cache_clear()
    cpu.native_fp16.cache_clear()
    try:
        try:
            with open("/proc/cpuinfo") as f:
                flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
        except OSError:
            flags = []
        assert cpu.native_bf16() is ("avx512_bf16" in flags or "amx_bf16" in flags)
        assert cpu.native_fp16() is ("avx512_fp16" in flags or "amx_fp16" in flags)
        assert cpu.native("bf16") is cpu.native_bf16() and cpu.native("fp16") is cpu.native_fp16()
    finally:
        cpu.native_bf16.cache_clear()
        cpu.native_fp16.cache_clear()


@pytest.mark.parametrize("form", ["with", "decorator"])
def test_traced_into_a_compiled_graph_without_a_break(form):
    """autocast inside torch.compile(fullgraph=True): Dynamo traces the region (a graph break would raise)."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 16, generator=g), torch.randn(16, 4, generator=g)

    if form == "with":
        def fn(a, b):
            with autocast("cpu", dtype=torch.bfloat16):
                return (a @ b) * 2
    else:
        @autocast("cpu", dtype=torch.bfloat16)
        def fn(a, b):
            return (a @ b) * 2

    torch._dynamo.reset()
    out = torch.compile(fn, backend="aot_eager", fullgraph=True)(a, b)
    assert out.dtype is torch.bfloat16
    torch.testing.assert_close(out, (a.bfloat16() @ b.bfloat16()) * 2, rtol=0, atol=0)
