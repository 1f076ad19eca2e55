"""An opt-in recompilation guard: warns when a training loop keeps compiling after its first steps.

A compiled step is fast only while its input shapes stay the same: torch.compile(dynamic=False) and
PyTorch/XLA compile a new graph for every new shape. The guard records the shapes of each step's tensor
inputs and watches the compile counter; when the counter grows after the warm-up steps it warns once per
new cause, naming the input and the dimension that changed against the last step that did not compile:

    guard = RecompileGuard(warmup_steps=3)
    for batch in loader:
        loss = compiled_model(**batch)["loss"]
        ...
        xm.sync()                      # on XLA: compilations happen here
        guard.step(batch)              # RecompileWarning: ... batch['input_ids'] dim 1: 128 -> 131

or, hooking the module so that each forward call is a step:

    guard = guard_module(compiled_model, warmup_steps=3)      # compiled_model = torch.compile(model)
    ...
    guard.close()
    guard.save("recompiles.json")      # python tools/xla_report.py recompiles.json

The counters: on CUDA/CPU the number of graphs Dynamo compiled (torch._dynamo.utils.counters
["stats"]["unique_graphs"], which torch._dynamo.reset() leaves alone, unlike the compile callbacks it
clears); on XLA accel.xla.metrics()'s compile count, and each step that compiled is also added to
accel.xla.metrics().compilations. The guard reads shapes, dtypes and Python scalars only: no host sync.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import os
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Optional, Union

import torch

from accel.utils.atomic_file import atomic_write
from accel.utils.batch import _is_namedtuple, iter_tensors
from accel.utils.loader import LoaderWrapper
from accel.utils.xla import is_xla_tensor

BACKENDS = ("auto", "dynamo", "xla")
FORMAT = "accel.recompile_guard"
FORMAT_VERSION = 1

_NOT_GIVEN = object()
# Python scalars are recorded by value: Dynamo (dynamic=False) specialises a graph on them and XLA
# bakes them into the graph as constants, so a changed value recompiles just like a changed shape.
_SCALARS = (bool, int, float)


class RecompileWarning(UserWarning):
    """A compilation after the warm-up steps (one warning per distinct cause)."""


@dataclasses.dataclass(frozen=True)
class RecompileEvent:
    """One step during which the compile counter grew.

    Attributes:
        step: the guard's step number (1-based).
        count: how many graphs were compiled during the step.
        warmup: whether the step was a warm-up step (no warning is given there).
        cause: the changes, "; "-joined, e.g. "batch['input_ids'] dim 1: 128 -> 131", or a sentence
            saying that no input changed.
        changes: the same changes, one string per changed dimension, dtype, value or input.
        reference_step: the step the inputs were compared with (the last one that did not compile,
            else the step before), None at the first step.
        inputs: (path, shape, dtype) for each input of the step; shape is None and dtype is repr(value)
            for a Python scalar.
        compile_time_s: seconds spent compiling during the step (XLA only, else None).
    """

    step: int
    count: int
    warmup: bool
    cause: str
    changes: tuple = ()
    reference_step: Optional[int] = None
    inputs: tuple = ()
    compile_time_s: Optional[float] = None

    def to_dict(self) -> dict:
        """The event as JSON-ready built-ins (what save() writes).

        Returns:
            A dict with the attributes above; inputs become {"path", "shape", "dtype"} dicts.
        """
        out = dataclasses.asdict(self)
        out["changes"] = list(self.changes)
        out["inputs"] = [
            {"path": path, "shape": None if shape is None else list(shape), "dtype": dtype}
            for path, shape, dtype in self.inputs
        ]
        return out


def flatten_inputs(obj: Any, path: str, out: dict) -> None:
    """Record obj's tensors (shape, dtype) and Python scalars (None, value) in `out`, keyed by path.

    The containers and their order follow accel.utils.batch.map_tensors (mappings such as BatchEncoding,
    namedtuples, lists/tuples, dataclasses); it cannot be reused because it does not say where in the
    batch a tensor sits, and the path is what the warning names.
    """
    if isinstance(obj, torch.Tensor):
        # torch.Size is an immutable tuple: storing it costs no copy and reads no device memory.
        out[path] = (obj.shape, obj.dtype)
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            flatten_inputs(value, f"{path}[{key!r}]", out)
    elif _is_namedtuple(obj):
        for field, value in zip(obj._fields, obj):
            flatten_inputs(value, f"{path}.{field}", out)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            flatten_inputs(value, f"{path}[{i}]", out)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            flatten_inputs(getattr(obj, f.name), f"{path}.{f.name}", out)
    elif type(obj) in _SCALARS:
        out[path] = (None, obj)


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _fmt(entry) -> str:
    shape, value = entry
    if shape is None:
        return repr(value)
    return f"tensor {tuple(shape)} {_dtype_name(value)}"


def _same(before, after) -> bool:
    if (before[0] is None) != (after[0] is None):
        return False
    if before[0] is None:
        # 1 == 1.0 == True in Python, but Dynamo guards on the type too.
        return type(before[1]) is type(after[1]) and before[1] == after[1]
    return before == after


def _changes(before: dict, after: dict) -> list:
    """What differs between two snapshots, one string per changed dimension/dtype/value/input."""
    out = []
    for path, now in after.items():
        if path not in before:
            out.append(f"{path}: new input, {_fmt(now)}")
            continue
        was = before[path]
        if _same(was, now):
            continue
        if was[0] is not None and now[0] is not None:
            if len(was[0]) != len(now[0]):
                out.append(f"{path} shape: {tuple(was[0])} -> {tuple(now[0])}")
            else:
                out.extend(
                    f"{path} dim {d}: {a} -> {b}" for d, (a, b) in enumerate(zip(was[0], now[0])) if a != b
                )
            if was[1] != now[1]:
                out.append(f"{path} dtype: {_dtype_name(was[1])} -> {_dtype_name(now[1])}")
        else:
            out.append(f"{path}: {_fmt(was)} -> {_fmt(now)}")
    for path, was in before.items():
        if path not in after:
            out.append(f"{path}: no longer passed (was {_fmt(was)})")
    return out


def _event_inputs(snapshot: dict) -> tuple:
    return tuple(
        (path, None, repr(value)) if shape is None else (path, tuple(int(d) for d in shape), _dtype_name(value))
        for path, (shape, value) in snapshot.items()
    )


_UNEXPLAINED = {
    "dynamo": "no input shape, dtype or Python value changed; the recompilation has another cause "
    "(a global, a module attribute, grad mode; TORCH_LOGS=recompiles names the failed guard)",
    "xla": "no input shape, dtype or Python value changed; the traced graph differs for another reason "
    "(a different code path, a host read such as .item() or print() cutting the graph)",
    "custom": "no input shape, dtype or Python value changed; the recompilation has another cause",
}


def _dynamo_compiles() -> tuple:
    if "torch._dynamo" not in sys.modules:
        return 0, None  # torch.compile has not run in this process yet, so nothing was compiled
    from torch._dynamo.utils import counters

    # .get, not [...]: counters is a defaultdict and reading must not add keys to it.
    return int(counters.get("stats", {}).get("unique_graphs", 0)), None


def _xla_compiles() -> tuple:
    if "torch_xla" not in sys.modules:
        return 0, 0.0  # the XLA runtime has not been loaded, so nothing was compiled
    # Imported here so that the CUDA path does not load accel.xla at all.
    from accel.xla._metrics import metrics

    # wait=False: compilations happen inside sync() itself, so the count is exact without waiting
    # for the device (waiting would be a host sync every step).
    m = metrics(wait=False)
    return m.compiles, m.compile_time_s


def _positional_names(module: torch.nn.Module) -> list:
    """The names of forward's positional parameters, so that args[0] is reported as e.g. `input_ids`."""
    # torch.compile(model) returns an OptimizedModule whose forward takes (*args, **kwargs).
    target = getattr(module, "_orig_mod", module)
    try:
        params = inspect.signature(target.forward).parameters.values()
    except (TypeError, ValueError):  # builtins or C-implemented forwards have no signature
        return []
    names = []
    for p in params:
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            break
        names.append(p.name)
    return names


class RecompileGuard:
    """Watches a loop's compile count and warns when it grows after the warm-up steps.

    Each step is closed by step() (or, after attach(), by the next forward call): the compilations
    since the previous step are attributed to the inputs of the step being closed. A step that
    compiled after warm-up is compared with the last step that did not compile, and the warning names
    each input path and dimension that changed, once per distinct cause. Usable as a context manager
    (close() on exit).

    Args:
        warmup_steps: steps during which compiling is expected (the first step always compiles; on XLA
            the second often does too, when optimizer state appears). Must be >= 1.
        backend: which compile counter to read: "dynamo" (torch.compile), "xla" (PyTorch/XLA), "auto"
            (XLA when the first step has a tensor on an XLA device, else Dynamo), or a callable returning
            the current cumulative compile count.
        name: how the inputs given to step()/observe() are named in messages, e.g. "batch".
        warn: emit a RecompileWarning (else only record events for report()).
        max_events: how many events report() keeps; later ones are counted in dropped_events.

    Raises:
        ValueError: an argument is invalid; the message names it.
    """

    def __init__(
        self,
        warmup_steps: int = 3,
        *,
        backend: Union[str, Callable[[], int]] = "auto",
        name: str = "batch",
        warn: bool = True,
        max_events: int = 1000,
    ):
        if not isinstance(warmup_steps, int) or isinstance(warmup_steps, bool) or warmup_steps < 1:
            raise ValueError(
                f"warmup_steps must be an int >= 1 (the first step always compiles), got {warmup_steps!r}"
            )
        if not callable(backend) and backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS} or a callable returning a count, got {backend!r}")
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string, got {name!r}")
        if not isinstance(warn, bool):
            raise ValueError(f"warn must be a bool, got {warn!r}")
        if not isinstance(max_events, int) or isinstance(max_events, bool) or max_events < 1:
            raise ValueError(f"max_events must be an int >= 1, got {max_events!r}")
        self.warmup_steps = warmup_steps
        self.name = name
        self.warn = warn
        self.max_events = max_events
        self.dropped_events = 0
        self._custom = backend if callable(backend) else None
        self._backend = "custom" if callable(backend) else backend
        # Both baselines now, before the first step's work: "auto" only learns which counter it needs
        # when it sees the first step's inputs, after that step may already have compiled.
        if self._custom is not None:
            self._last_count, self._last_time = self._read_custom(), None
            self._baselines = {}
        else:
            self._baselines = {"dynamo": _dynamo_compiles(), "xla": _xla_compiles()}
            if self._backend != "auto":
                self._last_count, self._last_time = self._baselines[self._backend]
        self._steps = 0
        self._compiles = 0
        self._events: list = []
        self._warned: set = set()
        self._pending: Optional[dict] = None
        self._pending_has_xla = False
        self._previous: Optional[tuple] = None  # (step, snapshot) of the step before
        self._clean: Optional[tuple] = None  # (step, snapshot) of the last step that did not compile
        self._handles: list = []

    # -- public API ---------------------------------------------------------------------------

    @property
    def backend(self) -> str:
        """The counter in use: "dynamo", "xla", "custom", or "auto" until the first step is closed."""
        return self._backend

    @property
    def steps(self) -> int:
        """How many steps were closed."""
        return self._steps

    @property
    def compiles(self) -> int:
        """Compilations counted over the closed steps (warm-up included)."""
        return self._compiles

    def observe(self, inputs: Any) -> None:
        """Record the inputs of the current step (their shapes, dtypes and Python scalars only).

        Args:
            inputs: a tensor or a nested batch (dicts, lists, tuples, namedtuples, dataclasses, BatchEncoding).
        """
        snapshot: dict = {}
        flatten_inputs(inputs, self.name, snapshot)
        self._set_pending(snapshot, inputs)

    def step(self, inputs: Any = _NOT_GIVEN) -> Optional[RecompileEvent]:
        """Close the current step: attribute the compilations since the previous step to its inputs.

        Call it once per step after the step's work (on XLA after sync(), where compilation happens).

        Args:
            inputs: the step's inputs (as for observe()); omit when observe() or an attached module's
                forward call already recorded them.

        Returns:
            The RecompileEvent when the step compiled, else None.
        """
        if inputs is not _NOT_GIVEN:
            self.observe(inputs)
        snapshot = self._pending if self._pending is not None else {}
        self._pending = None
        return self._close(snapshot)

    def attach(self, module: torch.nn.Module) -> "RecompileGuard":
        """Observe every forward call of `module`; each call closes the previous one as a step.

        For torch.compile(model), attach the returned module: its hooks run outside the compiled code.
        The last call stays open until step() or close().

        Args:
            module: the module called once per step.

        Returns:
            self.

        Raises:
            ValueError: module is not an nn.Module, was compiled in place with module.compile() (its hooks
                would be traced into the graph), or this guard already watches a module.
        """
        if not isinstance(module, torch.nn.Module):
            raise ValueError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if getattr(module, "_compiled_call_impl", None) is not None:
            raise ValueError(
                "module was compiled in place with module.compile(), so its hooks run inside the compiled "
                "code where the guard cannot observe them: attach torch.compile(module)'s result instead, "
                "or call guard.step(inputs) from the loop"
            )
        if self._handles:
            raise ValueError("module: this guard already watches a module; use one guard per module")
        names = _positional_names(module)
        training_path = f"{type(getattr(module, '_orig_mod', module)).__name__}.training"

        def pre_hook(mod, args, kwargs):
            # Inside a compiled region the hook would be traced into the graph (and read nothing real).
            if torch.compiler.is_compiling():
                return None
            if self._pending is not None:
                self._close(self._pending)
                self._pending = None
            snapshot: dict = {}
            for i, value in enumerate(args):
                flatten_inputs(value, names[i] if i < len(names) else f"args[{i}]", snapshot)
            for key, value in kwargs.items():
                flatten_inputs(value, key, snapshot)
            # Dynamo guards on both: an eval pass under no_grad recompiles, and the warning should say so.
            snapshot["torch.is_grad_enabled()"] = (None, torch.is_grad_enabled())
            # The wrapped model's flag: OptimizedModule keeps a .training of its own.
            snapshot[training_path] = (None, getattr(mod, "_orig_mod", mod).training)
            self._set_pending(snapshot, (args, kwargs))
            return None

        self._handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
        return self

    def close(self) -> None:
        """Close the step still open (the last forward call of an attached module) and detach."""
        if self._pending is not None:
            self.step()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def report(self) -> list:
        """The steps that compiled, warm-up included, oldest first.

        Returns:
            A list of RecompileEvent (at most max_events; see dropped_events).
        """
        return list(self._events)

    def to_dict(self) -> dict:
        """The guard's state as JSON-ready built-ins (what save() writes and tools/xla_report.py reads).

        Returns:
            {"format", "version", "name", "backend", "warmup_steps", "steps", "compiles",
            "dropped_events", "events": [RecompileEvent.to_dict(), ...]}.
        """
        return {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "name": self.name,
            "backend": self._backend,
            "warmup_steps": self.warmup_steps,
            "steps": self._steps,
            "compiles": self._compiles,
            "dropped_events": self.dropped_events,
            "events": [e.to_dict() for e in self._events],
        }

    def save(self, path: Union[str, os.PathLike]) -> None:
        """Write to_dict() as JSON, atomically (a temporary file in the same folder, then a rename).

        Args:
            path: the JSON file to write; its folder must exist.

        Raises:
            ValueError: path is not a str or os.PathLike.
        """
        if not isinstance(path, (str, os.PathLike)):
            raise ValueError(f"path must be a str or os.PathLike, got {type(path).__name__}")
        # A reader (or a crash) sees either the old file or the complete new one, never half of one.
        atomic_write(path, lambda f: json.dump(self.to_dict(), f, indent=1), binary=False)

    def __enter__(self) -> "RecompileGuard":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------

    def _read_custom(self) -> int:
        count = self._custom()
        if not isinstance(count, int) or isinstance(count, bool):
            raise ValueError(f"backend: the counter callable must return an int, got {count!r}")
        return count

    def _set_pending(self, snapshot: dict, inputs: Any) -> None:
        self._pending = snapshot
        if self._backend == "auto" and not self._pending_has_xla:
            # Only until the backend is resolved at the first closed step; later steps skip this walk.
            self._pending_has_xla = any(is_xla_tensor(t) for t in iter_tensors(inputs))

    def _read(self) -> tuple:
        if self._backend == "auto":
            self._backend = "xla" if self._pending_has_xla else "dynamo"
            self._last_count, self._last_time = self._baselines[self._backend]
        if self._backend == "custom":
            return self._read_custom(), None
        return _dynamo_compiles() if self._backend == "dynamo" else _xla_compiles()

    def _reference(self) -> Optional[tuple]:
        return self._clean if self._clean is not None else self._previous

    def _close(self, snapshot: dict) -> Optional[RecompileEvent]:
        count, seconds = self._read()
        # A smaller count means the counters were cleared (clear_metrics(), counters.clear()): all of
        # the current count happened since.
        delta = count - self._last_count if count >= self._last_count else count
        spent = None
        if seconds is not None:
            spent = seconds - self._last_time if self._last_time is not None and seconds >= self._last_time else seconds
        self._last_count, self._last_time = count, seconds
        self._steps += 1
        step = self._steps
        event = None
        if delta > 0:
            self._compiles += delta
            event = self._record(step, delta, snapshot, spent)
        else:
            self._clean = (step, snapshot)
        self._previous = (step, snapshot)
        return event

    def _record(self, step: int, count: int, snapshot: dict, seconds: Optional[float]) -> RecompileEvent:
        reference = self._reference()
        warmup = step <= self.warmup_steps
        if reference is None:
            changes, cause = (), "first step"
        else:
            changes = tuple(_changes(reference[1], snapshot))
            cause = "; ".join(changes) if changes else _UNEXPLAINED[self._backend]
        event = RecompileEvent(
            step=step,
            count=count,
            warmup=warmup,
            cause=cause,
            changes=changes,
            reference_step=None if reference is None else reference[0],
            inputs=_event_inputs(snapshot),
            compile_time_s=seconds,
        )
        if len(self._events) < self.max_events:
            self._events.append(event)
        else:
            self.dropped_events += 1
        if self._backend == "xla":
            from accel.xla._metrics import XlaCompilation, record_compilation

            record_compilation(
                XlaCompilation(step=step, count=count, warmup=warmup, cause=cause, inputs=event.inputs, guard=self.name)
            )
        if self.warn and not warmup and cause not in self._warned:
            self._warned.add(cause)
            warnings.warn(self._message(event, reference), RecompileWarning, stacklevel=4)
        return event

    def _message(self, event: RecompileEvent, reference: Optional[tuple]) -> str:
        if reference is None:
            against = ""
        elif reference is self._clean:
            against = f" (compared with step {reference[0]}, the last step that did not compile)"
        else:
            against = f" (compared with step {reference[0]}; every step so far compiled)"
        return (
            f"RecompileGuard({self.name!r}): {event.count} new compilation(s) at step {event.step}, after "
            f"{self.warmup_steps} warm-up step(s): {event.cause}{against}. Each new shape compiles a new "
            f"graph; pad or bucket inputs to a few fixed sizes (accel.data bucketing) to stop it."
        )


def guard_module(
    module: torch.nn.Module,
    warmup_steps: int = 3,
    *,
    backend: Union[str, Callable[[], int]] = "auto",
    warn: bool = True,
    max_events: int = 1000,
) -> RecompileGuard:
    """A RecompileGuard attached to `module`: each forward call is one step.

    Args:
        module: the module the loop calls once per step (for torch.compile, the module it returned).
        warmup_steps: forward calls during which compiling is expected (>= 1).
        backend: "auto", "dynamo", "xla" or a callable returning a compile count (see RecompileGuard).
        warn: emit RecompileWarning (else only record events).
        max_events: how many events report() keeps.

    Returns:
        The attached guard; call close() (or use it as a context manager) to settle the last call.

    Raises:
        ValueError: an argument is invalid; the message names it.
    """
    if not isinstance(module, torch.nn.Module):
        raise ValueError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    name = type(getattr(module, "_orig_mod", module)).__name__
    guard = RecompileGuard(warmup_steps, backend=backend, name=name, warn=warn, max_events=max_events)
    return guard.attach(module)


__all__ = ["RecompileEvent", "RecompileGuard", "RecompileWarning", "guard_module"]


class GuardedLoader(LoaderWrapper):
    """Iterate `loader` with one guard step per batch, for loops that only iterate (accelerate()'s loader).

    Batch k's shapes are recorded when it is handed out, and its step is closed when batch k+1 is asked
    for: by then its forward, backward and optimizer step (and on XLA the sync) have run, so the
    compilations they caused are counted against it. The last batch's step closes when the pass ends.
    """

    def __init__(self, loader, guard: RecompileGuard):
        if not isinstance(guard, RecompileGuard):
            raise ValueError(f"guard: expected a RecompileGuard, got {type(guard).__name__}")
        super().__init__(loader)
        self.recompile_guard = guard

    def __iter__(self):
        open_step = False
        for batch in self.loader:
            if open_step:
                self.recompile_guard.step()
            self.recompile_guard.observe(batch)
            open_step = True
            yield batch
        if open_step:
            self.recompile_guard.step()
