"""Dynamo's recompile limit, raised where one function legitimately compiles for many inputs."""
from __future__ import annotations


def allow_recompiles(n: int) -> None:
    """Let each function (each code object: closures of one lambda share it) keep at least `n` compiled
    graphs. Past Dynamo's limit (8 by default) a call runs eagerly without a word: a benchmark that
    compiles one code object for several sizes, dtypes or closures then times eager code for some of them.
    Never lowers a limit the user set; `recompile_limit` on torch >= 2.6, `cache_size_limit` before."""
    import torch._dynamo

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), n))
            return
