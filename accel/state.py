"""accel.save_state / accel.load_state: everything a training run needs to stop and go on as if it had not.

    accel.save_state("ckpt.pt", model, optimizer, scaler, scheduler, loader, step=step)
    ...                                           # a new process, objects built as before
    extra = accel.load_state("ckpt.pt", model, optimizer, scaler, scheduler, loader)
    step = extra["step"]

What is saved: the model's and optimizer's state, the GradScaler's, the LR scheduler's, the loader's epoch
and position (accel.data.ResumableLoader, or any loader with state_dict()/load_state_dict()), every
process's RNG states (python `random`, numpy, torch CPU, every CUDA device when CUDA is available, the XLA
generator when torch_xla is imported), and the keyword arguments (`extra`), which load_state returns.

Checkpoint layout:
- An unsharded model (plain, DistributedDataParallel, torch.compile'd, accel.accelerate()'d) gives ONE FILE
  at `path`, written by rank 0 only: a temporary file in the same folder renamed over `path` (a crash leaves
  the previous checkpoint whole), with the mode torch.save would give it, written through a symlink.
  Other ranks wait for it, so no rank can read half a file. It is a torch.save'd dict: "model" (the state
  dict of the user's own module: no "module." / "_orig_mod." prefixes, so an un-accelerated model loads
  it), "optimizer" (optimizer.state_dict()), "scaler", "scheduler", "extra", "world_size" and "ranks" (one
  {"rng", "dataloader"} entry per rank, each rank restores its own).
- A sharded model (FSDP2 `fully_shard`, or any model with DTensor parameters) gives a DIRECTORY at `path`:
      path/latest                 the name of the newest complete version, e.g. "state-000002"
      path/state-000002/          torch.distributed.checkpoint files: each rank writes its own shards of
                                  the model and optimizer (keyed by parameter name, so it loads at another
                                  world size, and into an unsharded model)
      path/state-000002/accel_state.pt   rank 0's small file: scaler, scheduler, extra, world_size, ranks
  A save writes a new version and then atomically rewrites `latest`; older versions are removed only then,
  so a failed save leaves the previous checkpoint loadable. torch.distributed.checkpoint.load reads a
  version folder directly.
  With async_save=True the shards are copied to host memory, written in the background, and `latest`
  moves when they are complete; the next save_state, load_state or wait_for_save(), or the interpreter's
  exit, waits for it (call wait_for_save() before destroy_process_group()). The single file can be saved
  asynchronously too (a host copy, then a background write).
Loading uses torch.load(weights_only=True); save_state refuses, with a TypeError naming it, a value that
could not be loaded that way (e.g. an object in `extra`), rather than writing a checkpoint nobody can load.

The path must be on storage every rank reads (as for torch.distributed.checkpoint).
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import errno
import io
import os
import re
import shutil
import sys
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from accel.data.resumable import CountedLoader, ResumableLoader, _keeps_own_state
from accel.utils.atomic_file import atomic_write
from accel.utils.modules import is_sharded, unwrap_model
from accel.utils.rng import host_rng_state, set_host_rng_state

__all__ = ["load_state", "save_state", "wait_for_save"]

_FORMAT = "accel.state"
_VERSION = 1
_STATE_FILE = "accel_state.pt"
_LATEST = "latest"
_VERSION_DIR = re.compile(r"state-(\d+)")


# ---------------------------------------------------------------- argument checks
def _check_path(path) -> str:
    if isinstance(path, bytes) or not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path: expected a str or os.PathLike, got {type(path).__name__}")
    path = os.fspath(path)
    if isinstance(path, bytes):
        raise TypeError("path: expected a str path, got a bytes path")
    if not path:
        raise ValueError("path: expected a file or directory path, got ''")
    return path


def _check_model(model) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")


def _check_stateful(name: str, value) -> None:
    if value is None:
        return
    if not (callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))):
        raise TypeError(f"{name}: expected None or an object with state_dict() and load_state_dict(), got "
                        f"{type(value).__name__}")


def _find_loader(dataloader):
    """The object whose state is the loader's position: a ResumableLoader or a loader keeping its own state,
    found through accel's wrappers (`.loader`, `.data_loader`)."""
    if dataloader is None:
        return None
    obj, seen = dataloader, []
    while obj is not None and all(obj is not s for s in seen):
        if isinstance(obj, ResumableLoader):
            return obj
        if isinstance(obj, CountedLoader):
            return obj.resumable
        if _keeps_own_state(obj):
            return obj
        seen.append(obj)
        attrs = getattr(obj, "__dict__", {})
        obj = attrs.get("loader") if attrs.get("loader") is not None else attrs.get("data_loader")
    innermost = seen[-1] if seen else dataloader
    from torch.utils.data import DataLoader, IterableDataset

    if isinstance(innermost, DataLoader) and isinstance(innermost.dataset, IterableDataset):
        raise TypeError(f"dataloader: a {type(innermost).__name__} over an IterableDataset does not record its "
                        "position, and accel.data.ResumableLoader cannot skip batches of one by index; use a loader "
                        "with state_dict()/load_state_dict() (e.g. torchdata's StatefulDataLoader)")
    if isinstance(innermost, DataLoader):
        raise TypeError(f"dataloader: a {type(innermost).__name__} does not record its position, so a resumed run "
                        "would silently start the epoch over; wrap it once, where it is built: "
                        "loader = accel.data.ResumableLoader(DataLoader(...)) (or use a loader with "
                        "state_dict()/load_state_dict(), e.g. torchdata's StatefulDataLoader)")
    raise TypeError(f"dataloader: {type(dataloader).__name__} neither is nor wraps an accel.data.ResumableLoader or "
                    "a loader with state_dict()/load_state_dict(), so its position cannot be saved")


# ---------------------------------------------------------------- values
def _to_cpu(obj, copy: bool):
    """Tensors moved to the CPU through dicts, lists and tuples (a host copy even of CPU tensors when `copy`:
    an asynchronous write must not see later in-place updates)."""
    if isinstance(obj, torch.Tensor):
        tensor = obj.detach()
        if tensor.device.type != "cpu":
            return tensor.to("cpu")
        return tensor.clone() if copy else tensor
    if type(obj) in (dict, collections.OrderedDict):
        out = type(obj)((key, _to_cpu(value, copy)) for key, value in obj.items())
        metadata = getattr(obj, "_metadata", None)  # module state dicts carry versions their loaders read
        if metadata is not None:
            out._metadata = metadata
        return out
    if type(obj) in (list, tuple):
        return type(obj)(_to_cpu(value, copy) for value in obj)
    return obj


def _has_xla_tensor(obj) -> bool:
    if isinstance(obj, torch.Tensor):
        return obj.device.type == "xla"
    if isinstance(obj, dict):
        return any(_has_xla_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_xla_tensor(v) for v in obj)
    return False


def _skeleton(obj):
    if type(obj) in (torch.Tensor, nn.Parameter):
        return None
    if type(obj) in (dict, collections.OrderedDict):
        return type(obj)((key, _skeleton(value)) for key, value in obj.items())
    if type(obj) in (list, tuple):
        return type(obj)(_skeleton(value) for value in obj)
    return obj


def _check_loadable(name: str, obj) -> None:
    """TypeError unless torch.load(weights_only=True) can read `obj` back (checked without its tensors)."""
    buffer = io.BytesIO()
    skeleton = _skeleton(obj)
    try:
        torch.save(skeleton, buffer)
    except Exception as exc:  # noqa: BLE001 - pickle raises several types for what it cannot save
        raise TypeError(f"{name}: cannot be saved ({type(exc).__name__}: {exc})") from exc
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except Exception as exc:  # noqa: BLE001
        raise TypeError(f"{name}: holds a value torch.load(weights_only=True) refuses, so the checkpoint could "
                        "not be loaded; keep to tensors, numbers, strings, None and lists/tuples/dicts of them "
                        f"({exc})") from exc


# ---------------------------------------------------------------- RNG
def _rng_state() -> dict:
    state: dict[str, Any] = {"host": host_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    if "torch_xla" in sys.modules:  # only when the user imported it: importing it starts a runtime
        from accel.xla import get_rng_state

        try:
            state["xla"] = int(get_rng_state())
        except Exception as exc:  # noqa: BLE001 - torch_xla imported but no usable device: keep the rest
            warnings.warn(f"save_state: the XLA RNG state is not saved ({exc})", stacklevel=3)
    return state


def _set_rng_state(state: dict) -> None:
    # accel.xla.set_rng_state also seeds torch's CPU and CUDA generators: restore it before those.
    if state.get("xla") is not None and "torch_xla" in sys.modules:
        from accel.xla import set_rng_state

        set_rng_state(state["xla"])
    if state.get("cuda") and torch.cuda.is_available():
        count = torch.cuda.device_count()
        if len(state["cuda"]) != count:
            warnings.warn(f"load_state: the checkpoint has the RNG states of {len(state['cuda'])} CUDA devices, "
                          f"this process sees {count}; restoring the first {min(count, len(state['cuda']))}",
                          stacklevel=3)
        for index, saved in enumerate(state["cuda"][:count]):
            torch.cuda.set_rng_state(saved, index)
    set_host_rng_state(state["host"])


# ---------------------------------------------------------------- distributed helpers
def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather(obj, rank: int, world: int) -> Optional[list]:
    if world == 1:
        return [obj]
    out = [None] * world if rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def _on_rank0(work: Callable[[], Any], path: str, rank: int, world: int, share: bool = False,
              caller: str = "save_state"):
    """Run `work` on rank 0; every rank raises if it failed (rank 0 its own error), so no rank waits forever
    for a rank that gave up. With `share`, every rank gets its (picklable) result, else only rank 0."""
    result, error = None, None
    if rank == 0:
        try:
            result = work()
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the others have heard of it
            error = exc
    if world > 1:
        box = [((result if share else None), None if error is None else f"{type(error).__name__}: {error}")]
        dist.broadcast_object_list(box, src=0)
        shared, message = box[0]
        if share:
            result = shared
        if error is None and message is not None:
            raise RuntimeError(f"{caller}: rank 0 failed to write {path!r}: {message}")
    if error is not None:
        raise error
    return result


_async_group_cache: Optional[tuple] = None


def _async_group():
    """A gloo group of our own for background saves: collectives on the default group from the save thread
    would interleave with the training loop's."""
    global _async_group_cache
    world = dist.group.WORLD
    if _async_group_cache is None or _async_group_cache[0] is not world:
        _async_group_cache = (world, dist.new_group(backend="gloo"))
    return _async_group_cache[1]


# ---------------------------------------------------------------- pending asynchronous save
class _Pending:
    def __init__(self, future: Future, path: str, distributed: bool):
        self.future = future
        self.path = path
        self.distributed = distributed


_pending: Optional[_Pending] = None


def _then(future: Future, after: Callable[[], None]) -> Future:
    """A future done once `future` is and `after` has run (callbacks run after waiters wake up, so a plain
    done-callback could still be running when result() returns)."""
    done: Future = Future()

    def callback(finished: Future) -> None:
        try:
            finished.result()
            after()
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
            done.set_exception(exc)
        else:
            done.set_result(None)

    future.add_done_callback(callback)
    return done


def wait_for_save() -> None:
    """Block until the last save_state(async_save=True) of this process is written and published.

    Every rank must call it (it ends with a barrier when the save was distributed). save_state and
    load_state call it first; call it yourself before torch.distributed.destroy_process_group().

    Raises:
        RuntimeError: the asynchronous save failed (its error is chained); the previous checkpoint at its
            path is still the loadable one.
    """
    _wait(barrier=True)


def _wait(barrier: bool) -> None:
    global _pending
    pending, _pending = _pending, None
    if pending is None:
        return
    error = None
    try:
        pending.future.result()
    except BaseException as exc:  # noqa: BLE001 - re-raised after the barrier
        error = exc
    if barrier and pending.distributed and dist.is_available() and dist.is_initialized():
        dist.barrier()  # rank 0 publishes the checkpoint: nobody reads it before that
    if error is not None:
        raise RuntimeError(f"save_state: the asynchronous save to {pending.path!r} failed: {error}") from error


def _wait_at_exit() -> None:
    try:
        _wait(barrier=False)  # peers may be gone already: no collective at exit
    except RuntimeError as exc:
        print(f"accel: {exc}", file=sys.stderr)


atexit.register(_wait_at_exit)


# ---------------------------------------------------------------- the loader
def _loader_state(loader) -> Optional[dict]:
    if loader is None:
        return None
    kind = "ResumableLoader" if isinstance(loader, ResumableLoader) else "state_dict"
    state = loader.state_dict()
    if kind == "state_dict":
        _check_loadable(f"dataloader ({type(loader).__name__}).state_dict()", state)
    return {"kind": kind, "state": _to_cpu(state, copy=False)}


# ---------------------------------------------------------------- saving
def save_state(path, model, optimizer=None, scaler=None, scheduler=None, dataloader=None, *,
               async_save: bool = False, **extra) -> None:
    """Save the training state so load_state can resume the run exactly (see the module docstring).

    Every rank of a distributed run must call it, with the same arguments.

    Args:
        path: the checkpoint file (unsharded model), or directory (sharded model: created if missing, its
            parent must exist).
        model: the model: plain, DistributedDataParallel, torch.compile'd, accel.accelerate()'d or FSDP2.
        optimizer: optional torch optimizer (or any object with state_dict()/load_state_dict()).
        scaler: optional GradScaler (torch.amp's or accel.amp's).
        scheduler: optional LR scheduler.
        dataloader: optional loader whose epoch and position are saved: an accel.data.ResumableLoader, a
            loader wrapping one (accel.accelerate()'s), or a loader with state_dict()/load_state_dict().
        async_save: return once the state is copied to host memory; it is written in the background (see
            wait_for_save).
        **extra: values to keep with the checkpoint (step counters, ...): tensors, numbers, strings, None and
            containers of them. load_state returns them.

    Raises:
        TypeError: an argument of the wrong type, a plain DataLoader as `dataloader` (wrap it with
            accel.data.ResumableLoader), or a value torch.load(weights_only=True) could not read back.
        ValueError: `path` is a directory for an unsharded model, or a file for a sharded one.
        OSError: writing failed (e.g. FileNotFoundError naming `path` when its folder is missing); the
            previous checkpoint at `path` is left as it was.
    """
    path = _check_path(path)
    _check_model(model)
    for name, value in (("optimizer", optimizer), ("scaler", scaler), ("scheduler", scheduler)):
        _check_stateful(name, value)
    if not isinstance(async_save, bool):
        raise TypeError(f"async_save: expected a bool, got {type(async_save).__name__}")
    loader = _find_loader(dataloader)
    _wait(barrier=True)

    module = unwrap_model(model)
    sharded = is_sharded(module)
    if sharded and os.path.isfile(path):
        raise ValueError(f"path: {path!r} is a file, but a sharded model's checkpoint is a directory")
    if not sharded and os.path.isdir(path):
        raise ValueError(f"path: {path!r} is a directory, but an unsharded model's checkpoint is one file")
    common = {
        "scaler": None if scaler is None else _to_cpu(scaler.state_dict(), copy=async_save),
        "scheduler": None if scheduler is None else _to_cpu(scheduler.state_dict(), copy=async_save),
        "extra": _to_cpu(dict(extra), copy=async_save),
    }
    if common["scaler"] is not None:
        _check_loadable("scaler.state_dict()", common["scaler"])
    if common["scheduler"] is not None:
        _check_loadable("scheduler.state_dict()", common["scheduler"])
    for key, value in extra.items():
        _check_loadable(f"extra[{key!r}]", value)
    mine = {"rng": _rng_state(), "dataloader": _loader_state(loader)}

    rank, world = _rank_world()
    meta = {"format": _FORMAT, "version": _VERSION, "world_size": world, "sharded": sharded,
            "ranks": _gather(mine, rank, world), **common}
    if sharded:
        _save_sharded(path, module, optimizer, meta, rank, world, async_save)
    else:
        _save_file(path, module, optimizer, meta, rank, world, async_save)


def _save_file(path: str, module: nn.Module, optimizer, meta: dict, rank: int, world: int, async_save: bool) -> None:
    def write() -> Optional[Future]:
        model_state = module.state_dict()
        optimizer_state = None if optimizer is None else optimizer.state_dict()
        _check_loadable("model.state_dict()", model_state)
        if optimizer_state is not None:
            _check_loadable("optimizer.state_dict()", optimizer_state)
        if _has_xla_tensor(model_state) or _has_xla_tensor(optimizer_state):
            from accel.utils.xla import mark_step

            mark_step()  # pending lazy updates land before the values are read
        payload = dict(meta, model=_to_cpu(model_state, copy=async_save),
                       optimizer=_to_cpu(optimizer_state, copy=async_save))
        if not async_save:
            atomic_write(path, lambda f: torch.save(payload, f))
            return None
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="accel-save_state")
        future = executor.submit(atomic_write, path, lambda f: torch.save(payload, f))
        executor.shutdown(wait=False)
        return future

    future = _on_rank0(write, path, rank, world)
    if async_save:
        global _pending
        if future is None:  # ranks other than 0: nothing to write, but a load must wait for rank 0's write
            future = Future()
            future.set_result(None)
        _pending = _Pending(future, path, world > 1)


def _optimizer_hyperparameters(optimizer) -> list:
    return [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]


def _save_sharded(path: str, module: nn.Module, optimizer, meta: dict, rank: int, world: int,
                  async_save: bool) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is not None and optimizer.state:
        model_state, optimizer_state = get_state_dict(module, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        meta["optimizer"] = "sharded"
    else:
        # get_state_dict would initialise an empty optimizer with a zero step, which changes the run (Adam's
        # step count): keep only its hyper-parameters.
        state = {"model": get_model_state_dict(module)}
        meta["optimizer"] = None if optimizer is None else "empty"
        if optimizer is not None:
            meta["optimizer_param_groups"] = _to_cpu(_optimizer_hyperparameters(optimizer), copy=True)

    def prepare() -> str:
        if not os.path.isdir(path):
            os.mkdir(path)  # its parent must exist: FileNotFoundError names `path`
        name = _next_version_name(path)
        os.mkdir(os.path.join(path, name))
        atomic_write(os.path.join(path, name, _STATE_FILE), lambda f: torch.save(meta, f))
        return name

    name = _on_rank0(prepare, path, rank, world, share=True)
    writer = _storage_writer(os.path.join(path, name))
    if async_save:
        response = dcp.async_save(state, storage_writer=writer, process_group=_async_group())
        future = getattr(response, "upload_completion", response)  # newer torch may answer with a pair
        if rank == 0:
            future = _then(future, lambda: _publish(path, name))
        global _pending
        _pending = _Pending(future, path, world > 1)
        return
    with _checkpoint_errors("save_state: writing", path):
        dcp.save(state, storage_writer=writer)
    _on_rank0(lambda: _publish(path, name), path, rank, world)


@contextlib.contextmanager
def _checkpoint_errors(what: str, path: str):
    """torch.distributed.checkpoint reports failures as CheckpointException, a BaseException that a training
    loop's `except Exception` would not catch: raise a RuntimeError naming the path instead."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        raise RuntimeError(f"{what} {path!r} failed: {exc}") from exc


def _storage_writer(folder: str):
    from torch.distributed.checkpoint import FileSystemWriter

    return FileSystemWriter(folder)


def _version_number(name: str) -> Optional[int]:
    match = _VERSION_DIR.fullmatch(name)
    return int(match.group(1)) if match else None


def _next_version_name(path: str) -> str:
    numbers = [n for n in map(_version_number, os.listdir(path)) if n is not None]
    return f"state-{max(numbers, default=0) + 1:06d}"


def _publish(path: str, name: str) -> None:
    atomic_write(os.path.join(path, _LATEST), lambda f: f.write(name + "\n"), binary=False)
    for entry in os.listdir(path):
        if entry != name and _version_number(entry) is not None and os.path.isdir(os.path.join(path, entry)):
            shutil.rmtree(os.path.join(path, entry), ignore_errors=True)


def _latest_version(path: str) -> str:
    try:
        with open(os.path.join(path, _LATEST)) as f:
            name = f.read().strip()
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, "No complete checkpoint in this directory (no 'latest' file)",
                                path) from None
    if _version_number(name) is None or not os.path.isdir(os.path.join(path, name)):
        raise ValueError(f"path: {path!r} has a 'latest' file naming {name!r}, which is not a checkpoint folder")
    return os.path.join(path, name)


# ---------------------------------------------------------------- loading
def _read(path: str) -> dict:
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as exc:  # noqa: BLE001 - torch's messages do not all name the file
        raise RuntimeError(f"load_state: cannot read the checkpoint {path!r}: {exc}") from exc
    if not isinstance(payload, dict) or payload.get("format") != _FORMAT:
        raise ValueError(f"path: {path!r} is not a checkpoint written by accel.save_state")
    if payload.get("version") != _VERSION:
        raise ValueError(f"path: {path!r} has checkpoint version {payload.get('version')!r}; this accel reads "
                         f"version {_VERSION}")
    return payload


def load_state(path, model, optimizer=None, scaler=None, scheduler=None, dataloader=None) -> dict:
    """Restore what save_state saved, into objects built the same way as when it was saved.

    Every rank of a distributed run must call it. The world size may differ from the saved one for a
    sharded checkpoint (the shards are re-split); each rank restores its own saved RNG state where one was
    saved for its rank.

    Args:
        path: what save_state was given.
        model: the model (a sharded checkpoint also loads into an unsharded model).
        optimizer, scaler, scheduler: optional; each one given must have been saved.
        dataloader: optional; the loader (or a wrapper of it) whose position was saved. Its next pass is the
            rest of the interrupted one.

    Returns:
        the `extra` keyword arguments given to save_state, as a dict.

    Raises:
        TypeError: an argument of the wrong type (see save_state).
        FileNotFoundError: nothing at `path`, or a checkpoint directory without a complete version.
        ValueError: the checkpoint lacks a state that was asked for, a dataloader position saved at another
            world size, or a single-file checkpoint given to a sharded model.
        RuntimeError: the file cannot be read (e.g. corrupt).
    """
    path = _check_path(path)
    _check_model(model)
    for name, value in (("optimizer", optimizer), ("scaler", scaler), ("scheduler", scheduler)):
        _check_stateful(name, value)
    loader = _find_loader(dataloader)
    _wait(barrier=True)

    rank, world = _rank_world()
    module = unwrap_model(model)
    folder = None
    if os.path.isdir(path):
        folder = _latest_version(path)
        payload = _read(os.path.join(folder, _STATE_FILE))
    elif os.path.exists(path):
        payload = _read(path)
    else:
        raise FileNotFoundError(errno.ENOENT, "No such checkpoint", path)

    # Everything asked for is checked before anything is changed.
    saved_optimizer = payload.get("optimizer") is not None
    for name, value, present in (("optimizer", optimizer, saved_optimizer),
                                 ("scaler", scaler, payload["scaler"] is not None),
                                 ("scheduler", scheduler, payload["scheduler"] is not None)):
        if value is not None and not present:
            raise ValueError(f"{name}: the checkpoint at {path!r} holds no {name} state (saved without {name}=)")
    ranks = payload["ranks"]
    mine = ranks[rank] if rank < len(ranks) else None
    if loader is not None:
        if payload["world_size"] != world:
            raise ValueError(f"dataloader: the checkpoint at {path!r} was saved by {payload['world_size']} ranks, "
                             f"this run has {world}: the per-rank loader positions do not carry over; load without "
                             "dataloader= and start the epoch yourself")
        saved_loader = mine["dataloader"]
        if saved_loader is None:
            raise ValueError(f"dataloader: the checkpoint at {path!r} holds no loader position (saved without "
                             "dataloader=)")
        kind = "ResumableLoader" if isinstance(loader, ResumableLoader) else "state_dict"
        if saved_loader["kind"] != kind:
            raise ValueError(f"dataloader: the checkpoint holds a {saved_loader['kind']} state, the loader given "
                             f"is a {type(loader).__name__}")

    if payload["sharded"]:
        _load_sharded(folder, module, optimizer, payload)
    else:
        if is_sharded(module):
            raise ValueError(f"model: a sharded model, but {path!r} is a single-file checkpoint of an unsharded "
                             "model; load it into the unsharded model, then shard it")
        module.load_state_dict(payload["model"])
        if optimizer is not None:
            optimizer.load_state_dict(payload["optimizer"])
    if scaler is not None:
        scaler.load_state_dict(payload["scaler"])
    if scheduler is not None:
        scheduler.load_state_dict(payload["scheduler"])
    if loader is not None:
        loader.load_state_dict(mine["dataloader"]["state"])
    if payload["world_size"] != world and rank == 0:
        warnings.warn(f"load_state: {path!r} was saved by {payload['world_size']} ranks, this run has {world}; "
                      "ranks without a saved RNG state keep theirs", stacklevel=2)
    if mine is not None:
        _set_rng_state(mine["rng"])  # last: nothing after it draws from the restored streams
    return dict(payload["extra"])


def _load_sharded(folder: str, module: nn.Module, optimizer, payload: dict) -> None:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    if optimizer is not None and payload["optimizer"] == "sharded":
        model_state, optimizer_state = get_state_dict(module, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        _dcp_load(state, folder)
        set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        return
    state = {"model": get_model_state_dict(module)}
    _dcp_load(state, folder)
    set_model_state_dict(module, state["model"])
    if optimizer is not None:  # saved before its first step: only the hyper-parameters
        saved = payload["optimizer_param_groups"]
        if len(saved) != len(optimizer.param_groups):
            raise ValueError(f"optimizer: the checkpoint has {len(saved)} parameter groups, this optimizer "
                             f"{len(optimizer.param_groups)}")
        for group, values in zip(optimizer.param_groups, saved):
            group.update(values)


def _dcp_load(state: dict, folder: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    if dist.is_available() and dist.is_initialized():
        with _checkpoint_errors("load_state: reading", folder):
            dcp.load(state, storage_reader=FileSystemReader(folder))
        return
    with _checkpoint_errors("load_state: reading", folder), warnings.catch_warnings():
        # Without a process group one process reads every shard: what loading at world size 1 means.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=FileSystemReader(folder), no_dist=True)
