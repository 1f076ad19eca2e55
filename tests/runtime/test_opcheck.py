"""torch.library.opcheck over every op in the accel namespace.

opcheck checks what torch.compile and autograd rely on and the kernels' own tests cannot see: that
each schema tells the truth (no undeclared mutation or aliasing), that the fake kernels give the real
outputs' shapes, strides and dtypes, that the autograd formula is registered the supported way, and
that the op traces through AOTAutograd with dynamic shapes to the same outputs and gradients.

Every op found in the namespace once every op library is loaded needs a case here:
test_every_accel_op_has_cases fails for a new op without one.
"""
from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch

from accel.runtime import _build
from accel.runtime.nn.onednn_mm import onednn_available
from tests.runtime._params import DEVICES

# test_aot_dispatch_dynamic includes test_faketensor's checks, but failing them separately says which.
TEST_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")

EXPECTED_OPS = {
    "bias_dropout_add_fwd", "bias_dropout_add_bwd", "dropout_mask", "masked_scale", "dropout_fwd",
    "dcn_v2_fwd", "dcn_v2_bwd",
    "fmha_swin_fwd", "fmha_swin_bwd",
    "fused_adam_step",
    "layer_norm_fwd", "layer_norm_bwd",
    "nms", "nms_soft",
    "quick_gelu_fwd", "quick_gelu_bwd",
    "window_process_partition", "window_process_reverse",
    "onednn_mm",
    "linear_cross_entropy_fwd", "linear_cross_entropy_bwd",
    "varlen_attention_fwd", "varlen_attention_bwd",
}

# Ops without tensors (accel.runtime.host_memory's allocator: install, stats, release): nothing for opcheck to check.
HOST_OPS = {"host_memory_install", "host_memory_stats", "host_memory_release"}

PACKAGES = ("accel.runtime.nn", "accel.runtime.optim", "accel.runtime")
# Ops defined in Python (torch.library.custom_op) on top of torch's own kernels: no csrc of their own.
PYTHON_OPS = ("accel.runtime.nn.onednn_mm", "accel.runtime.nn.linear_cross_entropy",
              "accel.runtime.nn.varlen_attention")


def _op_libraries() -> list[str]:
    """Every op library, by its C++ source (csrc/cpu/<lib>.cpp), as _build finds them."""
    return sorted(p.stem for p in (_build.csrc_dir() / "cpu").glob("*.cpp"))


def _load_all() -> None:
    """Load each op library through its Python module, whose _ops() also registers its fake
    kernels and autograd formulas."""
    for lib in _op_libraries():
        for package in PACKAGES:
            try:
                module = importlib.import_module(f"{package}.{lib}")
            except ModuleNotFoundError as e:
                if e.name != f"{package}.{lib}":
                    raise
                continue
            module._ops()
            break
        else:
            raise AssertionError(f"csrc/cpu/{lib}.cpp has no Python module in {' or '.join(PACKAGES)}")
    for name in PYTHON_OPS:
        importlib.import_module(name)


def _registered_accel_ops() -> set[str]:
    # No public API lists a namespace's operators (torch.ops.accel lists only those looked up so
    # far); the dispatcher's own list has been there since torch 1.x. Should it go, the schemas
    # in the C++ sources still catch an op added there without a case here.
    all_names = getattr(torch._C, "_dispatch_get_all_op_names", None)
    if all_names is None:
        defs = (re.findall(r'm\.def\(\s*"(\w+)\(', p.read_text()) for p in (_build.csrc_dir() / "cpu").glob("*.cpp"))
        return {name for names in defs for name in names}
    return {n.split("::", 1)[1].split(".", 1)[0] for n in all_names() if n.startswith("accel::")}


@pytest.fixture(scope="module")
def accel_ops():
    _load_all()
    return _registered_accel_ops()


# ---------------------------------------------------------------- sample inputs


class Keywords(dict):
    """The keyword-only arguments of a case, last in what its make() returns."""


def _randn(shape, device, dtype, gen, requires_grad=False, scale=1.0):
    t = (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(device=device, dtype=dtype)
    return t.requires_grad_(requires_grad)


def _rand(shape, device, dtype, gen, low=0.0, high=1.0):
    t = torch.rand(shape, generator=gen, dtype=torch.float64) * (high - low) + low
    return t.to(device=device, dtype=dtype)


def _quick_gelu(device, dtype, gen, *, transposed=False):
    x = _randn((6, 5, 7), device, dtype, gen)
    if transposed:
        x = x.transpose(0, 2)
    return (x.requires_grad_(),)


def _quick_gelu_bwd(device, dtype, gen):
    return _randn((6, 5, 7), device, dtype, gen), _randn((6, 5, 7), device, dtype, gen)


def _layer_norm_fwd(device, dtype, gen, *, ndim=1, affine=True, param_dtype=None):
    x = _randn((3, 6, 8), device, dtype, gen, requires_grad=True)
    shape = x.shape[x.dim() - ndim:]
    pdt = param_dtype or dtype
    w = _randn(shape, device, pdt, gen, requires_grad=True) if affine else None
    b = _randn(shape, device, pdt, gen, requires_grad=True) if affine else None
    return x, w, b, ndim, 1e-5


def _layer_norm_bwd(device, dtype, gen, *, affine=True, need=True):
    x, w, b, ndim, eps = _layer_norm_fwd(device, dtype, gen, affine=affine)
    x, w, b = (t.detach() if t is not None else None for t in (x, w, b))
    _, mean, rstd = torch.ops.accel.layer_norm_fwd(x, w, b, ndim, eps)
    dy = _randn(x.shape, device, dtype, gen)
    return dy, x, mean, rstd, w, b, ndim, need and affine, need and affine


def _window_partition(device, dtype, gen, *, shift=-2):
    return _randn((2, 8, 8, 3), device, dtype, gen, requires_grad=True), 4, shift


def _window_reverse(device, dtype, gen, *, shift=2):
    return _randn((2 * 4, 4, 4, 3), device, dtype, gen, requires_grad=True), 8, 8, 4, shift


def _fmha_fwd(device, dtype, gen, *, masked=True):
    batch, windows, heads, n = 2, 4, 3, 16
    attn = _randn((batch * windows, heads, n, n), device, dtype, gen, requires_grad=True)
    bias = _randn((heads, n, n), device, dtype, gen, requires_grad=True)
    # Swin's shift mask: 0 or -100, a buffer (no gradient)
    mask = (_rand((windows, n, n), device, torch.float64, gen) > 0.7).to(dtype) * -100 if masked else None
    return attn, bias, mask, windows


def _fmha_bwd(device, dtype, gen):
    attn, bias, mask, windows = _fmha_fwd(device, dtype, gen)
    out = torch.ops.accel.fmha_swin_fwd(attn.detach(), bias.detach(), mask, windows)
    return _randn(out.shape, device, dtype, gen), out


def _bias_dropout_add_fwd(device, dtype, gen, *, bias=True, p=0.1, train=True):
    x = _randn((4, 6, 16), device, dtype, gen, requires_grad=True)
    b = _randn((16,), device, dtype, gen, requires_grad=True) if bias else None
    residual = _randn((4, 6, 16), device, dtype, gen, requires_grad=True)
    return x, b, residual, p, train


def _bias_dropout_add_bwd(device, dtype, gen, *, bias_grad=False):
    x, b, residual, p, train = _bias_dropout_add_fwd(device, dtype, gen)
    _, rng_state = torch.ops.accel.bias_dropout_add_fwd(x.detach(), b.detach(), residual.detach(), p, train)
    return _randn(x.shape, device, dtype, gen, requires_grad=bias_grad), rng_state, p, bias_grad


def _dropout_mask(device, dtype, gen, *, p=0.3, size=(4, 6, 17)):
    return list(size), p, Keywords(device=torch.device(device))


def _masked_scale(device, dtype, gen, *, size=(4, 6, 17)):
    x = _randn(size, device, dtype, gen, requires_grad=True)
    return x, _rand(size, device, torch.float32, gen, 0, 1) < 0.7, 1 / 0.7


def _dropout_fwd(device, dtype, gen, *, p=0.3, size=(4, 6, 17)):
    return _randn(size, device, dtype, gen, requires_grad=True), p


def _boxes(n, device, dtype, gen):
    xy = _rand((n, 2), device, torch.float64, gen, 0, 40)
    wh = _rand((n, 2), device, torch.float64, gen, 2, 20)
    boxes = torch.cat([xy, xy + wh], dim=1).to(dtype)
    return boxes, _rand((n,), device, dtype, gen)


def _nms(device, dtype, gen, *, scores_grad=False):
    boxes, scores = _boxes(48, device, dtype, gen)
    return boxes, scores.requires_grad_(scores_grad), 0.5


def _nms_soft(device, dtype, gen, *, method=2, labelled=False, scores_grad=False):
    # scores_grad: the scores of a detection head in training, which still require grad
    boxes, scores = _boxes(48, device, dtype, gen)
    labels = torch.randint(0, 3, (48,), generator=gen).to(device) if labelled else None
    return boxes, scores.requires_grad_(scores_grad), labels, 0.3, 0.5, 1e-3, method


def _fused_adam_step(device, dtype, gen, *, amsgrad=False, scaler=False, lr_tensor=False, decoupled=False,
                     compact=False):
    sdt = dtype if compact else torch.float64 if dtype == torch.float64 else torch.float32
    shapes = [(5, 7), (13,), (2, 3, 4)]
    params = [_randn(s, device, dtype, gen) for s in shapes]
    grads = [_randn(s, device, dtype, gen) for s in shapes]
    exp_avgs = [_randn(s, device, sdt, gen, scale=0.1) for s in shapes]
    exp_avg_sqs = [_rand(s, device, sdt, gen, 0.0, 0.1) for s in shapes]
    max_exp_avg_sqs = [v + 0.01 for v in exp_avg_sqs] if amsgrad else []
    steps = [torch.full((), 3.0, device=device) for _ in shapes]
    lr_t = torch.tensor(1e-3, dtype=torch.float64) if lr_tensor else None
    grad_scale = torch.full((), 128.0, device=device) if scaler else None
    found_inf = torch.zeros((), device=device) if scaler else None
    return (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, 0.0 if lr_tensor else 1e-3, lr_t,
            0.9, 0.999, 1e-8, 1e-2, amsgrad, False, decoupled, grad_scale, found_inf, 16)


def _dcn_v2_fwd(device, dtype, gen, *, masked=True, bias=True, groups=1, offset_groups=1, stride=1):
    batch, channels, size, k, out_channels = 2, 4, 7, 3, 6
    out = (size + 2 - k) // stride + 1
    x = _randn((batch, channels, size, size), device, dtype, gen, requires_grad=True)
    # sub-pixel offsets, some reaching past the border
    offset = _randn((batch, 2 * offset_groups * k * k, out, out), device, dtype, gen, True, scale=1.5)
    weight = _randn((out_channels, channels // groups, k, k), device, dtype, gen, requires_grad=True)
    b = _randn((out_channels,), device, dtype, gen, requires_grad=True) if bias else None
    mask = _rand((batch, offset_groups * k * k, out, out), device, dtype, gen).requires_grad_() if masked else None
    return x, offset, weight, b, mask, [stride, stride], [1, 1], [1, 1]


def _onednn_mm(device, dtype, gen, *, bias=True, transposed=False):
    a = _randn((6, 5), device, dtype, gen, requires_grad=True)
    b = _randn((4, 5), device, dtype, gen).t() if transposed else _randn((5, 4), device, dtype, gen)
    return a, b.requires_grad_(), _randn((4,), device, dtype, gen, requires_grad=True) if bias else None


def _linear_cross_entropy_fwd(device, dtype, gen, *, bias=True):
    hidden = _randn((6, 5), device, dtype, gen, requires_grad=True)
    weight = _randn((9, 5), device, dtype, gen, requires_grad=True)
    b = _randn((9,), device, dtype, gen, requires_grad=True) if bias else None
    target = torch.tensor([3, 0, -100, 8, 5, 3], device=device)
    return hidden, weight, b, target, -100


def _linear_cross_entropy_bwd(device, dtype, gen, *, bias=True, want_weight=True):
    hidden, weight, b, target, ignore_index = _linear_cross_entropy_fwd(device, dtype, gen, bias=bias)
    hidden, weight = hidden.detach(), weight.detach()
    b = b.detach() if b is not None else None
    _, lse = torch.ops.accel.linear_cross_entropy_fwd(hidden, weight, b, target, ignore_index)
    grad = _randn((), device, lse.dtype, gen)
    return grad, hidden, weight, b, target, lse, ignore_index, True, want_weight, bias


def _varlen_attention_fwd(device, dtype, gen, *, causal=True, plain=False, window=0):
    q, k, v = (_randn((2, 3, 12, 4), device, dtype, gen, requires_grad=True) for _ in range(3))
    segments = torch.tensor([[1] * 5 + [2] * 4 + [0] * 3, [1] * 12], device=device)
    return q, k, v, segments, causal, 0.5, plain, window


def _varlen_attention_bwd(device, dtype, gen, *, plain=False, window=0):
    q, k, v, segments, causal, scale, _, _ = _varlen_attention_fwd(device, dtype, gen)
    q, k, v = q.detach(), k.detach(), v.detach()
    out, lse = torch.ops.accel.varlen_attention_fwd(q, k, v, segments, causal, scale, plain, window)
    return _randn(q.shape, device, dtype, gen), q, k, v, out, lse, segments, causal, scale, plain, window


def _dcn_v2_bwd(device, dtype, gen, *, masked=True):
    x, offset, weight, b, mask, stride, padding, dilation = _dcn_v2_fwd(device, dtype, gen, masked=masked)
    x, offset, weight = x.detach(), offset.detach(), weight.detach()
    mask = mask.detach() if mask is not None else None
    out_shape = (x.shape[0], weight.shape[0], offset.shape[2], offset.shape[3])
    return _randn(out_shape, device, dtype, gen), x, offset, weight, mask, stride, padding, dilation


# ---------------------------------------------------------------- cases


F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16
NEEDS_ONEDNN = (pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN linear op"),)
ALL = (F32, F64, BF16)


@dataclass
class Case:
    op: str
    name: str
    make: Callable
    dtypes: tuple = ALL
    kwargs: dict = field(default_factory=dict)
    # pytest.mark.xfail(reason=<the cause>, strict=True) while a found failure awaits its fix
    marks: tuple = ()
    cpu_only: bool = False  # an op with no CUDA kernel


CASES = [
    Case("quick_gelu_fwd", "contiguous", _quick_gelu),
    Case("quick_gelu_fwd", "transposed", _quick_gelu, (F32,), {"transposed": True}),
    Case("quick_gelu_bwd", "plain", _quick_gelu_bwd),
    Case("layer_norm_fwd", "affine", _layer_norm_fwd),
    Case("layer_norm_fwd", "no_affine", _layer_norm_fwd, (F32,), {"affine": False}),
    Case("layer_norm_fwd", "two_dims", _layer_norm_fwd, (F32,), {"ndim": 2}),
    Case("layer_norm_fwd", "fp32_params", _layer_norm_fwd, (BF16,), {"param_dtype": F32}),
    Case("layer_norm_bwd", "affine", _layer_norm_bwd),
    Case("layer_norm_bwd", "no_param_grads", _layer_norm_bwd, (F32,), {"need": False}),
    Case("layer_norm_bwd", "no_affine", _layer_norm_bwd, (F32,), {"affine": False}),
    Case("window_process_partition", "shifted", _window_partition),
    Case("window_process_partition", "unshifted", _window_partition, (F32,), {"shift": 0}),
    Case("window_process_reverse", "shifted", _window_reverse),
    Case("fmha_swin_fwd", "masked", _fmha_fwd),
    Case("fmha_swin_fwd", "unmasked", _fmha_fwd, (F32,), {"masked": False}),
    Case("fmha_swin_bwd", "plain", _fmha_bwd),
    Case("bias_dropout_add_fwd", "train", _bias_dropout_add_fwd),
    Case("bias_dropout_add_fwd", "no_bias", _bias_dropout_add_fwd, (F32,), {"bias": False}),
    Case("bias_dropout_add_fwd", "eval", _bias_dropout_add_fwd, (F32,), {"train": False}),
    Case("bias_dropout_add_bwd", "plain", _bias_dropout_add_bwd),
    Case("bias_dropout_add_bwd", "bias_grad", _bias_dropout_add_bwd, (F32, BF16), {"bias_grad": True}),
    Case("dropout_mask", "plain", _dropout_mask, (F32,)),
    Case("dropout_mask", "empty", _dropout_mask, (F32,), {"size": (0, 5)}),
    Case("dropout_mask", "keep_all", _dropout_mask, (F32,), {"p": 0.0}),
    Case("masked_scale", "plain", _masked_scale, (F32, BF16)),
    Case("masked_scale", "empty", _masked_scale, (F32,), {"size": (0, 5)}),
    Case("dropout_fwd", "plain", _dropout_fwd, (F32, BF16)),
    Case("dropout_fwd", "odd_size", _dropout_fwd, (F32,), {"size": (3, 7)}),
    Case("dropout_fwd", "empty", _dropout_fwd, (F32,), {"size": (0, 5)}),
    Case("dropout_fwd", "drop_all", _dropout_fwd, (F32,), {"p": 1.0}),
    Case("nms", "plain", _nms),
    Case("nms", "scores_require_grad", _nms, (F32,), {"scores_grad": True}),
    Case("nms_soft", "gaussian", _nms_soft),
    Case("nms_soft", "scores_require_grad", _nms_soft, (F32, BF16), {"scores_grad": True, "labelled": True}),
    Case("nms_soft", "linear_batched", _nms_soft, (F32,), {"method": 1, "labelled": True}),
    Case("nms_soft", "naive", _nms_soft, (F32,), {"method": 0}),
    Case("fused_adam_step", "adam", _fused_adam_step),
    Case("fused_adam_step", "amsgrad_adamw", _fused_adam_step, (F32,), {"amsgrad": True, "decoupled": True}),
    Case("fused_adam_step", "grad_scaler", _fused_adam_step, (F32, BF16), {"scaler": True}),
    Case("fused_adam_step", "lr_tensor", _fused_adam_step, (F32,), {"lr_tensor": True}),
    Case("fused_adam_step", "compact_state", _fused_adam_step, (BF16,), {"compact": True, "amsgrad": True}),
    Case("dcn_v2_fwd", "modulated", _dcn_v2_fwd, (F32, F64)),
    Case("dcn_v2_fwd", "v1_no_bias", _dcn_v2_fwd, (F32,), {"masked": False, "bias": False}),
    Case("dcn_v2_fwd", "groups_stride", _dcn_v2_fwd, (F32,), {"groups": 2, "offset_groups": 2, "stride": 2}),
    Case("dcn_v2_bwd", "modulated", _dcn_v2_bwd, (F32, F64)),
    Case("dcn_v2_bwd", "v1", _dcn_v2_bwd, (F32,), {"masked": False}),
    Case("linear_cross_entropy_fwd", "bias", _linear_cross_entropy_fwd, (F32, BF16)),
    Case("linear_cross_entropy_fwd", "no_bias", _linear_cross_entropy_fwd, (F32,), {"bias": False}),
    Case("linear_cross_entropy_bwd", "bias", _linear_cross_entropy_bwd, (F32, BF16)),
    Case("linear_cross_entropy_bwd", "frozen_weight_no_bias", _linear_cross_entropy_bwd, (F32,),
         {"bias": False, "want_weight": False}),
    Case("varlen_attention_fwd", "causal", _varlen_attention_fwd, cpu_only=True),
    Case("varlen_attention_fwd", "bidirectional", _varlen_attention_fwd, (F32,), {"causal": False}, cpu_only=True),
    Case("varlen_attention_bwd", "causal", _varlen_attention_bwd, (F32, BF16), cpu_only=True),
    Case("varlen_attention_fwd", "plain", _varlen_attention_fwd, (F32, BF16), {"plain": True}, cpu_only=True),
    Case("varlen_attention_bwd", "plain", _varlen_attention_bwd, (F32, BF16), {"plain": True}, cpu_only=True),
    Case("varlen_attention_fwd", "window", _varlen_attention_fwd, (F32, BF16), {"window": 3}, cpu_only=True),
    Case("varlen_attention_bwd", "window", _varlen_attention_bwd, (F32,), {"plain": True, "window": 3},
         cpu_only=True),
    Case("onednn_mm", "bias", _onednn_mm, (F32,), marks=NEEDS_ONEDNN, cpu_only=True),
    Case("onednn_mm", "weight_transposed_no_bias", _onednn_mm, (F32,), {"bias": False, "transposed": True},
         marks=NEEDS_ONEDNN, cpu_only=True),
]


def _params():
    out = []
    for device in DEVICES:
        for case in CASES:
            if case.cpu_only and device.values[0] != "cpu":
                continue
            for dtype in case.dtypes:
                dt = str(dtype).replace("torch.", "")
                out.append(pytest.param(device.values[0], case, dtype, id=f"{case.op}-{case.name}-{dt}-{device.id}",
                                        marks=(*device.marks, *case.marks)))
    return out


def test_every_accel_op_has_cases(accel_ops):
    assert accel_ops == EXPECTED_OPS | HOST_OPS, (
        f"ops without cases here: {sorted(accel_ops - EXPECTED_OPS - HOST_OPS)}; "
        f"expected but not registered: {sorted((EXPECTED_OPS | HOST_OPS) - accel_ops)}")
    assert {case.op for case in CASES} == EXPECTED_OPS


@pytest.mark.parametrize("device, case, dtype", _params())
def test_opcheck(accel_ops, device, case, dtype):
    gen = torch.Generator().manual_seed(0)
    args = case.make(device, dtype, gen, **case.kwargs)
    kwargs = dict(args[-1]) if args and isinstance(args[-1], Keywords) else {}
    args = args[:-1] if kwargs else args
    torch.library.opcheck(getattr(torch.ops.accel, case.op).default, args, kwargs, test_utils=TEST_UTILS)
