"""Key/value cache for autoregressive self-attention (inference).

A PyTorch port of the JAX ``KVLayerCache`` module. The one deliberate
difference: the JAX original returns new buffers from every update
(``.at[].set``), while here :func:`update_kv_layer_cache` writes into the
existing buffers in place, through one ``torch.ops.kvcache`` call, and the
returned cache shares them. A decode step therefore costs O(chunk) memory
traffic, never O(max_len).
"""


import operator
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch

from ._torchscript import make_scriptable
from .config import TransformerConfig

# The package's __init__ has loaded the operators (it runs before any submodule).
_init_op = torch.ops.kvcache.init_layer_cache.default
_update_op = torch.ops.kvcache.update_.default
_update_at_op = torch.ops.kvcache.update_at_.default


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
    """

    keys: torch.Tensor
    values: torch.Tensor
    length: torch.Tensor

    @property
    def max_len(self) -> int:
        """Maximum number of tokens the cache can hold."""
        return int(self.keys.shape[2])


make_scriptable(KVLayerCache)


def init_kv_layer_cache(
    batch_size: int,
    num_kv_heads: int,
    head_dim: int,
    max_len: int,
    dtype: torch.dtype,
    device: Optional[Union[torch.device, str]] = None,
) -> KVLayerCache:
    """Creates a zero-filled :class:`KVLayerCache`.

    Args:
        batch_size: Batch dimension.
        num_kv_heads: Number of KV heads.
        head_dim: Per-head feature dimensionality.
        max_len: Maximum sequence length.
        dtype: Buffer dtype (any: float32, bfloat16, float8, int8, bool, ...).
        device: Buffer device; ``None`` means CPU.

    Returns:
        :class:`KVLayerCache` with zero buffers (two separate allocations)
        and ``length = 0``.

    Raises:
        TypeError: If a size is not an int or ``dtype`` is not a
            ``torch.dtype``.
        ValueError: If a size is negative.
    """
    sizes = []
    for name, v in (
        ("batch_size", batch_size),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
        ("max_len", max_len),
    ):
        sizes.append(_as_int(name, v))
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
    dev = torch.device(device) if device is not None else None
    keys, values, length = _init_op(*sizes, dtype=dtype, device=dev)
    return KVLayerCache(keys=keys, values=values, length=length)


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
            transposed ``(batch, chunk, heads, head_dim)`` view).
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
            negative, or shapes or devices do not match. Nothing is written.
        TypeError: If ``cache`` is not a :class:`KVLayerCache`, dtypes
            differ, or ``start`` is neither an int nor an integer tensor.
    """
    if torch.jit.is_scripting():
        # TorchScript: the same calls, without the Python-only type checks.
        if isinstance(start, torch.Tensor):
            length = torch.ops.kvcache.update_at_(cache.keys, cache.values, keys_new, values_new, start)
        else:
            length = torch.ops.kvcache.update_(cache.keys, cache.values, keys_new, values_new, start)
        return KVLayerCache(cache.keys, cache.values, length)
    if not isinstance(cache, KVLayerCache):
        raise TypeError(f"cache must be a KVLayerCache, got {type(cache).__name__}")
    keys, values = cache.keys, cache.values
    # The op returns the new length too: one dispatch (one CUDA launch) per update.
    if isinstance(start, torch.Tensor):
        length = _update_at_op(keys, values, keys_new, values_new, start)
    else:
        if not isinstance(start, (int, torch.SymInt)) or isinstance(start, bool):
            start = _as_int("start", start)
        length = _update_op(keys, values, keys_new, values_new, start)
    return KVLayerCache(keys, values, length)


def init_decoder_kv_caches(
    *,
    num_layers: int,
    batch_size: int,
    num_kv_heads: int,
    head_dim: int,
    max_len: int,
    dtype: torch.dtype,
    device: Optional[Union[torch.device, str]] = None,
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

    Returns:
        Tuple of ``num_layers`` :class:`KVLayerCache` objects, each with its
        own buffers.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If a size is negative.
    """
    n = _as_int("num_layers", num_layers)
    if n < 0:
        raise ValueError(f"num_layers must be >= 0, got {n}")
    return tuple(
        init_kv_layer_cache(batch_size, num_kv_heads, head_dim, max_len, dtype, device)
        for _ in range(n)
    )


def init_decoder_kv_caches_from_config(
    config: TransformerConfig,
    *,
    batch_size: int,
    max_len: Optional[int] = None,
    dtype: torch.dtype = torch.float32,
    device: Optional[Union[torch.device, str]] = None,
) -> Tuple[KVLayerCache, ...]:
    """Builds per-layer KV caches from a :class:`TransformerConfig`.

    Args:
        config: Transformer hyperparameters.
        batch_size: Batch dimension.
        max_len: Maximum cached length. Defaults to
            ``config.kv_cache_max_len`` if set, otherwise ``config.max_len``.
        dtype: Buffer dtype.
        device: Buffer device; ``None`` means CPU.

    Returns:
        Tuple of ``config.num_layers`` :class:`KVLayerCache` objects with
        ``num_kv_heads = config.num_kv_heads or config.num_heads`` and
        ``head_dim = config.d_model // config.num_heads``.

    Raises:
        TypeError: If ``config`` is not a :class:`TransformerConfig`.
        ValueError: If a size is negative.
    """
    if not isinstance(config, TransformerConfig):
        raise TypeError(f"config must be a TransformerConfig, got {type(config).__name__}")
    cap = max_len if max_len is not None else config.cache_len
    return init_decoder_kv_caches(
        num_layers=config.num_layers,
        batch_size=batch_size,
        num_kv_heads=config.kv_heads,
        head_dim=config.head_dim,
        max_len=cap,
        dtype=dtype,
        device=device,
    )


def _as_int(name: str, value) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
