"""The "xla" torch.distributed backend, correct on every PJRT device.

``dist.init_process_group("xla", init_method="env://" | "xla://")``. On TPU (and any PJRT
device with real collectives) this hands over to torch_xla's ProcessGroupXla, which puts
collectives into the XLA graph. On the CPU PJRT client torch_xla has no cross-process
collectives and its group silently returns each process's local values; there we use
HostStagedProcessGroup: XLA tensors go through host memory and gloo, and the results are
copied back into the same tensors.

Importing this module registers the backend (after torch_xla's own registration, so ours
is the one init_process_group finds) and the "xla://" rendezvous.
"""
from __future__ import annotations

import datetime
import importlib
from urllib.parse import urlparse, urlunparse

import torch
import torch.distributed as dist

from accel.utils.xla import require_xla, xla_available
from accel.xla import _staging

BACKEND_NAME = "xla"

_torch_xla_creator = None  # torch_xla's factory, used where its collectives really work
_torch_xla_rendezvous = None  # torch_xla's "xla://" handler (TPU worker discovery)


def _done_work(result):
    """A Work that is already complete: the host collective finished before we return."""
    fut = torch.futures.Future()
    fut.set_result(result)
    make = getattr(torch._C._distributed_c10d, "_create_work_from_future", None)
    if make is not None:
        return make(fut)
    return _DoneWork(fut)


class _DoneWork(dist.Work):
    # Fallback for torch versions without _create_work_from_future.
    def __init__(self, fut):
        super().__init__()
        self._fut = fut

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True

    def is_success(self):
        return True

    def get_future(self):
        return self._fut


class HostStagedProcessGroup(dist.ProcessGroup):
    """ProcessGroup for XLA (and CPU) tensors on CPU PJRT: collectives run in gloo on host copies."""

    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta):
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore("accel-host-staged/", store), rank, size, timeout)
        self._group_name_str = ""

    def getBackendName(self):
        return BACKEND_NAME

    def name(self):
        return BACKEND_NAME

    # torch sets the name through this hook; the C++ base of a Python subclass cannot keep it.
    def _set_group_name(self, name: str) -> None:
        self._group_name_str = name

    @property
    def group_name(self):
        return self._group_name_str

    # -- reductions ---------------------------------------------------------------------------
    def _gloo_allreduce(self, host: torch.Tensor, op) -> None:
        if op == dist.ReduceOp.AVG:  # gloo has no AVG; the sum divided by the size is the same thing
            self._gloo_allreduce(host, dist.ReduceOp.SUM)
            host.div_(self.size())
            return
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        if host.dtype == torch.bool:  # gloo carries no bool
            wire = host.to(torch.uint8)
            self._gloo.allreduce([wire], opts).wait()
            host.copy_(wire.bool())
            return
        self._gloo.allreduce([host], opts).wait()

    def allreduce(self, tensors, opts=None):
        op = dist.ReduceOp.SUM if opts is None else opts.reduceOp
        hosts = _staging.to_host(tensors)
        for host in hosts:
            self._gloo_allreduce(host, op)
        _staging.copy_back(tensors, hosts)
        return _done_work(tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        op = dist.ReduceOp.SUM if opts is None else opts.reduceOp
        hosts = _staging.to_host(tensors)
        for idx, flat in _staging.flatten_by_dtype(hosts):
            self._gloo_allreduce(flat, op)
            _staging.unflatten_into(hosts, idx, flat)
        _staging.copy_back(tensors, hosts)
        return _done_work(tensors)

    def reduce(self, tensors, opts):
        hosts = _staging.to_host(tensors)
        ropts = dist.ReduceOptions()
        ropts.reduceOp, ropts.rootRank, ropts.rootTensor = opts.reduceOp, opts.rootRank, opts.rootTensor
        self._gloo.reduce(hosts, ropts).wait()
        if self.rank() == opts.rootRank:
            _staging.copy_back(tensors, hosts)
        return _done_work(tensors)

    def _reduce_scatter_base(self, output, input_tensor, opts=None):
        # Via allreduce: gloo's reduce_scatter support differs between torch versions.
        op = dist.ReduceOp.SUM if opts is None else opts.reduceOp
        (host_in,) = _staging.to_host([input_tensor])
        if host_in is input_tensor:  # a CPU input must not be overwritten by the full reduction
            host_in = input_tensor.clone()
        if host_in.numel() != output.numel() * self.size():
            raise ValueError(
                f"input must have world_size * output.numel() = {output.numel() * self.size()} elements, "
                f"got {host_in.numel()}"
            )
        self._gloo_allreduce(host_in, op)
        mine = host_in.reshape(self.size(), -1)[self.rank()].reshape(output.shape)
        _staging.copy_back([output], [mine])
        return _done_work([output])

    def reduce_scatter(self, output_tensors, input_tensors_lists, opts=None):
        for output, inputs in zip(output_tensors, input_tensors_lists):
            if len(inputs) != self.size():
                raise ValueError(f"input_list must hold world_size={self.size()} tensors, got {len(inputs)}")
            stacked = torch.stack(_staging.to_host(list(inputs)))
            self._reduce_scatter_base(output, stacked, opts)
        return _done_work(output_tensors)

    # -- gathers and broadcast ----------------------------------------------------------------
    def allgather(self, output_tensors_lists, input_tensors, opts=None):
        for outputs, input_tensor in zip(output_tensors_lists, input_tensors):
            (host_in,) = _staging.to_host([input_tensor])
            host_outs = [torch.empty(o.shape, dtype=o.dtype) for o in outputs]
            self._gloo.allgather([host_outs], [host_in]).wait()
            _staging.copy_back(outputs, host_outs)
        return _done_work(output_tensors_lists)

    def _allgather_base(self, output, input_tensor, opts=None):
        (host_in,) = _staging.to_host([input_tensor])
        if output.numel() != host_in.numel() * self.size():
            raise ValueError(
                f"output must have world_size * input.numel() = {host_in.numel() * self.size()} elements, "
                f"got {output.numel()}"
            )
        chunks = [torch.empty(host_in.shape, dtype=host_in.dtype) for _ in range(self.size())]
        self._gloo.allgather([chunks], [host_in]).wait()
        gathered = torch.cat([c.reshape(-1) for c in chunks]).reshape(output.shape)
        _staging.copy_back([output], [gathered])
        return _done_work([output])

    def broadcast(self, tensors, opts):
        hosts = _staging.to_host(tensors)
        bopts = dist.BroadcastOptions()
        bopts.rootRank, bopts.rootTensor = opts.rootRank, opts.rootTensor
        self._gloo.broadcast(hosts, bopts).wait()
        _staging.copy_back(tensors, hosts)
        return _done_work(tensors)

    def barrier(self, opts=None):
        self._gloo.barrier(dist.BarrierOptions()).wait()
        return _done_work(None)


def _uses_native_collectives() -> bool:
    import torch_xla.runtime as xr

    return xr.device_type() not in (None, "CPU")


def create_process_group(store, rank: int, size: int, timeout: datetime.timedelta):
    """The factory torch.distributed calls for backend "xla"."""
    require_xla("the 'xla' process group (dist.init_process_group('xla'))")
    import torch_xla.runtime as xr

    if xr.is_spmd():
        raise RuntimeError(
            "the 'xla' process group cannot be used under SPMD (xr.use_spmd()): SPMD runs one process "
            "over all devices, so there is nothing to communicate with. Use accel.xla.spmd for data "
            "parallelism, and a 'gloo' group if you need host-side collectives."
        )
    if _uses_native_collectives() and _torch_xla_creator is not None:
        return _torch_xla_creator(store, rank, size, timeout)
    if size > 1:
        _staging.warn_host_staging_once()
    return HostStagedProcessGroup(store, rank, size, timeout)


def _xla_rendezvous_handler(url: str, **kwargs):
    """"xla://": torchrun's environment (MASTER_ADDR/PORT, RANK, WORLD_SIZE), exactly like env://."""
    if xla_available() and _torch_xla_rendezvous is not None and _uses_native_collectives():
        yield from _torch_xla_rendezvous(url, **kwargs)
        return
    rendezvous = importlib.import_module("torch.distributed.rendezvous").rendezvous
    env_url = urlunparse(urlparse(url)._replace(scheme="env"))
    yield from rendezvous(env_url, **kwargs)


def _install_rendezvous_handler() -> None:
    # The module, not the function of the same name that torch.distributed re-exports.
    rdzv = importlib.import_module("torch.distributed.rendezvous")
    handlers = getattr(rdzv, "_rendezvous_handlers", None)
    if handlers is not None and BACKEND_NAME in handlers:
        # torch_xla registered its own; register_rendezvous_handler refuses to replace it.
        handlers[BACKEND_NAME] = _xla_rendezvous_handler
    else:
        dist.register_rendezvous_handler(BACKEND_NAME, _xla_rendezvous_handler)


def register() -> None:
    """(Re-)register the "xla" backend and rendezvous; idempotent."""
    global _torch_xla_creator, _torch_xla_rendezvous
    if xla_available():
        # Import torch_xla's module first: it registers "xla" when imported, and would
        # overwrite us if that happened later.
        import torch_xla.distributed.xla_backend as txb

        _torch_xla_creator = getattr(txb, "_create_xla_process_group", None)
        try:
            from torch_xla._internal import rendezvous as txr

            _torch_xla_rendezvous = getattr(txr, "pjrt_rendezvous_handler", None)
        except ImportError:  # pragma: no cover - layout differs in other torch_xla versions
            _torch_xla_rendezvous = None
    dist.Backend.register_backend(BACKEND_NAME, create_process_group, devices=["xla", "cpu"])
    _install_rendezvous_handler()


def is_host_staged(group=None) -> bool:
    """True when ``group`` (default: the default group) is accel's host-staged "xla" group."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    pg = group if group is not None else dist.group.WORLD
    return isinstance(pg, HostStagedProcessGroup)


register()
