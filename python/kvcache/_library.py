"""Finds and loads the compiled kvcache op library."""

from __future__ import annotations

import os

import torch

_LIB_DIR = os.path.dirname(os.path.abspath(__file__))
_LIB_NAME = "libkvcache.so"

_REBUILD = (
    "rebuild kvcache against the installed torch: in a source checkout, "
    "`pip install --no-build-isolation -e .` (or `pip install --no-build-isolation .`; "
    "from an sdist: `pip install --no-build-isolation kvcache-<version>.tar.gz`)"
)


def _major_minor(version: str) -> tuple[int, int]:
    parts = version.split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


def build_info_file():
    """Returns the generated ``kvcache._build_info`` module (written by setup.py).

    Raises:
        ImportError: If the package was not built (no ``_build_info.py``).
    """
    try:
        from . import _build_info
    except ImportError:
        raise ImportError(
            f"kvcache is not built (no _build_info.py in {_LIB_DIR}): build it with "
            "`pip install --no-build-isolation -e .` in the source checkout"
        ) from None
    return _build_info


def torch_mismatch(info, running_version: str, running_cuda: str | None) -> str | None:
    """Says why a build cannot load into a torch, or None when it can.

    Args:
        info: the build's record (``_build_info``: ``VERSION``,
            ``TORCH_VERSION``, ``TORCH_CUDA_VERSION``, ``WITH_CUDA``,
            ``CUDA_TOOLKIT``).
        running_version: the running torch's version (``torch.__version__``).
        running_cuda: its CUDA version (``torch.version.cuda``; None without CUDA).

    Returns:
        The error message (what differs and what to run), or None.
    """
    built = "%d.%d" % _major_minor(info.TORCH_VERSION)
    if _major_minor(running_version) != _major_minor(info.TORCH_VERSION):
        return (
            f"kvcache {info.VERSION} was built against torch {info.TORCH_VERSION}, "
            f"but torch {running_version} is installed; its C++ library only loads into "
            f"torch {built}.x: {_REBUILD}, or install torch=={built}.*"
        )
    if info.WITH_CUDA:
        built_cuda = (info.TORCH_CUDA_VERSION or info.CUDA_TOOLKIT).split(".")[0]
        if running_cuda is None or running_cuda.split(".")[0] != built_cuda:
            has = "has no CUDA" if running_cuda is None else f"uses CUDA {running_cuda}"
            return (
                f"kvcache {info.VERSION} has CUDA kernels built for CUDA {built_cuda}, but "
                f"torch {running_version} {has}: install a torch {built} built for "
                f"CUDA {built_cuda}, or {_REBUILD}"
            )
    return None


def check_torch() -> None:
    """Refuses a torch the op library was not compiled for, before loading it.

    libkvcache.so links against the C++ ABI of one torch major.minor; loaded
    into another it fails with an undefined symbol at best. The build records
    its torch in ``_build_info.py``, read here without loading the library.

    Raises:
        ImportError: If the package was not built, if the running torch's
            major.minor differs from the build's, or if the library has CUDA
            kernels and this torch has no CUDA (or another CUDA major). The
            message says what to run.
    """
    problem = torch_mismatch(build_info_file(), torch.__version__, torch.version.cuda)
    if problem is not None:
        raise ImportError(problem)


def version() -> str:
    """Returns kvcache's version with its backend, e.g. ``0.1.0+cpu``."""
    return build_info_file().VERSION


def library_path() -> str:
    """Returns the path of the compiled op library ``libkvcache.so``.

    Use it with ``torch.ops.load_library`` in a process that does not import
    ``kvcache``, or to link a LibTorch program against the operators.

    Returns:
        Absolute path of the shared library.

    Raises:
        FileNotFoundError: If the package was not built (run
            ``pip install --no-build-isolation -e .``).
    """
    path = os.path.join(_LIB_DIR, _LIB_NAME)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"kvcache op library not found at {path}: build the package with "
            "`pip install --no-build-isolation -e .`"
        )
    return path


def include_path() -> str:
    """Returns the folder of the C++ headers (``kvcache/kvcache.h``).

    Returns:
        Absolute path to add to a C++ program's include path. It exists in a
        source checkout (``csrc/include``) or an installed package
        (``kvcache/include``).

    Raises:
        FileNotFoundError: If neither exists.
    """
    for candidate in (
        os.path.join(_LIB_DIR, "include"),
        os.path.join(_LIB_DIR, os.pardir, os.pardir, "csrc", "include"),
    ):
        if os.path.exists(os.path.join(candidate, "kvcache", "kvcache.h")):
            return os.path.abspath(candidate)
    raise FileNotFoundError("kvcache C++ headers not found")


def load() -> None:
    """Checks the running torch, then loads the op library (``torch.ops.kvcache.*``).

    Importing ``kvcache._C`` loads ``libkvcache.so`` (the module links it),
    whose static initializers register the operators. A process must not
    also load another build of the library (``torch.ops.load_library`` of a
    CMake build): the second ``TORCH_LIBRARY(kvcache)`` fails to register.

    Raises:
        ImportError: If the package was not built, or was built for another
            torch (see :func:`check_torch`).
    """
    check_torch()
    from . import _C  # noqa: F401
