"""Row operations over every cache layout: rollback, select (reorder, fork) and reset.

For contiguous caches (:class:`kvcache.KVLayerCache`) and rings (:class:`kvcache.RingLayerCache`)
alike, each operation checks everything it will touch before it changes anything, with the
checks of :mod:`kvcache.common` and the operators' own, so that a mistake raises the same
error for either layout and leaves the cache as it was.
"""

import warnings
from typing import Optional, Union

import torch

from .cache import KVLayerCache
from .common import (INT64_MAX, INT64_MIN, as_int, check_length_writable, check_row_ints, check_scale_pair,
                     check_scales, check_tensor_args)
from .ring import RingLayerCache, check_ring, ring_write

_rollback_op = torch.ops.kvcache.rollback.default
_select_rows_op = torch.ops.kvcache.select_rows_.default
_reset_rows_op = torch.ops.kvcache.reset_rows.default


def rollback_kv_layer_cache(
    cache: KVLayerCache, n: Union[int, torch.Tensor], *, kv_start: Optional[torch.Tensor] = None
) -> KVLayerCache:
    """Drops the last ``n`` tokens of each row, in place (``length -= n``).

    Nothing is copied: later writes overwrite the stale slots and
    :func:`attend` never reads past ``length``. With per-row ``n`` this is
    how batched speculative decoding rejects draft tokens.

    Args:
        cache: The cache; its ``length`` is changed in place.
        n: Tokens to drop: an int (every row), or an int tensor on the
            cache's device, 0-D or of ``length``'s shape.
        kv_start: ``(batch,)`` first valid slot of each row; a row may not go
            below it. ``None`` means 0.

    Returns:
        ``cache`` itself.

    Raises:
        ValueError: If ``n`` is negative or larger than a row holds (CPU;
            nothing changes; also for a Python int outside int64), or
            ``cache.length`` cannot be written in place (an ``expand()``-ed
            view: nothing changes). On CUDA every length becomes -1 instead
            (check ``(cache.length >= 0).all()`` where a sync is fine).
        TypeError: If ``n`` is not an int or an integer tensor.

    A 0-D ``cache.length`` (one length for every row) with a ``(batch,)``
    ``kv_start`` is checked row by row against the shared length, as
    :func:`attend` takes that pair.
    """
    if not isinstance(cache, KVLayerCache):
        raise TypeError(f"cache must be a KVLayerCache, got {type(cache).__name__}")
    if not isinstance(n, torch.Tensor):
        n = as_int("n", n)
        # torch.tensor would raise "Overflow when unpacking long long": say
        # what the op says, naming n.
        if n < INT64_MIN:
            raise ValueError(f"n must be >= 0, got {n}")
        if n > INT64_MAX:
            raise ValueError(f"cannot roll back more tokens than the row holds: n={n} does not fit in int64")
        n = torch.tensor(n, dtype=torch.int64, device=cache.length.device)
    check_tensor_args(kv_start=kv_start, optional=("kv_start",))
    check_length_writable(cache.length)
    cache.length.copy_(_rollback_op(cache.length, n, kv_start=kv_start))
    return cache


def select_rows_kv_layer_cache(cache: KVLayerCache, index: torch.Tensor) -> KVLayerCache:
    """Row ``b`` takes the contents of row ``index[b]``, for every row, in place.

    Beam-search reordering, forking one prompt into several samples, or
    compacting a batch: keys, values (and a quantized cache's scales) and
    length of each row become those of row ``index[b]`` (a permutation, repeats or any selection), the buffers
    keep their addresses, and only the filled slots move (O(content)).

    Args:
        cache: The cache; changed in place. Its ``length`` is 0-D (every row
            the same) or ``(batch,)``.
        index: ``(batch,)`` int32/int64 tensor on the cache's device, each in
            ``[0, batch)``.

    Returns:
        ``cache`` itself.

    Raises:
        ValueError: An index out of range (CPU; nothing changes; on CUDA
            nothing is written and every length becomes -1), shapes and
            devices that do not fit (a quantized cache's ``k_scale`` /
            ``v_scale`` must be ``(batch, num_kv_heads, max_len)``), scales
            that share memory with each other, the keys or the values, or a
            ``cache.length`` that cannot be written in place (an
            ``expand()``-ed view). Nothing is moved.
        TypeError: If ``index`` is not an integer tensor, or the scales are
            not float32.
    """
    if not isinstance(cache, KVLayerCache):
        raise TypeError(f"cache must be a KVLayerCache, got {type(cache).__name__}")
    check_tensor_args(index=index)
    check_length_writable(cache.length)
    quantized = cache.k_scale is not None or cache.v_scale is not None
    if quantized:
        check_scales(cache.keys, cache.values, cache.k_scale, cache.v_scale)
        _check_scales_index(cache.k_scale, cache.v_scale, index)
    length = _select_rows_op(cache.keys, cache.values, cache.length, index)
    if quantized:
        # The scales are indexed like the slots: moved as (..., max_len, 1) caches by the same
        # operator (index and scales were checked above).
        _select_rows_op(cache.k_scale.unsqueeze(-1), cache.v_scale.unsqueeze(-1), cache.length, index)
    cache.length.copy_(length)
    return cache


def _check_scales_index(k_scale: torch.Tensor, v_scale: torch.Tensor, index: torch.Tensor) -> None:
    # The scales move in a second select_rows_ call, after the data: its checks of the index against
    # the scales (shape, range, no memory shared with them) run here first, by a call over lengths of
    # 0, which moves nothing, so that a refusal comes before the data move.
    zero = torch.zeros((), dtype=torch.int32, device=k_scale.device)
    _select_rows_op(k_scale.unsqueeze(-1), v_scale.unsqueeze(-1), zero, index)


def reset_rows_kv_layer_cache(cache: KVLayerCache, rows: torch.Tensor) -> KVLayerCache:
    """Empties the given rows (their ``length`` becomes 0), in place, in O(1) per row.

    Nothing is zeroed: slots past a row's length are never read, and the next
    write overwrites them. For continuous batching, where a finished row takes
    a new request. One ``reset_rows`` operator call computes the new lengths
    (every row checked first), then they are copied into ``cache.length``.

    Args:
        cache: The cache, with a per-row ``length`` of shape ``(batch,)``.
        rows: A ``(batch,)`` bool mask (exactly ``batch`` entries), or an
            int32/int64 tensor (0-D or 1-D) of row indices in ``[0, batch)``
            (repeats allowed), on the cache's device.

    Returns:
        ``cache`` itself.

    Raises:
        ValueError: If ``cache.length`` is 0-D (one length shared by every
            row cannot be reset for some rows only) or cannot be written in
            place (an ``expand()``-ed view), a mask has not exactly ``batch``
            entries, an index is outside ``[0, batch)`` (negative ones too:
            no wrap-around), or ``rows`` is on another device. Nothing
            changes. On CUDA an index out of range makes every length -1
            instead (check ``(cache.length >= 0).all()``).
        TypeError: If ``rows`` is not a bool, int32 or int64 tensor.
    """
    if not isinstance(cache, KVLayerCache):
        raise TypeError(f"cache must be a KVLayerCache, got {type(cache).__name__}")
    if not isinstance(rows, torch.Tensor):
        raise TypeError(
            f"rows must be a bool mask or an int32 or int64 tensor of row indices, got {type(rows).__name__}"
        )
    check_length_writable(cache.length)
    cache.length.copy_(_reset_rows_op(cache.length, rows))
    return cache


def rollback_ring_layer_cache(
    cache: RingLayerCache, n: Union[int, torch.Tensor], *, kv_start: Optional[torch.Tensor] = None
) -> RingLayerCache:
    """Drops the last ``n`` tokens of each row (``length -= n``), in place.

    Length arithmetic only: the dropped slots keep positions at or past the
    new length, which :func:`attend_ring` never reads, and the next write
    overwrites them. Exact after any number of wraps as long as no write
    starts more than ``max_step`` below the furthest position written.

    Args:
        cache: The ring; ``length`` changes in place.
        n: Tokens to drop: an int (every row) or an int tensor, 0-D or of
            ``length``'s shape.
        kv_start: First valid position per row; a row may not go below it.

    Returns:
        ``cache`` itself.

    Raises:
        ValueError: An int ``n`` above ``max_step`` or negative, or more
            than a row holds (CPU; on CUDA every length becomes -1). A tensor
            ``n`` above ``max_step`` is not checked (that would sync): the
            queries that lost positions then get NaN.
        TypeError: If ``n`` is not an int or an integer tensor.
    """
    check_ring(cache)
    if not isinstance(n, torch.Tensor):
        n = as_int("n", n)
        if n > cache.max_step:
            raise ValueError(
                f"a ring rolls back at most max_step={cache.max_step} tokens exactly, got n={n} "
                "(make the ring with a larger max_step)"
            )
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        n = torch.tensor(n, dtype=torch.int64, device=cache.length.device)
    check_tensor_args(kv_start=kv_start, optional=("kv_start",))
    check_length_writable(cache.length)
    cache.length.copy_(_rollback_op(cache.length, n, kv_start=kv_start))
    return cache


def check_ring_tensors(cache: RingLayerCache) -> None:
    # The ring write's own checks of the ring's tensors, run by an empty write
    # (no slot, no position is written): positions of shape (batch,
    # capacity), and a quantized ring's scales of shape (batch, num_kv_heads,
    # capacity), float32, sharing no memory with each other, the data or the
    # positions. The same C++ checks (and messages) as every ring write, run
    # by the fake kernels too, so compiled code refuses the same rings.
    check_scale_pair(cache.k_scale, cache.v_scale)
    b, h, _, d = cache.keys.shape
    if cache.k_scale is None:
        empty = cache.keys.new_empty((b, h, 0, d))
    else:
        empty = cache.keys.new_empty((b, h, 0, d), dtype=torch.float32)
    ring_write(cache, empty, empty, torch.zeros((), dtype=torch.int32, device=cache.keys.device))


def select_rows_ring_layer_cache(cache: RingLayerCache, index: torch.Tensor) -> RingLayerCache:
    """Row ``b`` takes keys, values, positions and length of row ``index[b]``, in place.

    Beam search and forking on a ring: every slot of the selected rows moves
    (``select_rows_`` over the whole capacity), with the positions (and a
    quantized ring's scales). Everything is checked before anything moves.

    Args:
        cache: The ring.
        index: ``(batch,)`` int32/int64 on the cache's device, in ``[0, batch)``.

    Returns:
        ``cache`` itself.

    Raises:
        ValueError: An index out of range (CPU: nothing changes; CUDA:
            nothing is written and every length becomes -1); shapes and
            devices that do not fit: ``positions`` not ``(batch, capacity)``,
            a quantized ring's ``k_scale`` / ``v_scale`` not ``(batch,
            num_kv_heads, capacity)`` or sharing memory with each other, the
            keys, the values or the positions; a ``cache.length`` that cannot
            be written in place (an ``expand()``-ed view). Nothing moves.
        TypeError: If ``index`` is not an integer tensor, or the scales are
            not float32.
    """
    check_ring(cache)
    check_tensor_args(index=index)
    check_length_writable(cache.length)
    check_ring_tensors(cache)
    # The operator moves whole rows (a full length), so the ring's own length, which moves after
    # the data, is checked here: 0-D or (batch,), int32 / int64, on the cache's device.
    check_row_ints(cache.length, "length", cache.keys)
    if cache.k_scale is not None:
        _check_scales_index(cache.k_scale, cache.v_scale, index)
    full = torch.full((), cache.capacity, dtype=torch.int32, device=cache.length.device)
    # Validates index (CPU: raises before any write; CUDA: -1 and no write).
    moved = _select_rows_op(cache.keys, cache.values, full, index)
    if cache.k_scale is not None:  # the scales move with their slots (index and scales were checked above)
        _select_rows_op(cache.k_scale.unsqueeze(-1), cache.v_scale.unsqueeze(-1), full, index)
    ok = moved >= 0
    batch = cache.positions.shape[0]
    safe = index.clamp(0, max(batch - 1, 0)).long()
    cache.positions.copy_(torch.where(ok, cache.positions.index_select(0, safe), cache.positions))
    length = cache.length.index_select(0, safe) if cache.length.dim() == 1 else cache.length
    cache.length.copy_(torch.where(ok, length, -1))
    return cache


def reset_rows_ring_layer_cache(cache: RingLayerCache, rows: torch.Tensor) -> RingLayerCache:
    """Empties the given rows: length 0 and every slot's position -1, in place.

    Keys and values are not zeroed (empty slots are never read). The rows are
    checked by the ``reset_rows`` operator, as
    :func:`kvcache.reset_rows_kv_layer_cache` checks them, before anything
    changes: one call computes the new lengths, a second (over lengths of 1)
    marks the rows to empty (0), whose positions are then set to -1.

    Args:
        cache: The ring, with a per-row ``length`` of shape ``(batch,)``.
        rows: A ``(batch,)`` bool mask (exactly ``batch`` entries), or an
            int32/int64 tensor (0-D or 1-D) of row indices in ``[0, batch)``
            (repeats allowed), on the cache's device.

    Returns:
        ``cache`` itself.

    Raises:
        ValueError: If ``cache.length`` is 0-D or cannot be written in place
            (an ``expand()``-ed view), a mask has not exactly ``batch``
            entries, an index is outside ``[0, batch)`` (negative ones too:
            no wrap-around), or ``rows`` is on another device. Nothing
            changes. On CUDA an index out of range makes every length -1
            instead, and no position is cleared (check
            ``(cache.length >= 0).all()``).
        TypeError: If ``cache`` is not a :class:`RingLayerCache`, or ``rows``
            is not a bool, int32 or int64 tensor.
    """
    check_ring(cache)
    if cache.length.dim() != 1:
        raise ValueError(
            "reset_rows_ring_layer_cache needs a per-row length of shape (batch,), got a "
            f"{cache.length.dim()}-D length: make it per-row with length.expand(batch).clone() first"
        )
    if not isinstance(rows, torch.Tensor):
        raise TypeError(
            f"rows must be a bool mask or an int32 or int64 tensor of row indices, got {type(rows).__name__}"
        )
    check_length_writable(cache.length)
    check_ring_tensors(cache)  # positions (batch, capacity) int32, writable, as every ring write
    # Every row is checked here (CPU: raises; CUDA: every entry -1), before
    # anything is written.
    length = _reset_rows_op(cache.length, rows)
    # The rows emptied: 0 where a length of 1 was reset. All -1 (CUDA, a bad
    # index): no row, so no position is cleared and the lengths become -1.
    emptied = _reset_rows_op(torch.ones_like(cache.length), rows) == 0
    cache.positions.masked_fill_(emptied.view(-1, 1), -1)
    cache.length.copy_(length)
    return cache


# Names of the previous release, kept for one release: every operation beyond the original
# module is now <operation>_kv_layer_cache, as in the C++ API.
def _warn_renamed(old: str, new: str) -> None:
    if not torch.compiler.is_compiling():  # warnings.warn is a graph break: warn in eager code only
        warnings.warn(f"kvcache.{old} is deprecated: use kvcache.{new}", DeprecationWarning, stacklevel=3)


def select_kv_layer_cache_rows(cache: KVLayerCache, index: torch.Tensor) -> KVLayerCache:
    """Deprecated alias of :func:`select_rows_kv_layer_cache` (removed in the next release).

    Warns (``DeprecationWarning``) when called eagerly; compiled code
    (``torch.compile``, ``fullgraph=True`` included) calls it without a
    warning, since ``warnings.warn`` would break the graph.
    """
    _warn_renamed("select_kv_layer_cache_rows", "select_rows_kv_layer_cache")
    return select_rows_kv_layer_cache(cache, index)


def reset_kv_layer_cache_rows(cache: KVLayerCache, rows: torch.Tensor) -> KVLayerCache:
    """Deprecated alias of :func:`reset_rows_kv_layer_cache` (removed in the next release).

    Warns (``DeprecationWarning``) when called eagerly; compiled code
    (``torch.compile``, ``fullgraph=True`` included) calls it without a
    warning, since ``warnings.warn`` would break the graph.
    """
    _warn_renamed("reset_kv_layer_cache_rows", "reset_rows_kv_layer_cache")
    return reset_rows_kv_layer_cache(cache, rows)
