"""Fused Swin window attention scores: softmax(q@k^T + relative position bias + shift mask).

    attn = FusedSwinFmha.apply(attn, relative_pos_bias, attn_mask, batch_size, window_num, num_head,
                               window_len)
    == torch.softmax(attn.view(B, nW, nH, N, N) + relative_pos_bias[None, None]
                     + attn_mask[None, :, None], -1).view(B*nW, nH, N, N)

attn is [B*nW, nH, N, N]; relative_pos_bias [nH, N, N]; attn_mask [nW, N, N] or None (the mask of
window w applies to attn rows b*nW + w). window_len is the tokens per window N (the window side, with
N = window_len**2, is accepted too). One pass over attn instead of three (two adds and a softmax);
out-of-place. Math is fp32 (fp64 for float64). The output has attn's dtype, so under autocast an fp16
attn with an fp32 bias gives fp16 probabilities (plain PyTorch would promote to fp32); the bias
gradient has the bias's dtype; the mask gets no gradient. Backward keeps only the softmax output.
CPU tensors, and CUDA tensors with N <= 1024, run the kernels in csrc/{cpu,cuda}/fmha.*; other
devices (XLA) and larger windows run the plain-PyTorch reference below.
"""
from __future__ import annotations

import operator

import torch

from accel.runtime import _build
from accel.runtime.nn._common import FLOAT_DTYPES, check_same_device, check_tensor

CUDA_MAX_WINDOW_LEN = 1024  # one warp per row, at most 32 values per lane in registers


def _opmath(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def fmha_reference(attn: torch.Tensor, bias: torch.Tensor, mask: torch.Tensor | None,
                   window_num: int) -> torch.Tensor:
    """Plain PyTorch, computed in fp32 (fp64 for float64) and returned in attn's dtype."""
    BnW, nH, N, _ = attn.shape
    ct = _opmath(attn.dtype)
    s = attn.to(ct) + bias.to(ct).unsqueeze(0)
    if mask is not None:
        s = s.view(BnW // window_num, window_num, nH, N, N) + mask.to(ct).unsqueeze(1).unsqueeze(0)
        s = s.view(BnW, nH, N, N)
    return torch.softmax(s, dim=-1).to(attn.dtype)


def fmha_backward_reference(grad: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad of attn, grad of the bias in fp32/fp64) from the softmax output: the softmax backward
    y * (g - sum(g * y)) and its sum over the B*nW windows."""
    ct = _opmath(out.dtype)
    y, g = out.to(ct), grad.to(ct)
    dx = y * (g - (g * y).sum(-1, keepdim=True))
    return dx.to(out.dtype), dx.sum(0)


def _register():
    """Output shapes for torch.compile, and the gradient of the backward op, so that create_graph=True
    (double backward, gradient penalties) differentiates the backward rather than taking it as a
    constant. The forward op's gradient is C++ (csrc/autograd/fmha_autograd.cpp), as light per call as
    torch's own ops: the softmax output saved, fmha_swin_bwd in the backward, the bias gradient in the
    bias's dtype, none for the mask."""
    torch.library.register_fake("accel::fmha_swin_fwd")(
        lambda attn, bias, mask, window_num: torch.empty_like(attn.contiguous()))

    def bwd_fake(grad, out):
        return (torch.empty_like(out.contiguous()),
                out.new_empty(out.shape[1:], dtype=_opmath(out.dtype)))

    torch.library.register_fake("accel::fmha_swin_bwd")(bwd_fake)

    def bwd_setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)
        ctx.set_materialize_grads(False)

    def bwd_backward(ctx, grad_dx, grad_dbias):
        grad, out = ctx.saved_tensors
        return _bwd_backward(grad, out, grad_dx, grad_dbias, ctx.needs_input_grad)

    torch.library.register_autograd("accel::fmha_swin_bwd", bwd_backward, setup_context=bwd_setup_context)


def _bwd_backward(grad, out, grad_dx, grad_dbias, needs_input_grad):
    """Gradients of fmha_swin_bwd's (dx, dbias) with respect to grad and out, in differentiable torch
    ops (so third and higher derivatives follow by autograd). dx = y (g - s), s = sum_j(g y), and dbias
    is dx summed over the windows, so an upstream u = grad_dx + grad_dbias (broadcast over the windows)
    of dx gives
        d/dg = y (u - sum_j(u y))            (the softmax backward again),
        d/dy = u (g - s) - g sum_j(u y).
    """
    ct = _opmath(out.dtype)
    u = grad_dx.to(ct) if grad_dx is not None else None
    if grad_dbias is not None:
        u = grad_dbias.to(ct).expand(out.shape) if u is None else u + grad_dbias.to(ct)
    if u is None:
        return None, None
    y, g = out.to(ct), grad.to(ct)
    uy = (u * y).sum(-1, keepdim=True)
    d_grad = (y * (u - uy)).to(grad.dtype) if needs_input_grad[0] else None
    d_out = None
    if needs_input_grad[1]:
        d_out = (u * (g - (g * y).sum(-1, keepdim=True)) - g * uy).to(out.dtype)
    return d_grad, d_out


def _ops():
    return _build.ops("fmha", _register)


def _kernel_for(attn: torch.Tensor) -> bool:
    """The kernels serve CPU tensors and CUDA tensors with N <= CUDA_MAX_WINDOW_LEN (see use_kernel)."""
    return attn.is_cpu or attn.is_cuda and attn.shape[-1] <= CUDA_MAX_WINDOW_LEN


def _as_int(name: str, value) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name}: expected an int, got bool")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name}: expected an int, got {type(value).__name__}") from None


def _check(attn, bias, mask, batch_size, window_num, num_head, window_len) -> None:
    check_tensor("attn", attn, ndim=4)
    check_tensor("relative_pos_bias", bias, ndim=3)
    if mask is not None:
        check_tensor("attn_mask", mask, ndim=3)
    check_same_device(attn=attn, relative_pos_bias=bias, attn_mask=mask)
    batch_size, window_num = _as_int("batch_size", batch_size), _as_int("window_num", window_num)
    num_head, window_len = _as_int("num_head", num_head), _as_int("window_len", window_len)
    BnW, nH, N, N2 = attn.shape
    if N != N2:
        raise ValueError(f"attn: expected [B*nW, nH, N, N] with square scores, got {tuple(attn.shape)}")
    if batch_size < 0 or window_num < 1 or batch_size * window_num != BnW:
        raise ValueError(f"batch_size, window_num: expected batch_size * window_num == attn.shape[0] = {BnW}, "
                         f"got {batch_size} * {window_num}")
    if num_head != nH:
        raise ValueError(f"num_head: expected attn.shape[1] = {nH}, got {num_head}")
    if window_len != N and window_len * window_len != N:
        raise ValueError(f"window_len: expected the tokens per window attn.shape[-1] = {N} "
                         f"(or its square root), got {window_len}")
    if tuple(bias.shape) != (nH, N, N):
        raise ValueError(f"relative_pos_bias: expected shape (nH, N, N) = {(nH, N, N)}, got {tuple(bias.shape)}")
    if mask is not None and tuple(mask.shape) != (window_num, N, N):
        raise ValueError(f"attn_mask: expected shape (window_num, N, N) = {(window_num, N, N)}, "
                         f"got {tuple(mask.shape)}")


def _common_call(attn, bias, mask, batch_size, window_num, num_head, window_len) -> bool:
    """True for the call Swin's WindowAttention makes every step: float tensors on one device, attn
    [batch_size * window_num, num_head, N, N] with window_len N (or its square root), bias [num_head, N, N],
    mask None or [window_num, N, N], the sizes plain ints. It accepts only valid calls and costs a few
    attribute reads (the kernels' own Python-free checks follow); anything else goes through _check,
    which names what is wrong, and the general path."""
    if type(attn) is not torch.Tensor or type(bias) is not torch.Tensor and type(bias) is not torch.nn.Parameter \
            or type(batch_size) is not int or type(window_num) is not int or type(num_head) is not int \
            or type(window_len) is not int or window_num < 1 \
            or attn.dtype not in FLOAT_DTYPES or bias.dtype not in FLOAT_DTYPES:
        return False
    N = attn.shape[-1] if attn.dim() == 4 else -1
    if window_len != N and window_len * window_len != N \
            or attn.shape != (batch_size * window_num, num_head, N, N) or bias.shape != (num_head, N, N):
        return False
    device = attn.device
    if bias.device != device:
        return False
    return mask is None or type(mask) is torch.Tensor and mask.dtype in FLOAT_DTYPES \
        and mask.shape == (window_num, N, N) and mask.device == device


class FusedSwinFmha:
    """softmax(attn + relative_pos_bias + attn_mask, -1) for Swin window attention; see the module doc.

    Called as FusedSwinFmha.apply(...), the interface of the torch.autograd.Function it once was. The
    gradient is the one registered for the kernel op (csrc/autograd/fmha_autograd.cpp, which composes
    with torch.compile and higher-order autograd), or plain autograd through the reference elsewhere.
    """

    @staticmethod
    def apply(attn, relative_pos_bias, attn_mask, batch_size, window_num, num_head, window_len):
        if not _common_call(attn, relative_pos_bias, attn_mask, batch_size, window_num, num_head, window_len):
            _check(attn, relative_pos_bias, attn_mask, batch_size, window_num, num_head, window_len)
            window_num = operator.index(window_num)
        if _kernel_for(attn):
            return _ops().fmha_swin_fwd(attn, relative_pos_bias, attn_mask, window_num)
        # detached: the mask gets no gradient on the kernel path either
        mask = attn_mask.detach() if attn_mask is not None else None
        return fmha_reference(attn, relative_pos_bias, mask, window_num)
