"""Compiled CPU graphs draw their dropout masks with accel's vectorised Philox kernel.

Inductor's CPU code draws each random number of a dropout mask with a scalar Philox of its own (~10 ns an element,
accel.runtime.policy). accelerate() already swaps a model's nn.Dropout layers for PhiloxDropout, whose mask comes
from `accel::dropout_mask` (64 draws at a time), but many models call the function instead of a layer
(`nn.functional.dropout(hidden, p=self.dropout, training=self.training)`: BART, mBART, Marian, Pegasus, OPT,
Whisper, ...), and those masks stayed Inductor's. In a small BART's bf16 training step on a 2-core AVX512-BF16 CPU
they took ~25% of the step.

`DrawDropoutMasks` is an Inductor joint-graph pass (run on the forward + backward graph, before Inductor replaces
torch's random ops with its own): every dropout mask of the graph, which torch's decomposition of dropout writes as
`rand(shape) > p` (whether the model called F.dropout or an nn.Dropout layer), becomes `accel::dropout_mask(shape,
p)`: the same keep rule (each element kept with probability 1 - p, drawn from torch's default generator, so
torch.manual_seed makes a run repeat), the rest of the dropout (the scaling, the backward's use of the mask)
unchanged. Random numbers used any other way stay Inductor's. accelerate() gives the pass to the models it
compiles on the CPU (with compute.kernels, where accel.runtime.policy lists philox_dropout); a model compiled by
hand takes it the same way:

    model.compile(options={"joint_custom_pre_pass": DrawDropoutMasks()})
"""
from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import get_hash_for_files

from accel.compiler.graph_pass import GraphPass
from accel.runtime.nn.bias_dropout_add import _ops, dropout_mask_call

__all__ = ["DrawDropoutMasks"]


def _dropout_mask(node: torch.fx.Node) -> tuple | None:
    """(size, p, device) when `node` is `rand(size, device=cpu) > p` whose random numbers serve only that
    comparison, with 0 < p < 1: a dropout's keep mask as torch's decomposition writes it."""
    aten = torch.ops.aten
    if node.op != "call_function" or node.target is not aten.gt.Scalar:
        return None
    rand, p = node.args
    if not (isinstance(rand, torch.fx.Node) and rand.op == "call_function" and rand.target is aten.rand.default
            and len(rand.users) == 1 and isinstance(p, float) and 0.0 < p < 1.0):
        return None
    device = rand.kwargs.get("device")
    if device is None or torch.device(device).type != "cpu" or rand.kwargs.get("generator") is not None:
        return None
    return rand.args[0], p, device


class DrawDropoutMasks(GraphPass):
    """Inductor joint-graph pass (joint_custom_pre_pass): the CPU dropout masks of a graph come from
    accel::dropout_mask (see the module docstring). Idempotent: Inductor may run a pre pass twice."""

    def __init__(self):
        # Loaded now, not when the pass first runs: a graph found in Inductor's cache runs code calling the op
        # without the pass having run in this process.
        self._dropout_mask = _ops().dropout_mask.default

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in list(graph.nodes):
            found = _dropout_mask(node)
            if found is None:
                continue
            size, p, device = found
            rand = node.args[0]
            with graph.inserting_before(node):
                mask = graph.call_function(self._dropout_mask, (size, p),
                                           {"device": device, "call": dropout_mask_call()})
            mask.meta.update(node.meta)
            node.replace_all_uses_with(mask)
            graph.erase_node(node)
            graph.erase_node(rand)

    def uuid(self):
        return get_hash_for_files((__file__,))
