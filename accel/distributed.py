"""Distributed training for accelerate(): the process group, DDP / FSDP2 / XLA SPMD FSDP wrapping, gradient
accumulation.

accelerate() calls `start_process_group` (or `start_spmd`) and `wrap_model`; users call `accumulate` around
each micro-batch:

    for i, batch in enumerate(loader):
        with accel.accumulate(model, steps=N):
            (model(**batch)["loss"] / N).backward()
        if (i + 1) % N == 0:
            optimizer.step(); optimizer.zero_grad()

What runs where:
- cpu / cuda: DDP is torch's DistributedDataParallel (bucketed all-reduce overlapping the backward);
  FSDP is torch's FSDP2 (`fully_shard`): one unit per block, then the root; with dp and fsdp both > 1
  it is HSDP over a 2-D mesh (replicate over dp, shard over fsdp).
- xla: data parallel averages the gradients once per optimizer step over the xla group (one bucketed
  all-reduce, accel.xla.reduce_gradients) from a step pre-hook on the optimizer the user builds, so the
  usual loop (or accel.xla.optimizer_step, which then does not reduce a second time) works unchanged;
  the sync-free GradScaler all-reduces its found_inf.
  FSDP on xla (dist.fsdp.size > 1) is torch_xla's FSDPv2 in SPMD mode, in ONE process that drives every
  device (accel.xla.fsdp): the "world" that dist.dp.size x dist.fsdp.size must fill is the SPMD device count
  (CPU_NUM_DEVICES on the PJRT CPU client, the chips on TPU), not the process count. The mesh is
  ('fsdp',) of fsdp.size devices, or with dp.size > 1 ('dp', 'fsdp') in dist.topology's order (parameters
  sharded over fsdp, replicated over dp); one FSDPv2 unit per block of dist.fsdp.wrap_layer_cls (or the
  repeated blocks), then the root; the loader uploads each batch split along dim 0 over the mesh. The
  compiler inserts the all-gathers and gradient reduce-scatters, so no process group is started (several
  processes launched by xlarun/torchrun are refused: SPMD and the xla process group exclude each other).
  dist.fsdp.cpu_offload is refused (FSDPv2 has no offload); dist.fsdp.flatten_parameters has no effect
  (every parameter is sharded on its own). On the PJRT CPU client this runs, and is tested, for
  correctness; the memory saving and the overlap of communication with compute exist only on TPU.
"""
from __future__ import annotations

import contextlib
import os
import weakref

import torch
from torch import nn

from accel.config import DistConfig

PROCESS_GROUP_BACKENDS = {"xla": "xla", "cuda": "nccl", "cpu": "gloo"}


def _dist():
    return torch.distributed if torch.distributed.is_available() else None


def world_size() -> int:
    """Ranks in the default process group, or the launcher's WORLD_SIZE before it exists, else 1."""
    dist = _dist()
    if dist is not None and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    dist = _dist()
    if dist is not None and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def start_process_group(backend: str) -> int:
    """Start the default process group when the launcher (xlarun / torchrun) started several ranks and the
    script has not started one itself (xla on the xla backend, nccl on cuda, gloo on cpu). On cuda each
    rank also takes the GPU of its LOCAL_RANK. Returns the world size."""
    n = world_size()
    if n <= 1:
        return 1
    dist = _dist()
    if dist is None:
        raise RuntimeError(f"WORLD_SIZE={n} but this torch build has no torch.distributed")
    if backend == "cuda" and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if not dist.is_initialized():
        if backend == "xla":
            import accel.xla  # noqa: F401 - registers the "xla" process-group backend

        dist.init_process_group(PROCESS_GROUP_BACKENDS[backend])
    return dist.get_world_size()


def all_ranks_agree(flag: bool) -> bool:
    """True only where every rank of the default process group passes True (one process: the flag itself): for
    choices each rank measures for itself, e.g. which library is faster, that must come out the same on all."""
    dist = _dist()
    if dist is None or not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    votes = torch.tensor([int(flag)], device=device)
    dist.all_reduce(votes, op=dist.ReduceOp.MIN)
    return bool(votes.item())


def _mesh(device_type: str, dp: int, fsdp: int, topology: list):
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if dp == 1:
        return init_device_mesh(device_type, (fsdp,), mesh_dim_names=("fsdp",))
    if topology[0] == "dp":  # the default: the ranks of one shard group are contiguous
        return init_device_mesh(device_type, (dp, fsdp), mesh_dim_names=("dp", "fsdp"))
    ranks = torch.arange(dp * fsdp).reshape(fsdp, dp).T  # fsdp outermost: a shard group strides over replicas
    return DeviceMesh(device_type, ranks, mesh_dim_names=("dp", "fsdp"))


def _named_fsdp_blocks(model: nn.Module, class_names) -> list[tuple[str, nn.Module]]:
    from accel.checkpoint import find_block_stacks, find_blocks_by_class

    if class_names:
        found = find_blocks_by_class(model, class_names)
        if not found:
            raise ValueError(f"dist.fsdp.wrap_layer_cls: no module of the model has a class named in "
                             f"{sorted(class_names)}")
    else:
        found = [block for _, stack in find_block_stacks(model) for block in stack]
    return list(found)


def _fsdp_blocks(model: nn.Module, class_names) -> list[nn.Module]:
    return [block for _, block in _named_fsdp_blocks(model, class_names)]


def _fully_shard(model: nn.Module, device: torch.device, dist_config: DistConfig, dp: int, fsdp: int,
                 dtype: torch.dtype | None) -> nn.Module:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = _mesh(device.type, dp, fsdp, dist_config.topology)
    # Gradients are reduced in fp32 whatever the compute dtype: bf16 sums over many ranks lose digits.
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype is not None else None)
    # cpu_offload: the sharded parameters, gradients and optimizer state live in host memory. Pinning them only
    # speeds up the copies to an accelerator, and torch can pin only where one exists: FSDP2's default
    # CPUOffloadPolicy(pin_memory=True) fails in fully_shard on a machine without a GPU ("Found no NVIDIA driver").
    # So unpinned on the cpu backend, where the compute device is the host and FSDP2's copies are no-ops.
    offload = (CPUOffloadPolicy(pin_memory=device.type != "cpu") if dist_config.fsdp.cpu_offload
               else OffloadPolicy())
    for block in _fsdp_blocks(model, dist_config.fsdp.wrap_layer_cls):
        fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=offload)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload)
    return model


def uses_spmd(backend: str, dist_config: DistConfig) -> bool:
    """FSDP on the xla backend: one SPMD process over all devices (see the module docstring)."""
    return backend == "xla" and dist_config.fsdp.size > 1


SPMD_WORLD = "the SPMD device count"


def start_spmd(dist_config: DistConfig) -> int:
    """For uses_spmd(): refuse what SPMD FSDP cannot do, then switch torch_xla into SPMD mode (before any
    XLA computation of accelerate()); returns the number of devices the SPMD program spans."""
    if dist_config.fsdp.cpu_offload:
        raise ValueError("dist.fsdp.cpu_offload with backend='xla': torch_xla's SPMD FSDP (FSDPv2) has no "
                         "offload; set it to False, or use the cuda/cpu backends (torch FSDP2)")
    n = world_size()
    if n > 1:
        raise ValueError(f"dist.fsdp.size > 1 with backend='xla' runs ONE process that drives every device "
                         f"(SPMD), but the launcher started WORLD_SIZE={n} processes: start one process (the "
                         f"devices are the CPU_NUM_DEVICES of the PJRT CPU client, or the TPU chips)")
    from accel.xla import spmd

    spmd.enable_spmd()
    return spmd.device_count()


def _spmd_fully_shard(model: nn.Module, dist_config: DistConfig) -> nn.Module:
    from accel.xla import fsdp as xla_fsdp
    from accel.xla import spmd

    dp, fsdp = dist_config.sizes(start_spmd(dist_config), SPMD_WORLD)
    mesh = spmd.fsdp_mesh(fsdp, dp, dist_config.topology)
    return xla_fsdp.fully_shard(model, mesh, _named_fsdp_blocks(model, dist_config.fsdp.wrap_layer_cls))


def input_sharding(model: nn.Module):
    """How the loader must place each batch for `model` (an accel.xla.spmd.BatchSharding for a model
    wrapped by the xla FSDP path), else None."""
    from accel.xla import fsdp as xla_fsdp

    mesh = xla_fsdp.mesh_of(model)
    if mesh is None:
        return None
    from accel.xla.spmd import BatchSharding

    return BatchSharding(mesh)


def wrap_model(model: nn.Module, backend: str, device: torch.device, dist_config: DistConfig,
               dtype: torch.dtype | None) -> nn.Module:
    """The model wrapped for the configured data-parallel / sharded run (unchanged with one rank). On xla
    with dist.fsdp.size > 1: FSDPv2 over the SPMD mesh (module docstring); autocast (dtype) is already
    around the forward there, and the parameters stay fp32."""
    if uses_spmd(backend, dist_config):
        return _spmd_fully_shard(model, dist_config)
    n = world_size()
    dp, fsdp = dist_config.sizes(n)
    if n == 1:
        return model
    if backend == "xla":
        _xla_data_parallel.add(model)
        return model
    if fsdp == 1:
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    return _fully_shard(model, device, dist_config, dp, fsdp, dtype)


# Models whose gradients accel averages at each optimizer step (the xla backend's data parallel).
_xla_data_parallel: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def reduces_gradients_on_step(model: nn.Module) -> bool:
    return model in _xla_data_parallel


# micro-batches seen in the current accumulation group, per model
_micro_batches: "weakref.WeakKeyDictionary[nn.Module, int]" = weakref.WeakKeyDictionary()


def _data_parallel_module(model: nn.Module):
    """The DDP wrapper or FSDP2 root inside `model` (through torch.compile's wrapper), else None."""
    from torch.nn.parallel import DistributedDataParallel

    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        FSDPModule = ()
    inner = getattr(model, "_orig_mod", model)
    return inner if isinstance(inner, (DistributedDataParallel, FSDPModule)) else None


@contextlib.contextmanager
def accumulate(model: nn.Module, steps: int):
    """Run one micro-batch of a group of `steps`: the first steps-1 of each group skip the gradient
    communication (DDP no_sync, FSDP2 set_requires_gradient_sync(False); on xla gradients are reduced
    at the optimizer step anyway), the last one reduces the sum of all of them. On xla's SPMD FSDP
    there is nothing to skip: the compiler places the gradient reduce-scatter in the graph of each
    micro-batch's backward, and the graphs accumulate into the sharded .grad as usual.

    Args:
        model: the model accelerate() returned (plain, DDP, FSDP2, xla FSDPv2 or compiled).
        steps: micro-batches per optimizer step (int >= 1). Scale each loss by 1/steps to get the
            gradient of the mean over the group, as in the module docstring.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise TypeError(f"steps: expected an int, got {steps!r}")
    if steps < 1:
        raise ValueError(f"steps: expected an int >= 1, got {steps}")
    count = _micro_batches.get(model, 0) + 1
    last = count >= steps
    _micro_batches[model] = 0 if last else count
    parallel = _data_parallel_module(model)
    if last or parallel is None:
        yield
        return
    if hasattr(parallel, "no_sync"):  # DDP
        with parallel.no_sync():
            yield
        return
    parallel.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        parallel.set_requires_gradient_sync(True)
