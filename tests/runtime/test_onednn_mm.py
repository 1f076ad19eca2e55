"""accel::onednn_mm and OneDNNLinear against plain products computed in float64.

An fp32 sum of K products carries an error of at most ~K * 2^-24 times the sum of their magnitudes (|a| @ |b|),
whichever library blocks it: that bound, not a guessed tolerance, is what the products are held to.
"""
import copy
import pickle

import pytest
import torch
from torch import nn

from accel.runtime.nn import onednn_mm as module
from accel.runtime.nn.onednn_mm import OneDNNLinear, onednn_mm, onednn_mm_reference

pytestmark = pytest.mark.skipif(not module.onednn_available(), reason="this torch build has no oneDNN linear op")
U = 2.0 ** -24


def _within_fp32_bound(out, a, b, bias=None):
    """|out - a @ b - bias| <= K u (|a| @ |b| + |bias|), everything but `out` in float64."""
    a, b = a.detach().double(), b.detach().double()
    exact = a @ b
    scale = a.abs() @ b.abs()
    if bias is not None:
        exact = exact + bias.detach().double()
        scale = scale + bias.detach().double().abs()
    k = a.shape[1]
    err = (out.detach().double() - exact).abs()
    assert bool((err <= (k + 2) * U * scale + 1e-30).all()), f"max error {err.max().item():.3g}"


def _operand(rows, cols, transposed, gen):
    t = torch.randn((cols, rows) if transposed else (rows, cols), generator=gen)
    return t.t() if transposed else t


@pytest.mark.parametrize("shape", [(1, 1, 1), (37, 129, 65), (256, 96, 192)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("a_t", [False, True], ids=["a", "a_t"])
@pytest.mark.parametrize("b_t", [False, True], ids=["b", "b_t"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_product_and_gradients_match_float64(shape, a_t, b_t, with_bias):
    m, k, n = shape
    gen = torch.Generator().manual_seed(0)
    a = _operand(m, k, a_t, gen).requires_grad_()
    b = _operand(k, n, b_t, gen).requires_grad_()
    bias = torch.randn(n, generator=gen).requires_grad_() if with_bias else None
    out = onednn_mm(a, b, bias)
    assert out.shape == (m, n) and out.dtype == torch.float32 and out.is_contiguous()
    _within_fp32_bound(out, a, b, bias)
    grad = torch.randn(m, n, generator=gen)
    out.backward(grad)
    _within_fp32_bound(a.grad, grad, b.t())
    _within_fp32_bound(b.grad, a.t(), grad)
    if with_bias:
        torch.testing.assert_close(bias.grad, grad.double().sum(0).float(), rtol=m * U * 2, atol=m * U * 2)


def test_reference_is_the_plain_product():
    a, b, bias = torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0], [4.0]]), torch.tensor([0.5])
    torch.testing.assert_close(onednn_mm_reference(a, b, bias), torch.tensor([[11.5]]))
    torch.testing.assert_close(onednn_mm(a, b, bias), torch.tensor([[11.5]]))


@pytest.mark.parametrize("args, match", [
    ((torch.ones(2, 3, 4), torch.ones(4, 2)), "a: expected a 2-D float32 CPU tensor"),
    ((torch.ones(2, 3), torch.ones(3, 2, dtype=torch.float64)), "b: expected a 2-D float32"),
    ((torch.ones(2, 3), torch.ones(4, 2)), r"b: expected 3 rows \(a's columns\)"),
    ((torch.ones(2, 3), torch.ones(3, 2), torch.ones(3)), r"bias: expected 2 elements"),
], ids=["3d", "float64", "inner_size", "bias_size"])
def test_bad_operands_name_the_argument(args, match):
    with pytest.raises(ValueError, match=match):
        onednn_mm(*args)


def test_probe_decides_by_its_threshold(monkeypatch):
    assert module.onednn_speedup() > 0.0  # timed here: this build has oneDNN
    for speedup, wins in ((module.MIN_SPEEDUP * 0.99, False), (module.MIN_SPEEDUP, True)):
        monkeypatch.setattr(module, "onednn_speedup", lambda s=speedup: s)
        assert module.onednn_wins() is wins


@pytest.fixture
def onednn_calls(monkeypatch):
    """How many products reached oneDNN, with oneDNN taken as the faster library for every product (which it
    is depends on the machine: onednn_faster's own tests below)."""
    calls = []
    real = module._onednn_linear
    monkeypatch.setattr(module, "onednn_faster", lambda a, b, bias=None: True)

    def counting(a, b, bias):
        calls.append(tuple(a.shape))
        return real(a, b, bias)

    monkeypatch.setattr(module, "_onednn_linear", counting)
    return calls


def _pair(in_features, out_features, bias=True):
    torch.manual_seed(0)
    plain = nn.Linear(in_features, out_features, bias=bias)
    ours = copy.deepcopy(plain)
    ours.__class__ = OneDNNLinear
    return plain, ours


@pytest.mark.parametrize("bias", [True, False])
def test_linear_takes_onednn_for_large_fp32_products_and_trains_like_nn_linear(onednn_calls, bias):
    plain, ours = _pair(192, 256, bias)
    x = torch.randn(4, 32, 192, requires_grad=True)  # 128 x 192 x 256 = 6.3M multiply-adds: large
    x2 = x.detach().clone().requires_grad_()
    grad = torch.randn(4, 32, 256)
    plain(x).backward(grad)
    y = ours(x2)
    y.backward(grad)
    # forward, grad of x, grad of the weight ([256, 128] x [128, 192]: its own layout, no copy)
    assert onednn_calls == [(128, 192), (128, 256), (256, 128)]
    assert ours.weight.grad.is_contiguous()
    assert y.shape == (4, 32, 256)
    _within_fp32_bound(y.reshape(-1, 256), x.reshape(-1, 192), plain.weight.t(), plain.bias)
    _within_fp32_bound(x2.grad.reshape(-1, 192), grad.reshape(-1, 256), plain.weight)
    _within_fp32_bound(ours.weight.grad, grad.reshape(-1, 256).t(), x.reshape(-1, 192))
    if bias:
        torch.testing.assert_close(ours.bias.grad, plain.bias.grad, rtol=1e-5, atol=1e-5)


def test_linear_is_nn_linear_where_onednn_would_not_pay_or_not_apply(onednn_calls):
    plain, ours = _pair(192, 256)
    small = torch.randn(3, 192)
    torch.testing.assert_close(ours(small), plain(small), rtol=0, atol=0)  # 3 x 192 x 256: small
    x = torch.randn(4, 32, 192)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ours(x).dtype == plain(x).dtype == torch.bfloat16
    torch.testing.assert_close(ours.double()(x.double()), plain.double()(x.double()), rtol=0, atol=0)
    compiled = torch.compile(ours.float(), backend="eager", fullgraph=True)  # traced: plain ops for Inductor
    torch.testing.assert_close(compiled(x), plain.float()(x), rtol=0, atol=0)
    assert onednn_calls == []


def test_linear_keeps_nn_linear_state_and_pickles():
    plain, ours = _pair(8, 4)
    assert isinstance(ours, nn.Linear) and ours.state_dict().keys() == plain.state_dict().keys()
    clone = pickle.loads(pickle.dumps(ours))
    assert type(clone) is OneDNNLinear
    torch.testing.assert_close(clone.weight, plain.weight)


def test_second_derivatives_match_nn_linear(onednn_calls):
    """onednn_mm's backward is made of differentiable ops (itself, mm, sum): gradient-penalty training works."""
    plain, ours = _pair(192, 256)
    x = torch.randn(128, 192, requires_grad=True)  # large: oneDNN forward and backward
    results = []
    for m in (plain, ours):
        (g,) = torch.autograd.grad(torch.tanh(m(x)).sum(), x, create_graph=True)
        results.append((g, *torch.autograd.grad(g.square().sum(), (m.weight, m.bias, x))))
    for ours_t, plain_t in zip(results[1], results[0]):
        torch.testing.assert_close(ours_t, plain_t, rtol=1e-4, atol=1e-4)
    assert len(onednn_calls) >= 4  # forward, the first backward's two products, the second's


@pytest.fixture
def timings(monkeypatch):
    """best_time answering from a list (oneDNN's time, then torch's, per product timed), counting its calls."""
    answers = []
    monkeypatch.setattr(module, "best_time", lambda call: answers.pop(0))
    monkeypatch.setattr(module, "_faster", {})
    return answers


@pytest.mark.parametrize("ours, theirs, faster", [(1.0, module.MIN_SPEEDUP, True), (1.0, 1.1, False),
                                                  (2.0, 1.0, False)], ids=["by_the_margin", "within", "slower"])
def test_faster_follows_the_timings_by_the_margin_once_per_product(timings, ours, theirs, faster):
    a, b = torch.randn(64, 32), torch.randn(16, 32).t()
    timings.extend([ours, theirs])
    assert module.onednn_faster(a, b) is faster
    assert module.onednn_faster(a.clone(), b) is faster and not timings  # the same product: not timed again
    assert module.onednn_faster(a[:40], b) is faster and not timings  # 40 rows: 33 to 64 share a class
    timings.extend([2.0, 1.0])  # another layout of the same product is another class: timed again
    assert module.onednn_faster(a, b.contiguous()) is False and not timings
    timings.extend([2.0, 1.0])  # and so are 65 to 128 rows
    assert module.onednn_faster(torch.randn(65, 32), b) is False and not timings


def test_layers_take_onednn_only_for_the_shapes_it_won(timings, monkeypatch):
    calls = []
    real = module._onednn_linear
    monkeypatch.setattr(module, "_onednn_linear", lambda a, b, bias: calls.append(tuple(a.shape)) or real(a, b, bias))
    plain, ours = _pair(1024, 1024)
    few, many = torch.randn(16, 1024), torch.randn(256, 1024)  # 16M and 256M multiply-adds: both large
    timings.extend([3.0, 1.0, 1.0, 2.0])  # few rows: oneDNN 3x slower; many rows: 2x faster
    torch.testing.assert_close(ours(few), plain(few), rtol=0, atol=0)  # torch's own product
    torch.testing.assert_close(ours(many), plain(many), rtol=1e-5, atol=1e-5)
    assert calls == [(256, 1024)]


def test_faster_takes_fake_tensors_of_a_graph_being_compiled():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a, b = torch.empty(128, 256), torch.empty(384, 256).t()
        assert isinstance(module.onednn_faster(a, b, torch.empty(384)), bool)  # timed on real tensors
