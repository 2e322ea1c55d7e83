"""torch.compile: no graph break, no recompile as the position advances, no cache copy."""

from __future__ import annotations

import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import kvcache
from kvcache.models import Decoder, greedy_generate

CFG = kvcache.TransformerConfig(num_layers=2, num_heads=8, d_model=64, max_len=64, num_kv_heads=2)
BATCH = 2


def step(model, tokens, start, caches):
    return model(tokens, start, caches)


@pytest.fixture(scope="module")
def model():
    return Decoder(CFG, seed=3).eval()


def fresh_caches():
    return list(kvcache.init_decoder_kv_caches_from_config(CFG, batch_size=BATCH))


@torch.no_grad()
def test_compiled_generation_matches_eager_without_recompiles(model):
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)  # fullgraph: a graph break raises
    prompt = torch.randint(0, CFG.vocab_size, (BATCH, 6), generator=torch.Generator().manual_seed(0))

    # eager reference: prefill + 33 decode steps
    ref_tokens, ref_logits = greedy_generate(model, prompt, 34, fresh_caches())

    caches = fresh_caches()
    logits, caches = compiled(model, prompt, torch.tensor(0, dtype=torch.int32), caches)
    last = logits[:, -1]
    pos = torch.tensor(prompt.shape[1], dtype=torch.int32)
    tokens = [last.argmax(-1)]
    # first decode step compiles the decode graph; then 32 more with no recompilation
    logits, caches = compiled(model, tokens[-1][:, None], pos, caches)
    tokens.append(logits[:, 0].argmax(-1))
    torch.testing.assert_close(logits[:, 0], ref_logits[1], rtol=1e-4, atol=1e-4)
    pos = pos + 1
    with torch.compiler.set_stance("fail_on_recompile"):
        for _ in range(32):
            logits, caches = compiled(model, tokens[-1][:, None], pos, caches)
            tokens.append(logits[:, 0].argmax(-1))
            pos = pos + 1
    assert torch.equal(torch.stack(tokens, 1), ref_tokens)
    assert int(caches[0].length) == prompt.shape[1] + 33


@torch.no_grad()
def test_inductor_calls_op_on_whole_cache_buffers(model):
    """The generated code passes the graph-input buffers to the op: no clone, no copy-back."""
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    caches = fresh_caches()
    token = torch.zeros(BATCH, 1, dtype=torch.int64)
    before = [c.keys.data_ptr() for c in caches]
    (logits, new), codes = run_and_get_code(compiled, model, token, torch.tensor(3, dtype=torch.int32), caches)
    code = "\n".join(codes)
    calls = re.findall(r"torch\.ops\.kvcache\.update_\.Tensor\(([^,]+), ([^,]+),", code)
    assert len(calls) == CFG.num_layers, code
    for keys_arg, values_arg in calls:
        assert re.fullmatch(r"arg\d+_1", keys_arg) and re.fullmatch(r"arg\d+_1", values_arg), calls
    cache_shape = f"({BATCH}, {CFG.num_kv_heads}, {CFG.max_len}, {CFG.head_dim})"
    allocations = [line for line in code.splitlines() if "empty_strided" in line and cache_shape in line]
    assert not allocations, allocations  # no cache-sized buffer is ever allocated
    assert "aten.clone" not in code and ".clone(" not in code
    # and the write landed in the caller's buffers
    assert [c.keys.data_ptr() for c in new] == before
    assert torch.count_nonzero(caches[0].keys[:, :, 3]) > 0
    assert torch.count_nonzero(caches[0].keys[:, :, :3]) == 0


def test_compiled_update_int_start_is_dynamic():
    """A Python-int start becomes a SymInt: one recompile at most, then none."""
    torch._dynamo.reset()

    @torch.compile(fullgraph=True)
    def write(cache, k, v, start: int):
        return kvcache.update_kv_layer_cache(cache, k, v, start)

    cache = kvcache.init_kv_layer_cache(1, 2, 4, 16, torch.float32)
    k = torch.randn(1, 2, 1, 4)
    write(cache, k, -k, 0)
    write(cache, k, -k, 1)  # automatic dynamic shapes: the int becomes symbolic here
    with torch.compiler.set_stance("fail_on_recompile"):
        for pos in range(2, 16):
            k = torch.randn(1, 2, 1, 4)
            out = write(cache, k, -k, pos)
            assert torch.equal(cache.keys[:, :, pos], k[:, :, 0])
            assert torch.equal(cache.values[:, :, pos], -k[:, :, 0])
            assert int(out.length) == pos + 1


def test_compiled_overflow_raises_value_error():
    torch._dynamo.reset()

    @torch.compile(fullgraph=True)
    def write(cache, k, v):
        return kvcache.update_kv_layer_cache(cache, k, v, 15)

    cache = kvcache.init_kv_layer_cache(1, 2, 4, 16, torch.float32)
    k = torch.randn(1, 2, 2, 4)
    with pytest.raises(Exception, match="KV cache overflow: end=17 exceeds max_len=16"):
        write(cache, k, k)
    assert torch.count_nonzero(cache.keys) == 0


@torch.no_grad()
def test_inductor_quantized_writes_take_whole_buffers_and_scales():
    """The writes by format under Inductor: a quantized cache's and ring's writes (update_.Tensor, the
    traced append's append_returning_, the ring's update_.Tensor with positions, and the deprecated
    update_quantized_ alias, which
    decomposes into update_) get the graph-input buffers and scales themselves: no clone, no
    cache- or scale-sized allocation, and the bytes land in the caller's tensors."""
    torch._dynamo.reset()
    c = kvcache.init_kv_layer_cache(2, 2, 8, 16, torch.float32, kv_dtype="int8")
    c.length.fill_(3)
    r = kvcache.init_ring_layer_cache(2, 2, 8, 4, torch.float32, kv_dtype="int8")
    k, v = torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8)

    def write(c, r, k, v, s):
        out = kvcache.update_kv_layer_cache(c, k, v, s)
        kvcache.append_kv_layer_cache(c, k, v)
        ring = kvcache.update_ring_layer_cache(r, k, v, s)
        alias = torch.ops.kvcache.update_quantized_(c.keys, c.values, c.k_scale, c.v_scale, k, v, 9)
        return out.length, ring.length, alias

    eager_c = kvcache.KVLayerCache(*(t.clone() for t in (c.keys, c.values, c.length, c.k_scale, c.v_scale)))
    eager_r = kvcache.RingLayerCache(r.keys.clone(), r.values.clone(), r.positions.clone(), r.length.clone(),
                                     r.window, r.sinks, r.max_step, r.k_scale.clone(), r.v_scale.clone())
    s = torch.tensor([5, 6])
    want = write(eager_c, eager_r, k, v, s)
    got, codes = run_and_get_code(torch.compile(write, fullgraph=True), c, r, k, v, s)
    code = "\n".join(codes)
    calls = re.findall(r"torch\.ops\.kvcache\.(\w+)\.(\w+)\(([^)]*)\)", code)
    assert sorted((op, ov) for op, ov, _ in calls) == [("append_returning_", "default"), ("update_", "Tensor"),
                                                      ("update_", "Tensor"), ("update_", "default")], calls
    assert sum("positions=arg" in args for _, _, args in calls) == 1, calls  # the ring's write
    for _, _, args in calls:
        # every tensor argument (buffers, scales, positions) is a graph input, not a copy
        for a in re.findall(r"(?:=|\b)(buf\d+|arg\d+_1)\b", args):
            assert a.startswith("arg"), (args, code)
        assert "k_scale=arg" in args and "v_scale=arg" in args, args
    assert "aten.clone" not in code and ".clone(" not in code
    for shape in ("(2, 2, 16, 8)", "(2, 2, 16)", f"(2, 2, {r.capacity}, 8)", f"(2, 2, {r.capacity})"):
        assert not [line for line in code.splitlines() if "empty_strided" in line and shape in line], shape
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    for a, b in [(c.keys, eager_c.keys), (c.values, eager_c.values), (c.k_scale, eager_c.k_scale),
                 (c.v_scale, eager_c.v_scale), (c.length, eager_c.length), (r.keys, eager_r.keys),
                 (r.k_scale, eager_r.k_scale), (r.positions, eager_r.positions)]:
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.int8 else a,
                           b.view(torch.uint8) if b.dtype == torch.int8 else b)
