"""Builds kvcache: the op library (libkvcache.so) and a small pybind11 module.

The op library is plain C++ (no Python symbols), so LibTorch programs can link
it too. CUDA kernels are compiled when nvcc and a CUDA-enabled torch are both
present; a GPU is not needed. Environment overrides:

  KVCACHE_CUDA=1|0|auto   force the CUDA build on or off (default: auto)
  TORCH_CUDA_ARCH_LIST    CUDA architectures (default: "8.0;9.0")
  MAX_JOBS                parallel compile jobs (ninja)

Build with ``pip install --no-build-isolation .`` so it compiles against the
torch already installed, not a freshly downloaded one.
"""

import glob
import os
import shutil

from setuptools import find_packages, setup

try:
    import torch
    from torch.utils import cpp_extension
except ImportError as exc:  # pragma: no cover - build-time guard
    raise RuntimeError(
        "kvcache compiles against the installed torch: install torch first, "
        "then run `pip install --no-build-isolation .`"
    ) from exc

import pybind11

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join("csrc")
LIB_NAME = "kvcache.libkvcache"
DEFAULT_ARCHS = "8.0;9.0"


def _want_cuda() -> bool:
    mode = os.environ.get("KVCACHE_CUDA", "auto").strip().lower()
    available = torch.version.cuda is not None and (
        cpp_extension.CUDA_HOME is not None or shutil.which("nvcc") is not None
    )
    if mode in ("1", "on", "true", "yes"):
        if not available:
            raise RuntimeError(
                "KVCACHE_CUDA=1 but the CUDA build needs nvcc and a CUDA-enabled "
                f"torch (torch.version.cuda={torch.version.cuda!r}, "
                f"CUDA_HOME={cpp_extension.CUDA_HOME!r})"
            )
        return True
    if mode in ("0", "off", "false", "no"):
        return False
    if mode != "auto":
        raise RuntimeError(f"KVCACHE_CUDA must be 1, 0 or auto, got {mode!r}")
    return available


def _op_library(with_cuda: bool):
    sources = sorted(glob.glob(os.path.join(CSRC, "*.cpp")))
    for sub in ("core", "ops", "cpu"):
        sources += sorted(glob.glob(os.path.join(CSRC, sub, "*.cpp")))
    # No -std flag: torch.utils.cpp_extension picks the standard its headers
    # need (C++20 for torch >= 2.13).
    # -fopenmp: at::parallel_for is inline in ATen's headers and runs
    # serially unless the including code is compiled with OpenMP. The
    # runtime is torch's own libgomp.so.1 (same soname, already loaded).
    cxx = ["-O3", "-fvisibility=hidden", "-fopenmp"]
    macros = []
    # The op library has no Python in it: C++ programs can link it.
    kwargs = dict(
        include_dirs=[os.path.join(ROOT, CSRC), os.path.join(ROOT, CSRC, "include")],
        extra_link_args=["-Wl,-soname,libkvcache.so", "-fopenmp"],
    )
    if with_cuda:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCHS)
        sources += sorted(glob.glob(os.path.join(CSRC, "cuda", "*.cu")))
        macros += [
            ("KVCACHE_WITH_CUDA", None),
            ("KVCACHE_CUDA_VERSION", f'"{torch.version.cuda}"'),
            ("KVCACHE_CUDA_ARCHS", f'"{os.environ["TORCH_CUDA_ARCH_LIST"]}"'),
        ]
        ext = cpp_extension.CUDAExtension(
            LIB_NAME,
            sources,
            define_macros=macros,
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3"]},
            **kwargs,
        )
    else:
        ext = cpp_extension.CppExtension(
            LIB_NAME, sources, define_macros=macros,
            extra_compile_args={"cxx": cxx}, **kwargs,
        )
    ext.libraries = [lib for lib in ext.libraries if lib != "torch_python"]
    return ext


def _python_module():
    # The pybind11 module: loads the op library and exposes its checks to
    # the fake kernels (torch's pybind11 casters for Tensor and SymInt).
    return cpp_extension.CppExtension(
        "kvcache._C",
        [os.path.join(CSRC, "python", "module.cpp")],
        include_dirs=[os.path.join(ROOT, CSRC), os.path.join(ROOT, CSRC, "include")],
        libraries=["kvcache"],
        runtime_library_dirs=["$ORIGIN"],
        extra_compile_args={"cxx": ["-O2", "-fvisibility=hidden"]},
    )


class BuildExtension(cpp_extension.BuildExtension):
    """Names the op library libkvcache.so, lets _C link against it, and puts
    the C++ headers beside it (kvcache/include) for LibTorch users."""

    def run(self):
        super().run()
        for header in glob.glob(os.path.join(CSRC, "include", "kvcache", "*.h")):
            dest_dir = os.path.join(
                os.path.dirname(self.get_ext_fullpath(LIB_NAME)), "include", "kvcache"
            )
            os.makedirs(dest_dir, exist_ok=True)
            self.copy_file(header, dest_dir)

    def get_ext_filename(self, fullname):
        parts = fullname.split(".")
        if parts[-1] == LIB_NAME.rsplit(".", 1)[-1]:
            return os.path.join(*parts[:-1], "libkvcache.so")
        return super().get_ext_filename(fullname)

    def build_extension(self, ext):
        os.makedirs(os.path.dirname(self.get_ext_fullpath(ext.name)), exist_ok=True)
        if ext.name == "kvcache._C":
            lib_dir = os.path.dirname(self.get_ext_fullpath(LIB_NAME))
            ext.library_dirs = [lib_dir] + list(ext.library_dirs)
        super().build_extension(ext)


WITH_CUDA = _want_cuda()
print(f"kvcache: building with CUDA={WITH_CUDA} (torch {torch.__version__}, "
      f"torch CUDA {torch.version.cuda})")

setup(
    packages=find_packages("python"),
    package_dir={"": "python"},
    ext_modules=[_op_library(WITH_CUDA), _python_module()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    zip_safe=False,
)
