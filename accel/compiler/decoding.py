"""A compiled model and its key/value cache: generation runs uncompiled, training calls build no cache.

Generation runs uncompiled: a model compiled for training would recompile for every generated token.

accelerate() compiles the model with static shapes, one graph per batch shape of training and evaluation.
transformers' generate() calls the same model with a key/value cache that grows by a token a call, so each
token is a new shape: a 2-layer GPT-2 compiled so on the CPU took 26.7 s for 12 tokens (9 compilations, then
Dynamo's recompile limit and uncompiled calls) where its plain forward takes well under a second.
`eager_when_decoding(model)` makes the calls that carry a key/value cache (a transformers Cache under any
argument name, or a `past_key_values` of older transformers) run the model's own forward, and every other
call the compiled one. generate() with transformers' static cache and its own compile_config still compiles:
it compiles its own call of the model, through which this choice is traced as plain Python.

Training calls build no cache: transformers' decoders build one whenever use_cache is on (their config's default),
in training too unless gradient checkpointing is on. A training step never reads it, and while there is one
transformers does not look for packed rows in the position ids (masking_utils reads them only without a cache):
rows packed by DataCollatorWithFlattening or TRL's packing (position ids restarting at each sample, no attention
mask) then attend across their samples, silently. `no_cache_when_training(hf)` gives the training calls of the
model (training mode, gradients on; compiled or not) that pass neither use_cache nor a cache use_cache=False, as
PackedModel's rows have.
"""
from __future__ import annotations

import functools
import inspect

import torch
from torch import nn

from accel.compiler.compiled_call import wrap_compiled_call
from accel.utils.transformers_models import kv_cache_types


def carries_kv_cache(args: tuple, kwargs: dict) -> bool:
    """Whether a model call passes a key/value cache (the incremental decoding of generate())."""
    if kwargs.get("past_key_values") is not None:
        return True
    types = kv_cache_types()
    return bool(types) and any(isinstance(v, types) for v in (*args, *kwargs.values()))


def eager_when_decoding(model: nn.Module) -> None:
    """Let calls of a model compiled by `model.compile()` that carry a key/value cache run uncompiled.

    Args:
        model: a module after `model.compile(...)`.

    Raises:
        ValueError: the model was not compiled with `model.compile()`.
    """
    def wrap(compiled):
        def call(*args, **kwargs):
            if carries_kv_cache(args, kwargs):
                return model._call_impl(*args, **kwargs)
            return compiled(*args, **kwargs)

        return call

    wrap_compiled_call(model, wrap)


@functools.cache
def _use_cache_position(cls: type) -> int | None:
    """The place of use_cache among the positional arguments of `cls`.forward (past `self`); None where it takes
    none."""
    try:
        parameters = list(inspect.signature(cls.forward).parameters)
    except (TypeError, ValueError):
        return None
    return parameters.index("use_cache") - 1 if "use_cache" in parameters else None


def _no_cache_pre_hook(module: nn.Module, args: tuple, kwargs: dict):
    """Give a training call of `module` (training mode, gradients on) that says nothing of a cache (no use_cache,
    by keyword or in its place, and no key/value cache) use_cache=False. A function of this module, not a closure:
    a model with the hook still pickles (torch.save(model))."""
    if ("use_cache" not in kwargs and len(args) <= _use_cache_position(type(module)) and module.training
            and torch.is_grad_enabled() and not carries_kv_cache(args, kwargs)):
        return args, {**kwargs, "use_cache": False}
    return None


def no_cache_when_training(hf: nn.Module) -> bool:
    """Let training calls of `hf` (a transformers model, or the one inside the model the user calls) that pass
    neither use_cache nor a key/value cache run with use_cache=False: a forward pre-hook on `hf`, traced into a
    compiled model's graph, kept by a copy or a pickle of the model. Returns whether it did: False where `hf`'s
    forward takes no use_cache or its config has it off already."""
    if _use_cache_position(type(hf)) is None or not getattr(getattr(hf, "config", None), "use_cache", False):
        return False
    hf.register_forward_pre_hook(_no_cache_pre_hook, with_kwargs=True)
    return True
