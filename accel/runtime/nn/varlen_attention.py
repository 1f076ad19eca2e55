"""Attention over packed rows computed one sample at a time on the CPU (varlen attention).

A packed row of L tokens holds several samples, each attending only to itself (accel.compiler.packed): with a
[B, 1, L, L] document mask SDPA computes every query against every key of the row and masks most of them away
(rows of 1024 holding samples of ~200 tokens: ~5x the work the samples need, causal or not). torch's CPU flash
kernel has no variable-length form, so `varlen_attention` calls it once per sample (each run of equal segment ids),
without a mask, causal where asked: the work of each sample alone. Forward and backward are torch.library ops
(`accel::varlen_attention_fwd` / `_bwd`, fake kernels, autograd formula), opaque to a compiled graph, whose
lengths they read on the host. On CUDA `flash_varlen_attention` (below) gives packed rows torch's FlashAttention
varlen kernel instead, where accelerate()'s compute.cuda_packed_attention="varlen" asks for it.

`plain=True` computes the backward of each sample shorter than PLAIN_BACKWARD_BELOW in plain products instead
(the probabilities recomputed from the forward's logsumexp, as the flash kernel's backward does, from fp32
scores; the softmax's backward in fp32; the products that give the inputs' gradients in their dtype): torch's
16-bit CPU flash kernel is slow backwards on short samples on a CPU without AMX (~0.33 ms for 32 tokens; 2-core
Zen 5, bf16, 12 heads of 64: 2.0-2.9x the plain backward's time at 32-128 tokens, 1.2-1.4x at 256, 0.84-0.97x
at 512), while its forward is the faster one (plain 1.2-2.9x slower causal, 0.75-1.8x bidirectional).
accelerate() asks for it where compute.cpu_attention does (accel.compiler.unpadded_attention).
"""
from __future__ import annotations

import inspect

import torch

from accel.runtime.nn._common import check_tensor

# plain=True: samples at least this long keep the flash kernel's backward (see the module docstring)
PLAIN_BACKWARD_BELOW = 384
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The flash kernel's logsumexp dtype: its accumulation type."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def segment_runs(segment_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """[(start, end), ...] per row of segment_ids [B, L]: the runs of equal ids (the row's padding is a run too)."""
    runs = []
    for row in segment_ids.tolist():
        starts = [0] + [i for i in range(1, len(row)) if row[i] != row[i - 1]]
        runs.append(list(zip(starts, starts[1:] + [len(row)])))
    return runs


def _scores(q, k, is_causal: bool, scale: float) -> torch.Tensor:
    """q k^T scale of one sample [1, H, l, l] in the accumulation dtype, -inf above the diagonal where causal.
    Computed in that dtype: the flash kernel's logsumexp is of fp32 scores, and probabilities recomputed from
    16-bit ones against it would be off by their rounding (a score of 10 rounded to bf16 moves its exp by ~4%)."""
    acc = _lse_dtype(q.dtype)
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)).mul_(scale)
    if is_causal:
        scores.masked_fill_(torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).triu(1), float("-inf"))
    return scores


def _plain_backward(grad_out, q, k, v, out, lse, is_causal: bool, scale: float):
    """One sample's (dq, dk, dv) in plain products, the probabilities recomputed from the logsumexp."""
    probs = _scores(q, k, is_causal, scale).sub_(lse[..., None]).exp_()
    grad_value = torch.matmul(probs.to(q.dtype).transpose(-1, -2), grad_out)
    # in fp32 as the scores: softmax's backward subtracts delta from it, where 16-bit rounding would cancel badly
    grad_probs = torch.matmul(grad_out.to(probs.dtype), v.to(probs.dtype).transpose(-1, -2))
    # softmax's backward: sum_j dP_ij P_ij = dO_i . O_i
    delta = (grad_out.to(probs.dtype) * out.to(probs.dtype)).sum(-1, keepdim=True)
    grad_scores = probs.mul_(grad_probs.sub_(delta)).mul_(scale).to(q.dtype)
    return torch.matmul(grad_scores, k), torch.matmul(grad_scores.transpose(-1, -2), q), grad_value


def _band(length: int, window: int, dtype: torch.dtype) -> torch.Tensor | None:
    """The additive [length, length] mask of a causal sliding window (a query sees itself and the window - 1 tokens
    before it), in the queries' dtype as the flash kernel takes it; None where the sample is no longer than the
    window (causality alone cuts the same)."""
    if window <= 0 or length <= window:
        return None
    position = torch.arange(length)
    behind = position.view(-1, 1) - position.view(1, -1)
    allowed = (behind >= 0) & (behind < window)
    return torch.zeros(length, length, dtype=dtype).masked_fill_(~allowed, float("-inf"))


@torch.library.custom_op("accel::varlen_attention_fwd", mutates_args=())
def _fwd(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segment_ids: torch.Tensor, is_causal: bool,
         scale: float, plain: bool, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Assumptions: query, key, value [B, H, L, D] on the CPU, one dtype, as many key as query heads;
    segment_ids [B, L], each sample one run of equal ids; `plain` says how the backward computes (the forward is
    the flash kernel's either way); window > 0 only with is_causal (0: none). Returns (output [B, H, L, D],
    logsumexp [B, H, L] in the accumulation dtype)."""
    out = torch.empty_like(query)
    lse = query.new_empty(query.shape[:3], dtype=_lse_dtype(query.dtype))
    for b, runs in enumerate(segment_runs(segment_ids)):
        for start, end in runs:
            s = slice(start, end)
            band = _band(end - start, window, query.dtype)
            o, m = _flash(query[b:b + 1, :, s], key[b:b + 1, :, s], value[b:b + 1, :, s], 0.0,
                          is_causal and band is None, attn_mask=band, scale=scale)
            out[b:b + 1, :, s] = o
            lse[b:b + 1, :, s] = m
    return out, lse


@_fwd.register_fake
def _fwd_fake(query, key, value, segment_ids, is_causal, scale, plain, window):
    return torch.empty_like(query), query.new_empty(query.shape[:3], dtype=_lse_dtype(query.dtype))


@torch.library.custom_op("accel::varlen_attention_bwd", mutates_args=())
def _bwd(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor,
         lse: torch.Tensor, segment_ids: torch.Tensor, is_causal: bool, scale: float,
         plain: bool, window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of query, key and value, per sample (the assumptions of the forward op). A sample its window
    cuts takes the flash kernel's backward under its band, plain or not."""
    grads = [torch.empty_like(t) for t in (query, key, value)]
    for b, runs in enumerate(segment_runs(segment_ids)):
        for start, end in runs:
            s = slice(start, end)
            args = (grad_out[b:b + 1, :, s], query[b:b + 1, :, s], key[b:b + 1, :, s], value[b:b + 1, :, s],
                    out[b:b + 1, :, s], lse[b:b + 1, :, s])
            band = _band(end - start, window, query.dtype)
            if band is not None:
                parts = _flash_backward(*args, 0.0, False, attn_mask=band, scale=scale)
            elif plain and end - start < PLAIN_BACKWARD_BELOW:
                parts = _plain_backward(*args, is_causal, scale)
            else:
                parts = _flash_backward(*args, 0.0, is_causal, scale=scale)
            for grad, part in zip(grads, parts):
                grad[b:b + 1, :, s] = part
    return tuple(grads)


@_bwd.register_fake
def _bwd_fake(grad_out, query, key, value, out, lse, segment_ids, is_causal, scale, plain, window):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _setup_context(ctx, inputs, output):
    query, key, value, segment_ids, is_causal, scale, plain, window = inputs
    ctx.save_for_backward(query, key, value, output[0], output[1], segment_ids)
    ctx.is_causal, ctx.scale, ctx.plain, ctx.window = is_causal, scale, plain, window


def _backward(ctx, grad_out, grad_lse):
    if torch.is_grad_enabled():
        raise RuntimeError("varlen_attention has no second derivative; use F.scaled_dot_product_attention with the "
                           "document mask for double backward")
    query, key, value, out, lse, segment_ids = ctx.saved_tensors
    dq, dk, dv = torch.ops.accel.varlen_attention_bwd(grad_out.contiguous(), query, key, value, out, lse, segment_ids,
                                                      ctx.is_causal, ctx.scale, ctx.plain, ctx.window)
    return dq, dk, dv, None, None, None, None, None


_fwd.register_autograd(_backward, setup_context=_setup_context)


def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segment_ids: torch.Tensor,
                     is_causal: bool = False, scale: float | None = None, plain: bool = False,
                     window: int | None = None) -> torch.Tensor:
    """softmax(q k^T scale) v where each token attends only to the tokens of its own segment (and, causal, not to
    later ones): `F.scaled_dot_product_attention` with the block-diagonal document mask, computed per segment.

    Args:
        query, key, value: [B, H, L, D] on the CPU (key and value may have fewer heads dividing H: grouped-query
            attention, repeated here as transformers' SDPA path does).
        segment_ids: [B, L] integer ids; each segment must be one run of equal ids (as packing lays samples out).
        is_causal: each token attends to the earlier tokens of its segment and itself only.
        scale: the scores' scale (default 1 / sqrt(D)).
        plain: the backward of each sample shorter than PLAIN_BACKWARD_BELOW in plain products rather than by
            torch's flash kernel (see the module docstring).
        window: with is_causal, each token attends to the last `window` tokens of its segment, itself included
            (transformers' sliding_window; a segment longer than it gets the kernel's additive band mask).

    Returns:
        [B, H, L, D], query's dtype.

    Raises:
        TypeError / ValueError: shapes, dtypes or devices other than the above.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_tensor(name, t, ndim=4)
        if t.device.type != "cpu":
            raise ValueError(f"{name}: varlen_attention runs on the CPU, got a tensor on {t.device}")
    check_tensor("segment_ids", segment_ids, dtypes=(torch.int64, torch.int32), ndim=2)
    batch, heads, length, _ = query.shape
    if key.shape != value.shape or key.shape[0] != batch or key.shape[2] != length or heads % key.shape[1]:
        raise ValueError(f"key and value: expected [{batch}, H/g, {length}, D] for query {tuple(query.shape)}, "
                         f"got {tuple(key.shape)} and {tuple(value.shape)}")
    if segment_ids.shape != (batch, length):
        raise ValueError(f"segment_ids: expected [{batch}, {length}], got {tuple(segment_ids.shape)}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1 or not is_causal):
        raise ValueError(f"window: expected a positive int with is_causal=True, got {window!r} "
                         f"(is_causal={is_causal})")
    # As SDPA under autocast: one dtype for the three, the autocast dtype where autocast is on (a custom op gets
    # its inputs as they are: rotary embeddings leave queries in fp32 next to bf16 keys).
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else query.dtype
    query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    if key.shape[1] != heads:
        key = key.repeat_interleave(heads // key.shape[1], dim=1)
        value = value.repeat_interleave(heads // value.shape[1], dim=1)
    scale = float(query.shape[-1] ** -0.5 if scale is None else scale)
    out, _ = torch.ops.accel.varlen_attention_fwd(query, key, value, segment_ids, bool(is_causal), scale, bool(plain),
                                                  int(window or 0))
    return out


# -- CUDA: torch's FlashAttention varlen kernel ---------------------------------------------------------------------
# On CUDA a packed row's samples take torch.nn.attention.varlen.varlen_attn (FlashAttention-2's variable-length
# kernel, torch 2.10 and later) over the batch flattened to [B * L] tokens, with cu_seqlens built on the device from
# the rows' seq_lens (accel.data.packing.static_cu_seqlens): each sample's work alone, where SDPA with the [B, 1, L, L]
# document mask computes and masks every pair of the row. Its dropout is 0: attention with dropout keeps the mask.
_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_FLASH_MAX_HEAD_DIM = 256


try:  # torch 2.10 and later
    from torch.nn.attention.varlen import varlen_attn as torch_varlen
except ImportError:
    torch_varlen = None
# torch 2.13 asks for grouped-query attention by name (enable_gqa); earlier ones take as many key as query heads
_VARLEN_TAKES_GQA = torch_varlen is not None and "enable_gqa" in inspect.signature(torch_varlen).parameters


@torch.compiler.assume_constant_result
def _capability_at_least_80(index: int) -> bool:
    """Read once while Dynamo traces (a constant of the graph), not at every call."""
    return torch.cuda.get_device_capability(index) >= (8, 0)


def flash_varlen_runs_on(device: torch.device) -> bool:
    """Whether torch's varlen kernel runs on `device`: CUDA with compute capability 8.0 or later (FlashAttention-2's
    requirement), with a torch that has the kernel."""
    if device.type != "cuda" or torch_varlen is None:
        return False
    return _capability_at_least_80(0 if device.index is None else device.index)


def flash_varlen_fits(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether flash_varlen_attention takes these [B, H, L, D] queries and keys: a device it runs on, 16-bit (or
    autocast to 16 bits there), a head size FlashAttention compiles (a multiple of 8 up to 256), key heads
    dividing the query heads, self-attention over one length."""
    device = query.device
    dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else query.dtype
    head_dim = query.shape[-1]
    return (dtype in _FLASH_DTYPES and head_dim % 8 == 0 and head_dim <= _FLASH_MAX_HEAD_DIM
            and query.shape[2] == key.shape[2] and query.shape[1] % key.shape[1] == 0 and flash_varlen_runs_on(device))


def _window_size(is_causal: bool, window: int | None, length: int) -> tuple[int, int]:
    """FlashAttention's (left, right) for a transformers window W: a query sees the keys fewer than W tokens behind
    it (itself included), left = W - 1; a window as long as the row cuts nothing."""
    left = window - 1 if window is not None and window < length else -1
    return (left, 0) if is_causal else (left, -1)


def flash_varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                           is_causal: bool = False, scale: float | None = None,
                           window: int | None = None) -> torch.Tensor:
    """Each sample's own attention over packed rows, by torch's FlashAttention varlen kernel (CUDA).

    Args:
        query, key, value: [B, H, L, D] (key and value may have fewer heads dividing H: grouped-query attention).
        cu_seqlens: int32 [N + 1] offsets of the samples in the batch flattened to [B * L] tokens, from 0 to B * L
            (accel.data.packing.static_cu_seqlens; empty samples allowed).
        is_causal: each token attends to the earlier tokens of its sample and itself only.
        scale: the scores' scale (default 1 / sqrt(D)).
        window: with is_causal, each token attends to the last `window` tokens of its sample, itself included
            (transformers' sliding_window).

    Returns:
        [B, H, L, D] in the 16-bit dtype (autocast's where on), a transposed view of a [B, L, H, D] tensor (what
        transformers' attention functions return after .transpose(1, 2)).

    Raises:
        ValueError: window without is_causal, or inputs flash_varlen_fits refuses.
    """
    if window is not None and not is_causal:
        raise ValueError("window: a sliding window needs is_causal=True")
    if not flash_varlen_fits(query, key):
        raise ValueError("query, key: flash_varlen_attention needs CUDA (compute capability 8.0+, torch 2.10+), "
                         f"fp16/bf16, head size a multiple of 8 up to 256; got {tuple(query.shape)} {query.dtype} "
                         f"on {query.device}, key {tuple(key.shape)}")
    batch, heads, length, head_dim = query.shape
    device = query.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else query.dtype
    flat_q, flat_k, flat_v = (t.to(dtype).transpose(1, 2).reshape(batch * length, t.shape[1], head_dim)
                              for t in (query, key, value))
    extra = {}
    if key.shape[1] != heads:  # grouped-query attention: torch 2.13 asks for it by name, earlier ones repeat
        if _VARLEN_TAKES_GQA:
            extra["enable_gqa"] = True
        else:
            flat_k, flat_v = (t.repeat_interleave(heads // key.shape[1], dim=1) for t in (flat_k, flat_v))
    out = torch_varlen(flat_q, flat_k, flat_v, cu_seqlens, cu_seqlens, length, length, scale=scale,
                         window_size=_window_size(is_causal, window, length), **extra)
    return out.view(batch, length, heads, head_dim).transpose(1, 2)


def reference_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                          enable_gqa=False):
    """torch's varlen_attn in plain PyTorch (FlashAttention's semantics, for tests on any device): [T, H, D]
    tokens, each sample cu_seq[i]:cu_seq[i + 1] attending to itself; window_size (left, right): query i sees key j
    where i - left <= j <= i + right, -1 unbounded ((-1, 0) is causal)."""
    heads = query.shape[1]
    if key.shape[1] != heads:
        if not enable_gqa:
            raise ValueError("reference_varlen_attn: fewer key heads need enable_gqa=True")
        key, value = (t.repeat_interleave(heads // key.shape[1], dim=1) for t in (key, value))
    out = torch.zeros_like(query)
    left, right = window_size
    for start, end in zip(cu_seq_q.tolist(), cu_seq_q.tolist()[1:]):
        if end == start:
            continue
        acc = torch.promote_types(query.dtype, torch.float32)  # fp32 at least, as the kernel accumulates
        q, k, v = (t[start:end].transpose(0, 1).to(acc) for t in (query, key, value))  # [H, n, D]
        i = torch.arange(end - start, device=query.device)
        offset = i.view(-1, 1) - i.view(1, -1)  # query - key
        allowed = torch.ones_like(offset, dtype=torch.bool)
        if left >= 0:
            allowed &= offset <= left
        if right >= 0:
            allowed &= -offset <= right
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
        out[start:end] = o.transpose(0, 1).to(out.dtype)
    return out
