"""Finds and loads the compiled kvcache op library."""

from __future__ import annotations

import os

import torch

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
    """
    here = os.path.dirname(os.path.abspath(__file__))
    for candidate in (
        os.path.join(here, "include"),
        os.path.join(here, os.pardir, os.pardir, "csrc", "include"),
    ):
        if os.path.exists(os.path.join(candidate, "kvcache", "kvcache.h")):
            return os.path.abspath(candidate)
    raise FileNotFoundError("kvcache C++ headers not found")


def load() -> None:
    """Loads the op library, registering ``torch.ops.kvcache.*``.

    Loading the same file again is a no-op; loading a second copy of the
    library (another build of it) would fail with a duplicate-registration
    error, so a process should use one build only.
    """
    if hasattr(torch.ops.kvcache, "update_"):
        return
    torch.ops.load_library(library_path())
