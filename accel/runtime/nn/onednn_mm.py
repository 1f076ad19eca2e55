"""fp32 matrix products on the CPU through oneDNN, where it measures faster than torch's BLAS.

torch computes an fp32 `mm`/`addmm`/`linear` on x86 CPUs with MKL, which runs its AVX-512 code on Intel CPUs
only. On an AMD EPYC with AVX-512 (Zen 5, 2 cores, torch 2.9, 2026-11-27) MKL ran BERT-base's products at
~210 GFLOP/s, where oneDNN -- which torch ships too, and uses for bf16 -- ran the same fp32 products, forward
and both backward ones, at 360-510 GFLOP/s (1.7-2.4x; benchmarks/kernels.py --ops onednn_mm), with fp32
rounding. oneDNN costs ~10 us more a call, so it loses on small products (8x2x768 0.3x, 64^3 0.4x, 128^3
1.0x, 256^3 1.5x).

- `onednn_mm(a, b, bias=None)` (the op `accel::onednn_mm`, differentiable) computes a @ b + bias by oneDNN;
  `onednn_mm_reference` is the plain PyTorch product it must equal up to fp32 rounding.
- `onednn_wins()`: a probe run once per process times both libraries on one BERT-sized product; oneDNN is used
  only where it is at least MIN_SPEEDUP times faster (detect, never assume: MKL may well win on Intel CPUs).
- `OneDNNLinear`, a drop-in nn.Linear (same constructor, parameters, state_dict), computes its large (MIN_MACS)
  fp32 CPU products, forward and backward, through onednn_mm; anywhere else (autocast, other dtypes or devices,
  while torch.compile traces) it is nn.Linear. accelerate() swaps it in where compute.cpu_gemm asks for oneDNN
  ("auto": where onednn_wins()); compiled graphs get oneDNN from accel.compiler.cpu_gemm, a graph pass over
  every large fp32 product.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.modules.linear import Linear as _TorchLinear

from accel.utils.timing import best_time

# Products with fewer multiply-adds stay with torch (oneDNN's per-call cost: 64^3 0.4x, 128^3 1.0x, 256^3 1.5x).
MIN_MACS = 1 << 22
# oneDNN must beat torch's BLAS by this much in the probe: a tie stays with torch (and runs stay repeatable).
MIN_SPEEDUP = 1.15
_PROBE_SHAPE = (1024, 768, 768)  # M, N, K: one BERT-base projection over 8 x 128 tokens


def onednn_mm_reference(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain PyTorch: a @ b (+ bias)."""
    return torch.mm(a, b) if bias is None else torch.addmm(bias, a, b)


def _onednn_linear(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # oneDNN's linear computes input @ weight.T + bias; b.t() as the weight is a view, not a copy.
    return torch.ops.mkldnn._linear_pointwise(a, b.t(), bias, "none", [], "")


def _check_operands(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> None:
    for name, t, dims in (("a", a, 2), ("b", b, 2), ("bias", bias, 1)):
        if t is None:
            continue
        if t.dim() != dims or t.dtype != torch.float32 or t.device.type not in ("cpu", "meta"):
            raise ValueError(f"{name}: expected a {dims}-D float32 CPU tensor, got {t.dim()}-D {t.dtype} on {t.device}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"b: expected {a.shape[1]} rows (a's columns), got shape {tuple(b.shape)}")
    if bias is not None and bias.shape[0] != b.shape[1]:
        raise ValueError(f"bias: expected {b.shape[1]} elements (b's columns), got {bias.shape[0]}")


@torch.library.custom_op("accel::onednn_mm", mutates_args=())
def onednn_mm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b (+ bias) computed by oneDNN.

    Args:
        a: [M, K] float32 CPU tensor, any strides.
        b: [K, N] float32 CPU tensor, any strides.
        bias: optional [N] float32, added to every row.

    Returns:
        [M, N] contiguous float32.
    """
    _check_operands(a, b, bias)
    return _onednn_linear(a, b, bias)


@onednn_mm.register_fake
def _(a, b, bias=None):
    _check_operands(a, b, bias)
    return a.new_empty((a.shape[0], b.shape[1]))


def large(m: int, k: int, n: int) -> bool:
    """Whether an [m, k] x [k, n] product is large enough for oneDNN's per-call cost to pay."""
    return m * k * n >= MIN_MACS


def _product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b, by oneDNN where it is large and oneDNN measured faster for it."""
    if large(a.shape[0], a.shape[1], b.shape[1]) and onednn_faster(a, b):
        return onednn_mm(a, b)
    return torch.mm(a, b)


def _setup_context(ctx, inputs, output):
    a, b, bias = inputs
    ctx.save_for_backward(a, b)
    ctx.has_bias = bias is not None


def _backward(ctx, grad):
    a, b = ctx.saved_tensors
    grad_a = _product(grad, b.t()) if ctx.needs_input_grad[0] else None
    grad_b = None
    if ctx.needs_input_grad[1]:
        # in b's layout: a Linear's weight read transposed gets its gradient contiguous, not copied into shape
        grad_b = _product(grad.t(), a).t() if _layout(b) == _COLUMN_MAJOR else _product(a.t(), grad)
    grad_bias = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return grad_a, grad_b, grad_bias


onednn_mm.register_autograd(_backward, setup_context=_setup_context)


def onednn_available() -> bool:
    """Whether this torch build has oneDNN's linear op (x86 and Arm builds do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _like(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A real CPU tensor with t's sizes and strides (t may be a FakeTensor of a graph being compiled)."""
    size, stride = tuple(int(d) for d in t.shape), tuple(int(d) for d in t.stride())
    return torch.empty_strided(size, stride).normal_(generator=gen)


def _times(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[float, float]:
    """(oneDNN's, torch's) best time for a @ b (+ bias), on random tensors of their sizes and strides."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        ra, rb = _like(a, gen), _like(b, gen)
        rbias = _like(bias, gen) if bias is not None else None
        return (best_time(lambda: _onednn_linear(ra, rb, rbias)),
                best_time(lambda: onednn_mm_reference(ra, rb, rbias)))


@functools.cache
def onednn_speedup() -> float:
    """How many times faster oneDNN computes an fp32 [1024, 768] x [768, 768] product than torch's mm on this
    CPU, at torch's thread count (0.0 without oneDNN). Measured once per process, ~50 ms."""
    if not onednn_available():
        return 0.0
    m, n, k = _PROBE_SHAPE
    ours, theirs = _times(torch.empty(m, k), torch.empty(n, k).t())  # b: a Linear's weight as mm sees it
    return theirs / ours


def onednn_wins() -> bool:
    """True when the probe found oneDNN at least MIN_SPEEDUP times faster than torch's BLAS here."""
    return onednn_speedup() >= MIN_SPEEDUP


# product class (onednn_faster's key) -> oneDNN measured faster for it on this machine
_faster: dict[tuple, bool] = {}


def _size_class(n: int) -> int:
    return (int(n) - 1).bit_length()  # sizes in (2^(c-1), 2^c] share a class


_ROW_MAJOR, _COLUMN_MAJOR, _OTHER = range(3)


def _layout(t: torch.Tensor) -> int:
    return _ROW_MAJOR if t.stride(1) == 1 else _COLUMN_MAJOR if t.stride(0) == 1 else _OTHER


def onednn_faster(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether oneDNN computes a @ b (+ bias) at least MIN_SPEEDUP times faster than torch's mm/addmm, timed once
    per process and class of product (each size rounded up to a power of two, each operand's layout: row- or
    column-major; so that varying batch shapes cost a few timings, not one each), ~6 products' time, on random
    tensors of the first such product's layout. The one-product probe (onednn_wins) says whether oneDNN can win
    on this CPU at all; which products it wins depends on their shapes: on a Zen 5 EPYC [8, 768] x [768, 768]
    took 0.68x MKL's time, but [16, 1024] x [1024, 1024] 3.0x and [32, 1024] x [1024, 512] 2.2x (few rows
    against a large weight). a, b and bias may be FakeTensors (accel.compiler.cpu_gemm decides while Inductor
    compiles)."""
    key = (_size_class(a.shape[0]), _size_class(a.shape[1]), _size_class(b.shape[1]), _layout(a), _layout(b),
           bias is not None)
    if key not in _faster:
        ours, theirs = _times(a, b, bias)
        _faster[key] = theirs >= MIN_SPEEDUP * ours
    return _faster[key]


class OneDNNLinear(_TorchLinear):
    """nn.Linear whose large fp32 CPU products run on oneDNN where it measured faster for their shape
    (onednn_faster), forward and backward. accelerate() swaps a model's nn.Linear layers for it where oneDNN can
    win on this CPU (compute.cpu_gemm); elsewhere nn.Linear stays."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        out_features, in_features = w.shape
        # the size first: a small product (the common case of small layers) pays one multiply before F.linear
        if (x.numel() * out_features >= MIN_MACS and x.dtype is torch.float32 and w.dtype is torch.float32
                and x.device.type == "cpu" and x.shape[-1] == in_features
                and not torch.compiler.is_compiling() and not torch.is_autocast_enabled("cpu")):
            rows = x.reshape(-1, in_features)
            if onednn_faster(rows, w.t(), self.bias):
                return onednn_mm(rows, w.t(), self.bias).view(*x.shape[:-1], out_features)
        return F.linear(x, w, self.bias)


# Linear layers that compute x @ W.T + b and nothing else: torch's own class (not nn.Linear, which
# accel.runtime.hooks may point elsewhere) and accel's oneDNN one. Model transforms that compute a layer's product
# themselves (fused projections, the fused LM loss) take these and leave any other (LoRA, quantised) alone.
PLAIN_LINEARS = (_TorchLinear, OneDNNLinear)
