"""Compile every csrc/**/*.cu with `nvcc -c` against the installed torch headers.

No GPU is needed and nothing is linked or run: this catches a CUDA build break on machines (CI)
that cannot run the kernels. Objects are cached by a hash of the source, the headers it includes
from csrc/, the flags and the torch version, so unchanged files are not recompiled.

    python tools/check_cuda_compiles.py [FILE.cu ...]     # default: all of csrc/
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCH = "-gencode=arch=compute_90,code=sm_90"


def nvcc() -> str | None:
    for cand in (os.environ.get("NVCC"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and os.path.exists(cand):
            return cand
    return None


def toolkit_include() -> Path:
    """The include dir of the CUDA toolkit nvcc belongs to (nvcc may be a wrapper script)."""
    cands = [os.environ.get("CUDA_HOME"), Path(nvcc()).resolve().parents[1], "/usr/local/cuda"]
    for c in cands:
        if c and (Path(c) / "include" / "cuda_runtime_api.h").exists():
            return Path(c) / "include"
    raise SystemExit("check_cuda_compiles: CUDA toolkit headers not found; set CUDA_HOME")


def flags(name: str) -> list[str]:
    import torch
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS, include_paths

    site = Path(torch.__file__).resolve().parents[1]
    # nvcc's own toolkit headers first: the nvidia-* wheels of torch's CUDA 12.8 build carry an
    # older cuda_runtime.h that nvcc 13's headers refuse. The wheels then supply the library
    # headers the toolkit lacks (cusparse.h, cublas.h, ...): a folder per library in the CUDA 12
    # wheels (nvidia/cusparse/include), one folder that holds the runtime's headers too in the CUDA 13
    # wheels of torch >= 2.11 (nvidia/cu13/include). Those folders come after the toolkit's, so a
    # header both have is the toolkit's.
    toolkit = toolkit_include()
    incs = [str(toolkit)] + include_paths() + [sysconfig.get_paths()["include"], str(ROOT / "csrc")]
    for wheel_inc in sorted(glob.glob(str(site / "nvidia" / "*" / "include"))):
        headers = [h.name for h in Path(wheel_inc).glob("*.h")]
        if any(not (toolkit / h).exists() for h in headers):
            incs.append(wheel_inc)
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    # COMMON_NVCC_FLAGS are the flags every cpp_extension build passes (no implicit half/bfloat16
    # conversions or operators): without them code that the JIT build rejects would pass here.
    return (["-std=c++17", "-O3", ARCH, "-Xcompiler", "-fPIC"] + COMMON_NVCC_FLAGS + [
             f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-DTORCH_EXTENSION_NAME={name}", "-DWITH_CUDA",
             "-DTORCH_API_INCLUDE_EXTENSION_H"]
            + [f"-I{i}" for i in incs])


def cache_key(src: Path, fl: list[str]) -> str:
    import torch

    h = hashlib.sha256(src.read_bytes())
    for hdr in sorted((ROOT / "csrc").rglob("*.h")) + sorted((ROOT / "csrc").rglob("*.cuh")):
        h.update(hdr.read_bytes())
    h.update(" ".join(fl).encode())
    h.update(torch.__version__.encode())
    return h.hexdigest()[:24]


def compile_one(src: Path, cache: Path) -> tuple[Path, bool, str]:
    """Returns (source, ok, compiler output)."""
    fl = flags(f"accel_{src.stem}")
    stamp = cache / f"{src.stem}.{cache_key(src, fl)}.ok"
    if stamp.exists():
        return src, True, "cached"
    obj = cache / f"{src.stem}.o"
    cmd = [nvcc(), "-c", str(src), "-o", str(obj)] + fl
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode == 0:
        stamp.touch()
        obj.unlink(missing_ok=True)
    return src, proc.returncode == 0, proc.stdout + proc.stderr


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*", help=".cu files (default: every csrc/**/*.cu)")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)
    if nvcc() is None:
        print("check_cuda_compiles: nvcc not found (set NVCC or put it on PATH)", file=sys.stderr)
        return 2
    files = [Path(f).resolve() for f in args.files] or sorted((ROOT / "csrc").rglob("*.cu"))
    cache = Path(os.environ.get("ACCEL_NVCC_CACHE", Path.home() / ".cache" / "accel" / "nvcc"))
    cache.mkdir(parents=True, exist_ok=True)
    failed = 0
    with cf.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        for src, ok, out in pool.map(lambda f: compile_one(f, cache), files):
            rel = src.relative_to(ROOT) if src.is_relative_to(ROOT) else src
            print(f"{'ok  ' if ok else 'FAIL'} {rel}" + (" (cached)" if out == "cached" else ""), flush=True)
            if not ok:
                failed += 1
                print(out, file=sys.stderr)
    print(f"{len(files) - failed} compiled, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
