"""varlen_attention against F.scaled_dot_product_attention with the block-diagonal document mask (causal or not):
outputs and the gradients of query, key and value, grouped-query heads, autocast's mixed dtypes, torch.compile,
through torch's flash kernel's backward and in plain products (plain=True); and that each segment is computed alone (the flash
kernel called once per run of equal ids, no mask)."""
import pytest
import torch
import torch.nn.functional as F

from accel.runtime.nn import varlen_attention as va
from accel.runtime.nn.varlen_attention import segment_runs, varlen_attention
from tests._varlen_kernel import NO_CUDA_VARLEN, varlen_kernel

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


# -- CUDA's route: torch's FlashAttention varlen kernel over static offsets (flash_varlen_attention) --------------
# SEGMENTS as each row's sample lengths: [10, 17, 9] then 4 tokens of padding; [25, 15]
SEQ_LENS = torch.tensor([[10, 17, 9], [25, 15, 0]], dtype=torch.int32)
WINDOW = pytest.mark.parametrize("causal, window", [(False, None), (True, None), (True, 6), (True, 40)],
                                 ids=["bidirectional", "causal", "window6", "window_as_long_as_the_row"])


def _windowed_reference(q, k, v, causal, window, scale=None):
    """The document mask's attention (the module's reference above), the window cut into it as
    accel.compiler.packed.document_mask cuts it: a key W or more tokens behind the query is out."""
    if window is None:
        return _reference(q, k, v, causal, scale)
    mask = SEGMENTS[:, None, :, None] == SEGMENTS[:, None, None, :]
    ones = torch.ones(mask.shape[-1], mask.shape[-1], dtype=torch.bool)
    mask = mask & ones.tril() & ones.triu(1 - window)
    groups = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                          attn_mask=mask, scale=scale)


def _flat(t):
    return t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3])  # [B, H, L, D] -> [B * L, H, D]


@WINDOW
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_reference_varlen_attn_is_the_document_mask(causal, window, kv_heads):
    """The plain reference of torch's varlen kernel, given static_cu_seqlens and the window translated to
    FlashAttention's (left, right), computes the document mask's attention (fp64)."""
    from accel.data.packing import static_cu_seqlens

    q, k, v, _ = _inputs(torch.float64, kv_heads=kv_heads)
    cu = static_cu_seqlens(SEQ_LENS, 40)
    out = va.reference_varlen_attn(_flat(q), _flat(k), _flat(v), cu, cu, 40, 40, scale=0.3,
                                   window_size=va._window_size(causal, window, 40), enable_gqa=True)
    want = _windowed_reference(q, k, v, causal, window, scale=0.3)
    torch.testing.assert_close(out, _flat(want), rtol=1e-10, atol=1e-12)


@pytest.fixture
def reference_kernel(monkeypatch):
    """flash_varlen_attention on the CPU, torch's kernel replaced by reference_varlen_attn (tests/_varlen_kernel.py)."""
    return varlen_kernel(monkeypatch)


@WINDOW
@pytest.mark.parametrize("kv_heads, takes_gqa", [(4, False), (2, True), (2, False)],
                         ids=["mha", "gqa_by_name", "gqa_repeated"])
def test_flash_varlen_attention_gives_the_kernel_the_packed_rows(monkeypatch, reference_kernel, causal, window,
                                                                 kv_heads, takes_gqa):
    from accel.data.packing import static_cu_seqlens

    monkeypatch.setattr(va, "_VARLEN_TAKES_GQA", takes_gqa)
    q, k, v, g = _inputs(torch.float64, kv_heads=kv_heads)
    cu = static_cu_seqlens(SEQ_LENS, 40)
    out = va.flash_varlen_attention(q, k, v, cu, is_causal=causal, scale=0.3, window=window)
    assert out.shape == q.shape and out.transpose(1, 2).is_contiguous()  # what transformers' functions return
    want = _windowed_reference(q, k, v, causal, window, scale=0.3)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
    for got, exp in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g)):
        torch.testing.assert_close(got, exp, rtol=1e-10, atol=1e-12)
    [(args, kwargs)] = reference_kernel
    assert args[3] is args[4] is cu and args[5:] == (40, 40)
    left = 5 if window == 6 else -1
    assert kwargs["window_size"] == ((left, 0) if causal else (-1, -1))
    assert kwargs.get("enable_gqa", False) == (kv_heads != 4 and takes_gqa)


def test_flash_varlen_attention_takes_autocasts_dtype(reference_kernel):
    """Under autocast the kernel gets the autocast dtype, as SDPA would (rotary embeddings leave fp32 queries
    next to 16-bit keys); its output stays in it."""
    from accel.data.packing import static_cu_seqlens

    q, k, v, _ = _inputs(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = va.flash_varlen_attention(q, k.bfloat16(), v, static_cu_seqlens(SEQ_LENS, 40), is_causal=True)
    assert out.dtype == torch.bfloat16
    want = _reference(*(t.bfloat16().double() for t in (q, k, v)), causal=True)
    torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=2e-2)


def test_flash_varlen_fits_only_what_the_kernel_takes(monkeypatch):
    q, k, _, _ = _inputs(torch.bfloat16)
    assert not va.flash_varlen_fits(q, k)  # the CPU: no FlashAttention varlen kernel
    monkeypatch.setattr(va, "flash_varlen_runs_on", lambda device: True)
    assert va.flash_varlen_fits(q, k)
    assert not va.flash_varlen_fits(q.float(), k.float())  # fp32: the kernel is 16-bit only
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert va.flash_varlen_fits(q.float(), k.float())  # autocast casts it for the kernel
    for dim in (12, 264):  # head sizes FlashAttention does not compile
        assert not va.flash_varlen_fits(q.new_zeros(2, 4, 40, dim), k.new_zeros(2, 4, 40, dim))
    assert not va.flash_varlen_fits(q[:, :, :1], k)  # one query against the row: not self-attention
    assert not va.flash_varlen_fits(q[:, :3], k)  # 3 query heads over 4 key heads
    with pytest.raises(ValueError, match="query, key: flash_varlen_attention needs CUDA"):
        va.flash_varlen_attention(q.float(), k.float(), k.float(), torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="window: a sliding window needs is_causal=True"):
        va.flash_varlen_attention(q, k, k, torch.zeros(3, dtype=torch.int32), window=4)


@pytest.mark.skipif(not (torch.cuda.is_available() and va.flash_varlen_runs_on(torch.device("cuda"))),
                    reason=NO_CUDA_VARLEN)
@WINDOW
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_flash_varlen_attention_on_cuda_is_the_document_mask(causal, window, kv_heads):
    """torch's own kernel, bf16, against the document mask's attention in fp64 (each compared with the exact
    result), outputs and gradients."""
    from accel.data.packing import static_cu_seqlens

    q, k, v, g = (t.detach().cuda().requires_grad_(t.requires_grad) for t in _inputs(torch.bfloat16, kv_heads=kv_heads))
    out = va.flash_varlen_attention(q, k, v, static_cu_seqlens(SEQ_LENS.cuda(), 40), is_causal=causal,
                                    window=window)
    exact = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
    want = _windowed_reference(*exact, causal, window)
    torch.testing.assert_close(out.double().cpu(), want, rtol=2e-2, atol=2e-2)
    grads = torch.autograd.grad(out, (q, k, v), g)
    for got, exp in zip(grads, torch.autograd.grad(want, exact, g.double().cpu())):
        torch.testing.assert_close(got.double().cpu(), exp, rtol=3e-2, atol=3e-2)


# -- sliding windows on the CPU: each segment longer than the window gets the kernel's band mask ------------------
@PLAIN
@pytest.mark.parametrize("window", [3, 9, 40], ids=["window3", "window9", "window_as_long_as_the_row"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_sliding_window_is_the_windowed_document_mask_float64(window, kv_heads, plain):
    """Outputs and gradients equal SDPA with the document mask cut to the window (the backward of a windowed
    segment is the flash kernel's under its band even when `plain` asks for plain products)."""
    q, k, v, g = _inputs(torch.float64, kv_heads=kv_heads)
    out = varlen_attention(q, k, v, SEGMENTS, True, scale=0.3, plain=plain, window=window)
    want = _windowed_reference(q, k, v, True, window, scale=0.3)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
    for got, exp in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g)):
        torch.testing.assert_close(got, exp, rtol=1e-10, atol=1e-12)


def test_sliding_window_in_bf16_and_compiled():
    q, k, v, g = _inputs(torch.bfloat16)
    want = _windowed_reference(*(t.double() for t in (q, k, v)), True, 6).to(torch.bfloat16)
    compiled = torch.compile(varlen_attention, dynamic=False, fullgraph=True)
    for fn in (varlen_attention, compiled):
        torch.testing.assert_close(fn(q, k, v, SEGMENTS, True, window=6), want, rtol=2e-2, atol=2e-2)


def test_window_needs_causal_and_a_positive_size():
    q, k, v, _ = _inputs(torch.float32)
    for window, causal in ((4, False), (0, True), (True, True), (2.5, True)):
        with pytest.raises(ValueError, match="window: expected a positive int with is_causal=True"):
            varlen_attention(q, k, v, SEGMENTS, causal, window=window)
