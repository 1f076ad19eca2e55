"""Which build of an op turns a C++ error into a crash? Build it several ways and run tests that make it raise.

On the H200 machine of 2026-11-26 (Ubuntu's Python 3.12.3, torch 2.11+cu130) every test whose op raised a
TORCH_CHECK from a g++-compiled file died with SIGSEGV (dcn_v2, fused_adam, masked_scale), while checks
raised from the nvcc-compiled files passed; on the development machines everything passes (gcc 12, also
with -march=sapphirerapids and Ubuntu's hardening flags; an Ubuntu 24.04 chroot with gcc 13.3 and that
machine's torch, CUDA sources included). This builds OP once per variant, each in a folder of its own and
all at once, then runs TESTS in a fresh process per variant:

    as-is      the build accel makes (C++ + CUDA where CUDA is present)
    cpu-only   without the .cu file: is it the two compilers' objects in one library?
    no-native  without -march=native
    no-openmp  without -fopenmp
    cuda-context  the as-is build, with CUDA initialised (a tensor on the GPU) before the tests: does the
               crash need the driver in the process, as in the GPU run's workers, which ran CUDA tests first?

    python tools/throw_probe.py --op fused_adam TESTS... [--variants as-is,no-native] [--out DIR]

A table says how each variant's tests ended (exit status, or the signal that killed them), beside the
compilers and the libgcc_s / libstdc++ the process mapped. Pick tests that run on the CPU (cpu-only has
no CUDA kernels).
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("as-is", "cpu-only", "no-native", "no-openmp", "cuda-context")
NO_CUDA = 77  # the cuda-context child's exit status where there is no GPU


def apply(variant: str) -> None:
    """Make accel's JIT build the `variant` build (in this process)."""
    from accel.runtime import _build

    if variant == "cpu-only":
        _build.with_cuda = lambda: False
    elif variant == "no-native":
        flags = _build.cxx_flags
        _build.cxx_flags = lambda cuda, native=True: flags(cuda, native=False)
    elif variant == "no-openmp":
        _build.OPENMP_FLAGS = ()
    elif variant not in ("as-is", "cuda-context"):
        raise ValueError(f"variant: expected one of {', '.join(VARIANTS)}, got {variant!r}")


def _child(variant: str, op: str, tests: list[str]) -> int:
    apply(variant)
    from accel.runtime import _build

    _build.load(op)
    if not tests:  # the build alone
        return 0
    import pytest

    if variant == "cuda-context":
        import torch

        if not torch.cuda.is_available():
            print("cuda-context: no CUDA device here", flush=True)
            return NO_CUDA
        torch.ones(1, device="cuda").add_(1).cpu()  # the driver loaded and a context made
    # before the tests: a test that crashes the process leaves no later line
    libs = sorted({line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
                   if "libgcc_s" in line or "libstdc++" in line})
    print("mapped:", *libs, flush=True)
    return int(pytest.main(["-q", "-p", "no:cacheprovider", *tests]))


def _ended(code: int) -> str:
    if code == NO_CUDA:
        return "not run: no CUDA device"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return "passed" if code == 0 else f"exit {code}"


def _build_of(variant: str) -> str:
    return "as-is" if variant == "cuda-context" else variant  # the same build, another process state


def _child_call(variant: str, op: str, ext: Path, tests: list[str] = ()) -> dict:
    """subprocess arguments of a child: `variant`'s build of `op` in its folder under `ext`, then `tests`."""
    return dict(args=[sys.executable, __file__, "--child", variant, "--op", op, *tests], cwd=ROOT,
                env={**os.environ, "ACCEL_EXT_DIR": str(ext / _build_of(variant)), "PYTHONPATH": str(ROOT)})


def _run(variant: str, op: str, tests: list[str], ext: Path, log: Path, timeout: float) -> tuple[int, float]:
    t0 = time.monotonic()
    with log.open("w") as f:
        try:
            code = subprocess.run(**_child_call(variant, op, ext, tests), stdout=f, stderr=subprocess.STDOUT,
                                  timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            code = 124
    return code, time.monotonic() - t0


def _versions() -> list[str]:
    out = []
    for cmd in (["c++", "--version"], ["nvcc", "--version"]):
        try:
            text = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
            out.append(f"{cmd[0]}: {text[0] if cmd[0] == 'c++' else text[-1]}")
        except (OSError, IndexError, subprocess.TimeoutExpired):
            out.append(f"{cmd[0]}: not found")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tests", nargs="*", help="pytest node ids that make OP raise (CPU ones)")
    p.add_argument("--op", required=True, help="the op to build, a name in csrc/cpu/")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--out", type=Path, default=None, help="folder for the logs (default: a temp folder)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per build and per test run")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        return _child(a.child, a.op, a.tests)
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    for v in variants:
        if v not in VARIANTS:
            p.error(f"--variants: expected names from {', '.join(VARIANTS)}, got {v!r}")
    out = a.out or Path(tempfile.mkdtemp(prefix="throw_probe_"))
    out.mkdir(parents=True, exist_ok=True)
    ext = out / "ext"
    # the builds at once, one per folder (each compiler job is single-threaded), then the tests one variant
    # at a time; a build that several variants share is waited for by each of them (the second wait returns)
    builds = {b: subprocess.Popen(**_child_call(b, a.op, ext), stdout=(out / f"build_{b}.log").open("w"),
                                  stderr=subprocess.STDOUT)
              for b in dict.fromkeys(_build_of(v) for v in variants)}
    rows = []
    for v in variants:
        proc = builds[_build_of(v)]
        try:
            built = proc.wait(timeout=a.timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            built = 124
        if built != 0:
            rows.append((v, f"build {_ended(built)}", ""))
            continue
        code, secs = _run(v, a.op, a.tests, ext, out / f"tests_{v}.log", a.timeout)
        mapped = next((line for line in (out / f"tests_{v}.log").read_text().splitlines()
                       if line.startswith("mapped:")), "")
        rows.append((v, f"{_ended(code)} ({secs:.0f} s)", mapped.removeprefix("mapped: ")))
    print(*_versions(), sep="\n")
    print(f"op {a.op}; tests: {' '.join(a.tests) or '(none: builds only)'}; logs in {out}")
    print("| variant | tests | libgcc_s / libstdc++ mapped |\n|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
