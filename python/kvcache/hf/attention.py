"""The ``"kvcache"`` attention and mask functions transformers calls (registered on import of
:mod:`kvcache.hf`).

The mask function builds no O(capacity) mask: a ``(batch, 1, 1, 2)`` int32 tensor of per-row
``kv_start`` and tokens seen. The attention reads a :class:`KVCacheLayer`'s own lengths (found
through its buffers, ``_registry``) or, for any other transformers layer, derives them from that
tensor; it is one ``torch.ops.kvcache.attend`` call either way (docs/hf.md).
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from . import _registry
from ._compat import masking_utils, mla_message, split_head_sizes
from .layer import _compiling

_attend_op = torch.ops.kvcache.attend.default


PAGED_STEP = "kvcache_paged"
"""The forward kwarg under which a continuous-batching step's paged call reaches the attention
(set by :func:`kvcache.hf.paged.paged_update`)."""

_paged_attention = None  # kvcache.hf.paged's attention, once installed (set_paged_attention)


def is_gathering_step(kwargs: dict) -> bool:
    """Whether an attention call's kwargs are a continuous-batching step of a transformers release
    whose attention function updates the paged cache itself (5.18: ``cache`` and ``read_index``)."""
    return "read_index" in kwargs and kwargs.get("cache") is not None


def set_paged_attention(fn) -> None:
    """Names the function a continuous-batching step that reaches ``"kvcache"`` is handed to
    (:func:`kvcache.hf.paged.install` passes ``paged_kvcache_attention``; this module does not
    import that one, which imports this one).

    Args:
        fn: An ``AttentionInterface`` function, or ``None``.
    """
    global _paged_attention
    _paged_attention = fn


def _check_mask_kind(mask_function, local_size, use_vmap, config) -> None:
    if config is not None and not getattr(config, "is_causal", True):
        raise NotImplementedError("attn_implementation='kvcache' supports causal attention only (config.is_causal=False)")
    if config is not None and getattr(config, "attention_chunk_size", None) is not None:
        raise NotImplementedError("attn_implementation='kvcache' does not support chunked attention (attention_chunk_size)")
    if use_vmap:
        raise NotImplementedError(
            "attn_implementation='kvcache' supports causal and sliding-window masks over left-padded rows; this model "
            "asked for a custom mask (or_mask_function/and_mask_function overlay)")
    if mask_function is not masking_utils.causal_mask_function and local_size is None:
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


def check_paged_model(model) -> None:
    """Refuses a model kvcache's paged attention cannot serve, before continuous batching starts.

    Args:
        model: A transformers model loaded with ``attn_implementation="kvcache"``.

    Raises:
        NotImplementedError: Keys and values of different head sizes (MLA-style attention:
            DeepSeek-V2/V3; transformers 5.25 pages their latents).
        TypeError: A model dtype other than float32, bfloat16 and float16.
    """
    config = model.config
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if split_head_sizes(text) is not None:
        raise NotImplementedError(
            mla_message(text, "kvcache's paged attention") + ": load the model with attn_implementation='sdpa' "
            "(or 'paged|eager') for continuous batching")
    dtype = getattr(model, "dtype", None)
    if dtype is not None and dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(
            f"kvcache's paged attention runs float32, bfloat16 and float16 models; this model is {dtype}: "
            "convert it (model.to(torch.float32)) or run continuous batching with attn_implementation='sdpa'")


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
            layer's buffers (read up to that layer's per-row lengths; a ring
            layer by its recorded positions, window and sinks), or any
            transformers layer's keys/values that end at the query.
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
            position biases, or keys and values of different head sizes
            (MLA-style attention); ``KVCache(sinks=N)`` over a left-padded batch.
            Learned attention-sink logits (gpt-oss ``s_aux``) are served:
            ``attend``'s ``sink_logits``.
        ValueError: A mask not built by :func:`kvcache_mask`; lengths out of
            range (``attend``'s checks).
    """
    if _paged_attention is not None and (PAGED_STEP in kwargs or is_gathering_step(kwargs)):
        # A continuous-batching step that reached the model under the name "kvcache" (a manager
        # still stepping after stop() restored the name): its paged call, as paged|kvcache runs it.
        return _paged_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                sliding_window=sliding_window, softcap=softcap, **kwargs)
    if dropout and getattr(module, "training", False):
        raise NotImplementedError("attn_implementation='kvcache' is for inference: attention dropout is not supported")
    if key.shape[-1] != value.shape[-1]:
        raise NotImplementedError(
            f"attn_implementation='kvcache' takes keys and values of one head size; got keys {tuple(key.shape)} and "
            f"values {tuple(value.shape)} (MLA-style attention, as in DeepSeek-V2/V3): load the model with "
            "attn_implementation='sdpa'")
    if is_causal is False or not getattr(module, "is_causal", True):
        raise NotImplementedError("attn_implementation='kvcache' supports causal self-attention only")
    # Learned per-head sink logits (gpt-oss passes its `sinks` parameter as s_aux): one virtual
    # slot per head in the softmax denominator. float32 and detached: the kernels read float32,
    # and inference takes no gradient through them.
    sink_logits = kwargs.get("s_aux")
    if sink_logits is None:
        sink_logits = kwargs.get("sinks")
    if sink_logits is not None:
        sink_logits = sink_logits.detach().to(torch.float32).reshape(-1)
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError("attn_implementation='kvcache' does not support position_bias")
    if attention_mask is not None:
        _check_mask(attention_mask)
    layer = _registry.layer_of(key, value)
    positions, sinks = None, 0
    k_scale = v_scale = None
    if layer is not None:
        lengths, window = layer.lengths, layer.window
        k_scale, v_scale = layer.k_scale, layer.v_scale  # a quantized layer's (None otherwise)
        kv_start = None if attention_mask is None else attention_mask.view(-1, 2).select(1, 0)
        if getattr(layer, "positions", None) is not None:
            # A ring (KVRingLayer): read by the recorded positions, over the ring or, after a
            # chunk longer than max_step, over the temporary write_ring_layer_cache returned.
            view = layer.take_view()
            key, value, positions, lengths, sinks = view.keys, view.values, view.positions, view.length, view.sinks
            k_scale, v_scale = view.k_scale, view.v_scale  # a quantized ring's (None otherwise)
            if sinks and kv_start is not None and query.shape[2] > 1 and not _compiling() and bool(
                    (kv_start > 0).any()):
                raise NotImplementedError(
                    f"KVCache(sinks={sinks}) does not support left-padded batches (a row's sinks are its first "
                    f"{sinks} slots, which hold padding there): generate such rows one at a time, or use sinks=0")
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
    if positions is None:
        out = _attend_op(query, key, value, lengths, kv_start=kv_start, scale=scaling, window=window,
                         softcap=float(softcap or 0.0), k_scale=k_scale, v_scale=v_scale,
                         sink_logits=sink_logits)
    else:
        out = _attend_op(query, key, value, lengths, kv_start=kv_start, scale=scaling, window=window,
                         softcap=float(softcap or 0.0), positions=positions, sinks=sinks, k_scale=k_scale,
                         v_scale=v_scale, sink_logits=sink_logits)
    return out.transpose(1, 2), None
