"""Cross entropy of a linear layer's output without its logits: a language model's head and loss in one.

A causal LM's last step, `F.cross_entropy(lm_head(hidden).float(), labels)`, makes [tokens, vocabulary] logits:
the product, its fp32 copy, the softmax's gradient, each tokens x vocabulary (8 rows of 2048 tokens x a 128k
vocabulary: 8.6 GB per fp32 copy), usually the largest tensors of a step. Compiled, Inductor keeps one of them
(the product) from the forward to the backward. `linear_cross_entropy` computes the same loss and gradients a
slice of the vocabulary at a time and keeps nothing of that size:
- forward: each slice's logits, then a running logsumexp per token (as online softmax does) and the target's
  logit; kept for the backward: the logsumexp, one number per token;
- backward: each slice's logits again, their softmax minus the one-hot target, and from that slice of the
  gradient the slice's rows of the weight's gradient (written once, no accumulation over the vocabulary's size)
  and its share of the hidden states' gradient (summed into an fp32 [tokens, hidden] buffer).
One more product than the unfused head (the backward recomputes the logits): the time a user trades for memory.
On the CPU the rows whose target is ignored (-100: an instruction-tuned model's prompt tokens) are left out of
the products in both passes (finding them costs no host sync there): with half the rows a prompt, forward +
backward 1.50x / 1.41x the compiled unfused loss (2048 x 512 -> 32000 / 3072 x 512 -> 128256, bf16, 2-core Zen 5),
which computes every row and ignores some.

The two passes are ops of their own (`accel::linear_cross_entropy_fwd` / `_bwd`, torch.library, with fake
kernels and an autograd formula), so a compiled model's graph holds them whole: Inductor would otherwise be free
to schedule every slice's product before their reductions and hold them all at once (measured: more memory
than the unfused loss). Inside, each slice's arithmetic is one torch.compile'd function (on CPU and CUDA; plain
ops on other devices), its elementwise work fused into a pass or two.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from accel.runtime.nn._common import check_same_device, check_tensor

IGNORE_INDEX = -100
REDUCTIONS = ("mean", "sum")
# Elements of a slice's logits, at least: 16 MiB in fp32 (measured on a 2-core CPU: 1.08-1.17x the unfused compiled
# loss's time at 4M elements, 1.25-1.35x at 16M, noisier and no faster at 2M).
CHUNK_ELEMENTS = 1 << 22
# On CUDA 128 MiB: each slice is two calls of compiled code whose host time outlasts a small slice's kernels (an
# H200 took 9.3 ms for 2048 x 512 -> 32000 in 16 slices a pass, against 0.8 ms for the unfused compiled loss,
# gpu_h200_2026-11-28.md); a GPU holds such a slice easily, and the unfused logits are still many times larger.
CUDA_CHUNK_ELEMENTS = 1 << 25


def chunk_columns(rows: int, vocab: int, hidden: int = 0, device_type: str = "cpu") -> int:
    """Vocabulary entries per slice for `rows` tokens: slices of CHUNK_ELEMENTS logits (CUDA_CHUNK_ELEMENTS on
    CUDA), or as many as the [rows, hidden] hidden states hold where that is more (large models on a GPU: fewer,
    larger products, and a slice never larger than a tensor the step holds anyway). At least one entry, at most
    the vocabulary."""
    least = CUDA_CHUNK_ELEMENTS if device_type == "cuda" else CHUNK_ELEMENTS
    return min(vocab, max(1, max(least, rows * hidden) // max(rows, 1)))


def linear_cross_entropy_reference(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                   bias: torch.Tensor | None = None, ignore_index: int = IGNORE_INDEX,
                                   reduction: str = "mean") -> torch.Tensor:
    """Plain PyTorch: the logits in the products' dtype, the cross entropy in fp32 (as transformers' loss;
    fp64 stays fp64)."""
    logits = F.linear(hidden, weight, bias)
    return F.cross_entropy(logits if logits.dtype == torch.float64 else logits.float(), target,
                           ignore_index=ignore_index, reduction=reduction)


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _slice_logits(hidden, weight, bias, acc):
    return F.linear(hidden, weight.to(hidden.dtype), None if bias is None else bias.to(hidden.dtype)).to(acc)


def _forward_slice(hidden, weight, bias, target, start: int, running_max, running_sum, picked):
    """Assumptions: hidden [N, H] in the products' dtype; weight [C, H] and bias [C] (or None) are the vocabulary
    entries start .. start + C - 1; target [N] class ids (ignored rows hold any valid id); running_max,
    running_sum, picked [N] in the accumulation dtype, from the slices before (-inf, 0, anything at first).
    Returns them updated with this slice: the logsumexp so far is running_max + log(running_sum)."""
    logits = _slice_logits(hidden, weight, bias, running_max.dtype)
    new_max = torch.maximum(running_max, logits.amax(dim=1))
    running_sum = running_sum * torch.exp(running_max - new_max) + torch.exp(logits - new_max.unsqueeze(1)).sum(1)
    local = target - start
    inside = (local >= 0) & (local < logits.shape[1])
    mine = logits.gather(1, local.clamp(0, logits.shape[1] - 1).unsqueeze(1)).squeeze(1)
    return new_max, running_sum, torch.where(inside, mine, picked)


def _backward_slice(hidden, weight, bias, target, start: int, lse, row_grad, grad_hidden,
                    want_hidden: bool, want_weight: bool, want_bias: bool):
    """Assumptions: as _forward_slice; lse [N] the full logsumexp; row_grad [N] each row's loss gradient (0 for
    ignored rows); grad_hidden [N, H] in the accumulation dtype, the sum over the slices before.
    Returns (grad_hidden with this slice's share added, this slice's weight rows' gradient, its bias entries'
    gradient), the last two None where not wanted."""
    logits = _slice_logits(hidden, weight, bias, lse.dtype)
    classes = torch.arange(start, start + logits.shape[1], device=logits.device)
    grad = (torch.exp(logits - lse.unsqueeze(1)) - (classes == target.unsqueeze(1)).to(lse.dtype))
    grad = grad * row_grad.unsqueeze(1)
    grad_logits = grad.to(hidden.dtype)
    if want_hidden:
        grad_hidden = grad_hidden + (grad_logits @ weight.to(hidden.dtype)).to(grad_hidden.dtype)
    grad_weight = (grad_logits.t() @ hidden).to(weight.dtype) if want_weight else None
    grad_bias = grad.sum(0).to(bias.dtype) if want_bias else None
    return grad_hidden, grad_weight, grad_bias


_COMPILED: dict = {}


def _slice_fn(fn, device: torch.device):
    """fn compiled once per process (dynamic shapes: one graph for every slice width and token count) where
    Inductor generates code for the device; fn itself elsewhere (XLA, MPS)."""
    if device.type not in ("cpu", "cuda"):
        return fn
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=True)
    return _COMPILED[fn]


def _prepared(target, ignore_index):
    valid = target != ignore_index
    return valid, target.masked_fill(~valid, 0)


def _kept_rows(valid: torch.Tensor) -> torch.Tensor | None:
    """The rows not ignored, as an index [K], where some are ignored and finding them costs no host sync (the CPU);
    else None: every row is computed (ignored ones then count 0). An instruction-tuned model's prompt tokens are
    ignored (-100): on the CPU their share of the head's products is skipped."""
    if valid.device.type != "cpu" or bool(valid.all()):
        return None
    return valid.nonzero().squeeze(1)


def _forward_rows(hidden, weight, bias, safe_target) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row's logsumexp [N], its target's logit [N]) of F.linear(hidden, weight, bias), in the accumulation
    dtype, a slice of the vocabulary at a time."""
    rows, vocab = hidden.shape[0], weight.shape[0]
    running_max = torch.full((rows,), float("-inf"), dtype=_accumulation_dtype(hidden.dtype), device=hidden.device)
    running_sum = torch.zeros_like(running_max)
    picked = torch.zeros_like(running_max)
    step = _slice_fn(_forward_slice, hidden.device)
    cols = chunk_columns(rows, vocab, hidden.shape[1], hidden.device.type)
    with torch.autocast(hidden.device.type, enabled=False):
        for start in range(0, vocab, cols):
            sl = slice(start, start + cols)
            running_max, running_sum, picked = step(hidden, weight[sl], None if bias is None else bias[sl],
                                                    safe_target, start, running_max, running_sum, picked)
    return running_max + torch.log(running_sum), picked


@torch.library.custom_op("accel::linear_cross_entropy_fwd", mutates_args=())
def _fwd(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], target: torch.Tensor,
         ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the loss summed over the rows not ignored [], each row's logsumexp [N]), in the accumulation dtype."""
    valid, safe_target = _prepared(target, ignore_index)
    keep = _kept_rows(valid)
    if keep is None:
        lse, picked = _forward_rows(hidden, weight, bias, safe_target)
        return torch.where(valid, lse - picked, 0.0).sum(), lse
    lse = torch.zeros(hidden.shape[:1], dtype=_accumulation_dtype(hidden.dtype), device=hidden.device)
    if keep.numel() == 0:
        return lse.sum(), lse
    kept_lse, picked = _forward_rows(hidden.index_select(0, keep), weight, bias, safe_target.index_select(0, keep))
    # an ignored row's logsumexp is never read (its gradient is 0): left 0
    return (kept_lse - picked).sum(), lse.index_copy(0, keep, kept_lse)


@_fwd.register_fake
def _fwd_fake(hidden, weight, bias, target, ignore_index):
    acc = _accumulation_dtype(hidden.dtype)
    return hidden.new_empty((), dtype=acc), hidden.new_empty(hidden.shape[:1], dtype=acc)


@torch.library.custom_op("accel::linear_cross_entropy_bwd", mutates_args=())
def _bwd(grad_loss: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
         target: torch.Tensor, lse: torch.Tensor, ignore_index: int, want_hidden: bool, want_weight: bool,
         want_bias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of hidden, weight and bias for the summed loss's gradient grad_loss []; each one not wanted
    is an empty tensor."""
    valid, safe_target = _prepared(target, ignore_index)
    keep = _kept_rows(valid)
    wanted = (want_hidden, want_weight, want_bias)
    if keep is not None and keep.numel() == 0:  # every row ignored: every gradient 0
        zeros = [torch.zeros_like(t) if want else hidden.new_empty(0)
                 for t, want in ((hidden, want_hidden), (weight, want_weight), (bias, want_bias))]
        return zeros[0], zeros[1], zeros[2]
    if keep is None:
        row_grad = valid.to(lse.dtype) * grad_loss.to(lse.dtype)
        grad_hidden, grad_weight, grad_bias = _backward_rows(hidden, weight, bias, safe_target, lse, row_grad, *wanted)
        grad_hidden = grad_hidden.to(hidden.dtype) if want_hidden else None
    else:  # the rows not ignored alone; the others' gradient is 0
        kept_hidden = hidden.index_select(0, keep)
        row_grad = grad_loss.to(lse.dtype).expand(keep.shape[0])
        kept_grad, grad_weight, grad_bias = _backward_rows(kept_hidden, weight, bias, safe_target.index_select(0, keep),
                                                           lse.index_select(0, keep), row_grad, *wanted)
        grad_hidden = hidden.new_zeros(hidden.shape).index_copy(0, keep, kept_grad.to(hidden.dtype)) \
            if want_hidden else None
    return (hidden.new_empty(0) if grad_hidden is None else grad_hidden), grad_weight.result(hidden), \
        grad_bias.result(hidden)


def _backward_rows(hidden, weight, bias, safe_target, lse, row_grad, want_hidden: bool, want_weight: bool,
                   want_bias: bool):
    """(grad_hidden [N, H] in the accumulation dtype, the weight's and the bias's _SliceGradient), a slice of the
    vocabulary at a time."""
    rows, vocab = hidden.shape[0], weight.shape[0]
    grad_hidden = torch.zeros(hidden.shape, dtype=lse.dtype, device=hidden.device)
    grad_weight = _SliceGradient(weight, want_weight)
    grad_bias = _SliceGradient(bias, want_bias)
    step = _slice_fn(_backward_slice, hidden.device)
    cols = chunk_columns(rows, vocab, hidden.shape[1], hidden.device.type)
    with torch.autocast(hidden.device.type, enabled=False):
        for start in range(0, vocab, cols):
            sl = slice(start, start + cols)
            grad_hidden, gw, gb = step(hidden, weight[sl], None if bias is None else bias[sl], safe_target, start,
                                       lse, row_grad, grad_hidden, want_hidden, want_weight, want_bias)
            grad_weight.add(sl, gw)
            grad_bias.add(sl, gb)
    return grad_hidden, grad_weight, grad_bias


class _SliceGradient:
    """A parameter's gradient made a slice of rows at a time. On CPU and CUDA each slice is written into place as
    it comes (no second copy of the gradient); torch_xla's functional tensors lose writes into slices of a
    tensor made inside the op, so there the slices are concatenated at the end."""

    def __init__(self, param: torch.Tensor | None, wanted: bool):
        self.wanted = wanted
        self.in_place = wanted and param.device.type in ("cpu", "cuda")
        self.out = torch.empty_like(param) if self.in_place else None
        self.parts = []

    def add(self, rows: slice, grad: torch.Tensor | None) -> None:
        if self.in_place:
            self.out[rows] = grad
        elif self.wanted:
            self.parts.append(grad)

    def result(self, like: torch.Tensor) -> torch.Tensor:
        if not self.wanted:
            return like.new_empty(0)
        return self.out if self.in_place else torch.cat(self.parts)


@_bwd.register_fake
def _bwd_fake(grad_loss, hidden, weight, bias, target, lse, ignore_index, want_hidden, want_weight, want_bias):
    return (torch.empty_like(hidden) if want_hidden else hidden.new_empty(0),
            torch.empty_like(weight) if want_weight else weight.new_empty(0),
            torch.empty_like(bias) if want_bias else hidden.new_empty(0))


def _setup_context(ctx, inputs, output):
    hidden, weight, bias, target, ignore_index = inputs
    ctx.save_for_backward(hidden, weight, bias, target, output[1])
    ctx.ignore_index = ignore_index


def _backward(ctx, grad_loss, grad_lse):
    if torch.is_grad_enabled():  # create_graph=True: the gradients below would be taken as constants, silently
        raise RuntimeError("linear_cross_entropy has no second derivative; for gradient penalties use "
                           "F.cross_entropy(F.linear(...)) or linear_cross_entropy_reference")
    hidden, weight, bias, target, lse = ctx.saved_tensors
    want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
    # The logsumexp output is internal to linear_cross_entropy (its gradient is None or zeros).
    grad_hidden, grad_weight, grad_bias = torch.ops.accel.linear_cross_entropy_bwd(
        grad_loss, hidden, weight, bias, target, lse, ctx.ignore_index, want_hidden, want_weight,
        bool(want_bias and bias is not None))
    return (grad_hidden if want_hidden else None, grad_weight if want_weight else None,
            grad_bias if want_bias and bias is not None else None, None, None)


_fwd.register_autograd(_backward, setup_context=_setup_context)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         bias: torch.Tensor | None = None, ignore_index: int = IGNORE_INDEX,
                         reduction: str = "mean") -> torch.Tensor:
    """`F.cross_entropy(F.linear(hidden, weight, bias).float(), target)` without the [N, V] logits.

    Under autocast the products run in its dtype, as F.linear's would; the softmax and the loss in fp32 (fp64
    for fp64 inputs). Gradients for hidden, weight and bias (those that require one); no second derivative.

    Args:
        hidden: [N, H] floating point.
        weight: [V, H], the linear layer's weight (a language model's lm_head, or its tied embedding).
        target: [N] class ids (int64 or int32) in [0, V), or ignore_index.
        bias: optional [V].
        ignore_index: the target value whose rows add nothing to the loss or the gradients.
        reduction: "mean" (over the rows not ignored; NaN when every row is, as F.cross_entropy) or "sum".

    Returns:
        The scalar loss, fp32 (fp64 for fp64 inputs).

    Raises:
        TypeError: an argument that is not a tensor, or of a dtype other than the ones above.
        ValueError: shapes or devices that do not match, or an unknown reduction.
    """
    check_tensor("hidden", hidden, ndim=2)
    check_tensor("weight", weight, ndim=2)
    check_tensor("target", target, dtypes=(torch.int64, torch.int32), ndim=1)
    if bias is not None:
        check_tensor("bias", bias, ndim=1)
    check_same_device(hidden=hidden, weight=weight, target=target, bias=bias)
    if weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight: expected [V, {hidden.shape[1]}] for hidden [N, {hidden.shape[1]}], "
                         f"got {tuple(weight.shape)}")
    if target.shape[0] != hidden.shape[0]:
        raise ValueError(f"target: expected [{hidden.shape[0]}] class ids (one per row of hidden), "
                         f"got {tuple(target.shape)}")
    if bias is not None and bias.shape[0] != weight.shape[0]:
        raise ValueError(f"bias: expected [{weight.shape[0]}] (weight's rows), got {tuple(bias.shape)}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction: expected one of {REDUCTIONS}, got {reduction!r}")
    compute = hidden.dtype
    if torch.is_autocast_enabled(hidden.device.type):
        compute = torch.get_autocast_dtype(hidden.device.type)
    with torch.autocast(hidden.device.type, enabled=False):
        loss, _ = torch.ops.accel.linear_cross_entropy_fwd(hidden.to(compute), weight, bias, target, ignore_index)
    if reduction == "mean":
        loss = loss / (target != ignore_index).sum()
    return loss
