"""The optimizers a user builds over an accelerated model: torch's fused Adam, and compiled steps.

accelerate() returns the model and the user builds the optimizer afterwards (TorchAcc's flow), so
accelerate() never sees the optimizer. It registers the model's parameters here instead, and one global
optimizer step pre-hook acts at the first step of every optimizer whose parameters all belong to an
accelerated model (anything else passes through untouched):

1. torch.optim.Adam / AdamW left at their defaults (fused and foreach not given, not differentiable) switch
   to torch's own fused kernel before their state exists. Measured on BERT-base parameters (109.5M fp32,
   AMD EPYC without AVX-512, torch 2.9): default loop 391 ms a step, foreach 412 ms, fused 75 ms (accel's
   own FusedAdamW: 311 ms). The update is the same algorithm; results differ from the loop only in
   rounding. An explicit fused=False or foreach=... is the user's choice and is kept.
2. The step is compiled (torch.compile(optimizer.step), from the second call on, once the state exists)
   for optimizers that are not one fused kernel, where an eager step's launches (CUDA) or loops cost what a
   generated kernel saves. A fused step (torch's fused Adam/AdamW, CPU or CUDA) is not: Dynamo never traces
   into torch's fused optimizer functions (torch.compiler.disable'd by torch), so a compiled fused step holds
   no graph, only Dynamo's frames around the eager kernel (a 100-tensor fused AdamW on this CPU: 523 us a
   step compiled against 476 us eager), and CUDA graphs cannot replay it. With cuda_graph_steps
   (compute.optimizer_cuda_graphs) the compiled step is replayed with CUDA graphs, as the model's
   forward and backward are (mode="reduce-overhead"): torch.compile captures optimizers over CUDA
   parameters as capturable, so the step counters stay on the device.

3. With graph_steps (compute.step_graph: the whole training step becomes one CUDA graph, accel.graph_step) a
   torch optimizer over CUDA parameters gets, before its state exists, capturable updates (its step counters
   on the device, as a capture needs) and a learning rate that is a device tensor: a float would be baked into
   the captured kernels, so a scheduler's later changes would never reach the replays; torch's schedulers
   fill a tensor lr in place, which they do.

4. On the xla backend with several ranks (accel.distributed), the gradients are averaged over the ranks at
   every step, before the update (one bucketed all-reduce, accel.xla.reduce_gradients): the usual
   loop needs no xm.optimizer_step; accel.xla.optimizer_step (which reduces first) is not reduced twice.

Not compiled: LBFGS-style closures that re-evaluate the model many times, sparse gradients. A scheduler's
float lr reaches a compiled step as a tensor (the groups keep their floats), so a schedule compiles nothing
more; another hyperparameter that changes between steps (OneCycleLR's momentum or betas) makes the step run
uncompiled from then on, with a warning (_CompiledStep).
"""
from __future__ import annotations

import weakref
from typing import NamedTuple

import torch
from torch.optim.adam import Adam as _TorchAdam
from torch.optim.adamw import AdamW as _TorchAdamW
from torch.optim.optimizer import register_optimizer_step_pre_hook


class _Options(NamedTuple):
    compile_steps: bool
    reduce_gradients: bool
    cuda_graph_steps: bool
    graph_steps: bool = False


# id -> parameter; entries vanish with their tensors (a WeakSet would compare tensors with ==).
_params: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()
# id(parameter) -> _Options, what its model asked for; an entry is removed with its parameter
# (weakref.finalize), so a later tensor with the same id starts clean.
_options: dict[int, _Options] = {}
_seen: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
_reducing: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
_hooks: list = []
_SKIP = ("LBFGS", "SparseAdam")
# The defining classes (never the torch.optim attributes, which accel.runtime.hooks may replace).
_TORCH_ADAMS = (_TorchAdam, _TorchAdamW)
_NONE = _Options(compile_steps=False, reduce_gradients=False, cuda_graph_steps=False)
# Optimizers that take a tensor lr: torch's, and accel's sync-free ones
_TENSOR_LR_MODULES = ("torch.optim.", "accel.amp.syncfree.")


def adopt_optimizers(model: torch.nn.Module, compile_steps: bool, reduce_gradients: bool = False,
                     cuda_graph_steps: bool = False, graph_steps: bool = False) -> None:
    """Apply the module docstring's rules to optimizers built over `model`'s parameters."""
    options = _Options(compile_steps, reduce_gradients, cuda_graph_steps and compile_steps, graph_steps)
    for p in model.parameters():
        if _params.get(id(p)) is not p:
            _params[id(p)] = p
            weakref.finalize(p, _options.pop, id(p), None)
        _options[id(p)] = options
    if not _hooks:
        # Global hooks run in registration order: at an optimizer's first step _adopt decides, then
        # _reduce_gradients already acts on that step.
        _hooks.append(register_optimizer_step_pre_hook(_adopt))
        _hooks.append(register_optimizer_step_pre_hook(_reduce_gradients))


def has_compiled_step(optimizer: torch.optim.Optimizer) -> bool:
    return isinstance(optimizer.__dict__.get("step"), _CompiledStep)


def uses_fused_kernel(optimizer: torch.optim.Optimizer) -> bool:
    return all(group.get("fused") for group in optimizer.param_groups)


def has_cuda_graph_step(optimizer: torch.optim.Optimizer) -> bool:
    step = optimizer.__dict__.get("step")
    return isinstance(step, _CompiledStep) and step.mode == "reduce-overhead"


class _CompiledStep:
    """optimizer.step replaced on the instance; holds the original bound step it compiles.

    A scheduler writes a new float lr into each param group every step, and a float in the groups is a constant
    of the compiled graph: each new value compiled the step again (a linear warm-up: every step, until Dynamo's
    recompile limit, after which the step ran uncompiled without a word). Around each compiled call a group's
    float lr is handed over as a 0-dim tensor on its parameters' device, filled with the value (torch's advice
    for compiled optimizers, done for the user: the groups keep their floats, which schedulers and logs read).
    Another hyperparameter that changes between steps (OneCycleLR cycles Adam's betas and SGD's momentum), or an
    lr that cannot be a tensor here, would compile anew each time as well: the step then runs uncompiled from
    there on, and says so once.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, eager_step, mode: str | None = None):
        # weak: the optimizer holds this step (a bound eager_step still holds the optimizer: a cycle the collector
        # frees, as before; a scheduler's wrapper holds it weakly too)
        self.optimizer = weakref.ref(optimizer)
        self.eager_step = eager_step
        self.mode = mode
        self.compiled = torch.compile(eager_step, mode=mode)
        self._lrs: list[torch.Tensor | None] = []  # per group: the lr's tensor, None where the float stays
        self._settings: list[dict] = []  # per group: the values a change of which would compile anew, by name
        self.uncompiled_since_change = False

    # A scheduler counts optimizer steps through a wrapper of its own around `step`, and warns when `step` was
    # replaced after it was built (accel replaces it at the first step) or is not wrapped: this step counts them
    # itself, and a scheduler built later sees it wrapped.
    _wrapped_by_lr_sched = True

    def __call__(self, *args, **kwargs):
        optimizer = self.optimizer()
        optimizer._opt_called = True  # what a scheduler's wrapper records
        if self.uncompiled_since_change:
            return self.eager_step(*args, **kwargs)
        groups = optimizer.param_groups
        if len(groups) != len(self._lrs):  # the first call, or a group added (a graph of its own, once)
            self._lrs = [_lr_tensor(optimizer, group) for group in groups]
            self._settings = [_settings(group, tensor is None) for group, tensor in zip(groups, self._lrs)]
        # on the hot path: the recorded names' values compared, no more (a dict of a few numbers a group)
        if any(group.get(key) != value for group, settings in zip(groups, self._settings)
               for key, value in settings.items()):
            import warnings

            changed = sorted({key for group, settings in zip(groups, self._settings)
                              for key, value in settings.items() if group.get(key) != value})
            self.uncompiled_since_change = True
            warnings.warn(f"{type(optimizer).__name__}'s {', '.join(changed)} changed between "
                          f"steps: each value would compile the optimizer step anew, so it runs uncompiled from "
                          f"now on (accel.compiler.optimizer; a schedule of the learning rate alone keeps it "
                          f"compiled)", stacklevel=2)
            return self.eager_step(*args, **kwargs)
        floats = []
        for group, tensor in zip(groups, self._lrs):
            if tensor is not None and not isinstance(group["lr"], torch.Tensor):
                floats.append((group, group["lr"]))
                tensor.fill_(group["lr"])
                group["lr"] = tensor
        try:
            return self.compiled(*args, **kwargs)
        finally:
            for group, lr in floats:
                group["lr"] = lr


def _lr_tensor(optimizer: torch.optim.Optimizer, group: dict) -> torch.Tensor | None:
    """A tensor for a group's float lr on its parameters' one device, or None: an lr that is a tensor already,
    parameters on several devices, an optimizer of another library (its lr may have to be a number), torch's
    Adam/AdamW with foreach=True and capturable=False (they refuse a tensor lr there)."""
    lr, params = group.get("lr"), group.get("params", [])
    devices = {p.device for p in params}
    if (isinstance(lr, torch.Tensor) or not isinstance(lr, (int, float)) or isinstance(lr, bool)
            or len(devices) != 1 or not type(optimizer).__module__.startswith(_TENSOR_LR_MODULES)
            or (isinstance(optimizer, _TORCH_ADAMS) and group.get("foreach") and not group.get("capturable"))):
        return None
    dtype = torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32
    return torch.tensor(float(lr), dtype=dtype, device=next(iter(devices)))


def _settings(group: dict, with_lr: bool) -> dict:
    """A group's numeric hyperparameters (lr only where it stays a float): a compiled step is specialised on each."""
    def numeric(value) -> bool:
        if isinstance(value, tuple):
            return all(numeric(v) for v in value)
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    return {key: value for key, value in group.items()
            if key not in ("params", "initial_lr") and (with_lr or key != "lr") and numeric(value)}


def _switch_to_fused(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    if type(optimizer) not in _TORCH_ADAMS or optimizer.state:
        return  # another optimizer, or state already built by the unfused code
    groups = optimizer.param_groups
    if any(g.get("fused") is not None or g.get("foreach") is not None or g.get("differentiable") for g in groups):
        return
    if not all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params):
        return
    for group in groups:
        group["fused"] = True
    optimizer.defaults["fused"] = True
    optimizer._step_supports_amp_scaling = True  # what torch's constructor sets for fused=True


def _make_capturable(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    devices = {p.device for p in params}
    if optimizer.state or len(devices) != 1 or next(iter(devices)).type != "cuda":
        return  # state built already (its step counters may be on the host), or not one CUDA device
    (device,) = devices
    for group in optimizer.param_groups:
        if "capturable" in group:
            group["capturable"] = True
        if "lr" in group and not isinstance(group["lr"], torch.Tensor):
            group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)


def _adopt(optimizer, args, kwargs):
    if torch.compiler.is_compiling() or optimizer in _seen:
        return None  # also inside the compiled step itself, which runs this hook again while tracing
    _seen.add(optimizer)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not params or not all(_params.get(id(p)) is p for p in params):
        return None
    if any(p.grad is not None and p.grad.is_sparse for p in params):
        return None
    options = [_options.get(id(p), _NONE) for p in params]
    if all(o.reduce_gradients for o in options):
        _reducing.add(optimizer)
    _switch_to_fused(optimizer, params)
    if all(o.graph_steps for o in options):
        _make_capturable(optimizer, params)
    wants_compile = all(o.compile_steps for o in options)
    if wants_compile and not uses_fused_kernel(optimizer) and type(optimizer).__name__ not in _SKIP:
        graphs = all(o.cuda_graph_steps for o in options) and all(p.device.type == "cuda" for p in params)
        optimizer.step = _CompiledStep(optimizer, optimizer.step, mode="reduce-overhead" if graphs else None)
    return None


def _reduce_gradients(optimizer, args, kwargs):
    if optimizer in _reducing and not torch.compiler.is_compiling():
        from accel.xla.collectives import reduce_gradients_once

        reduce_gradients_once(optimizer)
    return None
