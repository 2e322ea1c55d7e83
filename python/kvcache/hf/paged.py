"""Continuous batching (``generate_batch``, ``ContinuousBatchingManager``) through kvcache's paged ops.

With ``import kvcache.hf``, a model loaded with ``attn_implementation="kvcache"`` runs transformers'
continuous batching as a ``paged|kvcache`` attention: each layer writes its new keys and values
into transformers' own :class:`PagedAttentionCache` memory with :func:`kvcache.paged.write_pages`
and attends over the request's pages with :func:`kvcache.paged.attend_pages`. The context is
never gathered: transformers' ``PagedAttentionCache.update`` (write, then ``index_select`` of the
whole context per layer) is bypassed for such models.

How transformers (5.24 and later) lays out its cache, and what this module derives from it:

* One flat tensor, viewed per attention group (full / sliding layers) as rows of
  ``(num_kv_heads, head_dim)``; a block of the group holds, for each of its ``L`` layers, a key page
  then a value page of ``page_size`` rows: block ``b`` of layer ``i`` starts at row
  ``b * 2 * L * page_size + 2 * i * page_size`` (keys) and ``page_size`` rows later (values). The
  first two sectors are trash.
* The model calls ``cache.update(k, v, layer_idx, kwargs=kwargs)`` before the attention function,
  with per-step ``write_index`` / ``read_index`` (one int64 row index per written token / per
  context token of each sequence, per group) and ``cu_seq_lens_q`` / ``cu_seq_lens_k``. No
  block table reaches a non-flash attention (the decode fast path is flash-only), so the block
  table of each group is rebuilt once per step, on the device, from one index per page.
* Writes use per-layer strided page views ``(num_blocks, page_size, kv, d)`` (keys and values do
  not share a byte), slot ``block * page_size + offset``; the trash rows become ``-1`` (skipped).
  Reads use contiguous page views of ``page_size`` rows (of ``gcd(window, page_size)`` rows for
  sliding layers), whose page index is ``row // block_size``.
* Sliding layers hold a ring of ``sliding_window`` slots (position ``t`` at slot ``t % window``).
  A step whose sequences each add one token, or stay within the window, is written first and
  then attended through a virtual block table (positions shifted by a multiple of the window).
  A step in which a sequence adds several tokens and wraps the ring would overwrite keys its own
  earlier queries still see: for that group and step only, transformers' own sliding update is
  used (it reads at most ``window - 1`` cached tokens per sequence) and ``attend_pages`` reads its
  result as pages of one token.

Everything here is installed by :func:`install` (called by ``import kvcache.hf``); models with
another attention implementation keep transformers' behaviour.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Optional

import torch

from ..paged import attend_pages, write_pages
from ._compat import AttentionMaskInterface, masking_utils
from .attention import (PAGED_STEP, check_paged_model, is_gathering_step, kvcache_attention, kvcache_mask,
                        set_paged_attention)

__all__ = ["PAGED_ATTN_IMPLEMENTATION", "CB_ATTN_IMPLEMENTATION", "IMPLEMENTATIONS", "IN_PLACE", "install",
           "paged_kvcache_attention", "paged_update", "uses_kvcache"]

PAGED_ATTN_IMPLEMENTATION = "paged|kvcache"
"""The paged attention's name, registered with ``AttentionInterface``."""

CB_ATTN_IMPLEMENTATION = "kvcache_paged"
"""The name a ``ContinuousBatchingManager`` switches a kvcache model to while it runs (and back
when it stops), as it does ``eager`` -> ``paged|eager``: transformers 5.24+ resolves any other
``"paged|<name>"`` to ``"<name>"``, so the paged function needs a name without the prefix."""

IMPLEMENTATIONS = ("kvcache", PAGED_ATTN_IMPLEMENTATION, CB_ATTN_IMPLEMENTATION)
"""The attention names whose continuous-batching steps run through kvcache (:func:`uses_kvcache`)."""

IN_PLACE = False
"""Whether the installed transformers lets ``paged|kvcache`` read its pages in place.

``True`` on 5.24+, whose model layers call ``PagedAttentionCache.update`` before the attention
(patched here to copy nothing). ``False`` on 5.18, whose attention function updates the cache
itself, which gathers each sequence's context; ``paged|kvcache`` then reads the gathered rows as
pages of one token. Set by :func:`install`."""

_installed = False
_orig_update = None
_orig_switch = None


# --------------------------------------------------------------------------------------------- #
# Per-step metadata
# --------------------------------------------------------------------------------------------- #

class GroupStep:
    """The metadata of one attention group for one forward step, built once on the device.

    Attributes:
        gather: ``True`` when this step's sliding group falls back to transformers' window read
            (see the module docstring); the write then happens in that read.
        slots: ``(num_tokens,)`` int64 slots of the strided write views (``-1``: skip).
        block_table: ``(num_seqs, max_blocks)`` int32 pages of the read views.
        context_lens: ``(num_seqs,)`` int32 tokens each sequence's queries see the end of.
        cu_seqlens_q: ``(num_seqs + 1,)`` int32.
        block_size: Rows per page of the read views.
        window: Sliding window (0: none).
        read_index, write_index: transformers' indices (used by the gather fallback).
    """

    __slots__ = ("gather", "slots", "block_table", "context_lens", "cu_seqlens_q", "block_size", "window",
                 "read_index", "write_index")


class LayerCall:
    """What the attention function needs for one layer: the step's group metadata and where the layer's pages are."""

    __slots__ = ("step", "allocator", "layer_idx")

    def __init__(self, step: GroupStep, allocator, layer_idx: int) -> None:
        self.step, self.allocator, self.layer_idx = step, allocator, layer_idx


def _diff(cu: torch.Tensor) -> torch.Tensor:
    return (cu[1:] - cu[:-1]).to(torch.int64)


def _take(src: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``src[idx]`` with ``idx`` clamped into range (the callers mask the clamped entries)."""
    if src.numel() == 0:
        return torch.zeros_like(idx)
    return src[idx.clamp(0, src.numel() - 1)]


def _gathered_table(cu_k: torch.Tensor, k_len: torch.Tensor, width: int) -> torch.Tensor:
    """``(num_seqs, max(width, 1))`` int32 block table over a gathered context read as pages of one
    row: sequence ``s``'s at rows ``[cu_k[s], cu_k[s] + k_len[s])``, ``-1`` past its length."""
    j = torch.arange(max(width, 1), device=cu_k.device, dtype=torch.int64)
    table = cu_k[:-1].to(torch.int64)[:, None] + j[None, :]
    return torch.where(j[None, :] < k_len[:, None], table, -1).to(torch.int32)


def _past_lengths(kwargs: dict, cu_k_all: dict, cu_q: torch.Tensor, q_len: torch.Tensor) -> torch.Tensor:
    """Each sequence's cached tokens before this step, on the device (no host sync)."""
    full = cu_k_all.get("full_attention")
    if full is not None:
        return _diff(full.to(torch.int64)) - q_len
    pos = kwargs.get("position_ids")
    if pos is not None:
        flat = pos.reshape(-1).to(torch.int64)
        first = _take(flat, cu_q[:-1].to(torch.int64))
        return torch.where(q_len > 0, first, torch.zeros_like(first))
    raise NotImplementedError(
        "paged|kvcache: a model with only sliding-window layers must pass position_ids to its attention "
        "(kvcache.hf derives each sequence's length from them)")


def _build_step(allocator, kwargs: dict, cu_k_all: dict, max_k_all: dict) -> GroupStep:
    """Builds one group's :class:`GroupStep` from transformers' per-step kwargs (device ops only)."""
    ai = allocator.index
    cu_q = kwargs["cu_seq_lens_q"].to(torch.int32)
    write_index = kwargs["write_index"][ai]
    read_index = kwargs["read_index"][ai]
    cu_k = cu_k_all[allocator.layer_type]
    ml_k = int(max_k_all[allocator.layer_type])
    ml_q = int(kwargs.get("max_length_q") or 0)
    dev = write_index.device
    tpp = allocator.tokens_per_page
    stride = allocator.block_physical_stride
    window = int(getattr(allocator, "sliding_window", 0) or 0)

    step = GroupStep()
    step.read_index, step.write_index = read_index, write_index
    step.cu_seqlens_q = cu_q
    step.window = window

    q_len = _diff(cu_q)
    k_len = _diff(cu_k.to(torch.int64))

    if window and ml_k > window:
        # Some sequence adds several tokens past the ring's capacity: transformers' sliding update
        # (bounded read of <= window - 1 cached tokens per sequence) and pages of one token.
        step.gather = True
        step.slots = None
        step.block_size = 1
        step.block_table = _gathered_table(cu_k, k_len, ml_k)
        step.context_lens = k_len.to(torch.int32)
        return step

    step.gather = False
    # Writes: transformers' rows -> slots of the strided (num_blocks, page_size) views; trash -> -1.
    trash_rows = 2 * allocator.blocks_per_sector * stride
    wi = write_index.to(torch.int64)
    step.slots = torch.where(wi >= trash_rows, (wi // stride) * tpp + wi % tpp, torch.full_like(wi, -1))

    # Reads: a virtual block table over the (shifted) positions of each sequence.
    bs = math.gcd(window, tpp) if window else tpp
    step.block_size = bs
    p = _past_lengths(kwargs, cu_k_all, cu_q, q_len) if window else k_len - q_len
    total = p + q_len                                   # tokens of each sequence, this step's included
    old_cnt = k_len - q_len                             # cached tokens listed in read_index
    old_start = p - old_cnt                             # position of the first of them
    if window:
        lo = (total - q_len - window + 1).clamp(min=0)  # first position any query of the step sees
        shift = (lo // window) * window                 # multiple of the window: same ring slots
        width = -(-(ml_q + 2 * window) // bs)
    else:
        lo = torch.zeros_like(total)
        shift = lo
        width = -(-max(ml_k, 1) // bs)
    width = max(width, 1)
    j = torch.arange(width, device=dev, dtype=torch.int64)
    start = shift[:, None] + j[None, :] * bs           # absolute position of each virtual page's first slot
    needed = (start + bs > lo[:, None]) & (start < total[:, None])
    t = torch.minimum(torch.maximum(start, lo[:, None]), (total - 1).clamp(min=0)[:, None])
    rk = cu_k[:-1].to(torch.int64)[:, None]
    wq = cu_q[:-1].to(torch.int64)[:, None]
    from_read = _take(read_index.to(torch.int64), rk + (t - old_start[:, None]))
    from_write = _take(wi, wq + (t - p[:, None]))
    row = torch.where(t < p[:, None], from_read, from_write)
    step.block_table = torch.where(needed, row // bs, -1).to(torch.int32)
    step.context_lens = (total - shift).to(torch.int32)
    return step


def _group_step(cache, allocator, kwargs: dict, cu_k_all: dict, max_k_all: dict) -> GroupStep:
    """The step's :class:`GroupStep` for ``allocator``'s group, built by the step's first layer of the group."""
    key = kwargs["write_index"]  # a new list each step, shared by the step's layers
    memo = getattr(cache, "_kvcache_paged_step", None)
    if memo is None or memo[0] is not key:
        memo = (key, {})
        cache._kvcache_paged_step = memo  # holds `key`: its id cannot be reused while memoized
    steps = memo[1]
    step = steps.get(allocator.index)
    if step is None:
        step = steps[allocator.index] = _build_step(allocator, kwargs, cu_k_all, max_k_all)
    return step


# --------------------------------------------------------------------------------------------- #
# Page views of transformers' cache tensor
# --------------------------------------------------------------------------------------------- #

def _views(allocator, layer_idx: int, block_size: int):
    """``(write_k, write_v, read_k, read_v)`` page views of one layer, memoized on the allocator.

    The write views are ``(num_blocks, page_size, kv, d)`` strided views that share no byte; the
    read views are contiguous ``(n, block_size, kv, d)`` views starting at the layer's first key /
    value row (they overlap each other, and are only read).
    """
    memo = allocator.__dict__.setdefault("_kvcache_views", {})
    out = memo.get((layer_idx, block_size))
    if out is None:
        tpp = allocator.tokens_per_page
        num_layers = allocator.pages_per_block
        i = allocator.layer_indices.index(layer_idx)
        flat = allocator.cache_tensor.view(-1, allocator.num_key_value_heads, allocator.head_dim)
        rows = flat.shape[0]
        blocks = flat.view(rows // (2 * num_layers * tpp), 2 * num_layers, tpp, *flat.shape[1:])
        k_rows, v_rows = flat[2 * i * tpp:], flat[(2 * i + 1) * tpp:]
        n = v_rows.shape[0] // block_size
        out = (blocks[:, 2 * i], blocks[:, 2 * i + 1],
               k_rows[: n * block_size].view(n, block_size, *flat.shape[1:]),
               v_rows[: n * block_size].view(n, block_size, *flat.shape[1:]))
        memo[(layer_idx, block_size)] = out
    return out


# --------------------------------------------------------------------------------------------- #
# The patched cache update and the attention function
# --------------------------------------------------------------------------------------------- #

def uses_kvcache(cache) -> bool:
    """Whether ``cache`` (a ``PagedAttentionCache``) serves a model whose attention is kvcache's.

    Args:
        cache: transformers' ``PagedAttentionCache`` (any object with a ``config``).

    Returns:
        ``True`` when ``cache.config._attn_implementation`` is ``"kvcache"``,
        :data:`PAGED_ATTN_IMPLEMENTATION` or :data:`CB_ATTN_IMPLEMENTATION`; then the patched
        ``PagedAttentionCache.update`` gathers nothing.
    """
    return getattr(getattr(cache, "config", None), "_attn_implementation", None) in IMPLEMENTATIONS


@torch.compiler.disable
def paged_update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
                 kwargs: dict) -> "tuple[torch.Tensor, torch.Tensor]":
    """``PagedAttentionCache.update`` for kvcache models: prepares the layer's paged call, copies nothing.

    Args:
        self: The ``PagedAttentionCache``.
        key_states, value_states: ``(1, num_kv_heads, num_tokens, head_dim)`` of this step.
        layer_idx: The model layer.
        kwargs: The forward's kwargs, updated in place as transformers' update does
            (``cu_seq_lens_k`` / ``max_length_k`` of the layer's group) plus the layer's
            ``LayerCall`` (the layer's step and allocator) under ``PAGED_STEP``.

    Returns:
        ``(key_states, value_states)`` unchanged; the attention function writes them.

    Raises:
        NotImplementedError: A block-table (flash decode fast path) batch.
    """
    if not uses_kvcache(self):
        return _orig_update(self, key_states, value_states, layer_idx, kwargs=kwargs)
    if kwargs.get("block_table") is not None:
        raise NotImplementedError("paged|kvcache does not take transformers' flash decode fast path (block_table)")
    allocator = self.layer_to_allocator[layer_idx]
    cu_k_all, max_k_all = kwargs["cu_seq_lens_k"], kwargs["max_length_k"]
    if not isinstance(cu_k_all, dict):  # already selected (a second update of the same kwargs)
        cu_k_all, max_k_all = {allocator.layer_type: cu_k_all}, {allocator.layer_type: max_k_all}
    step = _group_step(self, allocator, kwargs, cu_k_all, max_k_all)
    kwargs["cu_seq_lens_k"] = cu_k_all[allocator.layer_type].to(torch.int32)
    kwargs["max_length_k"] = max_k_all[allocator.layer_type]
    kwargs[PAGED_STEP] = LayerCall(step, allocator, layer_idx)
    return key_states, value_states


@torch.compiler.disable
def paged_kvcache_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    **kwargs: Any,
):
    """The ``"paged|kvcache"`` attention (:data:`CB_ATTN_IMPLEMENTATION` in transformers 5.24+).

    Without ``PAGED_STEP`` in ``kwargs`` (a regular forward), this is
    :func:`kvcache.hf.kvcache_attention`. With it, the layer's new keys and values are
    written into transformers' paged cache in place and the queries attend over the pages.

    Args:
        module: The attention module.
        query: ``(1, num_heads, num_tokens, head_dim)``, the step's packed queries.
        key, value: ``(1, num_kv_heads, num_tokens, head_dim)``, the step's new keys and values.
        attention_mask: ``None`` under continuous batching (no mask is built).
        dropout: Must be 0.
        scaling: Score scale (default ``head_dim ** -0.5``).
        sliding_window: The layer's window (its group's ring decides what is read).
        softcap: Logit soft-capping, or ``None``.
        **kwargs: transformers' paged kwargs; ``s_aux`` / ``sinks``: learned sink logits.

    Returns:
        ``(output (1, num_tokens, num_heads, head_dim), None)``.

    Raises:
        NotImplementedError: Attention dropout in training, non-causal attention.
        ValueError: What ``attend_pages`` / ``write_pages`` refuse.
    """
    call = kwargs.pop(PAGED_STEP, None)
    if call is None and is_gathering_step(kwargs):
        return _attend_gathered(module, query, key, value, scaling, sliding_window, softcap, kwargs)
    if call is None:
        return kvcache_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                 sliding_window=sliding_window, softcap=softcap, **kwargs)
    if dropout and getattr(module, "training", False):
        raise NotImplementedError("paged|kvcache is for inference: attention dropout is not supported")
    if not getattr(module, "is_causal", True):
        raise NotImplementedError("paged|kvcache supports causal self-attention only")
    sink_logits = _sink_logits(kwargs)
    step, allocator, layer_idx = call.step, call.allocator, call.layer_idx
    q = query[0].transpose(0, 1)  # (num_tokens, num_heads, head_dim)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    if step.gather:
        keys, values = allocator.update(k, v, layer_idx, step.read_index, step.write_index)
        read_k, read_v = keys.unsqueeze(1), values.unsqueeze(1)
    else:
        write_k, write_v, read_k, read_v = _views(allocator, layer_idx, step.block_size)
        write_pages(write_k, write_v, k, v, step.slots)
    out = attend_pages(q, read_k, read_v, step.block_table, step.context_lens, step.cu_seqlens_q, scale=scaling,
                       window=step.window, softcap=softcap, sink_logits=sink_logits)
    return out.unsqueeze(0), None


def _sink_logits(kwargs: dict) -> Optional[torch.Tensor]:
    sink = kwargs.get("s_aux")
    if sink is None:
        sink = kwargs.get("sinks")
    return None if sink is None else sink.detach().to(torch.float32).reshape(-1)


def _attend_gathered(module, query, key, value, scaling, sliding_window, softcap, kwargs: dict):
    """transformers releases whose attention function updates the paged cache itself (5.18:
    ``cache.update(k, v, layer_idx, read_index, write_index)`` writes the step's keys and values
    and returns every sequence's context gathered back to back, as their flash varlen path reads
    it): the gathered rows are read as pages of one slot, sequence ``s``'s at rows
    ``[cu_seq_lens_k[s], cu_seq_lens_k[s + 1])``. The context is copied, as by ``paged|sdpa``, but
    each query reads only its own sequence's keys (no ``total_q x total_k`` mask). The window is the
    one the layer passes (Mistral, Phi3, Starcoder2 pass their config's; their modules have no
    ``sliding_window``), else its module's (Gemma's)."""
    if not getattr(module, "is_causal", True):
        raise NotImplementedError("paged|kvcache supports causal self-attention only")
    window = int(sliding_window or getattr(module, "sliding_window", None) or 0)
    layer_type = "sliding_attention" if window else "full_attention"
    cu_k, max_k = kwargs["cu_seq_lens_k"], kwargs.get("max_seqlen_k")
    if isinstance(cu_k, dict):
        cu_k = cu_k[layer_type]
        max_k = max_k[layer_type] if isinstance(max_k, dict) else max_k
    k, v = kwargs["cache"].update(key_states=key, value_states=value, layer_idx=module.layer_idx,
                                  read_index=kwargs["read_index"], write_index=kwargs["write_index"])
    k_len = _diff(cu_k)
    width = int(max_k) if max_k is not None else int(k_len.max()) if k_len.numel() else 1
    table = _gathered_table(cu_k, k_len, width)
    q = query[0].transpose(0, 1)
    out = attend_pages(q, k.unsqueeze(1), v.unsqueeze(1), table, k_len.to(torch.int32),
                       kwargs["cu_seq_lens_q"].to(torch.int32), scale=scaling, window=window, softcap=softcap,
                       sink_logits=_sink_logits(kwargs))
    return out.unsqueeze(0), None


def _unless_packed(*args, mask_function=None, attention_mask=None, local_size=None, **kwargs):
    """The paged names' mask function on transformers 5.18: ``None`` for a continuous-batching
    step's packed sequences (no 2-D mask, the causal mask composed with a packed-sequence one: the
    paged attention reads ``cu_seq_lens_q`` / ``cu_seq_lens_k``), else :func:`kvcache_mask`
    (left padding honoured, other custom masks refused). Arguments as :func:`kvcache_mask`."""
    if attention_mask is None and local_size is None and mask_function is not masking_utils.causal_mask_function:
        return None
    return kvcache_mask(*args, mask_function=mask_function, attention_mask=attention_mask, local_size=local_size,
                        **kwargs)


def _switch_to_cb_friendly_attn(self, model, *args, **kwargs) -> None:
    """``ContinuousBatchingManager.switch_to_cb_friendly_attn`` that keeps a kvcache attention.

    A ``"kvcache"`` / ``"paged|kvcache"`` model is switched to :data:`CB_ATTN_IMPLEMENTATION` (never to
    flash); ``stop()`` restores the original name, as for ``eager`` -> ``paged|eager``. Any other
    model goes to transformers' own method with its arguments as given (5.24+ adds
    ``auto_switch_to_flash``; 5.18 has none).

    Raises:
        NotImplementedError: A kvcache model whose keys and values have different head sizes
            (MLA-style attention: DeepSeek-V2/V3; transformers 5.25 pages their latents).
        TypeError: A kvcache model whose dtype is not float32, bfloat16 or float16.
        ValueError: A manager built for kvcache asked to run the model under another attention.
    """
    original = getattr(model.config, "_attn_implementation", None)
    if original not in IMPLEMENTATIONS:
        if getattr(self, "_kvcache_built", False):
            # Its inputs were allocated for paged|kvcache, without the attention mask sdpa and
            # paged|eager read: reusing them would attend without a mask (wrong tokens).
            raise ValueError(
                f"this ContinuousBatchingManager was built for attn_implementation='kvcache' and cannot run "
                f"the model as {original!r}: call model.destroy_cached_continuous_batching_manager() after "
                f"switching the attention (or run generate_batch with persistent_manager=False)")
        return _orig_switch(self, model, *args, **kwargs)
    # Refused here, in the caller's thread: raised inside a step, the error would only be logged by
    # the manager's generation thread and every request would come back failed and empty.
    check_paged_model(model)
    self._kvcache_built = True
    if original != CB_ATTN_IMPLEMENTATION:
        model.set_attn_implementation(CB_ATTN_IMPLEMENTATION)
        self._original_attn_impl = original
    return None


def install() -> bool:
    """Registers ``paged|kvcache`` and patches transformers' continuous batching to use it (idempotent).

    Registers :func:`paged_kvcache_attention` as ``"paged|kvcache"`` and
    :data:`CB_ATTN_IMPLEMENTATION` in ``AttentionInterface`` (``"kvcache"`` stays
    :func:`~kvcache.hf.kvcache_attention`), wraps ``PagedAttentionCache.update`` (kvcache
    models only: no gather) and lets ``ContinuousBatchingManager`` run a kvcache model through the
    paged function instead of refusing it.

    Returns:
        ``True`` when continuous batching was patched, ``False`` when the installed transformers
        has no continuous batching (the regular ``"kvcache"`` attention is registered either way).
    """
    global _installed, _orig_update, _orig_switch, IN_PLACE
    from ._compat import AttentionInterface

    AttentionInterface.register(PAGED_ATTN_IMPLEMENTATION, paged_kvcache_attention)
    AttentionInterface.register(CB_ATTN_IMPLEMENTATION, paged_kvcache_attention)
    set_paged_attention(paged_kvcache_attention)
    if _installed:
        return True
    try:
        from transformers.generation.continuous_batching import cache as cb_cache
        from transformers.generation.continuous_batching import continuous_api
    except ImportError:
        return False
    cache_cls = cb_cache.PagedAttentionCache
    manager_cls = getattr(continuous_api, "ContinuousBatchingManager", None)
    if not hasattr(cache_cls, "update") or manager_cls is None:
        return False
    # 5.24+'s model layers call cache.update(k, v, layer_idx, kwargs=...) before the attention (patched:
    # no gather); 5.18's attention function calls update(..., read_index, write_index) itself
    # (_attend_gathered, transformers' update kept).
    IN_PLACE = "read_index" not in inspect.signature(cache_cls.update).parameters
    if IN_PLACE:
        _orig_update = cache_cls.update
        cache_cls.update = paged_update
    # Outside a step the paged names are the regular attention (a forward while a manager runs, or
    # after init_continuous_batching() and stop() without start(), which keeps the CB name): the
    # masks of "kvcache", so left padding is honoured. 5.24+'s steps build no mask for these names
    # (its attn_mask_is_needed); 5.18's ask this interface for a packed-sequence one, which
    # kvcache_mask refuses: there _unless_packed answers None (the step reads cu_seqlens).
    mask = kvcache_mask if IN_PLACE else _unless_packed
    AttentionMaskInterface.register(PAGED_ATTN_IMPLEMENTATION, mask)
    AttentionMaskInterface.register(CB_ATTN_IMPLEMENTATION, mask)
    _orig_switch = manager_cls.switch_to_cb_friendly_attn
    manager_cls.switch_to_cb_friendly_attn = _switch_to_cb_friendly_attn
    _installed = True
    return True
