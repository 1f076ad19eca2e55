"""A whole training step as one CUDA graph: forward, backward, optimizer step and zero_grad, one replay.

With mode="reduce-overhead" the forward and the backward are graph replays of their own and the optimizer
step is a compiled function: the host still runs Dynamo's guards, the graph trees' bookkeeping, the autograd
engine and the optimizer's Python every step. Where the GPU work of a step is small (BERT-base at batch 32,
seq 128 on an H100: ~8.7 ms of kernels) that host work bounds the step. `graph_step(fn)` captures the
user's whole step function once per input signature and afterwards only copies the inputs in and replays,
so the host's work per step is a few copies and one graph launch:

    config.compute.step_graph = True              # compiled without graph trees; optimizers capturable
    model, loader = accel.accelerate(model, loader, config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    @accel.graph_step
    def train_step(batch):
        loss = model(**batch)["loss"]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    for batch in loader:
        loss = train_step(batch)

What a captured step requires (torch.cuda.graph's rules):
- every tensor input on one CUDA device, with one of a few shapes (accel's bucketing or packing): each new
  signature (the inputs' structure, as accel.utils.batch walks it: dicts, BatchEncoding, lists, tuples,
  dataclasses; each tensor's shape, strides and dtype; the other values, by their repr) runs `warmup` plain
  steps on a side stream (compiling and initialising everything lazy), then is captured; a call whose
  inputs are not all CUDA tensors runs fn as it is;
- no host synchronisation inside fn (.item(), printing a tensor, a CPU tensor made from a CUDA one);
- fn's Python runs at capture only: its side effects (counters, logging, a scheduler called inside it) do
  not happen on replays. A scheduler stepped outside the step changes the learning rate of replays as
  long as the lr is a tensor, which compute.step_graph makes it (accel.compiler.optimizer);
- what fn returns is copied out of the graph (detached) each call; tensors fn leaves behind otherwise (a
  .grad kept past the step) live in the graphs' memory and are overwritten by the next replay.
Graphs of different signatures share one memory pool: only one runs at a time, and none keeps memory
past its replay besides its outputs, which are copied.
"""
from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch

from accel.utils.batch import iter_tensors, map_tensors
from accel.utils.checks import check_int

__all__ = ["GraphedStep", "graph_step"]

_PLAIN_HINT = ("give accelerate() config.compute.step_graph = True: graph_step captures the whole step, which "
               "cannot hold the CUDA-graph replays of mode='reduce-overhead' inside it")


class _Slot:
    """Stands for a tensor in a signature's picture of the inputs."""

    def __repr__(self) -> str:
        return "<tensor>"


_SLOT = _Slot()
# Signatures one step may see before it says that they keep changing (a graph is kept for each).
_MANY_SIGNATURES = 16


def _tensor_device(tensors: list) -> torch.device | None:
    """The one CUDA device of the inputs' tensors, or None when the step cannot be captured (no tensor, a tensor
    elsewhere, or several devices: then a warning, as a step that never becomes a graph is easy to miss)."""
    devices = {x.device for x in tensors}
    if len(devices) > 1:
        warnings.warn(f"graph_step: the step's tensors are on {len(devices)} devices "
                      f"({', '.join(sorted(map(str, devices)))}): it runs uncaptured; move them to one CUDA device",
                      stacklevel=3)
    if len(devices) != 1:
        return None
    (device,) = devices
    return device if device.type == "cuda" else None


def _tensors_and_skeleton(inputs) -> tuple[list, Any]:
    """The inputs' tensors in iter_tensors' order, and the inputs with every tensor a slot: one walk a call."""
    tensors: list[torch.Tensor] = []

    def slot(t: torch.Tensor) -> _Slot:
        tensors.append(t)
        return _SLOT

    return tensors, map_tensors(inputs, slot)


def _signature(skeleton, tensors: list) -> tuple:
    """What a captured graph is specific to: the inputs' structure and non-tensor values (the skeleton's repr),
    each tensor's layout, and whether autograd records (a step called under no_grad is another graph)."""
    layouts = tuple((tuple(x.shape), x.stride(), x.dtype, x.requires_grad) for x in tensors)
    return torch.is_grad_enabled(), repr(skeleton), layouts


def _copy_out(outputs: Any) -> Any:
    return map_tensors(outputs, lambda t: t.detach().clone())


class _Captured:
    """One signature's graph: the static inputs it reads, the outputs it writes."""

    def __init__(self, graph, inputs: list, outputs: Any):
        self.graph = graph
        self.inputs = inputs  # static copies of the inputs' tensors, in iter_tensors' order
        self.outputs = outputs

    def run(self, tensors: list) -> Any:
        for static, x in zip(self.inputs, tensors):
            static.copy_(x)
        self.graph.replay()
        return _copy_out(self.outputs)


class GraphedStep:
    """`fn` (a whole training step) replayed as one CUDA graph per input signature; see the module docstring.

    Args:
        fn: the step; called with the same arguments as the GraphedStep.
        warmup: plain steps each new signature runs (on a side stream) before it is captured: compiling,
            the optimizer's state and cuBLAS's workspace must all exist before the capture.
    """

    def __init__(self, fn: Callable, warmup: int = 3):
        if not callable(fn):
            raise TypeError(f"fn: expected a callable, got {type(fn).__name__}")
        self.fn = fn
        self.warmup = check_int("warmup", warmup, min=1)
        self._graphs: dict[tuple, _Captured] = {}
        self._warmed: dict[tuple, int] = {}
        self._pool = None
        self._side = None  # the warm-ups' stream
        functools.update_wrapper(self, fn, updated=())  # name and doc; never fn.__dict__ over our own state

    @property
    def graphs(self) -> int:
        """Signatures captured so far."""
        return len(self._graphs)

    def __call__(self, *args, **kwargs):
        inputs = (args, kwargs)
        tensors, skeleton = _tensors_and_skeleton(inputs)
        device = _tensor_device(tensors)
        if device is None:
            return self.fn(*args, **kwargs)
        key = _signature(skeleton, tensors)
        captured = self._graphs.get(key)
        if captured is None:
            done = self._warmed.get(key, 0)
            if done < self.warmup:
                self._warmed[key] = done + 1
                if len(self._warmed) + len(self._graphs) == _MANY_SIGNATURES and done == 0:
                    warnings.warn(f"graph_step: {_MANY_SIGNATURES} input signatures so far, each warmed up and "
                                  "captured on its own: pad the inputs to a few shapes (accel's buckets or "
                                  "packing), and keep non-tensor arguments the same from step to step",
                                  stacklevel=2)
                return self._side_stream_call(device, args, kwargs)
            captured = self._capture(device, inputs)
            self._graphs[key] = captured
            del self._warmed[key]
        return captured.run(tensors)

    def _side_stream_call(self, device: torch.device, args, kwargs):
        # torch.cuda.graph's warm-up rule: run the step on a side stream before capturing it
        current = torch.cuda.current_stream(device)
        if self._side is None:
            self._side = torch.cuda.Stream(device)
        side = self._side
        side.wait_stream(current)
        with torch.cuda.stream(side):
            out = self.fn(*args, **kwargs)
        current.wait_stream(side)
        for t in iter_tensors(out):  # made on the side stream, used on the caller's from now on
            if t.device.type == "cuda":
                t.record_stream(current)
        # detached as a replay's are: a returned loss would keep the step's autograd graph (and its
        # AccumulateGrad nodes, made on the side stream) alive into the next step, which torch warns about
        return map_tensors(out, torch.Tensor.detach)

    def _capture(self, device: torch.device, inputs) -> _Captured:
        # static copies in the inputs' own containers (a BatchEncoding stays one)
        args, kwargs = map_tensors(inputs, lambda x: x.detach().clone().requires_grad_(x.requires_grad))
        graph = torch.cuda.CUDAGraph()
        # thread_local: a Prefetcher thread may copy the next batch on its own stream meanwhile
        try:
            with torch.cuda.device(device), torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                outputs = self.fn(*args, **kwargs)
        except RuntimeError as exc:
            raise RuntimeError(f"graph_step: capturing the step failed ({exc}). If the model was accelerated, "
                               f"{_PLAIN_HINT}; and the step must not synchronise with the host (no .item(), no "
                               "printing tensors)") from exc
        if self._pool is None:
            self._pool = graph.pool()
        return _Captured(graph, iter_tensors((args, kwargs)), outputs)


def graph_step(fn: Callable | None = None, *, warmup: int = 3):
    """`fn` as a GraphedStep; usable as `@graph_step` or `@graph_step(warmup=5)`."""
    if fn is None:
        return lambda f: GraphedStep(f, warmup=warmup)
    return GraphedStep(fn, warmup=warmup)
