"""Deformable convolution: DCN v1 and the modulated DCN v2, forward and backward.

`deform_conv2d` is a drop-in for torchvision.ops.deform_conv2d (same arguments, offset layout and
results). The modules follow the Python API of the widely used dcn_v2 package
(github.com/CharlesShang/DCNv2), as TorchAcc's guide imports them::

    from accel.runtime.nn.dcn_v2 import DCN, DCNv2
    conv = DCN(chi, cho, kernel_size, stride, padding, dilation, deformable_groups)

- `DCNv2(in, out, k, stride, padding, dilation=1, deformable_groups=1)`: weight and bias, with
  forward(input, offset, mask) taking the offsets and mask from the caller.
- `DCN(...)`: a DCNv2 that predicts its own offsets and mask from its input with a conv of the same
  geometry (`conv_offset_mask`, 3*deformable_groups*kh*kw output channels: the first two thirds are
  the offsets, the last third goes through a sigmoid to make the mask). That conv starts at zero, so
  a fresh DCN samples the regular grid with every mask value sigmoid(0) = 0.5: it computes
  0.5 * conv2d(input, weight) + bias, exactly as dcn_v2's and mmcv's DCN do at initialisation.
  Unlike dcn_v2, conv_offset_mask also takes the layer's dilation, so that its output always has
  the deformable conv's output size (dcn_v2 leaves it at 1, which fails for dilated layers with
  padding below the dilated kernel's half-width). The parameter names and shapes are dcn_v2's, so
  its state_dicts load as they are.
- `dcn_v2_conv(input, offset, mask, weight, bias, stride, padding, dilation, deformable_groups)`:
  dcn_v2's functional form, argument order included.

CPU and CUDA tensors run the kernels in csrc/{cpu,cuda}/dcn_v2.* (accel::dcn_v2_fwd / dcn_v2_bwd),
which process the whole batch at once: the sampling (im2col) and its backward in one parallel pass
over the batch (at::parallel_for on CPU, one kernel launch on CUDA), the two GEMMs batched over the
samples. float16/bfloat16 are sampled in float32 and the backward runs in float32; the CUDA forward's GEMM
takes float16/bfloat16 columns (tensor cores, float32 accumulation, as torchvision's), the CPU's
float32 ones; float64 is computed in float64. Other devices (XLA) run
`deform_conv2d_reference`, plain PyTorch (gathers), which autograd differentiates. Double backward
is not supported (as in torchvision).

Sampling (torchvision's definition): output pixel (i, j), kernel tap (a, b) of offset group g reads
input[c] at y = i*stride_h - pad_h + a*dil_h + dy, x = j*stride_w - pad_w + b*dil_w + dx by
bilinear interpolation, the image being zero outside its plane, a point outside (-1, H) x (-1, W)
giving 0; with a mask, that value is multiplied by mask[g*K + a*kw + b] at (i, j). dy and dx are
offset channels g*2K + 2(a*kw + b) and the one after it. A NaN offset samples 0.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

from accel.runtime import _build
from accel.runtime.nn._common import FLOAT_DTYPES, check_tensor, use_kernel

_REDUCED = (torch.float16, torch.bfloat16)

# ------------------------------------------------------------------ argument checks


def _is_int(v) -> bool:
    return isinstance(v, (int, torch.SymInt)) and not isinstance(v, bool)


def _pair(name: str, value, minimum: int) -> tuple[int, int]:
    """(v, v) for an int, the two ints of a pair; TypeError / ValueError naming `name` otherwise."""
    if _is_int(value):
        pair = (value, value)
    elif isinstance(value, (tuple, list, torch.Size)):
        if len(value) != 2:
            raise ValueError(f"{name}: expected an int or a pair of ints, got {len(value)} values {tuple(value)}")
        if not all(_is_int(v) for v in value):
            raise TypeError(f"{name}: expected an int or a pair of ints, got {tuple(value)!r}")
        pair = (value[0], value[1])
    else:
        raise TypeError(f"{name}: expected an int or a pair of ints, got {type(value).__name__}")
    if pair[0] < minimum or pair[1] < minimum:
        raise ValueError(f"{name}: expected values >= {minimum}, got {pair}")
    return pair


class _Geometry(NamedTuple):
    batch: int
    out_channels: int
    out_h: int
    out_w: int
    groups: int
    offset_groups: int
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]


def _check_args(input, offset, weight, bias, mask, stride, padding, dilation) -> _Geometry:
    """Validate deform_conv2d's arguments (the kernels re-check them); TypeError for a wrong type or
    dtype, ValueError for a wrong shape, device or value, each naming the argument."""
    check_tensor("input", input, ndim=4)
    check_tensor("offset", offset, ndim=4)
    check_tensor("weight", weight, ndim=4)
    if bias is not None:
        check_tensor("bias", bias, ndim=1)
    if mask is not None:
        check_tensor("mask", mask, ndim=4)
    for name, t in (("offset", offset), ("weight", weight), ("bias", bias), ("mask", mask)):
        if t is None:
            continue
        if t.dtype != input.dtype:
            raise TypeError(f"{name}: expected input's dtype {str(input.dtype).replace('torch.', '')}, "
                            f"got {str(t.dtype).replace('torch.', '')}")
        if t.device != input.device:
            raise ValueError(f"{name}: expected a tensor on {input.device} (input's device), got {t.device}")
    stride = _pair("stride", stride, 1)
    padding = _pair("padding", padding, 0)
    dilation = _pair("dilation", dilation, 1)

    batch, channels, height, width = input.shape
    out_channels, channels_per_group, kh, kw = weight.shape
    if channels_per_group == 0 or kh == 0 or kw == 0 or out_channels == 0:
        raise ValueError(f"weight: expected [out_channels, in_channels / groups, kh, kw] with non-zero sizes, "
                         f"got {tuple(weight.shape)}")
    if channels % channels_per_group != 0:
        raise ValueError(f"weight: size(1) = {channels_per_group} must divide input's {channels} channels "
                         f"(it is in_channels / groups)")
    groups = channels // channels_per_group
    if out_channels % groups != 0:
        raise ValueError(f"weight: size(0) = {out_channels} must be a multiple of groups = {groups} "
                         f"(input channels / weight.size(1))")
    span_h, span_w = dilation[0] * (kh - 1) + 1, dilation[1] * (kw - 1) + 1
    if height + 2 * padding[0] < span_h or width + 2 * padding[1] < span_w:
        raise ValueError(f"input: the padded input ({height + 2 * padding[0]}x{width + 2 * padding[1]}) is smaller "
                         f"than the dilated kernel ({span_h}x{span_w})")
    out_h = (height + 2 * padding[0] - span_h) // stride[0] + 1
    out_w = (width + 2 * padding[1] - span_w) // stride[1] + 1
    taps = kh * kw
    if offset.shape[1] == 0 or offset.shape[1] % (2 * taps) != 0:
        raise ValueError(f"offset: size(1) must be 2 * offset_groups * kh * kw, a positive multiple of "
                         f"{2 * taps}, got {offset.shape[1]}")
    offset_groups = offset.shape[1] // (2 * taps)
    if channels % offset_groups != 0:
        raise ValueError(f"offset: its {offset_groups} offset groups must divide input's {channels} channels")
    expected = (batch, offset.shape[1], out_h, out_w)
    if tuple(offset.shape) != expected:
        raise ValueError(f"offset: expected shape {expected} [batch, 2*offset_groups*kh*kw, out_h, out_w], "
                         f"got {tuple(offset.shape)}")
    if mask is not None:
        expected = (batch, offset_groups * taps, out_h, out_w)
        if tuple(mask.shape) != expected:
            raise ValueError(f"mask: expected shape {expected} [batch, offset_groups*kh*kw, out_h, out_w], "
                             f"got {tuple(mask.shape)}")
    if bias is not None and tuple(bias.shape) != (out_channels,):
        raise ValueError(f"bias: expected shape ({out_channels},) (weight.size(0)), got {tuple(bias.shape)}")
    return _Geometry(batch, out_channels, out_h, out_w, groups, offset_groups, stride, padding, dilation)


def _fast_pair(value, minimum: int):
    """_pair for the values a model passes (an int, or the tuple DCNv2's constructor made); None for
    anything else, or out of range, which _pair then explains."""
    if type(value) is int:
        value = (value, value)
    elif type(value) is not tuple or len(value) != 2 or type(value[0]) is not int or type(value[1]) is not int:
        return None
    return value if value[0] >= minimum and value[1] >= minimum else None


def _common_call(input, offset, weight, bias, mask, stride, padding, dilation, offset_groups=None):
    """(stride, padding, dilation) for the call a model makes every step, None for any other.

    That call: float tensors of one dtype on one CPU or CUDA device, of the shapes _check_args asks
    for, int or pair-of-int conv arguments in range, and (offset_groups, where given) offsets of that
    many groups. It accepts only valid calls, so the kernel may run at once, and costs a few attribute
    reads; anything else goes through _check_args, which names what is wrong, and the general path."""
    tensor, param = torch.Tensor, nn.Parameter
    if type(input) is not tensor or type(offset) is not tensor or not use_kernel(input):
        return None
    dtype, device = input.dtype, input.device
    if dtype not in FLOAT_DTYPES or input.dim() != 4 or offset.dim() != 4 or offset.dtype != dtype \
            or offset.device != device:
        return None
    for t, ndim in ((weight, 4), (bias, 1), (mask, 4)):
        if t is not None and ((type(t) is not tensor and type(t) is not param) or t.dim() != ndim
                              or t.dtype != dtype or t.device != device):
            return None
    if weight is None:
        return None
    stride, padding, dilation = _fast_pair(stride, 1), _fast_pair(padding, 0), _fast_pair(dilation, 1)
    if stride is None or padding is None or dilation is None:
        return None
    batch, channels, height, width = input.shape
    out_channels, per_group, kh, kw = weight.shape
    if not (channels and out_channels and per_group and kh and kw) or channels % per_group \
            or out_channels % (channels // per_group):
        return None
    span_h, span_w = dilation[0] * (kh - 1) + 1, dilation[1] * (kw - 1) + 1
    if height + 2 * padding[0] < span_h or width + 2 * padding[1] < span_w:
        return None
    out_h = (height + 2 * padding[0] - span_h) // stride[0] + 1
    out_w = (width + 2 * padding[1] - span_w) // stride[1] + 1
    taps = kh * kw
    groups = offset.shape[1] // (2 * taps)
    if not groups or offset.shape != (batch, 2 * taps * groups, out_h, out_w) or channels % groups \
            or (offset_groups is not None and groups != offset_groups) \
            or (mask is not None and mask.shape != (batch, groups * taps, out_h, out_w)) \
            or (bias is not None and bias.shape != (out_channels,)):
        return None
    return stride, padding, dilation


# ------------------------------------------------------------------ reference (plain PyTorch)


def deform_conv2d_reference(input: torch.Tensor, offset: torch.Tensor, weight: torch.Tensor,
                            bias: torch.Tensor | None = None, stride=1, padding=0, dilation=1,
                            mask: torch.Tensor | None = None) -> torch.Tensor:
    """deform_conv2d in plain PyTorch: bilinear sampling by explicit gathers, then one matmul.

    Same contract as `deform_conv2d`; differentiable by autograd (in every argument), and free of
    data-dependent shapes, so it also runs on XLA. Memory: a [batch, in_channels * kh * kw,
    out_h * out_w] column tensor, and four gathers of that size. float16/bfloat16 are computed in
    float32 and rounded once.
    """
    geo = _check_args(input, offset, weight, bias, mask, stride, padding, dilation)
    return _reference(input, offset, weight, bias, mask, geo)


def _reference(input, offset, weight, bias, mask, geo: _Geometry) -> torch.Tensor:
    ct = torch.float32 if input.dtype in _REDUCED else input.dtype
    batch, channels, height, width = input.shape
    kh, kw = weight.shape[2:]
    taps, groups, og = kh * kw, geo.groups, geo.offset_groups
    out_h, out_w = geo.out_h, geo.out_w
    dev = input.device
    off = offset.to(ct).reshape(batch, og, taps, 2, out_h, out_w)
    # base sampling rows and columns of every (tap, output row / column), then the offsets on top
    tap_row = torch.arange(kh, device=dev).repeat_interleave(kw)
    tap_col = torch.arange(kw, device=dev).repeat(kh)
    rows = torch.arange(out_h, device=dev) * geo.stride[0] - geo.padding[0]
    cols = torch.arange(out_w, device=dev) * geo.stride[1] - geo.padding[1]
    base_y = (rows[None, :] + tap_row[:, None] * geo.dilation[0]).to(ct)  # [K, out_h]
    base_x = (cols[None, :] + tap_col[:, None] * geo.dilation[1]).to(ct)  # [K, out_w]
    y = base_y[None, None, :, :, None] + off[:, :, :, 0]  # [B, og, K, out_h, out_w]
    x = base_x[None, None, :, None, :] + off[:, :, :, 1]
    # [-1, H) x [-1, W): where a neighbour lies in the image (see csrc/dcn_v2_host.h, make_tap)
    inside = (y >= -1) & (y < height) & (x >= -1) & (x < width)
    y_floor, x_floor = torch.floor(y), torch.floor(x)
    ly, lx = y - y_floor, x - x_floor
    hy, hx = 1 - ly, 1 - lx
    # Outside points are masked out below; zeroing their corner first keeps the integer conversion
    # defined for huge or NaN offsets.
    zero = torch.zeros((), dtype=ct, device=dev)
    y0 = torch.where(inside, y_floor, zero).long()
    x0 = torch.where(inside, x_floor, zero).long()

    per_group = channels // og
    planes = input.to(ct).reshape(batch, og, per_group, height * width)
    n = taps * out_h * out_w
    value = None
    for dy, dx, w in ((0, 0, hy * hx), (0, 1, hy * lx), (1, 0, ly * hx), (1, 1, ly * lx)):
        yi, xi = y0 + dy, x0 + dx
        ok = inside & (yi >= 0) & (yi < height) & (xi >= 0) & (xi < width)
        index = (yi.clamp(0, height - 1) * width + xi.clamp(0, width - 1)).reshape(batch, og, 1, n)
        v = torch.gather(planes, 3, index.expand(batch, og, per_group, n)).reshape(
            batch, og, per_group, taps, out_h, out_w)
        # where, not weight * ok: a zero weight times an inf/NaN pixel under a clamped index is NaN
        term = torch.where(ok[:, :, None], w[:, :, None] * v, zero)
        value = term if value is None else value + term
    if mask is not None:
        value = value * mask.to(ct).reshape(batch, og, 1, taps, out_h, out_w)
    columns = value.reshape(batch, groups, (channels // groups) * taps, out_h * out_w)
    w = weight.to(ct).reshape(groups, geo.out_channels // groups, (channels // groups) * taps)
    out = torch.matmul(w, columns).reshape(batch, geo.out_channels, out_h, out_w)
    if bias is not None:
        out = out + bias.to(ct)[None, :, None, None]
    return out.to(input.dtype)


# ------------------------------------------------------------------ kernels


def _register():
    """Fake kernels (output shapes for torch.compile, with the same checks as the API). The forward op's
    gradient is C++ (csrc/autograd/dcn_v2_autograd.cpp), as light per call as torch's own ops: it calls
    dcn_v2_bwd, which has no gradient of its own (no double backward)."""

    @torch.library.register_fake("accel::dcn_v2_fwd")
    def _fwd_fake(input, offset, weight, bias, mask, stride, padding, dilation):
        geo = _check_args(input, offset, weight, bias, mask, stride, padding, dilation)
        return input.new_empty((geo.batch, geo.out_channels, geo.out_h, geo.out_w))

    @torch.library.register_fake("accel::dcn_v2_bwd")
    def _bwd_fake(grad_output, input, offset, weight, mask, stride, padding, dilation):
        geo = _check_args(input, offset, weight, None, mask, stride, padding, dilation)
        check_tensor("grad_output", grad_output, ndim=4)
        expected = (geo.batch, geo.out_channels, geo.out_h, geo.out_w)
        if tuple(grad_output.shape) != expected:
            raise ValueError(f"grad_output: expected shape {expected}, got {tuple(grad_output.shape)}")
        if grad_output.device != input.device:
            raise ValueError(f"grad_output: expected a tensor on {input.device} (input's device), "
                             f"got {grad_output.device}")
        contiguous = torch.contiguous_format
        return (torch.empty_like(input, memory_format=contiguous),
                torch.empty_like(offset, memory_format=contiguous),
                torch.empty_like(mask, memory_format=contiguous) if mask is not None else input.new_empty((0,)),
                torch.empty_like(weight, memory_format=contiguous),
                weight.new_empty((geo.out_channels,)))


def _ops():
    return _build.ops("dcn_v2", _register)


# ------------------------------------------------------------------ public API


def deform_conv2d(input: torch.Tensor, offset: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  stride=1, padding=0, dilation=1, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Deformable convolution (DCN v1), or modulated deformable convolution (DCN v2) when `mask` is given.

    Same arguments, layouts and results as torchvision.ops.deform_conv2d (sampling: see the module doc).

    Args:
        input (Tensor[batch, in_channels, H, W]): the input; float32, float64, float16 or bfloat16.
        offset (Tensor[batch, 2 * offset_groups * kh * kw, out_h, out_w]): for each offset group and
            kernel tap (row-major), the (dy, dx) displacement of its sampling point at every output
            pixel. offset_groups, which must divide in_channels, is read from its size.
        weight (Tensor[out_channels, in_channels / groups, kh, kw]): the filters; groups is read from
            in_channels / weight.size(1).
        bias (Tensor[out_channels], optional): added to every output pixel.
        stride (int or (int, int)): >= 1. Default 1.
        padding (int or (int, int)): zero padding on each side, >= 0. Default 0.
        dilation (int or (int, int)): spacing of the kernel taps, >= 1. Default 1.
        mask (Tensor[batch, offset_groups * kh * kw, out_h, out_w], optional): factors of the
            sampled values (DCN v2's modulation); None multiplies by 1.

        offset, weight, bias and mask must have input's dtype and device.
        out_h = (H + 2 * padding_h - (dilation_h * (kh - 1) + 1)) // stride_h + 1, likewise out_w.

    Returns:
        Tensor[batch, out_channels, out_h, out_w]: the output, in input's dtype.

    Raises:
        TypeError: an argument of the wrong type or dtype (message names it).
        ValueError: a wrong shape, device or value (message names it).
    """
    conv = _common_call(input, offset, weight, bias, mask, stride, padding, dilation)
    if conv is None:
        geo = _check_args(input, offset, weight, bias, mask, stride, padding, dilation)
        if not use_kernel(input):
            return _reference(input, offset, weight, bias, mask, geo)
        conv = geo.stride, geo.padding, geo.dilation
    return _ops().dcn_v2_fwd(input, offset, weight, bias, mask, *conv)


def dcn_v2_conv(input: torch.Tensor, offset: torch.Tensor, mask: torch.Tensor | None, weight: torch.Tensor,
                bias: torch.Tensor | None, stride, padding, dilation, deformable_groups: int) -> torch.Tensor:
    """dcn_v2's functional form: `deform_conv2d` with dcn_v2's argument order, checking that offset
    and mask have `deformable_groups` groups.

    Returns:
        Tensor[batch, out_channels, out_h, out_w], as `deform_conv2d`.
    """
    _check_offset_groups(offset, mask, weight, deformable_groups)
    return deform_conv2d(input, offset, weight, bias, stride, padding, dilation, mask)


def _check_offset_groups(offset, mask, weight, deformable_groups) -> None:
    if not _is_int(deformable_groups):
        raise TypeError(f"deformable_groups: expected an int, got {type(deformable_groups).__name__}")
    if deformable_groups < 1:
        raise ValueError(f"deformable_groups: expected >= 1, got {deformable_groups}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 4:
        return  # deform_conv2d names the bad weight
    taps = weight.shape[2] * weight.shape[3]
    if isinstance(offset, torch.Tensor) and offset.dim() == 4 and offset.shape[1] != 2 * deformable_groups * taps:
        raise ValueError(f"offset: expected 2 * deformable_groups * kh * kw = {2 * deformable_groups * taps} "
                         f"channels, got {offset.shape[1]}")
    if isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[1] != deformable_groups * taps:
        raise ValueError(f"mask: expected deformable_groups * kh * kw = {deformable_groups * taps} channels, "
                         f"got {mask.shape[1]}")


def _positive_int(name: str, value, minimum: int = 1) -> int:
    if not _is_int(value):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: expected >= {minimum}, got {value}")
    return value


class DCNv2(nn.Module):
    """Modulated deformable convolution with externally supplied offsets and mask (dcn_v2's DCNv2).

    Args:
        in_channels (int), out_channels (int): channel counts; multiples of `groups`.
        kernel_size (int or (int, int)).
        stride (int or (int, int)): default 1.
        padding (int or (int, int)): default 0.
        dilation (int or (int, int)): default 1.
        deformable_groups (int): offset groups, dividing in_channels. Default 1.
        groups (int, keyword): weight groups, as in nn.Conv2d. Default 1.
        bias (bool, keyword): learn an additive bias. Default True.

    Parameters: weight [out_channels, in_channels / groups, kh, kw], uniform in +-1/sqrt(fan_in) as
    in dcn_v2; bias [out_channels], zero.

    forward(input, offset, mask=None):
        input [batch, in_channels, H, W], offset [batch, 2 * deformable_groups * kh * kw, out_h, out_w],
        mask [batch, deformable_groups * kh * kw, out_h, out_w] or None (no modulation: DCN v1).
        Returns [batch, out_channels, out_h, out_w]. offset, mask and the parameters are cast to
        input's dtype where they differ (e.g. under autocast).
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
                 deformable_groups: int = 1, *, groups: int = 1, bias: bool = True):
        super().__init__()
        self.in_channels = _positive_int("in_channels", in_channels)
        self.out_channels = _positive_int("out_channels", out_channels)
        self.kernel_size = _pair("kernel_size", kernel_size, 1)
        self.stride = _pair("stride", stride, 1)
        self.padding = _pair("padding", padding, 0)
        self.dilation = _pair("dilation", dilation, 1)
        self.deformable_groups = _positive_int("deformable_groups", deformable_groups)
        self.groups = _positive_int("groups", groups)
        if in_channels % groups or out_channels % groups:
            raise ValueError(f"groups: expected a divisor of in_channels ({in_channels}) and out_channels "
                             f"({out_channels}), got {groups}")
        if in_channels % deformable_groups:
            raise ValueError(f"deformable_groups: expected a divisor of in_channels ({in_channels}), "
                             f"got {deformable_groups}")
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels // groups, *self.kernel_size))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_channels))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.weight[0].numel())
        with torch.no_grad():
            self.weight.uniform_(-bound, bound)
            if self.bias is not None:
                self.bias.zero_()

    def extra_repr(self) -> str:
        s = (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
             f"padding={self.padding}, dilation={self.dilation}, deformable_groups={self.deformable_groups}")
        if self.groups != 1:
            s += f", groups={self.groups}"
        return s + ("" if self.bias is not None else ", bias=False")

    def _deform(self, input: torch.Tensor, offset: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        conv = _common_call(input, offset, weight, bias, mask, self.stride, self.padding, self.dilation,
                            self.deformable_groups)
        if conv is not None:  # the step's call: checked, nothing to cast
            return _ops().dcn_v2_fwd(input, offset, weight, bias, mask, *conv)
        _check_offset_groups(offset, mask, weight, self.deformable_groups)

        def cast(t):
            return t if t is None or not isinstance(input, torch.Tensor) or t.dtype == input.dtype \
                else t.to(input.dtype)

        return deform_conv2d(input, cast(offset), cast(self.weight), cast(self.bias), self.stride, self.padding,
                             self.dilation, cast(mask))

    def forward(self, input: torch.Tensor, offset: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self._deform(input, offset, mask)


class DCN(DCNv2):
    """Modulated deformable convolution predicting its own offsets and mask (dcn_v2's DCN).

    Same arguments and parameters as `DCNv2`, plus `conv_offset_mask`, an nn.Conv2d(in_channels,
    3 * deformable_groups * kh * kw, kernel_size, stride, padding, dilation) initialised to zero:
    its first 2 * deformable_groups * kh * kw output channels are the offsets, the rest pass through
    a sigmoid to form the mask. A fresh DCN therefore computes 0.5 * conv2d(input, weight) + bias.

    forward(input): input [batch, in_channels, H, W] -> [batch, out_channels, out_h, out_w].
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
                 deformable_groups: int = 1, *, groups: int = 1, bias: bool = True):
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, deformable_groups,
                         groups=groups, bias=bias)
        taps = self.kernel_size[0] * self.kernel_size[1]
        self.conv_offset_mask = nn.Conv2d(in_channels, 3 * deformable_groups * taps, self.kernel_size,
                                          self.stride, self.padding, self.dilation, bias=True)
        self.init_offset()

    def init_offset(self) -> None:
        """Zero the offset/mask conv: regular sampling grid, mask 0.5."""
        with torch.no_grad():
            self.conv_offset_mask.weight.zero_()
            self.conv_offset_mask.bias.zero_()

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        out = self.conv_offset_mask(input)
        n = 2 * self.deformable_groups * self.kernel_size[0] * self.kernel_size[1]
        return self._deform(input, out[:, :n], torch.sigmoid(out[:, n:]))
