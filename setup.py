"""Packaging. csrc/ ships inside the wheel as accel/_csrc so JIT builds work from any install.

Ahead-of-time kernel build: `ACCEL_BUILD_EXT=1 pip install --no-build-isolation .` compiles every
op in csrc/ (CUDA sources too when the installed torch sees a GPU) into accel/_ext/. Without it,
nothing here imports torch and the kernels are JIT-built on first use.
"""
import importlib.util
import os
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent


def _build_module():
    """accel/runtime/_build.py, loaded by path: the JIT build's source lists and flags are the ones used
    here too, without importing the accel package (and its dependencies) at install time."""
    spec = importlib.util.spec_from_file_location("_accel_build", ROOT / "accel" / "runtime" / "_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _extensions():
    if os.environ.get("ACCEL_BUILD_EXT", "0") in ("", "0"):
        return [], {}
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    build = _build_module()
    with_cuda = torch.cuda.is_available() or os.environ.get("ACCEL_BUILD_CUDA") == "1"
    exts = []
    for op in build.op_names():
        sources = [os.path.relpath(src, ROOT) for src in build.sources(op, cuda=with_cuda)]
        common = dict(include_dirs=[str(ROOT / "csrc")], extra_link_args=build.ld_flags())
        if any(src.endswith(".cu") for src in sources):
            exts.append(CUDAExtension(f"accel._ext.{op}", sources, **common, extra_compile_args={
                "cxx": build.cxx_flags(cuda=True, native=False), "nvcc": list(build.CUDA_FLAGS)}))
        else:
            exts.append(CppExtension(f"accel._ext.{op}", sources, **common,
                                     extra_compile_args=build.cxx_flags(cuda=False, native=False)))
    return exts, {"build_ext": BuildExtension}


ext_modules, cmdclass = _extensions()

setup(
    packages=find_packages(include=["accel", "accel.*"]) + ["accel._csrc"],
    package_dir={"accel._csrc": "csrc"},
    package_data={"accel._csrc": ["*.cpp", "*.h", "cpu/*.cpp", "cpu/*.h", "autograd/*.cpp", "autograd/*.h", "cuda/*.cu", "cuda/*.cuh"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
