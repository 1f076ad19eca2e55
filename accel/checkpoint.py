"""auto_checkpoint: activation checkpointing of a model's repeated blocks, found without class names.

    model = accel.auto_checkpoint(model)                            # checkpoint every repeated block
    model = accel.auto_checkpoint(model, memory_budget=2 << 30)     # only as many as needed to fit
    model = accel.auto_checkpoint(model, block_classes={"BertLayer"}, count=6)  # TorchAcc's gc_cls / gc_cnt
    accel.remove_checkpoint(model)                                  # undo

Finding the blocks. Every nn.ModuleList / nn.Sequential in the model is split into groups of children
with the same structure (the same types of the modules holding parameters, all the way down, and the same
parameter names and shapes), joined by lone children of the same class (T5's first layer, a ResNet stage's
downsampling block). The
group holding the most parameters comes first (ties: more members, then the outermost): the layers of a
transformer encoder, the blocks of a ResNet stage or of an MLP stack. Every other such group of blocks
that lies outside it is taken too (find_block_stacks): an encoder-decoder's encoder and decoder layers,
the blocks of every ResNet or Swin stage.

Or by class name. block_classes={"BertLayer"} takes every module of those classes instead (outermost
matches only: a match nested inside another match is not wrapped twice), in model order.
count=N checkpoints only the first N blocks (TorchAcc's gc_cnt), with or without class names.

Wrapping. Each block's class is swapped for a subclass of it, made once per class, with the same
name, qualified name and module and a `forward` that checkpoints. The module tree is untouched:
module names, hooks and state_dict keys stay exactly as they were, so state_dicts load between wrapped
and unwrapped models either way. As the checkpointing lives in the class, not in a method bound to the
instance, the whole model pickles (torch.save(model) too: a block is stored as its own class and
rebuilt with the subclass on load), deep-copies, and nn.DataParallel's replicas checkpoint and run on
themselves. isinstance(block, ItsClass) still holds; `type(block) is ItsClass` does not. A `forward`
set on the instance before is kept and run inside the checkpoint.
The forward runs the block under activation checkpointing when the block is training and grad is
enabled -- torch.utils.checkpoint (use_reentrant=False, RNG state preserved, so dropout masks are
replayed exactly) for CPU/CUDA inputs, torch_xla.utils.checkpoint for XLA inputs, decided per call
from the inputs' device -- and runs it plainly under eval() or torch.no_grad().
Calling auto_checkpoint again re-plans without wrapping twice.

Side effects happen once. The recomputation in backward runs the block's forward again, which would
update BatchNorm's running statistics (any buffer its forward updates) a second time. So every buffer
of a checkpointed block is copied before its forward (the copies live until its backward, and count
in the budget's bytes); the recomputation runs on fresh copies of those values -- it sees what the
forward saw, so it computes the same outputs, and it updates only the copies -- and afterwards the
block's buffers are the very tensors they were, whether the forward updated them in place or rebound
them. Plain attributes the recomputation rebinds (a call counter, a cached tensor) are put back after
it too, but it reads them as they are at backward time. Not covered: in-place changes to parameters,
to objects held in attributes (lists, dicts) or to global state.
Under torch.compile, when dynamo traces a block whole, the recomputation is part of the compiled
backward and AOTAutograd applies the buffer updates once, after the forward graph. A block whose
forward graph-breaks falls back to eager checkpointing around compiled pieces, chosen while tracing,
without the copies: its buffers are updated again by the recomputation.

Memory budget (bytes of saved activations of one training forward). Which blocks to checkpoint is
decided by dry runs of the forward (forwards only: no backward, no optimizer): a discarded warm-up,
one with every block checkpointed (the least memory), one with all but one (the cost of one plain
block), then the plan -- the first blocks checkpointed, the rest plain -- is checked by a further run
and tightened if it does not fit. Bytes are counted with torch.autograd.graph.saved_tensors_hooks
(distinct storages saved for backward, parameters and buffers excluded, plus the inputs and buffer
copies a checkpointed block keeps for its recomputation); on CUDA they are the peak of
torch.cuda.max_memory_allocated over the forward, above what was allocated before (this resets the
device's peak-memory statistic).
The dry runs need inputs:
  * pass `example_inputs` (a tuple of positional arguments or a dict of keyword arguments, shaped
    like a real batch) and the plan is made inside auto_checkpoint, or
  * pass none, and the plan is made at the first training forward, on that batch, just before it
    runs.
Dry runs leave parameters and their .grad alone and restore the modules' modes, the RNG state (CPU,
and every CUDA device of the model and inputs) and every buffer (e.g. BatchNorm running statistics),
so the real step sees exactly what it would have seen without them. Other state a forward changes
(Python attributes, forward hooks' side effects, user-held torch.Generator objects) is not restored.
Until a budget plan is made no block is checkpointed. `checkpoint_plan(model)` reports the plan.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import types
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from accel.utils.batch import iter_tensors
from accel.utils.transformers_models import kv_cache_types

__all__ = ["auto_checkpoint", "remove_checkpoint", "checkpoint_plan", "find_repeated_blocks", "find_block_stacks",
           "find_blocks_by_class", "activation_bytes", "CheckpointPlan"]

_PLAN_ATTR = "_accel_checkpoint_plan"


@dataclass
class CheckpointPlan:
    containers: list[str]                  # qualified names of the ModuleLists/Sequentials ("" = model)
    blocks: list[str]                      # qualified names of the repeated blocks, in model order
    checkpointed: list[str]                # the blocks that run under checkpointing
    memory_budget: int | None = None
    pending: bool = False                  # budget given, waiting for the first training forward
    measured: dict[str, int] = field(default_factory=dict)  # dry-run bytes: all, one_plain, per_block, chosen
    _hook: Any = field(default=None, repr=False, compare=False)
    _planning: bool = field(default=False, repr=False, compare=False)


def checkpoint_plan(model: nn.Module) -> CheckpointPlan | None:
    """The plan auto_checkpoint made for `model`, or None if it was never applied."""
    return model.__dict__.get(_PLAN_ATTR)


# ---------------------------------------------------------------------------------------------
# finding the repeated blocks

def _signature(module: nn.Module) -> tuple:
    """Same signature <=> same types of the modules holding parameters, in the same tree, and same parameter
    names/shapes/dtypes. Modules without parameters do not count: stochastic depth makes Swin's first block an
    nn.Identity where the next one has a DropPath (rates rise with depth), and the blocks are still alike."""
    types_ = tuple((name, type(m)) for name, m in module.named_modules() if any(True for _ in m.parameters()))
    params = tuple((name, tuple(p.shape), p.dtype) for name, p in module.named_parameters())
    return types_, params


def _depth(name: str) -> int:
    return 0 if name == "" else name.count(".") + 1


def _ranked_groups(model: nn.Module) -> list[tuple[str, list[tuple[str, nn.Module]]]]:
    """Every group of >= 2 structurally identical children (with parameters) of an nn.ModuleList /
    nn.Sequential, joined by the container's lone children of the same class (T5's first layer, the only one
    holding the relative attention bias; a ResNet stage's first block, the one that downsamples), as
    (container name, [(qualified block name, block), ...]) in container order; the largest group first: most
    parameters, then most members, then the outermost container."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    ranked = []
    for cname, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        groups: dict[tuple, list[tuple[str, nn.Module]]] = defaultdict(list)
        for child_name, child in container.named_children():
            groups[_signature(child)].append((f"{cname}.{child_name}" if cname else child_name, child))
        lone = [members[0] for members in groups.values() if len(members) == 1]
        position = {id(child): i for i, child in enumerate(container.children())}
        for members in groups.values():
            if len(members) >= 2:
                joining = [m for m in lone if type(m[1]) is type(members[0][1])]
                lone = [m for m in lone if m not in joining]
                members[:] = sorted(members + joining, key=lambda m: position[id(m[1])])
            n_params = sum(p.numel() for _, m in members for p in m.parameters())
            if len(members) >= 2 and n_params > 0:
                ranked.append(((n_params, len(members), -_depth(cname)), cname, members))
    ranked.sort(key=lambda item: item[0], reverse=True)  # stable: equal keys stay in model order
    return [(cname, members) for _, cname, members in ranked]


def find_repeated_blocks(model: nn.Module) -> tuple[str, list[tuple[str, nn.Module]]]:
    """(container name, [(qualified block name, block), ...]) of the largest group of structurally
    identical children of an nn.ModuleList / nn.Sequential; ("", []) when the model has none."""
    ranked = _ranked_groups(model)
    return ranked[0] if ranked else ("", [])


def _inside(name: str, outer: str) -> bool:
    return outer == "" or name == outer or name.startswith(outer + ".")


def find_block_stacks(model: nn.Module) -> list[tuple[str, list[tuple[str, nn.Module]]]]:
    """Every stack of repeated blocks, in model order: the largest group (find_repeated_blocks), then each
    other group whose blocks neither lie inside nor contain a block already taken, and are blocks (modules
    with submodules) rather than single layers. An encoder-decoder's encoder and decoder layers, both towers of
    a two-tower model, each stage's blocks of a ResNet or Swin (whose stages differ in width); not the experts
    inside an MoE layer (inside a taken block), nor a list of identical Linear heads (single layers, nothing
    worth recomputing)."""
    taken: list[tuple[str, list[tuple[str, nn.Module]]]] = []
    names: list[str] = []
    for cname, members in _ranked_groups(model):
        if taken and not all(any(True for _ in block.children()) for _, block in members):
            continue
        if any(_inside(n, t) or _inside(t, n) for n, _ in members for t in names):
            continue
        taken.append((cname, members))
        names.extend(n for n, _ in members)
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return sorted(taken, key=lambda stack: order[stack[1][0][0]])


def find_blocks_by_class(model: nn.Module, class_names) -> list[tuple[str, nn.Module]]:
    """[(qualified name, module), ...] of the outermost modules whose class name is in class_names."""
    names = set(class_names)
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if type(module).__name__ not in names:
            continue
        if any(name.startswith(outer + ".") for outer, _ in found):
            continue  # inside a block already taken
        found.append((name, module))
    return found


# ---------------------------------------------------------------------------------------------
# the checkpointing class of a block

_ORIG_ATTR = "_accel_ckpt_forward"   # an instance forward the block had before: None means the class's own
_ON_ATTR = "_accel_ckpt_on"          # whether this block checkpoints now
_CLASSES: dict[type, type] = {}      # a block's own class -> its checkpointing subclass (one per class)


class _Checkpointed:
    """Put in front of a block's class by _checkpointing_class. The checkpointing lives in the class,
    not in a bound method on the instance, so pickling, deepcopy and nn.DataParallel's replicas (new
    instances sharing the class) keep it and run it on themselves. No __slots__ here, not even empty
    ones: they would make the subclass's layout differ from the block's, and __class__ assignment fail."""

    def __reduce_ex__(self, protocol):
        # Pickle by the block's own class (importable by name) and rebuild the subclass on load.
        rv = super().__reduce_ex__(protocol)
        cls = type(self)
        if isinstance(rv, str) or "_accel_ckpt_base" not in cls.__dict__:
            return rv  # a class made on top of ours (e.g. FSDP2's) is pickled, or not, its own way
        base = cls._accel_ckpt_base
        fn, args, *rest = rv
        return (_rebuild_checkpointed, (fn, tuple(base if a is cls else a for a in args)), *rest)


def _rebuild_checkpointed(fn, args):
    obj = fn(*args)
    obj.__class__ = _checkpointing_class(type(obj))
    return obj


def _checkpointing_class(base: type) -> type:
    """The subclass of `base` whose forward checkpoints. Same name, qualname and module as `base`, so
    class-name lookups (block_classes, repr, transformers' no-split lists) see no difference."""
    if issubclass(base, _Checkpointed):
        return base
    cls = _CLASSES.get(base)
    if cls is not None:
        return cls

    def forward(self, *args, **kwargs):
        return _checkpointed_forward(self, args, kwargs)

    functools.update_wrapper(forward, base.forward)  # inspect.signature(block.forward) stays the block's
    namespace = {"__slots__": (), "__module__": base.__module__, "__qualname__": base.__qualname__,
                 "__doc__": base.__doc__, "_accel_ckpt_base": base, "forward": forward}
    return _CLASSES.setdefault(base, type(base)(base.__name__, (_Checkpointed, base), namespace))


class _OwnMethod:
    """An instance forward that was a method bound to the block itself, kept unbound so that a
    replica or a copy calls it on itself rather than on the block it came from."""

    __slots__ = ("func",)

    def __init__(self, func):
        self.func = func

    def __getstate__(self):
        return self.func

    def __setstate__(self, func):
        self.func = func


def _install(block: nn.Module) -> None:
    if isinstance(block, _Checkpointed):
        return  # already wrapped: never wrap twice
    # An instance forward would shadow the class's: keep it aside and call it from there.
    own = block.__dict__.pop("forward", None)
    if isinstance(own, types.MethodType) and own.__self__ is block:
        own = _OwnMethod(own.__func__)
    object.__setattr__(block, _ORIG_ATTR, own)
    object.__setattr__(block, _ON_ATTR, False)
    block.__class__ = _checkpointing_class(type(block))


def _uninstall(block: nn.Module) -> None:
    if not isinstance(block, _Checkpointed):
        return
    if "_accel_ckpt_base" not in type(block).__dict__:
        # Another library put its own subclass on top of ours (FSDP2 does): keep that class, and only
        # turn checkpointing off.
        object.__setattr__(block, _ON_ATTR, False)
        return
    block.__class__ = type(block)._accel_ckpt_base
    own = block.__dict__.pop(_ORIG_ATTR, None)
    block.__dict__.pop(_ON_ATTR, None)
    if isinstance(own, _OwnMethod):
        own = types.MethodType(own.func, block)
    if own is not None:
        object.__setattr__(block, "forward", own)


# ---------------------------------------------------------------------------------------------
# the checkpointed forward

def _tensors(args, kwargs):
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, torch.Tensor):
            yield v


def _run_original(block: nn.Module, *args, **kwargs):
    own = block.__dict__.get(_ORIG_ATTR)
    if own is None:
        return super(_Checkpointed, block).forward(*args, **kwargs)
    if isinstance(own, _OwnMethod):
        return own.func(block, *args, **kwargs)
    return own(*args, **kwargs)


_cache_warned = False


def _without_caches(block: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The block's arguments without transformers' key/value caches. A layer appends its keys and values to the
    cache it is given, so the recomputation in backward would append them a second time: a GPT-2 or Llama layer
    then attends over twice its keys (a shape error under torch.compile, a corrupted cache eagerly).
    transformers' own checkpointing gives a checkpointed layer no cache either (GradientCheckpointingLayer);
    layers that only read one say so with `_can_checkpoint_with_cache`."""
    global _cache_warned
    cache_types = kv_cache_types()
    if not cache_types or getattr(block, "_can_checkpoint_with_cache", False):
        return args, kwargs
    if not any(isinstance(v, cache_types) for v in itertools.chain(args, kwargs.values())):
        return args, kwargs
    if not _cache_warned and not torch.compiler.is_compiling():
        _cache_warned = True
        warnings.warn(f"auto_checkpoint: checkpointed {type(block).__name__} layers get no key/value cache (the "
                      "recomputation in backward would append to it again), as with transformers' own gradient "
                      "checkpointing; pass use_cache=False to the model to build none", stacklevel=3)
    args = tuple(None if isinstance(v, cache_types) else v for v in args)
    kwargs = {k: None if isinstance(v, cache_types) else v for k, v in kwargs.items()}
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    return args, kwargs


def _checkpointed_forward(block: nn.Module, args: tuple, kwargs: dict):
    if not (block.__dict__.get(_ON_ATTR) and block.training and torch.is_grad_enabled()):
        return _run_original(block, *args, **kwargs)
    args, kwargs = _without_caches(block, args, kwargs)
    meter = _Meter.active
    if meter is not None:  # a dry run: the inputs stay alive for the recomputation
        for t in _tensors(args, kwargs):
            meter.add(t)
    run = functools.partial(_run_original, block)
    if not torch.compiler.is_compiling():
        # Compiled, the recomputation is part of the backward graph and AOTAutograd applies the
        # forward's buffer updates once, after the forward graph: nothing to replay, and Python state
        # changed inside the checkpointed region would break dynamo's tracing of it.
        run = _SideEffectsOnce(block, run)
    device = next((t.device for t in _tensors(args, kwargs)), None)
    if device is not None and device.type == "xla":
        return _xla_checkpoint(run, args, kwargs, device)
    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, **kwargs)


class _SideEffectsOnce:
    """The block's forward as handed to a checkpoint function, which calls it once for the forward and
    again for each recomputation in backward. The recomputations must leave no trace: before the first
    call it copies every buffer of the block (BatchNorm's running statistics, counters, whatever the
    forward updates, in place or by rebinding); a recomputation runs on fresh copies of those values,
    so it computes exactly what the forward computed and updates only the copies, and afterwards the
    buffers are the tensors they were, and plain attributes the recomputation rebound are put back.
    Dropout is replayed by the checkpoint's own RNG preservation."""

    __slots__ = ("block", "fn", "saved")

    def __init__(self, block: nn.Module, fn):
        self.block, self.fn = block, fn
        self.saved: list | None = None  # [(module, buffer name, its value before the forward)]

    def __call__(self, *args, **kwargs):
        if self.saved is None:
            self.saved = _copy_buffers(self.block)
            return self.fn(*args, **kwargs)
        with _recomputing(self.block, self.saved):
            return self.fn(*args, **kwargs)


def _copy_buffers(block: nn.Module) -> list:
    copies: dict[int, torch.Tensor] = {}  # a tensor held under several names is copied once
    saved = []
    meter = _Meter.active
    with torch.no_grad():
        for module in block.modules():
            for name, b in module.named_buffers(recurse=False):
                c = copies.get(id(b))
                if c is None:
                    c = copies[id(b)] = b.detach().clone()
                    if meter is not None:  # kept until backward, like the inputs
                        meter.add(c)
                saved.append((module, name, c))
    return saved


_MISSING = object()


@contextlib.contextmanager
def _recomputing(block: nn.Module, saved: list):
    # Attributes are not swapped back to their forward-time values for the recomputation: hooks of
    # other libraries keep their own bookkeeping there and expect to see it as it is now.
    attrs = [(m, dict(m.__dict__)) for m in block.modules()]
    now = [(m, name, getattr(m, name)) for m, name, _ in saved]
    fresh: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for m, name, c in saved:
            t = fresh.get(id(c))
            if t is None:  # a fresh copy each time: a second backward recomputes from the same values
                t = fresh[id(c)] = c.clone()
            setattr(m, name, t)
    try:
        yield
    finally:
        for m, name, b in now:
            setattr(m, name, b)
        for m, before in attrs:
            d = m.__dict__
            for k in [k for k in d if k not in before]:
                del d[k]
            for k, v in before.items():
                if d.get(k, _MISSING) is not v:
                    d[k] = v


def _xla_checkpoint(run, args, kwargs, device):
    """torch_xla's checkpoint is reentrant and positional only: flatten kwargs into the positional
    inputs, and add a grad-requiring dummy when no input requires grad (a reentrant checkpoint
    would otherwise return an output detached from the block's parameters)."""
    from accel.utils.xla import require_xla

    require_xla("auto_checkpoint on XLA tensors")
    from torch_xla.utils.checkpoint import checkpoint as xla_checkpoint

    names = list(kwargs)
    n_args = len(args)

    def flat_run(*flat):
        return run(*flat[:n_args], **dict(zip(names, flat[n_args:n_args + len(names)])))

    flat = list(args) + [kwargs[k] for k in names]
    if not any(t.requires_grad for t in _tensors(flat, {})):
        flat.append(torch.zeros((), device=device, requires_grad=True))
    return xla_checkpoint(flat_run, *flat)


def _set_checkpointed(model: nn.Module, plan: CheckpointPlan, names) -> None:
    names = set(names)
    for name in plan.blocks:
        object.__setattr__(model.get_submodule(name), _ON_ATTR, name in names)


# ---------------------------------------------------------------------------------------------
# measuring saved activations

class _Meter:
    """Bytes of distinct storages saved for backward during one forward (parameters and buffers
    excluded), via saved_tensors_hooks; checkpointed blocks add their kept inputs through `add`."""

    active: "_Meter | None" = None

    def __init__(self, model: nn.Module):
        self.exclude = {self._key(t) for t in list(model.parameters()) + list(model.buffers())}
        self.seen: set = set()
        self.total = 0

    @staticmethod
    def _key(t: torch.Tensor):
        try:
            return ("storage", t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # tensors without storage (XLA, functional)
            return ("id", id(t))

    @staticmethod
    def _nbytes(t: torch.Tensor) -> int:
        try:
            return t.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):
            return t.numel() * t.element_size()

    def add(self, t: torch.Tensor) -> torch.Tensor:
        key = self._key(t)
        if key not in self.exclude and key not in self.seen:
            self.seen.add(key)
            self.total += self._nbytes(t)
        return t


def _call(model, inputs):
    args, kwargs = inputs
    return model(*args, **kwargs)


def activation_bytes(model: nn.Module, example_inputs) -> int:
    """Saved-activation bytes of one training forward of `model` on `example_inputs`, as it is now
    configured (checkpointed or not). CUDA: peak allocated bytes over the forward above the
    starting point; elsewhere: saved-tensor hooks. The model's modes, buffers and RNG are restored."""
    inputs = _normalize_inputs(example_inputs)
    with _preserved_state(model, inputs):
        _measure(model, inputs)  # warm-up, see _search
        return _measure(model, inputs)


def _dry_run_device(model: nn.Module, inputs) -> torch.device | None:
    """Where the forward runs: the device of the first input tensor (nested ones included), else of
    the model's first parameter or buffer."""
    for t in iter_tensors(inputs):
        return t.device
    for t in itertools.chain(model.parameters(), model.buffers()):
        return t.device
    return None


def _measure(model: nn.Module, inputs) -> int:
    device = _dry_run_device(model, inputs)
    if device is not None and device.type == "cuda":
        return _cuda_peak_bytes(model, inputs, device)
    return _saved_tensor_bytes(model, inputs)


def _cuda_peak_bytes(model: nn.Module, inputs, device: torch.device) -> int:
    """Peak bytes allocated on `device` during one forward, above what was allocated before it.

    The caching allocator counts allocations on the host as they are made, so the numbers do not wait
    for the kernels; the synchronisations only make a failing kernel fail here rather than later. The
    peak statistic is device-wide: this resets it, and the caller's own peak reading is lost.
    """
    torch.cuda.synchronize(device)
    start = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)  # the peak is now `start`, so the difference is >= 0
    out = _call(model, inputs)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del out  # the output and everything saved for backward are freed with it
    return int(peak - start)


def _saved_tensor_bytes(model: nn.Module, inputs) -> int:
    meter = _Meter(model)
    _Meter.active = meter
    try:
        with torch.autograd.graph.saved_tensors_hooks(meter.add, lambda t: t):
            out = _call(model, inputs)
        del out
    finally:
        _Meter.active = None
    return meter.total


def _normalize_inputs(example_inputs) -> tuple[tuple, dict]:
    """(positional args, keyword args) from a tensor, a tuple/list or a dict."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    raise ValueError("example_inputs: expected a tuple of positional arguments, a dict of keyword "
                     f"arguments or a tensor, got {type(example_inputs).__name__}")


def _cuda_devices(model: nn.Module, inputs) -> list[int]:
    tensors = itertools.chain(iter_tensors(inputs), model.parameters(), model.buffers())
    return sorted({t.device.index for t in tensors if t.device.type == "cuda"})


@contextlib.contextmanager
def _preserved_state(model: nn.Module, inputs):
    """Grad on for the dry runs, and training mode unless the model is already training (then each
    submodule keeps its own mode, e.g. a frozen BatchNorm in eval). Afterwards the modes, every buffer
    (value and object: BatchNorm running statistics, num_batches_tracked) and the RNG (CPU, and every
    CUDA device the model or the inputs live on) are as they were. Parameters, their .grad and any
    optimizer are not touched at all: the dry runs are forwards only, and no backward is run."""
    modes = {m: m.training for m in model.modules()}
    buffers = [(module, name, b, b.detach().clone())
               for module in model.modules() for name, b in module.named_buffers(recurse=False)]
    try:
        with torch.random.fork_rng(devices=_cuda_devices(model, inputs)), torch.enable_grad():
            if not model.training:
                model.train()
            yield
    finally:
        for m, mode in modes.items():
            m.training = mode
        with torch.no_grad():
            for module, name, b, saved in buffers:
                if getattr(module, name) is not b:  # a forward replaced the buffer instead of updating it
                    setattr(module, name, b)
                b.copy_(saved)


# ---------------------------------------------------------------------------------------------
# planning under a budget

def _plan_budget(model: nn.Module, plan: CheckpointPlan, inputs) -> None:
    """Choose plan.checkpointed by dry runs. If a dry run fails (e.g. out of memory), the blocks are
    left as the plan was before and the error is raised."""
    try:
        with _preserved_state(model, inputs):
            chosen, measured = _search(model, plan, inputs)
    except BaseException:
        _set_checkpointed(model, plan, plan.checkpointed)
        raise
    plan.checkpointed = list(chosen)
    plan.measured = measured
    plan.pending = False
    if measured["chosen"] > plan.memory_budget:
        warnings.warn(f"auto_checkpoint: memory_budget={plan.memory_budget} bytes cannot be met; with every "
                      f"block checkpointed one forward still saves {measured['chosen']} bytes", stacklevel=3)


def _search(model: nn.Module, plan: CheckpointPlan, inputs) -> tuple[list[str], dict[str, int]]:
    n = len(plan.blocks)
    budget = plan.memory_budget
    _set_checkpointed(model, plan, plan.blocks)
    # A discarded first run: one-time allocations (the cuBLAS workspace, lazily built caches) would
    # otherwise be charged to the all-checkpointed run only, and shrink the per-block estimate.
    _measure(model, inputs)
    all_ckpt = _measure(model, inputs)
    _set_checkpointed(model, plan, plan.blocks[1:])
    one_plain = _measure(model, inputs)
    per_block = max(one_plain - all_ckpt, 0)
    # keep the last `plain` blocks uncheckpointed: bytes ~ all_ckpt + plain * per_block
    if budget < all_ckpt:
        plain = 0
    elif per_block == 0:
        plain = n
    else:
        plain = min(n, (budget - all_ckpt) // per_block)
    while True:
        chosen = plan.blocks[:n - plain]
        _set_checkpointed(model, plan, chosen)
        measured = all_ckpt if plain == 0 else _measure(model, inputs)
        if measured <= budget or plain == 0:
            break
        plain -= 1  # blocks differ a little (first/last): tighten until it fits
    return chosen, {"all": all_ckpt, "one_plain": one_plain, "per_block": per_block, "chosen": measured}


def _lazy_plan_hook(model: nn.Module, args, kwargs):
    plan = checkpoint_plan(model)
    if (plan is None or not plan.pending or plan._planning
            or not (model.training and torch.is_grad_enabled())):
        return None  # also while planning: the dry runs call the model, and with it this hook
    plan._planning = True
    try:
        _plan_budget(model, plan, (tuple(args), dict(kwargs)))
    finally:
        plan._planning = False
    if plan._hook is not None:
        plan._hook.remove()
        plan._hook = None
    return None


# ---------------------------------------------------------------------------------------------
# public entry points

def _check_block_classes(block_classes):
    if block_classes is None:
        return None
    if isinstance(block_classes, str):
        block_classes = {block_classes}
    try:
        names = set(block_classes)
    except TypeError:
        names = set()
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"block_classes: expected None or a non-empty set of class names, got {block_classes!r}")
    return names


def auto_checkpoint(model: nn.Module, memory_budget: int | None = None, example_inputs=None, *,
                    block_classes=None, count: int | None = None) -> nn.Module:
    """Wrap `model`'s repeated blocks with activation checkpointing and return `model` (modified in
    place; same state_dict keys). memory_budget: bytes of saved activations per training forward
    to fit in (None: checkpoint every block). example_inputs: a batch for the budget's dry runs
    (tuple of positional or dict of keyword arguments); without it the first training forward is used.
    block_classes: class names of the blocks (None: every stack of repeated blocks, find_block_stacks).
    count: checkpoint only the first `count` blocks (None: all, or as the budget decides).
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if memory_budget is not None and (isinstance(memory_budget, bool) or not isinstance(memory_budget, int)
                                      or memory_budget <= 0):
        raise ValueError(f"memory_budget: expected a positive int number of bytes or None, got {memory_budget!r}")
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        raise ValueError(f"count: expected None or an int >= 1, got {count!r}")
    if count is not None and memory_budget is not None:
        raise ValueError("count and memory_budget are exclusive: the budget decides how many blocks to checkpoint")
    class_names = _check_block_classes(block_classes)
    inputs = None if example_inputs is None else _normalize_inputs(example_inputs)

    old = checkpoint_plan(model)
    if old is not None and old._hook is not None:
        old._hook.remove()
    if class_names is None:
        stacks = find_block_stacks(model)
        containers = [cname for cname, _ in stacks]
        members = [member for _, stack in stacks for member in stack]
        missing = "repeated blocks (structurally identical children of an nn.ModuleList or nn.Sequential)"
    else:
        containers, members = [], find_blocks_by_class(model, class_names)
        missing = f"modules of the classes {sorted(class_names)}"
    if not members:
        warnings.warn(f"auto_checkpoint: found no {missing}; the model is returned unchanged", stacklevel=2)
        return model
    if old is not None:  # re-planning with other blocks: the old ones get their own forward back
        for name in set(old.blocks) - {n for n, _ in members}:
            _uninstall(model.get_submodule(name))
    names = [name for name, _ in members]
    for _, block in members:
        _install(block)
    plan = CheckpointPlan(containers=containers, blocks=names, checkpointed=list(names), memory_budget=memory_budget)
    object.__setattr__(model, _PLAN_ATTR, plan)
    if memory_budget is None:
        plan.checkpointed = names[:count]
        _set_checkpointed(model, plan, plan.checkpointed)
    elif inputs is not None:
        _plan_budget(model, plan, inputs)
    else:
        plan.pending, plan.checkpointed = True, []
        _set_checkpointed(model, plan, [])
        plan._hook = model.register_forward_pre_hook(_lazy_plan_hook, with_kwargs=True)
    return model


def remove_checkpoint(model: nn.Module) -> nn.Module:
    """Undo auto_checkpoint: every block gets its own forward back. A no-op on an unwrapped model."""
    plan = checkpoint_plan(model)
    if plan is None:
        return model
    if plan._hook is not None:
        plan._hook.remove()
    for name in plan.blocks:
        _uninstall(model.get_submodule(name))
    del model.__dict__[_PLAN_ATTR]
    return model
