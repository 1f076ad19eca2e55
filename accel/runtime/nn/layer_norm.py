"""Fused LayerNorm: forward and backward kernels with fp32 statistics, mixed-precision params.

`fused_layer_norm(x, normalized_shape, weight, bias, eps)` and the `FusedLayerNorm` module (a
drop-in subclass of nn.LayerNorm: same constructor, parameters and state_dict keys) run the kernels
in csrc/{cpu,cuda}/layer_norm.* for CPU and CUDA tensors and `layer_norm_reference` elsewhere (XLA,
whose compiler fuses it). Inputs may be fp32/fp16/bf16 (and fp64 for gradcheck); weight and bias may
have x's dtype or, for fp16/bf16 x, fp32 (master weights kept in fp32). The output has x's dtype.
The forward and its gradients (dx, dweight, dbias) are accurate for rows of any magnitude up to
|x| <= 2^126 (~8.5e37; 2^1022 for fp64), on CPU and CUDA alike: a row whose sum of squares overflows
the fp32 statistics (|x| from ~1e19, reachable in fp32 and bf16, not in fp16) has them recomputed on
exactly rescaled values. A row holding an inf or NaN gives non-finite outputs.
"""
from __future__ import annotations

import functools
import numbers
import operator

import torch
from torch.nn.modules.normalization import LayerNorm as _TorchLayerNorm

from accel.runtime import _build
from accel.runtime.nn._common import check_same_device, check_tensor, use_kernel

_REDUCED = (torch.float16, torch.bfloat16)


def layer_norm_reference(x: torch.Tensor, normalized_shape, weight=None, bias=None, eps: float = 1e-5):
    """Plain PyTorch: the definition, computed in fp32 (fp64 for fp64 x), rounded once to x's dtype."""
    shape = _normalized_shape(normalized_shape)
    dims = tuple(range(-len(shape), 0))
    xf = x.float() if x.dtype in _REDUCED else x
    mean = xf.mean(dims, keepdim=True)
    var = (xf - mean).square().mean(dims, keepdim=True)
    y = (xf - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight.to(xf.dtype)
    if bias is not None:
        y = y + bias.to(xf.dtype)
    return y.to(x.dtype)


def _normalized_shape(normalized_shape) -> tuple[int, ...]:
    if isinstance(normalized_shape, numbers.Integral):
        return (int(normalized_shape),)
    if isinstance(normalized_shape, (str, bytes)):
        raise ValueError(f"normalized_shape: expected an int or a sequence of ints, got {normalized_shape!r}")
    try:
        shape = tuple(int(d) for d in normalized_shape)
    except (TypeError, ValueError):
        raise ValueError(f"normalized_shape: expected an int or a sequence of ints, got {normalized_shape!r}") from None
    if not shape or any(d < 0 for d in shape):
        raise ValueError(f"normalized_shape: expected a non-empty sequence of sizes >= 0, got {normalized_shape!r}")
    return shape


def _numel(shape) -> int:
    return functools.reduce(operator.mul, shape, 1)


def _stat_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _add(a, b):
    return b if a is None else a + b


def _bwd_backward(dy, x, mean, rstd, weight, need_dw, need_db, grad_dx, grad_dw, grad_db, needs_input_grad):
    """Gradients of layer_norm_bwd's (dx, dw, db) with respect to its inputs dy, x, mean, rstd, weight,
    each taken as independent (the chain through mean and rstd to x is the forward op's gradient, in
    csrc/autograd/layer_norm_autograd.cpp). In differentiable torch ops, so third and higher derivatives follow.

    Per row, with g = w dy, xhat = (x - mean) rstd, A = mean_j(g), B = mean_j(g xhat):
        dx = rstd (g - A - xhat B),  dw = sum_rows dy xhat,  db = sum_rows dy.
    For an upstream U of dx, with U_ = mean_j(U), C = mean_j(U xhat):
        d/dg = rstd (U - U_ - C xhat),  d/dxhat = -rstd (C g + B U),  d/drstd (the leading factor) =
        sum_j U (g - A - xhat B);
    then xhat = (x - mean) rstd carries d/dxhat to x, mean and rstd.
    """
    ct = mean.dtype
    M = mean.numel()
    D = x.numel() // M if M else 0
    x2 = x.reshape(M, D).to(ct)
    dy2 = dy.reshape(M, D).to(ct)
    mu = mean.reshape(M, 1)
    r = rstd.reshape(M, 1)
    xc = x2 - mu
    xhat = xc * r
    w = weight.reshape(1, D).to(ct) if weight is not None else None
    g = dy2 * w if w is not None else dy2

    d_g = d_xhat = d_r = d_dy = None
    if grad_dx is not None:
        U = grad_dx.reshape(M, D).to(ct)
        A = g.mean(1, keepdim=True)
        B = (g * xhat).mean(1, keepdim=True)
        C = (U * xhat).mean(1, keepdim=True)
        d_g = r * (U - U.mean(1, keepdim=True) - C * xhat)
        d_xhat = -r * (C * g + B * U)
        d_r = (U * (g - A - xhat * B)).sum(1, keepdim=True)
        d_dy = d_g * w if w is not None else d_g
    if grad_dw is not None and need_dw:
        vw = grad_dw.reshape(1, D).to(ct)
        d_dy = _add(d_dy, vw * xhat)
        d_xhat = _add(d_xhat, vw * dy2)
    if grad_db is not None and need_db:
        d_dy = _add(d_dy, grad_db.reshape(1, D).to(ct).expand(M, D))

    d_x = d_mean = None
    if d_xhat is not None:
        d_x = d_xhat * r
        d_mean = -d_x.sum(1)
        d_r = _add(d_r, (d_xhat * xc).sum(1, keepdim=True))
    d_w = None
    if d_g is not None and w is not None:
        d_w = (d_g * dy2).sum(0)

    def out(t, like, i):
        return t.reshape(like.shape).to(like.dtype) if t is not None and needs_input_grad[i] else None

    return (out(d_dy, dy, 0), out(d_x, x, 1), out(d_mean, mean, 2), out(d_r, rstd, 3), out(d_w, weight, 4))


def _register():
    """Teach torch.library the kernels' output shapes (for torch.compile) and the backward op's gradient
    (the forward op's is C++, csrc/autograd/layer_norm_autograd.cpp, as light per call as torch's own ops).

    layer_norm_fwd's mean and rstd are differentiable outputs and layer_norm_bwd has a gradient of its
    own, so that create_graph=True (double backward, gradient penalties) differentiates the backward
    rather than taking it as a constant: the second derivative in x runs through mean and rstd too.
    Outside such graphs nothing uses mean and rstd, and their gradients stay None (not materialized)."""

    @torch.library.register_fake("accel::layer_norm_fwd")
    def _fwd_fake(x, weight, bias, normalized_ndim, eps):
        rows = _numel(x.shape[: x.dim() - normalized_ndim])
        y = torch.empty_like(x, memory_format=torch.contiguous_format)
        return y, x.new_empty((rows,), dtype=_stat_dtype(x)), x.new_empty((rows,), dtype=_stat_dtype(x))

    @torch.library.register_fake("accel::layer_norm_bwd")
    def _bwd_fake(dy, x, mean, rstd, weight, bias, normalized_ndim, need_dweight, need_dbias):
        params = weight if weight is not None else bias
        pdtype = params.dtype if params is not None else x.dtype
        dx = torch.empty_like(x, memory_format=torch.contiguous_format)
        dw = torch.empty_like(weight, memory_format=torch.contiguous_format) if need_dweight \
            else x.new_empty((0,), dtype=pdtype)
        db = torch.empty_like(bias, memory_format=torch.contiguous_format) if need_dbias \
            else x.new_empty((0,), dtype=pdtype)
        return dx, dw, db

    def bwd_setup_context(ctx, inputs, output):
        dy, x, mean, rstd, weight, _bias, _normalized_ndim, need_dw, need_db = inputs
        ctx.save_for_backward(dy, x, mean, rstd, weight)
        ctx.need_dw, ctx.need_db = need_dw, need_db
        ctx.set_materialize_grads(False)

    def bwd_backward(ctx, grad_dx, grad_dw, grad_db):
        dy, x, mean, rstd, weight = ctx.saved_tensors
        grads = _bwd_backward(dy, x, mean, rstd, weight, ctx.need_dw, ctx.need_db,
                              grad_dx, grad_dw, grad_db, ctx.needs_input_grad)
        return (*grads, None, None, None, None)

    torch.library.register_autograd("accel::layer_norm_bwd", bwd_backward, setup_context=bwd_setup_context)


def _ops():
    return _build.ops("layer_norm", _register)


def _check(x, shape, weight, bias, eps):
    check_tensor("x", x)
    if x.dim() < len(shape) or tuple(x.shape[x.dim() - len(shape):]) != shape:
        raise ValueError(f"normalized_shape: expected the trailing dims of x, got {list(shape)} "
                         f"for x of shape {tuple(x.shape)}")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is None:
            continue
        check_tensor(name, p)
        if tuple(p.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape} (normalized_shape), got {tuple(p.shape)}")
    check_same_device(x=x, weight=weight, bias=bias)
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps >= 0:
        raise ValueError(f"eps: expected a real number >= 0, got {eps!r}")


def _kernel_params(x, weight, bias):
    """weight and bias in the one dtype the kernels take: x's, or fp32 beside fp16/bf16 x.
    Any other mix is cast (autograd carries the gradient back through the cast)."""
    given = [p for p in (weight, bias) if p is not None]
    if all(p.dtype == x.dtype for p in given):
        return weight, bias
    target = torch.float32 if x.dtype in _REDUCED else x.dtype
    cast = lambda p: p if p is None or p.dtype == target else p.to(target)  # noqa: E731
    return cast(weight), cast(bias)


def fused_layer_norm(x: torch.Tensor, normalized_shape, weight: torch.Tensor | None = None,
                     bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """Layer normalization over the trailing `normalized_shape` dims of x (like F.layer_norm).

    Args:
        x (Tensor[..., *normalized_shape]): fp32/fp16/bf16/fp64 input.
        normalized_shape (int or sequence of ints): the trailing dims normalized together.
        weight, bias (Tensor[*normalized_shape], optional): x's dtype, or fp32 beside fp16/bf16 x.
        eps (float): added to the variance.

    Returns:
        Tensor[x.shape]: in x's dtype.
    """
    return _layer_norm(x, _normalized_shape(normalized_shape), weight, bias, eps)


def _layer_norm(x, shape: tuple[int, ...], weight, bias, eps):
    if not torch.compiler.is_compiling():
        # the call a model makes every step, checked and run in C++ (None: anything else)
        y = _build.entries("layer_norm", _register).layer_norm(x, shape, weight, bias, eps)
        if y is not None:
            return y
    _check(x, shape, weight, bias, eps)
    if not use_kernel(x):
        return layer_norm_reference(x, shape, weight, bias, eps)
    weight, bias = _kernel_params(x, weight, bias)
    return _ops().layer_norm_fwd(x, weight, bias, len(shape), float(eps))[0]


class FusedLayerNorm(_TorchLayerNorm):
    """nn.LayerNorm running the fused kernels; same constructor, parameters and state_dict keys.

    A subclass of torch's own LayerNorm class (imported from its defining module, which
    accel.runtime.hooks never patches), so isinstance checks and init code written for
    nn.LayerNorm keep working, including while the hook has replaced torch.nn.LayerNorm.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # Under torch.compile the module steps aside: Inductor fuses the plain ops with their
            # neighbours (the residual add and dropout before a transformer's LayerNorm), which an
            # opaque custom op prevents. Measured: CPU fp32, Linear + dropout + residual + LayerNorm
            # [1024, 768] forward + backward 1.28x slower with the kernel; H100 BERT-base bf16 21.5 ms
            # vs 23.7 ms a step (accel.runtime.policy). fused_layer_norm itself still compiles to the kernel.
            return layer_norm_reference(input, self.normalized_shape, self.weight, self.bias, self.eps)
        # normalized_shape is the tuple nn.LayerNorm's constructor made: nothing to parse per call
        return _layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)
