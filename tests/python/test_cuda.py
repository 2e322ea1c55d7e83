"""CUDA: the CPU tests' checks on the GPU, CUDA graphs, opcheck, compile. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

import kvcache

from conftest import ALL_DTYPES, assert_same, filled_cache, random_kv, random_tensor, reference_update

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and kvcache.build_info()["with_cuda"]),
    reason="needs a GPU and a CUDA build of kvcache",
)
DEV = torch.device("cuda")
B, H, T, D = 2, 3, 64, 64


def cache_on_gpu(dtype=torch.float32, b=B, h=H, t=T, d=D):
    return filled_cache(b, h, t, d, dtype, DEV, seed=10)


def new_kv(chunk, dtype=torch.float32, b=B, h=H, d=D, seed=0):
    return random_kv(b, h, chunk, d, dtype, DEV, seed=seed)


def test_init_on_cuda():
    c = kvcache.init_kv_layer_cache(2, 3, 8, 16, torch.bfloat16, device="cuda")
    assert c.keys.is_cuda and c.values.is_cuda and c.length.is_cuda
    assert torch.count_nonzero(c.keys) == 0 and c.length.dtype == torch.int32


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("start,chunk", [(0, 1), (5, 3), (0, T), (T - 1, 1), (7, 0), (3, 37)])
def test_update_int_start_all_dtypes(dtype, start, chunk):
    c = cache_on_gpu(dtype)
    kn, vn = new_kv(chunk, dtype)
    ek, ev = reference_update(c.keys, c.values, kn, vn, start)
    out = kvcache.update_kv_layer_cache(c, kn, vn, start)
    assert_same(c.keys, ek)
    assert_same(c.values, ev)
    assert int(out.length) == start + chunk


@pytest.mark.parametrize("head_dim", [64, 128, 7, 1])  # 16-byte, 8/4/2-byte and element units
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_update_unit_sizes(head_dim, dtype):
    c = cache_on_gpu(dtype, d=head_dim)
    kn, vn = new_kv(5, dtype, d=head_dim)
    ek, ev = reference_update(c.keys, c.values, kn, vn, 9)
    kvcache.update_kv_layer_cache(c, kn, vn, 9)
    assert_same(c.keys, ek)
    assert_same(c.values, ev)


def test_update_misaligned_and_strided():
    # keys_new starting one element into its storage: not 16-byte aligned
    flat = random_tensor((B * H * 4 * D + 1,), torch.float16, DEV, seed=3)
    kn = flat[1:].view(B, H, 4, D)
    vn = random_tensor((B, 4, H, D), torch.float16, DEV, seed=4).transpose(1, 2)
    keys = random_tensor((B, T, H, D), torch.float16, DEV, seed=5).transpose(1, 2)
    values = random_tensor((B, H, T, 2 * D), torch.float16, DEV, seed=6)[..., ::2]
    ek, ev = reference_update(keys, values, kn, vn, 20)
    kvcache.update_kv_layer_cache(kvcache.KVLayerCache(keys, values, torch.zeros((), dtype=torch.int32, device=DEV)), kn, vn, 20)
    assert_same(keys, ek)
    assert_same(values, ev)


@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64])
def test_ragged_positions(pos_dtype):
    c = cache_on_gpu(b=4)
    kn, vn = new_kv(3, b=4)
    starts = [0, 5, 61, 30]
    ek, ev = reference_update(c.keys, c.values, kn, vn, starts)
    out = kvcache.update_kv_layer_cache(c, kn, vn, torch.tensor(starts, dtype=pos_dtype, device=DEV))
    assert_same(c.keys, ek)
    assert_same(c.values, ev)
    assert out.length.tolist() == [s + 3 for s in starts]


def test_host_start_errors_write_nothing():
    c = cache_on_gpu()
    k0, v0 = c.keys.clone(), c.values.clone()
    kn, vn = new_kv(3)
    with pytest.raises(ValueError, match=f"KV cache overflow: end={T + 1} exceeds max_len={T}"):
        kvcache.update_kv_layer_cache(c, kn, vn, T - 2)
    with pytest.raises(TypeError, match="keys_new must have the cache dtype"):
        kvcache.update_kv_layer_cache(c, kn.half(), vn, 0)
    with pytest.raises(ValueError, match=r"keys_new must be on the cache's device \(cuda:0\), got cpu"):
        kvcache.update_kv_layer_cache(c, kn.cpu(), vn, 0)
    with pytest.raises(ValueError, match=r"positions must be on the cache's device"):
        kvcache.update_kv_layer_cache(c, kn, vn, torch.tensor(0))
    assert torch.equal(c.keys, k0) and torch.equal(c.values, v0)


def test_out_of_range_device_positions_write_nothing():
    """Documented CUDA behaviour: no host sync, no error, no write at all; length shows it."""
    c = cache_on_gpu()
    k0, v0 = c.keys.clone(), c.values.clone()
    kn, vn = new_kv(3)
    for bad in ([0, T - 2], [-1, 0], [T, T]):
        out = kvcache.update_kv_layer_cache(c, kn, vn, torch.tensor(bad, device=DEV))
        torch.cuda.synchronize()
        assert torch.equal(c.keys, k0) and torch.equal(c.values, v0), bad
        assert not bool((out.length <= c.max_len).all() & (out.length >= 3).all())


def test_cuda_graph_replay_with_advancing_position():
    c = kvcache.init_kv_layer_cache(B, H, D, T, torch.float32, device=DEV)
    kn = torch.empty(B, H, 1, D, device=DEV)
    vn = torch.empty(B, H, 1, D, device=DEV)
    pos = torch.zeros((), dtype=torch.int64, device=DEV)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.ops.kvcache.update_at_(c.keys, c.values, kn, vn, pos)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.ops.kvcache.update_at_(c.keys, c.values, kn, vn, pos)
    c.keys.zero_()
    c.values.zero_()
    ref_k = torch.zeros_like(c.keys)
    ref_v = torch.zeros_like(c.values)
    for step in range(T):
        kn.copy_(torch.randn(B, H, 1, D, device=DEV))
        vn.copy_(torch.randn(B, H, 1, D, device=DEV))
        pos.fill_(step)
        graph.replay()
        ref_k[:, :, step : step + 1] = kn
        ref_v[:, :, step : step + 1] = vn
    assert torch.equal(c.keys, ref_k) and torch.equal(c.values, ref_v)
    # past the end inside the graph: nothing is written, nothing out of bounds
    before = c.keys.clone()
    pos.fill_(T)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(c.keys, before)


def test_large_cache_64bit_offsets():
    """A cache over 2**31 elements: the last positions are written correctly."""
    b, h, t, d = 1, 16, 2**21 + 8, 64  # 2**31 + 8192 int8 elements (2 GiB per buffer)
    keys = torch.zeros(b, h, t, d, dtype=torch.int8, device=DEV)
    values = torch.zeros_like(keys)
    kn = torch.randint(-100, 100, (b, h, 2, d), dtype=torch.int8, device=DEV)
    vn = torch.randint(-100, 100, (b, h, 2, d), dtype=torch.int8, device=DEV)
    torch.ops.kvcache.update_(keys, values, kn, vn, t - 2)
    assert torch.equal(keys[:, :, t - 2 :], kn) and torch.equal(values[:, :, t - 2 :], vn)
    assert torch.count_nonzero(keys[:, :, : t - 2]) == 0
    del keys, values


@pytest.mark.parametrize("op", ["update_", "update_at_"])
def test_opcheck_cuda(op):
    keys = torch.zeros(2, 3, 16, 8, device=DEV, dtype=torch.bfloat16)
    values = torch.zeros_like(keys)
    kn = torch.randn(2, 3, 4, 8, device=DEV).bfloat16()
    vn = torch.randn(2, 3, 4, 8, device=DEV).bfloat16()
    start = 5 if op == "update_" else torch.tensor([1, 9], device=DEV)
    result = opcheck(getattr(torch.ops.kvcache, op).default, (keys, values, kn, vn, start))
    assert all(v == "SUCCESS" for v in result.values()), result
    result = opcheck(torch.ops.kvcache.init_layer_cache.default, (1, 2, 4, 8), {"dtype": torch.float16, "device": DEV})
    assert all(v == "SUCCESS" for v in result.values()), result


@torch.no_grad()
def test_compile_reduce_overhead_decode_step():
    from kvcache.models import Decoder, greedy_generate

    cfg = kvcache.TransformerConfig(num_layers=2, num_heads=8, d_model=64, max_len=64, num_kv_heads=2)
    model = Decoder(cfg, seed=0).to(DEV).eval()
    prompt = torch.randint(0, cfg.vocab_size, (2, 6), device=DEV)
    ref_tokens, _ = greedy_generate(
        model, prompt, 20, list(kvcache.init_decoder_kv_caches_from_config(cfg, batch_size=2, device=DEV))
    )
    torch._dynamo.reset()

    def step(tokens, start, caches):
        return model(tokens, start, caches)

    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    caches = list(kvcache.init_decoder_kv_caches_from_config(cfg, batch_size=2, device=DEV))
    logits, caches = model(prompt, torch.zeros((), dtype=torch.int32, device=DEV), caches)
    tok = logits[:, -1].argmax(-1)
    tokens = [tok]
    pos = torch.tensor(6, dtype=torch.int32, device=DEV)
    for i in range(19):
        logits, caches = compiled(tok[:, None], pos, caches)
        tok = logits[:, 0].argmax(-1).clone()  # outputs of a CUDA graph are overwritten by the next replay
        tokens.append(tok)
        pos = pos + 1
    assert torch.equal(torch.stack(tokens, 1), ref_tokens)
