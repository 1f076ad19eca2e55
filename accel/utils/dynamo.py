"""Dynamo settings accel needs: the recompile limit, raised where one function legitimately compiles for many
inputs, and guards on modules' hooks."""
from __future__ import annotations


def _raise_limit(to) -> None:
    """Set the limit to to(current): `recompile_limit` on torch >= 2.6, `cache_size_limit` before."""
    import torch._dynamo

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            current = getattr(torch._dynamo.config, name)
            setattr(torch._dynamo.config, name, max(current, to(current)))
            return


def allow_recompiles(n: int) -> None:
    """Let each function (each code object: closures of one lambda share it) keep at least `n` compiled
    graphs. Past Dynamo's limit (8 by default) a call runs eagerly without a word: a benchmark that
    compiles one code object for several sizes, dtypes or closures then times eager code for some of them.
    Never lowers a limit the user set."""
    _raise_limit(lambda current: n)


def make_room_for_recompiles(n: int) -> None:
    """Raise each function's recompile limit by `n` graphs (never lower it): room for one more model's graphs.

    Dynamo keeps graphs on the code object it compiles, shared by every model of a class (transformers'
    forward wrappers: by every model); a model built like one before runs its graphs, any other adds entries
    (another config, shapes, dtypes). The limit counts them all, the entries of models long gone included: in a
    process that accelerates model after model (a sweep, cross-validation, a notebook cell run again, a test
    suite) the ninth model ran uncompiled, with no more than a log line. Each accelerate() adds room for its own
    graphs instead of setting a fixed limit (allow_recompiles).
    """
    _raise_limit(lambda current: current + int(n))


def guard_module_hooks() -> None:
    """Make Dynamo check modules' hooks before it runs a compiled graph (skip_nnmodule_hook_guards off).

    By default Dynamo assumes no hook is added to or removed from a module once a graph was compiled through it:
    a forward hook registered later (a probe, a logger), or on a model built like one compiled before (which
    runs that model's graphs), never ran, without a word. With the guards an empty hook dict is checked by its
    length at each call (a few microseconds a call for a BERT-base), and a changed one compiles anew.
    """
    import torch._dynamo

    torch._dynamo.config.skip_nnmodule_hook_guards = False
