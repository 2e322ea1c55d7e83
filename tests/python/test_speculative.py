"""Batched greedy speculative decoding equals plain greedy decoding with the target."""

from __future__ import annotations

import pytest
import torch

import kvcache
from kvcache.models import Decoder, greedy_generate
from kvcache.models.speculative import EarlyExitDraft, speculative_generate, speculative_round

CFG = kvcache.TransformerConfig(num_layers=3, num_heads=4, d_model=64, max_len=256, num_kv_heads=2)
NEW = 20


@pytest.fixture(scope="module")
def target():
    return Decoder(CFG, seed=7).eval()


def plain_greedy(model, prompt, n):
    caches = list(kvcache.init_decoder_kv_caches_from_config(CFG, batch_size=prompt.shape[0]))
    with torch.no_grad():
        tokens, _ = greedy_generate(model, prompt, n, caches)
    return tokens


class Oracle(torch.nn.Module):
    """A draft that IS the target (same modules): every proposal is accepted."""

    def __init__(self, target):
        super().__init__()
        self.target = target
        self.config = target.config
        self.embed = target.embed
        self.blocks = target.blocks

    def forward(self, tokens, start, caches):
        return self.target(tokens, start, caches)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_speculative_equals_greedy(target, batch, k):
    prompt = torch.randint(0, CFG.vocab_size, (batch, 6), generator=torch.Generator().manual_seed(batch * 10 + k))
    draft = EarlyExitDraft(target, 1)
    tokens, stats = speculative_generate(target, draft, prompt, NEW, k=k)
    assert torch.equal(tokens, plain_greedy(target, prompt, NEW))
    assert stats["proposed"] == stats["rounds"] * batch * k
    assert 0 <= stats["accepted"] <= stats["proposed"]


def test_rows_accept_different_counts_and_roll_back_independently(target):
    """With a perfect draft every proposal is accepted; with the early exit, rows disagree at different places."""
    prompt = torch.randint(0, CFG.vocab_size, (4, 6), generator=torch.Generator().manual_seed(3))
    tokens, stats = speculative_generate(target, Oracle(target), prompt, NEW, k=4)
    assert torch.equal(tokens, plain_greedy(target, prompt, NEW))
    assert stats["acceptance_rate"] == 1.0
    # one round by hand: per-row acceptance, per-row rollback of both caches
    from kvcache.models.speculative import init_caches

    draft = EarlyExitDraft(target, 2)
    t_caches, d_caches = init_caches(target, 4, 64), init_caches(draft, 4, 64)
    with torch.no_grad():
        logits, _ = target(prompt, None, t_caches)
        draft(prompt, None, d_caches)
        pending = logits[:, -1].argmax(-1)
        props, accepted, greedy = speculative_round(target, draft, pending, t_caches, d_caches, 4)
    expected = 6 + 1 + accepted  # prompt + pending + accepted proposals
    for c in t_caches + d_caches:
        assert torch.equal(c.length, expected.to(torch.int32))
    # the accepted count is the leading run of agreements
    agree = (props == greedy[:, :4]).tolist()
    for row, n in zip(agree, accepted.tolist()):
        assert all(row[:n]) and (n == 4 or not row[n])


@torch.no_grad()
def test_compiled_rounds_no_recompiles(target):
    torch._dynamo.reset()
    compiled = torch.compile(speculative_round, fullgraph=True)
    calls = {"n": 0}

    def round_fn(*args):
        calls["n"] += 1
        if calls["n"] == 2:  # the first call compiles; none after it may
            torch.compiler.set_stance("fail_on_recompile")
        return compiled(*args)

    prompt = torch.randint(0, CFG.vocab_size, (4, 6), generator=torch.Generator().manual_seed(5))
    try:
        tokens, stats = speculative_generate(target, EarlyExitDraft(target, 2), prompt, NEW, k=3, round_fn=round_fn)
    finally:
        torch.compiler.set_stance("default")
    assert calls["n"] == stats["rounds"] and stats["rounds"] >= 2
    assert torch.equal(tokens, plain_greedy(target, prompt, NEW))


def test_arguments_checked(target):
    prompt = torch.zeros(1, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="k must be >= 1"):
        speculative_generate(target, EarlyExitDraft(target, 1), prompt, 4, k=0)
    with pytest.raises(ValueError, match=r"num_layers must be in \[1, 3\]"):
        EarlyExitDraft(target, 4)
