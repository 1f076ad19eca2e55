"""linear_cross_entropy against plain PyTorch (F.cross_entropy of F.linear, fp32 loss) and hand-computed values:
the loss and the gradients of hidden, weight and bias, over several vocabulary slices, with ignored rows, both reductions,
autocast, torch.compile; and that no [N, V] tensor is kept for the backward."""
import math

import pytest
import torch
import torch.nn.functional as F

from accel.runtime.nn import linear_cross_entropy as lce_module
from accel.runtime.nn.linear_cross_entropy import (
    chunk_columns,
    linear_cross_entropy,
    linear_cross_entropy_reference,
)
from accel.utils.xla import xla_available

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture
def small_chunks(monkeypatch):
    """Slices as large as the tests' [33, 16] hidden states: 16 vocabulary entries, a vocabulary of 50 in four
    slices, the last one short."""
    monkeypatch.setattr(lce_module, "CHUNK_ELEMENTS", 1)
    monkeypatch.setattr(lce_module, "CUDA_CHUNK_ELEMENTS", 1)
    assert chunk_columns(33, 50, 16) == chunk_columns(33, 50, 16, "cuda") == 16


def _inputs(device, dtype=torch.float64, rows=33, hidden=16, vocab=50, bias=True, ignored=(0, 5, 6, 20)):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(rows, hidden, generator=g, dtype=dtype).to(device).requires_grad_()
    w = (0.3 * torch.randn(vocab, hidden, generator=g, dtype=dtype)).to(device).requires_grad_()
    b = (0.1 * torch.randn(vocab, generator=g, dtype=dtype)).to(device).requires_grad_() if bias else None
    t = torch.randint(0, vocab, (rows,), generator=g)
    t[list(ignored)] = -100
    return h, w, b, t.to(device)


def _loss_and_grads(fn, h, w, b, t, scale=1.0, **kwargs):
    loss = fn(h, w, t, b, **kwargs)
    wrt = [x for x in (h, w, b) if x is not None]
    return loss.detach(), torch.autograd.grad(loss * scale, wrt)


def _assert_matches(inputs, fn=linear_cross_entropy, expected_inputs=None, reference=linear_cross_entropy_reference,
                    loss_tol=None, grad_tol=None, **kwargs):
    """fn's loss and gradients on inputs (h, w, b, t) against the reference's on expected_inputs (default the same
    inputs), compared on the CPU, with (rtol, atol) tolerances (None: assert_close's defaults for the dtype).
    Returns fn's (loss, gradients)."""
    loss, grads = _loss_and_grads(fn, *inputs, **kwargs)
    want_loss, want_grads = _loss_and_grads(reference, *(expected_inputs or inputs), **kwargs)
    rtol, atol = loss_tol or (None, None)
    torch.testing.assert_close(loss.cpu(), want_loss.cpu(), rtol=rtol, atol=atol)
    rtol, atol = grad_tol or (None, None)
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got.cpu(), want.cpu(), rtol=rtol, atol=atol)
    return loss, grads


def test_chunk_columns_bound_a_slices_logits():
    assert chunk_columns(4096, 128256, 512) == lce_module.CHUNK_ELEMENTS // 4096
    assert chunk_columns(16384, 128256, 4096) == 4096  # a large model's slice: as large as its hidden states
    assert chunk_columns(10, 50, 16) == 50  # one slice: the whole vocabulary
    assert chunk_columns(1 << 30, 50, 1) == 1  # more tokens than the budget: one entry at a time
    # CUDA: larger slices, fewer calls (two for a small Llama's packed batch with Llama 2's vocabulary)
    assert chunk_columns(2048, 32000, 512, "cuda") == lce_module.CUDA_CHUNK_ELEMENTS // 2048 == 16384
    assert chunk_columns(16384, 128256, 4096, "cuda") == 4096


def test_hand_computed_loss_and_gradient():
    # one row, hidden [1, 0], weight rows [0, 0] and [1, 0]: logits [0, 1], target 1.
    h = torch.tensor([[1.0, 0.0]], dtype=torch.float64, requires_grad=True)
    w = torch.tensor([[0.0, 0.0], [1.0, 0.0]], dtype=torch.float64, requires_grad=True)
    loss = linear_cross_entropy(h, w, torch.tensor([1]))
    assert loss.item() == pytest.approx(math.log(1 + math.e) - 1)
    loss.backward()
    p0 = 1 / (1 + math.e)  # softmax of class 0; d loss / d logits = [p0, p1 - 1] = [p0, -p0]
    assert torch.allclose(h.grad, torch.tensor([[-p0, 0.0]], dtype=torch.float64))
    assert torch.allclose(w.grad, torch.tensor([[p0, 0.0], [-p0, 0.0]], dtype=torch.float64))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_plain_pytorch_over_several_chunks(small_chunks, device, reduction, bias):
    _assert_matches(_inputs(device, bias=bias), scale=2.5, reduction=reduction, loss_tol=(1e-12, 1e-12),
                    grad_tol=(1e-10, 1e-12))


@pytest.mark.parametrize("device", DEVICES)
def test_float32_and_autocast_match_plain_pytorch(small_chunks, device):
    inputs = _inputs(device, dtype=torch.float32)
    _assert_matches(inputs)
    # Under autocast the products run in bf16 as F.linear's would; the loss stays fp32.
    with torch.autocast(device, dtype=torch.bfloat16):
        loss, grads = _assert_matches(inputs, loss_tol=(2e-2, 2e-2), grad_tol=(5e-2, 1e-2))
    assert loss.dtype == torch.float32 and [g.dtype for g in grads] == [torch.float32] * 3


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_inputs(small_chunks, device):
    loss, grads = _assert_matches(_inputs(device, dtype=torch.bfloat16), loss_tol=(1e-2, 1e-2), grad_tol=(5e-2, 2e-2))
    assert loss.dtype == torch.float32 and all(g.dtype == torch.bfloat16 for g in grads)


def test_every_row_ignored_gives_what_cross_entropy_gives(small_chunks):
    h, w, b, t = _inputs("cpu")
    t = torch.full_like(t, -100)
    assert torch.isnan(linear_cross_entropy(h, w, t, b)) and torch.isnan(linear_cross_entropy_reference(h, w, t, b))
    loss, grads = _loss_and_grads(linear_cross_entropy, h, w, b, t, reduction="sum")
    assert loss.item() == 0.0 and all(torch.count_nonzero(g) == 0 for g in grads)


@pytest.mark.parametrize("ignored", [(), tuple(range(0, 33, 3)) + tuple(range(1, 20))],
                         ids=["none_ignored", "mostly_ignored"])
def test_cpu_products_skip_the_ignored_rows(small_chunks, monkeypatch, ignored):
    """On the CPU only the rows not ignored (an instruction-tuned model's answer tokens, not its prompt's) reach
    the head's products, forward and backward; loss and gradients are plain PyTorch's either way."""
    seen = []
    slice_fn = lce_module._slice_fn

    def recording(fn, device):
        step = slice_fn(fn, device)
        return lambda hidden, *args: (seen.append(hidden.shape[0]), step(hidden, *args))[1]

    monkeypatch.setattr(lce_module, "_slice_fn", recording)
    h, w, b, t = _inputs("cpu", ignored=ignored)
    _assert_matches((h, w, b, t))
    kept = 33 - len(set(ignored))
    assert seen and set(seen) == {kept}, seen


def test_ignore_index_other_than_minus_100(small_chunks):
    h, w, b, t = _inputs("cpu")
    t = t.masked_fill(t == -100, 7)
    _assert_matches((h, w, b, t), ignore_index=7)


def test_only_the_wanted_gradients(small_chunks):
    h, w, b, t = _inputs("cpu")
    w.requires_grad_(False)  # a frozen head (e.g. adapters trained below it)
    loss = linear_cross_entropy(h, w, t, b)
    grad_h, grad_b = torch.autograd.grad(loss, (h, b))
    ref = linear_cross_entropy_reference(h, w, t, b)
    for got, want in zip((grad_h, grad_b), torch.autograd.grad(ref, (h, b))):
        torch.testing.assert_close(got, want)
    with torch.no_grad():  # evaluation: the loss alone
        torch.testing.assert_close(linear_cross_entropy(h, w, t, b), ref.detach())


def test_no_tokens_by_vocabulary_tensor_is_kept_for_backward(small_chunks):
    rows, vocab = 33, 50
    h, w, b, t = _inputs("cpu", rows=rows, vocab=vocab)
    saved = []

    def pack(x):
        saved.append(x.numel())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        fused = linear_cross_entropy(h, w, t, b)
    assert saved and max(saved) < rows * vocab  # the gradients of h and w, and small ones
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        linear_cross_entropy_reference(h, w, t, b)
    assert max(saved) >= rows * vocab  # the unfused loss keeps its logits (or their softmax)
    fused.backward()


def test_second_derivative_is_refused(small_chunks):
    h, w, b, t = _inputs("cpu")
    # (a penalty added to a loss that does have a graph would otherwise treat the gradient as a constant)
    with pytest.raises(RuntimeError, match="linear_cross_entropy has no second derivative"):
        torch.autograd.grad(linear_cross_entropy(h, w, t, b), (h,), create_graph=True)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_matches_eager(small_chunks, device):
    compiled = torch.compile(linear_cross_entropy, fullgraph=True)
    _assert_matches(_inputs(device, dtype=torch.float32), fn=compiled, reference=linear_cross_entropy)


@pytest.mark.skipif(not xla_available(), reason="torch_xla is not installed")
def test_xla_tensors_take_plain_ops_per_slice(small_chunks):
    import torch_xla

    dev = torch_xla.device()
    h, w, b, t = _inputs("cpu", dtype=torch.float32)
    on_xla = tuple(x.detach().to(dev).requires_grad_() for x in (h, w, b))
    _assert_matches((*on_xla, t.to(dev)), expected_inputs=(h, w, b, t))


def test_bad_input_names_the_argument():
    h, w, b, t = _inputs("cpu")
    with pytest.raises(ValueError, match="weight: expected \\[V, 16\\]"):
        linear_cross_entropy(h, w[:, :8], t)
    with pytest.raises(ValueError, match="target: expected \\[33\\]"):
        linear_cross_entropy(h, w, t[:5])
    with pytest.raises(TypeError, match="target: expected dtype"):
        linear_cross_entropy(h, w, t.double())
    with pytest.raises(ValueError, match="bias: expected \\[50\\]"):
        linear_cross_entropy(h, w, t, b[:3])
    with pytest.raises(ValueError, match="reduction: expected one of"):
        linear_cross_entropy(h, w, t, reduction="none")
    with pytest.raises(ValueError, match="hidden: expected 2 dims"):
        linear_cross_entropy(h[None], w, t)
    with pytest.raises(TypeError, match="weight: expected a torch.Tensor"):
        linear_cross_entropy(h, w.tolist(), t)


def test_reference_is_f_cross_entropy_of_f_linear():
    h, w, b, t = _inputs("cpu", dtype=torch.float32)
    want = F.cross_entropy(F.linear(h, w, b), t, ignore_index=-100)
    torch.testing.assert_close(linear_cross_entropy_reference(h, w, t, b), want)
