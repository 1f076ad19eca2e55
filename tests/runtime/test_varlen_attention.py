"""varlen_attention against F.scaled_dot_product_attention with the block-diagonal document mask (causal or not):
outputs and the gradients of query, key and value, grouped-query heads, autocast's mixed dtypes, torch.compile,
through torch's flash kernel's backward and in plain products (plain=True); and that each segment is computed alone (the flash
kernel called once per run of equal ids, no mask)."""
import pytest
import torch
import torch.nn.functional as F

from accel.runtime.nn import varlen_attention as va
from accel.runtime.nn.varlen_attention import segment_runs, varlen_attention

# two rows: three samples and the row's padding (segment 0), and two samples
SEGMENTS = torch.tensor([[1] * 10 + [2] * 17 + [3] * 9 + [0] * 4, [1] * 25 + [2] * 15])


def _inputs(dtype, kv_heads=4, heads=4, length=40, dim=8):
    g = torch.Generator().manual_seed(0)

    def randn(h):
        return torch.randn(2, h, length, dim, generator=g, dtype=torch.float64).to(dtype).requires_grad_()

    return randn(heads), randn(kv_heads), randn(kv_heads), torch.randn(2, heads, length, dim, generator=g).to(dtype)


def _reference(q, k, v, causal, scale=None):
    mask = SEGMENTS[:, None, :, None] == SEGMENTS[:, None, None, :]
    if causal:
        mask = mask & torch.tril(torch.ones(mask.shape[-1], mask.shape[-1], dtype=torch.bool))
    groups = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                          attn_mask=mask, scale=scale)


def _compare(fn, q, k, v, g, causal, tol=None, **kwargs):
    """fn against the reference, computed in fp64 from the same inputs where they are 16-bit (two 16-bit
    computations round differently: each is compared with the exact result)."""
    out = fn(q, k, v, SEGMENTS, causal, **kwargs)
    exact = q.dtype in (torch.bfloat16, torch.float16)
    want = _reference(*(t.double() if exact else t for t in (q, k, v)), causal, kwargs.get("scale")).to(q.dtype)
    rtol, atol = tol or (None, None)
    torch.testing.assert_close(out, want, rtol=rtol, atol=atol)
    for got, exp in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g)):
        torch.testing.assert_close(got, exp, rtol=rtol, atol=atol)


def test_segment_runs():
    assert segment_runs(SEGMENTS) == [[(0, 10), (10, 27), (27, 36), (36, 40)], [(0, 25), (25, 40)]]


PLAIN = pytest.mark.parametrize("plain", [False, True], ids=["flash", "plain"])


@PLAIN
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_matches_sdpa_with_the_document_mask_float64(causal, kv_heads, plain):
    q, k, v, g = _inputs(torch.float64, kv_heads=kv_heads)
    _compare(varlen_attention, q, k, v, g, causal, tol=(1e-10, 1e-12), scale=0.3, plain=plain)


@PLAIN
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, (1e-5, 1e-5)), (torch.bfloat16, (2e-2, 2e-2)),
                                        (torch.float16, (3e-3, 3e-3))])
def test_float32_and_16_bit(dtype, tol, causal, plain):
    q, k, v, g = _inputs(dtype)
    _compare(varlen_attention, q, k, v, g, causal, tol=tol, plain=plain)


def test_autocast_takes_mixed_dtypes_as_sdpa_does():
    q, k, v, g = _inputs(torch.float32)
    kb, vb = (t.detach().bfloat16().requires_grad_() for t in (k, v))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = varlen_attention(q, kb, vb, SEGMENTS, True)
        want = _reference(q, kb, vb, True)
    assert out.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)


def test_each_segment_is_computed_alone(monkeypatch):
    calls = []
    flash = va._flash
    monkeypatch.setattr(va, "_flash", lambda q, *args, **kwargs: (calls.append(q.shape[2]), flash(q, *args, **kwargs))[1])
    q, k, v, _ = _inputs(torch.float32)
    varlen_attention(q, k, v, SEGMENTS, True)
    assert calls == [10, 17, 9, 4, 25, 15]


@PLAIN
def test_torch_compile_matches_eager(plain):
    q, k, v, g = _inputs(torch.float32)
    _compare(torch.compile(varlen_attention, fullgraph=True), q, k, v, g, True, tol=(1e-5, 1e-5), plain=plain)


def test_plain_backward_only_below_its_length(monkeypatch):
    """Samples of PLAIN_BACKWARD_BELOW tokens or more keep the flash kernel's backward, shorter ones plain products;
    the gradients are the reference's either way."""
    calls = []
    plain_backward, flash_backward = va._plain_backward, va._flash_backward
    monkeypatch.setattr(va, "_plain_backward", lambda g, *a: (calls.append(("plain", g.shape[2])), plain_backward(g, *a))[1])
    monkeypatch.setattr(va, "_flash_backward",
                        lambda g, *a, **kw: (calls.append(("flash", g.shape[2])), flash_backward(g, *a, **kw))[1])
    monkeypatch.setattr(va, "PLAIN_BACKWARD_BELOW", 12)
    q, k, v, g = _inputs(torch.float64)
    _compare(varlen_attention, q, k, v, g, True, tol=(1e-10, 1e-12), plain=True)
    assert calls == [("plain", 10), ("flash", 17), ("plain", 9), ("plain", 4), ("flash", 25), ("flash", 15)]


def test_plain_calls_no_flash_backward(monkeypatch):
    monkeypatch.setattr(va, "_flash_backward", None)
    q, k, v, g = _inputs(torch.bfloat16)
    torch.autograd.grad(varlen_attention(q, k, v, SEGMENTS, True, plain=True), (q, k, v), g)


def test_second_derivative_is_refused():
    q, k, v, _ = _inputs(torch.float64)
    with pytest.raises(RuntimeError, match="varlen_attention has no second derivative"):
        torch.autograd.grad(varlen_attention(q, k, v, SEGMENTS, True).sum(), (q,), create_graph=True)


def test_bad_input_names_the_argument():
    q, k, v, _ = _inputs(torch.float32)
    with pytest.raises(ValueError, match="segment_ids: expected \\[2, 40\\]"):
        varlen_attention(q, k, v, SEGMENTS[:, :5])
    with pytest.raises(ValueError, match="key and value: expected"):
        varlen_attention(q, k[:, :3], v[:, :3], SEGMENTS)
    with pytest.raises(TypeError, match="segment_ids: expected dtype"):
        varlen_attention(q, k, v, SEGMENTS.float())
    with pytest.raises(ValueError, match="query: expected 4 dims"):
        varlen_attention(q[0], k, v, SEGMENTS)
