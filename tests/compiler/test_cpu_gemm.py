"""accel.compiler.cpu_gemm: the graph pass that gives compiled CPU graphs oneDNN's fp32 products, and
accelerate()'s compute.cpu_gemm, against the same model run plainly (eager, torch's products)."""
import copy

import pytest
import torch
from torch import nn

import accel
from accel.compiler.cpu_gemm import SwapCpuGemms
from accel.config import Config
from accel.runtime.nn import onednn_mm as onednn
from accel.runtime.nn.onednn_mm import OneDNNLinear

pytestmark = pytest.mark.skipif(not onednn.onednn_available(), reason="this torch build has no oneDNN linear op")


@pytest.fixture
def onednn_calls(monkeypatch):
    """The [M, K] operand of each product that reached oneDNN: (shape, whether it was row-major), with oneDNN
    taken as the faster library for every product (which it is depends on the machine)."""
    calls = []
    real = onednn._onednn_linear
    monkeypatch.setattr(onednn, "onednn_faster", lambda a, b, bias=None: True)

    def counting(a, b, bias):
        calls.append((tuple(a.shape), a.is_contiguous()))
        return real(a, b, bias)

    monkeypatch.setattr(onednn, "_onednn_linear", counting)
    return calls


def _mlp(width=256, hidden=384, dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width, bias=False)).to(dtype)


def _fwd_bwd(model, x):
    x = x.detach().clone().requires_grad_()
    y = model(x)
    y.square().mean().backward()
    return y.detach(), x.grad, [p.grad for p in model.parameters()]


def _assert_same_training(ours, plain, x):
    y, gx, grads = _fwd_bwd(ours, x)
    y_ref, gx_ref, grads_ref = _fwd_bwd(plain, x)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-4, atol=1e-7)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-6)


def test_pass_swaps_every_large_fp32_product_forward_and_backward(onednn_calls):
    torch._dynamo.reset()
    model, plain = _mlp(), _mlp()
    compiled = torch.compile(model, options={"post_grad_custom_post_pass": SwapCpuGemms()})
    x = torch.randn(64, 256)  # 64 x 256 x 384 = 6.3M multiply-adds a product: large
    _assert_same_training(compiled, plain, x)
    # forward: two products; backward: the input's and the weight's gradient of each layer, the weight's with
    # its transposed left operand written row-major by Inductor (oneDNN would copy it itself, slowly)
    assert sorted(onednn_calls) == sorted([((64, 256), True), ((64, 384), True), ((64, 384), True),
                                           ((384, 64), True), ((64, 256), True), ((256, 64), True)])


@pytest.mark.parametrize("what", ["small", "float64"])
def test_pass_leaves_small_and_non_fp32_products_to_torch(onednn_calls, what):
    torch._dynamo.reset()
    dtype = torch.float64 if what == "float64" else torch.float32
    width, hidden = (16, 24) if what == "small" else (256, 384)
    model, plain = _mlp(width, hidden, dtype), _mlp(width, hidden, dtype)
    compiled = torch.compile(model, options={"post_grad_custom_post_pass": SwapCpuGemms()})
    _assert_same_training(compiled, plain, torch.randn(64, width, dtype=dtype))
    assert onednn_calls == []


def _accelerated(library: str, compile: bool):
    config = Config(backend="cpu")
    config.compute.cpu_gemm = library
    config.compute.compile = compile
    config.compute.kernels = False
    return accel.accelerate(_mlp(), None, config)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("library, wins, expected", [
    ("onednn", False, True), ("auto", True, True), ("auto", False, False), ("torch", True, False),
], ids=["onednn", "auto_where_it_wins", "auto_where_it_loses", "torch"])
def test_accelerate_follows_cpu_gemm_and_the_probe(monkeypatch, onednn_calls, compile, library, wins, expected):
    torch._dynamo.reset()
    monkeypatch.setattr(onednn, "onednn_speedup", lambda: 2.0 if wins else 1.0)
    model = _accelerated(library, compile)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert all((type(m) is OneDNNLinear) == expected for m in linears)
    _assert_same_training(model, _mlp(), torch.randn(64, 256))
    assert (len(onednn_calls) == 6) == expected and (onednn_calls == []) == (not expected)


def test_auto_takes_onednn_only_where_every_rank_found_it_faster(monkeypatch):
    from accel import distributed

    monkeypatch.setattr(onednn, "onednn_speedup", lambda: 2.0)
    monkeypatch.setattr(distributed, "all_ranks_agree", lambda flag: False)  # another rank's probe lost
    model = _accelerated("auto", compile=False)
    assert not any(isinstance(m, OneDNNLinear) for m in model.modules())


def test_under_autocast_the_products_are_not_fp32_and_stay_torchs(monkeypatch):
    import accel.utils.cpu as cpu

    monkeypatch.setattr(onednn, "onednn_speedup", lambda: 2.0)
    monkeypatch.setattr(cpu, "native_bf16", lambda: True)  # bf16 autocast, whatever this CPU has
    config = Config(backend="cpu")
    config.compute.bf16, config.compute.cpu_gemm, config.compute.compile = True, "onednn", False
    model = accel.accelerate(_mlp(), None, config)
    assert not any(isinstance(m, OneDNNLinear) for m in model.modules())


def test_cpu_gemm_onednn_without_onednn_is_an_error(monkeypatch):
    monkeypatch.setattr(onednn, "onednn_available", lambda: False)
    with pytest.raises(ValueError, match="compute.cpu_gemm: 'onednn' asked for"):
        _accelerated("onednn", compile=False)


def test_fuse_qkv_still_fuses_onednn_linear_projections():
    from accel.compiler.fused_qkv import _plain

    attn = nn.Module()
    for name in ("query", "key", "value"):
        linear = copy.deepcopy(nn.Linear(8, 8))
        linear.__class__ = OneDNNLinear
        setattr(attn, name, linear)
    assert _plain(attn)
