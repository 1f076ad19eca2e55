"""all_reduce and the gradient helpers built on it (xm.all_reduce semantics).

Where a collective runs:
- XLA tensors on TPU and other PJRT devices with real collectives: torch_xla (in the graph);
- otherwise, with a torch.distributed group of more than one process: that group (accel's
  "xla" group stages XLA tensors through host memory over gloo; gloo/nccl groups take
  CPU/CUDA tensors directly);
- a single worker: the inputs themselves (only ``scale`` is applied).
"""
from __future__ import annotations

import numbers
import os
import warnings

import torch
import torch.distributed as dist

from accel.utils.xla import is_xla_tensor
from accel.xla import _staging
from accel.xla._topology import _dist_ready, _uses_xla_native_collectives, ordinal, world_size

REDUCE_SUM, REDUCE_MUL, REDUCE_AND, REDUCE_OR, REDUCE_MIN, REDUCE_MAX = "sum", "mul", "and", "or", "min", "max"

_REDUCE_OPS = {
    REDUCE_SUM: dist.ReduceOp.SUM,
    REDUCE_MUL: dist.ReduceOp.PRODUCT,
    REDUCE_AND: dist.ReduceOp.BAND,
    REDUCE_OR: dist.ReduceOp.BOR,
    REDUCE_MIN: dist.ReduceOp.MIN,
    REDUCE_MAX: dist.ReduceOp.MAX,
}

_subgroups: dict[tuple, object] = {}
_warned_local_only = False


def _reduce_op(reduce_type):
    if reduce_type not in _REDUCE_OPS:
        raise ValueError(f"reduce_type must be one of {sorted(_REDUCE_OPS)}, got {reduce_type!r}")
    return _REDUCE_OPS[reduce_type]


def _check_groups(groups, n: int) -> list[list[int]] | None:
    if groups is None:
        return None
    if not isinstance(groups, (list, tuple)) or not all(isinstance(g, (list, tuple)) for g in groups):
        raise ValueError(f"groups must be None or a list of lists of ordinals, got {groups!r}")
    if len(groups) == 0:
        return None
    members = sorted(r for g in groups for r in g)
    if members != list(range(n)):
        raise ValueError(f"groups must split the ordinals 0..{n - 1} into disjoint lists, got {groups!r}")
    return [list(g) for g in groups]


def _my_group_size(groups, n: int) -> int:
    checked = _check_groups(groups, n)
    if checked is None:
        return n
    me = ordinal()
    return next(len(g) for g in checked if me in g)


def _process_group(groups):
    """The torch.distributed group for ``groups`` (None: the default group)."""
    checked = _check_groups(groups, world_size())
    if checked is None or len(checked) == 1:
        return None
    key = tuple(tuple(g) for g in checked)
    if key not in _subgroups:
        # Every rank passes the same groups, so every rank creates the same subgroups in the same order.
        mine, _ = dist.new_subgroups_by_enumeration(checked)
        _subgroups[key] = mine
    return _subgroups[key]


def _refuse_silent_local(pg, has_xla: bool) -> None:
    # torch_xla's own group on CPU PJRT would hand back each process's local value.
    if has_xla and type(pg).__name__ == "ProcessGroupXla":
        raise RuntimeError(
            "the 'xla' process group in use is torch_xla's, which on the CPU PJRT client returns local "
            "values instead of reducing across processes. Import accel.torch_xla.distributed.xla_backend "
            "(or accel.xla.backend) after torch_xla.distributed.xla_backend and before init_process_group."
        )


def _reduce_in_place(tensors: list[torch.Tensor], op, group) -> None:
    from accel.xla import backend

    pg = group if group is not None else dist.group.WORLD
    if isinstance(pg, backend.HostStagedProcessGroup):
        opts = dist.AllreduceCoalescedOptions()
        opts.reduceOp = op
        pg.allreduce_coalesced(tensors, opts).wait()
        return
    _refuse_silent_local(pg, any(is_xla_tensor(t) for t in tensors))
    hosts = _staging.to_host(tensors)
    for idx, flat in _staging.flatten_by_dtype(hosts):
        wire = flat.to(torch.uint8) if flat.dtype == torch.bool else flat  # gloo/nccl carry no bool
        dist.all_reduce(wire, op=op, group=group)
        _staging.unflatten_into(hosts, idx, wire.to(flat.dtype))
    _staging.copy_back(tensors, hosts)


def _warn_if_local_only() -> None:
    global _warned_local_only
    if not _warned_local_only and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        _warned_local_only = True
        warnings.warn(
            "accel.xla.all_reduce: WORLD_SIZE > 1 but no torch.distributed group is initialised, so "
            "each process reduces only its own values. Call dist.init_process_group('xla') first.",
            RuntimeWarning,
            stacklevel=3,
        )


def all_reduce(reduce_type: str, inputs, scale: float = 1.0, groups=None, pin_layout: bool = True):
    """Reduce ``inputs`` across workers, then multiply by ``scale``.

    ``inputs`` a tensor: returns a new reduced tensor. A list of tensors: reduced in place,
    the list is returned. ``pin_layout`` is accepted for torch_xla compatibility.
    """
    op = _reduce_op(reduce_type)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise ValueError(f"scale must be a real number, got {scale!r}")
    single = isinstance(inputs, torch.Tensor)
    if single:
        tensors = [inputs]
    elif isinstance(inputs, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in inputs):
        tensors = list(inputs)
    else:
        raise ValueError(f"inputs must be a tensor or a list of tensors, got {type(inputs).__name__}")
    _check_groups(groups, world_size())
    if not tensors:
        return inputs
    has_xla = any(is_xla_tensor(t) for t in tensors)
    if has_xla and _uses_xla_native_collectives():
        import torch_xla.core.xla_model as xm

        return xm.all_reduce(reduce_type, inputs, scale=float(scale), groups=groups, pin_layout=pin_layout)

    targets = [inputs.clone()] if single else tensors
    if _dist_ready() and world_size() > 1:
        _reduce_in_place(targets, op, _process_group(groups))
    else:
        _warn_if_local_only()
    if scale != 1.0:
        with torch.no_grad():
            for t in targets:
                t.mul_(scale)
    return targets[0] if single else inputs


def _check_optimizer(optimizer) -> None:
    if not hasattr(optimizer, "param_groups") or not callable(getattr(optimizer, "step", None)):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")


def fetch_gradients(optimizer) -> list[torch.Tensor]:
    """The .grad of every parameter the optimizer updates (parameters without a gradient skipped)."""
    _check_optimizer(optimizer)
    return [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


_fetch_gradients = fetch_gradients


# Set on an optimizer by reduce_gradients until its next step: accelerate()'s step pre-hook (several ranks
# on xla, accel.compiler.optimizer) then knows that optimizer_step, or the user, already reduced them.
_REDUCED = "_accel_gradients_reduced"


def reduce_gradients(optimizer, groups=None, pin_layout: bool = True) -> None:
    """Replace every gradient by its mean over the replicas (of this worker's group)."""
    n = world_size()
    if n > 1:
        count = _my_group_size(groups, n)
        all_reduce(REDUCE_SUM, fetch_gradients(optimizer), scale=1.0 / count, groups=groups, pin_layout=pin_layout)
        optimizer.__dict__[_REDUCED] = True
    else:
        _check_optimizer(optimizer)


def reduce_gradients_once(optimizer) -> None:
    """At a step: average the gradients unless reduce_gradients already did since the last step."""
    if not optimizer.__dict__.pop(_REDUCED, False):
        reduce_gradients(optimizer)
    optimizer.__dict__.pop(_REDUCED, None)


def optimizer_step(optimizer, optimizer_args=None, barrier: bool = False, groups=None, pin_layout: bool = True):
    """Average gradients across replicas, then ``optimizer.step(**optimizer_args)``.

    ``barrier=True`` also cuts and runs the graph (sync()), as TorchAcc's single-device loop needs.
    Returns what optimizer.step returned.
    """
    _check_optimizer(optimizer)
    if optimizer_args is not None and not isinstance(optimizer_args, dict):
        raise ValueError(f"optimizer_args must be a dict of keyword arguments, got {type(optimizer_args).__name__}")
    if not isinstance(barrier, bool):
        raise ValueError(f"barrier must be a bool, got {barrier!r}")
    reduce_gradients(optimizer, groups=groups, pin_layout=pin_layout)
    result = optimizer.step(**(optimizer_args or {}))
    if barrier:
        from accel.xla._closures import sync

        sync()
    return result
