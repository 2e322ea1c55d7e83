"""Paged caches: keys and values in fixed-size pages for many sequences at once.

Continuous batching serves requests that join and leave at every step; memory is handed out in
pages (blocks) of ``block_size`` slots as each sequence grows, so the cache holds the tokens that
exist rather than ``batch x max_len``. The layout is vLLM's flash layout and the memory of
transformers' ``PagedAttentionCache`` tensors, so either can be viewed without a copy:

* ``key_pages``, ``value_pages``: ``(num_blocks, block_size, num_kv_heads, head_dim)``;
* int8 / fp8 pages carry ``key_scales``, ``value_scales``: ``(num_blocks, block_size,
  num_kv_heads)`` float32, one scale per slot and KV head (the formats of :mod:`kvcache`'s
  quantized caches);
* a slot number is ``block * block_size + offset``; a block table ``(num_seqs, max_blocks)`` int32
  lists each sequence's pages in order, padded with -1.

:func:`write_pages` and :func:`attend_pages` are the two operators
(``torch.ops.kvcache.paged_write_`` / ``paged_attend``); :class:`PagedKVCache` holds one layer's
pages and :class:`BlockAllocator` hands out pages to sequences (allocate, free, fork with shared
full blocks). A scheduler (which requests run in a step) is the caller's.
"""

from dataclasses import dataclass
from typing import Optional, Union

import torch

from . import _C
from ._torchscript import make_scriptable
from .common import as_int, as_window, check_real, check_tensor_args, kv_dtype_of

_write_op = torch.ops.kvcache.paged_write_.default
_attend_op = torch.ops.kvcache.paged_attend.default

__all__ = ["write_pages", "attend_pages", "PagedKVCache", "init_paged_cache", "BlockAllocator",
           "UnknownSequenceError"]


def write_pages(
    key_pages: torch.Tensor,
    value_pages: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_scales: Optional[torch.Tensor] = None,
    value_scales: Optional[torch.Tensor] = None,
) -> None:
    """Writes new tokens' keys and values into their slots of the pages, in place.

    Token ``t`` goes to slot ``slot_mapping[t]`` (page ``slot // block_size``, offset
    ``slot % block_size``); -1 skips the token (vLLM's ``reshape_and_cache_flash``). Quantized
    pages (int8 / float8_e4m3fn) are quantized on write, one scale per (slot, KV head) written to
    ``key_scales`` / ``value_scales``. One call, one pass over the tokens; nothing else is read or
    written.

    Args:
        key_pages, value_pages: ``(num_blocks, block_size, num_kv_heads, head_dim)``, written.
        key, value: ``(num_tokens, num_kv_heads, head_dim)``, the pages' dtype (float32, bfloat16
            or float16 for quantized pages).
        slot_mapping: ``(num_tokens,)`` int32 or int64 slots, -1 to skip.
        key_scales, value_scales: ``(num_blocks, block_size, num_kv_heads)`` float32, given exactly
            when the pages are quantized; written.

    Raises:
        ValueError: Shapes or devices that do not fit, tensors sharing memory, a slot outside
            ``[-1, num_blocks * block_size)`` or a slot given twice (CPU; checked before anything
            is written; on CUDA a bad slot mapping writes nothing); one of the two scales given
            without the other.
        TypeError: A dtype that does not fit (no implicit casts); scales given with plain pages,
            or left out with int8 / fp8 pages (as ``update_kv_layer_cache`` raises).
    """
    if torch.jit.is_scripting():
        torch.ops.kvcache.paged_write_(key_pages, value_pages, key, value, slot_mapping, key_scales=key_scales,
                                       value_scales=value_scales)
        return
    check_tensor_args(key_pages=key_pages, value_pages=value_pages, key=key, value=value, slot_mapping=slot_mapping,
                      key_scales=key_scales, value_scales=value_scales, optional=("key_scales", "value_scales"))
    _write_op(key_pages, value_pages, key, value, slot_mapping, key_scales=key_scales,
              value_scales=value_scales)


def attend_pages(
    q: torch.Tensor,
    key_pages: torch.Tensor,
    value_pages: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: Optional[float] = None,
    window: Optional[int] = 0,
    softcap: Optional[float] = None,
    sink_logits: Optional[torch.Tensor] = None,
    key_scales: Optional[torch.Tensor] = None,
    value_scales: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention of varlen queries over each sequence's pages, read in place.

    Sequence ``s`` holds ``context_lens[s]`` tokens (this step's included) at positions
    ``0 .. context_lens[s] - 1``; position ``j`` is in slot ``j % block_size`` of page
    ``block_table[s, j // block_size]``. Its queries are ``q[cu_seqlens_q[s]:cu_seqlens_q[s+1]]``,
    its last tokens: query ``i`` sits at position ``context_lens[s] - q_len + i`` and attends
    causally (with ``window``, to the last ``window`` positions up to itself). Prefill, decode and
    mixed batches are one call; only the pages of visible positions are read (entries of other
    blocks, past the context or freed out of a window, may be -1). ``q`` may end with padding
    (rows ``cu_seqlens_q[-1]:``, no sequence's: a batch padded to a fixed size for a compiled or
    CUDA-graph step, as transformers' continuous batching pads its steps then): those rows come
    out 0.

    Args:
        q: ``(total_q, num_heads, head_dim)`` float32, bfloat16 or float16 (the pages' dtype for
            plain pages); ``num_heads`` a multiple of ``num_kv_heads``.
        key_pages, value_pages: ``(num_blocks, block_size, num_kv_heads, head_dim)``.
        block_table: ``(num_seqs, max_blocks)`` int32, -1 padded.
        context_lens: ``(num_seqs,)`` int32.
        cu_seqlens_q: ``(num_seqs + 1,)`` int32 offsets of each sequence's queries in ``q``.
        scale: Score scale; ``None`` means ``head_dim ** -0.5``.
        window: Sliding window (0 or ``None``: none).
        softcap: Scores become ``softcap * tanh(score / softcap)``; ``None`` or 0: none.
        sink_logits: ``(num_heads,)`` float32 learned sink logits (gpt-oss's ``s_aux``), or None.
        key_scales, value_scales: The scales of int8 / fp8 pages (see :func:`write_pages`).

    Returns:
        ``(total_q, num_heads, head_dim)`` in ``q``'s dtype.

    Raises:
        ValueError: Shapes or devices that do not fit; ``scale`` / ``softcap`` out of range; on
            CPU, ``cu_seqlens_q`` not starting at 0, decreasing or ending beyond ``total_q``,
            ``context_lens`` below a sequence's query count or beyond its table, a page a query
            sees outside ``[0, num_blocks)`` (all before anything is read); a ``window`` outside
            int64.
        TypeError: Dtypes that do not fit; a ``window`` that is not an int; a ``scale`` or
            ``softcap`` that is not a number (a bool, a str, a tensor).
    """
    softcap_ = 0.0 if softcap is None else softcap
    if torch.jit.is_scripting():  # TorchScript's Optional[int] annotation already types window
        return torch.ops.kvcache.paged_attend(q, key_pages, value_pages, block_table, context_lens, cu_seqlens_q,
                                              scale=scale, window=0 if window is None else window, softcap=softcap_,
                                              key_scales=key_scales, value_scales=value_scales,
                                              sink_logits=sink_logits)
    check_tensor_args(q=q, key_pages=key_pages, value_pages=value_pages, block_table=block_table,
                      context_lens=context_lens, cu_seqlens_q=cu_seqlens_q, sink_logits=sink_logits,
                      key_scales=key_scales, value_scales=value_scales,
                      optional=("sink_logits", "key_scales", "value_scales"))
    check_real(scale=scale, softcap=softcap)
    return _attend_op(q, key_pages, value_pages, block_table, context_lens, cu_seqlens_q,
                      scale=scale, window=as_window(window), softcap=softcap_,
                      key_scales=key_scales, value_scales=value_scales, sink_logits=sink_logits)


_MAX_SLOTS = 2 ** 31 - 1  # slot numbers and context lengths are int32 in the block-table ops
_MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _positive(name: str, value) -> int:
    v = as_int(name, value)
    if v < 1:
        raise ValueError(f"{name} must be an int >= 1, got {v}")
    return v


def _pool(num_blocks, block_size) -> "tuple[int, int]":
    """A pool's ``(num_blocks, block_size)`` as ints >= 1 of at most ``2**31 - 1`` slots."""
    num_blocks, block_size = _positive("num_blocks", num_blocks), _positive("block_size", block_size)
    if num_blocks * block_size > _MAX_SLOTS:
        raise ValueError(f"num_blocks * block_size must be <= 2**31 - 1 slots, got {num_blocks} * {block_size}")
    return num_blocks, block_size


@dataclass
class PagedKVCache:
    """One layer's pages (and scales, for int8 / fp8 pages).

    Attributes:
        key_pages, value_pages: ``(num_blocks, block_size, num_kv_heads, head_dim)``.
        key_scales, value_scales: ``(num_blocks, block_size, num_kv_heads)`` float32, or None.
    """

    key_pages: torch.Tensor
    value_pages: torch.Tensor
    key_scales: Optional[torch.Tensor] = None
    value_scales: Optional[torch.Tensor] = None

    @property
    def block_size(self) -> int:
        """Slots per page (``key_pages.shape[1]``)."""
        return self.key_pages.shape[1]

    @property
    def num_blocks(self) -> int:
        """Pages in the pool (``key_pages.shape[0]``)."""
        return self.key_pages.shape[0]

    def write(self, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """:func:`write_pages` into this layer's pages (and scales), in place.

        Args:
            key, value: ``(num_tokens, num_kv_heads, head_dim)``.
            slot_mapping: ``(num_tokens,)`` int32 / int64 slots, -1 to skip a token.

        Raises:
            ValueError, TypeError: What :func:`write_pages` raises (nothing is written).
        """
        write_pages(self.key_pages, self.value_pages, key, value, slot_mapping, self.key_scales,
                    self.value_scales)

    def attend(self, q: torch.Tensor, block_table: torch.Tensor, context_lens: torch.Tensor,
               cu_seqlens_q: torch.Tensor, scale: Optional[float] = None, window: Optional[int] = 0,
               softcap: Optional[float] = None,
               sink_logits: Optional[torch.Tensor] = None) -> torch.Tensor:
        """:func:`attend_pages` over this layer's pages (and scales).

        Args:
            q: ``(total_q, num_heads, head_dim)``, the sequences' queries back to back.
            block_table: ``(num_seqs, max_blocks)`` int32, -1 padded.
            context_lens: ``(num_seqs,)`` int32, this step's tokens included.
            cu_seqlens_q: ``(num_seqs + 1,)`` int32 offsets of each sequence's queries in ``q``.
            scale, window, softcap, sink_logits: As :func:`attend_pages`.

        Returns:
            ``(total_q, num_heads, head_dim)`` in ``q``'s dtype.

        Raises:
            ValueError, TypeError: What :func:`attend_pages` raises.
        """
        return attend_pages(q, self.key_pages, self.value_pages, block_table, context_lens,
                            cu_seqlens_q, scale, window, softcap, sink_logits, self.key_scales,
                            self.value_scales)

    @torch.jit.unused
    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copies pages ``src[i]`` onto pages ``dst[i]``, scales included (all checked first:
        an error writes nothing).

        Args:
            src, dst: ``(n,)`` integer page indices in ``[0, num_blocks)``.

        Raises:
            ValueError: ``src`` and ``dst`` of different shapes or not 1-D, an index outside
                ``[0, num_blocks)``, a page named twice in ``dst``, pages and scales that do
                not share ``num_blocks``, or a page or scale tensor that cannot be written in
                place (an ``expand()``-ed view, a leaf that requires grad, an inference tensor
                outside inference mode).
            TypeError: ``src`` / ``dst`` not int32 / int64 tensors.
        """
        tensors = [t for t in (self.key_pages, self.value_pages, self.key_scales, self.value_scales)
                   if t is not None]
        for name, idx in (("src", src), ("dst", dst)):
            if not isinstance(idx, torch.Tensor) or idx.dtype not in (torch.int32, torch.int64):
                raise TypeError(f"{name} must be an int32 or int64 tensor of page indices, got "
                                f"{getattr(idx, 'dtype', type(idx).__name__)}")
            if idx.dim() != 1 or idx.shape != src.shape:
                raise ValueError(f"src and dst must be 1-D of one length, got {tuple(src.shape)} and "
                                 f"{tuple(dst.shape)}")
        n = self.num_blocks
        if any(t.shape[0] != n for t in tensors):
            raise ValueError("key_pages, value_pages and the scales must have the same num_blocks, got "
                             f"{[t.shape[0] for t in tensors]}")
        for name, idx in (("src", src), ("dst", dst)):
            if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
                raise ValueError(f"{name} must hold page indices in [0, num_blocks={n}), got "
                                 f"{idx.tolist()}")
        if torch.unique(dst).numel() != dst.numel():
            raise ValueError(f"dst must not name a page twice (which copy lands is undefined), got {dst.tolist()}")
        # One-byte formats by their bytes: index_copy_ has no float8 kernel.
        views = [t.view(torch.uint8) if t.element_size() == 1 else t for t in tensors]
        none = dst.new_empty(0, dtype=torch.int64)
        for name, b in zip(("key_pages", "value_pages", "key_scales", "value_scales"), views):
            # An empty copy writes nothing but meets every check a tensor's in-place write does
            # (internal overlap, autograd leaf, inference tensor): all pass before a page is written.
            try:
                b.index_copy_(0, none, b[:0])
            except RuntimeError as e:
                raise ValueError(f"{name} cannot be written in place: {e}") from None
        for b in views:
            b.index_copy_(0, dst.to(torch.int64), b.index_select(0, src.to(torch.int64)))


make_scriptable(PagedKVCache)


def _cache_zeros(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype, device=device)`` (``None``: torch's default device); on the
    CPU in eager code allocated as ``init_layer_cache`` allocates its buffers (``kvcache._C.cache_zeros``:
    transparent huge pages)."""
    if torch.compiler.is_compiling():
        return torch.zeros(shape, dtype=dtype, device=device)
    dev = torch.device(device) if device is not None else torch.get_default_device()
    if dev.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=dev)
    return _C.cache_zeros(shape, dtype, dev)


def init_paged_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: Union[torch.device, str, None] = None,
    *,
    kv_dtype=None,
) -> PagedKVCache:
    """Zero-filled pages of one layer (on the CPU under Linux in transparent huge pages, as
    :func:`kvcache.init_kv_layer_cache`'s buffers: a block table visits the pool's pages in any
    order, and 4 KB pages would cost a TLB miss each; ``KVCACHE_HUGE_PAGES=0`` turns that off).

    Args:
        num_blocks, block_size, num_kv_heads, head_dim: The page geometry (each >= 1).
        dtype: The model's dtype (the pages' dtype unless ``kv_dtype`` is given).
        device: Where the pages live (default: CPU).
        kv_dtype: ``None``, ``"int8"``/``torch.int8`` or ``"fp8"``/``torch.float8_e4m3fn``:
            quantized pages with float32 scales (the writes quantize ``dtype`` keys and values).

    Returns:
        A :class:`PagedKVCache`.

    Raises:
        ValueError: A size below 1, or more than ``2**31 - 1`` slots (``num_blocks *
            block_size``: slots and lengths are int32 in the ops).
        TypeError: A size that is not an int; a ``dtype`` other than float32, bfloat16 and
            float16; an unknown ``kv_dtype``.
    """
    num_blocks, block_size = _pool(num_blocks, block_size)
    num_kv_heads, head_dim = _positive("num_kv_heads", num_kv_heads), _positive("head_dim", head_dim)
    if dtype not in _MODEL_DTYPES:
        raise TypeError(f"dtype must be torch.float32, torch.bfloat16 or torch.float16 (what write_pages and "
                        f"attend_pages take), got {dtype}")
    store = kv_dtype_of(kv_dtype) or dtype
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = _cache_zeros(shape, store, device)
    v = _cache_zeros(shape, store, device)
    if store in (torch.int8, torch.float8_e4m3fn):
        ks = torch.ones(shape[:3], dtype=torch.float32, device=device)
        vs = torch.ones(shape[:3], dtype=torch.float32, device=device)
        return PagedKVCache(k, v, ks, vs)
    return PagedKVCache(k, v)


def __getattr__(name: str):
    # BlockAllocator, the host bookkeeping that hands these pages out, lives in
    # kvcache.block_allocator (which imports PagedKVCache); it stays importable from here.
    if name in ("BlockAllocator", "UnknownSequenceError"):
        from . import block_allocator

        return getattr(block_allocator, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
