"""Benchmark cases for benchmarks/kernels.py, one module per op (<op>.py, named like csrc/cpu/<op>.cpp).

Each module defines `cases(device: str, quick: bool)`, a list of Case or a generator of them (which
builds a case's inputs only when it is its turn, for ops with large ones). A Case is one op at one size:
our implementation and every peer as zero-argument callables on pre-made inputs, plus the bytes an
ideal implementation must move (read + write) so kernels.py can report GB/s against the device's
measured copy bandwidth. `quick` asks for small sizes only (CPU smoke runs).

A module may also define `host_cases(device: str) -> list[Case]` for benchmarks/host_cost.py: the op
as a model calls it (the public function or module, forward, and forward + backward where it has a
gradient) on inputs so small that the kernel takes no time, so what is timed is the host's cost of a
call (Python checks, dispatch, autograd), next to the same call of torch's own ops.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class Case:
    op: str                       # e.g. "quick_gelu fwd"
    size: str                     # human-readable size, e.g. "16M fp32"
    bytes_moved: int              # minimal bytes read + written by one call
    ours: Callable[[], Any]
    peers: dict[str, Callable[[], Any]] = field(default_factory=dict)  # name -> callable
    memory_bound: bool = True     # judged against copy bandwidth when True


def grad_case(op: str, size: str, bytes_moved: int, inputs: tuple, grad_output, ours: Callable[..., Any],
              peers: dict[str, Callable[..., Any]]) -> Case:
    """A Case timing fn(*inputs) forward and backward (the gradients of all inputs for grad_output) for ours
    and for each peer: how an op performs inside a compiled graph, next to the same graph in other ops."""
    import torch

    def step(fn):
        return torch.autograd.grad(fn(*inputs), inputs, grad_output)

    return Case(op, size, bytes_moved, lambda: step(ours), {name: lambda fn=fn: step(fn) for name, fn in peers.items()})
