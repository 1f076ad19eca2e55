"""What torch.compile would trace of a call: the ops recorded on fake tensors while is_compiling() is true.
Fake tensors need no GPU, so a CPU-only machine checks the choices an op makes for CUDA tensors too."""
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx


def traced_ops(fn, device: str, shape=(4, 8)) -> set[str]:
    """The call_function targets of fn(x), x a fake tensor of `shape` on `device`, traced as under compile
    (load the op's kernels before: the accel ops must exist)."""
    with FakeTensorMode():
        x = torch.empty(shape, device=device)
        with mock.patch("torch.compiler.is_compiling", lambda: True):
            graph = make_fx(fn)(x)
    return {str(node.target) for node in graph.graph.nodes if node.op == "call_function"}


def accel_ops(ops: set[str]) -> set[str]:
    return {op for op in ops if op.startswith("accel.")}
