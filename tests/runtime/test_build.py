"""The JIT build: a visible message, a cache that rebuilds on change, and the compiler's output on failure."""
import os
import subprocess

import sys
import textwrap
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


def test_first_call_inside_fullgraph_compile_loads_the_kernels():
    # Fresh process: nothing is loaded yet, so Dynamo meets the load while tracing.
    proc = subprocess.run([sys.executable, "-c", FIRST_CALL_COMPILED], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "OK" in proc.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OpenMP flags are only passed on Linux")
def test_cpu_kernels_are_built_with_openmp():
    # at::parallel_for runs serially in code compiled without OpenMP; a kernel built with it calls
    # into the GOMP runtime, so the extension must import GOMP symbols.
    from accel.runtime import _build
    from accel.runtime.nn.quick_gelu import quick_gelu

    quick_gelu(torch.zeros(3))
    so = Path(_build.load("quick_gelu").__file__).read_bytes()
    assert b"GOMP_parallel" in so


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
