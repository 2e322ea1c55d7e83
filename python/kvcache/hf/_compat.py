"""The transformers names kvcache.hf uses, and the differences between the versions it supports
(5.18 to 5.25). Importing this module imports transformers; nothing else in kvcache does."""

from __future__ import annotations

import inspect

try:
    import transformers  # noqa: F401
    from transformers import cache_utils as _cache_utils
    from transformers import masking_utils
    from transformers.cache_utils import (  # noqa: F401
        Cache,
        CacheLayerMixin,
        LinearAttentionAndStaticFullAttentionLayer,
        LinearAttentionAndStaticSlidingWindowAttentionLayer,
        LinearAttentionLayer,
        StaticSlidingWindowLayer,
    )
    from transformers.masking_utils import AttentionMaskInterface  # noqa: F401
    from transformers.modeling_utils import AttentionInterface  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "kvcache.hf needs Hugging Face transformers (5.18 or newer): pip install 'transformers>=5.18' "
        "(kvcache is not on the package index; in a source checkout, scripts/setup.sh installs it) "
        f"(import failed: {e})"
    ) from e

# Attention-free layers: DummyLayer in transformers 5.24; 5.18 used LinearAttentionLayer for them.
NoKVLayer = getattr(_cache_utils, "DummyLayer", None) or LinearAttentionLayer


def _cache_arg_name() -> str:
    # transformers renamed generate's/forward's `past_key_values` to `cache` after
    # 5.18 (5.24 and 5.25 still take the old name, with a FutureWarning).
    from transformers.generation.utils import GenerationMixin

    params = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    return "cache" if "cache" in params else "past_key_values"


CACHE_ARG = _cache_arg_name()
"""The keyword ``generate`` and the models take the cache by in the installed
transformers: ``"cache"`` (5.24 and later) or ``"past_key_values"`` (5.18); for code
that runs on both: ``model.generate(**inputs, **{kvcache.hf.CACHE_ARG: cache})``."""


def head_shapes(config, n: int) -> "tuple[list[int], list[int]]":
    """KV heads and head dims of the n layers of a (text) config."""
    try:
        from transformers.configuration_utils import get_head_shapes

        heads, dims = get_head_shapes(config)
    except (ImportError, AttributeError):  # before get_head_shapes existed
        dims = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    heads = list(heads) if isinstance(heads, (list, tuple)) else [heads] * n
    dims = list(dims) if isinstance(dims, (list, tuple)) else [dims] * n
    return heads, dims


def split_head_sizes(config) -> "tuple[int, int] | None":
    """``(qk_head_dim, v_head_dim)`` when a (text) config's keys and values have different head sizes.

    MLA-style attention (DeepSeek-V2/V3 and models built like them) projects keys and values from
    cached latents to ``qk_head_dim`` and ``v_head_dim``; kvcache's caches and attention take keys
    and values of one shape. ``None`` for every other config.
    """
    qk = getattr(config, "qk_head_dim", None)
    vd = getattr(config, "v_head_dim", None)
    if (qk is not None or vd is not None) and qk != vd:
        return qk, vd
    return None


def mla_message(config, what: str) -> str:
    """The refusal of an MLA-style config by ``what`` (see :func:`split_head_sizes`)."""
    qk, vd = split_head_sizes(config)
    return (f"{type(config).__name__} has keys and values of different head sizes (qk_head_dim={qk}, "
            f"v_head_dim={vd}: MLA-style attention); {what} takes keys and values of one shape")


def tp_size(*configs) -> int:
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
