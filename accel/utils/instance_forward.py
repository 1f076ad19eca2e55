"""A module's forward replaced on the instance, for the model transforms that change what one module computes.

Setting `module.forward` on the instance (not the class) keeps the module's name, hooks, state_dict keys and
class: other modules of the class, and other models, are untouched; `module(...)` still runs the hooks around
the new forward. The replacement is a plain object (not a closure) so the model still pickles and deep-copies.
Transforms stack: each one calls the forward that was there before it (the class's, or an earlier instance
forward) through `own`.

What is set is a bound method of the object, not the object: Dynamo guards an instance forward by identity
unless it is a bound method, whose function it guards by its code. So a second model built like the first runs
the graphs compiled for the first (the same code objects, guards that hold) instead of compiling its own. The
function is the object's own copy of its class's `__call__` (the same code) carrying the signature of the forward
it replaced: `inspect.signature(model.forward)` is what HF Trainer reads to keep the batch's columns the forward
takes, and a forward of `(*args, **kwargs)` made it drop every one ("You must specify exactly one of input_ids or
inputs_embeds").
"""
from __future__ import annotations

import inspect
import types

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
        object.__setattr__(self.module, "forward", self.bound_forward)
        return self

    @property
    def bound_forward(self) -> types.MethodType:
        """`self.__call__`, through a function of its own that shares the class's code and has the replaced
        forward's signature. Its name is this property's: a pickled or deep-copied module's forward is
        `getattr(copy of this object, "bound_forward")`, made again for the copy."""
        call = type(self).__call__
        signature = self._replaced_signature() if "module" in self.__dict__ else None  # None: being unpickled
        if signature is None:
            return types.MethodType(call, self)
        function = types.FunctionType(call.__code__, call.__globals__, "bound_forward", call.__defaults__,
                                      call.__closure__)
        function.__kwdefaults__ = call.__kwdefaults__
        function.__qualname__ = f"{type(self).__qualname__}.__call__"
        this = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
        function.__signature__ = signature.replace(parameters=[this, *signature.parameters.values()])
        return types.MethodType(function, self)

    def _replaced_signature(self) -> inspect.Signature | None:
        """The signature of the first forward under this one's stack that is not an InstanceForward (each of
        those has the signature of what it replaced): the class's, or a user's own; None where there is none to
        read."""
        inner = self.inner
        while isinstance(getattr(inner, "__self__", None), InstanceForward):
            below = inner.__self__
            if "inner" not in below.__dict__:
                return None  # being unpickled
            inner = below.inner
        replaced = inner if inner is not None else types.MethodType(type(self.module).forward, self.module)
        try:
            return inspect.signature(replaced)
        except (TypeError, ValueError):
            return None

    def __setstate__(self, state):
        self.__dict__.update(state)
        # Unpickling can reach this object before its module, whose forward was then bound to it before this
        # state existed (without the signature): bind it again.
        forward = self.module.__dict__.get("forward")
        if getattr(forward, "__self__", None) is self and getattr(forward, "__func__", None) is type(self).__call__:
            object.__setattr__(self.module, "forward", self.bound_forward)


def installed_forward(module: nn.Module) -> InstanceForward | None:
    """The InstanceForward that is `module`'s forward, or None (the class's forward, or another replacement)."""
    owner = getattr(module.__dict__.get("forward"), "__self__", None)
    return owner if isinstance(owner, InstanceForward) else None


def stacked_forward(module: nn.Module, kind: type | tuple[type, ...]) -> InstanceForward | None:
    """The InstanceForward of type `kind` in the stack that is `module`'s forward (one installed later, such as
    accelerate()'s autocast forward, may sit above it), or None."""
    forward = installed_forward(module)
    while forward is not None and not isinstance(forward, kind):
        below = getattr(forward.inner, "__self__", None)
        forward = below if isinstance(below, InstanceForward) else None
    return forward
