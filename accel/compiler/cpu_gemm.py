"""Compiled CPU graphs compute their large fp32 matrix products through oneDNN where it beats torch's BLAS.

Inductor calls torch's `mm`/`addmm` (MKL on x86) for the matrix products of a compiled CPU graph, forward and
backward. On CPUs where oneDNN computes fp32 products faster (accel.runtime.nn.onednn_mm: 1.7-2.4x on an AMD
EPYC with AVX-512, whose AVX-512 MKL does not use), `SwapCpuGemms`, a post-grad graph pass that accelerate()
gives Inductor on the CPU, replaces the large fp32 ones with `accel::onednn_mm`, each where oneDNN measured
faster for that product's shape and layout (timed while compiling, once per process and product). The
products and their operands are unchanged; only the library that sums them, and so their rounding, differs. BERT-base 8x128
fp32 training through accelerate() on that CPU: 1.36 s a step against 2.56 s with torch's products (2.29x
against 1.23x eager fp32; benchmarks/results/bert_base_cpu_fp32_simulated.json).

accelerate() installs the pass where compute.cpu_gemm asks for oneDNN: "onednn", or "auto" (the default) where
the once-per-process probe (accel.runtime.nn.onednn_mm.onednn_wins) found it faster on this CPU. A model
compiled by hand takes it the same way:

    if onednn_wins():
        model.compile(options={"post_grad_custom_post_pass": SwapCpuGemms()})
"""
from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import get_hash_for_files

from accel.compiler.graph_pass import GraphPass
from accel.runtime.nn import onednn_mm as _onednn


def _static_product_size(a, b) -> tuple[int, int, int] | None:
    try:
        return int(a.shape[0]), int(a.shape[1]), int(b.shape[1])
    except TypeError:  # symbolic sizes: accel compiles static shapes; leave dynamic ones to torch
        return None


def _swappable(node: torch.fx.Node) -> bool:
    """A large fp32 CPU product of 2-D operands; addmm's bias a vector and beta = alpha = 1."""
    aten = torch.ops.aten
    if node.op != "call_function" or node.target not in (aten.mm.default, aten.addmm.default):
        return False
    if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
        return False
    values = [arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None for arg in node.args]
    out = node.meta.get("val")
    if out is None or len(values) not in (2, 3) or any(v is None for v in values):
        return False
    if any(v.device.type != "cpu" or v.dtype != torch.float32 for v in (out, *values)):
        return False
    if node.target is aten.addmm.default and values[0].dim() != 1:
        return False
    size = _static_product_size(*values[-2:])
    return size is not None and _onednn.large(*size)


def _input_layouts(a: torch.fx.Node, b: torch.fx.Node, bias) -> tuple:
    """The example inputs whose strides Inductor gives the op (its eager_input_vals): a row-major, b and bias as
    they are. oneDNN's linear copies a transposed left operand itself, single-threaded and slowly (6 ms for the
    [3072, 1024] one of BERT's weight gradients); asked for row-major, Inductor writes it so in the kernel that
    produces it (a GELU backward, say), or copies it with a tiled, vectorised loop."""
    val = a.meta["val"]
    if not val.is_contiguous():
        with val.fake_mode:
            val = torch.empty(val.shape, dtype=val.dtype, device=val.device)
    bias_val = bias.meta["val"] if isinstance(bias, torch.fx.Node) else None
    return (val, b.meta["val"], bias_val), {}


class SwapCpuGemms(GraphPass):
    """Inductor post-grad pass: large fp32 CPU mm/addmm nodes become accel::onednn_mm, each where oneDNN measured
    faster for its shape and layout (accel.runtime.nn.onednn_mm.onednn_faster). Whoever installs it has decided
    that oneDNN can win on this CPU (accelerate(): compute.cpu_gemm and the probe)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in list(graph.nodes):
            if not _swappable(node):
                continue
            if node.target is torch.ops.aten.addmm.default:
                bias, a, b = node.args
            else:
                (a, b), bias = node.args, None
            layouts = _input_layouts(a, b, bias)
            if not _onednn.onednn_faster(*layouts[0]):  # timed for this product's shape and layout
                continue
            with graph.inserting_before(node):
                swapped = graph.call_function(torch.ops.accel.onednn_mm.default, (a, b, bias))
            swapped.meta.update(node.meta)
            swapped.meta["eager_input_vals"] = layouts
            node.replace_all_uses_with(swapped)
            graph.erase_node(node)

    def uuid(self):
        return get_hash_for_files((__file__, _onednn.__file__))
