"""What sits in front of a compiled model's call.

`model.compile()` stores the compiled call as `model._compiled_call_impl`, which `model(...)` calls instead of
`_call_impl`, outside the compiled code. accelerate() puts plain-Python steps in front of it there (a forward hook
would run inside the compiled code, traced by Dynamo): generate()'s calls run uncompiled (decoding), a failure
after a move is explained (moved_model), input shapes are watched (batch_shapes), gradients are copied out of a
CUDA graph's pool (graph_pool_grads). nn.Module drops `_compiled_call_impl` when pickled or copied, so a copy of
the model is plainly uncompiled, not bound to this model through these closures.
"""
from __future__ import annotations

from collections.abc import Callable

from torch import nn


def wrap_compiled_call(model: nn.Module, wrap: Callable[[Callable], Callable]) -> None:
    """Replace `model`'s compiled call by `wrap(compiled call)`.

    Raises:
        ValueError: `model` was not compiled with `model.compile()`.
    """
    compiled = getattr(model, "_compiled_call_impl", None)
    if compiled is None:
        raise ValueError(f"model: expected a module compiled with .compile(), got an uncompiled "
                         f"{type(model).__name__}")
    model._compiled_call_impl = wrap(compiled)
