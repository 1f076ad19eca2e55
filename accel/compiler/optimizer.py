"""Compiled optimizer steps for the optimizers a user builds over an accelerated model.

accelerate() returns the model and the user builds the optimizer afterwards (TorchAcc's flow), so
accelerate() never sees the optimizer. An eager optimizer step is dozens of kernel launches and, at
small batches on a GPU, costs as much host time as the whole compiled forward and backward; the
strongest plain-PyTorch setup compiles it (`torch.compile(opt.step)`). So accelerate() registers the
model's parameters here, and one global optimizer step pre-hook gives every optimizer whose parameters
all belong to an accelerated model a compiled step from its second call on (the first call runs
eagerly and creates the state the compiled step then updates in place).

Anything else passes through untouched: optimizers over other parameters, and optimizers torch cannot
compile well (sparse gradients, LBFGS-style closures that re-evaluate the model many times).
A learning-rate scheduler that changes a float lr every step makes Dynamo recompile each time (and,
past its cache limit, fall back to eager): pass lr as a tensor, e.g. AdamW(params, lr=torch.tensor(1e-4)),
as torch recommends for compiled optimizers.
"""
from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

# id -> parameter; entries vanish with their tensors (a WeakSet would compare tensors with ==).
_params: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()
_seen: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
_hook = None
# Re-evaluate the model inside step(): nothing to gain from compiling them, and closures break graphs.
_SKIP = ("LBFGS", "SparseAdam")


def compile_optimizer_steps(model: torch.nn.Module) -> None:
    """Give optimizers built over `model`'s parameters a compiled step (see the module docstring)."""
    global _hook
    for p in model.parameters():
        _params[id(p)] = p
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(_maybe_compile)


def has_compiled_step(optimizer: torch.optim.Optimizer) -> bool:
    return isinstance(optimizer.__dict__.get("step"), _CompiledStep)


class _CompiledStep:
    """optimizer.step replaced on the instance; holds the original bound step it compiles."""

    def __init__(self, eager_step):
        self.eager_step = eager_step
        self.compiled = torch.compile(eager_step)

    def __call__(self, *args, **kwargs):
        return self.compiled(*args, **kwargs)


def _maybe_compile(optimizer, args, kwargs):
    if torch.compiler.is_compiling() or optimizer in _seen:
        return None  # also inside the compiled step itself, which runs this hook again while tracing
    _seen.add(optimizer)
    if type(optimizer).__name__ in _SKIP:
        return None
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not params or not all(_params.get(id(p)) is p for p in params):
        return None
    if any(p.grad is not None and p.grad.is_sparse for p in params):
        return None
    optimizer.step = _CompiledStep(optimizer.step)
    return None
