"""The JIT build: a visible message, a cache that rebuilds on change, the compiler's output on failure,
a cache that processes share safely (concurrent builders, builds killed half-way), and flags that do
not drift from one op's build to the next."""
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

OP = textwrap.dedent("""
    #include <torch/library.h>
    #include <torch/types.h>
    at::Tensor probe_value(const at::Tensor& x) {{ return x + {value}; }}
    TORCH_LIBRARY_FRAGMENT(accel, m) {{ m.def("probe_value(Tensor x) -> Tensor"); }}
    TORCH_LIBRARY_IMPL(accel, CPU, m) {{ m.impl("probe_value", &probe_value); }}
""")

# Runs in a fresh process: an op can be registered once per process only.
SCRIPT = textwrap.dedent("""
    import sys, torch
    from pathlib import Path
    from accel.runtime import _build
    _build.csrc_dir = lambda: Path(sys.argv[1])
    print("RESULT", _build.ops("probe").probe_value(torch.zeros(1)).item())
""")


def _fake_csrc(tmp_path, body):
    csrc = tmp_path / "csrc"
    (csrc / "cpu").mkdir(parents=True, exist_ok=True)
    (csrc / "bindings.cpp").write_text((ROOT / "csrc" / "bindings.cpp").read_text())
    # with the headers bindings.cpp includes (autograd/python_entry.h); no op's autograd sources
    shutil.copytree(ROOT / "csrc" / "autograd", csrc / "autograd", ignore=shutil.ignore_patterns("*.cpp"))
    (csrc / "cpu" / "probe.cpp").write_text(body)
    return csrc


def _run(csrc, ext_dir):
    env = {"ACCEL_EXT_DIR": str(ext_dir), "PATH": "/usr/bin:/bin:/usr/local/bin"}
    return subprocess.run([sys.executable, "-c", SCRIPT, str(csrc)], capture_output=True, text=True,
                          env=env, timeout=600)


@pytest.mark.slow
def test_builds_once_caches_and_rebuilds_on_change(tmp_path):
    csrc = _fake_csrc(tmp_path, OP.format(value=1))
    first = _run(csrc, tmp_path / "ext")
    assert first.returncode == 0, first.stderr
    assert "RESULT 1.0" in first.stdout
    assert "building the 'probe' kernels" in first.stderr

    second = _run(csrc, tmp_path / "ext")
    assert "RESULT 1.0" in second.stdout
    assert "building" not in second.stderr  # cached: no rebuild, no message

    (csrc / "cpu" / "probe.cpp").write_text(OP.format(value=2))
    third = _run(csrc, tmp_path / "ext")
    assert third.returncode == 0, third.stderr
    assert "RESULT 2.0" in third.stdout
    assert "building the 'probe' kernels" in third.stderr


@pytest.mark.slow
def test_build_failure_reports_compiler_output(tmp_path):
    csrc = _fake_csrc(tmp_path, OP.format(value="undeclared_identifier_xyz"))
    proc = _run(csrc, tmp_path / "ext")
    assert proc.returncode != 0
    assert "building the 'probe' kernels failed" in proc.stderr
    assert "undeclared_identifier_xyz" in proc.stderr  # the compiler's own message comes through


def test_unknown_op_is_a_clear_error():
    from accel.runtime import _build

    with pytest.raises(ValueError, match=r"no C\+\+ source"):
        _build.sources("no_such_op")


FIRST_CALL_COMPILED = textwrap.dedent("""
    import torch
    from accel.runtime.nn.quick_gelu import quick_gelu, quick_gelu_reference
    x = torch.randn(37, requires_grad=True)
    y = torch.compile(quick_gelu, fullgraph=True)(x)  # the op's first use in this process
    y.sum().backward()
    xr = x.detach().clone().requires_grad_()
    quick_gelu_reference(xr).sum().backward()
    torch.testing.assert_close(y, quick_gelu_reference(x))
    torch.testing.assert_close(x.grad, xr.grad)
    print("OK")
""")


def _run_in_fresh_process(script: str) -> None:
    """Run `script` with this Python in a new process; it must exit 0 and print OK."""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "OK" in proc.stdout


def test_first_call_inside_fullgraph_compile_loads_the_kernels():
    # Fresh process: nothing is loaded yet, so Dynamo meets the load while tracing.
    _run_in_fresh_process(FIRST_CALL_COMPILED)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OpenMP flags are only passed on Linux")
def test_cpu_kernels_are_built_with_openmp():
    # at::parallel_for runs serially in code compiled without OpenMP; a kernel built with it calls
    # into the GOMP runtime, so the extension must import GOMP symbols.
    from accel.runtime import _build
    from accel.runtime.nn.quick_gelu import quick_gelu

    quick_gelu(torch.zeros(3))
    so = Path(_build.load("quick_gelu").__file__).read_bytes()
    assert b"GOMP_parallel" in so


# A number formatted into a std::ostringstream, the way TORCH_CHECK builds its messages (c10::str).
FORMAT_NUMBER_CPP = r"""
#include <cstring>
#include <sstream>
extern "C" int format_number(long value, char* out, int size) {
  std::ostringstream s;
  s << "n=" << value;
  std::strncpy(out, s.str().c_str(), size - 1);
  out[size - 1] = 0;
  return s.fail() ? -1 : 0;
}
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process's maps (/proc), Linux only")
def test_extensions_use_torchs_cpp_runtime_even_where_the_compiler_links_its_own(tmp_path):
    # The GPU machine's compiler linked libstdc++ statically: every extension carried a runtime of its own,
    # whose iostreams have no locale facets in torch's process, and each TORCH_CHECK message with a number
    # in it crashed the process (SIGSEGV) or came out cut short before the number. -static-libstdc++ makes
    # any g++ do the same; with accel's link flags the library must still format numbers.
    import ctypes

    from torch.utils import cpp_extension

    from accel.runtime import _build

    runtime = _build.process_libstdcxx()
    assert runtime and "libstdc++" in runtime[0] and Path(runtime[0]).is_file()
    assert set(runtime) <= set(_build.ld_flags())
    src, lib = tmp_path / "format_number.cpp", tmp_path / "format_number.so"
    src.write_text(FORMAT_NUMBER_CPP)
    cxx = cpp_extension.get_cxx_compiler()
    if shutil.which(cxx) is None:
        pytest.skip(f"no C++ compiler ({cxx}) to build the test library")
    subprocess.run([cxx, "-shared", "-fPIC", "-O2", str(src), "-o", str(lib), *_build.ld_flags(),
                    "-static-libstdc++"], check=True, capture_output=True)
    buf = ctypes.create_string_buffer(64)
    assert ctypes.CDLL(str(lib)).format_number(12345, buf, 64) == 0
    assert buf.value == b"n=12345"


@pytest.mark.skipif(shutil.which("readelf") is None, reason="needs binutils' readelf to list a library's dependencies")
def test_a_built_op_depends_on_the_shared_cpp_runtime():
    # the kernels' own library (built with whatever compiler this machine has) needs libstdc++.so.6
    from accel.runtime import _build

    if not _build.process_libstdcxx():
        pytest.skip("this process has no libstdc++ loaded (not Linux, or a libc++ build of torch)")
    dynamic = subprocess.run(["readelf", "-d", _build.load("quick_gelu").__file__], check=True,
                             capture_output=True, text=True).stdout
    assert "[libstdc++.so.6]" in dynamic


def test_builds_are_kept_apart_per_cpu_instruction_set(monkeypatch):
    # JIT builds use -march=native: a cache shared by two hosts must not hand one's build to the other.
    from accel.runtime import _build

    tags = []
    for flags in ("flags\t: fpu sse2 avx2", "flags\t: fpu sse2 avx2 avx512f"):
        monkeypatch.setattr(_build, "cpu_features", lambda flags=flags: flags)
        _build.machine_tag.cache_clear()
        tags.append(_build.machine_tag())
    _build.machine_tag.cache_clear()
    assert tags[0] != tags[1]
    assert all(t.startswith(torch.__version__.replace("+", "_")) for t in tags)


def test_ninja_next_to_python_is_found_without_it_on_path(monkeypatch, tmp_path):
    """A venv's python run without activating the venv: PATH lacks the venv's bin, where ninja is."""
    from accel.runtime import _build

    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    ninja = bin_dir / "ninja"
    ninja.write_text("#!/bin/sh\n")
    ninja.chmod(0o755)
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python"))
    monkeypatch.setitem(sys.modules, "ninja", None)  # no ninja package either: the folder must do
    monkeypatch.setenv("PATH", str(empty))
    _build._ensure_ninja_on_path()
    assert os.environ["PATH"].split(os.pathsep)[0] == str(bin_dir)
    _build._ensure_ninja_on_path()  # found now: PATH is left alone
    assert os.environ["PATH"].count(str(bin_dir)) == 1


# ---------------------------------------------------------------- a cache shared between processes

LOAD_QUICK_GELU = textwrap.dedent("""
    import sys, torch
    from accel.runtime import _build
    _build.WAIT_NOTICE_S = float(sys.argv[1])
    _build.load("quick_gelu")
    print("OK", torch.ops.accel.quick_gelu_fwd(torch.zeros(2)).tolist(), flush=True)
""")

# Generous: a fresh process imports torch and loads a cached build (ninja finds nothing to do); a
# regression that sleeps on a leftover lock would otherwise hang the suite instead of failing.
LOAD_TIMEOUT_S = 180


@pytest.fixture
def cached_quick_gelu(tmp_path):
    """A private cache holding an up-to-date copy of the quick_gelu build, so processes started on it
    load without compiling. Returns (cache root, the op's build folder there)."""
    from accel.runtime import _build

    try:
        aot = importlib.util.find_spec("accel._ext.quick_gelu") is not None
    except ImportError:
        aot = False
    if aot:
        pytest.skip("an ahead-of-time build of the kernels is installed: the JIT build is not used")
    _build.load("quick_gelu")  # built (or found) in this session's cache
    root = tmp_path / "ext"
    folder = root / _build.machine_tag() / "quick_gelu"
    shutil.copytree(_build.build_dir("quick_gelu"), folder,
                    ignore=shutil.ignore_patterns(_build.LOCK_NAME, _build.BATON_NAME))
    return root, folder


def _env(ext_dir, path=None):
    env = dict(os.environ, ACCEL_EXT_DIR=str(ext_dir))
    if path is not None:
        env["PATH"] = path
    return env


def _load_in_subprocess(ext_dir, notice_s=10.0, **kwargs):
    try:
        return subprocess.run([sys.executable, "-c", LOAD_QUICK_GELU, str(notice_s)], capture_output=True,
                              text=True, env=_env(ext_dir), timeout=LOAD_TIMEOUT_S, **kwargs)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"loading the kernels hung for {LOAD_TIMEOUT_S}s (a leftover lock?); stderr:\n{e.stderr}")


def _make_baton(path):
    # What cpp_extension's FileBaton does when it takes the lock.
    os.close(os.open(path, os.O_CREAT | os.O_EXCL))


def _real_ninja():
    from accel.runtime import _build

    _build._ensure_ninja_on_path()
    ninja = shutil.which("ninja")
    if ninja is None:
        pytest.skip("ninja not found")
    return ninja


def _fake_ninja(folder, body):
    """A `ninja` for cpp_extension to run: answers --version, then runs `body` (sh)."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "ninja"
    script.write_text(f'#!/bin/sh\nif [ "$1" = "--version" ]; then exec {_real_ninja()} --version; fi\n{body}\n')
    script.chmod(0o755)
    return folder


def _wait_for(predicate, what, timeout=LOAD_TIMEOUT_S, proc=None):
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the process exited (rc {proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_a_leftover_lock_file_is_removed_and_the_load_goes_on(cached_quick_gelu):
    # The state a build killed half-way leaves: cpp_extension's lock file, with nobody building.
    root, folder = cached_quick_gelu
    baton = folder / "lock"
    _make_baton(baton)
    start = time.monotonic()
    proc = _load_in_subprocess(root)
    assert proc.returncode == 0, proc.stderr
    assert "OK [0.0, 0.0]" in proc.stdout
    assert f"removed {baton}" in proc.stderr
    assert "building the 'quick_gelu' kernels (" not in proc.stderr  # the cached build was used
    assert not baton.exists()
    assert time.monotonic() - start < LOAD_TIMEOUT_S


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the shared-cache lock targets Linux")
def test_a_build_killed_half_way_does_not_block_the_next_run(cached_quick_gelu, tmp_path):
    root, folder = cached_quick_gelu
    started = tmp_path / "ninja-started"
    # A build that never finishes, like a long compile interrupted by torchrun's SIGKILL.
    fake = _fake_ninja(tmp_path / "stuck-bin", f"touch {started}; exec sleep 600")
    env = _env(root, path=f"{fake}{os.pathsep}/usr/bin{os.pathsep}/bin")
    victim = subprocess.Popen([sys.executable, "-c", LOAD_QUICK_GELU, "10"], env=env, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for(lambda: started.exists() and (folder / "lock").exists(), "the build to start", proc=victim)
        # Only the Python process dies: its compiler (here `sleep`) lives on, as an orphaned nvcc
        # may. It must not keep the build locked.
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(timeout=60)
        assert (folder / "lock").exists()  # what used to make every later run hang

        proc = _load_in_subprocess(root)
        assert proc.returncode == 0, proc.stderr
        assert "OK [0.0, 0.0]" in proc.stdout
        assert f"removed {folder / 'lock'}" in proc.stderr
    finally:
        try:
            os.killpg(victim.pid, signal.SIGKILL)  # the orphaned `sleep`
        except ProcessLookupError:
            pass
        victim.wait(timeout=60)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the shared-cache lock targets Linux")
def test_concurrent_builders_wait_for_each_other_and_both_load(cached_quick_gelu, tmp_path):
    # Two ranks loading one op at once: the second waits (and says whom for) while the first
    # builds, then loads; the first's lock file is never mistaken for a leftover.
    root, folder = cached_quick_gelu
    started, go = tmp_path / "ninja-started", tmp_path / "go"
    fake = _fake_ninja(tmp_path / "gated-bin",
                       f"touch {started}\nwhile [ ! -e {go} ]; do sleep 0.1; done\nexec {_real_ninja()} \"$@\"")
    env = _env(root, path=f"{fake}{os.pathsep}/usr/bin{os.pathsep}/bin")
    logs = [tmp_path / "first.err", tmp_path / "second.err"]
    procs = []
    try:
        for k, log in enumerate(logs):
            with open(log, "w") as err:
                procs.append(subprocess.Popen([sys.executable, "-c", LOAD_QUICK_GELU, "0.5"], env=env, text=True,
                                              stdout=subprocess.PIPE, stderr=err))
            if k == 0:
                _wait_for(started.exists, "the first build to start", proc=procs[0])
        _wait_for(lambda: "waiting for" in logs[1].read_text(), "the second process to wait", proc=procs[1])
        go.touch()
        outs = [p.communicate(timeout=LOAD_TIMEOUT_S)[0] for p in procs]
    finally:
        go.touch()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    errs = [log.read_text() for log in logs]
    for p, out, err in zip(procs, outs, errs):
        assert p.returncode == 0, err
        assert "OK [0.0, 0.0]" in out
        assert "removed" not in err
    assert f"waiting for pid {procs[0].pid} " in errs[1]
    assert str(folder / "accel.lock") in errs[1]
    assert "waiting" not in errs[0]


@pytest.mark.slow
def test_two_processes_building_one_op_from_scratch_both_succeed(tmp_path):
    csrc = _fake_csrc(tmp_path, OP.format(value=3))
    env = {"ACCEL_EXT_DIR": str(tmp_path / "ext"), "PATH": "/usr/bin:/bin:/usr/local/bin"}
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, str(csrc)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    try:
        results = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err
        assert "RESULT 3.0" in out
    # One built; the other waited for it and found the build up to date.
    assert sum("accel: building the 'probe' kernels" in err for _, err in results) == 1


def test_a_live_holder_is_waited_for_not_overruled(tmp_path, monkeypatch, capsys):
    from accel.runtime import _build

    if _build.fcntl is None:
        pytest.skip("no flock on this platform")
    import fcntl

    monkeypatch.setattr(_build, "WAIT_NOTICE_S", 0.2)
    baton = tmp_path / "lock"
    _make_baton(baton)  # the live holder's own build in progress
    holder = os.open(tmp_path / "accel.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX)
    os.write(holder, b"pid 4242 on elsewhere\n")
    entered = threading.Event()

    def build():
        with _build._build_lock("probe", tmp_path):
            entered.set()

    thread = threading.Thread(target=build, daemon=True)
    try:
        thread.start()
        time.sleep(1.0)
        assert not entered.is_set()
        assert baton.exists()  # a live build's lock file is left alone
        os.remove(baton)  # the holder finishes: cpp_extension removes its file, the OS our lock
    finally:
        os.close(holder)
    thread.join(timeout=30)
    assert entered.is_set()
    err = capsys.readouterr().err
    assert "waiting for pid 4242 on elsewhere, which is building the 'probe' kernels" in err
    assert str(tmp_path / "accel.lock") in err
    assert "removed" not in err


def test_without_flock_a_leftover_lock_file_is_named(tmp_path, monkeypatch, capsys):
    # Where there is no flock (Windows), a leftover cannot be told from a live build: say what to delete.
    from accel.runtime import _build

    monkeypatch.setattr(_build, "fcntl", None)
    _make_baton(tmp_path / "lock")
    with _build._build_lock("probe", tmp_path):
        pass
    err = capsys.readouterr().err
    assert f"{tmp_path / 'lock'} exists" in err and "delete it" in err
    assert (tmp_path / "lock").exists()


# ---------------------------------------------------------------- flags that do not drift


def test_a_load_leaves_the_flag_constants_and_fingerprints_alone(tmp_path, monkeypatch):
    # cpp_extension.load appends its link flags to the extra_ldflags list it is given.
    from torch.utils import cpp_extension

    from accel.runtime import _build

    calls = []

    def fake_load(**kwargs):
        calls.append({k: list(v) if isinstance(v, list) else v for k, v in kwargs.items()})
        for key in ("extra_cflags", "extra_ldflags", "extra_cuda_cflags", "extra_include_paths"):
            if isinstance(kwargs.get(key), list):
                kwargs[key].append("-lappended_by_torch")
        return types.ModuleType(kwargs["name"])

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setenv("ACCEL_EXT_DIR", str(tmp_path))
    monkeypatch.setenv("PATH", os.environ.get("PATH", ""))  # _jit_build may add ninja's folder
    openmp, flags, links = _build.OPENMP_FLAGS, _build.cxx_flags(False), _build.ld_flags()
    before = _build._fingerprint(_build.sources("layer_norm"))
    _build._jit_build("quick_gelu")
    _build._jit_build("fmha")
    assert isinstance(_build.OPENMP_FLAGS, tuple) and isinstance(_build.CUDA_FLAGS, tuple)
    assert _build.OPENMP_FLAGS == openmp
    assert _build.cxx_flags(False) == flags
    assert _build._fingerprint(_build.sources("layer_norm")) == before
    assert calls[0]["extra_cflags"] == calls[1]["extra_cflags"]
    assert _build.ld_flags() == links
    assert calls[0]["extra_ldflags"] == calls[1]["extra_ldflags"] == links


FINGERPRINT_AFTER_A_LOAD = textwrap.dedent("""
    from accel.runtime import _build
    srcs = _build.sources("layer_norm")
    before, flags = _build._fingerprint(srcs), _build.cxx_flags(False)
    _build._jit_build("quick_gelu")  # the real cpp_extension.load, cached build
    assert _build._fingerprint(srcs) == before, "the fingerprint of the next op changed"
    assert _build.cxx_flags(False) == flags, (flags, _build.cxx_flags(False))
    print("OK")
""")


def test_fingerprints_do_not_depend_on_which_op_loads_first():
    # Fresh process: the first load in a process is the one where cpp_extension writes its ninja
    # file and appends its link flags.
    _run_in_fresh_process(FINGERPRINT_AFTER_A_LOAD)


def test_setup_py_builds_what_the_jit_build_builds(monkeypatch):
    # One source of truth: setup.py's ahead-of-time extensions take their ops, sources and flags from
    # _build (portable: no -march=native in a build that may be copied elsewhere).
    from accel.runtime import _build

    root = Path(_build.__file__).resolve().parents[2]
    monkeypatch.setenv("ACCEL_BUILD_EXT", "1")
    namespace = {"__file__": str(root / "setup.py"), "__name__": "accel_setup_under_test"}
    code = (root / "setup.py").read_text().replace("\nsetup(\n", "\n_setup_kwargs = dict(\n")
    exec(compile(code, "setup.py", "exec"), namespace)
    exts = {e.name: e for e in namespace["ext_modules"]}
    assert sorted(exts) == [f"accel._ext.{op}" for op in _build.op_names()]
    assert "dcn_v2" in _build.op_names() and "quick_gelu" in _build.op_names()
    for op in _build.op_names():
        ext = exts[f"accel._ext.{op}"]
        expected = [os.path.relpath(s, root) for s in _build.sources(op, cuda=any(s.endswith(".cu")
                                                                                 for s in ext.sources))]
        assert ext.sources == expected
        cxx = ext.extra_compile_args["cxx"] if isinstance(ext.extra_compile_args, dict) else ext.extra_compile_args
        assert "-march=native" not in cxx and all(f in cxx for f in _build.OPENMP_FLAGS)
        assert ext.extra_link_args == _build.ld_flags()


def test_compile_caches_are_keyed_on_the_kernel_sources(monkeypatch, tmp_path):
    # torch.compile's FX graph / AOTAutograd caches see an op's name and schema, not its C++: importing
    # accel's kernel builder adds a fingerprint of csrc/ to torch.compiler.config.cache_key_tag, beside the
    # user's own tag, once; a change to any csrc/ file changes it.
    from accel.runtime import _build
    from accel.runtime.nn.quick_gelu import quick_gelu

    if not hasattr(torch.compiler, "config") or not hasattr(torch.compiler.config, "cache_key_tag"):
        pytest.skip(f"torch {torch.__version__} has no torch.compiler.config.cache_key_tag")
    quick_gelu(torch.ones(2))  # loads an op
    mine = f"accel-csrc-{_build._csrc_fingerprint()}"
    assert mine in torch.compiler.config.cache_key_tag.split("|")

    # (plain setattr: monkeypatch's undo hides the entry of torch's config module for good)
    before = torch.compiler.config.cache_key_tag
    try:
        torch.compiler.config.cache_key_tag = "users-tag"
        _build.tag_compile_caches()
        _build.tag_compile_caches()
        assert torch.compiler.config.cache_key_tag == f"users-tag|{mine}"
    finally:
        torch.compiler.config.cache_key_tag = before

    csrc = tmp_path / "csrc"
    shutil.copytree(ROOT / "csrc", csrc)
    monkeypatch.setattr(_build, "csrc_dir", lambda: csrc)
    _build._csrc_fingerprint.cache_clear()
    try:
        same = _build._csrc_fingerprint()
        _build._csrc_fingerprint.cache_clear()
        (csrc / "autograd" / "backward_guard.h").write_text("// changed\n")
        changed = _build._csrc_fingerprint()
    finally:
        _build._csrc_fingerprint.cache_clear()
    assert f"accel-csrc-{same}" == mine and changed != same
