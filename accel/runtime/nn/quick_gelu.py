"""QuickGELU: x * sigmoid(1.702 x), the GELU approximation of CLIP and GPT-style models.

`quick_gelu(x)` and the `QuickGelu` module run the kernels in csrc/{cpu,cuda}/quick_gelu.* for CPU
and CUDA tensors (fp16/bf16 computed in fp32), and `quick_gelu_reference` elsewhere.
"""
from __future__ import annotations

import torch
from torch import nn

from accel.runtime import _build
from accel.runtime.nn._common import check_tensor, use_kernel

ALPHA = 1.702


def quick_gelu_reference(x: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch: the definition, computed in fp32 for reduced-precision inputs."""
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    return (xf * torch.sigmoid(ALPHA * xf)).to(x.dtype)


def _register():
    """Teach torch.library the kernels' output shapes (for torch.compile) and gradient."""
    torch.library.register_fake("accel::quick_gelu")(lambda x: torch.empty_like(x.contiguous()))
    torch.library.register_fake("accel::quick_gelu_backward")(
        lambda grad, x: torch.empty_like(x.contiguous()))

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return torch.ops.accel.quick_gelu_backward(grad, x)

    torch.library.register_autograd("accel::quick_gelu", backward, setup_context=setup_context)


def _ops():
    return _build.ops("quick_gelu", _register)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    check_tensor("x", x)
    if use_kernel(x):
        return _ops().quick_gelu(x)
    return quick_gelu_reference(x)


class QuickGelu(nn.Module):
    """Drop-in for nn.GELU in models trained with QuickGELU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quick_gelu(x)
