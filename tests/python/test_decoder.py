"""The small decoder: cached generation equals recomputing without a cache."""

from __future__ import annotations

import pytest
import torch

import kvcache
from kvcache.models import Decoder, greedy_generate

CFG = kvcache.TransformerConfig(num_layers=2, num_heads=8, d_model=64, max_len=48, num_kv_heads=2)


@pytest.fixture(scope="module")
def model():
    return Decoder(CFG, seed=1).eval()


def fresh_caches(batch, dtype=torch.float32):
    return list(kvcache.init_decoder_kv_caches_from_config(CFG, batch_size=batch, dtype=dtype))


@torch.no_grad()
def test_prefill_and_decode_match_uncached(model):
    prompt = torch.randint(0, CFG.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    tokens, step_logits = greedy_generate(model, prompt, 10, fresh_caches(2))
    full = model.forward_no_cache(torch.cat([prompt, tokens], dim=1))
    for i, logits in enumerate(step_logits):
        torch.testing.assert_close(logits, full[:, 11 + i], rtol=1e-4, atol=1e-4)
    # greedy: every generated token is the argmax of the uncached logits before it
    assert torch.equal(tokens, full[:, 11:21].argmax(-1))


@torch.no_grad()
def test_ragged_batch_matches_each_row_alone(model):
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, CFG.vocab_size, (3, 10), generator=g)
    lengths = torch.tensor([10, 4, 7])
    tokens, _ = greedy_generate(model, prompt, 6, fresh_caches(3), prompt_lengths=lengths)
    for r in range(3):
        row = prompt[r : r + 1, : int(lengths[r])]
        alone, _ = greedy_generate(model, row, 6, fresh_caches(1))
        assert torch.equal(tokens[r], alone[0]), r


@torch.no_grad()
def test_kvcache_attention_equals_masked_sdpa_over_whole_buffer():
    """attend (filled slots only) and masked SDPA over the whole buffer agree, ragged rows included."""
    fast = Decoder(CFG, seed=1, attention="kvcache").eval()
    slow = Decoder(CFG, seed=1, attention="sdpa").eval()
    prompt = torch.randint(0, CFG.vocab_size, (3, 9), generator=torch.Generator().manual_seed(5))
    lengths = torch.tensor([9, 4, 6])
    t1, l1 = greedy_generate(fast, prompt, 8, fresh_caches(3), prompt_lengths=lengths)
    t2, l2 = greedy_generate(slow, prompt, 8, fresh_caches(3), prompt_lengths=lengths)
    assert torch.equal(t1, t2)
    for a, b in zip(l1, l2):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_unknown_attention_impl_rejected():
    with pytest.raises(ValueError, match="attention must be one of"):
        Decoder(CFG, attention="flash")


@torch.no_grad()
def test_caches_updated_in_place_with_lengths(model):
    caches = fresh_caches(2)
    before = [c.keys for c in caches]
    prompt = torch.randint(0, CFG.vocab_size, (2, 5))
    _, new = model(prompt, torch.tensor(0), caches)
    for c, b in zip(new, before):
        assert c.keys is b  # same buffer: written in place
        assert int(c.length) == 5
        assert torch.count_nonzero(c.keys[:, :, :5]) > 0
        assert torch.count_nonzero(c.keys[:, :, 5:]) == 0


def test_demo_runs_and_passes(capsys):
    from kvcache import demo

    rc = demo.main(["--layers", "1", "--d-model", "32", "--heads", "4", "--kv-heads", "2",
                    "--prompt-len", "6", "--new-tokens", "5", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "PASS" in out and "speed-up" in out and "tok/s" in out
