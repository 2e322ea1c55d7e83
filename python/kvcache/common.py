"""Shared internals of the cache family: argument normalisation, length checks, dtype handling.

:mod:`kvcache.cache` (contiguous rows), :mod:`kvcache.ring` (sliding-window rings),
:mod:`kvcache.rows` (row operations over either) and :mod:`kvcache.hf` import these by their
public names; each check exists once, so every layout raises the same error for the same
mistake. Not part of the user API (the package does not re-export them).
"""

import numbers
import operator
from typing import Optional

import torch

# The package's __init__ has loaded the operators (it runs before any submodule).
_update_op = torch.ops.kvcache.update_.default
_check_lengths_writable_op = torch.ops.kvcache.check_lengths_writable.default

#: The range of the int64 arguments the operators take.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

#: The spellings of a quantized cache's ``kv_dtype`` and the storage dtype of each.
KV_DTYPES = {
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
    torch.int8: torch.int8,
    torch.float8_e4m3fn: torch.float8_e4m3fn,
}


def kv_dtype_of(kv_dtype) -> Optional[torch.dtype]:
    """The storage dtype of a ``kv_dtype`` argument (None: a plain cache).

    Raises:
        TypeError: For a spelling other than None, "int8", "fp8", torch.int8, torch.float8_e4m3fn.
    """
    if kv_dtype is None:
        return None
    try:
        return KV_DTYPES[kv_dtype]
    except (KeyError, TypeError):
        raise TypeError(
            f'kv_dtype must be None, "int8", "fp8", torch.int8 or torch.float8_e4m3fn, got {kv_dtype!r}'
        ) from None


def check_length_writable(length: torch.Tensor) -> None:
    """Raises (ValueError) unless ``length`` can be written in place by a ``copy_``.

    Args:
        length: A cache's int32/int64 lengths, 0-D or ``(batch,)``.

    Raises:
        ValueError: An ``expand()``-ed (internally overlapping) length, or an inference tensor
            outside inference mode.
    """
    # Every wrapper that writes cache.length with a copy_ of an operator's new
    # lengths calls this before the operator runs, so that the copy cannot
    # fail after the op moved rows (select) and nothing changes on error: an
    # expand()ed length, an inference tensor outside inference mode (whose
    # copy_ writes, then raises). One C++ check (append_'s for its lengths),
    # also run by the fake kernel, so compiled code raises the same error.
    _check_lengths_writable_op(length)


def check_tensor_args(optional: tuple = (), **args) -> None:
    """Raises a TypeError naming the first of ``args`` that is not a tensor.

    The operators' own parsing would refuse a list or a numpy array with a RuntimeError; the
    Python API says TypeError, as for every other type mistake.

    Args:
        optional: The names that may also be ``None``.
        **args: Each argument's name and value, in the function's order.

    Raises:
        TypeError: ``"<name> must be a torch.Tensor (or None), got <type>"``.
    """
    for name, value in args.items():
        if isinstance(value, torch.Tensor) or (value is None and name in optional):
            continue
        alt = " or None" if name in optional else ""
        raise TypeError(f"{name} must be a torch.Tensor{alt}, got {type(value).__name__}")


def check_row_ints(t, name: str, keys: torch.Tensor) -> None:
    """Raises unless ``t`` is one int per row of ``keys``, as the operators take per-row lengths.

    Args:
        t: The tensor to check (``0-D`` or ``(batch,)``, int32 / int64, on ``keys``' device).
        name: Its name in the message.
        keys: The cache's ``(batch, ...)`` keys.

    Raises:
        TypeError: ``t`` not an int32 / int64 tensor.
        ValueError: Another shape or device.
    """
    if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be an int32 or int64 tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    batch = keys.shape[0]
    if not (t.dim() == 0 or (t.dim() == 1 and t.shape[0] == batch)):
        raise ValueError(f"{name} must be a 0-D tensor (one value for every row) or have shape (batch={batch},), "
                         f"got shape {tuple(t.shape)}")
    if t.device != keys.device:
        raise ValueError(f"{name} must be on the cache's device ({keys.device}), got {t.device}")


def check_scale_pair(k_scale, v_scale) -> None:
    """Raises (ValueError) unless both scales are set (a quantized cache) or neither (a plain one)."""
    # A quantized cache has both scales, a plain one neither.
    if (k_scale is None) != (v_scale is None):
        have, missing = ("k_scale", "v_scale") if v_scale is None else ("v_scale", "k_scale")
        raise ValueError(
            f"{missing} is None but {have} is set: a quantized cache needs both k_scale and v_scale, "
            "a plain cache neither"
        )


def check_scales(keys, values, k_scale, v_scale) -> None:
    """Checks a cache's scales as every quantized write does, writing nothing.

    Args:
        keys, values: The cache's ``(batch, num_kv_heads, max_len, head_dim)`` buffers.
        k_scale, v_scale: Its ``(batch, num_kv_heads, max_len)`` float32 scales, or both None.

    Raises:
        ValueError: One scale without the other, a wrong shape or device, or scales sharing
            memory with each other or the data.
        TypeError: Scales that are not float32.
    """
    # Writers that move a quantized cache's scales with a plain operator
    # (select_rows_ over (..., max_len, 1) views) call this before anything
    # moves: the quantized write's own checks, run by an empty write (nothing
    # is written): each scale float32 of shape (batch, num_kv_heads,
    # max_len) on the cache's device, and the two scales sharing no memory
    # with each other, the keys or the values. The same C++ checks and
    # messages as every quantized write; the fake kernel runs them too, so
    # compiled code refuses the same caches.
    check_scale_pair(k_scale, v_scale)
    if k_scale is None:
        return
    b, h, _, d = keys.shape
    empty = keys.new_empty((b, h, 0, d), dtype=torch.float32)
    _update_op(keys, values, empty, empty, 0, k_scale=k_scale, v_scale=v_scale)


def raise_out_of_range_start(start: int, keys_new, keys) -> None:
    """Raises the write's own ValueError for a Python int ``start`` outside int64."""
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    chunk = keys_new.shape[2] if isinstance(keys_new, torch.Tensor) and keys_new.dim() == 4 else 0
    max_len = keys.shape[2] if isinstance(keys, torch.Tensor) and keys.dim() == 4 else 0
    # The op's overflow message, naming the argument that does not fit.
    raise ValueError(
        f"KV cache overflow: end={start + chunk} exceeds max_len={max_len} (start={start} does not fit in int64)"
    )


@torch.jit.unused  # scripted callers pass TorchScript's typed options as they are
def check_real(**options) -> None:
    """Refuses attend options (``scale=``, ``softcap=``) that are not numbers (None passes: the default).

    Raises:
        TypeError: Naming the option, for a bool (``True`` would silently mean 1.0), a tensor
            (its value would be read on the host: a sync in eager, and torch.compile cannot pass
            it where the operators take a float) or a value that is not a real number (a str,
            ...); a Python or numpy number passes.
    """
    for name, value in options.items():
        if value is None:
            continue
        if isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a float or None, got a tensor: pass a Python number "
                            f"({name}=float(t); the operators take the value, not a tensor)")
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a float or None, got {type(value).__name__}")


@torch.jit.unused  # scripted callers pass TorchScript's typed window as it is
def as_window(window) -> int:
    """An attend ``window`` argument as the operators' int (``None``: 0, no window).

    Raises:
        TypeError: A ``window`` that is not an int (a float, a bool, a tensor: its value would be
            read on the host, and torch.compile cannot pass it where the operators take an int).
        ValueError: A ``window`` outside int64.
    """
    if window is None:
        return 0
    if isinstance(window, torch.Tensor):
        raise TypeError("window must be an int or None, got a tensor: pass a Python int (window=int(t); the "
                        "operators take the value, not a tensor)")
    w = as_int("window", window)
    if not INT64_MIN <= w <= INT64_MAX:
        raise ValueError(f"window must fit in int64 (0: no window), got {w}")
    return w


def as_int(name: str, value) -> int:
    """``value`` as a Python int (anything with ``__index__``, not bool).

    Raises:
        TypeError: Naming ``name``, for a bool or a value that is not an integer.
    """
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
