"""A compiled model moved to another kind of device after accelerate() says so when its compiled call fails there.

accelerate() places the model on its backend's device and compiles it for that device (Inductor on 'cpu' and
'cuda'). Code that moves the model afterwards takes the compiled call along: transformers' Trainer, for one,
moves every model to the XLA device when torch_xla is installed. Dynamo then compiles again for the new device,
and where Inductor has no code generator for it (an XLA device) the call fails deep inside Inductor (a KeyError
'xla' or an assertion in a lowering) that names neither the move nor a way out. `explain_failures_after_a_move`
turns such a failure into an error naming both devices and what to do. Calls that work pay nothing (a try block);
a move that still compiles (another CUDA device, back to the CPU) goes on as before.
"""
from __future__ import annotations

import itertools

import torch
from torch import nn

from accel.compiler.compiled_call import wrap_compiled_call


def _device_of(model: nn.Module) -> torch.device | None:
    tensor = next(itertools.chain(model.parameters(), model.buffers()), None)
    return None if tensor is None else tensor.device


def explain_failures_after_a_move(model: nn.Module, device: torch.device) -> None:
    """Make a failing compiled call of `model` raise a RuntimeError naming the move, where its parameters are no
    longer on a device of `device`'s type.

    Args:
        model: a module after `model.compile(...)` (accelerate()'s compiled model).
        device: where accelerate() placed and compiled it.

    Raises:
        ValueError: the model was not compiled with `model.compile()`.
    """
    def wrap(compiled):
        def call(*args, **kwargs):
            try:
                return compiled(*args, **kwargs)
            except Exception as error:
                now = _device_of(model)
                if now is None or now.type == device.type:
                    raise
                raise RuntimeError(_explanation(device, now, error)) from error

        return call

    wrap_compiled_call(model, wrap)


def _explanation(device: torch.device, now: torch.device, error: Exception) -> str:
    first_line = (str(error).strip().splitlines() or [""])[0][:200]  # the whole error stays chained
    backend = f"config.backend='{now.type}'" if now.type in ("cpu", "cuda", "xla") else "its backend"
    return (f"model: accelerate() placed this model on {device} and compiled it for {device.type}, and it was moved "
            f"to {now} afterwards (transformers' Trainer, for one, moves models to the XLA device when torch_xla is "
            f"installed, unless USE_TORCH_XLA=0 is in its environment); its compiled call failed there "
            f"({type(error).__name__}: {first_line}). Either keep the model on {device}, or move it first and then "
            f"call accel.accelerate() with {backend}, which places and prepares it for that device")
