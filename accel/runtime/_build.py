"""Build and load the kernels in csrc/: one extension per op, named after the op.

Each op `<op>` is csrc/cpu/<op>.cpp (C++ kernels, plus the torch.library schema of its ops) and,
where torch sees a GPU, csrc/cuda/<op>.cu, linked with csrc/bindings.cpp into a pybind11 module.
Loading the module registers the ops as torch.ops.accel.*.

Order of preference: a module built ahead of time by `ACCEL_BUILD_EXT=1 pip install .`
(accel._ext.<op>), else a JIT build through torch.utils.cpp_extension + ninja, cached under
$ACCEL_EXT_DIR (default ~/.cache/accel/ext/), in a folder per torch version, CPU instruction set and
GPU architecture (machine_tag), and rebuilt when a source changes.

Processes that share a cache (torchrun ranks, jobs on one home directory) build each op once: the
first takes an OS file lock on <build dir>/accel.lock and builds, the others wait for it and then
load the result. The OS drops that lock when its holder dies, so a build killed half-way never
blocks later runs; see `_build_lock`.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import os
import platform
import shutil
import socket
import sys
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Callable, Iterator

import torch

try:
    import fcntl
except ImportError:  # not POSIX (Windows): no cross-process lock of our own, see _build_lock
    fcntl = None

_lock = threading.RLock()


def csrc_dir() -> Path:
    """The csrc/ tree: the repository's in a source checkout, the packaged copy otherwise."""
    repo = Path(__file__).resolve().parents[2] / "csrc"
    if (repo / "bindings.cpp").exists():
        return repo
    packaged = Path(__file__).resolve().parents[1] / "_csrc"
    if (packaged / "bindings.cpp").exists():
        return packaged
    raise RuntimeError(f"accel: kernel sources not found (looked in {repo} and {packaged})")


def with_cuda() -> bool:
    # torch 2.9 from PyPI is a CUDA build even on machines without a GPU, where its CUDA
    # runtime cannot be linked against by the local nvcc: build CUDA sources only with a GPU.
    return torch.cuda.is_available() and torch.version.cuda is not None


def cpu_features() -> str:
    """The CPU's instruction-set flags line (Linux x86 "flags", Arm "Features"), else the architecture."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), platform.machine())
    except OSError:
        return platform.machine()


@functools.cache
def machine_tag() -> str:
    """What a build is specific to besides its sources: the torch version, the CPU's instruction set
    (JIT builds use -march=native, so a cache shared between hosts, e.g. a home directory on a cluster,
    must not hand an AVX-512 build to an older CPU) and, with CUDA, the GPU's compute capability."""
    tag = torch.__version__.replace("+", "_") + "_" + hashlib.sha256(cpu_features().encode()).hexdigest()[:8]
    if with_cuda():
        major, minor = torch.cuda.get_device_capability()
        return f"{tag}_cuda_sm{major}{minor}"
    return tag + "_cpu"


def build_dir(op: str) -> Path:
    root = os.environ.get("ACCEL_EXT_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "accel", "ext")
    path = Path(root) / machine_tag() / op
    path.mkdir(parents=True, exist_ok=True)
    return path


def op_names() -> list[str]:
    """Every op in csrc/: one per csrc/cpu/<op>.cpp."""
    return sorted(p.stem for p in (csrc_dir() / "cpu").glob("*.cpp"))


def sources(op: str, cuda: bool | None = None) -> list[str]:
    """The sources of `op`'s extension; its CUDA file when `cuda` (default: when torch sees a GPU)."""
    root = csrc_dir()
    cpp = root / "cpu" / f"{op}.cpp"
    if not cpp.exists():
        raise ValueError(f"op: no C++ source for {op!r} (expected {cpp})")
    srcs = [root / "bindings.cpp", cpp]
    # the op's autograd in C++, where it has one (named apart: cpp_extension's JIT build puts every
    # object file in one folder, so two <op>.cpp would collide)
    autograd = root / "autograd" / f"{op}_autograd.cpp"
    if autograd.exists():
        srcs.append(autograd)
    cu = root / "cuda" / f"{op}.cu"
    if (with_cuda() if cuda is None else cuda) and cu.exists():
        srcs.append(cu)
    return [str(s) for s in srcs]


_loaded: dict[str, bool] = {}


def ops(op: str, register: Callable[[], None] | None = None):
    """torch.ops.accel, once `op`'s kernels are loaded and `register` (its fake/autograd
    registrations) has run. Works inside torch.compile(fullgraph=True) too, also as the very
    first call: see `_ensure_loaded`."""
    _ensure_loaded(op, register)
    return torch.ops.accel


def entries(op: str, register: Callable[[], None] | None = None) -> ModuleType:
    """`op`'s extension module, once loaded and registered like `ops`: its functions are the ops'
    Python entries (csrc/autograd/python_entry.h), the light path of a model's common call. Eager
    only; under torch.compile call `ops`."""
    module = _entry_modules.get(op)  # per call: one dict lookup (import_module's costs ~1 us)
    if module is None:
        _ensure_loaded(op, register)
        module = _entry_modules[op] = load(op)
    return module


_entry_modules: dict[str, ModuleType] = {}


# Dynamo runs a function marked assume_constant_result for real while it traces and keeps only
# its result, so the build/load happens at trace time and the op already exists when Dynamo
# looks up torch.ops.accel.<name> right after. Once loaded, this is one dict lookup.
@torch.compiler.assume_constant_result
def _ensure_loaded(op: str, register: Callable[[], None] | None) -> bool:
    if op not in _loaded:
        with _lock:
            if op not in _loaded:
                load(op)
                if register is not None:
                    register()
                _loaded[op] = True
    return True


def tag_compile_caches() -> None:
    """Add a fingerprint of csrc/ to torch.compile's cache key (torch.compiler.config.cache_key_tag,
    keeping the user's own tag). torch's FX graph and AOTAutograd caches key a graph on its Python-visible
    ops only: a compiled backward cached before accel's C++ changed (an op's schema, its C++ gradient)
    would otherwise be replayed against the new kernels, failing or, worse, computing the old gradient.
    Called when this module is imported: a first op load may happen while Dynamo traces, where torch's
    config cannot be changed, and that graph's key must carry the tag too."""
    config = getattr(torch.compiler, "config", None)
    if config is None or not hasattr(config, "cache_key_tag"):
        return  # a torch without the option: nothing to key on
    mine = f"accel-csrc-{_csrc_fingerprint()}"
    tag = config.cache_key_tag
    if mine not in tag.split("|"):
        config.cache_key_tag = f"{tag}|{mine}" if tag else mine


@functools.cache
def _csrc_fingerprint() -> str:
    """A short hash of every file under csrc/ (names and bytes)."""
    h = hashlib.sha256()
    root = csrc_dir()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


@functools.cache
def load(op: str) -> ModuleType:
    """Return the extension module of `op`, building it on first use, once per process."""
    try:
        return importlib.import_module(f"accel._ext.{op}")
    except ImportError:
        return _jit_build(op)


# at::parallel_for is a header template that runs in parallel only when the including code is
# compiled with OpenMP; without it every CPU kernel would run on one thread. The GOMP symbols bind
# to the runtime torch already loaded globally, so torch.set_num_threads governs our kernels too.
# Tuples, and cpp_extension only ever gets fresh lists: it appends its own flags (-ltorch, ...) to
# the extra_ldflags list it is given, which would otherwise grow a shared constant with every build
# and change the flags, fingerprint and so the cache of every op loaded later in the process.
OPENMP_FLAGS: tuple[str, ...] = ("-fopenmp",) if sys.platform.startswith("linux") else ()
CUDA_FLAGS: tuple[str, ...] = ("-O3",)


def process_libstdcxx() -> tuple[str, ...]:
    """The C++ runtime this process runs on (torch loaded it): the path of its libstdc++ shared library,
    as a linker input, or nothing where there is none to find (not Linux, libc++).

    Linked first, it defines every C++ runtime symbol the extension needs, so no compiler can put a
    private copy of libstdc++ into it. A compiler that links libstdc++ statically (the GPU machine of
    2026-11-26: its CXX, /opt/gcc/bin/g++, gave the extensions no libstdc++.so.6 dependency) makes
    each extension carry its own runtime, whose iostreams have no locale facets in a process whose
    locale belongs to torch's libstdc++: the first number a TORCH_CHECK message formats leaves the
    stream failed (the message cut short before it, seen with -static-libstdc++ on gcc 12) or crashes
    the process (SIGSEGV in std::ostream::_M_insert<long>, the GPU machine's backtrace). The shared
    library named here is recorded by its soname (libstdc++.so.6), so a wheel built with it still runs
    on any machine."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return ()
    for line in maps.splitlines():
        path = line.split(maxsplit=5)[-1]
        if os.path.basename(path).startswith("libstdc++.so") and os.path.isfile(path):
            return (path,)
    return ()


def ld_flags() -> list[str]:
    """The link flags of every accel extension (JIT and setup.py): OpenMP, and torch's C++ runtime."""
    return [*OPENMP_FLAGS, *process_libstdcxx()]


def cxx_flags(cuda: bool, native: bool = True) -> list[str]:
    # JIT builds run where they are used, so they may target this CPU's vector units; an ahead-of-time
    # build (setup.py, native=False) may be copied to another machine and must not.
    # -fno-math-errno: sqrtf and friends need not set errno (nothing reads it), which lets GCC vectorize
    # loops calling them; without it the fused Adam loop stayed scalar on AVX2 CPUs, 4x slower than torch's.
    return ["-O3", "-fno-math-errno", *(("-march=native",) if native else ()), *OPENMP_FLAGS,
            *(("-DWITH_CUDA",) if cuda else ())]


def _ensure_ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH. A venv's python run without activating the venv has a PATH
    without the venv's bin (where pip put ninja): then add the folder of a ninja next to this Python or
    inside the ninja package."""
    if shutil.which("ninja"):
        return
    candidates = [os.path.dirname(sys.executable)]
    try:
        import ninja

        candidates.append(ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    for folder in candidates:
        if shutil.which("ninja", path=folder):
            os.environ["PATH"] = folder + os.pathsep + os.environ.get("PATH", "")
            return


def _jit_build(op: str) -> ModuleType:
    from torch.utils import cpp_extension

    _ensure_ninja_on_path()
    srcs = sources(op)
    cuda = any(s.endswith(".cu") for s in srcs)
    folder = build_dir(op)
    with _build_lock(op, folder):
        # cpp_extension rebuilds when a source changes but says nothing; say it ourselves, since a
        # first build takes a minute. The stamp is our own fingerprint of what goes into the build;
        # read under the lock, so a process that waited for another one's build stays quiet.
        stamp = folder / "accel.stamp"
        fingerprint = _fingerprint(srcs)
        if not stamp.exists() or stamp.read_text() != fingerprint:
            print(f"accel: building the {op!r} kernels ({'C++ + CUDA' if cuda else 'C++'}) in "
                  f"{folder}; this happens once per source change", file=sys.stderr, flush=True)
        try:
            module = cpp_extension.load(
                name=f"accel_{op}",
                sources=srcs,
                extra_cflags=cxx_flags(cuda),
                extra_ldflags=ld_flags(),
                extra_cuda_cflags=list(CUDA_FLAGS) if cuda else None,
                extra_include_paths=[str(csrc_dir())],
                build_directory=str(folder),
                with_cuda=cuda,
                verbose=False,
            )
        except Exception as e:  # the compiler's output is in the message; keep it
            raise RuntimeError(
                f"accel: building the {op!r} kernels failed. Sources: {', '.join(srcs)}.\n{e}") from e
        stamp.write_text(fingerprint)
    return module


# Seconds a process waits for another one's build of the same op before saying whom it waits for.
WAIT_NOTICE_S = 10.0
_POLL_S = 0.1
LOCK_NAME = "accel.lock"  # ours: an flock(2) lock, never deleted
BATON_NAME = "lock"  # cpp_extension's FileBaton: a file whose mere existence means "building"


@contextlib.contextmanager
def _build_lock(op: str, folder: Path) -> Iterator[None]:
    """Hold the cross-process lock of `folder` while the body builds or loads there.

    cpp_extension.load serializes builds with a FileBaton: it creates <folder>/lock, builds and
    deletes it, and every other caller sleeps until that file is gone. A build killed half-way
    (torchrun's SIGTERM/SIGKILL to the other ranks when one fails, a job's time limit, a second
    Ctrl-C during the cleanup of the first) leaves the file behind and every later load then sleeps
    forever, without a word. The file names no owner, so it cannot tell
    "building" from "died". Our lock can: flock(2) belongs to an open file, the OS drops it when the
    holder exits however it exits, and its descriptor is not inherited by the compilers the build
    runs (Python opens files non-inheritable), so a holder is always a live process. Every accel
    build takes it before calling cpp_extension.load, so a baton found while holding it was left by
    a dead process: it is removed, and the load goes on.
    """
    lock_path, baton = folder / LOCK_NAME, folder / BATON_NAME
    fd = _open_lock(lock_path) if fcntl is not None else None
    if fd is None:
        _notice_baton(op, baton)
        yield
        return
    try:
        if not _acquire(fd, op, folder, lock_path):
            _notice_baton(op, baton)
            yield
            return
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        except OSError:
            pass  # the owner's name is only for the waiters' message
        try:
            baton.unlink()
        except FileNotFoundError:
            pass
        else:
            print(f"accel: removed {baton}, the lock file of an interrupted build of the {op!r} kernels "
                  f"(no process was building them)", file=sys.stderr, flush=True)
        yield
    finally:
        os.close(fd)  # releases the lock


def _open_lock(path: Path) -> int | None:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:  # e.g. a read-only cache, whose builds cannot be redone anyway
        print(f"accel: cannot open the build lock {path} ({e}); building without it", file=sys.stderr,
              flush=True)
        return None


def _acquire(fd: int, op: str, folder: Path, lock_path: Path) -> bool:
    """Wait for the lock; False where the file system offers no locks (some NFS mounts)."""
    start = time.monotonic()
    noticed = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        except OSError as e:
            print(f"accel: cannot lock {lock_path} ({e}); building without it, so processes sharing "
                  f"{folder} may build at once", file=sys.stderr, flush=True)
            return False
        if not noticed and time.monotonic() - start >= WAIT_NOTICE_S:
            noticed = True
            try:
                owner = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            except OSError:
                owner = "another process"
            print(f"accel: waiting for {owner}, which is building the {op!r} kernels in {folder} "
                  f"(it holds {lock_path}, released when that process exits)", file=sys.stderr, flush=True)
        time.sleep(_POLL_S)


def _notice_baton(op: str, baton: Path) -> None:
    """Without our lock a leftover baton cannot be told from a live build: name it, once, since
    cpp_extension will wait on it without a word."""
    if baton.exists():
        print(f"accel: {baton} exists: another process is building the {op!r} kernels, or an interrupted "
              f"build left it behind. The load waits until it is gone; if no build is running, delete it.",
              file=sys.stderr, flush=True)


def _fingerprint(srcs: list[str]) -> str:
    h = hashlib.sha256(torch.__version__.encode())
    h.update(" ".join(cxx_flags(False) + ld_flags()).encode())
    headers = sorted(csrc_dir().rglob("*.h")) + sorted(csrc_dir().rglob("*.cuh"))
    for path in [Path(s) for s in srcs] + headers:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


tag_compile_caches()
