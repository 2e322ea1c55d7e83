"""Finds and loads the compiled kvcache op library."""

from __future__ import annotations

import os

_LIB_DIR = os.path.dirname(os.path.abspath(__file__))
_LIB_NAME = "libkvcache.so"


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
    """Loads the op library, registering ``torch.ops.kvcache.*``.

    Importing ``kvcache._C`` loads ``libkvcache.so`` (the module links it),
    whose static initializers register the operators. A process must not
    also load another build of the library (``torch.ops.load_library`` of a
    CMake build): the second ``TORCH_LIBRARY(kvcache)`` fails to register.
    """
    from . import _C  # noqa: F401
