"""Base of accel's Inductor graph passes: two instances are equal when they transform graphs alike.

A pass is part of the options a model is compiled with, and Dynamo runs a graph compiled for one model on
another only when their backends compare equal (torch's Inductor backend compares its options by value). A pass
without equality made every accelerate() a backend of its own, so a second model built like the first (a sweep,
cross-validation, a notebook cell run again) compiled everything anew; with it, the second model's calls run the
first one's graphs wherever Dynamo's guards hold (same code, shapes, dtypes and settings).
"""
from __future__ import annotations

from torch._inductor.custom_graph_pass import CustomGraphPass


class GraphPass(CustomGraphPass):
    """A CustomGraphPass whose instances of one class and one uuid() are equal (and hash alike): uuid() already
    names what the pass does (Inductor's cache keys on it)."""

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and other.uuid() == self.uuid()

    def __hash__(self) -> int:
        return hash((type(self), self.uuid()))
