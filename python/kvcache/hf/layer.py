"""``KVCacheLayer``: one attention layer of a :class:`kvcache.hf.KVCache`.

Its buffers are a :class:`kvcache.KVLayerCache` (``layer.kv``) and every operation on them is the
Python API's (append, rollback, select rows, reset rows), so each rule (checks, the traced write,
length writes) lives once, in ``kvcache/cache.py``. What is added here is transformers' layer
protocol: lazy allocation from the first keys, the sizes transformers asks for, batch reshaping.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch

from .. import common
from .. import rows as row_ops
from .. import cache as _api
from . import _registry
from ._compat import CacheLayerMixin


def _compiling() -> bool:
    return torch.compiler.is_compiling()


class KVCacheLayer(CacheLayerMixin):
    """One attention layer of a :class:`KVCache`: kvcache buffers plus per-row lengths.

    Slot ``j`` of row ``b`` holds token ``j`` of that row (left padding
    included); ``lengths[b]`` slots are filled. ``update`` writes with one
    ``append_`` call and returns the whole buffers; the ``kvcache`` attention
    reads ``[kv_start[b], lengths[b])`` (the last ``window`` slots of it for a
    sliding layer), other attentions read everything through a mask.

    Args:
        max_cache_len: Slots per row.
        window: Sliding window (a query sees itself and the ``window - 1``
            slots before it); 0 for full attention.
        layer_idx: The model layer this serves (for messages).

    Attributes:
        keys, values: ``(batch, num_kv_heads, max_cache_len, head_dim)``
            buffers (``None`` before the first update or allocation).
        lengths: ``(batch,)`` int32 device tensor, changed in place only.
        kv: the same three tensors as a :class:`kvcache.KVLayerCache`, for the Python API.
    """

    is_compileable = True
    is_croppable = True

    def __init__(self, max_cache_len: int, window: int = 0, layer_idx: int = 0, kv_dtype=None):
        super().__init__()
        self.max_cache_len = max_cache_len
        # A quantized layer: int8 / float8_e4m3fn storage with per-slot float32
        # scales (k_scale / v_scale, indexed like the slots; README "Quantized caches").
        self.kv_dtype: Optional[torch.dtype] = common.kv_dtype_of(kv_dtype)
        self.k_scale: Optional[torch.Tensor] = None
        self.v_scale: Optional[torch.Tensor] = None
        self.window = window
        self.is_sliding = window > 0
        self.layer_idx = layer_idx
        self.lengths: Optional[torch.Tensor] = None
        # Set by KVCache when the user fixed them up front.
        self.expected_dtype: Optional[torch.dtype] = None
        self.expected_batch: Optional[int] = None
        self.expected_device: Optional[torch.device] = None

    def __repr__(self) -> str:
        kind = f"window={self.window}" if self.window else "full"
        return f"KVCacheLayer({kind}, max_cache_len={self.max_cache_len})"

    def __deepcopy__(self, memo):
        # A copy owns new buffers: register them, so the attention finds the copy's lengths.
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            setattr(new, k, copy.deepcopy(v, memo))
        if new.is_initialized:
            _registry.register(new)
        return new

    # -- allocation --------------------------------------------------------

    def allocate(self, batch_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device) -> None:
        """Allocates zeroed buffers and zero lengths (done lazily by the first ``update`` otherwise)."""
        c = _api.init_kv_layer_cache(batch_size, num_kv_heads, head_dim, self.max_cache_len, dtype,
                                     device=torch.device(device), kv_dtype=self.kv_dtype)
        lengths = torch.zeros(batch_size, dtype=torch.int32, device=c.keys.device)  # one per row
        self._set_buffers(c.keys, c.values, lengths, c.k_scale, c.v_scale)

    def _set_buffers(self, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
                     k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None) -> None:
        self.keys, self.values, self.lengths = keys, values, lengths
        self.k_scale, self.v_scale = k_scale, v_scale
        # The same tensors as a kvcache.KVLayerCache: every operation below is the Python API's
        # (a quantized one's writes quantize, and its row selection moves the scales).
        self.kv = _api.KVLayerCache(keys, values, lengths, k_scale, v_scale)
        self.batch_size, self.num_heads = keys.shape[0], keys.shape[1]
        self.k_head_dim = self.v_head_dim = keys.shape[-1]
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        _registry.register(self)
        if not _compiling():
            # Fixed addresses: compiled code and CUDA graphs may keep pointers to them.
            for t in (keys, values, lengths, k_scale, v_scale):
                if t is not None:
                    torch._dynamo.mark_static_address(t)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocates the buffers from the first keys/values (or ``Cache.early_initialization``'s empty ones)."""
        if key_states.dim() != 4 or value_states.dim() != 4:
            raise ValueError(
                f"layer {self.layer_idx}: keys/values must be (batch, num_kv_heads, seq, head_dim), "
                f"got {tuple(key_states.shape)} and {tuple(value_states.shape)}")
        if key_states.shape[-1] != value_states.shape[-1] or key_states.shape[1] != value_states.shape[1]:
            raise NotImplementedError(
                f"layer {self.layer_idx}: keys {tuple(key_states.shape)} and values {tuple(value_states.shape)} have "
                "different head sizes (MLA-style attention); kvcache.hf.KVCache stores keys and values of one shape")
        b = key_states.shape[0]
        self._check_expected(key_states, b)
        self.allocate(b, key_states.shape[1], key_states.shape[-1], key_states.dtype, key_states.device)

    def _check_expected(self, key_states: torch.Tensor, batch: int) -> None:
        if self.expected_dtype is not None and key_states.dtype != self.expected_dtype:
            raise TypeError(
                f"layer {self.layer_idx}: the cache was built with dtype={self.expected_dtype} but the model passed "
                f"{key_states.dtype} keys/values (nothing was written)")
        if self.expected_batch is not None and batch != self.expected_batch:
            raise ValueError(
                f"layer {self.layer_idx}: the cache was built with batch_size={self.expected_batch} but the model "
                f"passed a batch of {batch} (num_beams and num_return_sequences multiply the batch; nothing was written)")
        if self.expected_device is not None and key_states.device != self.expected_device:
            raise ValueError(
                f"layer {self.layer_idx}: the cache was built on device={self.expected_device} but the model passed "
                f"keys/values on {key_states.device} (nothing was written)")

    # -- the per-step write -------------------------------------------------

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Writes ``(batch, num_kv_heads, chunk, head_dim)`` keys/values at each row's length.

        Returns:
            ``(keys, values)``: the whole buffers (the ``kvcache`` attention
            reads only the filled slots; other attentions need the mask).

        Raises:
            ValueError: ``"KV cache overflow: ..."`` when a row would pass
                ``max_cache_len``, or shapes that do not match the buffers.
                Nothing is written.
            TypeError: keys/values of another dtype than the buffers.
                Nothing is written.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.kv_dtype is not None:
            # The quantizing write takes any float dtype and checks everything (nothing written on error).
            _api.append_kv_layer_cache(self.kv, key_states, value_states)
            return self.keys, self.values
        if key_states.dtype != self.keys.dtype or value_states.dtype != self.keys.dtype:
            raise TypeError(
                f"layer {self.layer_idx}: the cache holds {self.keys.dtype} keys/values but the model passed "
                f"{key_states.dtype} keys and {value_states.dtype} values (nothing was written); build the "
                "KVCache with the model's dtype")
        if key_states.shape[0] != self.keys.shape[0]:
            raise ValueError(
                f"layer {self.layer_idx}: the cache holds a batch of {self.keys.shape[0]} rows but the model passed "
                f"{key_states.shape[0]} (nothing was written); use batch_repeat_interleave/batch_select_indices "
                "or a new cache")
        _api.append_kv_layer_cache(self.kv, key_states, value_states)
        return self.keys, self.values

    # -- sizes ------------------------------------------------------------------

    def get_seq_length(self):
        """Tokens held: the longest row's length, as a 0-D device tensor (no host sync), or 0 before use."""
        if not self.is_initialized:
            return 0
        return self.lengths.amax()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` for masks over the whole buffer (``sdpa``/``eager``): ``(max_cache_len, 0)``."""
        return self.max_cache_len, 0

    def get_max_length(self) -> int:
        """Slots per row (``max_cache_len``)."""
        return self.max_cache_len

    def get_max_cache_shape(self) -> int:
        """Same as :meth:`get_max_length` (the name transformers used before 5.16)."""
        return self.max_cache_len

    # -- reshaping ----------------------------------------------------------

    def reset(self) -> None:
        """Empties every row in O(1): lengths become 0, nothing is zeroed (never read past a length)."""
        if self.is_initialized:
            self.lengths.zero_()

    def crop(self, tokens_to_remove) -> None:
        """Drops tokens from every row with ``rollback`` (no copy).

        Args:
            tokens_to_remove: ``-n`` (an int or 0-D int tensor) removes the last
                ``n`` tokens of each row; a positive ``m`` (transformers' legacy
                meaning) keeps at most the first ``m`` tokens of each row.

        Raises:
            ValueError: Removing more tokens than a row holds (CPU; nothing
                changes; on CUDA every length becomes -1).
        """
        if not self.is_initialized:
            return
        dev = self.lengths.device
        if isinstance(tokens_to_remove, torch.Tensor):
            t = tokens_to_remove.to(device=dev, dtype=torch.int64)
            n = torch.where(t < 0, -t, (self.lengths.to(torch.int64) - t).clamp(min=0))
        else:
            t = common.as_int("tokens_to_remove", tokens_to_remove)
            if t == 0:
                return
            if t < 0:
                n = torch.tensor(-t, dtype=torch.int64, device=dev)
            else:
                n = (self.lengths.to(torch.int64) - t).clamp(min=0)
        row_ops.rollback_kv_layer_cache(self.kv, n)

    def rollback(self, n) -> None:
        """Drops the last ``n`` tokens (int, 0-D or ``(batch,)`` int tensor) of each row, in place."""
        if not self.is_initialized:
            raise ValueError(f"layer {self.layer_idx}: the cache is empty (nothing to roll back)")
        row_ops.rollback_kv_layer_cache(self.kv, n)

    def reset_rows(self, rows: torch.Tensor) -> None:
        """Empties the given rows (a ``(batch,)`` bool mask or row indices) in O(1) each."""
        if self.is_initialized:
            row_ops.reset_rows_kv_layer_cache(self.kv, rows)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row ``b`` takes row ``beam_idx[b]`` (beam search): ``select_rows_``, in place, filled slots only."""
        if self.is_initialized:
            row_ops.select_rows_kv_layer_cache(self.kv, beam_idx.to(self.lengths.device))

    def batch_select_indices(self, indices) -> None:
        """Keeps the rows ``indices`` (an index or bool tensor), in this order.

        A full-size index is one in-place ``select_rows_``; fewer rows are
        compacted to the front in place and the layer narrows to views of
        its buffers (same addresses); more rows need new buffers.
        """
        if not self.is_initialized:
            return
        dev = self.lengths.device
        idx = torch.as_tensor(indices, device=dev)
        if idx.dtype == torch.bool:
            idx = idx.nonzero().flatten()
        idx = idx.to(torch.int64).flatten()
        b, k = self.keys.shape[0], idx.numel()
        if k == b:
            row_ops.select_rows_kv_layer_cache(self.kv, idx)
        elif k < b:
            # Rows k.. keep their own contents; rows ..k take the selection (all at once).
            full = torch.cat((idx, torch.arange(k, b, device=dev)))
            row_ops.select_rows_kv_layer_cache(self.kv, full)
            scales = (None, None) if self.k_scale is None else (self.k_scale[:k], self.v_scale[:k])
            self._set_buffers(self.keys[:k], self.values[:k], self.lengths[:k], *scales)
        else:
            self._grow(idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeats every row ``repeats`` times (row ``b`` becomes rows ``b*repeats ..``): new, larger buffers."""
        if not self.is_initialized:
            return
        r = common.as_int("repeats", repeats)
        if r < 1:
            raise ValueError(f"repeats must be >= 1, got {r}")
        if r == 1:
            return
        idx = torch.arange(self.keys.shape[0], device=self.lengths.device).repeat_interleave(r)
        self._grow(idx)

    def _grow(self, idx: torch.Tensor) -> None:
        # A batch cannot grow inside fixed-size buffers: allocate, then copy the
        # filled slots only (one host read of the longest row, off the decode path).
        old_k, old_v, old_len = self.keys, self.values, self.lengths
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= old_k.shape[0]):
            raise ValueError(f"indices must be in [0, {old_k.shape[0]}), got {idx.tolist()}")
        filled = int(old_len.max()) if old_len.numel() else 0
        c = _api.init_kv_layer_cache(idx.numel(), old_k.shape[1], old_k.shape[-1], self.max_cache_len,
                                     old_k.dtype, device=old_k.device, kv_dtype=self.kv_dtype)
        keys, values = c.keys, c.values
        if filled:
            keys[:, :, :filled] = old_k[:, :, :filled].index_select(0, idx)
            values[:, :, :filled] = old_v[:, :, :filled].index_select(0, idx)
        lengths = old_len.index_select(0, idx).clone()
        scales = (None, None)
        if self.k_scale is not None:  # the scales are indexed like the slots
            scales = (self.k_scale.index_select(0, idx), self.v_scale.index_select(0, idx))
        self._set_buffers(keys, values, lengths, *scales)
