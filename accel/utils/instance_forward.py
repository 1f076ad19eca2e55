"""A module's forward replaced on the instance, for the model transforms that change what one module computes.

Setting `module.forward` on the instance (not the class) keeps the module's name, hooks, state_dict keys and
class: other modules of the class, and other models, are untouched; `module(...)` still runs the hooks around
the new forward. The replacement is a plain object (not a closure) so the model still pickles and deep-copies.
Transforms stack: each one calls the forward that was there before it (the class's, or an earlier instance
forward) through `own`.

What is set is the object's bound `__call__`, not the object: Dynamo guards an instance forward by identity
unless it is a bound method, whose function (shared by every instance of the transform) it guards instead. So a
second model built like the first runs the graphs compiled for the first (the same code objects, guards that
hold) instead of compiling its own.
"""
from __future__ import annotations

from torch import nn


class InstanceForward:
    """Base of a forward set on one module's instance; subclasses define __call__ and call `own` for the
    module's previous forward."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.inner = module.__dict__.get("forward")  # an instance forward set before this one, if any

    def own(self, *args, **kwargs):
        """The forward this one replaced."""
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def install(self):
        """Make this the module's forward; returns self."""
        object.__setattr__(self.module, "forward", self.__call__)
        return self


def installed_forward(module: nn.Module) -> InstanceForward | None:
    """The InstanceForward that is `module`'s forward, or None (the class's forward, or another replacement)."""
    owner = getattr(module.__dict__.get("forward"), "__self__", None)
    return owner if isinstance(owner, InstanceForward) else None
