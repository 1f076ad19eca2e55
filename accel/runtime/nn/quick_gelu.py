"""QuickGELU: x * sigmoid(1.702 x), the GELU approximation of CLIP and GPT-style models.

`quick_gelu(x)` and the `QuickGelu` module run the kernels in csrc/{cpu,cuda}/quick_gelu.* for CPU
and CUDA tensors (fp16/bf16 computed in fp32), and `quick_gelu_reference` elsewhere and under torch.compile
(Inductor fuses it with the ops around it, which beats a kernel of its own: _common.use_kernel_eagerly).
The result keeps x's memory format (channels-last, any permutation of dims) as torch's elementwise ops do,
and so does the gradient with respect to x.
"""
from __future__ import annotations

import torch
from torch import nn

from accel.runtime import _build
from accel.runtime.nn._common import FLOAT_DTYPES, check_tensor, use_kernel_eagerly

ALPHA = 1.702


def _opmath(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def quick_gelu_reference(x: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch: the definition, computed in fp32 for reduced-precision inputs."""
    xf = _opmath(x)
    return (xf * torch.sigmoid(ALPHA * xf)).to(x.dtype)


def _second_derivative(x: torch.Tensor) -> torch.Tensor:
    """d^2/dx^2 [x s(a x)] = a s (1 - s) (2 + a x (1 - 2 s)), in differentiable torch ops (in fp32 for
    fp16/bf16 x), so that third and higher derivatives follow by autograd. Multiplied as
    a (2 t + a (x t) (1 - 2 s)) with t = s (1 - s): t is 0 wherever s saturates, before a x (inf for
    |x| > max / a) can make inf * 0 = NaN of a finite input."""
    xf = _opmath(x)
    s = torch.sigmoid(ALPHA * xf)
    t = s * (1 - s)
    return ALPHA * (2 * t + ALPHA * (xf * t) * (1 - 2 * s))


def _register():
    """Teach torch.library the kernels' output shapes (for torch.compile) and the backward op's gradient.
    The forward op's gradient is C++ (csrc/autograd/quick_gelu_autograd.cpp, as light per call as
    torch's own ops) and calls the backward op; that one has a gradient of its own, so create_graph=True
    (double backward, gradient penalties) differentiates through it instead of treating it as a constant."""
    # The kernels' layout (csrc/cpu/quick_gelu.cpp): empty_like(x)'s, which is x's strides for a
    # non-overlapping and dense x (channels-last, permuted), as torch's elementwise ops keep them.
    torch.library.register_fake("accel::quick_gelu_fwd")(lambda x: torch.empty_like(x))
    torch.library.register_fake("accel::quick_gelu_bwd")(lambda grad, x: torch.empty_like(x))

    # quick_gelu_bwd(g, x) = g f'(x): linear in g, whose gradient is therefore the same op again,
    # and g f''(x) in x.
    def backward_setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def backward_backward(ctx, grad_dx):
        grad, x = ctx.saved_tensors
        d_grad = d_x = None
        if ctx.needs_input_grad[0]:
            d_grad = torch.ops.accel.quick_gelu_bwd(grad_dx, x)
        if ctx.needs_input_grad[1]:
            d_x = (_opmath(grad_dx) * _opmath(grad) * _second_derivative(x)).to(x.dtype)
        return d_grad, d_x

    torch.library.register_autograd("accel::quick_gelu_bwd", backward_backward,
                                    setup_context=backward_setup_context)


def _ops():
    return _build.ops("quick_gelu", _register)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    # the common call (a float tensor on the CPU or a GPU) goes straight to the kernel; anything else
    # is checked, which names what is wrong, or takes the reference (XLA, and torch.compile, which fuses it)
    if isinstance(x, torch.Tensor) and x.dtype in FLOAT_DTYPES and use_kernel_eagerly(x):
        return _ops().quick_gelu_fwd(x)
    check_tensor("x", x)
    if use_kernel_eagerly(x):
        return _ops().quick_gelu_fwd(x)
    return quick_gelu_reference(x)


class QuickGelu(nn.Module):
    """Drop-in for nn.GELU in models trained with QuickGELU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quick_gelu(x)
