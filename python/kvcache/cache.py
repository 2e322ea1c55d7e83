"""Key/value cache for autoregressive self-attention (inference).

A PyTorch port of the JAX ``KVLayerCache`` module. The one deliberate
difference: the JAX original returns new buffers from every update
(``.at[].set``), while here :func:`update_kv_layer_cache` writes into the
existing buffers in place, through one ``torch.ops.kvcache`` call, and the
returned cache shares them. A decode step therefore costs O(chunk) memory
traffic, never O(max_len).
"""


from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch

from ._torchscript import make_scriptable
from .common import (INT64_MAX, INT64_MIN, as_int, as_window, check_real, check_tensor_args, kv_dtype_of,
                     raise_out_of_range_start)
from .ring import RingKV, RingLayerCache, attend_ring
from .config import TransformerConfig

# The package's __init__ has loaded the operators (it runs before any submodule).
_init_op = torch.ops.kvcache.init_layer_cache.default
_update_op = torch.ops.kvcache.update_.default
_update_tensor_op = torch.ops.kvcache.update_.Tensor
_append_op = torch.ops.kvcache.append_.default
_append_returning_op = torch.ops.kvcache.append_returning_.default
_attend_op = torch.ops.kvcache.attend.default

_check_lengths_writable_op = torch.ops.kvcache.check_lengths_writable.default



@dataclass(frozen=True)
class KVLayerCache:
    """KV cache buffers for one attention layer.

    Stores keys and values after RoPE rotation in KV-head layout
    (``num_kv_heads``).

    Args:
        keys: Cached keys of shape ``(batch, num_kv_heads, max_len, head_dim)``.
        values: Cached values of the same shape as ``keys`` (its own storage).
        length: ``int32`` tensor on the cache's device: the number of valid
            positions; 0-D, or ``(batch,)`` after an update with per-row
            positions.
        k_scale: For a quantized cache (``int8`` or ``float8_e4m3fn`` keys
            and values, see ``init_kv_layer_cache(kv_dtype=...)``): the
            float32 ``(batch, num_kv_heads, max_len)`` scale of every key
            slot; ``None`` for a plain cache.
        v_scale: The same for the values.
    """

    keys: torch.Tensor
    values: torch.Tensor
    length: torch.Tensor
    k_scale: Optional[torch.Tensor] = None
    v_scale: Optional[torch.Tensor] = None

    @property
    def max_len(self) -> int:
        """Maximum number of tokens the cache can hold."""
        return int(self.keys.shape[2])

    @property
    def quantized(self) -> bool:
        """Whether keys and values are quantized (int8 or fp8 with scales)."""
        return self.k_scale is not None


make_scriptable(KVLayerCache)


def init_kv_layer_cache(
    batch_size: int,
    num_kv_heads: int,
    head_dim: int,
    max_len: int,
    dtype: torch.dtype,
    device: Optional[Union[torch.device, str]] = None,
    *,
    kv_dtype=None,
) -> KVLayerCache:
    """Creates a zero-filled :class:`KVLayerCache`.

    Args:
        batch_size: Batch dimension.
        num_kv_heads: Number of KV heads.
        head_dim: Per-head feature dimensionality.
        max_len: Maximum sequence length.
        dtype: Buffer dtype (any: float32, bfloat16, float8, int8, bool, ...).
            With ``kv_dtype`` it is not stored: keys/values written and
            queries may be float32, bfloat16 or float16.
        device: Buffer device; ``None`` means CPU.
        kv_dtype: ``None`` (a plain cache of ``dtype``), or a quantized cache:
            ``"int8"`` / ``torch.int8`` or ``"fp8"`` / ``torch.float8_e4m3fn``
            keys and values with one float32 scale per (row, KV head, slot)
            in ``k_scale`` / ``v_scale`` (README "Quantized caches"). Writes
            quantize, :func:`attend` dequantizes in registers.

    Returns:
        :class:`KVLayerCache` with zero buffers (two separate allocations;
        on the CPU under Linux in transparent huge pages, which makes
        reading long caches cheaper: ``KVCACHE_HUGE_PAGES=0`` turns that
        off) and ``length = 0`` (and scales of 1 for a quantized cache).

    Raises:
        TypeError: If a size is not an int, ``dtype`` is not a
            ``torch.dtype`` or ``kv_dtype`` is not one of the spellings above.
        ValueError: If a size is negative, ``max_len`` is 2**31 or more
            (lengths are int32), or the cache would not fit in 2**63 bytes.
    """
    sizes = []
    for name, v in (
        ("batch_size", batch_size),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
        ("max_len", max_len),
    ):
        v = as_int(name, v)
        if not INT64_MIN <= v <= INT64_MAX:
            raise ValueError(f"{name} must fit in int64 (and max_len in int32), got {v}")
        sizes.append(v)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
    stored = kv_dtype_of(kv_dtype)
    dev = torch.device(device) if device is not None else None
    keys, values, length = _init_op(*sizes, dtype=stored if stored is not None else dtype, device=dev)
    if stored is None:
        return KVLayerCache(keys=keys, values=values, length=length)
    # Scales indexed like the slots: (batch, num_kv_heads, max_len).
    k_scale = torch.ones(keys.shape[:3], dtype=torch.float32, device=keys.device)
    v_scale = torch.ones(keys.shape[:3], dtype=torch.float32, device=keys.device)
    return KVLayerCache(keys=keys, values=values, length=length, k_scale=k_scale, v_scale=v_scale)


def update_kv_layer_cache(
    cache: KVLayerCache,
    keys_new: torch.Tensor,
    values_new: torch.Tensor,
    start: Union[int, torch.Tensor],
) -> KVLayerCache:
    """Writes new keys/values into ``cache`` at ``[start, start + chunk)``.

    The write is in place: the returned cache shares ``cache.keys`` and
    ``cache.values`` (no copy of the buffers is ever made), and only its
    ``length`` is new. Both buffers are written by one operator call.

    Args:
        cache: Existing :class:`KVLayerCache`.
        keys_new: Keys of shape ``(batch, num_kv_heads, chunk, head_dim)``,
            the cache's dtype and device; any strides (for example a
            transposed ``(batch, chunk, heads, head_dim)`` view). For a
            quantized cache: float32, bfloat16 or float16, quantized per
            slot with their scales written to ``cache.k_scale`` /
            ``cache.v_scale`` (``update_`` with ``k_scale`` / ``v_scale``).
        values_new: Values of the same shape as ``keys_new``.
        start: Position to write at: a Python int, or an int32/int64 tensor on
            the cache's device, 0-D (same start for every row) or of shape
            ``(batch,)`` (one start per row, for ragged batches). A tensor
            start is read on the device: no host sync, no recompile under
            ``torch.compile`` when it changes.

    Returns:
        :class:`KVLayerCache` sharing the buffers, with
        ``length = start + chunk`` as int32 (0-D for an int or 0-D start,
        ``(batch,)`` for per-row starts).

    Raises:
        ValueError: If ``start + chunk > cache.max_len``
            (``"KV cache overflow: end=E exceeds max_len=M"``), ``start`` is
            negative, shapes or devices do not match, or the new data shares
            memory with the rows it is written to. Nothing is written. On
            CUDA a device ``start`` is checked by the kernel: if any row is
            out of range nothing is written and every entry of the returned
            ``length`` is -1 (check ``(cache.length >= 0).all()``).
        TypeError: If ``cache`` is not a :class:`KVLayerCache`, dtypes
            differ, or ``start`` is neither an int nor an integer tensor.
    """
    if torch.jit.is_scripting():
        # TorchScript: the same call (the isinstance refines the Union),
        # without the Python-only type checks.
        ks = cache.k_scale
        vs = cache.v_scale
        if isinstance(start, torch.Tensor):
            length = torch.ops.kvcache.update_(
                cache.keys, cache.values, keys_new, values_new, start, k_scale=ks, v_scale=vs
            )
        else:
            length = torch.ops.kvcache.update_(
                cache.keys, cache.values, keys_new, values_new, start, k_scale=ks, v_scale=vs
            )
        return KVLayerCache(cache.keys, cache.values, length, ks, vs)
    if not isinstance(cache, KVLayerCache):
        raise TypeError(f"cache must be a KVLayerCache, got {type(cache).__name__}")
    check_tensor_args(keys_new=keys_new, values_new=values_new)
    keys, values = cache.keys, cache.values
    ks, vs = cache.k_scale, cache.v_scale
    # One write for both formats: the scales (None for a plain cache) pick
    # it. The op returns the new length too: one dispatch (one CUDA launch)
    # per update.
    if isinstance(start, torch.Tensor):
        length = _update_tensor_op(keys, values, keys_new, values_new, start, k_scale=ks, v_scale=vs)
    else:
        if not isinstance(start, (int, torch.SymInt)) or isinstance(start, bool):
            start = as_int("start", start)
        if isinstance(start, int) and not INT64_MIN <= start <= INT64_MAX:
            # The op takes int64: say what the user got wrong, not "expected int".
            raise_out_of_range_start(start, keys_new, keys)
        length = _update_op(keys, values, keys_new, values_new, start, k_scale=ks, v_scale=vs)
    return KVLayerCache(keys, values, length, ks, vs)


def init_decoder_kv_caches(
    *,
    num_layers: int,
    batch_size: int,
    num_kv_heads: int,
    head_dim: int,
    max_len: int,
    dtype: torch.dtype,
    device: Optional[Union[torch.device, str]] = None,
    kv_dtype=None,
) -> Tuple[KVLayerCache, ...]:
    """Creates one empty :class:`KVLayerCache` per layer.

    Args:
        num_layers: Number of layers.
        batch_size: Batch dimension.
        num_kv_heads: Number of KV heads.
        head_dim: Per-head feature dimensionality.
        max_len: Maximum cached sequence length.
        dtype: Buffer dtype.
        device: Buffer device; ``None`` means CPU.
        kv_dtype: ``None``, ``"int8"`` or ``"fp8"`` (or the torch dtypes):
            quantized caches, as :func:`init_kv_layer_cache`.

    Returns:
        Tuple of ``num_layers`` :class:`KVLayerCache` objects, each with its
        own buffers.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If a size is negative.
    """
    n = as_int("num_layers", num_layers)
    if n < 0:
        raise ValueError(f"num_layers must be >= 0, got {n}")
    return tuple(
        init_kv_layer_cache(batch_size, num_kv_heads, head_dim, max_len, dtype, device, kv_dtype=kv_dtype)
        for _ in range(n)
    )


def init_decoder_kv_caches_from_config(
    config: TransformerConfig,
    *,
    batch_size: int,
    max_len: Optional[int] = None,
    dtype: torch.dtype = torch.float32,
    device: Optional[Union[torch.device, str]] = None,
    kv_dtype=None,
) -> Tuple[KVLayerCache, ...]:
    """Builds per-layer KV caches from a :class:`TransformerConfig`.

    Args:
        config: Transformer hyperparameters.
        batch_size: Batch dimension.
        max_len: Maximum cached length. Defaults to
            ``config.kv_cache_max_len`` (which defaults to ``config.max_len``).
        dtype: Buffer dtype.
        device: Buffer device; ``None`` means CPU.
        kv_dtype: ``None``, ``"int8"`` or ``"fp8"``: quantized caches (see
            :func:`init_kv_layer_cache`).

    Returns:
        Tuple of ``config.num_layers`` :class:`KVLayerCache` objects with
        ``num_kv_heads = config.num_kv_heads`` and
        ``head_dim = config.d_model // config.num_heads``.

    Raises:
        TypeError: If ``config`` is not a :class:`TransformerConfig`.
        ValueError: If a size is negative.
    """
    if not isinstance(config, TransformerConfig):
        raise TypeError(f"config must be a TransformerConfig, got {type(config).__name__}")
    cap = max_len if max_len is not None else config.kv_cache_max_len
    return init_decoder_kv_caches(
        num_layers=config.num_layers,
        batch_size=batch_size,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        max_len=cap,
        dtype=dtype,
        device=device,
        kv_dtype=kv_dtype,
    )


def append_kv_layer_cache(cache: KVLayerCache, keys_new: torch.Tensor, values_new: torch.Tensor) -> KVLayerCache:
    """Writes new keys/values at ``cache.length`` and advances it, in place.

    The stateful counterpart of :func:`update_kv_layer_cache`: one operator
    call writes both buffers at each row's current length and adds ``chunk``
    to ``cache.length`` in place, so the length tensor keeps its address
    (CUDA graphs, module buffers) and no position has to be tracked outside.

    Args:
        cache: :class:`KVLayerCache` whose ``length`` (int32/int64, 0-D or
            ``(batch,)``) is the position to write at; it is advanced.
        keys_new: Keys ``(batch, num_kv_heads, chunk, head_dim)``.
        values_new: Values of the same shape as ``keys_new``.

    Returns:
        ``cache`` itself (its ``length`` now ``length + chunk``).

    Raises:
        ValueError: If a row would overflow (``"KV cache overflow: ..."``),
            shapes or devices do not match, or tensors share memory that is
            written. Nothing is written. On CUDA, where the lengths are only
            read on the device, an overflowing row instead makes the kernel
            write nothing and set every length to -1.
        TypeError: If dtypes differ.
    """
    if torch.jit.is_scripting():
        torch.ops.kvcache.append_(
            cache.keys, cache.values, cache.length, keys_new, values_new, k_scale=cache.k_scale, v_scale=cache.v_scale
        )
        return cache
    if not isinstance(cache, KVLayerCache):
        raise TypeError(f"cache must be a KVLayerCache, got {type(cache).__name__}")
    check_tensor_args(keys_new=keys_new, values_new=values_new)
    _append(cache.keys, cache.values, cache.length, keys_new, values_new, cache.k_scale, cache.v_scale)
    return cache


def _append(keys, values, lengths, keys_new, values_new, k_scale=None, v_scale=None) -> None:
    # The one place that chooses how lengths advance (kvcache.hf calls it too),
    # for both formats (k_scale / v_scale: a quantized cache's, else None).
    # Eager: append_, in place. Traced (torch.compile, torch.export):
    # append_returning_, whose new lengths are copied back. Inductor (torch
    # 2.13) can re-inline a pointwise read of a graph input made before a
    # custom op that mutates it in place after that op, where it sees the new
    # value (docs/design.md has the repro); a copy_ is functionalized. Both
    # ops run append_'s checks (naming lengths, refusing a lengths the copy
    # could not write), so both paths raise the same errors.
    if torch.compiler.is_compiling():
        lengths.copy_(_append_returning_op(keys, values, lengths, keys_new, values_new, k_scale=k_scale, v_scale=v_scale))
    else:
        _append_op(keys, values, lengths, keys_new, values_new, k_scale=k_scale, v_scale=v_scale)


def attend(
    q: torch.Tensor,
    cache: KVLayerCache,
    kv_start: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    sink_logits: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention of new queries over the filled part of ``cache``.

    (The options are not keyword-only so that TorchScript can compile it.)

    Query ``i`` of row ``b`` sits at slot ``cache.length[b] - seq + i`` (the
    queries are the last ``seq`` tokens written) and attends causally to the
    slots from ``kv_start[b]`` up to itself. Slots outside
    ``[kv_start[b], length[b])`` are never read: a decode step costs
    O(filled slots), not O(capacity). Prefill, chunked prefill and decode are
    the same call.

    Args:
        q: Queries ``(batch, num_heads, seq, head_dim)``, any strides, the
            cache's dtype (float32, bfloat16 or float16; any of the three
            for a quantized cache, which is dequantized in registers);
            ``num_heads`` a multiple of ``num_kv_heads`` (grouped-query
            attention).
        cache: The layer's cache, already updated with this step's keys and
            values; or a ring (:class:`kvcache.RingLayerCache`, or the
            :class:`kvcache.RingKV` of :func:`kvcache.write_ring_layer_cache`),
            read by position with the ring's window and sinks (see
            :func:`kvcache.ring.attend_ring`).
        kv_start: ``(batch,)`` int tensor: the first valid slot of each row
            (left padding); ``None`` means 0.
        scale: Score scale; ``None`` means ``head_dim ** -0.5``.
        window: Sliding window: a query at slot ``p`` sees only
            ``(p - window, p]``; ``None`` or 0 means no window.
        softcap: Scores become ``softcap * tanh(score / softcap)`` (Gemma 2);
            ``None`` or 0 means none.
        sink_logits: ``(num_heads,)`` float32 learned attention-sink logits
            (gpt-oss): each head's softmax also counts one virtual slot with
            that score (in the units of the scaled scores) and a zero value,
            so the real slots' weights sum to less than 1. ``None``: none.

    Returns:
        ``(batch, num_heads, seq, head_dim)`` tensor in ``q``'s dtype
        (float32 accumulation). Queries that see no slot (left-padding
        positions) get zeros. Its memory is ``(batch, seq, heads, head_dim)``,
        so ``out.transpose(1, 2).reshape(batch, seq, -1)`` is free.

    Raises:
        ValueError: Shapes, devices or options that do not fit; a ``scale``
            or ``softcap`` that is not finite and positive, or whose products
            with ``head_dim`` and ``log2(e)`` overflow float32 (e.g.
            ``scale=1e38``: the scores would be inf and the output NaN); on
            CPU, lengths outside ``[seq, max_len]`` or ``kv_start`` outside
            ``[0, length]``. On CUDA those rows get NaN output instead (no
            read out of bounds).
        TypeError: Unsupported or mismatched dtypes; a ``window`` that is
            not an int (ValueError: outside int64); a ``scale`` or ``softcap``
            that is not a number (a bool, a str, a tensor).
    """
    softcap_ = 0.0 if softcap is None else softcap
    if torch.jit.is_scripting():  # TorchScript's Optional[int] annotation already types window
        window_ = 0 if window is None else window
        return torch.ops.kvcache.attend(
            q,
            cache.keys,
            cache.values,
            cache.length,
            kv_start=kv_start,
            scale=scale,
            window=window_,
            softcap=softcap_,
            k_scale=cache.k_scale,
            v_scale=cache.v_scale,
            sink_logits=sink_logits,
        )
    check_tensor_args(q=q, kv_start=kv_start, sink_logits=sink_logits, optional=("kv_start", "sink_logits"))
    window_ = as_window(window)
    if not isinstance(cache, KVLayerCache):  # attend_ring checks scale and softcap itself
        return _attend_ring(q, cache, kv_start, scale, window, softcap, sink_logits)
    check_real(scale=scale, softcap=softcap)
    return _attend_op(
        q,
        cache.keys,
        cache.values,
        cache.length,
        kv_start=kv_start,
        scale=scale,
        window=window_,
        softcap=softcap_,
        k_scale=cache.k_scale,
        v_scale=cache.v_scale,
        sink_logits=sink_logits,
    )


@torch.jit.unused
def _attend_ring(q, cache, kv_start, scale, window, softcap, sink_logits) -> torch.Tensor:
    # Rings (kvcache.ring): Python only (TorchScript compiles attend for KVLayerCache).
    if not isinstance(cache, (RingLayerCache, RingKV)):
        raise TypeError(f"cache must be a KVLayerCache, got {type(cache).__name__}")
    if window is not None and window != cache.window:
        raise ValueError(f"window={window} differs from the ring's window={cache.window}")
    return attend_ring(q, cache, kv_start=kv_start, scale=scale, softcap=softcap, sink_logits=sink_logits)


# The row operations moved to kvcache.rows (one module for every layout); the old module paths
# keep resolving (lazily: kvcache.rows imports this module).
_MOVED_TO_ROWS = (
    "rollback_kv_layer_cache", "select_rows_kv_layer_cache", "reset_rows_kv_layer_cache",
    "select_kv_layer_cache_rows", "reset_kv_layer_cache_rows",
)


def __getattr__(name):
    if name in _MOVED_TO_ROWS:
        from . import rows

        return getattr(rows, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
