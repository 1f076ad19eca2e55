"""Gradients that survive the next CUDA-graph replay, for models compiled with mode="reduce-overhead".

Under CUDA graphs the compiled backward writes its outputs into the graphs' memory pool, and autograd hands
a parameter that has no .grad yet the output tensor itself (it takes it over instead of copying). The next
replay writes that memory again. A .grad kept past its step therefore breaks: with
zero_grad(set_to_none=False), or gradients summed over micro-batches, the next backward either raises
"accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run" or, where the replay
wrote the very buffer .grad holds, sums wrong values without a word (pytorch/pytorch#169545).

`keep_grads_out_of_graph_pool(model)` runs, before each call of the compiled model, a check of every
parameter: a .grad that is not a copy made here (one autograd took over from a replay) gets a copy of its
own, once, while the replay's memory still holds it. Later backwards add into that copy in place and
zero_grad(set_to_none=False) zeroes it in place, so it stays the copy: no further copies. The usual loop,
zero_grad() setting .grad to None before the next forward, finds no .grad and copies nothing; the check
then costs a read of each parameter's .grad: ~10 us a call for 200 parameters (kept gradients: ~40 us).
"""
from __future__ import annotations

import operator
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from accel.compiler.compiled_call import wrap_compiled_call

_grad_of = operator.attrgetter("grad")


def _none() -> None:
    return None


class _GradsOutOfGraphPool:
    """The compiled call, preceded by the copy of graph-owned gradients. A plain object (not a closure):
    nn.Module drops `_compiled_call_impl` when pickled, and this never needs pickling itself."""

    def __init__(self, params: list[nn.Parameter], compiled_call: Callable[..., Any]):
        self.params = params
        self.compiled_call = compiled_call
        self.nones = [None] * len(params)
        # weak references to the copies made here (a dead one where none): a copy is freed as soon as the
        # user drops the .grad (zero_grad(set_to_none=True)), and is recognised while it is the .grad
        self.copies: list[Callable[[], torch.Tensor | None]] = [_none] * len(params)

    def __call__(self, *args, **kwargs):
        grads = list(map(_grad_of, self.params))
        if grads != self.nones:  # C-speed test for the usual loop, which leaves no .grad before a forward
            self._copy_foreign(grads)
        return self.compiled_call(*args, **kwargs)

    def _copy_foreign(self, grads: list[torch.Tensor | None]) -> None:
        copies = self.copies
        for i, grad in enumerate(grads):
            if grad is not None and grad is not copies[i]():
                # a tensor autograd took from a replay (or one the user set): from now on a copy of our own
                own = grad.clone()  # clone keeps the strides, which .grad's layout contract wants
                self.params[i].grad = own
                copies[i] = weakref.ref(own)


def keep_grads_out_of_graph_pool(model: nn.Module) -> None:
    """Makes the gradients of `model` (compiled by `model.compile(mode="reduce-overhead")`) safe to keep
    across steps; see the module docstring.

    Args:
        model: a module whose `compile()` was called: its compiled call gets the check in front.

    Raises:
        ValueError: `model` was not compiled with `nn.Module.compile()`.
    """
    if has_graph_pool_grad_check(model):
        return
    # every parameter, frozen ones too: one unfrozen later is covered, and one without .grad costs a read
    wrap_compiled_call(model, lambda compiled: _GradsOutOfGraphPool(list(model.parameters()), compiled))


def has_graph_pool_grad_check(model: nn.Module) -> bool:
    """Whether keep_grads_out_of_graph_pool() guards `model`'s compiled call."""
    return isinstance(getattr(model, "_compiled_call_impl", None), _GradsOutOfGraphPool)


__all__ = ["has_graph_pool_grad_check", "keep_grads_out_of_graph_pool"]
