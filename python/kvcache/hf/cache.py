"""``KVCache``: a ``transformers.Cache`` whose attention layers are :class:`KVCacheLayer` s, built
from a model config (layer types, sliding windows, head shapes, tensor parallelism)."""

from __future__ import annotations

import warnings
from typing import Optional, Union

import torch

from .. import common
from .. import rows as row_ops
from .. import cache as _api
from ._compat import (
    Cache,
    LinearAttentionAndStaticFullAttentionLayer,
    LinearAttentionAndStaticSlidingWindowAttentionLayer,
    LinearAttentionLayer,
    NoKVLayer,
    StaticSlidingWindowLayer,
    head_shapes,
    mla_message,
    split_head_sizes,
    tp_size,
)
from .. import ring as _ring
from .layer import KVCacheLayer, _compiling
from .ring_layer import KVRingLayer

ATTN_IMPLEMENTATION = "kvcache"
"""The name registered with ``AttentionInterface`` and ``AttentionMaskInterface``."""


_SUPPORTED = ("full_attention", "sliding_attention", "linear_attention", "conv", "hybrid", "hybrid_sliding",
              "dummy", "moe", "mlp")


def _layer_types(config) -> "tuple[list[str], list[Optional[int]]]":
    """Layer types and sliding windows, one per layer, from a (text) config."""
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    per_layer = getattr(config, "per_layer_config", None)
    if types is None:
        types = []
        for i in range(n):
            c = per_layer[i] if per_layer is not None else config
            if getattr(c, "sliding_window", None) is not None:
                types.append("sliding_attention")
            elif getattr(c, "attention_chunk_size", None) is not None:
                types.append("chunked_attention")
            else:
                types.append("full_attention")
    types = list(types)[:n]
    windows = []
    for i, t in enumerate(types):
        c = per_layer[i] if per_layer is not None else config
        windows.append(getattr(c, "sliding_window", None) if t in ("sliding_attention", "hybrid_sliding") else None)
    return types, windows


def _local_heads(heads: int, tp: int) -> int:
    if heads % tp:
        raise ValueError(
            f"num_key_value_heads={heads} does not split across tp_size={tp} tensor-parallel ranks; "
            "build the KVCache without batch_size/dtype/device so it sizes from the model's key states")
    return heads // tp


class KVCache(Cache):
    """A ``transformers.Cache`` on kvcache buffers: per-row device lengths, one ``append_`` per layer per step.

    Pass it to ``generate`` (``past_key_values=`` / ``cache=``, see
    :data:`CACHE_ARG`) or to the model's forward; with
    ``attn_implementation="kvcache"`` decode reads only the filled slots.

    Args:
        config: The model's config (``model.config``; composite configs use
            their decoder text config).
        max_cache_len: Slots per row: prompt plus generated tokens (left
            padding included) must fit.
        batch_size, dtype, device: When all three are given, every layer is
            allocated now (what ``torch.export`` and compiled prefill need);
            otherwise on the first update, from the keys/values, checked
            against whichever of them were given. Under transformers' tensor
            parallelism (``config.distributed_config.tp_size > 1``, set by
            ``from_pretrained(..., tp_plan="auto")``), each rank allocates its
            local ``num_key_value_heads // tp_size`` heads.
        sliding_layers: ``"ring"`` (default): each sliding-window layer is
            a ring (:class:`KVRingLayer`) of ``sinks + window + max_step - 1``
            slots, read by position (exact for prompts of any length, croppable
            up to ``max_step`` tokens after any number of wraps);
            ``"linear"`` (also its old name ``"kvcache"``): linear
            ``max_cache_len`` buffers read through ``attend``'s window;
            ``"hf"``: transformers' ``StaticSlidingWindowLayer``.
        max_step: R, >= 1 (rings only): the most tokens one forward may add
            inside a ring (longer chunks, such as prompts, are attended
            exactly through a temporary) and the deepest ``crop``/rollback
            below the furthest position written. Default 64
            (:data:`kvcache.ring.DEFAULT_MAX_STEP`, docs/hf.md): above
            assisted generation's draft lengths, (R - 1) / window extra
            memory (12% of a 512 window, 1.5% of 4096).
        sinks: Attention sinks for the sliding layers (rings only): the first
            ``sinks`` positions of a row stay visible to every query
            (StreamingLLM); default 0. Left-padded batches are refused with it.
        kv_dtype: ``None`` (keys/values in the model's dtype), ``"int8"``
            or ``"fp8"`` (also ``torch.int8`` / ``torch.float8_e4m3fn``): a
            quantized cache, about a quarter of fp32's bytes (README
            "Quantized caches"); needs ``attn_implementation="kvcache"``,
            which dequantizes in registers (any other is refused at the first
            update, before anything is written). Rings are quantized too
            (per-slot scales move with their slots).

    Raises:
        TypeError: ``max_cache_len`` or ``batch_size`` not an int, ``dtype``
            not a ``torch.dtype``, ``kv_dtype`` not one of its spellings.
        ValueError: ``max_cache_len`` not in ``[1, 2**31)``, ``batch_size``
            < 1, an unknown ``sliding_layers``, ``max_step`` < 1, ``sinks`` <
            0, ``sinks`` > 0 without rings, KV heads that do not split across
            the tensor-parallel ranks (allocated up front only).
        NotImplementedError: The config has a layer type kvcache cannot
            serve (chunked or indexed attention, KV sharing between layers,
            keys/values of different head sizes); the message names it.
    """

    def __init__(
        self,
        config,
        max_cache_len: int,
        *,
        batch_size: Optional[int] = None,
        dtype: Optional[torch.dtype] = None,
        device: Optional[Union[str, torch.device]] = None,
        sliding_layers: str = "ring",
        max_step: int = _ring.DEFAULT_MAX_STEP,
        sinks: int = 0,
        kv_dtype=None,
    ):
        max_cache_len = common.as_int("max_cache_len", max_cache_len)
        if not 1 <= max_cache_len < 2**31:
            raise ValueError(f"max_cache_len must be in [1, 2**31) (lengths are int32), got {max_cache_len}")
        if batch_size is not None:
            batch_size = common.as_int("batch_size", batch_size)
            if batch_size < 1:
                raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
        if sliding_layers not in ("ring", "linear", "kvcache", "hf"):
            raise ValueError(f"sliding_layers must be 'ring', 'linear' or 'hf', got {sliding_layers!r}")
        if sliding_layers == "kvcache":  # the linear layers' name before rings
            sliding_layers = "linear"
        max_step = common.as_int("max_step", max_step)
        if max_step < 1:
            raise ValueError(f"max_step must be >= 1, got {max_step}")
        sinks = common.as_int("sinks", sinks)
        if sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {sinks}")
        if sinks and sliding_layers != "ring":
            raise ValueError(f"sinks={sinks} needs sliding_layers='ring', got sliding_layers={sliding_layers!r}")
        self.sliding_layers, self.max_step, self.sinks = sliding_layers, max_step, sinks
        dev = torch.device(device) if device is not None else None
        self.kv_dtype = common.kv_dtype_of(kv_dtype)
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        self.config = text
        self._max_cache_len = max_cache_len

        for attr in ("num_kv_shared_layers", "kv_sharing_modes"):
            v = getattr(text, attr, None)
            if v and (not isinstance(v, (list, tuple)) or any(m == "reuse" for m in v)):
                raise NotImplementedError(
                    f"{type(text).__name__} shares keys/values between layers ({attr}={v}); kvcache.hf.KVCache "
                    "does not support KV sharing yet: use transformers' StaticCache/DynamicCache")
        if split_head_sizes(text) is not None:
            raise NotImplementedError(mla_message(text, "kvcache.hf.KVCache"))

        types, windows = _layer_types(text)
        layers = []
        for i, (t, w) in enumerate(zip(types, windows)):
            if t == "full_attention":
                layers.append(KVCacheLayer(max_cache_len, 0, i, kv_dtype=self.kv_dtype))
            elif t == "sliding_attention":
                if w is None or w < 1:
                    raise ValueError(f"layer {i} is a sliding_attention layer without a sliding_window in the config")
                if sliding_layers == "ring":
                    if sinks + int(w) + max_step - 1 >= 2**31:
                        raise ValueError(f"sinks + sliding_window + max_step - 1 = {sinks + int(w) + max_step - 1} "
                                         "slots: a ring holds fewer than 2**31 (int32 positions)")
                    layers.append(KVRingLayer(max_cache_len, int(w), i, sinks=sinks, max_step=max_step,
                                              kv_dtype=self.kv_dtype))
                elif sliding_layers == "linear":
                    layers.append(KVCacheLayer(max_cache_len, int(w), i, kv_dtype=self.kv_dtype))
                else:
                    layers.append(StaticSlidingWindowLayer(max_cache_len=max_cache_len, sliding_window=int(w)))
            elif t in ("linear_attention", "conv"):
                layers.append(LinearAttentionLayer(number_of_states=getattr(text, "number_of_conv_states", 1)))
            elif t == "hybrid":
                layers.append(LinearAttentionAndStaticFullAttentionLayer(
                    max_cache_len=max_cache_len, number_of_states=getattr(text, "number_of_conv_states", 1)))
            elif t == "hybrid_sliding":
                layers.append(LinearAttentionAndStaticSlidingWindowAttentionLayer(
                    max_cache_len=max_cache_len, sliding_window=int(w),
                    number_of_states=getattr(text, "number_of_conv_states", 1)))
            elif t in ("dummy", "moe", "mlp"):
                layers.append(NoKVLayer())
            else:
                raise NotImplementedError(
                    f"layer {i} of {type(text).__name__} is a {t!r} layer, which kvcache.hf.KVCache does not serve "
                    f"(it serves {', '.join(_SUPPORTED)}); use transformers' StaticCache/DynamicCache for this model")
        super().__init__(layers=layers)

        ours = [(i, l) for i, l in enumerate(self.layers) if isinstance(l, KVCacheLayer)]
        for _, layer in ours:
            layer.expected_dtype, layer.expected_batch, layer.expected_device = dtype, batch_size, dev
        if batch_size is not None and dtype is not None and dev is not None:
            heads, dims = head_shapes(text, len(self.layers))
            tp = tp_size(config, text)
            for i, layer in ours:
                layer.allocate(batch_size, _local_heads(heads[i], tp), dims[i], dtype, dev)
        self._attn_checked = False
        # The first linear (non-ring) kvcache layer: the one whose write refuses a chunk that overflows
        # max_cache_len (rings never overflow), so that the rings before it ask it first.
        self._first_linear = next((i for i, l in ours if not isinstance(l, KVRingLayer)), None)

    def __repr__(self) -> str:
        return f"KVCache(max_cache_len={self.max_cache_len}, layers={self.layers})"

    @property
    def max_cache_len(self) -> int:
        """Slots per row (transformers 5.18's base class has a deprecated property of this name)."""
        return self._max_cache_len

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Writes this step's keys/values for ``layer_idx`` and returns what its attention reads.

        Args:
            key_states, value_states: ``(batch, num_kv_heads, chunk, head_dim)``, this step's keys
                (after RoPE) and values; the cache's dtype (any float dtype for a quantized cache).
            layer_idx: The model layer.
            *args: Passed on to the layer.
            **kwargs: transformers' cache kwargs, passed on to the layer.

        Returns:
            ``(keys, values)``: for a full-attention layer its whole buffers ``(batch,
            num_kv_heads, max_cache_len, head_dim)`` (the ``"kvcache"`` attention reads only the
            filled slots, other attentions through their mask); for a ring the ring's buffers
            ``(batch, num_kv_heads, capacity, head_dim)``, or, under another attention than
            ``"kvcache"``, a ``(batch, num_kv_heads, max_cache_len, head_dim)`` temporary with every
            held position at its own index; for a layer kvcache does not serve, what
            transformers' layer returns.

        Raises:
            ValueError: ``"KV cache overflow: ..."`` (a row would pass ``max_cache_len``), or a
                batch/shape that does not match the buffers; a quantized cache (``kv_dtype``) or
                ``sinks`` under another attention than ``"kvcache"``. Nothing is written.
            TypeError: keys/values of another dtype than the cache's (plain caches). Nothing
                is written.
        """
        if not self._attn_checked and not _compiling():
            self._attn_checked = True
            impl = getattr(self.config, "_attn_implementation", None)
            if impl != ATTN_IMPLEMENTATION and self.kv_dtype is not None:
                self._attn_checked = False
                raise ValueError(
                    f"a quantized kvcache.hf.KVCache (kv_dtype={self.kv_dtype}) is read by "
                    f"attn_implementation='{ATTN_IMPLEMENTATION}' only (it dequantizes in registers), got {impl!r}: "
                    f"load the model with attn_implementation='{ATTN_IMPLEMENTATION}' (nothing was written)")
            if impl != ATTN_IMPLEMENTATION and any(isinstance(l, KVCacheLayer) for l in self.layers):
                warnings.warn(
                    f"kvcache.hf.KVCache is used with attn_implementation={impl!r}: attention reads the whole "
                    f"max_cache_len={self.max_cache_len} buffer through a mask (correct, but O(capacity) per step). "
                    f"Load the model with attn_implementation='{ATTN_IMPLEMENTATION}' (or call "
                    f"model.set_attn_implementation('{ATTN_IMPLEMENTATION}')) to read only the filled slots.",
                    stacklevel=3)
        layer = self.layers[layer_idx]
        if isinstance(layer, KVRingLayer):
            if self._first_linear is not None and layer_idx < self._first_linear:
                self._check_linear_room(key_states.shape[-2])
            # Another attention reads through transformers' masks: give it the ring's positions
            # laid out linearly (a temporary of max_cache_len slots, O(capacity) like StaticCache).
            linear = getattr(self.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION
            if linear and layer.sinks:
                raise ValueError(
                    f"KVCache(sinks={layer.sinks}) is read by attn_implementation='{ATTN_IMPLEMENTATION}' only "
                    f"(transformers' masks have no sinks), got {self.config._attn_implementation!r} (nothing was "
                    "written)")
            return layer.update(key_states, value_states, *args, linear_view=linear, **kwargs)
        return layer.update(key_states, value_states, *args, **kwargs)

    def _check_linear_room(self, chunk: int) -> None:
        # A ring layer before the first linear layer would be written before that layer refuses an
        # overflowing chunk: the step's first layers ask it first, so that nothing is written. Its
        # lengths are read on CPU (values known there, as the write's own check reads them); on CUDA
        # the write does not raise (it poisons the lengths), and neither does this.
        lin = self.layers[self._first_linear]
        if _compiling() or (lin.is_initialized and lin.lengths.device.type != "cpu"):
            return
        end = (int(lin.lengths.max()) if lin.is_initialized and lin.lengths.numel() else 0) + int(chunk)
        if end > lin.max_cache_len:
            raise ValueError(f"KV cache overflow: end={end} exceeds max_len={lin.max_cache_len} (layer "
                             f"{self._first_linear}; nothing was written)")

    def rollback(self, n) -> None:
        """Drops the last ``n[b]`` tokens of each row, in every kvcache layer, in place (no copy).

        Per-row amounts are what batched speculative decoding needs (each row
        accepts its own number of draft tokens); transformers' ``crop`` takes
        one amount for every row.

        Args:
            n: An int >= 0, or an int32 / int64 tensor, 0-D (every row) or ``(batch,)`` (one
                amount per row), on the cache's device.

        Raises:
            ValueError: ``"cannot roll back more tokens than the row holds: ..."`` (CPU; on
                CUDA that layer's lengths become -1); ``n < 0``; an empty (not yet written)
                cache; a ring that would go more than ``max_step`` below the furthest position
                written (eager: every ring is asked before any layer changes).
            TypeError: ``n`` neither an int nor an int tensor (a float, a bool, a str).
        """
        self._check_rings(lambda la: n if isinstance(n, torch.Tensor) else common.as_int("n", n))
        for layer in self.layers:
            if isinstance(layer, KVCacheLayer):
                layer.rollback(n)

    def crop(self, tokens_to_remove) -> None:
        """Drops tokens from every layer (transformers' ``crop``), in place (no copy); every ring
        checks the depth before any layer changes.

        Args:
            tokens_to_remove: ``-n`` (an int or 0-D int tensor) removes the last ``n`` tokens of
                each row; ``m >= 0`` keeps at most the first ``m`` tokens of each row.

        Raises:
            ValueError: A row holds fewer tokens (CPU), or a ring would go more than
                ``max_step`` below the furthest position written (eager).
            TypeError: ``tokens_to_remove`` neither an int nor an int tensor.
        """
        self._check_rings(lambda la: la.crop_amount(tokens_to_remove))
        super().crop(tokens_to_remove)

    def _check_rings(self, amount) -> None:
        # Rings refuse a rollback deeper than max_step: ask every ring before any layer changes.
        if _compiling():
            return
        for layer in self.layers:
            if isinstance(layer, KVRingLayer) and layer.is_initialized:
                n = amount(layer)
                if n is None:
                    continue
                if not isinstance(n, torch.Tensor):
                    n = torch.tensor(n, dtype=torch.int64)
                layer.check_depth(n.to(device=layer.lengths.device, dtype=torch.int64))

    def reset_rows(self, rows: torch.Tensor) -> None:
        """Empties the given rows of every kvcache layer in O(1) (continuous batching): their
        lengths become 0 (a ring's positions -1), nothing is zeroed.

        Args:
            rows: A ``(batch,)`` bool mask, or int32 / int64 row indices (0-D or 1-D) in
                ``[0, batch)``, on the cache's device.

        Raises:
            ValueError, TypeError: As :func:`kvcache.reset_rows_kv_layer_cache`; ``rows`` is
                checked against every layer before any layer changes, so a bad ``rows`` leaves
                every layer as it was.
        """
        layers = [la for la in self.layers if isinstance(la, KVCacheLayer) and la.is_initialized]
        # Every layer's new lengths first (the API's checks, on copies), then the writes.
        for layer in layers:
            common.check_length_writable(layer.lengths)
        new = [row_ops.reset_rows_kv_layer_cache(_api.KVLayerCache(la.keys, la.values, la.lengths.clone()), rows).length
               for la in layers]
        for layer, lengths in zip(layers, new):
            if isinstance(layer, KVRingLayer):
                layer.reset_rows(rows)  # also empties the rows' positions
            else:
                layer.lengths.copy_(lengths)

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        """Slots per row of ``layer_idx`` (the name transformers used before 5.16 for :meth:`get_max_length`).

        Args:
            layer_idx: The model layer (default 0).

        Returns:
            ``max_cache_len`` for a kvcache layer (a ring's too, not its slot count), else the
            transformers layer's ``get_max_length()``.
        """
        return self.layers[layer_idx].get_max_length()
