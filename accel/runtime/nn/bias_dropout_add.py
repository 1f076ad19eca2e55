"""Fused bias-dropout-add: residual + dropout(x + bias), the tail of every transformer sub-layer.

    bias_dropout_add(x, bias, residual, prob, training)   residual + dropout(x + bias, prob)
    dropout_add_fused_train(x, to_add, drop_rate)         to_add + dropout(x, drop_rate)
    dropout_add_fused(x, to_add, drop_rate)               x + to_add (inference)

CPU and CUDA tensors run the kernels in csrc/{cpu,cuda}/bias_dropout_add.*: one pass reads x, bias and
residual and writes the output. The mask is not stored: the forward keeps the Philox (seed, offset) it
drew from torch's generator (16 bytes) and the backward regenerates the mask from it, so memory for
the backward is the same as for a plain add. Random numbers come from torch's default generator of the
input's device, so `torch.manual_seed` makes results reproducible. Other devices (XLA) run
`bias_dropout_add_reference`, which their compiler fuses.

Dropout: each element is kept with probability 1 - p and kept values are scaled by 1 / (1 - p);
p = 0 is the identity, p = 1 gives zeros. fp16/bf16 are computed in fp32 and rounded once.

The same Philox keep rule also serves a plain dropout, for models whose dropout is not followed by an add:

    philox_dropout(x, p, training)      F.dropout(x, p, training), the mask from accel::dropout_mask
    PhiloxDropout(p)                    nn.Dropout running philox_dropout

accel::dropout_mask draws only the keep mask (one byte per element, from torch's generator like the op
above); the rest is x * mask / (1 - p): under torch.compile plain ops, which Inductor fuses with the
neighbouring kernels (on CUDA, where Inductor's Triton code draws its masks vectorised, compiled code takes
torch's dropout and the reference instead: _inductor_draws); in eager code accel::dropout_fwd, called from
C++, which returns that mask and the scaled x (one pass writes both on CUDA; on the CPU the mask kernel,
then accel::masked_scale's one pass) and whose gradient is masked_scale's C++ node: one call costs the host
what nn.Dropout's does. Why: Inductor's CPU code draws each element's random number with a scalar Philox
of its own (~10 ns an element); dropout then took ~11% of a compiled BERT-base training step on the CPU,
and the kernel here draws 64 at a time.
"""
from __future__ import annotations

import itertools
import numbers

import torch
import torch.nn.functional as F
from torch.nn.modules.dropout import Dropout as _TorchDropout

from accel.runtime import _build
from accel.runtime.nn._common import check_same_device, check_tensor, use_kernel

__all__ = ["bias_dropout_add", "dropout_add_fused_train", "dropout_add_fused", "bias_dropout_add_reference",
           "philox_dropout", "PhiloxDropout", "swap_in_philox_dropout"]


def bias_dropout_add_reference(x, bias, residual, prob: float, training: bool):
    """Plain PyTorch, the definition (draws its mask from torch's own dropout, not ours)."""
    y = x if bias is None else x + bias
    return residual + F.dropout(y, prob, training)


def _check_p(p, name="p"):
    if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0.0 <= float(p) <= 1.0:
        raise ValueError(f"{name}: expected a number in [0, 1], got {p!r}")


def _check(x, bias, residual, prob, x_name="x", residual_name="residual", prob_name="prob"):
    check_tensor(x_name, x)
    check_tensor(residual_name, residual)
    _check_p(prob, prob_name)
    if residual.shape != x.shape:
        raise ValueError(f"{residual_name}: expected the shape of {x_name} {tuple(x.shape)}, "
                         f"got {tuple(residual.shape)}")
    if residual.dtype != x.dtype:
        raise ValueError(f"{residual_name}: expected the dtype of {x_name} ({x.dtype}), got {residual.dtype}")
    if bias is not None:
        check_tensor("bias", bias)
        if x.dim() == 0 or bias.shape != (x.shape[-1],):
            last = "a 0-dim x has none" if x.dim() == 0 else f"({x.shape[-1]},)"
            raise ValueError(f"bias: expected shape (x.shape[-1],) = {last}, got {tuple(bias.shape)}")
        if bias.dtype != x.dtype:
            raise ValueError(f"bias: expected the dtype of {x_name} ({x.dtype}), got {bias.dtype}")
    check_same_device(**{x_name: x, residual_name: residual, "bias": bias})


def _register():
    """Output shapes for torch.compile, and the backward op's gradient. The forward op's gradient is C++
    (csrc/autograd/bias_dropout_add_autograd.cpp, as light per call as torch's own ops): it regenerates
    the mask from rng_state by calling the backward op."""

    def fake_fwd(x, bias, residual, p, train):
        return torch.empty_like(x.contiguous()), torch.empty(2, dtype=torch.int64, device=x.device)

    torch.library.register_fake("accel::bias_dropout_add_fwd")(fake_fwd)
    def fake_bwd(grad, rng_state, p, bias_grad):
        if bias_grad and grad.dim() == 0:
            raise RuntimeError("bias_dropout_add_bwd: bias_grad needs a grad with a last dim")
        dbias = grad.new_empty(grad.shape[-1:] if bias_grad else (0,))
        return torch.empty_like(grad.contiguous()), dbias

    torch.library.register_fake("accel::bias_dropout_add_bwd")(fake_bwd)

    def fake_mask(size, p, *, device, call=0):
        return torch.empty(size, dtype=torch.bool, device=device)

    torch.library.register_fake("accel::dropout_mask")(fake_mask)

    def fake_masked_scale(x, mask, scale):
        torch._check(mask.dtype == torch.bool, lambda: f"masked_scale: mask: expected a bool tensor, got {mask.dtype}")
        torch._check(mask.shape == x.shape, lambda: f"masked_scale: mask: expected x's shape {tuple(x.shape)}, "
                                                    f"got {tuple(mask.shape)}")
        return torch.empty_like(x)

    torch.library.register_fake("accel::masked_scale")(fake_masked_scale)

    def fake_dropout_fwd(x, p):
        torch._check(x.is_floating_point(), lambda: f"dropout_fwd: x: expected a floating-point tensor, got {x.dtype}")
        torch._check(0.0 <= p <= 1.0, lambda: f"dropout_fwd: p: expected a float in [0, 1], got {p}")
        y = torch.empty_like(x, memory_format=torch.contiguous_format)
        return y, torch.empty(x.shape, dtype=torch.bool, device=x.device)

    torch.library.register_fake("accel::dropout_fwd")(fake_dropout_fwd)

    # bias_dropout_add_bwd(g) = (m * g, sum over rows of m * g), m = mask / (1 - p), is linear in g and
    # scales each element by itself, so its gradient is the same op on the incoming gradients:
    # m * (ggx + ggb broadcast over the rows). Registered so that create_graph=True (double backward,
    # gradient penalties) differentiates it rather than taking it as a constant.
    def bwd_setup_context(ctx, inputs, output):
        grad, rng_state, p, _bias_grad = inputs
        ctx.p = float(p)
        ctx.shape = grad.shape
        ctx.save_for_backward(rng_state)

    def bwd_backward(ctx, grad_dx, grad_dbias):
        (rng_state,) = ctx.saved_tensors
        incoming = grad_dx
        if grad_dbias is not None and grad_dbias.numel() > 0:
            spread = grad_dbias.expand(ctx.shape)
            incoming = spread if incoming is None else incoming + spread
        if incoming is None:
            return None, None, None, None
        return torch.ops.accel.bias_dropout_add_bwd(incoming, rng_state, ctx.p, False)[0], None, None, None

    torch.library.register_autograd("accel::bias_dropout_add_bwd", bwd_backward, setup_context=bwd_setup_context)


def _ops():
    return _build.ops("bias_dropout_add", _register)


def _inductor_draws(x: torch.Tensor) -> bool:
    """Whether torch.compile is tracing a CUDA tensor. Inductor's Triton code then draws the mask (vectorised
    Philox) inside the kernel it fuses around it, and an opaque op of ours would only split that kernel: a
    compiled softmax + dropout with accel::dropout_mask ran at 0.80x of the same with F.dropout on an H200
    at 1M fp32 (benchmarks/results/kernels_cuda_h200_run2.json; its 16M bf16 0.92x was timed eagerly past
    Dynamo's recompile limit). So under compile on CUDA the plain ops run. Drawing the mask with our kernel anyway
    (4 draws a Philox against Inductor's one) lost end to end: BERT-base 32x128 on an H200 8.8 ms a step against
    8.2 (gpu_h200_2026-11-28.md). On the CPU Inductor draws a scalar Philox per element, and ours stays (module
    docstring)."""
    return torch.compiler.is_compiling() and x.device.type == "cuda"


def _fused(x, bias, residual, prob, training):
    """The op on a call _check accepted: the kernels on CPU and CUDA tensors, the reference elsewhere (and
    under torch.compile on CUDA, _inductor_draws)."""
    if use_kernel(x) and not _inductor_draws(x):
        return _ops().bias_dropout_add_fwd(x, bias, residual, float(prob), bool(training))[0]
    return bias_dropout_add_reference(x, bias, residual, float(prob), bool(training))


def _entry(x, bias, residual, prob, training):
    """The call a model makes every step, checked and run in C++ (csrc/autograd/python_entry.h); None
    for anything else, and under torch.compile, which traces the general path."""
    if torch.compiler.is_compiling():
        return None
    return _build.entries("bias_dropout_add", _register).bias_dropout_add(x, bias, residual, prob, training)


def bias_dropout_add(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, prob: float,
                     training: bool) -> torch.Tensor:
    """residual + dropout(x + bias, prob) when training, residual + x + bias otherwise.

    bias has shape (x.shape[-1],) (or is None); residual has x's shape; all share dtype and device.
    """
    out = _entry(x, bias, residual, prob, training)
    if out is not None:
        return out
    _check(x, bias, residual, prob)
    return _fused(x, bias, residual, prob, training)


def dropout_add_fused_train(x: torch.Tensor, to_add: torch.Tensor, drop_rate: float) -> torch.Tensor:
    """to_add + dropout(x, drop_rate), for training (TorchAcc's fused_bias_dropout_add)."""
    out = _entry(x, None, to_add, drop_rate, True)
    if out is not None:
        return out
    _check(x, None, to_add, drop_rate, residual_name="to_add", prob_name="drop_rate")
    return _fused(x, None, to_add, drop_rate, True)


def dropout_add_fused(x: torch.Tensor, to_add: torch.Tensor, drop_rate: float) -> torch.Tensor:
    """x + to_add: the inference counterpart of dropout_add_fused_train (dropout is the identity).
    drop_rate is checked but unused, so the two calls are interchangeable."""
    out = _entry(x, None, to_add, drop_rate, False)
    if out is not None:
        return out
    _check(x, None, to_add, drop_rate, residual_name="to_add", prob_name="drop_rate")
    return _fused(x, None, to_add, drop_rate, False)


def philox_dropout(x: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
    """F.dropout(x, p, training, inplace), the keep mask drawn by accel's Philox kernel.

    Args:
        x (Tensor[...]): any floating dtype; CPU and CUDA tensors draw with accel::dropout_mask, others
            (XLA), integer tensors, p = 1, inplace=True and CUDA tensors under torch.compile (where
            Inductor's own fused dropout is faster) take F.dropout itself.
        p (float): the probability of zeroing an element, in [0, 1].
        training (bool): False returns x.

    Returns:
        Tensor[x.shape]: mask * x / (1 - p), mask a bool tensor with each element true with probability
        1 - p; dropped elements are multiplied by 0, so NaN and inf propagate as in torch's dropout.
    """
    if training and not inplace and not torch.compiler.is_compiling():
        # the call a model makes every step in training, checked and run in C++ (None: anything else)
        y = _build.entries("bias_dropout_add", _register).dropout(x, p)
        if y is not None:
            return y
    _check_p(p)
    if not training or p == 0.0:
        return x
    if (inplace or p == 1.0 or not isinstance(x, torch.Tensor) or not x.is_floating_point() or not use_kernel(x)
            or _inductor_draws(x)):
        return F.dropout(x, p, training, inplace)
    mask = _ops().dropout_mask(x.shape, float(p), device=x.device, call=dropout_mask_call())
    return mask * x * (1.0 / (1.0 - p))


_mask_calls = itertools.count(1)


@torch.compiler.assume_constant_result
def dropout_mask_call() -> int:
    """A number no other call of accel::dropout_mask in this process has had: its `call` argument, which only tells
    calls apart. AOTAutograd merges graph nodes of equal arguments whatever their tags (torch 2.9-2.13 spare aten's
    random ops only), so two dropouts of one shape and p in a compiled training graph would otherwise share one mask.
    Dynamo runs it while tracing (assume_constant_result): each traced call site gets its own constant."""
    return next(_mask_calls)


class PhiloxDropout(_TorchDropout):
    """nn.Dropout running philox_dropout: same constructor, attributes and state_dict (none).

    A subclass of torch's own Dropout class (imported from its defining module, which
    accel.runtime.hooks never patches), so isinstance(m, nn.Dropout) stays true.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return philox_dropout(input, self.p, self.training, self.inplace)


def swap_in_philox_dropout(model: torch.nn.Module) -> None:
    """Makes the torch nn.Dropout layers of `model` PhiloxDropout (same attributes: only where the mask comes
    from differs), this model's layers only (no process-wide hook)."""
    for module in model.modules():
        if type(module) is _TorchDropout:
            module.__class__ = PhiloxDropout

