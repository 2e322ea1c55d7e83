"""Builds kvcache: the op library (libkvcache.so) and the pybind11 module _C.

The op library is plain C++ (no Python symbols), so LibTorch programs can link
it too. CUDA kernels are compiled when nvcc and a CUDA-enabled torch are both
present; a GPU is not needed.

Build prerequisites (checked up front, below): torch (the one the wheel will
run with), setuptools >= 77 and a C++20 compiler (g++ >= 10); nvcc for the
CUDA kernels; ninja is optional (parallel compiles). The pybind11 package is
not needed: _C uses the pybind11 headers bundled with torch.

Build with ``pip install --no-build-isolation .`` (or ``python -m build
--no-isolation``) so it compiles against the installed torch: an isolated
build cannot see it.

The build settings (version, flags, CUDA architectures) live in
cmake/build_settings.json, which CMakeLists.txt reads too. Environment
overrides:

  KVCACHE_CUDA=1|0|auto   force the CUDA build on or off (default: auto)
  TORCH_CUDA_ARCH_LIST    CUDA architectures (default: build_settings.json)
  KVCACHE_DEBUG=1         keep debug info (release builds strip it)
  MAX_JOBS                parallel compile jobs (ninja)

The built wheel requires the torch major.minor it was compiled against and
has a local version naming its backend (0.1.0+cpu, 0.1.0+cu130); the package
refuses, at import, a torch of another major.minor (_build_info.py, written
here at build time).
"""

import functools
import glob
import json
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = "csrc"
LIB_NAME = "kvcache.libkvcache"

with open(os.path.join(ROOT, "cmake", "build_settings.json"), encoding="utf-8") as _f:
    SETTINGS = json.load(_f)

# An sdist is only the sources: it needs neither torch nor a compiler.
SDIST_ONLY = "sdist" in sys.argv[1:]


def _fail(message: str):
    # SystemExit prints the message alone, without a traceback to read past.
    raise SystemExit(f"\nkvcache build: {message}\n")


def _version_tuple(text: str):
    return tuple(int(p) for p in re.findall(r"\d+", text)[:2])


# ---- Prerequisites -------------------------------------------------------

import setuptools  # noqa: E402

if _version_tuple(setuptools.__version__) < (77, 0):
    # pyproject.toml's SPDX license string (license = "Apache-2.0") needs it.
    _fail(
        f"setuptools >= 77 is needed, found {setuptools.__version__}: "
        "run `pip install 'setuptools>=77'`, then build again."
    )

from setuptools import find_packages, setup  # noqa: E402

if not SDIST_ONLY:
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        _isolated = any("pip-build-env" in p or "build-env-" in p for p in sys.path + [sys.prefix])
        _fail(
            "torch is not importable by this build.\n"
            + ("  This is an isolated build (pip's default, and `python -m build`'s): it runs in a\n"
               "  temporary environment that cannot see the torch you installed.\n" if _isolated else "")
            + "  kvcache compiles against the installed torch: install it first (for example\n"
            "  `pip install torch==2.13.0`), then build without isolation:\n"
            "    pip install --no-build-isolation .        (or -e . for development)\n"
            "    python -m build --no-isolation            (sdist and wheel)"
        )
    _cxx = os.environ.get("CXX", "c++").split()[0]
    if shutil.which(_cxx) is None:
        _fail(f"no C++ compiler ({_cxx!r} not found): install a C++20 compiler, "
              "e.g. `apt-get install g++` (g++ >= 10), or set CXX.")
    if not cpp_extension.is_ninja_available():
        print("kvcache build: ninja not found; compiling serially with the slower setuptools "
              "backend. `pip install ninja` for parallel builds (optional).", file=sys.stderr)


# ---- Settings (cmake/build_settings.json) ---------------------------------

def _want_cuda() -> bool:
    mode = os.environ.get("KVCACHE_CUDA", "auto").strip().lower()
    available = torch.version.cuda is not None and _nvcc() is not None
    if mode in ("1", "on", "true", "yes"):
        if not available:
            _fail(
                "KVCACHE_CUDA=1 but the CUDA build needs nvcc and a CUDA-enabled "
                f"torch (torch.version.cuda={torch.version.cuda!r}, "
                f"CUDA_HOME={cpp_extension.CUDA_HOME!r})"
            )
        return True
    if mode in ("0", "off", "false", "no"):
        return False
    if mode != "auto":
        _fail(f"KVCACHE_CUDA must be 1, 0 or auto, got {mode!r}")
    return available


def _nvcc():
    if cpp_extension.CUDA_HOME:
        path = os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc")
        if os.path.exists(path):
            return path
    return shutil.which("nvcc")


@functools.lru_cache(maxsize=None)
def _cuda_toolkit_version() -> str:
    """The CUDA toolkit nvcc belongs to, e.g. "13.0"."""
    out = subprocess.run([_nvcc(), "--version"], capture_output=True, text=True, check=True).stdout
    match = re.search(r"release (\d+)\.(\d+)", out)
    if not match:
        _fail(f"cannot read the CUDA version from `{_nvcc()} --version`:\n{out}")
    return f"{match.group(1)}.{match.group(2)}"


DEBUG = os.environ.get("KVCACHE_DEBUG", "0").strip().lower() in ("1", "on", "true", "yes")


def _cxx_flags():
    flags = [f"-std=c++{SETTINGS['cxx_standard']}", f"-fvisibility={SETTINGS['visibility']}"]
    # Python's CFLAGS carry -g (8 MB libraries instead of ~1 MB); a later -g0 wins.
    flags += ["-g", "-O0"] if DEBUG else [*SETTINGS["release_flags"], "-g0"]
    return flags


def _link_flags():
    return [] if DEBUG else ["-Wl,--strip-debug"]


def _glob(patterns):
    # Relative to the repository, as setuptools wants its sources.
    return [f for pattern in patterns for f in sorted(glob.glob(pattern, root_dir=ROOT))]


def _op_library(with_cuda: bool):
    sources = _glob(SETTINGS["sources"])
    cxx = _cxx_flags()
    link = ["-Wl,-soname,libkvcache.so", *_link_flags()]
    if SETTINGS["openmp"]:
        # The runtime is torch's own libgomp.so.1 (same soname, already loaded).
        cxx.append("-fopenmp")
        link.append("-fopenmp")
    macros = []
    # The op library has no Python in it: C++ programs can link it.
    kwargs = dict(
        include_dirs=[os.path.join(ROOT, CSRC), os.path.join(ROOT, CSRC, "include")],
        extra_link_args=link,
    )
    if with_cuda:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", SETTINGS["cuda_arch_list"])
        sources += _glob(SETTINGS["cuda_sources"])
        nvcc = [f"-std=c++{SETTINGS['cxx_standard']}",
                f"-Xcompiler=-fvisibility={SETTINGS['visibility']}",
                *(["-g"] if DEBUG else SETTINGS["release_flags"])]
        ext = cpp_extension.CUDAExtension(
            LIB_NAME, sources, define_macros=macros,
            extra_compile_args={"cxx": cxx, "nvcc": nvcc}, **kwargs,
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
        extra_compile_args={"cxx": _cxx_flags()},
        extra_link_args=_link_flags(),
    )


# ---- Version and dependencies ----------------------------------------------

def _local_version(with_cuda: bool) -> str:
    if not with_cuda:
        return "cpu"
    return "cu" + _cuda_toolkit_version().replace(".", "")


def _torch_requirement() -> str:
    major, minor = _version_tuple(torch.__version__)
    return f"torch>={major}.{minor},<{major}.{minor + 1}"


_BUILD_INFO = '''\
"""How this copy of kvcache was built (generated by setup.py; not in git).

Read at import, before libkvcache.so is loaded, so that a torch of another
major.minor is refused with a clear message instead of a symbol error.
"""

VERSION = {version!r}
TORCH_VERSION = {torch_version!r}  # the torch it was compiled against
TORCH_CUDA_VERSION = {torch_cuda!r}  # torch.version.cuda of that torch
WITH_CUDA = {with_cuda!r}  # CUDA kernels compiled in
CUDA_TOOLKIT = {cuda_toolkit!r}  # nvcc's CUDA version (None without CUDA)
'''

_CONFIG_VERSION = """\
# Generated by setup.py: find_package(kvcache <version>) accepts this build
# when the requested version has the same major and is not newer.
set(PACKAGE_VERSION "{version}")
if(PACKAGE_FIND_VERSION_MAJOR STREQUAL "" OR
   (PACKAGE_FIND_VERSION_MAJOR EQUAL {major} AND
    NOT PACKAGE_FIND_VERSION VERSION_GREATER PACKAGE_VERSION))
  set(PACKAGE_VERSION_COMPATIBLE TRUE)
  if(PACKAGE_FIND_VERSION VERSION_EQUAL PACKAGE_VERSION)
    set(PACKAGE_VERSION_EXACT TRUE)
  endif()
else()
  set(PACKAGE_VERSION_COMPATIBLE FALSE)
endif()
"""


if not SDIST_ONLY:
    class BuildExtension(cpp_extension.BuildExtension):
        """Names the op library libkvcache.so, lets _C link against it, and puts
        beside it what an installed package needs: _build_info.py, the C++
        headers (kvcache/include) and the CMake package config
        (kvcache/share/cmake/kvcache)."""

        def finalize_options(self):
            super().finalize_options()
            # Objects go to one fixed folder per configuration under this tree's build/
            # (setuptools' editable builds would use a fresh temporary one): ninja then
            # recompiles only what changed since the last build, and two trees (the
            # checkout, an unpacked sdist) compile with the same relative paths, which
            # ccache needs to share its cache between them (scripts/ccache_env.sh). An
            # explicit --build-temp is kept.
            if "build_temp" not in self.distribution.get_option_dict("build_ext"):
                backend = "cuda" if WITH_CUDA else "cpu"
                tag = f"{backend}-torch{torch.__version__.split('+')[0]}-py{sys.version_info[0]}{sys.version_info[1]}"
                self.build_temp = os.path.join(ROOT, "build", f"temp-{tag}{'-debug' if DEBUG else ''}")

        def run(self):
            super().run()
            pkg = os.path.dirname(self.get_ext_fullpath(LIB_NAME))
            self._write(os.path.join(pkg, "_build_info.py"), _BUILD_INFO.format(
                version=VERSION, torch_version=torch.__version__, torch_cuda=torch.version.cuda,
                with_cuda=WITH_CUDA, cuda_toolkit=_cuda_toolkit_version() if WITH_CUDA else None,
            ))
            include = os.path.join(pkg, "include", "kvcache")
            os.makedirs(include, exist_ok=True)
            for header in glob.glob(os.path.join(CSRC, "include", "kvcache", "*.h")):
                self.copy_file(header, include)
            cmake_dir = os.path.join(pkg, "share", "cmake", "kvcache")
            os.makedirs(cmake_dir, exist_ok=True)
            for name in ("kvcacheConfig.cmake", "kvcache_link_ops.cmake", "build_settings.json"):
                self.copy_file(os.path.join("cmake", name), cmake_dir)
            self._write(os.path.join(cmake_dir, "kvcacheConfigVersion.cmake"), _CONFIG_VERSION.format(
                version=SETTINGS["version"], major=SETTINGS["version"].split(".")[0]))

        @staticmethod
        def _write(path, text):
            old = None
            if os.path.exists(path):
                with open(path, encoding="utf-8") as f:
                    old = f.read()
            if old != text:  # keep the mtime (and the editable build's freshness check) when unchanged
                with open(path, "w", encoding="utf-8") as f:
                    f.write(text)

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


if SDIST_ONLY:
    # The sources only (MANIFEST.in): no backend, no torch pin. A wheel built
    # from it requires the torch it is compiled against.
    VERSION = SETTINGS["version"]
    setup(
        version=VERSION,
        install_requires=["torch>=2.13"],
        packages=find_packages("python"),
        package_dir={"": "python"},
        zip_safe=False,
    )
else:
    WITH_CUDA = _want_cuda()
    VERSION = f"{SETTINGS['version']}+{_local_version(WITH_CUDA)}"
    print(f"kvcache {VERSION}: building with CUDA={WITH_CUDA} (torch {torch.__version__}, "
          f"torch CUDA {torch.version.cuda}), requires {_torch_requirement()}")
    setup(
        version=VERSION,
        install_requires=[_torch_requirement()],
        packages=find_packages("python"),
        package_dir={"": "python"},
        ext_modules=[_op_library(WITH_CUDA), _python_module()],
        cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
        zip_safe=False,
    )
