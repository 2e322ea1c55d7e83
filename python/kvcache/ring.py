"""Sliding-window ring caches with attention sinks.

A :class:`RingLayerCache` holds one attention layer's keys and values for a
sliding-window layer in ``sinks + window + max_step - 1`` slots instead of
``max_len``: position ``p`` lives at slot ``p`` if ``p < sinks``, else at
``sinks + (p - sinks) % (capacity - sinks)``, and each slot records the
logical position it holds (``positions``, ``-1``: empty), written by the same
operator call as the keys and values (``torch.ops.kvcache.update_.Tensor`` with
``positions`` and ``sinks``, the write a linear cache takes with a device start;
a quantized ring's data, scales and positions by the same call with
``k_scale`` / ``v_scale``).
``length`` is the logical length (the next position), so rollback stays
length arithmetic, and the graph of a decode step is the same before and
after the ring wraps.

:func:`kvcache.attend` reads a ring by the recorded positions: a query at
position ``p`` of a row with first valid position ``kv_start`` sees the slot
holding position ``q`` iff ``kv_start <= q <= p`` and (``q < sinks`` or
``p - q < window``); the window counts the query itself, as transformers'
sliding layers do. Empty and stale slots are never read.

Exactness: every query sees exactly the positions that rule asks for as long
as (1) a write of more than ``max_step`` tokens is attended through
:func:`write_ring_layer_cache` (which then attends over the ring's previous
slots plus the chunk), and (2) a write never starts more than ``max_step``
positions below the highest position written so far (rolling back at most
``max_step`` tokens from the furthest point decoded). When a query finds
fewer of its positions than the rule asks for (a deeper rollback), its
output is NaN, never a silently different answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from .common import as_int, check_length_writable, check_real, check_tensor_args, kv_dtype_of

_init_op = torch.ops.kvcache.init_layer_cache.default
_write_op = torch.ops.kvcache.update_.Tensor
_attend_op = torch.ops.kvcache.attend.default
_update_op = torch.ops.kvcache.update_.default

#: Default ``max_step`` (R): the most tokens one write may add and still be
#: attended inside the ring, and the furthest rollback. 64 covers speculative
#: decoding drafts and decode batches at 1.6% of a 4096 window's memory;
#: longer prompts go through the exact long-chunk path of
#: :func:`write_ring_layer_cache`.
DEFAULT_MAX_STEP = 64

_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class RingLayerCache:
    """A sliding-window layer's KV cache as a ring of slots.

    Args:
        keys: ``(batch, num_kv_heads, capacity, head_dim)``, capacity =
            ``sinks + window + max_step - 1``.
        values: Same shape and dtype as ``keys`` (its own storage).
        positions: ``(batch, capacity)`` int32: the logical position each
            slot holds, ``-1`` for an empty slot.
        length: int32 logical length (next position to write), 0-D or
            ``(batch,)``.
        window: The sliding window (a query sees itself and the
            ``window - 1`` positions before it), >= 1.
        sinks: The first ``sinks`` positions, always visible.
        max_step: R: the most tokens a write may add and be attended in the
            ring, and the deepest exact rollback.
        k_scale: A quantized ring's (int8 / float8_e4m3fn ``keys``) float32
            key scales ``(batch, num_kv_heads, capacity)``, one per slot,
            indexed like the slots (README "Quantized caches"); ``None`` for
            a plain ring.
        v_scale: The same for the values.
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    length: torch.Tensor
    window: int
    sinks: int = 0
    max_step: int = DEFAULT_MAX_STEP
    k_scale: Optional[torch.Tensor] = None
    v_scale: Optional[torch.Tensor] = None

    @property
    def quantized(self) -> bool:
        """Whether keys/values are int8 / fp8 with per-slot scales."""
        return self.k_scale is not None

    @property
    def capacity(self) -> int:
        """Slots per row, ``sinks + window + max_step - 1``."""
        return int(self.keys.shape[2])


@dataclass(frozen=True)
class RingKV:
    """What one step's queries attend over (see :func:`write_ring_layer_cache`).

    The ring's own buffers after the write (a chunk of at most ``max_step``
    tokens), or a temporary concatenation of the ring's slots from before
    the write and the chunk (longer chunks). Pass it to :func:`kvcache.attend`.

    Args:
        keys: ``(batch, num_kv_heads, slots, head_dim)``.
        values: Same shape as ``keys``.
        positions: ``(batch, slots)`` int32 logical positions (-1: empty).
        length: int32 logical length after the write, 0-D or ``(batch,)``.
        window: The ring's window.
        sinks: The ring's sinks.
        k_scale, v_scale: A quantized ring's scales ``(batch, num_kv_heads,
            slots)`` (``None`` for a plain ring).
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    length: torch.Tensor
    window: int
    sinks: int = 0
    k_scale: Optional[torch.Tensor] = None
    v_scale: Optional[torch.Tensor] = None


def init_ring_layer_cache(
    batch_size: int,
    num_kv_heads: int,
    head_dim: int,
    window: int,
    dtype: torch.dtype,
    device: Optional[Union[torch.device, str]] = None,
    *,
    sinks: int = 0,
    max_step: int = DEFAULT_MAX_STEP,
    kv_dtype=None,
) -> RingLayerCache:
    """Creates an empty :class:`RingLayerCache` (zero buffers, every slot empty).

    Args:
        batch_size: Batch dimension.
        num_kv_heads: Number of KV heads.
        head_dim: Per-head feature dimensionality.
        window: Sliding window, >= 1 (transformers' ``sliding_window``).
        dtype: Buffer dtype (with ``kv_dtype``: not stored; keys/values
            written and queries may be float32, bfloat16 or float16).
        device: Buffer device; ``None`` means CPU.
        sinks: Attention sinks: the first ``sinks`` positions stay visible
            to every query (StreamingLLM). Default 0.
        max_step: R, >= 1: the most tokens one write may add and be attended
            inside the ring, and the deepest exact rollback (default
            :data:`DEFAULT_MAX_STEP`).
        kv_dtype: ``None`` (a plain ring of ``dtype``), or ``"int8"`` /
            ``torch.int8`` / ``"fp8"`` / ``torch.float8_e4m3fn``: a quantized
            ring with one float32 scale per (row, KV head, slot), the formats
            of :func:`kvcache.init_kv_layer_cache`'s ``kv_dtype``.

    Returns:
        :class:`RingLayerCache` of ``sinks + window + max_step - 1`` slots per
        row, ``positions`` all -1 and a 0-D ``length`` of 0.

    Raises:
        TypeError: If a size is not an int, ``dtype`` is not a torch.dtype or
            ``kv_dtype`` is not one of its spellings.
        ValueError: If ``window`` or ``max_step`` is < 1, ``sinks`` < 0, a
            size is negative, or the capacity reaches 2**31.
    """
    window = as_int("window", window)
    sinks = as_int("sinks", sinks)
    max_step = as_int("max_step", max_step)
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if sinks < 0:
        raise ValueError(f"sinks must be >= 0, got {sinks}")
    if max_step < 1:
        raise ValueError(f"max_step must be >= 1, got {max_step}")
    capacity = sinks + window + max_step - 1
    if capacity > _INT32_MAX:
        raise ValueError(
            f"sinks + window + max_step - 1 = {capacity} slots: a ring holds at most {_INT32_MAX} (int32 positions)"
        )
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
    stored = kv_dtype_of(kv_dtype)
    dev = torch.device(device) if device is not None else None
    keys, values, length = _init_op(
        as_int("batch_size", batch_size),
        as_int("num_kv_heads", num_kv_heads),
        as_int("head_dim", head_dim),
        capacity,
        dtype=stored if stored is not None else dtype,
        device=dev,
    )
    positions = torch.full((keys.shape[0], capacity), -1, dtype=torch.int32, device=keys.device)
    k_scale = v_scale = None
    if stored is not None:
        k_scale = torch.ones(keys.shape[:3], dtype=torch.float32, device=keys.device)
        v_scale = torch.ones(keys.shape[:3], dtype=torch.float32, device=keys.device)
    return RingLayerCache(keys, values, positions, length, window, sinks, max_step, k_scale, v_scale)


def _quantize_chunk(cache: RingLayerCache, keys_new, values_new):
    # The chunk quantized into a chunk-sized buffer by update_ with scales,
    # for what a chunk longer than max_step attends over
    # (write_ring_layer_cache): the ring keeps only its last positions, the
    # chunk's queries see them all. The same quantizer as the ring write's (per slot,
    # deterministic), so these are exactly the bytes and scales the ring
    # stores for the positions it keeps. O(chunk), never O(capacity).
    if not isinstance(keys_new, torch.Tensor) or keys_new.dim() != 4:
        shape = tuple(keys_new.shape) if isinstance(keys_new, torch.Tensor) else type(keys_new).__name__
        raise ValueError(f"keys_new must be (batch, num_kv_heads, chunk, head_dim), got {shape}")
    b, h, c, d = keys_new.shape
    dev = keys_new.device
    tk = torch.empty((b, h, c, d), dtype=cache.keys.dtype, device=dev)
    tv = torch.empty((b, h, c, d), dtype=cache.keys.dtype, device=dev)
    tks = torch.empty((b, h, c), dtype=torch.float32, device=dev)
    tvs = torch.empty((b, h, c), dtype=torch.float32, device=dev)
    _update_op(tk, tv, keys_new, values_new, 0, k_scale=tks, v_scale=tvs)
    return tk, tv, tks, tvs


def ring_write(cache: RingLayerCache, keys_new, values_new, start_t) -> torch.Tensor:
    """The ring's write of one chunk, one operator call; returns the new length.

    ``update_.Tensor`` with the ring's ``positions`` and ``sinks`` (the write of every layout
    with a device start; ``positions`` makes it a ring's): a quantized ring's data, scales and
    positions are quantized and placed by the same call (given the ring's ``k_scale`` /
    ``v_scale``; None for a plain ring). The shared core of every ring write
    (:mod:`kvcache.rows` runs it with an empty chunk to check a ring's tensors).
    """
    check_tensor_args(keys_new=keys_new, values_new=values_new)
    return _write_op(
        cache.keys,
        cache.values,
        keys_new,
        values_new,
        start_t,
        k_scale=cache.k_scale,
        v_scale=cache.v_scale,
        positions=cache.positions,
        sinks=cache.sinks,
    )


def check_ring(cache) -> None:
    """Raises TypeError unless ``cache`` is a :class:`RingLayerCache`."""
    if not isinstance(cache, RingLayerCache):
        raise TypeError(f"cache must be a RingLayerCache, got {type(cache).__name__}")


def _start_tensor(cache: RingLayerCache, start) -> torch.Tensor:
    if isinstance(start, torch.Tensor):
        return start
    start = as_int("start", start)
    if not 0 <= start <= _INT32_MAX:
        raise ValueError(f"start must be in [0, {_INT32_MAX}] (int32 positions), got {start}")
    return torch.tensor(start, dtype=torch.int32, device=cache.keys.device)


def update_ring_layer_cache(
    cache: RingLayerCache,
    keys_new: torch.Tensor,
    values_new: torch.Tensor,
    start: Union[int, torch.Tensor],
) -> RingLayerCache:
    """Writes new keys/values at the logical positions ``[start, start + chunk)``.

    One operator call writes keys, values and the slots' positions in place
    (a quantized ring: quantizes them and writes their scales too, in the same
    call, ``update_.Tensor`` with the ring's positions and scales); a chunk longer than the ring writes
    only what the ring keeps (the sinks and the last ``capacity - sinks``
    positions). To attend over a chunk longer than ``max_step``, use
    :func:`write_ring_layer_cache`.

    Args:
        cache: The ring.
        keys_new: ``(batch, num_kv_heads, chunk, head_dim)``, the cache's
            dtype (a quantized ring: float32, bfloat16 or float16) and
            device, any strides.
        values_new: Same shape as ``keys_new``.
        start: First position: an int, or an int32/int64 tensor on the
            cache's device, 0-D or ``(batch,)`` (ragged rows), read on the
            device (no sync, no recompile).

    Returns:
        :class:`RingLayerCache` sharing the buffers, with ``length =
        start + chunk`` (int32, the start's shape).

    Raises:
        ValueError: A negative start or ``start + chunk`` past int32 (CPU;
            nothing is written; on CUDA nothing is written and every entry of
            the returned length is -1), or shapes/devices that do not fit.
        TypeError: Mismatched dtypes, or ``cache`` not a RingLayerCache.
    """
    check_ring(cache)
    start_t = _start_tensor(cache, start)
    length = ring_write(cache, keys_new, values_new, start_t)
    return RingLayerCache(
        cache.keys,
        cache.values,
        cache.positions,
        length,
        cache.window,
        cache.sinks,
        cache.max_step,
        cache.k_scale,
        cache.v_scale,
    )


def append_ring_layer_cache(cache: RingLayerCache, keys_new: torch.Tensor, values_new: torch.Tensor) -> RingLayerCache:
    """Writes at ``cache.length`` and advances it in place (its address stays).

    As :func:`update_ring_layer_cache` with ``start = cache.length``; the new
    length is copied into ``cache.length`` (a functional op plus ``copy_``:
    see docs/design.md on the Inductor bug of in-place length ops).

    Args:
        cache: The ring; ``length`` is advanced by ``chunk``.
        keys_new: ``(batch, num_kv_heads, chunk, head_dim)``.
        values_new: Same shape as ``keys_new``.

    Returns:
        ``cache`` itself.

    Raises:
        ValueError, TypeError: As :func:`update_ring_layer_cache`.
    """
    check_ring(cache)
    check_length_writable(cache.length)
    cache.length.copy_(ring_write(cache, keys_new, values_new, cache.length))
    return cache


def write_ring_layer_cache(
    cache: RingLayerCache,
    keys_new: torch.Tensor,
    values_new: torch.Tensor,
    start: Optional[Union[int, torch.Tensor]] = None,
) -> RingKV:
    """Writes a chunk and returns what its queries attend over: write-then-attend in one call.

    The step of a transformers layer: ``kv = write_ring_layer_cache(ring, k,
    v)`` then ``kvcache.attend(q, kv)`` with the whole chunk's queries. For a
    chunk of at most ``max_step`` tokens the ring itself holds everything its
    queries see, so the chunk is written and the ring returned. A longer
    chunk (a prompt) would overwrite, inside the chunk, keys that its own
    earlier queries need; then the ring's slots from before the write
    (positions at or past ``start`` masked as empty: they are stale) are
    concatenated with the chunk, which the queries attend over exactly, and
    the ring keeps only its last ``capacity - sinks`` positions (and the
    sinks). Same results either way; the long path costs one copy of the
    ring and the chunk.

    Args:
        cache: The ring.
        keys_new: ``(batch, num_kv_heads, chunk, head_dim)``.
        values_new: Same shape as ``keys_new``.
        start: First position (int, or int tensor 0-D / ``(batch,)``); ``None``
            writes at ``cache.length`` and advances it in place.

    Returns:
        :class:`RingKV` to pass to :func:`kvcache.attend`, whose ``length``
        is the logical length after the write.

    Raises:
        ValueError, TypeError: As :func:`update_ring_layer_cache`; with
            ``start=None`` also a ``cache.length`` that cannot be written in
            place (an ``expand()``-ed view). Nothing is written.
    """
    check_ring(cache)
    if start is None:
        # cache.length is advanced by a copy_ after the write: refuse a length
        # that copy_ could not write (an expand()ed view) before anything is
        # written, not after.
        check_length_writable(cache.length)
        start_t = cache.length
    else:
        start_t = _start_tensor(cache, start)
    chunk = keys_new.shape[2] if isinstance(keys_new, torch.Tensor) and keys_new.dim() == 4 else 0
    long_chunk = chunk > cache.max_step
    if long_chunk:
        # The write's own checks first (an empty write of the same rows,
        # heads and head_dim: nothing is written), so that new data that does
        # not fit the ring raises the op's ValueError/TypeError instead of
        # torch.cat's RuntimeError below.
        empty_v = values_new[:, :, :0] if isinstance(values_new, torch.Tensor) and values_new.dim() == 4 else values_new
        ring_write(cache, keys_new[:, :, :0], empty_v, start_t)
        # A quantized ring's chunk, quantized for the view (the ring keeps
        # only part of it); raises for bad new data before anything is written.
        staged = _quantize_chunk(cache, keys_new, values_new) if cache.k_scale is not None else None
        batch = cache.positions.shape[0]
        s = start_t.to(torch.int32)
        s = s.view(-1, 1) if s.dim() == 1 else s
        old = torch.where(cache.positions < s, cache.positions, -1)
        new = (s + torch.arange(chunk, dtype=torch.int32, device=s.device)).expand(batch, chunk)
        view_pos = torch.cat([old, new], dim=1)
        if staged is None:
            view_k = torch.cat([cache.keys, keys_new], dim=2)
            view_v = torch.cat([cache.values, values_new], dim=2)
            view_ks = view_vs = None
        else:  # the chunk's quantized data and scales, exactly what the ring stores
            view_k = torch.cat([cache.keys, staged[0]], dim=2)
            view_v = torch.cat([cache.values, staged[1]], dim=2)
            view_ks = torch.cat([cache.k_scale, staged[2]], dim=2)
            view_vs = torch.cat([cache.v_scale, staged[3]], dim=2)
    length = ring_write(cache, keys_new, values_new, start_t)
    if start is None:  # checked writable above
        cache.length.copy_(length)
        length = cache.length
    if long_chunk:
        return RingKV(view_k, view_v, view_pos, length, cache.window, cache.sinks, view_ks, view_vs)
    return RingKV(
        cache.keys, cache.values, cache.positions, length, cache.window, cache.sinks, cache.k_scale, cache.v_scale
    )


def attend_ring(
    q: torch.Tensor,
    kv: Union[RingLayerCache, RingKV],
    kv_start: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    softcap: Optional[float] = None,
    sink_logits: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention of the last ``seq`` positions' queries over a ring, by position.

    Query ``i`` of row ``b`` sits at position ``p = length[b] - seq + i`` and
    sees the slots whose position ``q`` has ``kv_start[b] <= q <= p`` and
    (``q < sinks`` or ``p - q < window``). Empty and stale slots are never
    read; a decode step costs O(capacity), flat in the context length.

    Args:
        q: ``(batch, num_heads, seq, head_dim)``, the cache's dtype (float32,
            bfloat16, float16; any of the three for a quantized ring, read
            with its scales and dequantized in registers).
        kv: A :class:`RingLayerCache` after a write of at most ``max_step``
            tokens, or the :class:`RingKV` of :func:`write_ring_layer_cache`.
        kv_start: ``(batch,)`` or 0-D int: first valid position (left
            padding); ``None`` means 0.
        scale: Score scale; ``None`` means ``head_dim ** -0.5``.
        softcap: ``softcap * tanh(score / softcap)``; ``None`` or 0: none.
        sink_logits: ``(num_heads,)`` float32 learned sink logits (gpt-oss),
            as in :func:`kvcache.attend`; ``None``: none.

    Returns:
        ``(batch, num_heads, seq, head_dim)`` in ``q``'s dtype. A query that
        sees no position gets zeros; one that finds fewer of its positions
        than the rule asks for (the ring lost them: see the module's
        exactness rule) gets NaN.

    Raises:
        ValueError: Shapes, devices or options that do not fit; on CPU,
            lengths below ``seq`` or ``kv_start`` outside ``[0, length]``
            (on CUDA those rows get NaN).
        TypeError: Unsupported or mismatched dtypes; a ``scale`` or
            ``softcap`` that is not a number (a bool, a str, a tensor).
    """
    if not isinstance(kv, (RingLayerCache, RingKV)):
        raise TypeError(f"kv must be a RingLayerCache or RingKV, got {type(kv).__name__}")
    check_tensor_args(q=q, kv_start=kv_start, sink_logits=sink_logits, optional=("kv_start", "sink_logits"))
    check_real(scale=scale, softcap=softcap)
    return _attend_op(
        q,
        kv.keys,
        kv.values,
        kv.length,
        kv_start=kv_start,
        scale=scale,
        window=kv.window,
        softcap=0.0 if softcap is None else softcap,
        positions=kv.positions,
        sinks=kv.sinks,
        k_scale=kv.k_scale,
        v_scale=kv.v_scale,
        sink_logits=sink_logits,
    )


# The row operations moved to kvcache.rows (one module for every layout); the old module paths
# keep resolving (lazily: kvcache.rows imports this module).
_MOVED_TO_ROWS = ("rollback_ring_layer_cache", "select_rows_ring_layer_cache", "reset_rows_ring_layer_cache")


def __getattr__(name):
    if name in _MOVED_TO_ROWS:
        from . import rows

        return getattr(rows, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
