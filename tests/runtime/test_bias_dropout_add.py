"""Fused bias-dropout-add against the formula residual + mask * (x + bias) / (1 - p), with the mask
recovered from the op itself (x = ones, residual = zeros, same seed), computed in float64."""
import math

import pytest
import torch

from accel.runtime.nn import bias_dropout_add, dropout_add_fused, dropout_add_fused_train
from accel.runtime.nn.bias_dropout_add import bias_dropout_add_reference

from ._params import DEVICES, DTYPES, tol

SHAPES = [(7,), (3, 1001), (2, 5, 129), (0, 4)]


def recover_mask(shape, p, seed, device):
    """The keep-mask the op draws after torch.manual_seed(seed): with x = 1 and residual = 0 the
    output is scale where kept and 0 where dropped."""
    torch.manual_seed(seed)
    out = bias_dropout_add(torch.ones(shape, device=device), None, torch.zeros(shape, device=device), p, True)
    kept = out != 0
    if p < 1:
        torch.testing.assert_close(out[kept], torch.full_like(out[kept], 1 / (1 - p)))
    return kept


def inputs(shape, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(device, dtype)
    bias = torch.randn(shape[-1], generator=g).to(device, dtype)
    residual = torch.randn(shape, generator=g).to(device, dtype)
    return x, bias, residual


def by_hand(x, bias, residual, mask, p):
    scale = 1 / (1 - p) if p < 1 else 0.0
    y = x.double() + (0 if bias is None else bias.double())
    return residual.double() + mask.double() * y * scale


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("p", [0.0, 0.3, 1.0])
def test_forward_backward_match_formula(device, dtype, shape, p):
    mask = recover_mask(shape, p, seed=11, device=device)
    x, bias, residual = inputs(shape, dtype, device)
    x.requires_grad_(), bias.requires_grad_(), residual.requires_grad_()
    torch.manual_seed(11)
    out = bias_dropout_add(x, bias, residual, p, True)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out, by_hand(x, bias, residual, mask, p).to(dtype), **tol(dtype))

    g = torch.randn(shape).to(device, dtype)
    out.backward(g)
    scale = 1 / (1 - p) if p < 1 else 0.0
    gx = mask.double() * scale * g.double()
    torch.testing.assert_close(x.grad, gx.to(dtype), **tol(dtype))
    torch.testing.assert_close(residual.grad, g)
    gb = gx.reshape(-1, shape[-1]).sum(0)
    rtol, atol = tol(dtype).values()
    torch.testing.assert_close(bias.grad, gb.to(dtype), rtol=rtol, atol=atol * max(1, math.prod(shape[:-1])) ** 0.5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_kept_fraction_is_binomial(device, p):
    n = 200_003
    torch.manual_seed(1)
    kept = (bias_dropout_add(torch.ones(n, device=device), None, torch.zeros(n, device=device), p, True) != 0)
    frac = kept.double().mean().item()
    assert abs(frac - (1 - p)) <= 5 * math.sqrt(p * (1 - p) / n)  # 5 sigma
    # no structure across the 4 words of one Philox draw: each lane keeps ~(1 - p) too
    lanes = kept[: n - n % 4].reshape(-1, 4).double().mean(0)
    assert torch.all((lanes - (1 - p)).abs() <= 5 * math.sqrt(p * (1 - p) / (n // 4)))


@pytest.mark.parametrize("device", DEVICES)
def test_p0_is_identity_and_p1_gives_residual(device):
    x, bias, residual = inputs((5, 33), torch.float32, device)
    torch.testing.assert_close(bias_dropout_add(x, bias, residual, 0.0, True), residual + (x + bias))
    torch.testing.assert_close(bias_dropout_add(x, bias, residual, 1.0, True), residual, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_reproducible_under_manual_seed_and_different_across_seeds(device):
    x, bias, residual = inputs((64, 65), torch.float32, device)
    torch.manual_seed(3)
    a = bias_dropout_add(x, bias, residual, 0.5, True)
    b = bias_dropout_add(x, bias, residual, 0.5, True)  # the generator moved on
    torch.manual_seed(3)
    a2 = bias_dropout_add(x, bias, residual, 0.5, True)
    torch.manual_seed(4)
    c = bias_dropout_add(x, bias, residual, 0.5, True)
    assert torch.equal(a, a2)
    assert not torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("device", DEVICES)
def test_backward_regenerates_the_forward_mask_without_storing_it(device):
    shape = (9, 130)
    mask = recover_mask(shape, 0.4, seed=5, device=device)
    x = torch.randn(shape, device=device, requires_grad=True)
    residual = torch.randn(shape, device=device)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        torch.manual_seed(5)
        out = dropout_add_fused_train(x, residual, 0.4)
    # only the Philox (seed, offset): 2 int64, not a mask the size of x
    assert [(t.dtype, t.numel()) for t in saved] == [(torch.int64, 2)]
    torch.rand(1000, device=device)  # move the generator on between forward and backward
    g = torch.randn(shape, device=device)
    out.backward(g)
    torch.testing.assert_close(x.grad, mask * g / 0.6)


def test_gradcheck_float64_cpu():
    x = torch.randn(6, 7, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(7, dtype=torch.float64, requires_grad=True)
    residual = torch.randn(6, 7, dtype=torch.float64, requires_grad=True)

    def fn(x, bias, residual):
        torch.manual_seed(0)  # the same mask at every evaluation
        return bias_dropout_add(x, bias, residual, 0.3, True)

    assert torch.autograd.gradcheck(fn, (x, bias, residual))


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_inputs(device):
    x = torch.randn(64, 48, device=device).t()[::2]
    residual = torch.randn(48, 64, device=device)[::2]
    bias = torch.randn(128, device=device)[::2]
    assert not x.is_contiguous() and not bias.is_contiguous()
    mask = recover_mask(x.shape, 0.25, seed=2, device=device)
    torch.manual_seed(2)
    out = bias_dropout_add(x, bias, residual, 0.25, True)
    torch.testing.assert_close(out, by_hand(x, bias, residual, mask, 0.25).float())


@pytest.mark.parametrize("device", DEVICES)
def test_inference_forms(device):
    x, bias, residual = inputs((4, 17), torch.float32, device)
    torch.testing.assert_close(dropout_add_fused(x, residual, 0.5), x + residual, rtol=0, atol=0)
    torch.testing.assert_close(bias_dropout_add(x, bias, residual, 0.5, False), residual + (x + bias))
    torch.testing.assert_close(bias_dropout_add_reference(x, bias, residual, 0.5, False), residual + (x + bias))
    torch.manual_seed(8)
    a = dropout_add_fused_train(x, residual, 0.5)
    torch.manual_seed(8)
    torch.testing.assert_close(a, bias_dropout_add(x, None, residual, 0.5, True), rtol=0, atol=0)


def test_torch_compile_fullgraph_matches_eager():
    x, bias, residual = inputs((8, 40), torch.float32, "cpu")
    x.requires_grad_()

    def fn(x, bias, residual):
        return bias_dropout_add(x * 2, bias, residual, 0.3, True).sum(-1)

    compiled = torch.compile(fn, fullgraph=True)
    torch.manual_seed(6)
    eager = fn(x, bias, residual)
    (gx_eager,) = torch.autograd.grad(eager.sum(), x)
    torch.manual_seed(6)
    out = compiled(x, bias, residual)
    (gx,) = torch.autograd.grad(out.sum(), x)
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(gx, gx_eager)


def test_bad_input_names_argument():
    x = torch.randn(3, 4)
    for bad in (-0.1, 1.5, "0.1", None, True):
        with pytest.raises(ValueError, match="drop_rate"):
            dropout_add_fused_train(x, x, bad)
        with pytest.raises(ValueError, match="drop_rate"):
            dropout_add_fused(x, x, bad)
        with pytest.raises(ValueError, match="prob"):
            bias_dropout_add(x, None, x, bad, True)
    with pytest.raises(ValueError, match="to_add"):
        dropout_add_fused_train(x, torch.randn(4, 3), 0.1)
    with pytest.raises(ValueError, match="residual"):
        bias_dropout_add(x, None, torch.randn(3, 4, dtype=torch.float64), 0.1, True)
    with pytest.raises(ValueError, match="bias"):
        bias_dropout_add(x, torch.randn(3), x, 0.1, True)
    with pytest.raises(ValueError, match="to_add"):
        dropout_add_fused_train(x, torch.randn(3, 4, device="meta"), 0.1)
    with pytest.raises(ValueError, match="x"):
        dropout_add_fused_train(torch.arange(12).reshape(3, 4), x, 0.1)
