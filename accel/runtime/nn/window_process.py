"""Swin Transformer window ops: cyclic shift + window partition, and window merge + shift back.

    x_windows = WindowProcess.apply(x, B, H, W, C, -shift_size, window_size)
        == window_partition(torch.roll(x, (-shift_size, -shift_size), (1, 2)), window_size)
    x = WindowProcessReverse.apply(attn_windows, B, H, W, C, shift_size, window_size)
        == torch.roll(window_reverse(attn_windows, window_size, H, W), (shift_size, shift_size), (1, 2))

x is [B, H, W, C]; windows are [B*nW, window_size, window_size, C] with nW = (H/ws)*(W/ws), ordered
like Swin's window_partition. The shift is torch.roll's, positive or negative, any int64 but -2**63 (whose
negation, the backward's shift, is no int64); sizes are int64 too, others raise a ValueError naming them.
Each op is one gather pass (csrc/{cpu,cuda}/window_process.*) instead of a roll followed by a permute
copy; its backward is the other op with the opposite shift. CPU and CUDA tensors run the kernels (any float
dtype: they copy bytes), other devices (XLA) run the plain-PyTorch reference below, and so does torch.compile
where Inductor does better with it (_kernel_for).
"""
from __future__ import annotations

import torch

from accel.runtime import _build
from accel.runtime.nn._common import FLOAT_DTYPES, check_tensor, use_kernel
from accel.utils.checks import check_int


def _kernel_for(t: torch.Tensor) -> bool:
    """Whether t takes the kernels. Under torch.compile only 16-bit tensors on the CPU do: elsewhere Inductor
    fuses the roll and the permute into the kernels next to them, which beats an opaque op's extra pass, and
    on the CPU its code for 16-bit dtypes does not (benchmarks/kernel_cases/window_process.py, compiled
    LayerNorm -> partition -> reverse, fwd + bwd, 2-core CPU, 2026-11-27, the ops in the graph against plain
    ops: 0.19-0.54x in fp32; in bf16 1.5-3.1x at Swin stage 1 and 0.79-0.94x at stage 3, which moves a
    quarter of stage 1's bytes; CUDA not yet measured)."""
    return use_kernel(t) and (not torch.compiler.is_compiling() or (t.is_cpu and t.element_size() == 2))


def window_partition(x: torch.Tensor, window_size: int) -> torch.Tensor:
    """[B, H, W, C] -> [B*nW, ws, ws, C], windows in row-major order of (b, window row, window col)."""
    B, H, W, C = x.shape
    ws = window_size
    x = x.reshape(B, H // ws, ws, W // ws, ws, C)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, ws, ws, C)


def window_reverse(windows: torch.Tensor, window_size: int, H: int, W: int) -> torch.Tensor:
    """Inverse of window_partition: [B*nW, ws, ws, C] -> [B, H, W, C]."""
    ws = window_size
    B = windows.shape[0] // ((H // ws) * (W // ws))
    x = windows.reshape(B, H // ws, W // ws, ws, ws, -1)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(B, H, W, -1)


def window_process_reference(x: torch.Tensor, shift: int, window_size: int) -> torch.Tensor:
    return window_partition(torch.roll(x, (shift, shift), (1, 2)), window_size)


def window_process_reverse_reference(windows: torch.Tensor, H: int, W: int, shift: int,
                                     window_size: int) -> torch.Tensor:
    return torch.roll(window_reverse(windows, window_size, H, W), (shift, shift), (1, 2))


def _register():
    """Output shapes for torch.compile. The raw ops' gradients (each other's inverse) are C++
    (csrc/autograd/window_process_autograd.cpp), as light per call as torch's own ops."""
    def partition_fake(x, window_size, shift):
        B, H, W, C = x.shape
        return x.new_empty((B * (H // window_size) * (W // window_size), window_size, window_size, C))

    def reverse_fake(windows, H, W, window_size, shift):
        nW = (H // window_size) * (W // window_size)
        return windows.new_empty((windows.shape[0] // nW, H, W, windows.shape[3]))

    torch.library.register_fake("accel::window_process_partition")(partition_fake)
    torch.library.register_fake("accel::window_process_reverse")(reverse_fake)


def _ops():
    return _build.ops("window_process", _register)


# The ops take int64 sizes and shift. The shift's range is symmetric, [-(2**63 - 1), 2**63 - 1]: each op's
# backward is the other op with the shift negated, and -(-2**63) does not fit in an int64 (it wrapped
# to -2**63 itself, a different shift modulo most H, and gave a wrong gradient).
_INT64_MAX = 2 ** 63 - 1


def _as_int(name: str, value, minimum: int) -> int:
    return check_int(name, value, min=minimum, max=_INT64_MAX)


def _check_geometry(B, H, W, C, shift_size, window_size):
    B = _as_int("B", B, 0)
    H = _as_int("H", H, 1)
    W = _as_int("W", W, 1)
    C = _as_int("C", C, 0)
    shift = _as_int("shift_size", shift_size, -_INT64_MAX)
    ws = _as_int("window_size", window_size, 1)
    if H % ws or W % ws:
        raise ValueError(f"window_size: expected a divisor of H={H} and W={W}, got {ws}")
    if H * W * max(C, 1) > _INT64_MAX:  # the kernels' window count and torch's strides for [B, H, W, C]
        raise ValueError(f"H, W, C: expected H * W * max(C, 1) <= 2**63 - 1, got H={H}, W={W}, C={C}")
    return B, H, W, C, shift, ws


def _partition(x, H, W, shift, ws):
    if _kernel_for(x):
        return _ops().window_process_partition(x, ws, shift)
    return window_process_reference(x, shift, ws)


def _reverse(windows, H, W, shift, ws):
    if _kernel_for(windows):
        return _ops().window_process_reverse(windows, H, W, ws, shift)
    return window_process_reverse_reference(windows, H, W, shift, ws)


def _common_call(t, B, H, W, C, shift_size, window_size) -> bool:
    """True for the call a Swin block makes every step, but for t's shape (each op checks its own): a
    float tensor t on the CPU or a GPU, the sizes positive ints, window_size a divisor of H and W, the
    shift an int in _as_int's range (written as literals, cheaper than globals). With B and C positive,
    t's shape (which the caller compares) bounds B*H*W*C by t.numel() < 2**63, so every size and product
    the kernels compute fits their int64; an empty batch or C = 0 takes the checked path. It accepts only
    valid calls and costs a few attribute reads; anything else goes through the checks that name what is
    wrong, and the general path."""
    return type(B) is int and type(H) is int and type(W) is int and type(C) is int \
        and type(shift_size) is int and type(window_size) is int \
        and B > 0 and C > 0 and H > 0 and W > 0 and window_size > 0 \
        and not H % window_size and not W % window_size \
        and -_INT64_MAX <= shift_size <= _INT64_MAX \
        and type(t) is torch.Tensor and _kernel_for(t) and t.dtype in FLOAT_DTYPES


# Plain classes called as WindowProcess.apply(...), the interface of the torch.autograd.Function each
# once was: the gradient is the one registered for the kernel ops (csrc/autograd/window_process_autograd.cpp,
# which composes with torch.compile and higher-order autograd), or plain autograd through the reference
# elsewhere.
class WindowProcess:
    """windows = window_partition(torch.roll(x, (shift_size, shift_size), (1, 2)), window_size)."""

    @staticmethod
    def apply(x, B, H, W, C, shift_size, window_size):
        if _common_call(x, B, H, W, C, shift_size, window_size) and x.shape == (B, H, W, C):
            return _ops().window_process_partition(x, window_size, shift_size)
        B, H, W, C, shift, ws = _check_geometry(B, H, W, C, shift_size, window_size)
        check_tensor("x", x, ndim=4)
        if tuple(x.shape) != (B, H, W, C):
            raise ValueError(f"x: expected shape (B, H, W, C) = {(B, H, W, C)}, got {tuple(x.shape)}")
        return _partition(x, H, W, shift, ws)


class WindowProcessReverse:
    """x = torch.roll(window_reverse(windows, window_size, H, W), (shift_size, shift_size), (1, 2))."""

    @staticmethod
    def apply(windows, B, H, W, C, shift_size, window_size):
        if _common_call(windows, B, H, W, C, shift_size, window_size) \
                and windows.shape == (B * (H // window_size) * (W // window_size), window_size, window_size, C):
            return _ops().window_process_reverse(windows, H, W, window_size, shift_size)
        B, H, W, C, shift, ws = _check_geometry(B, H, W, C, shift_size, window_size)
        check_tensor("windows", windows, ndim=4)
        expected = (B * (H // ws) * (W // ws), ws, ws, C)
        if tuple(windows.shape) != expected:
            raise ValueError(f"windows: expected shape (B*nW, window_size, window_size, C) = {expected}, "
                             f"got {tuple(windows.shape)}")
        return _reverse(windows, H, W, shift, ws)
