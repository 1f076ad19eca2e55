"""The "xla" torch.distributed backend, correct on every PJRT device.

``dist.init_process_group("xla", init_method="env://" | "xla://")``. On TPU (and any PJRT
device with real collectives) this hands over to torch_xla's ProcessGroupXla, which puts
collectives into the XLA graph. On the CPU PJRT client torch_xla has no cross-process
collectives and its group silently returns each process's local values; there we use
HostStagedProcessGroup: XLA tensors go through host memory and gloo, and the results are
copied back into the same tensors.

What HostStagedProcessGroup covers (each ``dist.<fn>`` calls the method named after it on
the group object, so these Python methods are what torch.distributed reaches):

- reductions: all_reduce (SUM, AVG, PRODUCT, MIN, MAX; bool too), the coalesced all_reduce
  of ``_coalescing_manager``, reduce, reduce_scatter, reduce_scatter_tensor;
- gathers and broadcast: all_gather, all_gather_into_tensor, broadcast, barrier;
- data movement, sent as bytes so every dtype travels (gloo itself has no int16 or complex):
  scatter, gather, all_to_all, all_to_all_single with or without split sizes;
- point to point: send, recv (from a rank or any source; recv returns the sender), isend,
  irecv, batch_isend_irecv. These return works still in flight (gloo's send finishes only
  once the peer has posted its receive); wait() completes them, copying received data into
  XLA tensors on the waiting thread;
- object collectives, built by torch on the above: all_gather_object, broadcast_object_list
  (CPU byte tensors by default, XLA ones with ``device=``), gather_object, scatter_object_list.

Not covered: monitored_barrier (torch allows it on "gloo" groups only), allgather_coalesced
and the coalesced all_gather_into_tensor/reduce_scatter_tensor of ``_coalescing_manager``.
Every other method returns a Work that is already complete, with results in place.

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


class _InFlightWork(dist.Work):
    """A gloo send or receive still in flight; for a receive, host buffers to copy out of.

    Point-to-point works stay in flight after they return: gloo's send only finishes once the
    peer has posted its receive, so a receive that blocked inside irecv would deadlock every
    exchange in which both ranks post irecv before isend (as batch_isend_irecv allows).
    Completing a receive copies its host buffers into the targets (XLA or non-contiguous
    tensors) on the thread that waits, never on gloo's, because XLA tensors belong to the
    caller's thread. gloo waits for the data again on every wait() of its p2p works, so this
    one waits once and remembers.
    """

    def __init__(self, gloo_work, targets=(), hosts=()):
        super().__init__()
        self._gloo_work = gloo_work
        self._targets = list(targets)
        self._hosts = list(hosts)
        self._done = False

    def wait(self, timeout=None):
        if not self._done:
            if timeout is None:
                self._gloo_work.wait()
            else:
                self._gloo_work.wait(timeout)
            _staging.copy_back(self._targets, self._hosts)
            self._done = True
        return True

    def is_completed(self):
        # gloo marks p2p works complete only inside wait(), so this is True once waited on.
        return self._done

    def exception(self):
        return self._gloo_work.exception()

    def _source_rank(self):
        # dist.recv(src=None) asks the work which rank the data came from.
        return self._gloo_work._source_rank()

    def result(self):
        self.wait()
        return self._targets

    def get_future(self):
        # Completing first means callbacks chained on the future already see the received data.
        self.wait()
        fut = torch.futures.Future()
        fut.set_result(self._targets)
        return fut


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
            host_outs = [_staging.host_buffer_like(o) for o in outputs]
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
        chunks = [_staging.host_buffer_like(host_in) for _ in range(self.size())]
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

    # -- scatter, gather, all-to-all: data movement, sent as bytes ---------------------------
    def _one_tensor(self, tensors, name):
        if len(tensors) != 1:
            raise ValueError(f"{name} must hold exactly one tensor, got {len(tensors)}")
        return tensors[0]

    def _one_per_rank(self, tensors, name, like):
        """Check a root's list (one tensor per rank, each like ``like``) and return it."""
        if len(tensors) != self.size():
            raise ValueError(f"{name} must hold world_size={self.size()} tensors, got {len(tensors)}")
        for i, t in enumerate(tensors):
            if t.numel() != like.numel() or t.dtype != like.dtype:
                raise ValueError(
                    f"{name}[{i}] must have {like.numel()} elements of {like.dtype}, got {t.numel()} of {t.dtype}"
                )
        return tensors

    def scatter(self, output_tensors, input_tensors, opts=None):
        opts = dist.ScatterOptions() if opts is None else opts
        output = self._one_tensor(output_tensors, "output_tensors")
        host_out = _staging.host_buffer_like(output)
        wire_in = []
        if self.rank() == opts.rootRank:
            chunks = self._one_per_rank(input_tensors[0] if input_tensors else [], "scatter_list", output)
            wire_in = [[_staging.as_bytes(h) for h in _staging.to_host(list(chunks))]]
        self._gloo.scatter([_staging.as_bytes(host_out)], wire_in, opts).wait()
        _staging.copy_back([output], [host_out])
        return _done_work(output_tensors)

    def gather(self, output_tensors, input_tensors, opts=None):
        opts = dist.GatherOptions() if opts is None else opts
        (host_in,) = _staging.to_host([self._one_tensor(input_tensors, "input_tensors")])
        targets, host_outs, wire_out = [], [], []
        if self.rank() == opts.rootRank:
            targets = self._one_per_rank(output_tensors[0] if output_tensors else [], "gather_list", host_in)
            host_outs = [_staging.host_buffer_like(t) for t in targets]
            wire_out = [[_staging.as_bytes(h) for h in host_outs]]
        self._gloo.gather(wire_out, [_staging.as_bytes(host_in)], opts).wait()
        _staging.copy_back(targets, host_outs)
        return _done_work(output_tensors)

    def _check_splits(self, name, splits, t, tensor_name):
        if t.dim() == 0:
            raise ValueError(f"{tensor_name} must have at least one dimension to split along, got a scalar")
        if not splits:
            if t.shape[0] % self.size():
                raise ValueError(
                    f"{tensor_name}.shape[0]={t.shape[0]} must divide by world_size={self.size()} "
                    f"when {name} is empty"
                )
            return
        if len(splits) != self.size() or any(s < 0 for s in splits) or sum(splits) != t.shape[0]:
            raise ValueError(
                f"{name} must hold world_size={self.size()} non-negative sizes summing to "
                f"{tensor_name}.shape[0]={t.shape[0]}, got {list(splits)}"
            )

    def alltoall_base(self, output, input_tensor, output_split_sizes, input_split_sizes, opts=None):
        opts = dist.AllToAllOptions() if opts is None else opts
        self._check_splits("input_split_sizes", input_split_sizes, input_tensor, "input")
        self._check_splits("output_split_sizes", output_split_sizes, output, "output")
        if output.shape[1:].numel() != input_tensor.shape[1:].numel():
            raise ValueError(
                f"output and input must have rows of the same size (shape[1:]), got "
                f"{tuple(output.shape[1:])} and {tuple(input_tensor.shape[1:])}"
            )
        (host_in,) = _staging.to_host([input_tensor])
        host_out = _staging.host_buffer_like(output)
        wire_out, wire_in = _staging.rows_as_bytes(host_out), _staging.rows_as_bytes(host_in)
        self._gloo.alltoall_base(wire_out, wire_in, list(output_split_sizes), list(input_split_sizes), opts).wait()
        _staging.copy_back([output], [host_out])
        return _done_work([output])

    def alltoall(self, output_tensors, input_tensors, opts=None):
        # gloo has no list all-to-all: one byte buffer per side, split by each tensor's size.
        for name, tensors in (("output_tensor_list", output_tensors), ("input_tensor_list", input_tensors)):
            if len(tensors) != self.size():
                raise ValueError(f"{name} must hold world_size={self.size()} tensors, got {len(tensors)}")
        host_ins = _staging.to_host(list(input_tensors))
        host_outs = [_staging.host_buffer_like(t) for t in output_tensors]
        wire_in = torch.cat([_staging.as_bytes(h) for h in host_ins])
        out_sizes = [h.nbytes for h in host_outs]
        wire_out = torch.empty(sum(out_sizes), dtype=torch.uint8)
        opts = dist.AllToAllOptions() if opts is None else opts
        self._gloo.alltoall_base(wire_out, wire_in, out_sizes, [h.nbytes for h in host_ins], opts).wait()
        for host, piece in zip(host_outs, wire_out.split(out_sizes)):
            _staging.as_bytes(host).copy_(piece)
        _staging.copy_back(output_tensors, host_outs)
        return _done_work(output_tensors)

    # -- point to point: left in flight (see _InFlightWork) -----------------------------------
    def send(self, tensors, dst_rank, tag=0):
        (host,) = _staging.to_host([self._one_tensor(tensors, "tensors")])
        # gloo holds the byte view, and so the host copy, until the peer has it.
        return _InFlightWork(self._gloo.send([_staging.as_bytes(host)], dst_rank, tag))

    def _receive(self, tensors, start):
        target = self._one_tensor(tensors, "tensors")
        if target.device.type == "cpu" and target.is_contiguous():
            return _InFlightWork(start([_staging.as_bytes(target)]), [target], [target])  # gloo writes into it
        host = _staging.host_buffer_like(target)
        return _InFlightWork(start([_staging.as_bytes(host)]), [target], [host])

    def recv(self, tensors, src_rank, tag=0):
        return self._receive(tensors, lambda wire: self._gloo.recv(wire, src_rank, tag))

    def recv_anysource(self, tensors, tag=0):
        return self._receive(tensors, lambda wire: self._gloo.recv_anysource(wire, tag))

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
