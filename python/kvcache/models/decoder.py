"""A small decoder-only transformer on the kvcache operators.

Token embedding, rotary position embedding (RoPE), grouped-query attention
(``num_kv_heads < num_heads``), RMSNorm and a SiLU-gated MLP; weights come
from a seeded generator. Each layer writes its keys and values with one
kvcache call (:func:`kvcache.update_kv_layer_cache`, or
:func:`kvcache.append_kv_layer_cache` for the stateful model) and reads them
back with :func:`kvcache.attend`, which touches only the filled slots. The
``attention="sdpa"`` flag switches to masked scaled-dot-product attention over
the whole buffer, the usual static-cache way, for comparison.

:class:`Decoder` keeps no Python-side state: positions and caches come in as
arguments and the updated caches go out, so the same code runs eagerly,
under ``torch.compile``, ``torch.export`` and TorchScript.
"""

import math
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import (
    KVLayerCache,
    append_kv_layer_cache,
    attend,
    init_kv_layer_cache,
    update_kv_layer_cache,
)
from ..config import TransformerConfig

ATTENTION_IMPLS = ("kvcache", "sdpa")


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in float32 so bfloat16 models stay accurate.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotates ``x`` (batch, heads, seq, head_dim) by its absolute positions (batch, seq)."""
    angles = positions.to(torch.float32)[:, None, :, None] * inv_freq  # (B, 1, S, D/2)
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


def grouped_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    q_positions: torch.Tensor,
) -> torch.Tensor:
    """Causal grouped-query attention over a KV buffer, without copying it.

    Args:
        q: Queries ``(batch, num_heads, seq, head_dim)``.
        keys: Keys ``(batch, num_kv_heads, kv_len, head_dim)``; slot ``j``
            holds position ``j``.
        values: Values of the same shape as ``keys``.
        q_positions: Absolute position of every query ``(batch, seq)``;
            a query attends to slots ``j <= its position``.

    Returns:
        Attention output ``(batch, num_heads, seq, head_dim)``.
    """
    b, h, s, d = q.shape
    kv_heads, kv_len = keys.shape[1], keys.shape[2]
    group = h // kv_heads
    # Fold the query heads that share a KV head into the sequence axis, so
    # the cache is read as is (no repeat_interleave copy of it).
    qg = q.reshape(b, kv_heads, group * s, d)
    slots = torch.arange(kv_len, device=q.device)
    mask = slots[None, None, :] <= q_positions[:, :, None]  # (B, S, kv_len)
    mask = mask[:, None, None, :, :].expand(b, 1, group, s, kv_len).reshape(b, 1, group * s, kv_len)
    out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask)
    return out.reshape(b, h, s, d)


class Attention(nn.Module):
    """Grouped-query self-attention that writes its keys/values to a KV cache."""

    def __init__(self, config: TransformerConfig, attention: str = "kvcache"):
        super().__init__()
        self.attention = attention
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        d = config.d_model
        self.wq = nn.Linear(d, self.num_heads * self.head_dim, bias=False)
        self.wkv = nn.Linear(d, 2 * self.num_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.num_heads * self.head_dim, d, bias=False)
        inv_freq = 1.0 / (
            config.rope_theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim)
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def project(self, x: torch.Tensor, positions: torch.Tensor):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        kv = self.wkv(x).view(b, s, 2, self.num_kv_heads, self.head_dim)
        k = kv[:, :, 0].transpose(1, 2)
        v = kv[:, :, 1].transpose(1, 2)  # a strided view; the cache op takes it as is
        return rope(q, positions, self.inv_freq), rope(k, positions, self.inv_freq), v

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        start: Optional[torch.Tensor],
        cache: KVLayerCache,
    ) -> Tuple[torch.Tensor, KVLayerCache]:
        q, k, v = self.project(x, positions)
        if start is None:  # stateful: write at cache.length and advance it
            cache = append_kv_layer_cache(cache, k, v)
        else:
            cache = update_kv_layer_cache(cache, k, v, start)
        if self.attention == "kvcache":
            out = attend(q, cache)  # reads only the filled slots
        else:
            out = grouped_attention(q, cache.keys, cache.values, positions)
        b, _, s, _ = out.shape
        return self.wo(out.transpose(1, 2).reshape(b, s, -1)), cache

    def forward_no_cache(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q, k, v = self.project(x, positions)
        out = grouped_attention(q, k, v, positions)
        b, _, s, _ = out.shape
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """SiLU-gated feed-forward block."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        hidden = config.d_ff or 4 * config.d_model
        self.w_in = nn.Linear(config.d_model, 2 * hidden, bias=False)
        self.w_out = nn.Linear(hidden, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_in(x).chunk(2, dim=-1)
        return self.w_out(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, config: TransformerConfig, attention: str = "kvcache"):
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = Attention(config, attention)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        start: Optional[torch.Tensor],
        cache: KVLayerCache,
    ) -> Tuple[torch.Tensor, KVLayerCache]:
        a, cache = self.attn(self.attn_norm(x), positions, start, cache)
        x = x + a
        return x + self.mlp(self.mlp_norm(x)), cache

    def forward_no_cache(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = x + self.attn.forward_no_cache(self.attn_norm(x), positions)
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    """Decoder-only transformer with KV caching through ``kvcache``.

    Args:
        config: Model hyperparameters (``num_kv_heads < num_heads`` gives
            grouped-query attention).
        seed: Seed of the generator the weights are drawn from.
        dtype: Parameter dtype.
        attention: ``"kvcache"`` (:func:`kvcache.attend`: reads only the
            filled slots) or ``"sdpa"`` (masked scaled-dot-product attention
            over the whole cache buffer, O(capacity): for comparison).

    Raises:
        ValueError: If ``attention`` is not one of those two.
    """

    def __init__(
        self,
        config: TransformerConfig,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        attention: str = "kvcache",
    ):
        super().__init__()
        if attention not in ATTENTION_IMPLS:
            raise ValueError(f"attention must be one of {ATTENTION_IMPLS}, got {attention!r}")
        self.config = config
        self.attention = attention
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList([Block(config, attention) for _ in range(config.num_layers)])
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    continue
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(fan_in))
        self.to(dtype)

    def forward(
        self,
        tokens: torch.Tensor,
        start: Optional[torch.Tensor],
        caches: List[KVLayerCache],
    ) -> Tuple[torch.Tensor, List[KVLayerCache]]:
        """Runs ``tokens`` at positions ``start + [0, seq)``, caching their keys/values.

        Args:
            tokens: Token ids ``(batch, seq)``: a prompt (prefill), a chunk
                (chunked prefill, speculative verification) or one token per
                row (decode).
            start: int tensor: the position of ``tokens[:, 0]``, 0-D (all rows)
                or ``(batch,)`` (ragged rows). ``None``: each layer writes at
                its cache's ``length`` and advances it in place
                (:func:`kvcache.append_kv_layer_cache`).
            caches: One :class:`KVLayerCache` per layer.

        Returns:
            ``(logits, caches)``: logits ``(batch, seq, vocab)`` in float32,
            and the updated caches (the same buffers; new lengths).
        """
        b, s = tokens.shape
        first = caches[0].length if start is None else start
        positions = first.reshape(-1, 1).expand(b, 1) + torch.arange(s, device=tokens.device)[None, :]
        x = self.embed(tokens)
        new_caches: List[KVLayerCache] = []
        for i, block in enumerate(self.blocks):
            x, cache = block(x, positions, start, caches[i])
            new_caches.append(cache)
        return self.head(self.norm(x)).float(), new_caches

    def forward_no_cache(self, tokens: torch.Tensor) -> torch.Tensor:
        """Full causal forward over ``tokens`` (batch, seq) with no cache.

        Returns:
            Logits ``(batch, seq, vocab)`` in float32.
        """
        b, s = tokens.shape
        positions = torch.arange(s, device=tokens.device)[None, :].expand(b, s)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block.forward_no_cache(x, positions)
        return self.head(self.norm(x)).float()


class CacheBuffers(nn.Module):
    """One layer's cache as module buffers: keys, values and a per-row length
    (not saved in the state_dict)."""

    def __init__(self, batch_size: int, num_kv_heads: int, head_dim: int, max_len: int, dtype: torch.dtype):
        super().__init__()
        cache = init_kv_layer_cache(batch_size, num_kv_heads, head_dim, max_len, dtype)
        self.register_buffer("keys", cache.keys, persistent=False)
        self.register_buffer("values", cache.values, persistent=False)
        self.register_buffer("lengths", torch.zeros(batch_size, dtype=torch.int32), persistent=False)


class StatefulDecoder(nn.Module):
    """A :class:`Decoder` that owns its KV caches as module buffers.

    ``forward(tokens)`` runs one prefill or decode step: every layer writes
    its new keys/values at its buffers' current length and advances the
    length in place (:func:`kvcache.append_kv_layer_cache`, one operator per
    layer), then attends over the filled slots. Only tensors cross the call,
    and the buffers keep their addresses, which is what ``torch.export``,
    AOTInductor, CUDA graphs and a C++ TorchScript runner need. Each layer
    has its own buffers, passed whole to the operators (a view would make
    Inductor clone them).

    Args:
        model: The decoder (its weights are shared, not copied).
        batch_size: Batch size of the caches.
        max_len: Cache capacity; defaults to ``model.config.kv_cache_max_len``.
        dtype: Cache dtype; defaults to the model's parameter dtype.
    """

    def __init__(self, model: Decoder, batch_size: int, max_len: Optional[int] = None,
                 dtype: Optional[torch.dtype] = None):
        super().__init__()
        cfg = model.config
        dtype = dtype if dtype is not None else model.embed.weight.dtype
        cap = max_len if max_len is not None else cfg.kv_cache_max_len
        self.model = model
        self.caches = nn.ModuleList(
            [CacheBuffers(batch_size, cfg.num_kv_heads, cfg.head_dim, cap, dtype) for _ in range(cfg.num_layers)]
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """One step: logits ``(batch, seq, vocab)`` for ``tokens`` (batch, seq) at the current lengths."""
        caches: List[KVLayerCache] = []
        for buffers in self.caches:
            caches.append(KVLayerCache(buffers.keys, buffers.values, buffers.lengths))
        logits, _ = self.model(tokens, None, caches)
        return logits

    @torch.jit.export
    def reset(self) -> None:
        """Empties every cache (lengths to 0; nothing is zeroed)."""
        for buffers in self.caches:
            buffers.lengths.zero_()


def greedy_generate(
    model: Decoder,
    prompt: torch.Tensor,
    new_tokens: int,
    caches: List[KVLayerCache],
    prompt_lengths: Optional[torch.Tensor] = None,
    step_callback=None,
) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """Greedy decoding with the KV cache: one prefill, then one token per step.

    Args:
        model: The decoder.
        prompt: Token ids ``(batch, prompt_len)``; rows shorter than
            ``prompt_len`` are right-padded.
        new_tokens: Number of tokens to generate per row.
        caches: Empty caches, one per layer, with room for
            ``prompt_len + new_tokens`` positions.
        prompt_lengths: ``(batch,)`` true prompt length of each row (ragged
            batch); ``None`` means every row uses the whole prompt.
        step_callback: Called after every step (for a progress bar).

    Returns:
        ``(tokens, step_logits)``: generated ids ``(batch, new_tokens)`` and
        the logits that chose each token, one ``(batch, vocab)`` per step.
    """
    b, s = prompt.shape
    device = prompt.device
    logits, caches = model(prompt, torch.zeros((), dtype=torch.int32, device=device), caches)
    if prompt_lengths is None:
        pos = torch.tensor(s, dtype=torch.int32, device=device)  # one position for all rows
        last = logits[:, -1]
    else:
        # Padded slots of short rows are written by the prefill but never
        # attended: each row's decode overwrites slot `length` before reading it.
        pos = prompt_lengths.to(device=device, dtype=torch.int32)
        last = logits[torch.arange(b, device=device), pos - 1]
    out, step_logits = [], []
    for _ in range(new_tokens):
        token = last.argmax(-1)
        out.append(token)
        step_logits.append(last)
        if step_callback is not None:
            step_callback()
        if len(out) == new_tokens:
            break
        logits, caches = model(token[:, None], pos, caches)
        last = logits[:, 0]
        pos = pos + 1
    return torch.stack(out, dim=1), step_logits
