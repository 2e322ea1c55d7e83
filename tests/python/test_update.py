"""update_kv_layer_cache and the update ops against plain-PyTorch slicing."""

from __future__ import annotations

import pytest
import torch

import kvcache

from kv_testing import ALL_DTYPES, assert_same, filled_cache, random_kv, random_tensor
from kv_testing import device  # noqa: F401  (the device fixture)
from references import update_reference as reference_update

B, H, T, D = 2, 3, 16, 8


def make_cache(dtype=torch.float32, b=B, h=H, t=T, d=D, device="cpu"):
    return filled_cache(b, h, t, d, dtype, device)


def new_kv(chunk, dtype=torch.float32, b=B, h=H, d=D, seed=0, device="cpu"):
    return random_kv(b, h, chunk, d, dtype, device, seed=seed)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("start,chunk", [(0, 1), (5, 3), (0, T), (T - 1, 1), (7, 0)])
def test_update_int_start_all_dtypes(dtype, start, chunk, device):
    cache = make_cache(dtype, device=device)
    kn, vn = new_kv(chunk, dtype, device=device)
    exp_k, exp_v = reference_update(cache.keys, cache.values, kn, vn, start)
    out = kvcache.update_kv_layer_cache(cache, kn, vn, start)
    assert_same(cache.keys, exp_k)
    assert_same(cache.values, exp_v)
    assert out.keys is cache.keys and out.values is cache.values  # in place, shared
    assert out.length.dtype == torch.int32 and out.length.shape == ()
    assert int(out.length) == start + chunk


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.bool])
@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64])
def test_update_tensor_start_scalar(dtype, pos_dtype, device):
    cache = make_cache(dtype, device=device)
    kn, vn = new_kv(4, dtype, device=device)
    exp_k, exp_v = reference_update(cache.keys, cache.values, kn, vn, 6)
    out = kvcache.update_kv_layer_cache(cache, kn, vn, torch.tensor(6, dtype=pos_dtype, device=device))
    assert_same(cache.keys, exp_k)
    assert_same(cache.values, exp_v)
    assert out.length.dtype == torch.int32 and out.length.shape == ()
    assert int(out.length) == 10


@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64])
def test_update_ragged_positions(pos_dtype, device):
    b = 4
    cache = make_cache(b=b, device=device)
    kn, vn = new_kv(3, b=b, device=device)
    starts = [0, 5, 13, 9]
    exp_k, exp_v = reference_update(cache.keys, cache.values, kn, vn, starts)
    out = kvcache.update_kv_layer_cache(cache, kn, vn, torch.tensor(starts, dtype=pos_dtype, device=device))
    assert_same(cache.keys, exp_k)
    assert_same(cache.values, exp_v)
    assert out.length.dtype == torch.int32
    assert out.length.tolist() == [s + 3 for s in starts]


def test_update_positions_non_contiguous():
    b = 3
    cache = make_cache(b=b)
    kn, vn = new_kv(2, b=b)
    pos = torch.tensor([[4, 0], [1, 0], [9, 0]])[:, 0]  # stride 2
    assert not pos.is_contiguous()
    exp_k, exp_v = reference_update(cache.keys, cache.values, kn, vn, [4, 1, 9])
    kvcache.update_kv_layer_cache(cache, kn, vn, pos)
    assert_same(cache.keys, exp_k)
    assert_same(cache.values, exp_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int8])
def test_update_transposed_inputs(dtype):
    """keys_new as a (batch, chunk, heads, head_dim) tensor transposed to the cache layout."""
    cache = make_cache(dtype)
    k_bthd = random_tensor((B, 5, H, D), dtype, seed=3)
    v_bthd = random_tensor((B, 5, H, D), dtype, seed=4)
    kn, vn = k_bthd.transpose(1, 2), v_bthd.transpose(1, 2)
    assert not kn.is_contiguous()
    exp_k, exp_v = reference_update(cache.keys, cache.values, kn, vn, 2)
    kvcache.update_kv_layer_cache(cache, kn, vn, 2)
    assert_same(cache.keys, exp_k)
    assert_same(cache.values, exp_v)


def test_update_inputs_with_strided_head_dim():
    """head_dim not contiguous: the element-by-element path."""
    cache = make_cache()
    big_k = random_tensor((B, H, 4, 2 * D), torch.float32, seed=5)
    big_v = random_tensor((B, H, 4, 2 * D), torch.float32, seed=6)
    kn, vn = big_k[..., ::2], big_v[..., 1::2]
    exp_k, exp_v = reference_update(cache.keys, cache.values, kn, vn, 3)
    kvcache.update_kv_layer_cache(cache, kn, vn, 3)
    assert_same(cache.keys, exp_k)
    assert_same(cache.values, exp_v)


def test_update_expanded_inputs():
    """A broadcast (stride-0) source is fine: only the destination must not self-overlap."""
    cache = make_cache()
    kn = torch.arange(D, dtype=torch.float32).expand(B, H, 2, D)
    vn = -kn
    exp_k, exp_v = reference_update(cache.keys, cache.values, kn, vn, 0)
    kvcache.update_kv_layer_cache(cache, kn, vn, 0)
    assert_same(cache.keys, exp_k)
    assert_same(cache.values, exp_v)


@pytest.mark.parametrize("layout", ["bthd", "slice_of_bigger", "head_dim_strided", "fused_kv"])
def test_update_strided_caches(layout):
    """Caches that are views: a (batch, max_len, heads, head_dim) buffer, a slice, a strided head_dim."""
    if layout == "bthd":
        keys = random_tensor((B, T, H, D), torch.float32, seed=7).transpose(1, 2)
        values = random_tensor((B, T, H, D), torch.float32, seed=8).transpose(1, 2)
    elif layout == "slice_of_bigger":
        keys = random_tensor((B + 1, H + 2, T + 4, D), torch.float32, seed=7)[1:, 1:-1, 2:-2]
        values = random_tensor((B + 1, H + 2, T + 4, D), torch.float32, seed=8)[1:, 1:-1, 2:-2]
    elif layout == "fused_kv":
        # One (batch, heads, max_len, 2, head_dim) buffer holding keys and values interleaved.
        fused = random_tensor((B, H, T, 2, D), torch.float32, seed=7)
        keys, values = fused[..., 0, :], fused[..., 1, :]
    else:
        keys = random_tensor((B, H, T, 2 * D), torch.float32, seed=7)[..., ::2]
        values = random_tensor((B, H, T, 2 * D), torch.float32, seed=8)[..., 1::2]
    assert keys.shape == (B, H, T, D) and not keys.is_contiguous()
    base_k = keys._base
    base_k_before = base_k.clone()
    kn, vn = new_kv(3)
    exp_k, exp_v = reference_update(keys, values, kn, vn, 11)
    cache = kvcache.KVLayerCache(keys, values, torch.zeros((), dtype=torch.int32))
    kvcache.update_kv_layer_cache(cache, kn, vn, 11)
    assert_same(keys, exp_k)
    assert_same(values, exp_v)
    # Memory of the base buffer outside the view is untouched.
    mask = torch.ones_like(base_k, dtype=torch.bool)
    for view in (keys, values):
        if view._base is base_k:
            mask.as_strided(view.shape, view.stride(), view.storage_offset()).fill_(False)
    assert torch.equal(base_k[mask], base_k_before[mask])


def test_update_ops_directly():
    cache = make_cache()
    kn, vn = new_kv(2)
    exp_k, exp_v = reference_update(cache.keys, cache.values, kn, vn, 4)
    length = torch.ops.kvcache.update_(cache.keys, cache.values, kn, vn, 4)
    assert length.dtype == torch.int32 and length.shape == () and int(length) == 6
    assert_same(cache.keys, exp_k)
    assert_same(cache.values, exp_v)
    kn2, vn2 = new_kv(1, seed=9)
    exp_k, exp_v = reference_update(cache.keys, cache.values, kn2, vn2, [7, 2])
    positions = torch.tensor([7, 2])
    length = torch.ops.kvcache.update_(cache.keys, cache.values, kn2, vn2, positions)
    assert length.dtype == torch.int32 and length.tolist() == [8, 3]
    assert length.data_ptr() != positions.data_ptr()  # a new tensor, aliasing no input
    assert_same(cache.keys, exp_k)
    assert_same(cache.values, exp_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tensor_pos", [False, True])
def test_prefill_then_many_decode_steps(dtype, tensor_pos):
    """A prefill chunk then single-token steps; equal to the reference after every step."""
    b, h, d, max_len, prompt = 2, 4, 16, 64, 11
    cache = kvcache.init_kv_layer_cache(b, h, d, max_len, dtype)
    ref_k = torch.zeros(b, h, max_len, d, dtype=dtype)
    ref_v = torch.zeros_like(ref_k)
    kn, vn = new_kv(prompt, dtype, b=b, h=h, d=d, seed=1)
    cache = kvcache.update_kv_layer_cache(cache, kn, vn, torch.tensor(0) if tensor_pos else 0)
    ref_k[:, :, :prompt] = kn
    ref_v[:, :, :prompt] = vn
    assert int(cache.length) == prompt
    for step in range(max_len - prompt):
        pos = prompt + step
        kn, vn = new_kv(1, dtype, b=b, h=h, d=d, seed=100 + step)
        start = cache.length if tensor_pos else pos
        cache = kvcache.update_kv_layer_cache(cache, kn, vn, start)
        ref_k[:, :, pos : pos + 1] = kn
        ref_v[:, :, pos : pos + 1] = vn
        assert_same(cache.keys, ref_k)
        assert_same(cache.values, ref_v)
        assert int(cache.length) == pos + 1
    with pytest.raises(ValueError, match=f"KV cache overflow: end={max_len + 1} exceeds max_len={max_len}"):
        kvcache.update_kv_layer_cache(cache, kn, vn, max_len)


def test_ragged_decode_steps():
    """Rows at different positions advance together with a (batch,) position tensor."""
    b, h, d, max_len = 3, 2, 4, 32
    cache = kvcache.init_kv_layer_cache(b, h, d, max_len, torch.float32)
    ref_k = torch.zeros(b, h, max_len, d)
    ref_v = torch.zeros_like(ref_k)
    pos = torch.tensor([0, 4, 9], dtype=torch.int32)
    for step in range(10):
        kn, vn = new_kv(1, b=b, h=h, d=d, seed=step)
        cache = kvcache.update_kv_layer_cache(cache, kn, vn, pos)
        for r in range(b):
            p = int(pos[r])
            ref_k[r, :, p] = kn[r, :, 0]
            ref_v[r, :, p] = vn[r, :, 0]
        assert_same(cache.keys, ref_k)
        assert_same(cache.values, ref_v)
        assert cache.length.tolist() == (pos + 1).tolist()
        pos = cache.length


@pytest.mark.parametrize("threads", [2, 3, 8])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_large_parallel_update(threads, layout):
    """Big enough (about 10 MiB) to take the multi-threaded path: the caller and helper threads
    take uneven tasks (128 slabs of 75 KiB, 3 per task) from one counter, per-row starts included."""
    b, h, t, d = 4, 16, 512, 64
    if layout == "contiguous":
        keys, values = torch.zeros(b, h, t, d), torch.zeros(b, h, t, d)
    else:  # (batch, seq, heads, head_dim) storage
        keys, values = torch.zeros(b, t, h, d).transpose(1, 2), torch.zeros(b, t, h, d).transpose(1, 2)
    keys.copy_(random_tensor(keys.shape, torch.float32, seed=3))
    values.copy_(random_tensor(values.shape, torch.float32, seed=4))
    kn, vn = new_kv(300, b=b, h=h, d=d)
    starts = torch.tensor([100, 0, 212, 7])
    ref_k, ref_v = keys.clone(), values.clone()
    for r, s in enumerate(starts.tolist()):
        ref_k[r, :, s : s + 300] = kn[r]
        ref_v[r, :, s : s + 300] = vn[r]
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = torch.ops.kvcache.update_.Tensor(keys, values, kn, vn, starts)
    finally:
        torch.set_num_threads(saved)
    assert_same(keys, ref_k)
    assert_same(values, ref_v)
    assert out.tolist() == (starts + 300).tolist()


def test_numpy_int_start_accepted():
    import numpy as np

    cache = make_cache()
    kn, vn = new_kv(1)
    exp_k, exp_v = reference_update(cache.keys, cache.values, kn, vn, 3)
    out = kvcache.update_kv_layer_cache(cache, kn, vn, np.int64(3))
    assert_same(cache.keys, exp_k)
    assert int(out.length) == 4
