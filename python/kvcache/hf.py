"""Hugging Face ``transformers`` integration: a kvcache ``Cache`` and a ``kvcache`` attention.

Usage (one switch in the model, one in ``generate``)::

    import kvcache.hf  # registers attn_implementation="kvcache"

    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="kvcache")
    cache = kvcache.hf.KVCache(model.config, max_cache_len=4096)
    out = model.generate(**inputs, past_key_values=cache)  # transformers 5.24 names it ``cache=``

:class:`KVCache` is a ``transformers.Cache`` whose full-attention (and, by
default, sliding-window) layers hold kvcache buffers ``(batch, num_kv_heads,
max_cache_len, head_dim)`` and one int32 device length per row. Each layer
writes a step with one ``torch.ops.kvcache.append_`` call (write at the
row's length, advance it in place): fixed addresses, no host sync, no
recompiles under ``torch.compile``. The ``kvcache`` attention calls
``torch.ops.kvcache.attend``, which reads only the filled slots
``[kv_start[b], lengths[b])`` of each row, so a decode step costs
O(filled slots) instead of O(max_cache_len).

Design decisions
----------------
**Explicit ``attn_implementation="kvcache"``, not automatic.** The attention
implementation is model state (``config._attn_implementation``) that
transformers reads before any cache code runs (the masks are built from it
in ``prepare_inputs_for_generation``), while a cache is per call. Switching
it from the cache's constructor would silently change how the same model
runs later with another cache. Both halves are safe on their own instead:
a :class:`KVCache` gives correct results with any attention (``sdpa``,
``eager``: they read the whole buffer through an O(capacity) mask, like
``StaticCache``; a one-time warning says so), and ``"kvcache"`` attention
gives correct results with any transformers cache whose layers hold the
sequence up to the current token (``DynamicCache``, ``StaticCache``, their
sliding-window layers, or no cache), so a model loaded with
``attn_implementation="kvcache"`` keeps working in ``generate`` without a
:class:`KVCache`, for example as an assisted-generation draft model.

**How the attention finds a layer's lengths.** transformers passes the
attention function the module, the queries and the keys/values that
``Cache.update`` returned, but not the cache. A :class:`KVCache` layer
returns its own buffers from ``update``, and every allocation registers the
layer in a process-wide table keyed by ``id()`` of its keys buffer (a weak
reference: the table never keeps a cache alive, and entries disappear with
their buffers). The attention looks the keys tensor up there and accepts
the layer only if ``key is layer.keys and value is layer.values``, then
reads ``layer.lengths`` (the device tensor ``append_`` just advanced) and
``layer.window``. Nothing is written to the table during a forward, so two
caches in flight (a draft and a target model, two threads) cannot see each
other's state, and ``torch.compile`` resolves the lookup at trace time (the
buffers are graph inputs with stable identities). Keys that are not a
registered layer's buffers take the generic path below.

**The mask.** The ``kvcache`` entry of ``AttentionMaskInterface`` builds no
O(capacity) mask: it returns a ``(batch, 1, 1, 2)`` int32 tensor holding,
per row, ``kv_start`` (the first non-padding slot, from the 2-D attention
mask: left padding is never read) and ``total`` (the tokens seen including
this step). It is 4-D, so transformers passes it through unchanged, and
``generate`` builds it outside the compiled forward, so the compiled decode
step sees a fixed-shape input. For keys that are not kvcache buffers (the
generic path) the attention derives ``lengths = min(total, key_len)`` and
shifts ``kv_start`` by the tokens the layer no longer holds: correct for
every transformers layer that stores a contiguous run of tokens ending at
the query (dynamic, static, both sliding variants). Only left padding is
representable; a mask with holes is refused on prefill (``ValueError``).
Bidirectional, chunked and custom (``or``/``and`` overlay, packed sequence)
masks raise ``NotImplementedError``.

**Sliding-window layers.** By default (``sliding_layers="kvcache"``) a
sliding layer is a linear kvcache buffer of ``max_cache_len`` slots read
through ``attend``'s window (only the last ``window`` slots are read, so it
costs what a full layer costs, croppable at any length, compileable). It
holds ``max_cache_len`` slots where transformers' ring buffer holds
``min(window, max_cache_len)``: when that memory matters (a long
``max_cache_len`` on a model whose layers are mostly sliding), pass
``sliding_layers="hf"`` to get transformers' ``StaticSlidingWindowLayer``
(served by the generic attention path; it rolls its buffer every decode
step and cannot be cropped once past the window).

**Layers kvcache does not serve.** Linear-attention and convolution layers
(``"linear_attention"``, ``"conv"``) and attention-free layers
(``"dummy"``, ``"moe"``, ``"mlp"``) use transformers' own layer classes;
``"hybrid"``/``"hybrid_sliding"`` layers (linear state plus attention in one
layer) use transformers' static hybrid layers, whose attention part goes
through the generic path. Chunked attention, indexed/sparse attention, KV
sharing between layers and keys/values of different head sizes (MLA) raise
``NotImplementedError`` naming the layer type.

**Batch reshaping.** ``reorder_cache`` (beam search) and
``batch_select_indices`` with a full-size index are one ``select_rows_`` per
layer: in place, buffers keep their addresses, only filled slots move.
``batch_select_indices`` with fewer indices compacts the selected rows to
the front in place and narrows the layer to views of its buffers (same
addresses). ``batch_repeat_interleave`` and a larger selection grow the
batch, which fixed-size buffers cannot do in place: they allocate new
buffers (``batch * repeats`` rows) and copy the filled slots once; compiled
code then recompiles for the new shapes, as it must. ``crop`` is
``rollback`` (no copy), ``reset`` sets the lengths to 0 (O(1), nothing is
zeroed); :meth:`KVCache.rollback` and :meth:`KVCache.reset_rows` take
per-row amounts (batched speculative decoding, continuous batching).

Supported transformers: 5.18 to 5.24 (tested); importing :mod:`kvcache`
never imports transformers, only ``import kvcache.hf`` does.
"""

from __future__ import annotations

import copy
import inspect
import warnings
import weakref
from typing import Optional, Union

import torch

try:
    import transformers
    from transformers import masking_utils as _masking
    from transformers import cache_utils as _cache_utils
    from transformers.cache_utils import (
        Cache,
        CacheLayerMixin,
        LinearAttentionAndStaticFullAttentionLayer,
        LinearAttentionAndStaticSlidingWindowAttentionLayer,
        LinearAttentionLayer,
        StaticSlidingWindowLayer,
    )
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface
except ImportError as e:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "kvcache.hf needs Hugging Face transformers (5.18 or newer): pip install 'kvcache[hf]' "
        f"(import failed: {e})"
    ) from e

from . import cache as _cache  # loads the operators (through the package __init__)
from .cache import (  # the operator handles and argument checks of the Python API
    _append_op,
    _as_int,
    _attend_op,
    _init_op,
    _rollback_op,
    _select_rows_op,
    _update_tensor_op,
)

# Attention-free layers: DummyLayer in transformers 5.24; 5.18 used LinearAttentionLayer for them.
_NoKVLayer = getattr(_cache_utils, "DummyLayer", None)

__all__ = ["ATTN_IMPLEMENTATION", "CACHE_ARG", "KVCache", "KVCacheLayer", "kvcache_attention", "kvcache_mask"]

ATTN_IMPLEMENTATION = "kvcache"
"""The name registered with ``AttentionInterface`` and ``AttentionMaskInterface``."""



def _cache_arg_name() -> str:
    # transformers renamed generate's/forward's `past_key_values` to `cache` after
    # 5.18 (5.24 still takes the old name, with a FutureWarning).
    from transformers.generation.utils import GenerationMixin

    params = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    return "cache" if "cache" in params else "past_key_values"


CACHE_ARG = _cache_arg_name()
"""The keyword ``generate`` and the models take the cache by in the installed
transformers: ``"cache"`` (5.24) or ``"past_key_values"`` (5.18); for code
that runs on both: ``model.generate(**inputs, **{kvcache.hf.CACHE_ARG: cache})``."""


# ---------------------------------------------------------------------------
# Registry: keys buffer -> layer (see the module docstring).

_LAYERS: "dict[int, weakref.ref]" = {}


def _register(layer: "KVCacheLayer") -> None:
    key = id(layer.keys)
    _LAYERS[key] = weakref.ref(layer)
    # Drop the entry when the buffer object dies (its id may then be reused).
    weakref.finalize(layer.keys, _LAYERS.pop, key, None)


def _layer_of(key: torch.Tensor, value: torch.Tensor) -> Optional["KVCacheLayer"]:
    ref = _LAYERS.get(id(key))
    layer = ref() if ref is not None else None
    if layer is not None and layer.keys is key and layer.values is value:
        return layer
    return None


def _compiling() -> bool:
    return torch.compiler.is_compiling()


# ---------------------------------------------------------------------------
# Cache layers


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
    """

    is_compileable = True
    is_croppable = True

    def __init__(self, max_cache_len: int, window: int = 0, layer_idx: int = 0):
        super().__init__()
        self.max_cache_len = max_cache_len
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
            _register(new)
        return new

    # -- allocation --------------------------------------------------------

    def allocate(self, batch_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device) -> None:
        """Allocates zeroed buffers and zero lengths (done lazily by the first ``update`` otherwise)."""
        keys, values, _ = _init_op(batch_size, num_kv_heads, head_dim, self.max_cache_len, dtype=dtype,
                                   device=torch.device(device))
        lengths = torch.zeros(batch_size, dtype=torch.int32, device=keys.device)
        self._set_buffers(keys, values, lengths)

    def _set_buffers(self, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> None:
        self.keys, self.values, self.lengths = keys, values, lengths
        self.batch_size, self.num_heads = keys.shape[0], keys.shape[1]
        self.k_head_dim = self.v_head_dim = keys.shape[-1]
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        _register(self)
        if not _compiling():
            # Fixed addresses: compiled code and CUDA graphs may keep pointers to them.
            for t in (keys, values, lengths):
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
        if _compiling():
            # As kvcache.append_kv_layer_cache: traced, write with the
            # functional update_.Tensor and copy the new lengths back (Inductor
            # can move a read of a graph input past a custom op that mutates
            # it in place; docs/design.md).
            self.lengths.copy_(_update_tensor_op(self.keys, self.values, key_states, value_states, self.lengths))
        else:
            _append_op(self.keys, self.values, self.lengths, key_states, value_states)
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
            t = _as_int("tokens_to_remove", tokens_to_remove)
            if t == 0:
                return
            if t < 0:
                n = torch.tensor(-t, dtype=torch.int64, device=dev)
            else:
                n = (self.lengths.to(torch.int64) - t).clamp(min=0)
        self.lengths.copy_(_rollback_op(self.lengths, n))

    def rollback(self, n) -> None:
        """Drops the last ``n`` tokens (int, 0-D or ``(batch,)`` int tensor) of each row, in place."""
        if not self.is_initialized:
            raise ValueError(f"layer {self.layer_idx}: the cache is empty (nothing to roll back)")
        if not isinstance(n, torch.Tensor):
            n = torch.tensor(_as_int("n", n), dtype=torch.int64, device=self.lengths.device)
        self.lengths.copy_(_rollback_op(self.lengths, n))

    def reset_rows(self, rows: torch.Tensor) -> None:
        """Empties the given rows (a ``(batch,)`` bool mask or row indices) in O(1) each."""
        if self.is_initialized:
            _cache.reset_kv_layer_cache_rows(_cache.KVLayerCache(self.keys, self.values, self.lengths), rows)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row ``b`` takes row ``beam_idx[b]`` (beam search): ``select_rows_``, in place, filled slots only."""
        if self.is_initialized:
            self.lengths.copy_(_select_rows_op(self.keys, self.values, self.lengths, beam_idx.to(self.lengths.device)))

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
            self.lengths.copy_(_select_rows_op(self.keys, self.values, self.lengths, idx))
        elif k < b:
            # Rows k.. keep their own contents; rows ..k take the selection (all at once).
            full = torch.cat((idx, torch.arange(k, b, device=dev)))
            self.lengths.copy_(_select_rows_op(self.keys, self.values, self.lengths, full))
            self._set_buffers(self.keys[:k], self.values[:k], self.lengths[:k])
        else:
            self._grow(idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeats every row ``repeats`` times (row ``b`` becomes rows ``b*repeats ..``): new, larger buffers."""
        if not self.is_initialized:
            return
        r = _as_int("repeats", repeats)
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
        keys, values, _ = _init_op(idx.numel(), old_k.shape[1], old_k.shape[-1], self.max_cache_len,
                                   dtype=old_k.dtype, device=old_k.device)
        if filled:
            keys[:, :, :filled] = old_k[:, :, :filled].index_select(0, idx)
            values[:, :, :filled] = old_v[:, :, :filled].index_select(0, idx)
        lengths = old_len.index_select(0, idx).clone()
        self._set_buffers(keys, values, lengths)


# ---------------------------------------------------------------------------
# The Cache


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


def _tp_size(*configs) -> int:
    """The tensor-parallel degree transformers sharded the model with (1 if none).

    ``from_pretrained(..., tp_plan="auto")`` / ``distributed_config=`` stores its
    ``DistributedConfig`` on ``model.config``: the attention projections are
    split by heads, so each rank's layers see ``num_key_value_heads / tp_size``.
    """
    for c in configs:
        tp = getattr(getattr(c, "distributed_config", None), "tp_size", None)
        if tp is not None:
            return int(tp)
    return 1


def _local_heads(heads: int, tp: int) -> int:
    if heads % tp:
        raise ValueError(
            f"num_key_value_heads={heads} does not split across tp_size={tp} tensor-parallel ranks; "
            "build the KVCache without batch_size/dtype/device so it sizes from the model's key states")
    return heads // tp


def _head_shapes(config, n: int) -> "tuple[list[int], list[int]]":
    try:
        from transformers.configuration_utils import get_head_shapes

        heads, dims = get_head_shapes(config)
    except (ImportError, AttributeError):
        dims = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    heads = list(heads) if isinstance(heads, (list, tuple)) else [heads] * n
    dims = list(dims) if isinstance(dims, (list, tuple)) else [dims] * n
    return heads, dims


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
        sliding_layers: ``"kvcache"`` (default): sliding-window layers are
            linear kvcache buffers read through ``attend``'s window;
            ``"hf"``: transformers' ``StaticSlidingWindowLayer`` (holds only
            ``min(window, max_cache_len)`` slots).

    Raises:
        TypeError: ``max_cache_len`` or ``batch_size`` not an int, ``dtype``
            not a ``torch.dtype``.
        ValueError: ``max_cache_len`` not in ``[1, 2**31)``, ``batch_size``
            < 1, an unknown ``sliding_layers``, KV heads that do not split
            across the tensor-parallel ranks (allocated up front only).
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
        sliding_layers: str = "kvcache",
    ):
        max_cache_len = _as_int("max_cache_len", max_cache_len)
        if not 1 <= max_cache_len < 2**31:
            raise ValueError(f"max_cache_len must be in [1, 2**31) (lengths are int32), got {max_cache_len}")
        if batch_size is not None:
            batch_size = _as_int("batch_size", batch_size)
            if batch_size < 1:
                raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
        if sliding_layers not in ("kvcache", "hf"):
            raise ValueError(f"sliding_layers must be 'kvcache' or 'hf', got {sliding_layers!r}")
        dev = torch.device(device) if device is not None else None
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        self.config = text
        self._max_cache_len = max_cache_len

        for attr in ("num_kv_shared_layers", "kv_sharing_modes"):
            v = getattr(text, attr, None)
            if v and (not isinstance(v, (list, tuple)) or any(m == "reuse" for m in v)):
                raise NotImplementedError(
                    f"{type(text).__name__} shares keys/values between layers ({attr}={v}); kvcache.hf.KVCache "
                    "does not support KV sharing yet: use transformers' StaticCache/DynamicCache")
        if getattr(text, "qk_head_dim", None) is not None or getattr(text, "v_head_dim", None) is not None:
            qk = getattr(text, "qk_head_dim", None)
            vd = getattr(text, "v_head_dim", None)
            if qk != vd:
                raise NotImplementedError(
                    f"{type(text).__name__} has keys and values of different head sizes (qk_head_dim={qk}, "
                    f"v_head_dim={vd}: MLA-style attention); kvcache.hf.KVCache stores keys and values of one shape")

        types, windows = _layer_types(text)
        layers = []
        for i, (t, w) in enumerate(zip(types, windows)):
            if t == "full_attention":
                layers.append(KVCacheLayer(max_cache_len, 0, i))
            elif t == "sliding_attention":
                if w is None or w < 1:
                    raise ValueError(f"layer {i} is a sliding_attention layer without a sliding_window in the config")
                if sliding_layers == "kvcache":
                    layers.append(KVCacheLayer(max_cache_len, int(w), i))
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
                layers.append(_NoKVLayer() if _NoKVLayer is not None else LinearAttentionLayer())
            else:
                raise NotImplementedError(
                    f"layer {i} of {type(text).__name__} is a {t!r} layer, which kvcache.hf.KVCache does not serve "
                    f"(it serves {', '.join(_SUPPORTED)}); use transformers' StaticCache/DynamicCache for this model")
        super().__init__(layers=layers)

        ours = [(i, l) for i, l in enumerate(self.layers) if isinstance(l, KVCacheLayer)]
        for _, layer in ours:
            layer.expected_dtype, layer.expected_batch, layer.expected_device = dtype, batch_size, dev
        if batch_size is not None and dtype is not None and dev is not None:
            heads, dims = _head_shapes(text, len(self.layers))
            tp = _tp_size(config, text)
            for i, layer in ours:
                layer.allocate(batch_size, _local_heads(heads[i], tp), dims[i], dtype, dev)
        self._attn_checked = False

    def __repr__(self) -> str:
        return f"KVCache(max_cache_len={self.max_cache_len}, layers={self.layers})"

    @property
    def max_cache_len(self) -> int:
        """Slots per row (transformers 5.18's base class has a deprecated property of this name)."""
        return self._max_cache_len

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Writes this step's keys/values for ``layer_idx`` and returns what its attention reads.

        Raises:
            ValueError: ``"KV cache overflow: ..."``, or a batch/shape that
                does not match the buffers. Nothing is written.
            TypeError: keys/values of another dtype than the cache's.
        """
        if not self._attn_checked and not _compiling():
            self._attn_checked = True
            impl = getattr(self.config, "_attn_implementation", None)
            if impl != ATTN_IMPLEMENTATION and any(isinstance(l, KVCacheLayer) for l in self.layers):
                warnings.warn(
                    f"kvcache.hf.KVCache is used with attn_implementation={impl!r}: attention reads the whole "
                    f"max_cache_len={self.max_cache_len} buffer through a mask (correct, but O(capacity) per step). "
                    f"Load the model with attn_implementation='{ATTN_IMPLEMENTATION}' (or call "
                    f"model.set_attn_implementation('{ATTN_IMPLEMENTATION}')) to read only the filled slots.",
                    stacklevel=3)
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    def rollback(self, n) -> None:
        """Drops the last ``n[b]`` tokens of each row (int, 0-D or ``(batch,)`` device tensor), every kvcache layer.

        Per-row amounts are what batched speculative decoding needs (each row
        accepts its own number of draft tokens); transformers' ``crop`` takes
        one amount for every row.
        """
        for layer in self.layers:
            if isinstance(layer, KVCacheLayer):
                layer.rollback(n)

    def reset_rows(self, rows: torch.Tensor) -> None:
        """Empties the given rows of every kvcache layer in O(1) (continuous batching)."""
        for layer in self.layers:
            if isinstance(layer, KVCacheLayer):
                layer.reset_rows(rows)

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        """Slots per row of ``layer_idx`` (the name transformers used before 5.16 for :meth:`get_max_length`)."""
        return self.layers[layer_idx].get_max_length()


# ---------------------------------------------------------------------------
# Attention and mask


def _check_mask_kind(mask_function, local_size, use_vmap, config) -> None:
    if config is not None and not getattr(config, "is_causal", True):
        raise NotImplementedError("attn_implementation='kvcache' supports causal attention only (config.is_causal=False)")
    if config is not None and getattr(config, "attention_chunk_size", None) is not None:
        raise NotImplementedError("attn_implementation='kvcache' does not support chunked attention (attention_chunk_size)")
    if use_vmap:
        raise NotImplementedError(
            "attn_implementation='kvcache' supports causal and sliding-window masks over left-padded rows; this model "
            "asked for a custom mask (or_mask_function/and_mask_function overlay)")
    if mask_function is not _masking.causal_mask_function and local_size is None:
        raise NotImplementedError(
            f"attn_implementation='kvcache' supports causal and sliding-window masks only, got {mask_function!r} "
            "(bidirectional, chunked or packed-sequence masks are not supported)")


def kvcache_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset=0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: Optional[torch.Tensor] = None,
    local_size: Optional[int] = None,
    use_vmap: bool = False,
    config=None,
    device: Union[str, torch.device] = "cpu",
    **kwargs,
) -> torch.Tensor:
    """The ``AttentionMaskInterface`` entry for ``"kvcache"``: per-row offsets, no O(capacity) mask.

    Args:
        batch_size, q_length: The forward's batch and query length.
        kv_length, kv_offset: Unused (the attention reads lengths from the cache).
        q_offset: Tokens already in the cache (int or 0-D tensor).
        mask_function, local_size, use_vmap, config: What transformers asks
            for; only causal and sliding-window masks are accepted.
        attention_mask: ``(batch, tokens so far)`` 2-D mask (1: token, 0:
            left padding), or ``None`` (no padding).
        device: Where to build the result.

    Returns:
        ``(batch, 1, 1, 2)`` int32 tensor: ``[..., 0]`` the first
        non-padding slot of each row (``kv_start``), ``[..., 1]`` the tokens
        seen including this step (``q_offset + q_length``).

    Raises:
        ValueError: On prefill (``q_length > 1``, outside tracing), a row
            whose mask has a 0 after a 1 (only left padding is supported).
        NotImplementedError: A bidirectional, chunked or custom mask.
    """
    _check_mask_kind(mask_function, local_size, use_vmap, config)
    dev = torch.device(device)
    total = q_offset + q_length
    if isinstance(total, torch.Tensor):
        total_t = total.to(device=dev, dtype=torch.int32).reshape(()).expand(batch_size)
    else:
        total_t = torch.full((batch_size,), int(total), dtype=torch.int32, device=dev)
    if attention_mask is None:
        kv_start = torch.zeros(batch_size, dtype=torch.int32, device=dev)
    else:
        if attention_mask.dim() != 2:
            raise ValueError(f"expected a 2-D attention mask (batch, tokens), got shape {tuple(attention_mask.shape)}")
        m = attention_mask.to(device=dev, dtype=torch.bool)
        has = m.any(-1)
        first = m.to(torch.int32).argmax(-1).to(torch.int32)  # first 1 of each row
        if q_length > 1 and not _compiling():
            ones = m.sum(-1, dtype=torch.int32)
            if bool(((ones != m.shape[-1] - first) & has).any()):
                raise ValueError(
                    "attn_implementation='kvcache' supports left padding only: the attention mask has a 0 after a 1 "
                    "in some row (pad on the left: tokenizer.padding_side = 'left')")
        kv_start = torch.where(has, first, total_t)
    return torch.stack((kv_start, total_t), dim=-1).view(batch_size, 1, 1, 2)


def _check_mask(attention_mask) -> None:
    if (
        not isinstance(attention_mask, torch.Tensor)
        or attention_mask.dtype != torch.int32
        or attention_mask.dim() != 4
        or tuple(attention_mask.shape[1:]) != (1, 1, 2)
    ):
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
        raise ValueError(
            "attn_implementation='kvcache' takes the (batch, 1, 1, 2) int32 masks kvcache.hf builds from a 2-D "
            f"attention mask; got {shape} (pass a 2-D attention_mask, not a prepared 4-D one)")


def kvcache_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    is_causal: Optional[bool] = None,
    **kwargs,
):
    """The ``AttentionInterface`` entry for ``"kvcache"``: ``torch.ops.kvcache.attend`` over the filled slots.

    Args:
        module: The attention module (``module.layer_idx``, ``module.training``).
        query: ``(batch, num_heads, seq, head_dim)``.
        key, value: What ``Cache.update`` returned: a :class:`KVCache`
            layer's buffers (read up to that layer's per-row lengths), or
            any transformers layer's keys/values that end at the query.
        attention_mask: The tensor :func:`kvcache_mask` built, or ``None``.
        dropout: Must be 0 (inference).
        scaling: Score scale (default ``head_dim ** -0.5``).
        sliding_window: Window for keys that are not kvcache buffers (a
            kvcache layer uses its own).
        softcap: Logit soft-capping (Gemma 2), or ``None``.

    Returns:
        ``(output (batch, seq, num_heads, head_dim), None)``.

    Raises:
        NotImplementedError: Dropout in training, non-causal attention,
            attention sinks or position biases.
        ValueError: A mask not built by :func:`kvcache_mask`; lengths out of
            range (``attend``'s checks).
    """
    if dropout and getattr(module, "training", False):
        raise NotImplementedError("attn_implementation='kvcache' is for inference: attention dropout is not supported")
    if is_causal is False or not getattr(module, "is_causal", True):
        raise NotImplementedError("attn_implementation='kvcache' supports causal self-attention only")
    for name in ("s_aux", "sinks", "position_bias"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"attn_implementation='kvcache' does not support {name}")
    if attention_mask is not None:
        _check_mask(attention_mask)
    layer = _layer_of(key, value)
    if layer is not None:
        lengths, window = layer.lengths, layer.window
        kv_start = None if attention_mask is None else attention_mask.view(-1, 2).select(1, 0)
    else:
        # Keys that hold a contiguous run of tokens ending at the last query.
        key_len = key.shape[-2]
        window = int(sliding_window or 0)
        if attention_mask is None:
            kv_start = None
            lengths = torch.full((), key_len, dtype=torch.int32, device=key.device)
        else:
            kv_start, total = attention_mask.view(-1, 2).unbind(1)
            lengths = total.clamp(max=key_len)
            kv_start = (kv_start - (total - lengths)).clamp(min=0)
    out = _attend_op(query, key, value, lengths, kv_start=kv_start, scale=scaling, window=window,
                     softcap=float(softcap or 0.0))
    return out.transpose(1, 2), None


AttentionInterface.register(ATTN_IMPLEMENTATION, kvcache_attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, kvcache_mask)
