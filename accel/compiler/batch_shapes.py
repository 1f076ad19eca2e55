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
"""
from __future__ import annotations

import os
import sys
import warnings

from accel.compiler.recompile_guard import flatten_inputs
from accel.utils.loader import LoaderWrapper

# Full batches and a shorter last one: two shapes that a static-shape loader also brings.
EXPECTED_SHAPES = 2
_SHOWN = 4  # sizes listed per changing dimension in the warning
_ACCEL = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


class ManyShapesWarning(UserWarning):
    """A compiled model's batches came in more shapes than a static-shape loader gives."""


def _shapes(batch) -> tuple:
    """((path, shape), ...) of the batch's tensors, in the batch's order."""
    found: dict = {}
    flatten_inputs(batch, "batch", found)
    return tuple((path, tuple(shape)) for path, (shape, _) in found.items() if shape is not None)


def _loop_stacklevel() -> int:
    """warnings.warn's stacklevel that names the training loop: the first caller outside accel (the loader's
    wrappers around this one vary with the config)."""
    level, frame = 2, sys._getframe(2)  # 1: warn's caller, this module's __iter__
    while frame is not None and frame.f_code.co_filename.startswith(_ACCEL):
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


class ShapeWatch(LoaderWrapper):
    """Iterate `loader` unchanged; warn once (ManyShapesWarning) when its batches have come in more than
    EXPECTED_SHAPES distinct sets of tensor shapes, over all passes."""

    def __init__(self, loader):
        super().__init__(loader)
        self._seen: dict = {}  # distinct shape sets, in arrival order
        self._warned = False

    def __iter__(self):
        for batch in self.loader:
            if not self._warned:
                self._seen.setdefault(_shapes(batch), None)
                if len(self._seen) > EXPECTED_SHAPES:
                    self._warned = True
                    changing = "; ".join(_changing(list(self._seen))) or "the set of inputs"
                    warnings.warn(
                        f"accelerate(): the loader's batches came in {len(self._seen)} shapes so far ({changing}) and "
                        "the model is compiled for static shapes: every new shape compiles it again (seconds to "
                        "minutes each), and past torch.compile's recompile limit it runs uncompiled. Pad batches to a "
                        "few lengths with dataloader.buckets (or dataloader.max_length and num_buckets), or pack them "
                        "with dataloader.pack", ManyShapesWarning, stacklevel=_loop_stacklevel())
            yield batch
