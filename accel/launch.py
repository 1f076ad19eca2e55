"""xlarun: torchrun for accel's XLA path.

    xlarun --nproc_per_node=8 train.py --lr 1e-3
    python -m accel.launch --nnodes=2 --node_rank=0 --master_addr=... train.py
    xlarun --compile-cache /scratch/xla-cache --nproc_per_node=8 train.py
    xlarun --no-compile-cache --nproc_per_node=8 train.py

Every torchrun flag is accepted (we delegate to torch.distributed.run's own parser and
launcher). Before the workers start we set what torch_xla needs in each of them:
PJRT_DEVICE (TPU when one is attached, else CPU; a value the user set is kept), and one
CPU device per process, because CPU_NUM_DEVICES > 1 under several processes makes the
PJRT CPU client abort in its rendezvous.

Persistent compile cache (xlarun's own flags, given before the script like torchrun's):
``--compile-cache DIR`` (e.g. ~/.cache/accel/xla; $ACCEL_XLA_COMPILE_CACHE=DIR does the same) and
``--no-compile-cache`` (also overrides the variable). Each worker keeps its compiled graphs in
DIR/rank<RANK>. Off unless asked for: with torch_xla 2.9 it cannot speed anything up (below),
and a feature that does not win stays off by default. torch_xla's cache writes entries in place, without a temporary
file, so two processes sharing one folder can read each other's half-written entries.

How it reaches the workers: torch_xla creates its computation cache at the first compile
and reads XLA_PERSISTENT_CACHE_PATH / XLA_PERSISTENT_CACHE_READ_ONLY at that moment
(torch_xla.runtime.initialize_cache only sets these two variables). The per-rank value
cannot come from xlarun's environment, which every rank shares and which is fixed before
ranks are assigned, so xlarun starts each worker as ``python .../accel/launch.py`` in a
worker mode that sets both variables from its RANK, then runs the script in the same process
with runpy as ``python script.py`` would (sys.argv, sys.path[0], __main__). That covers scripts
that use torch_xla without accel, and imports neither torch nor accel before the script (this
file runs as a plain file for that reason: its imports must stay stdlib-only). Under
--no-python or --run-path there is no Python command line to take over; there
ACCEL_XLA_COMPILE_CACHE=DIR is what the workers get, and accel.xla.xla_device() starts the
cache on first use (scripts calling torch_xla directly run without one). Setting
ACCEL_XLA_COMPILE_CACHE=DIR for any other launcher does the same.

A user's own XLA_PERSISTENT_CACHE_PATH is kept unless --compile-cache is given.

torch_xla 2.9 writes the entries but its PJRT client cannot load them back on CPU, TPU or
GPU ("Deserializing serialized executable not supported", pytorch/xla#9094): the next run
finds each entry, fails to load it and compiles again. accel.xla.metrics() counts loads
(persistent_cache_hits) and such failures (persistent_cache_load_failures).
"""
from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from collections.abc import Mapping, MutableMapping

CACHE_ENV = "ACCEL_XLA_COMPILE_CACHE"
XLA_CACHE_PATH = "XLA_PERSISTENT_CACHE_PATH"
XLA_CACHE_READ_ONLY = "XLA_PERSISTENT_CACHE_READ_ONLY"
# First argument of the command xlarun gives torchrun for each worker; users never type it.
_WORKER_FLAG = "--accel-xla-worker"


def _tpu_attached() -> bool:
    return bool(os.environ.get("TPU_NAME")) or os.path.exists("/dev/accel0") or (
        importlib.util.find_spec("libtpu") is not None
    )


def _several_processes(nproc_per_node) -> bool:
    try:
        return int(nproc_per_node) > 1
    except (TypeError, ValueError):  # "auto", "cpu", "gpu": torchrun decides; assume several
        return True


def prepare_environment(nproc_per_node, env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set the torch_xla variables the workers inherit; returns what was set."""
    env = os.environ if env is None else env
    changed: dict[str, str] = {}
    if not env.get("PJRT_DEVICE"):
        changed["PJRT_DEVICE"] = "TPU" if _tpu_attached() else "CPU"
    device = changed.get("PJRT_DEVICE", env.get("PJRT_DEVICE"))
    if device == "CPU" and _several_processes(nproc_per_node):
        user_value = env.get("CPU_NUM_DEVICES")
        if user_value is None:
            changed["CPU_NUM_DEVICES"] = "1"
        elif user_value != "1":
            warnings.warn(
                f"CPU_NUM_DEVICES={user_value} with several processes per node: the PJRT CPU client "
                "times out in its rendezvous in that setup. Use one device per process, or SPMD "
                "(accel.xla.spmd) in a single process.",
                RuntimeWarning,
                stacklevel=2,
            )
    env.update(changed)
    return changed


# ---------------------------------------------------------------------------------------------
# Persistent compile cache


def rank_cache_dir(root: str, env: Mapping[str, str] | None = None) -> str:
    """DIR/rank<RANK>: this process's folder (rank 0 outside a launcher)."""
    env = os.environ if env is None else env
    return os.path.join(root, f"rank{env.get('RANK') or '0'}")


def _writable(path: str) -> bool:
    # access() reports a read-only mount even to root, whom permission bits never stop.
    return os.access(path, os.W_OK | os.X_OK)


def _cache_dir_state(path: str) -> tuple[str | None, str]:
    """("write" | "read" | None, why not) for a cache folder, creating nothing."""
    path = os.path.abspath(path)
    if os.path.isdir(path):
        if _writable(path):
            return "write", ""
        if os.access(path, os.R_OK | os.X_OK):
            return "read", f"{path} is not writable"
        return None, f"{path} is neither writable nor readable"
    parent = path
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if os.path.isdir(parent) and _writable(parent):
        return "write", ""
    return None, f"cannot create {path} ({parent} is {'read-only' if os.path.isdir(parent) else 'a file'})"


def open_cache_dir(path: str) -> tuple[str, bool] | None:
    """(path, read_only) when torch_xla can use `path` as its cache folder, else None.

    The folder is created here: torch_xla would create it at its first compile, and a failure
    there is an error in the training step. An existing folder we cannot write to is still read:
    a cache prepared elsewhere and mounted read-only serves its entries. Problems are warnings,
    since a run without a cache only compiles more.
    """
    state, why = _cache_dir_state(path)
    if state == "write":
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            state, why = None, f"cannot create {path} ({exc.strerror or exc})"
    if state == "read":
        warnings.warn(f"accel: XLA compile cache: {why}; reusing its entries, adding none.",
                      RuntimeWarning, stacklevel=2)
    elif state is None:
        warnings.warn(f"accel: XLA compile cache off: {why}.", RuntimeWarning, stacklevel=2)
        return None
    return path, state == "read"


def prepare_compile_cache(cache_dir: str | None, explicit: bool = False,
                          env: MutableMapping[str, str] | None = None) -> bool:
    """Tell the workers where their caches go (CACHE_ENV); returns whether there is one.

    cache_dir None turns the cache off, the user's XLA_PERSISTENT_CACHE_PATH included. An
    inherited XLA_PERSISTENT_CACHE_PATH is left to torch_xla unless `explicit` (the user
    gave --compile-cache).
    """
    env = os.environ if env is None else env
    off = cache_dir is None
    if not off and env.get(XLA_CACHE_PATH) and not explicit:
        env.pop(CACHE_ENV, None)
        return False
    if not off:
        state, why = _cache_dir_state(cache_dir)
        if state is None:
            # One message from the launcher rather than one per worker.
            warnings.warn(f"xlarun: XLA compile cache off: {why}.", RuntimeWarning, stacklevel=2)
            off = True
    if off:
        for key in (CACHE_ENV, XLA_CACHE_PATH, XLA_CACHE_READ_ONLY):
            env.pop(key, None)
        return False
    env[CACHE_ENV] = cache_dir
    # Each worker sets its own per-rank value; an inherited one would win in accel.xla.
    env.pop(XLA_CACHE_PATH, None)
    env.pop(XLA_CACHE_READ_ONLY, None)
    return True


def set_worker_cache_env(env: MutableMapping[str, str] | None = None) -> str | None:
    """In a worker: point torch_xla at CACHE_ENV/rank<RANK>; returns the folder, or None."""
    env = os.environ if env is None else env
    root = env.get(CACHE_ENV)
    if not root:
        return None
    opened = open_cache_dir(rank_cache_dir(root, env))
    if opened is None:
        return None
    path, read_only = opened
    env[XLA_CACHE_PATH] = path
    env[XLA_CACHE_READ_ONLY] = "1" if read_only else "0"
    return path


def _run_worker(argv: list[str]) -> None:
    """Worker mode: cache variables for this rank, then the user's script as its own __main__."""
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        raise SystemExit("xlarun worker mode needs a script or -m module")
    module = argv[0] == "-m"
    if not getattr(sys.flags, "safe_path", False):
        # sys.path[0] is this file's folder (accel/, whose torch_xla shim must not shadow the real
        # one); make it what `python -m mod` or `python script.py` would have put there.
        sys.path[0] = os.getcwd() if module else os.path.dirname(os.path.realpath(argv[0]))
    import runpy

    set_worker_cache_env()
    if module:
        sys.argv = argv[1:]  # run_module puts the module's file in argv[0], as python -m does
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")


def _route_through_worker_mode(args) -> bool:
    """Make torchrun start `python -u .../accel/launch.py --accel-xla-worker [-m] script args...`."""
    if args.no_python or args.run_path or not getattr(args, "use_env", True):
        return False
    prefix = [_WORKER_FLAG] + (["-m"] if args.module else [])
    args.training_script_args = [*prefix, args.training_script, *args.training_script_args]
    args.training_script = os.path.abspath(__file__)
    args.module = False
    return True


# ---------------------------------------------------------------------------------------------


def get_args_parser():
    """torchrun's parser plus xlarun's flags (both only before the script: what follows it is the script's)."""
    from torch.distributed.run import get_args_parser as torchrun_args_parser

    parser = torchrun_args_parser()
    parser.prog = "xlarun"
    group = parser.add_argument_group("xlarun")
    cache = group.add_mutually_exclusive_group()
    cache.add_argument(
        "--compile-cache", "--compile_cache", metavar="DIR", default=None,
        help=f"keep compiled XLA graphs in DIR/rank<RANK> across runs (e.g. ~/.cache/accel/xla; default: "
             f"${CACHE_ENV} if set, else no cache)",
    )
    cache.add_argument("--no-compile-cache", "--no_compile_cache", action="store_true",
                       help="no persistent XLA compile cache")
    return parser


def parse_args(argv: list[str]):
    """(torchrun's namespace, compile-cache folder or None, whether --compile-cache was given)."""
    args = get_args_parser().parse_args(argv)
    given, off = args.compile_cache, args.no_compile_cache
    del args.compile_cache, args.no_compile_cache  # torchrun's namespace stays as torchrun makes it
    if off:
        return args, None, False
    cache_dir = given or os.environ.get(CACHE_ENV)
    if not cache_dir:
        return args, None, False
    return args, os.path.abspath(os.path.expanduser(cache_dir)), given is not None


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == [_WORKER_FLAG]:
        _run_worker(argv[1:])
        return
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.run import run

    args, cache_dir, explicit = parse_args(argv)
    prepare_environment(args.nproc_per_node)
    if prepare_compile_cache(cache_dir, explicit):
        _route_through_worker_mode(args)
    record(run)(args)


if __name__ == "__main__":
    main()
