"""Say when Inductor runs a compiled graph without the CUDA graphs it was asked for.

mode="reduce-overhead" asks Inductor to replay each compiled graph as one CUDA graph. Where it cannot (an
input mutated outside the graph's pool, a CPU tensor, an op that cannot be captured, a graph re-recorded past
its limit, ...) it runs the graph's kernels one launch each instead, and says so only in a log: torch up to 2.12 writes it
to the "perf_hints" log, off unless TORCH_LOGS=perf_hints; 2.13 to its "cudagraphs" log, among a training
run's other log lines. A small step then becomes bound by the host's launches
(BERT-base at batch 32, seq 128 has some 500 kernels a step: ~10 ms of launches on a slow host against ~1 ms
of graph replays) and nothing tells the user why.

`watch()` listens to that log (every skip goes through torch._inductor.cudagraph_utils'
log_cudagraph_skip_and_bump_counter, which writes it to that module's artifact logger: "perf_hints" up to
torch 2.12, "cudagraphs" in 2.13; a handler on the logger itself hears it whatever the log settings) and warns
once per distinct reason with a CudaGraphSkipWarning; `reasons()` lists what it heard, for benchmarks to
record. accelerate() watches whenever it compiles with CUDA graphs.
"""
from __future__ import annotations

import importlib
import logging
import threading
import warnings

__all__ = ["CudaGraphSkipWarning", "reasons", "watch"]

_MODULE = "torch._inductor.cudagraph_utils"
# Its artifact loggers by the names torch 2.9-2.13 give them, where the module's globals show none.
_KNOWN_LOGGERS = (f"{_MODULE}.__perf_hints", f"{_MODULE}.__cudagraphs")
# The one other warning those loggers write: a graph recorded for many input sizes, which still replays.
_NOT_A_SKIP = "CUDAGraph supports dynamic shapes"
# A reason's first line names the cause; the rest is a stack trace of the user's code.
_MAX_CHARS = 400


class CudaGraphSkipWarning(UserWarning):
    """A compiled graph runs without the CUDA graphs asked for (one warning per distinct reason)."""


class _SkipHandler(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.heard: list[str] = []  # guarded by the handler's own lock, which handle() holds around emit()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a log record that cannot be formatted is not ours to raise
            return
        if message.startswith(_NOT_A_SKIP):
            return
        reason = _reason(message)
        new = reason not in self.heard
        self.heard.append(reason)
        if new:
            warnings.warn(f"accel: a compiled graph runs without CUDA graphs, one host launch per kernel: {reason}",
                          CudaGraphSkipWarning)


def _reason(message: str) -> str:
    """The cause (the message's first line) and, where Inductor gives the stack that led to it, its innermost
    frame: 'skipping cudagraphs due to mutated inputs (1 instances) [at File ".../x.py", line 9, in f: x.add_(1)]'."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return ""
    reason = lines[0].removesuffix("Found from :").rstrip(" .:")
    frames = [i for i, line in enumerate(lines) if line.startswith("File ")]
    if frames:
        last = frames[-1]
        code = lines[last + 1] if last + 1 < len(lines) and not lines[last + 1].startswith("File ") else ""
        reason += f" [at {lines[last]}" + (f": {code}]" if code else "]")
    return reason if len(reason) <= _MAX_CHARS else reason[:_MAX_CHARS - 3] + "..."


_handler: _SkipHandler | None = None
_install_lock = threading.Lock()


def _skip_loggers() -> list[logging.Logger]:
    """The artifact loggers of torch._inductor.cudagraph_utils (the skips go to one of them)."""
    try:
        module = importlib.import_module(_MODULE)
    except ImportError:  # a torch without Inductor has no CUDA graphs to skip
        return []
    found = {v.name: v for v in vars(module).values()
             if isinstance(v, logging.Logger) and v.name.startswith(f"{_MODULE}.__")}
    for name in _KNOWN_LOGGERS:
        found.setdefault(name, logging.getLogger(name))
    return list(found.values())


def watch() -> None:
    """Start listening (once per process; later calls change nothing)."""
    global _handler
    with _install_lock:
        if _handler is None:
            _handler = _SkipHandler()
            for logger in _skip_loggers():
                logger.addHandler(_handler)


def reasons() -> list[str]:
    """Every skip heard since watch() was first called, in order, one entry per skip (its cause and the
    innermost frame of the code that led to it, where Inductor gives one)."""
    if _handler is None:
        return []
    with _handler.lock:
        return list(_handler.heard)
