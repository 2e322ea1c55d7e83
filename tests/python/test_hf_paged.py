"""Continuous batching (``generate_batch``, ``ContinuousBatchingManager``) through ``paged|kvcache``.

Tiny random models: every request's tokens must equal its own greedy ``generate`` (eager / sdpa)
and ``paged|sdpa``'s, with prefix sharing on, chunked prefills (small ``max_batch_tokens``),
Gemma-3 sliding layers (window a multiple of the page and not), and without any gather of the
context (transformers' ``PagedAttentionCache`` read path is never called for full layers).
"""

from __future__ import annotations

import logging

import pytest
import torch

import kvcache  # noqa: F401  (loads the operators)

transformers = pytest.importorskip("transformers", reason="kvcache.hf needs Hugging Face transformers")
if not hasattr(torch.ops.kvcache, "paged_attend"):
    pytest.skip("this build of kvcache has no paged ops (torch.ops.kvcache.paged_attend)", allow_module_level=True)
cb_api = pytest.importorskip("transformers.generation.continuous_batching",
                             reason="the installed transformers has no continuous batching")

import kvcache.hf  # noqa: E402,F401
from kvcache.hf import paged as hf_paged  # noqa: E402
from transformers import GenerationConfig  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402
from transformers.generation.continuous_batching.cache_allocators import (  # noqa: E402
    FullAttentionCacheAllocator,
    SlidingAttentionCacheAllocator,
)

PAGE = 8
# transformers 5.24+ reads pages in place (its layers call the patched cache update); 5.18's attention
# function updates the cache itself and gathers the context, which paged|kvcache then reads.
IN_PLACE = hf_paged.IN_PLACE
needs_in_place = pytest.mark.skipif(not IN_PLACE, reason=f"transformers {transformers.__version__} gathers "
                                    "the context in its attention-level cache update (5.24+ reads pages in place)")


@pytest.fixture(autouse=True)
def _quiet():
    logger = logging.getLogger("ContinuousBatchingLogger")
    level = logger.level
    logger.setLevel(logging.ERROR)
    transformers.logging.set_verbosity_error()
    yield
    logger.setLevel(level)


def _no_eos(model):
    # Random weights: every request generates exactly max_new_tokens (no end-of-sequence token).
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None
    return model


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)
    return _no_eos(LlamaForCausalLM(cfg).eval())


def _gemma3(window: int):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(num_hidden_layers=3, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=256,
                           sliding_window=window,
                           layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    return _no_eos(Gemma3ForCausalLM(cfg).eval())


def _prompts(lengths, shared=None):
    g = torch.Generator().manual_seed(1)
    out = [torch.randint(3, 128, (n,), generator=g).tolist() for n in lengths]
    if shared is not None:  # a request sharing the first `shared` tokens of the longest prompt
        longest = max(out, key=len)
        out.append(longest[:shared] + [5, 6, 7])
    return out


def _gen_config(new_tokens):
    return GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)


def _cb_config(max_batch_tokens=32, sharing=True):
    return ContinuousBatchingConfig(page_size=PAGE, num_blocks=64, max_batch_tokens=max_batch_tokens,
                                    allow_block_sharing=sharing)


def _generate_batch(model, impl, prompts, new_tokens, **cb):
    model.set_attn_implementation(impl)
    out = model.generate_batch(prompts, generation_config=_gen_config(new_tokens),
                               continuous_batching_config=_cb_config(**cb), progress_bar=False)
    return [out[f"req_{i}"].generated_tokens for i in range(len(prompts))]


def _greedy(model, impl, prompts, new_tokens):
    model.set_attn_implementation(impl)
    gc = _gen_config(new_tokens)
    return [model.generate(torch.tensor([p]), generation_config=gc)[0, len(p):].tolist() for p in prompts]


class _Counts:
    """Counts the paged op calls and the steps' metadata builds (direct / gather)."""

    def __init__(self, monkeypatch):
        self.write = self.attend = self.direct = self.gather = 0
        write, attend, build = hf_paged.write_pages, hf_paged.attend_pages, hf_paged._build_step

        def count_write(*a, **k):
            self.write += 1
            return write(*a, **k)

        def count_attend(*a, **k):
            self.attend += 1
            return attend(*a, **k)

        def count_build(*a, **k):
            step = build(*a, **k)
            if step.gather:
                self.gather += 1
            else:
                self.direct += 1
            return step

        monkeypatch.setattr(hf_paged, "write_pages", count_write)
        monkeypatch.setattr(hf_paged, "attend_pages", count_attend)
        monkeypatch.setattr(hf_paged, "_build_step", count_build)


def test_llama_generate_batch_matches_greedy_and_paged_sdpa(monkeypatch):
    model = _llama()
    prompts = _prompts((5, 12, 27, 9, 1), shared=19)  # 2 shared blocks of 8; chunked prefill (32-token steps)
    counts = _Counts(monkeypatch)
    ours = _generate_batch(model, "kvcache", prompts, 12)
    assert model.config._attn_implementation == "kvcache"  # switched back after the manager stopped
    assert counts.attend > 0
    if IN_PLACE:
        assert counts.write == counts.attend and counts.gather == 0
    assert ours == _greedy(model, "sdpa", prompts, 12)
    assert ours == _generate_batch(model, "sdpa", prompts, 12)  # paged sdpa (index-based cache)


def test_compiled_steps_padded_batches(monkeypatch):
    """generate_batch with compile configs pads each step's queries to a fixed size (zero-length
    sequences after the real ones, trash write indices): paged|kvcache reads the padded batch and
    gives the tokens of per-request greedy generate (Dynamo's eager backend: the padding, not
    Inductor, is what this checks)."""
    from transformers.generation.configuration_utils import CompileConfig

    model = _llama()
    prompts = _prompts((5, 17, 9, 30))
    counts = _Counts(monkeypatch)
    cc = CompileConfig(backend="eager", fullgraph=False, dynamic=False)
    model.set_attn_implementation("kvcache")
    cfg = ContinuousBatchingConfig(page_size=PAGE, num_blocks=64, max_batch_tokens=32,
                                   varlen_compile_config=cc, decode_compile_config=cc)
    out = model.generate_batch(prompts, generation_config=_gen_config(10), continuous_batching_config=cfg,
                               progress_bar=False)
    ours = [out[f"req_{i}"].generated_tokens for i in range(len(prompts))]
    assert counts.attend > 0
    assert ours == _greedy(model, "sdpa", prompts, 10)


@needs_in_place
def test_llama_no_gather(monkeypatch):
    """No context is read back through transformers' cache: its update is never called, and each
    layer of each step is one write_pages and one attend_pages."""
    model = _llama()
    prompts = _prompts((6, 17), shared=9)

    def refuse(*a, **k):
        raise AssertionError("PagedAttentionCache's gather path was used")

    monkeypatch.setattr(FullAttentionCacheAllocator, "update", refuse)
    monkeypatch.setattr(hf_paged, "_orig_update", refuse)
    selects = []
    index_select = torch.index_select

    def spy_select(src, dim, index, *a, **k):
        selects.append(tuple(src.shape))
        return index_select(src, dim, index, *a, **k)

    monkeypatch.setattr(torch, "index_select", spy_select)
    counts = _Counts(monkeypatch)
    ours = _generate_batch(model, "kvcache", prompts, 6)
    num_layers = model.config.num_hidden_layers
    assert counts.direct > 0 and counts.gather == 0
    assert counts.attend == counts.write == counts.direct * num_layers  # one group: one build per step
    assert selects == []
    monkeypatch.undo()
    assert ours == _greedy(model, "sdpa", prompts, 6)


def test_mistral_window_passed_by_argument(monkeypatch):
    """Mistral passes its window to the attention function as an argument (its attention module has
    no sliding_window): prompts longer than the window, chunked prefill and decode give the tokens of
    per-request greedy generate (transformers 5.18 read the window from the module only, as 0)."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=128, max_position_embeddings=256, sliding_window=6)
    model = _no_eos(MistralForCausalLM(cfg).eval())
    prompts = _prompts((12, 3, 20))
    assert _generate_batch(model, "kvcache", prompts, 6, max_batch_tokens=16) == _greedy(model, "eager", prompts, 6)


@pytest.mark.parametrize("window", [16, 12])  # a multiple of the page size, and not (pages of gcd = 4)
def test_gemma3_sliding_generate_batch(monkeypatch, window):
    model = _gemma3(window)
    # prompts longer than the window (ring wraps in prefill and decode), chunked prefills
    prompts = _prompts((5, 13, 30, 41))
    counts = _Counts(monkeypatch)
    ours = _generate_batch(model, "kvcache", prompts, 20)
    assert counts.attend > 0
    if IN_PLACE:
        assert counts.direct > 0 and counts.gather > 0  # decode steps direct; a wrapping prefill chunk falls back
    assert ours == _greedy(model, "eager", prompts, 20)


@needs_in_place
def test_gemma3_decode_steps_gather_nothing(monkeypatch):
    """Once prefills are done, sliding and full layers read the ring / pages in place."""
    model = _gemma3(16)
    prompts = _prompts((3, 6))  # within the window: no step ever falls back
    sliding_updates = []
    orig = SlidingAttentionCacheAllocator.update
    monkeypatch.setattr(SlidingAttentionCacheAllocator, "update",
                        lambda self, *a, **k: sliding_updates.append(1) or orig(self, *a, **k))
    monkeypatch.setattr(FullAttentionCacheAllocator, "update",
                        lambda *a, **k: pytest.fail("full-attention gather path used"))
    counts = _Counts(monkeypatch)
    ours = _generate_batch(model, "kvcache", prompts, 24)  # decode far past the window
    assert sliding_updates == [] and counts.gather == 0
    monkeypatch.undo()
    assert ours == _greedy(model, "eager", prompts, 24)


def test_continuous_batching_manager():
    model = _llama()
    prompts = _prompts((7, 15))
    model.set_attn_implementation("kvcache")
    manager = model.init_continuous_batching(generation_config=_gen_config(5),
                                             continuous_batching_config=_cb_config())
    manager.start()
    try:
        ids = [manager.add_request(p, request_id=f"r{i}", max_new_tokens=5) for i, p in enumerate(prompts)]
        results = {}
        for _ in ids:
            r = manager.get_result(timeout=60)
            assert r is not None
            results[r.request_id] = r.generated_tokens
    finally:
        manager.stop(block=True, timeout=60)
    assert model.config._attn_implementation == "kvcache"
    assert [results[i] for i in ids] == _greedy(model, "sdpa", prompts, 5)


def test_plain_forward_unchanged():
    """Outside continuous batching the "kvcache" attention is the regular one, and the paged
    function falls back to it when called without a paged cache."""
    from transformers.modeling_utils import AttentionInterface

    assert AttentionInterface._global_mapping["kvcache"] is kvcache.hf.kvcache_attention
    assert AttentionInterface._global_mapping["paged|kvcache"] is hf_paged.paged_kvcache_attention
    model = _llama()
    ids = torch.tensor([_prompts((9,))[0]])
    with torch.no_grad():
        model.set_attn_implementation(hf_paged.CB_ATTN_IMPLEMENTATION)
        paged_fn = model(ids).logits
        model.set_attn_implementation("sdpa")
        torch.testing.assert_close(paged_fn, model(ids).logits, atol=1e-5, rtol=1e-4)


@needs_in_place
def test_steps_under_the_name_kvcache_stay_paged():
    """A manager that keeps stepping after the model's name went back to "kvcache" (stop(block=False)
    restores it while the loop still finishes its requests) still runs each step's paged call:
    the regular "kvcache" attention hands a prepared step to paged|kvcache instead of attending
    over the packed step as one sequence. (5.18 builds a packed-sequence mask for such a step,
    which kvcache_mask refuses: an error, not wrong tokens.)"""
    model = _llama()
    prompts = _prompts((5, 12, 27, 9))
    ref = _greedy(model, "sdpa", prompts, 6)
    model.set_attn_implementation("kvcache")
    manager = model.init_continuous_batching(generation_config=_gen_config(6),
                                             continuous_batching_config=_cb_config(max_batch_tokens=8))
    manager.start()
    try:
        manager.add_request(prompts[0], request_id="warm", max_new_tokens=2)
        assert manager.get_result(timeout=60) is not None
        model.set_attn_implementation("kvcache")  # what stop() restores mid-run
        ids = [manager.add_request(p, request_id=f"r{i}", max_new_tokens=6) for i, p in enumerate(prompts)]
        results = {}
        while len(results) < len(ids):
            r = manager.get_result(timeout=60)
            assert r is not None
            if r.is_finished():
                results[r.request_id] = r.generated_tokens
    finally:
        manager.stop(block=True, timeout=60)
    assert [results[i] for i in ids] == ref


def test_persistent_manager_refuses_another_attention():
    """A persistent manager built for "kvcache" allocated no attention mask; reused for sdpa it would
    attend without one (wrong tokens): a clear error instead, and a fresh manager works."""
    model = _llama()
    prompts = _prompts((5, 12))
    model.set_attn_implementation("kvcache")
    gc, cb = _gen_config(4), _cb_config()
    ours = model.generate_batch(prompts, generation_config=gc, continuous_batching_config=cb, progress_bar=False,
                                persistent_manager=True)
    model.set_attn_implementation("sdpa")
    try:
        with pytest.raises(ValueError, match="built for attn_implementation='kvcache' and cannot run the model as "
                                             "'sdpa'.*destroy_cached_continuous_batching_manager"):
            model.generate_batch(prompts, generation_config=gc, continuous_batching_config=cb, progress_bar=False,
                                 persistent_manager=True)
    finally:
        model.destroy_cached_continuous_batching_manager()
    sdpa = model.generate_batch(prompts, generation_config=gc, continuous_batching_config=cb, progress_bar=False)
    assert [ours[f"req_{i}"].generated_tokens for i in range(2)] == \
        [sdpa[f"req_{i}"].generated_tokens for i in range(2)]


def test_mla_model_refused_before_the_manager_runs():
    """A DeepSeek-V3 (MLA) model: transformers 5.25 pages its latents and expands them to keys of
    qk_head_dim and values of v_head_dim, which kvcache's paged attention cannot take. Refused in the
    caller's thread, before any step (a step's error is only logged by the manager's thread and every
    request comes back empty), with the model's attention left as it was."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    cfg = DeepseekV3Config(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                           num_hidden_layers=2, num_attention_heads=4, qk_nope_head_dim=16, qk_rope_head_dim=8,
                           v_head_dim=16, kv_lora_rank=16, q_lora_rank=None, n_routed_experts=4,
                           num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1,
                           max_position_embeddings=256)
    model = _no_eos(DeepseekV3ForCausalLM(cfg).eval())
    for impl in ("kvcache", hf_paged.PAGED_ATTN_IMPLEMENTATION):
        model.set_attn_implementation(impl)
        before = model.config._attn_implementation  # transformers 5.25 drops the "paged|" of the second
        with pytest.raises(NotImplementedError, match=r"DeepseekV3Config has keys and values of different head "
                                                      r"sizes \(qk_head_dim=24, v_head_dim=16: MLA-style"):
            model.generate_batch(_prompts((5, 3)), generation_config=_gen_config(4),
                                 continuous_batching_config=_cb_config(), progress_bar=False)
        assert model.config._attn_implementation == before


def test_float64_model_refused_before_the_manager_runs():
    """paged_attend reads float32, bfloat16 and float16: a float64 model is refused when the manager
    is built, not inside a step (where every request came back FAILED and empty), and sdpa still
    serves it."""
    model = _llama().to(torch.float64)
    prompts = _prompts((5, 3))
    model.set_attn_implementation("kvcache")
    with pytest.raises(TypeError, match=r"kvcache's paged attention runs float32, bfloat16 and float16 models; this "
                                        r"model is torch.float64: convert it"):
        model.generate_batch(prompts, generation_config=_gen_config(4), continuous_batching_config=_cb_config(),
                             progress_bar=False)
    assert model.config._attn_implementation == "kvcache"
    assert _generate_batch(model, "sdpa", prompts, 4) == _greedy(model, "sdpa", prompts, 4)


@pytest.mark.parametrize("name", [hf_paged.CB_ATTN_IMPLEMENTATION, hf_paged.PAGED_ATTN_IMPLEMENTATION])
def test_paged_names_honour_padding_outside_a_step(name):
    """Under the continuous-batching names (kept by init_continuous_batching() then stop() without
    start()), a regular padded generate builds kvcache's masks: left padding is honoured."""
    model = _llama()
    prompts = _prompts((3, 9, 6))
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    gc = _gen_config(5)
    model.set_attn_implementation("sdpa")
    ref = model.generate(ids, attention_mask=mask, generation_config=gc)
    model.set_attn_implementation(name)
    assert torch.equal(model.generate(ids, attention_mask=mask, generation_config=gc), ref)
