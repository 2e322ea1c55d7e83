"""kvcache.hf on rings: sliding-window layers of tiny random Gemma 3 and Mistral models.

Every reference is transformers' own: DynamicCache (whose sliding layers keep the last
``window - 1`` tokens) with sdpa/eager attention, or, for attention sinks, transformers'
eager-style attention written out in plain PyTorch over a full DynamicCache. Prompts and
generations run past the window and past the ring (several wraps); nothing is downloaded.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import kvcache.hf as kh  # noqa: E402
from kv_testing import record_crops  # noqa: E402
from transformers import (  # noqa: E402
    AttentionInterface,
    DynamicCache,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    MistralConfig,
    MistralForCausalLM,
)
from transformers.masking_utils import AttentionMaskInterface  # noqa: E402

VOCAB = 96
WINDOW = 6
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, initializer_range=0.2, pad_token_id=0)
ARCHS = {
    # layers 0 and 2 sliding, layer 1 full: a hybrid like Gemma-3-270M
    "gemma3": (Gemma3ForCausalLM, lambda **kw: Gemma3TextConfig(
        **{**COMMON, "initializer_range": 0.02, "num_hidden_layers": 3, "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": WINDOW,
           "layer_types": ["sliding_attention", "full_attention", "sliding_attention"], **kw})),
    # every layer sliding (Gemma 3 at 0.02: at 0.2 its greedy tokens collapse to one repeated token)
    "mistral": (MistralForCausalLM, lambda **kw: MistralConfig(
        **{**COMMON, "num_hidden_layers": 2, "sliding_window": WINDOW, **kw})),
}
MAX_LEN = 128
PROMPT = 20  # > window and > a max_step=4 ring (9 slots)
NEW = 24  # several wraps of a max_step=4 ring


@functools.lru_cache(maxsize=None)
def _model(arch: str, seed: int = 0, **overrides):
    cls, make_cfg = ARCHS[arch]
    torch.manual_seed(seed)
    overrides = {k: list(v) if isinstance(v, tuple) else v for k, v in overrides.items()}  # hashable in the cache
    return cls(make_cfg(**overrides)).eval()


def inputs(batch: int, prompt: int = PROMPT, pad: int = 5, seed: int = 1, repeat: bool = False):
    """Random prompts; with batch 2, row 1 is left-padded by ``pad`` tokens; ``repeat``: a repeated phrase."""
    g = torch.Generator().manual_seed(seed)
    if repeat:
        ids = torch.randint(3, VOCAB, (batch, 7), generator=g).repeat(1, prompt // 7 + 1)[:, :prompt]
    else:
        ids = torch.randint(3, VOCAB, (batch, prompt), generator=g)
    mask = torch.ones_like(ids)
    if batch > 1:
        ids[1, :pad] = 0
        mask[1, :pad] = 0
    return ids, mask


def generate(model, ids, mask, cache=None, impl="sdpa", new=NEW, **kw):
    model.set_attn_implementation(impl)
    extra = {kh.CACHE_ARG: cache} if cache is not None else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              **extra, **kw)


def dynamic(model, ids, mask, **kw):
    return generate(model, ids, mask, DynamicCache(config=model.config), **kw)


@functools.lru_cache(maxsize=None)
def reference(arch, batch, **kw):
    """DynamicCache's greedy tokens for ``inputs(batch)`` (shared by the tests that compare to them)."""
    ids, mask = inputs(batch)
    return dynamic(_model(arch), ids, mask, **kw)


def assert_tokens(a, b):
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.equal(a, b), f"\n{a}\n!=\n{b}"


def rings(cache):
    return [la for la in cache.layers if isinstance(la, kh.KVRingLayer)]


# ------------------------------------------------------------------ generate


@pytest.mark.parametrize("batch, max_step", [(1, 4), (2, 4), (2, 64)])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_generate_past_the_window_matches_dynamic_cache(arch, batch, max_step):
    model = _model(arch)
    ids, mask = inputs(batch)
    ref = reference(arch, batch)
    assert all(len(set(r[PROMPT:].tolist())) > 5 for r in ref)  # not a degenerate repetition
    cache = kh.KVCache(model.config, MAX_LEN, max_step=max_step)
    assert rings(cache) and all(la.capacity == WINDOW + max_step - 1 for la in rings(cache))
    assert_tokens(generate(model, ids, mask, cache, impl="kvcache"), ref)
    for la in rings(cache):
        assert la.keys.shape[2] == WINDOW + max_step - 1  # the ring, not max_cache_len
        assert la.lengths.tolist() == [PROMPT + NEW - 1] * batch  # logical lengths
        assert int(la.positions.max()) == PROMPT + NEW - 2


def test_the_reference_depends_on_the_window():
    # The comparisons above catch a wrong window only if the window changes the tokens.
    windowed = _model("mistral")
    full = MistralForCausalLM(ARCHS["mistral"][1](sliding_window=None)).eval()
    full.load_state_dict(windowed.state_dict())
    ids, mask = inputs(1)
    assert not torch.equal(generate(full, ids, mask), dynamic(windowed, ids, mask))


@pytest.mark.parametrize("arch", list(ARCHS))
def test_another_attention_reads_the_ring_through_transformers_masks(arch):
    model = _model(arch)
    ids, mask = inputs(2)
    ref = reference(arch, 2)
    with pytest.warns(UserWarning, match="O\\(capacity\\)"):
        out = generate(model, ids, mask, kh.KVCache(model.config, MAX_LEN, max_step=4), impl="sdpa")
    assert_tokens(out, ref)


def test_linear_sliding_layers_option():
    model = _model("gemma3")
    ids, mask = inputs(2)
    cache = kh.KVCache(model.config, MAX_LEN, sliding_layers="linear")
    assert not rings(cache) and cache.layers[0].window == WINDOW
    assert_tokens(generate(model, ids, mask, cache, impl="kvcache"), reference("gemma3", 2))


# ------------------------------------------------------- prefill and rollback


def _forward(model, x, cache, past, mask_len=None):
    pos = torch.arange(past, past + x.shape[1]).unsqueeze(0).expand(x.shape[0], -1)
    mask = torch.ones(x.shape[0], past + x.shape[1], dtype=torch.long)
    with torch.no_grad():
        return model(input_ids=x, attention_mask=mask, position_ids=pos, **{kh.CACHE_ARG: cache}).logits


@pytest.mark.parametrize("arch", list(ARCHS))
def test_chunked_prefill_longer_than_the_ring(arch):
    model = _model(arch)
    ids, _ = inputs(1, prompt=64)
    model.set_attn_implementation("sdpa")
    ref = _forward(model, ids, DynamicCache(config=model.config), 0)
    model.set_attn_implementation("kvcache")
    cache = kh.KVCache(model.config, MAX_LEN, max_step=4)  # 9-slot rings
    got, past = [], 0
    for c in (13, 1, 4, 17, 2, 27):  # longer and shorter than max_step
        got.append(_forward(model, ids[:, past:past + c], cache, past))
        past += c
    torch.testing.assert_close(torch.cat(got, 1), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_crop_after_the_wrap_equals_never_decoding_the_dropped_tokens(arch):
    model = _model(arch)
    ids, _ = inputs(1, prompt=40)
    prompt, drafted, kept, nxt = ids[:, :30], ids[:, 30:34], 1, ids[:, 34:37]
    model.set_attn_implementation("sdpa")
    ref = _forward(model, torch.cat([prompt, drafted[:, :kept], nxt], 1), DynamicCache(config=model.config), 0)
    model.set_attn_implementation("kvcache")
    cache = kh.KVCache(model.config, MAX_LEN, max_step=4)
    _forward(model, prompt, cache, 0)
    _forward(model, drafted, cache, 30)
    cache.crop(-(drafted.shape[1] - kept))  # 3 <= max_step, after several wraps of the 9-slot ring
    assert all(la.lengths.tolist() == [30 + kept] for la in rings(cache))
    got = _forward(model, nxt, cache, 30 + kept)
    torch.testing.assert_close(got, ref[:, -nxt.shape[1]:], rtol=1e-4, atol=1e-4)
    # Deeper than max_step below the furthest position written: refused, nothing changes.
    with pytest.raises(ValueError, match="max_step=4"):
        cache.crop(-5)
    cache.crop(-3)  # back to 31: 3 below the furthest position written (34)
    with pytest.raises(ValueError, match="max_step=4"):
        cache.crop(-2)  # 29 would be 5 below it, though only 2 below the length
    assert all(la.lengths.tolist() == [30 + kept] for la in rings(cache))


@pytest.mark.parametrize("arch", list(ARCHS))
def test_prompt_lookup_assisted_generation_equals_greedy(arch, monkeypatch):
    model = _model(arch)
    ids, mask = inputs(1, prompt=40, repeat=True)
    ref = dynamic(model, ids, mask)
    crops = record_crops(monkeypatch, kh.KVRingLayer)
    out = generate(model, ids, mask, kh.KVCache(model.config, MAX_LEN, max_step=4), impl="kvcache",
                   prompt_lookup_num_tokens=3)
    assert_tokens(out, ref)
    assert any(n < 0 for n in crops), "no candidate was rejected: crop after the wrap not exercised"


@pytest.mark.parametrize("arch", list(ARCHS))
def test_assistant_model_generation_equals_greedy(arch):
    target = _model(arch)
    draft = _model(arch, seed=7, num_hidden_layers=1, layer_types=None) if arch == "mistral" else \
        _model(arch, seed=7, num_hidden_layers=1, layer_types=("sliding_attention",))
    draft.set_attn_implementation("sdpa")
    ids, mask = inputs(1)
    ref = reference(arch, 1)
    out = generate(target, ids, mask, kh.KVCache(target.config, MAX_LEN), impl="kvcache", assistant_model=draft)
    assert_tokens(out, ref)


@pytest.mark.parametrize("arch, batch", [("gemma3", 2), ("mistral", 1)])
def test_beam_search_matches_dynamic_cache_beams(arch, batch):
    model = _model(arch)
    ids, mask = inputs(batch, prompt=12)
    kw = dict(num_beams=3, num_return_sequences=2, new=16)
    ref = dynamic(model, ids, mask, **kw)
    calls = []
    orig = kh.KVRingLayer.reorder_cache

    def spy(self, beam_idx):
        calls.append(beam_idx.clone())
        orig(self, beam_idx)

    kh.KVRingLayer.reorder_cache = spy
    try:
        out = generate(model, ids, mask, kh.KVCache(model.config, MAX_LEN, max_step=4), impl="kvcache", **kw)
    finally:
        kh.KVRingLayer.reorder_cache = orig
    assert_tokens(out, ref)
    assert calls and any(not torch.equal(c, torch.arange(c.numel())) for c in calls)  # rows really moved


def test_reset_and_reuse():
    model = _model("gemma3")
    ids, mask = inputs(2)
    cache = kh.KVCache(model.config, MAX_LEN, max_step=4)
    generate(model, *inputs(2, seed=5), cache, impl="kvcache", new=12)
    cache.reset()
    assert all(bool((la.positions == -1).all()) and la.lengths.tolist() == [0, 0] for la in rings(cache))
    assert_tokens(generate(model, ids, mask, cache, impl="kvcache"), reference("gemma3", 2))
    cache.reset_rows(torch.tensor([1]))
    assert all(bool((la.positions[1] == -1).all()) and la.lengths.tolist()[1] == 0 for la in rings(cache))
    assert all(bool((la.positions[0] >= 0).any()) for la in rings(cache))


# --------------------------------------------------------------------- sinks


def _sink_reference(module, query, key, value, attention_mask, scaling=None, sliding_window=None, **kw):
    """Eager attention over every token so far, a query at p seeing k <= p with p - k < window or k < SINKS."""
    groups = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(groups, 1).double()
    v = value.repeat_interleave(groups, 1).double()
    s = query.double() @ k.transpose(-1, -2) * scaling
    kl, ql = key.shape[2], query.shape[2]
    p = torch.arange(kl - ql, kl).view(-1, 1)
    j = torch.arange(kl).view(1, -1)
    ok = j <= p
    if sliding_window:
        ok &= (p - j < sliding_window) | (j < _SINKS)
    s = s.masked_fill(~ok, float("-inf"))
    out = torch.softmax(s, -1) @ v
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


_SINKS = 3
AttentionInterface.register("sinkref", _sink_reference)
AttentionMaskInterface.register("sinkref", lambda *a, **k: None)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_attention_sinks_option_matches_a_sink_mask(arch):
    model = _model(arch)
    ids, mask = inputs(1)
    ref = generate(model, ids, mask, DynamicCache(), impl="sinkref")  # full layers: every token kept
    assert not torch.equal(ref, reference(arch, 1))  # the sinks change the tokens
    cache = kh.KVCache(model.config, MAX_LEN, max_step=4, sinks=_SINKS)
    assert all(la.capacity == _SINKS + WINDOW + 3 for la in rings(cache))
    assert_tokens(generate(model, ids, mask, cache, impl="kvcache"), ref)


def test_sinks_refuse_left_padding_and_other_attentions():
    model = _model("mistral")
    ids, mask = inputs(2)
    with pytest.raises(NotImplementedError, match="left-padded"):
        generate(model, ids, mask, kh.KVCache(model.config, MAX_LEN, sinks=2), impl="kvcache")
    with pytest.raises(ValueError, match="sinks=2"):
        generate(model, *inputs(1), kh.KVCache(model.config, MAX_LEN, sinks=2), impl="sdpa")


# -------------------------------------------------------------------- memory


def test_ring_memory_is_sinks_window_and_max_step():
    cfg = ARCHS["gemma3"][1]()
    b, dt = 2, torch.float32
    cache = kh.KVCache(cfg, 1000, batch_size=b, dtype=dt, device="cpu", max_step=8, sinks=2)
    slot = b * cfg.num_key_value_heads * cfg.head_dim * dt.itemsize * 2  # keys and values
    for i, la in enumerate(cache.layers):
        kv_bytes = (la.keys.numel() + la.values.numel()) * la.keys.element_size()
        if cfg.layer_types[i] == "sliding_attention":
            assert isinstance(la, kh.KVRingLayer)
            assert kv_bytes == slot * (2 + WINDOW + 8 - 1)
            assert la.positions.numel() == b * (2 + WINDOW + 8 - 1)
        else:
            assert not isinstance(la, kh.KVRingLayer) and kv_bytes == slot * 1000


# ---------------------------------------------------------------- arguments


@pytest.mark.parametrize("kw, exc, match", [
    (dict(max_step=0), ValueError, "max_step"),
    (dict(max_step=-3), ValueError, "max_step"),
    (dict(max_step="8"), TypeError, "max_step"),
    (dict(sinks=-1), ValueError, "sinks"),
    (dict(sinks=1.5), TypeError, "sinks"),
    (dict(sinks=2, sliding_layers="linear"), ValueError, "sinks"),
    (dict(sinks=2, sliding_layers="hf"), ValueError, "sinks"),
    (dict(sliding_layers="rings"), ValueError, "sliding_layers"),
    (dict(max_step=2**31), ValueError, "2\\*\\*31"),
])
def test_bad_arguments_name_the_argument(kw, exc, match):
    with pytest.raises(exc, match=match):
        kh.KVCache(ARCHS["gemma3"][1](), MAX_LEN, **kw)


def test_bad_crop_and_rollback():
    model = _model("mistral")
    model.set_attn_implementation("kvcache")
    cache = kh.KVCache(model.config, MAX_LEN, max_step=4)
    _forward(model, inputs(1)[0], cache, 0)
    with pytest.raises(ValueError, match="max_step=4"):
        cache.crop(-5)
    with pytest.raises(ValueError, match="max_step=4"):
        cache.rollback(torch.tensor([5]))
    with pytest.raises(ValueError, match="n must be >= 0"):
        cache.layers[0].rollback(-1)
    assert all(la.lengths.tolist() == [PROMPT] for la in rings(cache))  # nothing changed


# ------------------------------------------------------------ torch.compile


@torch.no_grad()
def test_fullgraph_forward_prefill_longer_than_the_ring_then_decode_across_wraps():
    # Traced whole (mask builder, registry lookup, the long-chunk temporary kept on the layer):
    # one graph for the prefill shape and one for every decode step, before and after the wraps.
    from torch._dynamo.utils import counters

    model = _model("mistral")
    ids, _ = inputs(1)
    ref_cache = DynamicCache(config=model.config)
    cache = kh.KVCache(model.config, MAX_LEN, batch_size=1, dtype=torch.float32, device="cpu", max_step=4)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    torch._dynamo.reset()
    counters.clear()
    x, past = ids, 0
    for step in range(13):  # 20 + 12 positions through a 9-slot ring
        pos = torch.arange(past, past + x.shape[1]).unsqueeze(0)
        m = torch.ones(1, past + x.shape[1], dtype=torch.long)
        model.set_attn_implementation("sdpa")
        want = model(input_ids=x, attention_mask=m, position_ids=pos, **{kh.CACHE_ARG: ref_cache}).logits
        model.set_attn_implementation("kvcache")
        got = compiled(input_ids=x, attention_mask=m, position_ids=pos, **{kh.CACHE_ARG: cache}).logits
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        past += x.shape[1]
        x = want[:, -1:].argmax(-1)
    assert all(la.lengths.tolist() == [past] for la in rings(cache))
    assert counters["stats"]["unique_graphs"] <= 3  # prefill, first decode, decode with a grown mask


def test_gpt_oss_learned_sinks_with_kvcache_attention_and_with_eager():
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    cfg = GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=2,
                       num_experts_per_tok=1, sliding_window=WINDOW, layer_types=["sliding_attention",
                                                                                   "full_attention"],
                       max_position_embeddings=512, initializer_range=0.02, pad_token_id=0)
    model = GptOssForCausalLM(cfg).eval()
    torch.nn.init.normal_(model.model.layers[0].self_attn.sinks, std=2.0)  # sinks that matter
    ids, mask = inputs(1)
    ref = generate(model, ids, mask, DynamicCache(config=model.config), impl="eager", new=12)
    # The kvcache attention passes s_aux to attend's sink_logits: transformers' eager tokens,
    # through ring wraps (window WINDOW, 12 new tokens past a prompt).
    out = generate(model, ids, mask, kh.KVCache(model.config, MAX_LEN, max_step=4), impl="kvcache", new=12)
    assert_tokens(out, ref)
    with pytest.warns(UserWarning, match="O\\(capacity\\)"):
        out = generate(model, ids, mask, kh.KVCache(model.config, MAX_LEN, max_step=4), impl="eager", new=12)
    assert_tokens(out, ref)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_quantized_rings(kv_dtype):
    # kv_dtype quantizes the rings too (per-slot scales): logits of a prefill longer than the
    # ring and decode steps across its wraps stay near transformers' float32 DynamicCache.
    model = _model("gemma3")
    ids, _ = inputs(1, prompt=40)
    model.set_attn_implementation("sdpa")
    ref = _forward(model, ids, DynamicCache(config=model.config), 0)
    model.set_attn_implementation("kvcache")
    cache = kh.KVCache(model.config, MAX_LEN, max_step=4, kv_dtype=kv_dtype)
    got = torch.cat([_forward(model, ids[:, :20], cache, 0)] +
                    [_forward(model, ids[:, p:p + 1], cache, p) for p in range(20, 40)], 1)
    for la in rings(cache):
        assert la.keys.dtype in (torch.int8, torch.float8_e4m3fn) and la.keys.shape[2] == WINDOW + 3
        assert la.k_scale.shape == la.keys.shape[:3]
    err = (got - ref).abs().max().item()
    # e4m3 keeps 3 mantissa bits (int8 about 7): the bound is the format's, not a fit to our output
    assert err < {"int8": 0.05, "fp8": 0.1}[kv_dtype] * ref.abs().max().item(), err
    cache.crop(-2)  # rollback moves nothing: lengths only
    assert all(la.lengths.tolist() == [38] for la in rings(cache))


def test_overflow_refused_before_the_rings_before_the_first_full_layer_write():
    """Gemma-3's layer 0 is a ring and layer 1 a full layer, whose write refuses a chunk past
    max_len: the refusal comes before layer 0 writes, on the first step and on a later one, and the
    cache then serves a chunk that fits as if the refused one never came."""
    model = _model("gemma3")
    model.set_attn_implementation(kh.ATTN_IMPLEMENTATION)
    x = torch.randint(3, VOCAB, (1, 14), generator=torch.Generator().manual_seed(3))
    cache = kh.KVCache(model.config, 10)
    with pytest.raises(ValueError, match=r"KV cache overflow: end=12 exceeds max_len=10"):
        _forward(model, x[:, :12], cache, 0)
    assert all(not la.is_initialized for la in cache.layers)
    _forward(model, x[:, :8], cache, 0)
    before = [(la.lengths.clone(), la.positions.clone() if isinstance(la, kh.KVRingLayer) else None)
              for la in cache.layers]
    with pytest.raises(ValueError, match=r"KV cache overflow: end=11 exceeds max_len=10"):
        _forward(model, x[:, 8:11], cache, 8)
    for la, (n, p) in zip(cache.layers, before):
        assert torch.equal(la.lengths, n)
        if p is not None:
            assert torch.equal(la.positions, p)
    fresh = kh.KVCache(model.config, 10)
    _forward(model, x[:, :8], fresh, 0)
    torch.testing.assert_close(_forward(model, x[:, 8:10], cache, 8), _forward(model, x[:, 8:10], fresh, 8),
                               atol=0, rtol=0)
