"""attend over token-major caches: (batch, max_len, kv_heads, head_dim) memory viewed as
(batch, kv_heads, max_len, head_dim), each slot's KV heads side by side as in pages. Tasks of few
query rows take every KV head of their row (Plan::heads, as paged tasks do) and walk the heads
piece by piece; these tests hold that path to the float64 reference with every option it meets:
GQA ratios, head_dim on and off the vector lanes (keys read in place or widened), kv_start (left
padding), windows, softcaps, short chunks, splits of long rows over threads, int8 / fp8 caches.
Unused slots are poisoned (NaN / Inf): the kernel never reads them.
"""

from __future__ import annotations

import pytest
import torch

import kvcache
from kv_testing import forced_split
from references import assert_close
from references import attention_reference as reference
from test_attend import check

# (batch, heads, kv_heads, seq, head_dim, max_len, lengths): decode and chunks short enough to be
# grouped (heads x seq <= 64 rows), GQA 1..4, head_dim 12 (widened), 64, 80, 128.
SHAPES = [
    (2, 9, 3, 1, 64, 300, [300, 37]),
    (3, 8, 2, 1, 128, 700, [700, 65, 129]),  # block edges
    (2, 6, 6, 1, 80, 200, [1, 200]),  # group 1
    (2, 8, 2, 3, 64, 150, [150, 3]),  # a short chunk, lengths == seq
    (1, 16, 4, 4, 64, 500, [333]),  # 64 rows: the most a grouped task takes
    (2, 6, 3, 2, 12, 90, [90, 41]),  # head_dim off the lanes: keys and values widened
]


def shape_id(shape):
    b, h, kvh, s, d, T, lengths = shape
    return f"b{b}-h{h}-kv{kvh}-s{s}-d{d}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_matches_reference(shape, dtype):
    b, h, kvh, s, d, T, lengths = shape
    check(b, h, kvh, s, d, T, lengths, dtype, kv_layout="transposed")


@pytest.mark.parametrize("opts", [
    dict(window=17),
    dict(window=1),
    dict(softcap=5.0),
    dict(kv_start=[3, 0]),
    dict(kv_start=[290, 10], window=9, softcap=2.0),
], ids=lambda o: "-".join(f"{k}{v}" for k, v in o.items()))
@pytest.mark.parametrize("seq", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_options(opts, seq, dtype):
    """Windows, softcaps and left padding on grouped tasks; bf16 on AVX512-BF16 reads each block
    by its slots' addresses (grouped_block_bf16), fp32 run by run."""
    check(2, 9, 3, seq, 64, 300, [300, 140], dtype, kv_layout="transposed", **opts)


@pytest.mark.parametrize("seq", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_split_rows(seq, dtype):
    """A long row split over two threads (blocks of 64 slots): the grouped parts merge per head."""
    with forced_split():
        check(1, 9, 3, seq, 64, 1000, [1000], dtype, kv_layout="transposed", window=700)
        check(2, 8, 4, seq, 128, 600, [600, 300], dtype, kv_layout="transposed", kv_start=[5, 0])


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16], ids=str)
def test_quantized(kv_dtype, qdtype):
    """int8 / fp8 token-major data with (batch, kv_heads, max_len) scales: against the float64
    reference over the dequantized cache."""
    g = torch.Generator().manual_seed(3)
    b, h, kvh, T, d = 2, 9, 3, 260, 64
    lengths = torch.tensor([260, 77], dtype=torch.int32)
    if kv_dtype == torch.int8:
        kq = torch.randint(-127, 128, (b, T, kvh, d), generator=g, dtype=torch.int8)
        vq = torch.randint(-127, 128, (b, T, kvh, d), generator=g, dtype=torch.int8)
    else:
        kq = torch.randn(b, T, kvh, d, generator=g).to(kv_dtype)
        vq = torch.randn(b, T, kvh, d, generator=g).to(kv_dtype)
    ks = torch.rand(b, kvh, T, generator=g) * 0.02 + 0.001
    vs = torch.rand(b, kvh, T, generator=g) * 0.02 + 0.001
    keys, values = kq.transpose(1, 2), vq.transpose(1, 2)
    q = torch.randn(b, h, 1, d, generator=g).to(qdtype)
    out = torch.ops.kvcache.attend(q, keys, values, lengths, k_scale=ks, v_scale=vs)
    kd = keys.double() * ks.double()[..., None]
    vd = values.double() * vs.double()[..., None]
    assert_close(out, reference(q, kd, vd, lengths), qdtype)
    with forced_split():
        split = torch.ops.kvcache.attend(q, keys, values, lengths, k_scale=ks, v_scale=vs)
    assert_close(split, reference(q, kd, vd, lengths), qdtype)


def test_grouped_equals_head_major():
    """The same values in head-major and token-major memory give the same output (to float32
    rounding: the order of the sums within a slot is the same, the blocks are the same)."""
    g = torch.Generator().manual_seed(5)
    k = torch.randn(3, 400, 3, 64, generator=g)
    v = torch.randn(3, 400, 3, 64, generator=g)
    q = torch.randn(3, 9, 1, 64, generator=g)
    lengths = torch.tensor([400, 1, 222], dtype=torch.int32)
    tm = kvcache.attend(q, kvcache.KVLayerCache(k.transpose(1, 2), v.transpose(1, 2), lengths))
    hm = kvcache.attend(q, kvcache.KVLayerCache(k.transpose(1, 2).contiguous(),
                                                v.transpose(1, 2).contiguous(), lengths))
    torch.testing.assert_close(tm, hm, atol=1e-6, rtol=1e-5)
