"""``KVRingLayer``: a sliding-window layer of a :class:`kvcache.hf.KVCache` held as a ring.

A ring holds ``sinks + window + max_step - 1`` slots per row instead of ``max_cache_len``
(:mod:`kvcache.ring`): every write goes through :func:`kvcache.write_ring_layer_cache`, which also
decides what the step's queries attend over (the ring, or for a chunk longer than ``max_step`` a
temporary of the ring's old slots plus the chunk), and the ``"kvcache"`` attention reads it with
``attend``'s positions, window and sinks. Rollback (``crop``) is length arithmetic, exact up to
``max_step`` tokens below the furthest position written, after any number of wraps.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import common
from .. import rows as row_ops
from .. import ring as _ring
from .layer import KVCacheLayer, _compiling


class KVRingLayer(KVCacheLayer):
    """One sliding-window attention layer of a :class:`KVCache`, as a ring of slots.

    Row ``b``'s token at position ``p`` (left padding included, as in the
    linear layers) lives at slot ``p`` if ``p < sinks``, else at ``sinks +
    (p - sinks) % (capacity - sinks)``; ``positions[b, slot]`` records it
    (``-1``: empty). ``lengths[b]`` is the row's logical length.

    Args:
        max_cache_len: The cache's ``max_cache_len`` (sizes the mask of a
            non-``"kvcache"`` attention; the ring itself is not bounded by it).
        window: The layer's sliding window (a query sees itself and the
            ``window - 1`` positions before it), >= 1.
        layer_idx: The model layer this serves (for messages).
        sinks: The first ``sinks`` positions of every row stay visible
            (StreamingLLM attention sinks); 0: none.
        max_step: R: the most tokens one step may add inside the ring, and
            the deepest exact rollback (``crop``) from the furthest position written.
        kv_dtype: ``None``, or ``"int8"``/``"fp8"`` (a quantized ring: per-slot
            float32 scales ``k_scale``/``v_scale`` that move with their slots).

    Attributes:
        keys, values: ``(batch, num_kv_heads, capacity, head_dim)``.
        positions: ``(batch, capacity)`` int32.
        lengths: ``(batch,)`` int32 logical lengths, changed in place only.
        ring: the same tensors as a :class:`kvcache.RingLayerCache`.
    """

    def __init__(self, max_cache_len: int, window: int, layer_idx: int = 0, *, sinks: int = 0,
                 max_step: int = _ring.DEFAULT_MAX_STEP, kv_dtype=None):
        super().__init__(max_cache_len, window, layer_idx, kv_dtype=kv_dtype)
        self.sinks = sinks
        self.max_step = max_step
        self.capacity = sinks + window + max_step - 1
        self.positions: Optional[torch.Tensor] = None
        # What this step's queries attend over when it is not the ring itself (a chunk longer
        # than max_step): set by update, read and dropped by the "kvcache" attention.
        self._view: Optional[_ring.RingKV] = None

    def __repr__(self) -> str:
        s = f", sinks={self.sinks}" if self.sinks else ""
        return f"KVRingLayer(window={self.window}{s}, max_step={self.max_step}, capacity={self.capacity})"

    # -- allocation --------------------------------------------------------

    def allocate(self, batch_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device) -> None:
        """Allocates an empty ring (zero buffers, every position -1, zero lengths)."""
        r = _ring.init_ring_layer_cache(batch_size, num_kv_heads, head_dim, self.window, dtype,
                                        device=torch.device(device), sinks=self.sinks, max_step=self.max_step,
                                        kv_dtype=self.kv_dtype)
        lengths = torch.zeros(batch_size, dtype=torch.int32, device=r.keys.device)
        self._set_ring(r.keys, r.values, r.positions, lengths, r.k_scale, r.v_scale)

    def _set_ring(self, keys, values, positions, lengths, k_scale=None, v_scale=None) -> None:
        self.positions = positions
        self.ring = _ring.RingLayerCache(keys, values, positions, lengths, self.window, self.sinks, self.max_step,
                                         k_scale, v_scale)
        self._set_buffers(keys, values, lengths, k_scale, v_scale)
        if not _compiling():
            torch._dynamo.mark_static_address(positions)

    def _set_buffers(self, keys, values, lengths, *args) -> None:
        # The linear layer's bookkeeping (registry, static addresses, sizes); rings keep self.ring.
        super()._set_buffers(keys, values, lengths, *args)
        self._view = None

    # -- the per-step write -------------------------------------------------

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, linear_view: bool = False,
               **kwargs):
        """Writes ``(batch, num_kv_heads, chunk, head_dim)`` keys/values at each row's length.

        Args:
            key_states, value_states: This step's keys and values.
            linear_view: Return a ``(batch, heads, max_cache_len, head_dim)``
                temporary with every held position at its own index (for
                attentions that read through transformers' masks); set by
                :class:`KVCache` when the model's attention is not ``"kvcache"``.

        Returns:
            ``(keys, values)``: the ring's buffers (the ``"kvcache"``
            attention finds the layer from them), or the linear temporary.

        Raises:
            ValueError: Shapes or batch that do not match the ring (nothing
                is written); with ``linear_view``, a row past ``max_cache_len``.
            TypeError: keys/values of another dtype than the ring.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.kv_dtype is None and (key_states.dtype != self.keys.dtype or value_states.dtype != self.keys.dtype):
            # (A quantized ring's write takes any float dtype and checks it, nothing written on error.)
            raise TypeError(
                f"layer {self.layer_idx}: the cache holds {self.keys.dtype} keys/values but the model passed "
                f"{key_states.dtype} keys and {value_states.dtype} values (nothing was written); build the "
                "KVCache with the model's dtype")
        if key_states.shape[0] != self.keys.shape[0]:
            raise ValueError(
                f"layer {self.layer_idx}: the cache holds a batch of {self.keys.shape[0]} rows but the model passed "
                f"{key_states.shape[0]} (nothing was written); use batch_repeat_interleave/batch_select_indices "
                "or a new cache")
        if linear_view and self.kv_dtype is not None:
            raise ValueError(
                f"layer {self.layer_idx}: a quantized ring (kv_dtype={self.kv_dtype}) is read by "
                "attn_implementation='kvcache' only (nothing was written)")
        if linear_view and not _compiling():
            end = int(self.lengths.max()) + key_states.shape[2]
            if end > self.max_cache_len:
                raise ValueError(
                    f"KV cache overflow: end={end} exceeds max_cache_len={self.max_cache_len} (layer "
                    f"{self.layer_idx}; nothing was written)")
        kv = _ring.write_ring_layer_cache(self.ring, key_states, value_states)
        if linear_view:
            return self._linearize(kv)
        # Only a long chunk attends over something else than the ring.
        self._view = kv if kv.keys is not self.keys else None
        return self.keys, self.values

    def _linearize(self, kv: _ring.RingKV):
        # Every held position p at index p of a max_cache_len buffer (index L: a dump slot for
        # empty slots); the mask transformers built for that length then reads it exactly.
        b, h, _, d = kv.keys.shape
        n = self.max_cache_len
        pos = kv.positions.to(torch.int64)
        idx = torch.where((pos >= 0) & (pos < n), pos, n).view(b, 1, -1, 1).expand(b, h, -1, d)
        out = []
        for t in (kv.keys, kv.values):
            lin = t.new_zeros(b, h, n + 1, d)
            lin.scatter_(2, idx, t)
            out.append(lin[:, :, :n])
        return out[0], out[1]

    def take_view(self) -> "_ring.RingKV":
        """What the current step's queries attend over (the ``"kvcache"`` attention's read), once."""
        v, self._view = self._view, None
        if v is not None:
            return v
        return _ring.RingKV(self.keys, self.values, self.positions, self.lengths, self.window, self.sinks,
                            self.k_scale, self.v_scale)

    # -- sizes and rollback ---------------------------------------------------

    def check_depth(self, n: torch.Tensor) -> None:
        """Raises ValueError if removing ``n`` tokens per row goes more than ``max_step`` below the furthest
        position written (the highest recorded position + 1), where window keys are lost. One host
        read; skipped while compiling (a query that lost keys then gets NaN)."""
        if _compiling():
            return
        new = self.lengths.to(torch.int64) - n
        furthest = self.positions.amax(1).to(torch.int64) + 1
        deepest = int((furthest - new).max())
        if deepest > self.max_step:
            raise ValueError(
                f"layer {self.layer_idx}: rolling back to {int(new.min())} tokens is {deepest} below the furthest "
                f"position written; a ring rolls back at most max_step={self.max_step} exactly (build the KVCache "
                "with a larger max_step; nothing changed)")

    def crop(self, tokens_to_remove) -> None:
        """Drops tokens from every row by length arithmetic (no copy), exact after any number of wraps.

        Args:
            tokens_to_remove: ``-n`` (an int or 0-D int tensor) removes the last
                ``n`` tokens of each row; a positive ``m`` keeps at most the first
                ``m`` tokens of each row.

        Raises:
            ValueError: Removing more tokens than a row holds, or reaching more
                than ``max_step`` below the furthest position written (eager;
                nothing changes).
        """
        n = self.crop_amount(tokens_to_remove)
        if n is not None:
            self.rollback(n)

    def crop_amount(self, tokens_to_remove) -> Optional[torch.Tensor]:
        """The per-row tokens :meth:`crop` removes (an int64 device tensor), or ``None`` for none."""
        if not self.is_initialized:
            return None
        dev = self.lengths.device
        if isinstance(tokens_to_remove, torch.Tensor):
            t = tokens_to_remove.to(device=dev, dtype=torch.int64)
            return torch.where(t < 0, -t, (self.lengths.to(torch.int64) - t).clamp(min=0))
        t = common.as_int("tokens_to_remove", tokens_to_remove)
        if t == 0:
            return None
        if t < 0:
            return torch.full(self.lengths.shape, -t, dtype=torch.int64, device=dev)
        return (self.lengths.to(torch.int64) - t).clamp(min=0)

    def rollback(self, n) -> None:
        """Drops the last ``n`` tokens (int, 0-D or ``(batch,)`` int tensor) of each row, in place.

        Raises:
            ValueError: The cache is empty; ``n`` above a row's length (CPU);
                a rollback deeper than ``max_step`` below the furthest position
                written (eager). Nothing changes.
        """
        if not self.is_initialized:
            raise ValueError(f"layer {self.layer_idx}: the cache is empty (nothing to roll back)")
        if not isinstance(n, torch.Tensor):
            n = common.as_int("n", n)
            if n < 0:
                raise ValueError(f"n must be >= 0, got {n}")
            n = torch.tensor(n, dtype=torch.int64, device=self.lengths.device)
        self.check_depth(n.to(device=self.lengths.device, dtype=torch.int64))
        row_ops.rollback_ring_layer_cache(self.ring, n)

    def reset(self) -> None:
        """Empties every row: lengths 0, every slot's position -1 (keys and values are not zeroed)."""
        if self.is_initialized:
            self.lengths.zero_()
            self.positions.fill_(-1)
            self._view = None

    def reset_rows(self, rows: torch.Tensor) -> None:
        """Empties the given rows (a ``(batch,)`` bool mask or row indices): length 0, positions -1."""
        if self.is_initialized:
            if isinstance(rows, torch.Tensor) and not rows.is_floating_point() and rows.dtype != torch.bool:
                rows = rows.to(device=self.lengths.device, dtype=torch.int64)  # index_fill_ takes int64
            row_ops.reset_rows_ring_layer_cache(self.ring, rows)

    # -- reshaping ----------------------------------------------------------

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row ``b`` takes row ``beam_idx[b]`` (beam search): every slot, its positions and length, in place."""
        if self.is_initialized:
            row_ops.select_rows_ring_layer_cache(self.ring, beam_idx.to(self.lengths.device))

    def batch_select_indices(self, indices) -> None:
        """Keeps the rows ``indices`` (an index or bool tensor), in this order (in place when it does not grow)."""
        if not self.is_initialized:
            return
        dev = self.lengths.device
        idx = torch.as_tensor(indices, device=dev)
        if idx.dtype == torch.bool:
            idx = idx.nonzero().flatten()
        idx = idx.to(torch.int64).flatten()
        b, k = self.keys.shape[0], idx.numel()
        if k == b:
            row_ops.select_rows_ring_layer_cache(self.ring, idx)
        elif k < b:
            full = torch.cat((idx, torch.arange(k, b, device=dev)))
            row_ops.select_rows_ring_layer_cache(self.ring, full)
            scales = (None, None) if self.k_scale is None else (self.k_scale[:k], self.v_scale[:k])
            self._set_ring(self.keys[:k], self.values[:k], self.positions[:k], self.lengths[:k], *scales)
        else:
            self._grow(idx)

    def _grow(self, idx: torch.Tensor) -> None:
        # New, larger buffers: every slot of the selected rows (a ring is small), off the decode path.
        b = self.keys.shape[0]
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= b):
            raise ValueError(f"indices must be in [0, {b}), got {idx.tolist()}")
        scales = (None, None)
        if self.k_scale is not None:  # the scales are indexed like the slots
            scales = (self.k_scale.index_select(0, idx), self.v_scale.index_select(0, idx))
        self._set_ring(self.keys.index_select(0, idx), self.values.index_select(0, idx),
                       self.positions.index_select(0, idx), self.lengths.index_select(0, idx).clone(), *scales)

