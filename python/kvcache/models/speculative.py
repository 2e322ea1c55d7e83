"""Batched greedy speculative decoding on fixed-address kvcache caches.

A small draft model proposes ``k`` tokens per row; the target model checks
all of them in one forward pass (a chunk of ``k + 1`` tokens through
:func:`kvcache.attend`, causal inside the chunk); each row accepts its own
number of tokens, and both models' caches roll back per row with
:func:`kvcache.rollback_kv_layer_cache` (lengths move back, nothing is
copied). The output equals plain greedy decoding with the target model.

One round, per row, with ``t`` the pending token (emitted, not yet cached):

1. the draft runs ``k + 1`` one-token steps on ``t, d1, ..., dk`` and
   proposes ``d1..dk`` (the last step only caches ``dk``, so that both caches
   hold the same ``k + 1`` new tokens);
2. the target runs once on ``[t, d1, ..., dk]``; its greedy choices
   ``g0..gk`` accept the longest prefix ``d1..dn`` with ``d(i+1) == g(i)``;
3. the row emits ``d1..dn, g(n)`` (``n + 1`` tokens, at least one), both
   caches roll back by ``k - n``, and ``g(n)`` becomes the pending token.

Every shape is static and every position lives in a device length tensor,
so a round compiles to the same graphs each time (``torch.compile`` with no
recompiles) and needs no host sync until the caller reads the tokens.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import nn

from ..cache import KVLayerCache, init_kv_layer_cache
from ..rows import rollback_kv_layer_cache
from .decoder import Decoder


class EarlyExitDraft(nn.Module):
    """A draft model made of the target's first layers and its output head.

    It shares the target's modules (no copy of any weight), like
    self-speculative "early exit" decoding: a cheap guess that agrees with
    the target where the last layers change little.

    Args:
        target: The target :class:`Decoder`.
        num_layers: How many of the target's blocks the draft runs.

    Raises:
        ValueError: If ``num_layers`` is not in ``[1, target.config.num_layers]``.
    """

    def __init__(self, target: Decoder, num_layers: int):
        super().__init__()
        if not 1 <= num_layers <= target.config.num_layers:
            raise ValueError(
                f"num_layers must be in [1, {target.config.num_layers}], got {num_layers}"
            )
        self.config = target.config
        self.embed = target.embed
        self.blocks = nn.ModuleList(list(target.blocks[:num_layers]))
        self.norm = target.norm
        self.head = target.head

    def forward(self, tokens: torch.Tensor, start: Optional[torch.Tensor], caches: List[KVLayerCache]):
        """As :meth:`Decoder.forward` (one cache per draft layer)."""
        return Decoder.forward(self, tokens, start, caches)  # the same body, fewer blocks


def init_caches(model: nn.Module, batch_size: int, max_len: int, device=None, dtype=None) -> List[KVLayerCache]:
    """Empty per-layer caches for ``model`` with a per-row length (batch,) each."""
    cfg = model.config
    dtype = dtype if dtype is not None else model.embed.weight.dtype
    device = device if device is not None else model.embed.weight.device
    caches = []
    for _ in model.blocks:
        c = init_kv_layer_cache(batch_size, cfg.num_kv_heads, cfg.head_dim, max_len, dtype, device)
        caches.append(KVLayerCache(c.keys, c.values, torch.zeros(batch_size, dtype=torch.int32, device=device)))
    return caches


def draft_step(draft: nn.Module, tokens: torch.Tensor, caches: List[KVLayerCache]) -> torch.Tensor:
    """One draft step on ``tokens`` (batch, 1): appends to the caches, returns greedy next tokens (batch,)."""
    logits, _ = draft(tokens, None, caches)
    return logits[:, -1].argmax(-1)


def verify_step(
    target: nn.Module,
    pending: torch.Tensor,
    proposals: torch.Tensor,
    target_caches: List[KVLayerCache],
    draft_caches: List[KVLayerCache],
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The target checks ``[pending, proposals]`` in one pass; both caches roll back per row.

    Args:
        target: The target model.
        pending: (batch,) the token every row emitted last, not yet cached.
        proposals: (batch, k) the draft's tokens.
        target_caches, draft_caches: Each holds the rows' history; the draft's
            already includes ``pending`` and ``proposals`` (k + 1 entries).

    Returns:
        ``(accepted, greedy)``: (batch,) number of proposals each row accepts
        (0..k) and (batch, k + 1) the target's greedy choice after each token
        of the chunk; row b emits ``proposals[b, :n] + [greedy[b, n]]``.
    """
    k = proposals.shape[1]
    chunk = torch.cat([pending[:, None], proposals], dim=1)
    logits, _ = target(chunk, None, target_caches)
    greedy = logits.argmax(-1)  # (batch, k + 1)
    agree = (proposals == greedy[:, :k]).to(torch.int32)
    accepted = agree.cumprod(dim=1).sum(dim=1, dtype=torch.int32)  # leading run of matches
    drop = k - accepted  # both caches hold k + 1 new tokens; keep pending + accepted
    for cache in target_caches:
        rollback_kv_layer_cache(cache, drop)
    for cache in draft_caches:
        rollback_kv_layer_cache(cache, drop)
    return accepted, greedy


def speculative_round(
    target: nn.Module,
    draft: nn.Module,
    pending: torch.Tensor,
    target_caches: List[KVLayerCache],
    draft_caches: List[KVLayerCache],
    k: int,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One round: k + 1 draft steps, one target pass, per-row acceptance and rollback.

    Returns:
        ``(proposals, accepted, greedy)``: (batch, k), (batch,), (batch, k + 1);
        the next pending token of row b is ``greedy[b, accepted[b]]``.
    """
    proposals = []
    token = pending
    for i in range(k + 1):
        nxt = draft_step(draft, token[:, None], draft_caches)
        if i < k:
            proposals.append(nxt)
            token = nxt
    props = torch.stack(proposals, dim=1)
    accepted, greedy = verify_step(target, pending, props, target_caches, draft_caches)
    return props, accepted, greedy


@torch.no_grad()
def speculative_generate(
    target: Decoder,
    draft: nn.Module,
    prompt: torch.Tensor,
    new_tokens: int,
    k: int = 4,
    round_fn=None,
) -> Tuple[torch.Tensor, dict]:
    """Greedy speculative decoding: the target's greedy tokens, fewer target passes.

    Args:
        target: The target :class:`Decoder`.
        draft: A cheaper model with the same vocabulary and ``forward(tokens,
            start, caches)`` (e.g. :class:`EarlyExitDraft`).
        prompt: (batch, prompt_len) token ids (every row the same length).
        new_tokens: Tokens to produce per row.
        k: Draft tokens proposed per round.
        round_fn: Replaces :func:`speculative_round` (e.g. a
            ``torch.compile``-d version of it); same signature.

    Returns:
        ``(tokens, stats)``: (batch, new_tokens) ids, and a dict with
        ``rounds``, ``proposed``, ``accepted`` (over all rows) and
        ``acceptance_rate`` (accepted / proposed).

    Raises:
        ValueError: If ``k < 1`` or ``new_tokens < 1``.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if new_tokens < 1:
        raise ValueError(f"new_tokens must be >= 1, got {new_tokens}")
    round_fn = round_fn if round_fn is not None else speculative_round
    b, s = prompt.shape
    # Rows run until the slowest has new_tokens; a row gains at most k + 1
    # tokens a round (and holds k + 1 unverified ones before its rollback).
    max_len = s + (new_tokens + 1) * (k + 1)
    t_caches = init_caches(target, b, max_len)
    d_caches = init_caches(draft, b, max_len)
    logits, _ = target(prompt, None, t_caches)
    draft(prompt, None, d_caches)
    pending = logits[:, -1].argmax(-1)
    out: List[List[int]] = [[int(t)] for t in pending.tolist()]
    rounds = proposed = accepted_total = 0
    while min(len(row) for row in out) < new_tokens:
        props, accepted, greedy = round_fn(target, draft, pending, t_caches, d_caches, k)
        pending = greedy.gather(1, accepted.long()[:, None])[:, 0]
        rounds += 1
        proposed += b * k
        acc = accepted.tolist()
        accepted_total += sum(acc)
        for row, n, p, nxt in zip(out, acc, props.tolist(), pending.tolist()):
            row.extend(p[:n])
            row.append(nxt)
    tokens = torch.tensor([row[:new_tokens] for row in out], device=prompt.device)
    stats = dict(rounds=rounds, proposed=proposed, accepted=accepted_total,
                 acceptance_rate=accepted_total / max(proposed, 1))
    return tokens, stats
