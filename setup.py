"""Packaging. csrc/ ships inside the wheel as accel/_csrc so JIT builds work from any install.

Ahead-of-time kernel build: `ACCEL_BUILD_EXT=1 pip install --no-build-isolation .` compiles every
op in csrc/ (CUDA sources too when the installed torch sees a GPU) into accel/_ext/. Without it,
nothing here imports torch and the kernels are JIT-built on first use.
"""
import os
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent


def _extensions():
    if os.environ.get("ACCEL_BUILD_EXT", "0") in ("", "0"):
        return [], {}
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    with_cuda = torch.cuda.is_available() or os.environ.get("ACCEL_BUILD_CUDA") == "1"
    # OpenMP: at::parallel_for only runs in parallel in code compiled with it (see _build.py).
    omp = ["-fopenmp"] if sys.platform.startswith("linux") else []
    exts = []
    for cpp in sorted((ROOT / "csrc" / "cpu").glob("*.cpp")):
        op = cpp.stem
        sources = ["csrc/bindings.cpp", f"csrc/cpu/{op}.cpp"]
        cu = ROOT / "csrc" / "cuda" / f"{op}.cu"
        if with_cuda and cu.exists():
            sources.append(f"csrc/cuda/{op}.cu")
            exts.append(CUDAExtension(f"accel._ext.{op}", sources, include_dirs=[str(ROOT / "csrc")],
                                      define_macros=[("WITH_CUDA", None)],
                                      extra_compile_args={"cxx": ["-O3"] + omp, "nvcc": ["-O3"]},
                                      extra_link_args=omp))
        else:
            exts.append(CppExtension(f"accel._ext.{op}", sources, include_dirs=[str(ROOT / "csrc")],
                                     extra_compile_args=["-O3"] + omp, extra_link_args=omp))
    return exts, {"build_ext": BuildExtension}


ext_modules, cmdclass = _extensions()

setup(
    packages=find_packages(include=["accel", "accel.*"]) + ["accel._csrc"],
    package_dir={"accel._csrc": "csrc"},
    package_data={"accel._csrc": ["*.cpp", "*.h", "cpu/*.cpp", "cpu/*.h", "cuda/*.cu", "cuda/*.cuh"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
