"""Hugging Face ``transformers`` integration: a kvcache ``Cache`` and a ``kvcache`` attention.

Usage (one switch in the model, one in ``generate``)::

    import kvcache.hf  # registers attn_implementation="kvcache"

    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="kvcache")
    cache = kvcache.hf.KVCache(model.config, max_cache_len=4096)
    out = model.generate(**inputs, past_key_values=cache)  # transformers 5.24 and later name it ``cache=``

:class:`KVCache` is a ``transformers.Cache`` whose full-attention layers hold kvcache buffers
``(batch, num_kv_heads, max_cache_len, head_dim)`` and one int32 device length per row, and whose
sliding-window layers are, by default, rings of ``sinks + window + max_step - 1`` slots
(:class:`KVRingLayer`, :mod:`kvcache.ring`) read by their recorded positions. Each layer writes a step with one operator call (write at
the row's length, advance it in place): fixed addresses, no host sync, no recompiles under
``torch.compile``. The ``kvcache`` attention calls ``torch.ops.kvcache.attend``, which reads only
the filled slots ``[kv_start[b], lengths[b])`` of each row, so a decode step costs O(filled
slots) instead of O(max_cache_len).

Modules: ``_compat`` (transformers versions), ``_registry`` (buffers -> layer), ``layer``
(:class:`KVCacheLayer`), ``ring_layer`` (:class:`KVRingLayer`), ``cache`` (:class:`KVCache`), ``attention`` (the attention and mask
functions); this module registers the last two with transformers. Why it is built this way:
docs/hf.md. Supported transformers: 5.18 to 5.25 (tested); importing :mod:`kvcache` never
imports transformers, only ``import kvcache.hf`` does.
"""

from __future__ import annotations

from ._compat import CACHE_ARG, AttentionInterface, AttentionMaskInterface
from .attention import kvcache_attention, kvcache_mask
from .cache import ATTN_IMPLEMENTATION, KVCache
from .layer import KVCacheLayer
from .ring_layer import KVRingLayer

__all__ = ["ATTN_IMPLEMENTATION", "CACHE_ARG", "KVCache", "KVCacheLayer", "KVRingLayer", "kvcache_attention",
           "kvcache_mask"]

AttentionInterface.register(ATTN_IMPLEMENTATION, kvcache_attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, kvcache_mask)

from . import paged as _paged  # noqa: E402  (paged|kvcache: continuous batching, docs/hf.md)

_paged.install()
