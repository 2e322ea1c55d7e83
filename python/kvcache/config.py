"""Transformer hyperparameters used to size the KV caches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class TransformerConfig:
    """Hyperparameters of a decoder-only transformer.

    Args:
        num_layers: Number of transformer blocks (one KV cache each).
        num_heads: Number of query heads.
        d_model: Model width; must be divisible by ``num_heads``
            (``head_dim = d_model // num_heads``).
        max_len: Maximum sequence length the model supports.
        num_kv_heads: Number of key/value heads for grouped-query attention;
            ``None`` means ``num_heads`` (multi-head attention), and the field
            then holds ``num_heads``. Must divide ``num_heads``.
        kv_cache_max_len: Capacity of the KV caches; ``None`` means
            ``max_len``, and the field then holds ``max_len``.
        vocab_size: Vocabulary size of the token embedding.
        d_ff: Hidden width of the MLP; ``None`` means ``4 * d_model``.
        rope_theta: Base of the rotary position embedding frequencies.
        norm_eps: Epsilon of RMSNorm.

    Raises:
        ValueError: If a size is not positive, ``d_model`` is not divisible
            by ``num_heads``, or ``num_heads`` by ``num_kv_heads``.
    """

    num_layers: int
    num_heads: int
    d_model: int
    max_len: int
    num_kv_heads: Optional[int] = None
    kv_cache_max_len: Optional[int] = None
    vocab_size: int = 256
    d_ff: Optional[int] = None
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_heads", "d_model", "max_len", "vocab_size"):
            _check_positive(name, getattr(self, name))
        for name in ("num_kv_heads", "kv_cache_max_len", "d_ff"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name))
        if self.d_model % self.num_heads != 0:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by num_heads "
                f"({self.num_heads})"
            )
        # One name per quantity: the optional fields hold their resolved
        # value (what the JAX original computes at each use with `or`).
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.kv_cache_max_len is None:
            object.__setattr__(self, "kv_cache_max_len", self.max_len)
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be divisible by "
                f"num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def head_dim(self) -> int:
        """Per-head feature size, ``d_model // num_heads``."""
        return self.d_model // self.num_heads


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
