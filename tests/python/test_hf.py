"""kvcache.hf: the transformers Cache and the "kvcache" attention, on tiny random models.

References are transformers' own caches and attention (StaticCache/DynamicCache
with sdpa) and plain float64 PyTorch; nothing is downloaded.
"""

from __future__ import annotations

import copy
import functools
import re
import subprocess
import sys
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import kvcache.hf as kh  # noqa: E402
from kv_testing import record_crops  # noqa: E402
from references import assert_close, attention_reference  # noqa: E402
from transformers import (  # noqa: E402
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    StaticCache,
)

VOCAB = 96
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    # Larger random weights: peaked logits, so greedy tokens do not hinge on rounding.
    initializer_range=0.2,
    pad_token_id=0,
)
WINDOW = 5
ARCHS = {
    "llama": (LlamaForCausalLM, lambda **kw: LlamaConfig(**{**COMMON, **kw})),
    # layer 0 full attention, layer 1 sliding window
    "qwen2": (Qwen2ForCausalLM,
              lambda **kw: Qwen2Config(**{**COMMON, **kw}, use_sliding_window=True, sliding_window=WINDOW,
                                       max_window_layers=1)),
    # every layer sliding
    "mistral": (MistralForCausalLM, lambda **kw: MistralConfig(**{**COMMON, **kw}, sliding_window=WINDOW)),
}
MAX_LEN = 48
NEW = 12


@functools.lru_cache(maxsize=None)
def _model(arch: str, dtype: torch.dtype, seed: int = 0, **overrides):
    cls, make_cfg = ARCHS[arch]
    torch.manual_seed(seed)
    return cls(make_cfg(**overrides)).to(dtype).eval()


def model_for(arch, dtype=torch.float32, **overrides):
    return _model(arch, dtype, **overrides)


def inputs(batch: int, prompt: int = 9, pad: int = 4, seed: int = 1):
    """Random prompts; with batch 2, row 1 is left-padded by ``pad`` tokens."""
    g = torch.Generator().manual_seed(seed)
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


def assert_tokens(a, b):
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.equal(a, b), f"\n{a}\n!=\n{b}"


# ------------------------------------------------------------------ generate


def assert_tokens_or_tie(model, mask, got, want, tol=0.05):
    """Equal tokens, or the first difference is a rounding tie of a low-precision model.

    At the first column where the sequences differ, the model run in float32
    (its own weights, upcast) on the common prefix must score the two
    candidate tokens within ``tol`` of each other: a bfloat16 attention that
    rounds differently may then pick either, and nothing after that point is
    comparable.
    """
    if torch.equal(got, want):
        return
    assert got.shape == want.shape
    t = int((got != want).any(0).nonzero()[0])
    rows = (got[:, t] != want[:, t]).nonzero().flatten()
    oracle = copy.deepcopy(model).float()
    oracle.set_attn_implementation("eager")
    full = torch.cat([mask, torch.ones(mask.shape[0], t - mask.shape[1], dtype=mask.dtype)], 1)
    with torch.no_grad():
        logits = oracle(got[:, :t], attention_mask=full, position_ids=(full.cumsum(-1) - 1).clamp(min=0)).logits
    for r in rows.tolist():
        a, b = logits[r, -1, got[r, t]].item(), logits[r, -1, want[r, t]].item()
        assert abs(a - b) < tol, f"row {r} column {t}: tokens {got[r, t]} vs {want[r, t]} score {a:.4f} vs {b:.4f}"


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_generate_matches_static_and_dynamic(arch, dtype, batch):
    model = model_for(arch, dtype)
    ids, mask = inputs(batch)
    static = generate(model, ids, mask, StaticCache(model.config, MAX_LEN))
    dynamic = generate(model, ids, mask, DynamicCache(config=model.config))
    cache = kh.KVCache(model.config, MAX_LEN)
    ours = generate(model, ids, mask, cache, impl="kvcache")
    # every row holds prompt (padding included) + generated tokens but the last
    for layer in cache.layers:
        assert layer.lengths.tolist() == [ids.shape[1] + NEW - 1] * batch
    if dtype == torch.float32:
        assert_tokens(static, dynamic)
        assert_tokens(ours, static)
    else:
        # bfloat16 attentions that round differently may break greedy ties
        # differently (transformers' own static and dynamic caches do, here).
        assert_tokens_or_tie(model, mask, ours, static)
        assert_tokens_or_tie(model, mask, ours, dynamic)


def test_tie_check_rejects_a_real_difference():
    model = model_for("llama", torch.bfloat16)
    ids, mask = inputs(2)
    ref = generate(model, ids, mask)
    bad = ref.clone()
    bad[1, 12] = (ref[1, 12] + 1) % VOCAB  # a token the model does not pick
    with pytest.raises(AssertionError, match="column 12"):
        assert_tokens_or_tie(model, mask, bad, ref)


def test_the_reference_depends_on_the_window_and_the_padding():
    # The comparisons above can only catch a wrong window or read padding if
    # these change the tokens: check that they do, on the same inputs.
    windowed = model_for("mistral")
    full = MistralForCausalLM(MistralConfig(**COMMON, sliding_window=None)).eval()
    full.load_state_dict(windowed.state_dict())
    ids, mask = inputs(2)
    ref = generate(windowed, ids, mask)
    assert not torch.equal(generate(full, ids, mask), ref)
    assert not torch.equal(generate(windowed, ids, torch.ones_like(mask))[1], ref[1])


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_hf_sliding_layers_option(arch):
    model = model_for(arch)
    ids, mask = inputs(2)
    ref = generate(model, ids, mask, DynamicCache(config=model.config))
    cache = kh.KVCache(model.config, MAX_LEN, sliding_layers="hf")
    assert any(type(l).__name__ == "StaticSlidingWindowLayer" for l in cache.layers)
    assert_tokens(generate(model, ids, mask, cache, impl="kvcache"), ref)


def test_kvcache_with_another_attention_is_correct_and_warns():
    model = model_for("qwen2")
    ids, mask = inputs(2)
    ref = generate(model, ids, mask, StaticCache(model.config, MAX_LEN))
    with pytest.warns(UserWarning, match="O\\(capacity\\)"):
        out = generate(model, ids, mask, kh.KVCache(model.config, MAX_LEN), impl="sdpa")
    assert_tokens(out, ref)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_kvcache_attention_with_transformers_caches(arch):
    # "kvcache" attention over keys that are not KVCache buffers: dynamic and
    # static layers (sliding ones too) and no cache at all.
    model = model_for(arch)
    ids, mask = inputs(2)
    ref = generate(model, ids, mask, DynamicCache(config=model.config))
    assert_tokens(generate(model, ids, mask, DynamicCache(config=model.config), impl="kvcache"), ref)
    assert_tokens(generate(model, ids, mask, StaticCache(model.config, MAX_LEN), impl="kvcache"), ref)
    assert_tokens(generate(model, ids, mask, impl="kvcache", use_cache=False), ref)


def test_chunked_prefill():
    model = model_for("qwen2")
    ids, mask = inputs(2)
    ref = generate(model, ids, mask, DynamicCache(config=model.config))
    out = generate(model, ids, mask, kh.KVCache(model.config, MAX_LEN), impl="kvcache", prefill_chunk_size=4)
    assert_tokens(out, ref)


def test_allocates_up_front_and_keeps_addresses():
    model = model_for("llama")
    ids, mask = inputs(2)
    cache = kh.KVCache(model.config, MAX_LEN, batch_size=2, dtype=torch.float32, device="cpu")
    ptrs = [(l.keys.data_ptr(), l.values.data_ptr(), l.lengths.data_ptr()) for l in cache.layers]
    assert all(l.keys.shape == (2, 2, MAX_LEN, 16) for l in cache.layers)
    assert all(int(l.lengths.abs().sum()) == 0 for l in cache.layers)
    ref = generate(model, ids, mask)
    assert_tokens(generate(model, ids, mask, cache, impl="kvcache"), ref)
    cache.reset()
    assert_tokens(generate(model, ids, mask, cache, impl="kvcache"), ref)
    assert ptrs == [(l.keys.data_ptr(), l.values.data_ptr(), l.lengths.data_ptr()) for l in cache.layers]
    lazy = kh.KVCache(model.config, MAX_LEN)
    assert not lazy.is_initialized and all(l.keys is None for l in lazy.layers)


def test_gemma2_softcap_scaling_and_alternating_windows():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(**{**COMMON, "num_hidden_layers": 4}, head_dim=16, sliding_window=WINDOW,
                       attn_logit_softcapping=2.0, query_pre_attn_scalar=24, final_logit_softcapping=None)
    model = Gemma2ForCausalLM(cfg).eval()
    assert cfg.layer_types[:2] == ["sliding_attention", "full_attention"]
    ids, mask = inputs(2)
    ref = generate(model, ids, mask, DynamicCache(config=cfg), impl="eager")  # sdpa has no softcap
    cache = kh.KVCache(cfg, MAX_LEN)
    assert [l.window for l in cache.layers] == [WINDOW, 0, WINDOW, 0]
    assert_tokens(generate(model, ids, mask, cache, impl="kvcache"), ref)
    # the reference depends on the softcap: without it the tokens change
    nocap = Gemma2ForCausalLM(Gemma2Config(**{**COMMON, "num_hidden_layers": 4}, head_dim=16, sliding_window=WINDOW,
                                           attn_logit_softcapping=None, query_pre_attn_scalar=24,
                                           final_logit_softcapping=None)).eval()
    nocap.load_state_dict(model.state_dict())
    assert not torch.equal(generate(nocap, ids, mask, impl="eager"), ref)


def test_deepcopy_registers_the_copy():
    model = model_for("llama")
    model.set_attn_implementation("kvcache")
    ids, mask = inputs(2)
    cache = kh.KVCache(model.config, MAX_LEN)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **{kh.CACHE_ARG: cache})
    twin = copy.deepcopy(cache)
    for a, b in zip(cache.layers, twin.layers):
        assert kh._registry.layer_of(b.keys, b.values) is b and kh._registry.layer_of(a.keys, a.values) is a
        assert b.keys.data_ptr() != a.keys.data_ptr() and torch.equal(a.keys, b.keys)
        assert torch.equal(a.lengths, b.lengths)
    twin.crop(-2)  # the copy moves alone
    assert [int(l.lengths[0]) for l in cache.layers] == [ids.shape[1]] * 2
    assert [int(l.lengths[0]) for l in twin.layers] == [ids.shape[1] - 2] * 2


def test_hybrid_model_falls_back_to_transformers_layers():
    from transformers import Lfm2Config, Lfm2ForCausalLM
    from transformers.cache_utils import LinearAttentionLayer

    torch.manual_seed(0)
    cfg = Lfm2Config(**{**COMMON, "num_hidden_layers": 4},
                     layer_types=["conv", "full_attention", "conv", "full_attention"])
    model = Lfm2ForCausalLM(cfg).eval()
    ids, mask = inputs(2)
    ref = generate(model, ids, mask, DynamicCache(config=model.config))
    cache = kh.KVCache(cfg, MAX_LEN)
    assert [type(l) for l in cache.layers] == [LinearAttentionLayer, kh.KVCacheLayer] * 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_tokens(generate(model, ids, mask, cache, impl="kvcache"), ref)


@pytest.mark.parametrize("batch", [1, 2])
def test_beam_search_matches_dynamic_cache(batch):
    model = model_for("llama")
    ids, mask = inputs(batch)
    ref = generate(model, ids, mask, num_beams=2, num_return_sequences=2)
    cache = kh.KVCache(model.config, MAX_LEN)
    calls = []
    orig = kh.KVCacheLayer.reorder_cache

    def spy(self, beam_idx):
        calls.append(beam_idx.clone())
        ptr = self.keys.data_ptr()
        orig(self, beam_idx)
        assert self.keys.data_ptr() == ptr  # in place

    kh.KVCacheLayer.reorder_cache = spy
    try:
        out = generate(model, ids, mask, cache, impl="kvcache", num_beams=2, num_return_sequences=2)
    finally:
        kh.KVCacheLayer.reorder_cache = orig
    assert_tokens(out, ref)
    assert calls and any(not torch.equal(c, torch.arange(c.numel())) for c in calls)  # rows really moved


@pytest.mark.parametrize("draft_impl", ["sdpa", "kvcache"])
def test_assisted_generation_matches_dynamic_cache(draft_impl, monkeypatch):
    target = model_for("llama", num_hidden_layers=3)
    draft = model_for("llama", seed=7, num_hidden_layers=1)
    draft.set_attn_implementation(draft_impl)
    ids, mask = inputs(1)
    ref = generate(target, ids, mask, DynamicCache(config=target.config))
    crops = record_crops(monkeypatch, kh.KVCacheLayer)
    out = generate(target, ids, mask, kh.KVCache(target.config, MAX_LEN), impl="kvcache", assistant_model=draft)
    assert_tokens(out, ref)
    assert any(n < 0 for n in crops), "the draft was never rejected: crop not exercised"


@pytest.mark.skipif(not hasattr(transformers.cache_utils.Cache, "get_recurrent_states_to_keep"),
                    reason=f"transformers {transformers.__version__} refuses assisted generation on stateful "
                           "models (5.25 keeps their recurrent states' history)")
def test_prompt_lookup_on_a_hybrid_model_matches_greedy(monkeypatch):
    """Prompt-lookup decoding on LFM2 (conv layers in transformers' own layer classes, attention
    layers in kvcache's): rejected drafts crop the kvcache layers and roll the conv states back
    (transformers 5.25); the tokens are plain greedy's."""
    from transformers import Lfm2Config, Lfm2ForCausalLM

    torch.manual_seed(0)
    cfg = Lfm2Config(**{**COMMON, "num_hidden_layers": 4, "initializer_range": 0.5},
                     layer_types=["conv", "full_attention", "conv", "full_attention"])
    model = Lfm2ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(0)
    base = torch.randint(3, VOCAB, (6,), generator=g)
    ids = torch.cat([base, base, base[:3]])[None]  # repeats: the lookup proposes drafts
    mask = torch.ones_like(ids)
    ref = generate(model, ids, mask, DynamicCache(config=model.config), new=16)
    assert len(set(ref[0, ids.shape[1]:].tolist())) > 4  # not a degenerate repetition
    crops = record_crops(monkeypatch, kh.KVCacheLayer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = generate(model, ids, mask, kh.KVCache(cfg, MAX_LEN), impl="kvcache", new=16, prompt_lookup_num_tokens=3)
    assert_tokens(out, ref)
    assert any(n < 0 for n in crops), "no draft was rejected: crop not exercised"


def test_two_caches_in_flight():
    model = model_for("qwen2")
    a_ids, a_mask = inputs(2, seed=1)
    b_ids, b_mask = inputs(2, seed=2)
    ref_a = generate(model, a_ids, a_mask, new=6)
    ref_b = generate(model, b_ids, b_mask, new=6)
    model.set_attn_implementation("kvcache")
    ca, cb = kh.KVCache(model.config, MAX_LEN), kh.KVCache(model.config, MAX_LEN)
    seqs = {"a": [a_ids, a_mask, ca], "b": [b_ids, b_mask, cb]}
    with torch.no_grad():
        for step in range(6):  # the two forwards alternate on the same model
            for s in seqs.values():
                ids, mask, cache = s
                x = ids if step == 0 else ids[:, -1:]
                pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, -x.shape[1]:]
                logits = model(input_ids=x, attention_mask=mask, position_ids=pos,
                               **{kh.CACHE_ARG: cache}).logits[:, -1]
                s[0] = torch.cat([ids, logits.argmax(-1, keepdim=True)], 1)
                s[1] = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    assert_tokens(seqs["a"][0], ref_a)
    assert_tokens(seqs["b"][0], ref_b)


# -------------------------------------------------------------- torch.compile


@torch.no_grad()
def test_compiled_decode_one_graph_kvcache_ops_on_buffers():
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code
    from transformers import CompileConfig

    cap = 80  # no other size of the model is 80
    model = LlamaForCausalLM(LlamaConfig(**COMMON)).eval()
    ids, mask = inputs(2)
    ref = generate(model, ids, mask, new=8)
    compile_config = CompileConfig(fullgraph=True, backend="inductor", mode=None)
    compile_config._compile_all_devices = True  # transformers compiles on CPU only when told
    model.generation_config.compile_config = compile_config
    torch._dynamo.reset()
    counters.clear()
    cache = kh.KVCache(model.config, cap)
    out, codes = run_and_get_code(lambda: generate(model, ids, mask, cache, impl="kvcache", new=8))
    assert_tokens(out, ref)
    assert counters["stats"]["unique_graphs"] == 1  # every decode step ran the same graph
    cache.reset()
    assert_tokens(generate(model, ids, mask, cache, impl="kvcache", new=8), ref)
    assert counters["stats"]["unique_graphs"] == 1  # no recompile for a second generate either
    model.generation_config.compile_config = None

    code = "\n".join(codes)
    # traced, a layer writes with append_returning_ at its lengths (the new
    # lengths are copied back: kvcache.cache._append)
    writes = re.findall(r"torch\.ops\.kvcache\.append_returning_\.default\(([^,]+), ([^,]+),", code)
    attends = re.findall(r"torch\.ops\.kvcache\.attend\.default\([^,]+, ([^,]+), ([^,]+), [^,]+,", code)
    assert len(writes) == len(attends) == COMMON["num_hidden_layers"]
    # the ops write and read the cache's own buffers (graph inputs), not copies
    for args in writes + attends:
        assert all(re.fullmatch(r"arg\d+_1", a.strip()) for a in args), args
    assert set(writes) == set(attends)
    # nothing of cache size is allocated or copied
    allocs = re.findall(r"empty_strided_cpu\(\(([^)]*)\)", code)
    assert allocs and not any(str(cap) in [s.strip() for s in a.split(",")] for a in allocs), allocs


@torch.no_grad()
def test_fullgraph_forward_with_preallocated_cache_prefill_and_decode():
    # The whole forward, prefill included, traced in one graph per shape (the
    # mask builder and the registry lookup included): what torch.export needs.
    model = model_for("qwen2")
    model.set_attn_implementation("kvcache")
    ids, mask = inputs(2)
    eager_cache = kh.KVCache(model.config, MAX_LEN, batch_size=2, dtype=torch.float32, device="cpu")
    cache = kh.KVCache(model.config, MAX_LEN, batch_size=2, dtype=torch.float32, device="cpu")
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    torch._dynamo.reset()
    x, m = ids, mask
    for step in range(3):
        pos = (m.cumsum(-1) - 1).clamp(min=0)[:, -x.shape[1]:]
        want = model(input_ids=x, attention_mask=m, position_ids=pos, **{kh.CACHE_ARG: eager_cache}).logits
        got = compiled(input_ids=x, attention_mask=m, position_ids=pos, **{kh.CACHE_ARG: cache}).logits
        torch.testing.assert_close(got, want)
        x = want[:, -1:].argmax(-1)
        m = torch.cat([m, torch.ones_like(m[:, :1])], 1)
    assert [l.lengths.tolist() for l in cache.layers] == [[ids.shape[1] + 2] * 2] * 2


# ------------------------------------------------------ Cache API vs references


def _layer_cache(batch=3, heads=2, dim=4, cap=16, dtype=torch.float64):
    layer = kh.KVCacheLayer(cap, 0, 0)
    layer.allocate(batch, heads, dim, dtype, "cpu")
    return layer


def _fill(layer, chunk, seed):
    g = torch.Generator().manual_seed(seed)
    b, h, _, d = layer.keys.shape
    k = torch.randn(b, h, chunk, d, generator=g, dtype=layer.keys.dtype)
    v = torch.randn(b, h, chunk, d, generator=g, dtype=layer.keys.dtype)
    layer.update(k, v)
    return k, v


def test_layer_update_sizes_and_reset():
    layer = _layer_cache()
    k1, v1 = _fill(layer, 5, 0)
    k2, v2 = _fill(layer, 1, 1)
    assert torch.equal(layer.keys[:, :, :6], torch.cat([k1, k2], 2))
    assert torch.equal(layer.values[:, :, :6], torch.cat([v1, v2], 2))
    assert layer.lengths.tolist() == [6, 6, 6] and int(layer.get_seq_length()) == 6
    assert layer.get_mask_sizes(1) == (16, 0)
    assert layer.get_max_length() == layer.get_max_cache_shape() == 16
    before = layer.keys.clone()
    ptr = layer.keys.data_ptr()
    layer.reset()
    assert layer.lengths.tolist() == [0, 0, 0] and int(layer.get_seq_length()) == 0
    assert torch.equal(layer.keys, before) and layer.keys.data_ptr() == ptr  # O(1): nothing zeroed
    k3, _ = _fill(layer, 2, 2)
    assert torch.equal(layer.keys[:, :, :2], k3)


def test_crop_rolls_back_and_rewrites():
    layer = _layer_cache()
    k1, v1 = _fill(layer, 6, 0)
    ptr = layer.keys.data_ptr()
    layer.crop(-2)
    assert layer.lengths.tolist() == [4] * 3 and layer.keys.data_ptr() == ptr
    k2, _ = _fill(layer, 3, 1)
    assert torch.equal(layer.keys[:, :, :7], torch.cat([k1[:, :, :4], k2], 2))
    layer.crop(torch.tensor(-1))
    assert layer.lengths.tolist() == [6] * 3
    layer.crop(5)  # positive: keep at most the first 5
    assert layer.lengths.tolist() == [5] * 3
    layer.crop(9)
    assert layer.lengths.tolist() == [5] * 3
    layer.crop(0)
    assert layer.lengths.tolist() == [5] * 3
    with pytest.raises(ValueError, match="roll back more tokens"):
        layer.crop(-6)
    assert layer.lengths.tolist() == [5] * 3


def test_per_row_rollback_and_reset_rows():
    model = model_for("llama")
    cache = kh.KVCache(model.config, 16, batch_size=3, dtype=torch.float64, device="cpu")
    for layer in cache.layers:
        _fill(layer, 6, 0)
    cache.rollback(torch.tensor([0, 2, 5]))
    assert all(l.lengths.tolist() == [6, 4, 1] for l in cache.layers)
    cache.reset_rows(torch.tensor([False, True, False]))
    assert all(l.lengths.tolist() == [6, 0, 1] for l in cache.layers)
    with pytest.raises(ValueError):
        cache.rollback(torch.tensor([7, 0, 0]))
    assert all(l.lengths.tolist() == [6, 0, 1] for l in cache.layers)


@pytest.mark.parametrize(
    "rows,exc",
    [(torch.tensor([True]), ValueError), (torch.tensor([-1]), ValueError), (torch.tensor([0, 9]), ValueError),
     (torch.tensor([0], dtype=torch.int16), TypeError), ([0], TypeError)],
    ids=["short-mask", "negative", "out-of-range", "int16", "list"],
)
def test_reset_rows_bad_rows_leave_every_layer_unchanged(rows, exc):
    """issue 17: layer 0 was reset before layer 1 refused the rows."""
    model = model_for("llama")
    cache = kh.KVCache(model.config, 16, batch_size=3, dtype=torch.float64, device="cpu")
    layers = [la for la in cache.layers if isinstance(la, kh.KVCacheLayer)]
    assert len(layers) >= 2
    for layer in layers:
        _fill(layer, 6, 0)
    cache.rollback(torch.tensor([0, 2, 5]))
    with pytest.raises(exc, match="rows"):
        cache.reset_rows(rows)
    assert all(la.lengths.tolist() == [6, 4, 1] for la in layers)
    cache.reset_rows(torch.tensor([2, 0], dtype=torch.int32))  # int32 indices accepted
    assert all(la.lengths.tolist() == [0, 4, 0] for la in layers)


def _ref_rows(keys, lengths):
    return [keys[b, :, : int(n)] for b, n in enumerate(lengths)]


def test_reorder_and_select_rows_in_place():
    layer = _layer_cache(batch=4)
    _fill(layer, 5, 0)
    layer.rollback(torch.tensor([0, 1, 2, 3]))  # ragged: 5, 4, 3, 2
    keys, values, lengths = layer.keys.clone(), layer.values.clone(), layer.lengths.clone()
    ptrs = (layer.keys.data_ptr(), layer.values.data_ptr(), layer.lengths.data_ptr())
    idx = torch.tensor([2, 2, 0, 3])
    layer.reorder_cache(idx)
    assert (layer.keys.data_ptr(), layer.values.data_ptr(), layer.lengths.data_ptr()) == ptrs
    assert torch.equal(layer.lengths, lengths[idx])
    for got, want in zip(_ref_rows(layer.keys, layer.lengths), _ref_rows(keys[idx], lengths[idx])):
        assert torch.equal(got, want)
    for got, want in zip(_ref_rows(layer.values, layer.lengths), _ref_rows(values[idx], lengths[idx])):
        assert torch.equal(got, want)


@pytest.mark.parametrize("kind", ["subset", "bool", "permutation"])
def test_batch_select_indices(kind):
    layer = _layer_cache(batch=4)
    _fill(layer, 5, 0)
    layer.rollback(torch.tensor([0, 1, 2, 3]))
    keys, lengths = layer.keys.clone(), layer.lengths.clone()
    ptr = layer.keys.data_ptr()
    sel = {"subset": torch.tensor([3, 1]), "bool": torch.tensor([False, True, False, True]),
           "permutation": torch.tensor([1, 3, 0, 2])}[kind]
    idx = sel.nonzero().flatten() if sel.dtype == torch.bool else sel
    layer.batch_select_indices(sel)
    assert layer.keys.shape[0] == layer.lengths.shape[0] == layer.batch_size == idx.numel()
    assert layer.keys.data_ptr() == ptr
    assert torch.equal(layer.lengths, lengths[idx])
    for got, want in zip(_ref_rows(layer.keys, layer.lengths), _ref_rows(keys[idx], lengths[idx])):
        assert torch.equal(got, want)
    k, _ = _fill(layer, 1, 3)  # still writable, at each row's own length
    for b, n in enumerate(layer.lengths.tolist()):
        assert torch.equal(layer.keys[b, :, n - 1], k[b, :, 0])


def test_batch_repeat_interleave_and_growing_selection():
    layer = _layer_cache(batch=2)
    _fill(layer, 4, 0)
    layer.rollback(torch.tensor([0, 2]))
    keys, lengths = layer.keys.clone(), layer.lengths.clone()
    layer.batch_repeat_interleave(3)
    idx = torch.arange(2).repeat_interleave(3)
    assert layer.keys.shape == (6, 2, 16, 4) and layer.batch_size == 6
    assert torch.equal(layer.lengths, lengths[idx])
    for got, want in zip(_ref_rows(layer.keys, layer.lengths), _ref_rows(keys[idx], lengths[idx])):
        assert torch.equal(got, want)
    assert kh._registry.layer_of(layer.keys, layer.values) is layer  # the new buffers are registered
    layer.batch_select_indices(torch.tensor([5, 0, 0, 1, 2, 3, 4]))  # 7 > 6 rows: grows again
    assert layer.keys.shape[0] == 7 and layer.lengths.tolist() == [2, 4, 4, 4, 4, 2, 2]


# ----------------------------------------------------------- attention glue


def _ref_attention(q, k, v, first, last, scale, window=0, softcap=0.0):
    """float64 attention of queries at slots last-seq..last-1 over [first, slot] (and the window)."""
    return attention_reference(q, k, v, torch.tensor(last), torch.tensor(first), scale, window, softcap)


class _Module(torch.nn.Module):
    layer_idx = 0
    is_causal = True


@pytest.mark.parametrize("window", [0, 3])
def test_attention_reads_layer_lengths_and_mask_offsets(window):
    layer = kh.KVCacheLayer(16, window, 0)
    layer.allocate(2, 2, 8, torch.float32, "cpu")
    _fill(layer, 7, 0)
    q = torch.randn(2, 4, 2, 8, generator=torch.Generator().manual_seed(5))
    mask2d = torch.tensor([[1] * 9, [0, 0, 0] + [1] * 6])
    m = kh.kvcache_mask(2, 2, 16, q_offset=7, attention_mask=mask2d.bool(),
                        mask_function=transformers.masking_utils.causal_mask_function)
    assert m.shape == (2, 1, 1, 2) and m.dtype == torch.int32 and m.flatten().tolist() == [0, 9, 3, 9]
    # the queries belong after the 7 cached tokens: write 2 more first
    k, v = _fill(layer, 2, 1)
    out, weights = kh.kvcache_attention(_Module(), q, layer.keys, layer.values, m, scaling=0.3, softcap=2.0)
    assert weights is None and out.shape == (2, 2, 4, 8)
    ref = _ref_attention(q, layer.keys, layer.values, [0, 3], [9, 9], 0.3, window, 2.0)
    assert_close(out.transpose(1, 2), ref, torch.float32)


def test_attention_over_foreign_keys_shifts_offsets():
    # Keys a transformers layer returns: only the last 6 of 10 tokens (a sliding
    # dynamic layer); kv_start 7 (absolute) is slot 3 there.
    g = torch.Generator().manual_seed(0)
    full_k, full_v = torch.randn(1, 1, 10, 4, generator=g), torch.randn(1, 1, 10, 4, generator=g)
    q = torch.randn(1, 2, 1, 4, generator=g)
    m = torch.tensor([7, 10], dtype=torch.int32).view(1, 1, 1, 2)
    out, _ = kh.kvcache_attention(_Module(), q, full_k[:, :, 4:].contiguous(), full_v[:, :, 4:].contiguous(), m,
                                  scaling=0.5, sliding_window=5)
    ref = _ref_attention(q, full_k, full_v, [7], [10], 0.5, window=5)
    assert_close(out.transpose(1, 2), ref, torch.float32)


def test_registry_is_weak_and_checks_identity():
    layer = _layer_cache()
    assert kh._registry.layer_of(layer.keys, layer.values) is layer
    assert kh._registry.layer_of(layer.keys, layer.values.clone()) is None  # values must be the layer's too
    assert kh._registry.layer_of(layer.keys.clone(), layer.values) is None
    key = id(layer.keys)
    del layer
    import gc

    gc.collect()
    assert key not in kh._registry._LAYERS


# ------------------------------------------------------------------- errors


def test_overflow_raises_and_writes_nothing():
    layer = _layer_cache(cap=8)
    _fill(layer, 6, 0)
    keys, lengths = layer.keys.clone(), layer.lengths.clone()
    with pytest.raises(ValueError, match="KV cache overflow: "):
        _fill(layer, 3, 1)
    assert torch.equal(layer.keys, keys) and torch.equal(layer.lengths, lengths)
    model = model_for("llama")
    ids, mask = inputs(1)
    with pytest.raises(ValueError, match="KV cache overflow: "):
        generate(model, ids, mask, kh.KVCache(model.config, ids.shape[1] + 3), impl="kvcache")


def test_dtype_mismatch_raises_type_error_and_writes_nothing():
    layer = _layer_cache(dtype=torch.float32)
    _fill(layer, 2, 0)
    keys, lengths = layer.keys.clone(), layer.lengths.clone()
    k = torch.zeros(3, 2, 1, 4, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="bfloat16"):
        layer.update(k, k)
    assert torch.equal(layer.keys, keys) and torch.equal(layer.lengths, lengths)
    model = model_for("llama", torch.bfloat16)
    ids, mask = inputs(1)
    with pytest.raises(TypeError, match="dtype=torch.float32"):
        generate(model, ids, mask, kh.KVCache(model.config, MAX_LEN, dtype=torch.float32), impl="kvcache")
    cache = kh.KVCache(model.config, MAX_LEN, batch_size=1, dtype=torch.float32, device="cpu")
    with pytest.raises(TypeError, match="nothing was written"):
        generate(model, ids, mask, cache, impl="kvcache")
    assert all(int(l.lengths.sum()) == 0 and int(l.keys.abs().sum()) == 0 for l in cache.layers)


def test_batch_mismatch_raises():
    model = model_for("llama")
    ids, mask = inputs(2)
    cache = kh.KVCache(model.config, MAX_LEN, batch_size=1, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="batch"):
        generate(model, ids, mask, cache, impl="kvcache")


@pytest.mark.parametrize("layer_type", ["chunked_attention", "indexed_attention", "made_up_attention"])
def test_unsupported_layer_type(layer_type):
    cfg = LlamaConfig(**COMMON)
    cfg.layer_types = ["full_attention", layer_type]
    with pytest.raises(NotImplementedError, match=layer_type):
        kh.KVCache(cfg, MAX_LEN)


def test_different_key_and_value_head_sizes():
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                           qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, kv_lora_rank=16, q_lora_rank=None)
    with pytest.raises(NotImplementedError, match="different head sizes"):
        kh.KVCache(cfg, MAX_LEN)
    layer = kh.KVCacheLayer(8)
    with pytest.raises(NotImplementedError, match="different head sizes"):
        layer.update(torch.zeros(1, 1, 1, 24), torch.zeros(1, 1, 1, 16))
    assert not layer.is_initialized


def test_kvcache_attention_refuses_different_key_and_value_head_sizes():
    """MLA-style attention (DeepSeek-V3) with transformers' own cache: the kvcache attention gets keys
    of qk_head_dim and values of v_head_dim, and refuses them by name before any operator runs."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    cfg = DeepseekV3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                           num_hidden_layers=1, num_attention_heads=2, qk_nope_head_dim=16, qk_rope_head_dim=8,
                           v_head_dim=16, kv_lora_rank=16, q_lora_rank=None, n_routed_experts=4,
                           num_experts_per_tok=2, n_group=1, topk_group=1)
    model = DeepseekV3ForCausalLM(cfg).eval()
    model.set_attn_implementation("kvcache")
    with pytest.raises(NotImplementedError, match=r"one head size; got keys \(1, 2, 5, 24\) and values "
                                                  r"\(1, 2, 5, 16\) \(MLA-style.*attn_implementation='sdpa'"):
        model(torch.tensor([[1, 5, 9, 3, 7]]))


def test_mask_errors():
    causal = transformers.masking_utils.causal_mask_function
    with pytest.raises(ValueError, match="left padding only"):
        kh.kvcache_mask(1, 3, 8, attention_mask=torch.tensor([[1, 0, 1]]).bool(), mask_function=causal)
    with pytest.raises(NotImplementedError, match="causal and sliding"):
        kh.kvcache_mask(1, 3, 8, mask_function=transformers.masking_utils.bidirectional_mask_function)
    with pytest.raises(NotImplementedError, match="custom mask"):
        kh.kvcache_mask(1, 3, 8, mask_function=causal, use_vmap=True)
    q = torch.zeros(1, 2, 1, 4)
    k = torch.zeros(1, 1, 3, 4)
    with pytest.raises(ValueError, match="int32 masks"):
        kh.kvcache_attention(_Module(), q, k, k, torch.zeros(1, 1, 1, 3, dtype=torch.bool))


def test_bad_arguments():
    cfg = LlamaConfig(**COMMON)
    with pytest.raises(ValueError, match="max_cache_len"):
        kh.KVCache(cfg, 0)
    with pytest.raises(TypeError, match="max_cache_len"):
        kh.KVCache(cfg, 4.0)
    with pytest.raises(TypeError, match="dtype"):
        kh.KVCache(cfg, 8, dtype="float32")
    with pytest.raises(ValueError, match="sliding_layers"):
        kh.KVCache(cfg, 8, sliding_layers="rings")


# ------------------------------------------------------------------ packaging


def test_importing_kvcache_does_not_import_transformers():
    code = "import sys, kvcache; assert 'transformers' not in sys.modules, 'imported'; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_registered_names_and_cache_arg():
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    assert AttentionInterface._global_mapping["kvcache"] is kh.kvcache_attention
    assert AttentionMaskInterface._global_mapping["kvcache"] is kh.kvcache_mask
    assert kh.CACHE_ARG in ("cache", "past_key_values")
