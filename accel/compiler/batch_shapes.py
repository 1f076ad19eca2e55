"""Say once that a compiled model's batches keep changing shape (the loader accelerate() returns).

accelerate() compiles for static shapes: torch.compile(dynamic=False) on cuda and cpu keeps one graph per input
shape, and XLA compiles a graph per shape by nature. A loader that pads each batch to its own longest sample (a
padding collate_fn such as DataCollatorWithPadding) brings a new shape almost every batch, so the model compiles
again and again, seconds to minutes each time, and on cuda/cpu, past Dynamo's recompile limit, runs uncompiled
from then on. A 2-layer BERT (hidden 128) on 60 batches of 8 samples of 16-128 tokens, 2-core CPU: 118 s for the
first 20 steps, against 36 s with dataloader.max_length=128 and num_buckets=4. Padding to a few lengths
(dataloader.buckets, or max_length with num_buckets) or packing (dataloader.pack) is the fix; TorchAcc's configs
leave it to the user, so accelerate() does not pad unasked, but its loader warns (ManyShapesWarning) when a third
distinct set of batch shapes arrives (full batches and a shorter last one are two), naming the dimensions that
changed. Reading shapes costs no device access (torch.Size is host metadata).

A model accelerate()d without its loader (a loop that keeps its own, transformers' Trainer) is watched at its
calls instead (`watch_call_shapes`: in front of its compiled call; quiet once it has warned, or when a later
accelerate() call wraps a loader): the same warning, whose fix there is to give accelerate() the loader, or to
pad to a few lengths in the collate function (DataCollatorWithPadding's pad_to_multiple_of, padding="max_length").
A 4-layer BERT (hidden 256) called on 40 batches of 29 lengths, bf16, 2-core CPU: 167 s compiling against 2.1 s
eager.
"""
from __future__ import annotations

import os
import sys
import warnings

import torch
from torch import nn

from accel.compiler.compiled_call import wrap_compiled_call
from accel.compiler.decoding import carries_kv_cache
from accel.compiler.recompile_guard import flatten_inputs
from accel.utils.loader import LoaderWrapper

# Full batches and a shorter last one: two shapes that a static-shape loader also brings.
EXPECTED_SHAPES = 2
_SHOWN = 4  # sizes listed per changing dimension in the warning
_ACCEL = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


class ManyShapesWarning(UserWarning):
    """A compiled model's batches came in more shapes than a static-shape loader gives."""


def _tensor_shapes(found: dict) -> tuple:
    return tuple((path, tuple(shape)) for path, (shape, _) in found.items() if shape is not None)


def _shapes(batch) -> tuple:
    """((path, shape), ...) of the batch's tensors, in the batch's order."""
    found: dict = {}
    flatten_inputs(batch, "batch", found)
    return _tensor_shapes(found)


def _call_shapes(args: tuple, kwargs: dict) -> tuple:
    """((argument, shape), ...) of a call's tensors: args[i]... and keyword arguments by name."""
    found: dict = {}
    for i, value in enumerate(args):
        flatten_inputs(value, f"args[{i}]", found)
    for name, value in kwargs.items():
        flatten_inputs(value, name, found)
    return _tensor_shapes(found)


def _loop_stacklevel(skipped: tuple[str, ...] = (_ACCEL,)) -> int:
    """warnings.warn's stacklevel that names the training loop: the first caller outside the `skipped` folders
    (accel: the loader's wrappers around this one vary with the config; torch too for a module's hook)."""
    level, frame = 2, sys._getframe(2)  # 1: warn's caller, this module's __iter__ or hook
    while frame is not None and frame.f_code.co_filename.startswith(skipped):
        level, frame = level + 1, frame.f_back
    return level


def _changing(seen: list) -> list[str]:
    """'batch['input_ids'] dim 1: 37, 52, 64' for each dimension whose size differs between the seen shapes."""
    sizes: dict = {}
    for shapes in seen:
        for path, shape in shapes:
            for dim, size in enumerate(shape):
                sizes.setdefault((path, dim), []).append(size)
    out = []
    for (path, dim), values in sizes.items():
        distinct = list(dict.fromkeys(values))
        if len(distinct) > 1:
            more = ", ..." if len(distinct) > _SHOWN else ""
            out.append(f"{path} dim {dim}: {', '.join(map(str, distinct[:_SHOWN]))}{more}")
    return out


class _Shapes:
    """The distinct sets of tensor shapes seen; `too_many(shapes)` gives, once, the description of the changing
    dimensions when more than EXPECTED_SHAPES have come."""

    def __init__(self):
        self.seen: dict = {}  # distinct shape sets, in arrival order
        self.done = False  # warned

    def too_many(self, shapes: tuple) -> str | None:
        self.seen.setdefault(shapes, None)
        if len(self.seen) <= EXPECTED_SHAPES:
            return None
        self.done = True
        return "; ".join(_changing(list(self.seen))) or "the set of inputs"


_RECOMPILES = ("and the model is compiled for static shapes: every new shape compiles it again (seconds to minutes "
               "each), and past torch.compile's recompile limit it runs uncompiled.")


class ShapeWatch(LoaderWrapper):
    """Iterate `loader` unchanged; warn once (ManyShapesWarning) when its batches have come in more than
    EXPECTED_SHAPES distinct sets of tensor shapes, over all passes."""

    def __init__(self, loader):
        super().__init__(loader)
        self._shapes = _Shapes()

    def __iter__(self):
        for batch in self.loader:
            changing = None if self._shapes.done else self._shapes.too_many(_shapes(batch))
            if changing:
                warnings.warn(
                    f"accelerate(): the loader's batches came in {len(self._shapes.seen)} shapes so far ({changing}) "
                    f"{_RECOMPILES} Pad batches to a few lengths with dataloader.buckets (or dataloader.max_length "
                    "and num_buckets), or pack them with dataloader.pack", ManyShapesWarning,
                    stacklevel=_loop_stacklevel())
            yield batch


class CallShapes:
    """What watch_call_shapes installs; `stop()` ends the watch (a loader now watched instead). Shapes are counted
    per mode of the call (training or not, gradients or not): an evaluation loop's full and last batches are
    graphs of their own beside training's, not changing shapes of one loop."""

    def __init__(self, model: nn.Module):
        self._model = model
        self._by_mode: dict = {}  # (training, grad enabled) -> _Shapes
        self._done = False

    def stop(self) -> None:
        self._done = True

    def see(self, args: tuple, kwargs: dict) -> None:
        if self._done:
            return
        key = (self._model.training, torch.is_grad_enabled())
        mode = self._by_mode.get(key) or self._by_mode.setdefault(key, _Shapes())  # a new record once a mode
        shapes = _call_shapes(args, kwargs)
        # generate()'s calls grow the key/value cache by a token each and run uncompiled (accel.compiler.decoding)
        if shapes in mode.seen or carries_kv_cache(args, kwargs):
            return
        changing = mode.too_many(shapes)
        if changing:
            self._done = True
            warnings.warn(
                f"accelerate(): the model's calls came in {len(mode.seen)} input shapes so far ({changing}) "
                f"{_RECOMPILES} accelerate() was given no loader to make them static: give it the DataLoader "
                "(then dataloader.buckets or dataloader.pack), or pad in the collate function to a few lengths "
                "(DataCollatorWithPadding's pad_to_multiple_of, or padding='max_length')", ManyShapesWarning,
                stacklevel=_loop_stacklevel((_ACCEL, _TORCH)))


def watch_call_shapes(model: nn.Module) -> CallShapes:
    """Warn once (ManyShapesWarning) when `model` has been called with more than EXPECTED_SHAPES distinct sets of
    tensor shapes (its positional and keyword arguments) in one mode (training or evaluation, with or without
    gradients). A model compiled with `model.compile()` is watched in
    front of its compiled call (accel.compiler.compiled_call), another (XLA's lazy tensors compile by themselves)
    by a forward pre-hook."""
    watch = CallShapes(model)
    if getattr(model, "_compiled_call_impl", None) is None:
        model.register_forward_pre_hook(lambda module, args, kwargs: watch.see(args, kwargs), with_kwargs=True)
        return watch

    def wrap(compiled):
        def call(*args, **kwargs):
            watch.see(args, kwargs)
            return compiled(*args, **kwargs)

        return call

    wrap_compiled_call(model, wrap)
    return watch
