"""Paged caches (kvcache.paged): the slot-mapped write and the block-table attend against plain
PyTorch (indexing for the write, the float64 reference over each sequence's gathered slots for the
attend), the allocator, bad metadata refused before anything is read or written, traced paths."""

import contextlib
import os
import random
import subprocess
import sys

import pytest
import torch

import kvcache
from kvcache.paged import BlockAllocator, PagedKVCache, attend_pages, init_paged_cache, write_pages
from references import attention_reference
from test_ring_update_quantized import quantize_ref

HERE = os.path.dirname(os.path.abspath(__file__))


# ------------------------------------------------------------------ helpers ---

def random_layout(ctx, num_blocks, block_size, seed=0, share=False, pad=2):
    """A block table for sequences of ctx tokens over shuffled pages (-1 padded); with share,
    sequence 1 shares sequence 0's first page (a common prefix)."""
    rng = random.Random(seed)
    pages = list(range(num_blocks))
    rng.shuffle(pages)
    need = [-(-c // block_size) for c in ctx]
    width = max(need + [1]) + pad
    table = torch.full((len(ctx), width), -1, dtype=torch.int32)
    for s, n in enumerate(need):
        for j in range(n):
            if share and s == 1 and j == 0 and need[0] > 0:
                table[s, j] = table[0, 0]
            else:
                table[s, j] = pages.pop()
    return table


def gathered(pages, table, s, length):
    """(1, kv_heads, length, dim) of sequence s's positions, by plain indexing."""
    bs = pages.shape[1]
    pos = torch.arange(length)
    slots = table[s, pos // bs].long() * bs + pos % bs
    return pages.reshape(-1, *pages.shape[2:])[slots].permute(1, 0, 2).unsqueeze(0)


def reference(q, kp, vp, table, ctx, cu, **kw):
    out = torch.zeros(q.shape, dtype=torch.float64)
    for s in range(len(ctx)):
        a, e = int(cu[s]), int(cu[s + 1])
        if e == a:
            continue
        K, V = gathered(kp, table, s, int(ctx[s])), gathered(vp, table, s, int(ctx[s]))
        qs = q[a:e].permute(1, 0, 2).unsqueeze(0)
        out[a:e] = attention_reference(qs, K, V, torch.tensor(int(ctx[s])), **kw)[0].permute(1, 0, 2)
    return out


def dequantized(pages, scales):
    return pages.float() * scales[..., None]


def make_case(ctx, qlens, heads=4, kv_heads=2, dim=16, block_size=4, dtype=torch.float32, seed=0,
              share=False, extra_blocks=3):
    g = torch.Generator().manual_seed(seed)
    need = sum(-(-c // block_size) for c in ctx)
    nb = need + extra_blocks
    kp = torch.randn(nb, block_size, kv_heads, dim, generator=g).to(dtype)
    vp = torch.randn(nb, block_size, kv_heads, dim, generator=g).to(dtype)
    table = random_layout(ctx, nb, block_size, seed=seed, share=share)
    cu = torch.tensor([0] + list(torch.tensor(qlens).cumsum(0).tolist()), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), heads, dim, generator=g).to(dtype)
    return q, kp, vp, table, torch.tensor(ctx, dtype=torch.int32), cu


TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}


# ------------------------------------------------------------------- attend ---

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [1, 4, 16, 64, 128])
def test_attend_mixed_batch(dtype, block_size):
    """Prefill, decode and a chunk in one call, ragged lengths, shuffled pages, GQA."""
    ctx, qlens = [37, 1, 200, 130, 0], [37, 1, 1, 9, 0]
    q, kp, vp, table, lens, cu = make_case(ctx, qlens, block_size=block_size, dtype=dtype, dim=32)
    out = attend_pages(q, kp, vp, table, lens, cu)
    assert out.shape == q.shape and out.dtype == dtype
    ref = reference(q, kp, vp, table, lens, cu)
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("pad", [1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attend_padded_batch(dtype, pad):
    """q padded past the last sequence's queries (transformers' compiled / CUDA-graph steps, with
    zero-length sequences after the real ones): the padding rows come out 0, the others as the
    unpadded call gives them, against the float64 reference."""
    ctx, qlens = [37, 1, 20, 0, 0], [5, 1, 1, 0, 0]
    q, kp, vp, table, lens, cu = make_case(ctx, qlens, dtype=dtype)
    g = torch.Generator().manual_seed(7)
    qp = torch.cat([q, torch.randn(pad, *q.shape[1:], generator=g).to(dtype) * 1e30])
    out = attend_pages(qp, kp, vp, table, lens, cu, window=9)
    assert out.shape == qp.shape
    assert bool((out[q.shape[0]:] == 0).all())
    ref = reference(q, kp, vp, table, lens, cu, window=9)
    torch.testing.assert_close(out[: q.shape[0]].double(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    # Only padding: no sequence has a query.
    empty = torch.zeros(3, dtype=torch.int32)
    out = attend_pages(qp[:4], kp, vp, table[:2], lens[:2] * 0, empty)
    assert bool((out == 0).all())


def test_table_capacity_does_not_overflow():
    """A block table expand()-ed to 2**61 columns holds any int32 length: max_blocks * block_size
    (2**64) must not wrap around into a refusal."""
    q, kp, vp, table, lens, cu = make_case([5], [1], block_size=8)
    wide = table[:, :1].expand(1, 2 ** 61)
    out = attend_pages(q, kp, vp, wide, lens, cu)
    torch.testing.assert_close(out.double(), reference(q, kp, vp, table, lens, cu), atol=2e-5, rtol=2e-5)


def test_sequence_without_queries_reads_no_page():
    """A sequence with context but no query this step (a request that waits while others run)
    needs no page: its table row may be all -1, as on CUDA, and the others' outputs are unchanged."""
    ctx, qlens = [12, 32, 9], [3, 0, 2]
    q, kp, vp, table, lens, cu = make_case(ctx, qlens, seed=11)
    ref = reference(q, kp, vp, table, lens, cu)
    table[1] = -1
    out = attend_pages(q, kp, vp, table, lens, cu)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("opts", [dict(window=5), dict(softcap=3.0), dict(scale=0.3, window=70),
                                  dict(sink_logits=True), dict(softcap=2.0, window=17, sink_logits=True)])
def test_attend_options(opts):
    ctx, qlens = [90, 150, 3], [4, 1, 3]
    q, kp, vp, table, lens, cu = make_case(ctx, qlens, heads=6, kv_heads=3, dim=64, block_size=16,
                                           seed=3)
    if opts.pop("sink_logits", False):
        opts["sink_logits"] = torch.randn(6)
    out = attend_pages(q, kp, vp, table, lens, cu, **opts)
    ref = reference(q, kp, vp, table, lens, cu, **opts)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


def test_window_reads_only_visible_pages():
    """Pages that slid out of the window may be freed (-1) and hold NaN: never read."""
    ctx, qlens, bs = [100], [2], 8
    q, kp, vp, table, lens, cu = make_case(ctx, qlens, block_size=bs, seed=5)
    window = 20
    first_block = (100 - 2 - window + 1) // bs
    ref = reference(q, kp, vp, table, lens, cu, window=window)
    for j in range(first_block):
        kp[table[0, j]] = float("nan")
        vp[table[0, j]] = float("nan")
        table[0, j] = -1
    out = attend_pages(q, kp, vp, table, lens, cu, window=window)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


def test_shared_prefix_pages():
    ctx, qlens = [40, 33], [1, 2]
    q, kp, vp, table, lens, cu = make_case(ctx, qlens, block_size=16, share=True, seed=7)
    assert table[0, 0] == table[1, 0]
    out = attend_pages(q, kp, vp, table, lens, cu)
    torch.testing.assert_close(out.double(), reference(q, kp, vp, table, lens, cu), atol=2e-5,
                               rtol=2e-5)


def test_same_as_contiguous_attend():
    """Pages holding the same tokens as a contiguous cache give attend's result (decode)."""
    b, kvh, h, d, L, bs = 3, 2, 8, 64, 300, 16
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(b, kvh, L, d, generator=g)
    values = torch.randn(b, kvh, L, d, generator=g)
    nb = b * (L // bs + 1)
    perm = torch.randperm(nb, generator=g)
    table = perm[: b * (-(-L // bs))].view(b, -1).to(torch.int32)
    kp = torch.zeros(nb, bs, kvh, d)
    vp = torch.zeros(nb, bs, kvh, d)
    slots = (table.long()[:, torch.arange(L) // bs] * bs + torch.arange(L) % bs)
    kp.view(-1, kvh, d)[slots.reshape(-1)] = keys.permute(0, 2, 1, 3).reshape(-1, kvh, d)
    vp.view(-1, kvh, d)[slots.reshape(-1)] = values.permute(0, 2, 1, 3).reshape(-1, kvh, d)
    lengths = torch.tensor([L, 200, 77], dtype=torch.int32)
    q = torch.randn(b, h, 1, d, generator=g)
    cache = kvcache.KVLayerCache(keys, values, lengths)
    want = kvcache.attend(q, cache)
    got = attend_pages(q[:, :, 0], kp, vp, table, lengths, torch.arange(b + 1, dtype=torch.int32))
    torch.testing.assert_close(got, want[:, :, 0], atol=1e-5, rtol=1e-5)


def test_split_rows_with_threads():
    """A long sequence among short ones: rows split over threads, merged exactly."""
    from kv_testing import forced_split

    ctx, qlens = [3000, 5, 17], [1, 1, 1]
    q, kp, vp, table, lens, cu = make_case(ctx, qlens, dim=64, block_size=32, seed=11)
    ref = reference(q, kp, vp, table, lens, cu)
    with forced_split():
        out = attend_pages(q, kp, vp, table, lens, cu)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [1, 2, 8, 16])
@pytest.mark.parametrize("opts", [{}, dict(window=45), dict(window=21, softcap=5.0)])
@pytest.mark.parametrize("split", [False, True])
def test_decode_pieces_across_pages(dtype, block_size, opts, split):
    """Decode over pages smaller than the kernel's piece of a grouped task (SmolLM2's 9 / 3 heads,
    head_dim 64: every head's score and weight passes go page by page): lengths and windows that
    start and end mid-page, shuffled pages, rows split over tasks at block boundaries, against the
    float64 reference."""
    from kv_testing import forced_split

    ctx = [1, 15, 16, 17, 63, 64, 65, 200, 333]
    q, kp, vp, table, lens, cu = make_case(ctx, [1] * len(ctx), heads=9, kv_heads=3, dim=64,
                                           block_size=block_size, dtype=dtype, seed=block_size)
    ref = reference(q, kp, vp, table, lens, cu, **opts)
    with forced_split() if split else contextlib.nullcontext():
        out = attend_pages(q, kp, vp, table, lens, cu, **opts)
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [3, 16])
def test_attend_head_dim_off_the_lanes(dtype, block_size):
    """head_dim 12 (keys and values widened into scratch, not read in place): blocks that span pages
    are packed run by run; decode and chunk rows of 3 KV heads (tasks over all heads) and a prefill
    (one head a task) in one call."""
    ctx, qlens = [150, 70, 40], [1, 6, 40]
    q, kp, vp, table, lens, cu = make_case(ctx, qlens, heads=6, kv_heads=3, dim=12, block_size=block_size,
                                           dtype=dtype, seed=17)
    out = attend_pages(q, kp, vp, table, lens, cu, window=100)
    ref = reference(q, kp, vp, table, lens, cu, window=100)
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn])
def test_split_quantized_pages_over_all_heads(kv_dtype):
    """Decode rows over every KV head, split over threads, on quantized 8-slot pages: the parts
    of every head merged exactly, each run's scales on its own columns."""
    from kv_testing import forced_split

    ctx, qlens = [1000, 9, 300], [1, 1, 2]
    q, kp, vp, table, lens, cu = make_case(ctx, qlens, heads=8, kv_heads=4, dim=32, block_size=8, seed=19)
    kq, ks = quantize_ref(kp, kv_dtype)
    vq, vs = quantize_ref(vp, kv_dtype)
    ref = reference(q, dequantized(kq, ks), dequantized(vq, vs), table, lens, cu)
    with forced_split():
        out = attend_pages(q, kq, vq, table, lens, cu, key_scales=ks, value_scales=vs)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
def test_attend_quantized_pages(kv_dtype, qdtype):
    ctx, qlens = [70, 5, 129], [3, 1, 1]
    q, kp, vp, table, lens, cu = make_case(ctx, qlens, block_size=16, dim=64, seed=13)
    kq, ks = quantize_ref(kp, kv_dtype)
    vq, vs = quantize_ref(vp, kv_dtype)
    q = q.to(qdtype)
    out = attend_pages(q, kq, vq, table, lens, cu, key_scales=ks, value_scales=vs)
    ref = reference(q, dequantized(kq, ks), dequantized(vq, vs), table, lens, cu)
    tol = 2e-5 if qdtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dim", [64, 20])
@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
def test_fp8_nan_bytes_read_as_nan(dim, qdtype):
    """e4m3fn's NaN bytes (0x7f, 0xff), which our writes never produce but pages written elsewhere
    may hold, read as NaN (as torch's conversion reads them) in decode rows and in a prefill chunk:
    the rows that see one come out NaN, every other row as the reference."""
    ctx, qlens = [40, 9, 70, 33], [20, 1, 1, 2]
    q, kp, vp, table, lens, cu = make_case(ctx, qlens, block_size=16, dim=dim, seed=23)
    kq, ks = quantize_ref(kp, torch.float8_e4m3fn)
    vq, vs = quantize_ref(vp, torch.float8_e4m3fn)
    # Sequence 0's key at position 5 (KV head 1) and sequence 2's value at position 50 (KV head 0).
    kq.view(torch.uint8)[table[0, 0], 5, 1, dim - 1] = 0x7F
    vq.view(torch.uint8)[table[2, 50 // 16], 50 % 16, 0, 3] = 0xFF
    q = q.to(qdtype)
    ref = reference(q, dequantized(kq, ks), dequantized(vq, vs), table, lens, cu)
    assert ref.isnan().any() and not ref.isnan().all()
    out = attend_pages(q, kq, vq, table, lens, cu, key_scales=ks, value_scales=vs)
    tol = 2e-5 if qdtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol, equal_nan=True)


@pytest.mark.parametrize("block_size", [1, 5, 16, 48])
@pytest.mark.parametrize("kv_dtype", [None, torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("opts", [{}, dict(softcap=2.0, window=37, sink_logits=True)])
def test_attend_chunks_over_pages_smaller_than_a_block(block_size, kv_dtype, opts):
    """Prefill chunks (enough query rows for the GEMM loops) whose blocks span pages smaller than a
    kernel block (64 slots): each run of a block is gathered before the GEMMs; plain and quantized
    pages, with a window, softcap and sink logits; a chunk whose start is not page-aligned."""
    ctx, qlens = [150, 77, 40, 200], [70, 77, 1, 33]
    q, kp, vp, table, lens, cu = make_case(ctx, qlens, heads=6, kv_heads=3, dim=64, block_size=block_size,
                                           seed=23)
    opts = dict(opts)
    if opts.pop("sink_logits", False):
        opts["sink_logits"] = torch.randn(6, generator=torch.Generator().manual_seed(1))
    if kv_dtype is None:
        out = attend_pages(q, kp, vp, table, lens, cu, **opts)
        ref = reference(q, kp, vp, table, lens, cu, **opts)
    else:
        kq, ks = quantize_ref(kp, kv_dtype)
        vq, vs = quantize_ref(vp, kv_dtype)
        out = attend_pages(q, kq, vq, table, lens, cu, key_scales=ks, value_scales=vs, **opts)
        ref = reference(q, dequantized(kq, ks), dequantized(vq, vs), table, lens, cu, **opts)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


ISA_SCRIPT = """
import sys, torch
sys.path.insert(0, {here!r})
import kvcache, test_paged as t
assert kvcache._C.attend_cpu_isa() == {isa!r}
for dt in (torch.float32, torch.bfloat16, torch.float16):
    for bs in (8, 64):
        t.test_attend_mixed_batch(dt, bs)
t.test_attend_options(dict(softcap=2.0, window=17, sink_logits=True))
t.test_attend_quantized_pages(torch.int8, torch.bfloat16)
t.test_attend_quantized_pages(torch.float8_e4m3fn, torch.float32)
t.test_fp8_nan_bytes_read_as_nan(64, torch.float32)
t.test_fp8_nan_bytes_read_as_nan(20, torch.bfloat16)
"""


@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512", "avx512vnni", "avx512bf16"])
def test_forced_isa_path(isa):
    from test_attend import ISA_FLAGS, _cpu_flags

    if not ISA_FLAGS[isa] <= _cpu_flags():
        pytest.skip(f"this CPU lacks {sorted(ISA_FLAGS[isa] - _cpu_flags())}")
    env = dict(os.environ, KVCACHE_ATTEND_ISA=isa)
    proc = subprocess.run([sys.executable, "-c", ISA_SCRIPT.format(here=HERE, isa=isa)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


# -------------------------------------------------------------------- write ---

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_write_bit_exact(dtype, slot_dtype):
    nb, bs, kvh, d, n = 6, 4, 3, 8, 9
    c = init_paged_cache(nb, bs, kvh, d, dtype)
    g = torch.Generator().manual_seed(0)
    c.key_pages.copy_(torch.randn(c.key_pages.shape, generator=g))
    c.value_pages.copy_(torch.randn(c.value_pages.shape, generator=g))
    key = torch.randn(n, kvh, d, generator=g).to(dtype)
    # A non-contiguous value: every other head of a wider tensor.
    value = torch.randn(n, 2 * kvh, d, generator=g).to(dtype)[:, ::2]
    slots = torch.tensor([5, -1, 0, 23, 7, -1, 12, 1, 18], dtype=slot_dtype)
    want_k, want_v = c.key_pages.clone(), c.value_pages.clone()
    keep = slots >= 0
    want_k.view(-1, kvh, d)[slots[keep].long()] = key[keep]
    want_v.view(-1, kvh, d)[slots[keep].long()] = value[keep]
    c.write(key, value, slots)
    assert torch.equal(c.key_pages, want_k) and torch.equal(c.value_pages, want_v)


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_quantized(kv_dtype, src_dtype):
    nb, bs, kvh, d = 5, 4, 2, 16
    c = init_paged_cache(nb, bs, kvh, d, src_dtype, kv_dtype=kv_dtype)
    g = torch.Generator().manual_seed(1)
    key = (torch.randn(6, kvh, d, generator=g) * 3).to(src_dtype)
    value = torch.randn(6, kvh, d, generator=g).to(src_dtype)
    key[2, 1] = 0  # an all-zero slot keeps a positive scale
    slots = torch.tensor([3, 19, -1, 8, 0, 12])
    c.write(key, value, slots)
    keep = slots >= 0
    for pages, scales, src in ((c.key_pages, c.key_scales, key), (c.value_pages, c.value_scales, value)):
        q, s = quantize_ref(src[keep], kv_dtype)
        got_q = pages.view(-1, kvh, d)[slots[keep]]
        assert torch.equal(got_q.view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(scales.view(-1, kvh)[slots[keep]], s)


def test_write_then_attend_roundtrip_with_allocator():
    """Three requests joining and leaving: the allocator's slots, the write, the attend."""
    torch.manual_seed(0)
    kvh, h, d, bs = 2, 4, 32, 8
    alloc = BlockAllocator(num_blocks=32, block_size=bs)
    cache = init_paged_cache(32, bs, kvh, d, torch.float32)
    history = {}
    def step(batch):  # batch: {seq_id: n new tokens}
        ids = list(batch)
        slot_maps, keys, values, qs = [], [], [], []
        for s in ids:
            n = batch[s]
            slot_maps.append(alloc.append(s, n))
            k, v = torch.randn(n, kvh, d), torch.randn(n, kvh, d)
            hk, hv = history.get(s, (torch.zeros(0, kvh, d), torch.zeros(0, kvh, d)))
            history[s] = (torch.cat([hk, k]), torch.cat([hv, v]))
            keys.append(k), values.append(v), qs.append(torch.randn(n, h, d))
        cache.write(torch.cat(keys), torch.cat(values), torch.cat(slot_maps))
        cu = torch.tensor([0] + torch.tensor([batch[s] for s in ids]).cumsum(0).tolist(), dtype=torch.int32)
        out = cache.attend(torch.cat(qs), alloc.block_table(ids), alloc.context_lens(ids), cu)
        for i, s in enumerate(ids):
            K, V = history[s]
            qq = qs[i].permute(1, 0, 2).unsqueeze(0)
            ref = attention_reference(qq, K.permute(1, 0, 2)[None], V.permute(1, 0, 2)[None],
                                      torch.tensor(K.shape[0]))[0].permute(1, 0, 2)
            torch.testing.assert_close(out[cu[i]:cu[i + 1]].double(), ref, atol=2e-5, rtol=2e-5)
    step({"a": 13, "b": 3})
    step({"a": 1, "b": 1, "c": 20})
    alloc.free("b")
    alloc.fork("a", "a2", [cache])
    history["a2"] = history["a"]
    step({"a": 1, "a2": 1, "c": 1, "d": 9})
    assert alloc.tables["a"][0] == alloc.tables["a2"][0]  # full block shared
    assert alloc.tables["a"][1] != alloc.tables["a2"][1]  # partial block copied


def test_allocator_accounting():
    a = BlockAllocator(4, 4)
    a.append(0, 9)
    assert a.free_blocks == 1
    with pytest.raises(RuntimeError, match="out of pages"):
        a.append(1, 5)
    assert a.free_blocks == 1 and 1 not in a.lengths and 1 not in a.tables  # a refused id is not registered
    a.fork(0, 2)  # 2 full blocks shared, the partial third copied
    assert a.free_blocks == 0
    a.free(0)
    assert a.free_blocks == 1
    a.free(2)
    assert a.free_blocks == 4


def _allocator_state(a):
    return (list(a._free), list(a._refs), {k: list(v) for k, v in a.tables.items()}, dict(a.lengths))


@pytest.mark.parametrize("kv_dtype", [None, "int8", "fp8"])
def test_fork_copies_the_partial_block_of_every_format(kv_dtype):
    """The child's partial last block is a byte copy of the parent's (pages and scales), in every
    page format (index_copy_ has no float8 kernel), and the two then diverge independently."""
    a = BlockAllocator(6, 4)
    cache = init_paged_cache(6, 4, 2, 8, torch.float32, kv_dtype=kv_dtype)
    g = torch.Generator().manual_seed(0)
    cache.write(torch.randn(6, 2, 8, generator=g), torch.randn(6, 2, 8, generator=g), a.append("p", 6))
    before = [t.clone() for t in (cache.key_pages, cache.value_pages, cache.key_scales, cache.value_scales)
              if t is not None]
    a.fork("p", "c", [cache])
    src, dst = a.tables["p"][1], a.tables["c"][1]
    assert a.tables["c"][0] == a.tables["p"][0] and src != dst
    tensors = [t for t in (cache.key_pages, cache.value_pages, cache.key_scales, cache.value_scales)
               if t is not None]
    for t, b in zip(tensors, before):
        assert torch.equal(t[dst].view(torch.uint8), b[src].view(torch.uint8))  # bit-exact copy
        keep = [i for i in range(t.shape[0]) if i != dst]
        assert torch.equal(t[keep].view(torch.uint8), b[keep].view(torch.uint8))  # nothing else written


def test_allocator_errors_change_nothing():
    """A refused append / fork leaves the allocator and the pages as they were: no sequence
    registered, no reference count raised, no page taken or written."""
    a = BlockAllocator(4, 4)
    cache = init_paged_cache(4, 4, 1, 8, torch.float32)
    cache.key_pages.normal_()
    a.append("p", 6)
    state, pages = _allocator_state(a), cache.key_pages.clone()
    for call, exc, match in [
        (lambda: a.append("new", 100), RuntimeError, "out of pages"),
        (lambda: a.append("x", 1.5), TypeError, "n must be an int, got float"),
        (lambda: a.append("x", -1), ValueError, "n must be >= 0"),
        (lambda: a.fork("p", "c", None), TypeError, "caches must be an iterable of PagedKVCache"),
        (lambda: a.fork("p", "c", [cache.key_pages]), TypeError, "caches must hold PagedKVCache"),
        (lambda: a.fork("p", "c", [init_paged_cache(1, 4, 1, 8, torch.float32)]), ValueError,
         "caches must have num_blocks=4 pages of block_size=4, got 1 of 4"),
        (lambda: a.fork("p", "p"), ValueError, "sequence 'p' already exists"),
        (lambda: a.fork("nobody", "c"), ValueError, "unknown sequence 'nobody'"),
        (lambda: a.free("nobody"), ValueError, "unknown sequence 'nobody'"),
        (lambda: a.block_table(["p", "nobody"]), ValueError, "unknown sequence 'nobody'"),
        (lambda: a.context_lens(["nobody"]), KeyError, "unknown sequence 'nobody'"),
        (lambda: a.block_table(["p"], max_blocks=0), ValueError, "max_blocks must be an int >= 1, got 0"),
        (lambda: a.block_table(["p"], max_blocks=1), ValueError, "has 2 blocks, more than max_blocks=1"),
    ]:
        with pytest.raises(exc, match=match):
            call()
        assert _allocator_state(a) == state
        assert torch.equal(cache.key_pages, pages)
    a.free("p")
    assert a.free_blocks == 4


def test_allocator_append_failing_allocation_changes_nothing(monkeypatch):
    """An append whose slot tensor cannot be allocated (MemoryError) leaves the allocator as it
    was: the new sequence is not registered and no block leaves the free list."""
    a = BlockAllocator(8, 4)
    a.append("p", 6)
    state = _allocator_state(a)

    def no_memory(*args, **kwargs):
        raise MemoryError("no memory")

    monkeypatch.setattr(torch, "tensor", no_memory)
    monkeypatch.setattr(torch, "arange", no_memory)
    for seq, n in (("new", 9), ("p", 7)):
        with pytest.raises(MemoryError):
            a.append(seq, n)
        assert _allocator_state(a) == state
    monkeypatch.undo()
    assert a.append("new", 9).tolist() == [s for b in (2, 3, 4) for s in range(4 * b, 4 * b + 4)][:9]  # lowest first


def test_fork_checks_every_cache_even_without_a_copy():
    """A fork whose parent ends on a full block copies nothing, yet refuses pages that cannot be
    written (as the C++ fork does): the next fork of the same caches would have to copy."""
    a = BlockAllocator(4, 4)
    a.append("p", 4)
    cache = init_paged_cache(4, 4, 1, 8, torch.float32)
    bad = PagedKVCache(cache.key_pages[:1].expand(4, 4, 1, 8), cache.value_pages)
    state = _allocator_state(a)
    with pytest.raises(ValueError, match="key_pages cannot be written in place"):
        a.fork("p", "c", [bad])
    assert _allocator_state(a) == state
    a.fork("p", "c", [cache])
    assert a.tables["c"] == a.tables["p"] == [0]


def test_allocator_rollback_frees_blocks_and_next_append_continues():
    """Speculative decoding over pages: 10 tokens written, 4 rejected, 3 new ones appended: the
    attend sees the 6 kept tokens then the 3 new ones (float64 reference over those tokens), and the
    rolled-back sequence's freed block is handed out again."""
    g = torch.Generator().manual_seed(0)
    a = BlockAllocator(8, 4)
    cache = init_paged_cache(8, 4, 2, 16, torch.float32)
    k, v = torch.randn(13, 2, 16, generator=g), torch.randn(13, 2, 16, generator=g)
    cache.write(k[:10], v[:10], a.append("s", 10))  # blocks 0, 1, 2
    a.rollback("s", 4)                                  # 6 tokens: blocks 0, 1; block 2 free
    assert a.lengths["s"] == 6 and a.tables["s"] == [0, 1] and a.free_blocks == 6
    slots = a.append("s", 3)
    assert slots.tolist() == [6, 7, 8]                  # block 1's last two slots, block 2 again
    cache.write(k[10:], v[10:], slots)
    q = torch.randn(1, 4, 16, generator=g)
    out = cache.attend(q, a.block_table(["s"]), a.context_lens(["s"]), torch.tensor([0, 1], dtype=torch.int32))
    kept = torch.cat([torch.arange(6), torch.arange(10, 13)])
    ref = attention_reference(q.permute(1, 0, 2).unsqueeze(0), k[kept].permute(1, 0, 2).unsqueeze(0),
                              v[kept].permute(1, 0, 2).unsqueeze(0), torch.tensor(9))[0].permute(1, 0, 2)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    a.rollback("s", 9)
    assert a.tables["s"] == [] and a.lengths["s"] == 0 and a.free_blocks == 8


def test_allocator_rollback_refusals_change_nothing():
    a = BlockAllocator(8, 4)
    a.append("p", 9)        # blocks 0, 1 full, 2 partial
    a.fork("p", "c")        # c shares 0, 1 and has a copy of 2
    state = _allocator_state(a)
    for call, exc, match in [
        (lambda: a.rollback("c", 2), ValueError, "partly filled, shared with another sequence"),
        (lambda: a.rollback("c", 10), ValueError, "cannot roll back more tokens than 'c' holds: n=10, length=9"),
        (lambda: a.rollback("c", -1), ValueError, "n must be >= 0"),
        (lambda: a.rollback("c", 1.0), TypeError, "n must be an int"),
        (lambda: a.rollback("nobody", 1), ValueError, "unknown sequence 'nobody'"),
    ]:
        with pytest.raises(exc, match=match):
            call()
        assert _allocator_state(a) == state
    a.rollback("c", 1)      # 8 tokens: its copied block goes back, the shared ones stay the parent's
    assert a.tables["c"] == [0, 1] and a.tables["p"][:2] == [0, 1] and a.free_blocks == 5
    a.rollback("c", 4)      # 4 tokens, last block full: allowed
    assert a.tables["c"] == [0] and a.free_blocks == 5


def test_allocator_takes_any_iterable_of_ids():
    a = BlockAllocator(8, 4)
    a.append("x", 5)
    a.append("y", 2)
    assert a.context_lens(s for s in ("x", "y")).tolist() == [5, 2]
    assert a.block_table(iter(["y", "x"])).tolist() == [[2, -1], [0, 1]]


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_allocator_slots_follow_the_table(block_size):
    """Every slot append returns is position p's: table[p // block_size] * block_size +
    p % block_size over the sequence's final table, for random growth of interleaved sequences."""
    g = torch.Generator().manual_seed(block_size)
    a = BlockAllocator(4096, block_size)
    got = {s: [] for s in range(5)}
    for _ in range(40):
        s = int(torch.randint(0, 5, (), generator=g))
        got[s] += a.append(s, int(torch.randint(0, 3 * block_size + 2, (), generator=g))).tolist()
    for s, slots in got.items():
        t = a.tables.get(s, [])
        assert slots == [t[p // block_size] * block_size + p % block_size for p in range(len(slots))]


@pytest.mark.parametrize("call,exc,match", [
    (lambda: BlockAllocator(4.5, 4), TypeError, "num_blocks must be an int, got float"),
    (lambda: BlockAllocator(4, "4"), TypeError, "block_size must be an int, got str"),
    (lambda: BlockAllocator(0, 4), ValueError, "num_blocks must be an int >= 1, got 0"),
    (lambda: BlockAllocator(2 ** 16, 2 ** 16), ValueError, r"num_blocks \* block_size must be <= 2\*\*31 - 1"),
    (lambda: init_paged_cache(2 ** 16, 2 ** 16, 1, 1, torch.float32, device="meta"), ValueError,
     r"num_blocks \* block_size must be <= 2\*\*31 - 1"),
    (lambda: init_paged_cache(4, 4.0, 1, 1, torch.float32), TypeError, "block_size must be an int, got float"),
])
def test_geometry_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_copy_blocks_checks_before_writing():
    cache = init_paged_cache(4, 2, 1, 2, torch.float32)
    cache.key_pages.normal_()
    before = cache.key_pages.clone()
    with pytest.raises(ValueError, match=r"dst must hold page indices in \[0, num_blocks=4\), got \[99\]"):
        cache.copy_blocks(torch.tensor([0]), torch.tensor([99]))
    with pytest.raises(TypeError, match="src must be an int32 or int64 tensor"):
        cache.copy_blocks(torch.tensor([0.0]), torch.tensor([1]))
    odd = type(cache)(cache.key_pages, torch.zeros(2, 2, 1, 2))
    with pytest.raises(ValueError, match="must have the same num_blocks"):
        odd.copy_blocks(torch.tensor([0]), torch.tensor([3]))
    with pytest.raises(ValueError, match=r"dst must not name a page twice .* got \[2, 2\]"):
        cache.copy_blocks(torch.tensor([0, 1]), torch.tensor([2, 2]))
    with pytest.raises(TypeError, match="src must be an int32 or int64 tensor of page indices, got torch.uint64"):
        cache.copy_blocks(torch.tensor([0], dtype=torch.uint64), torch.tensor([1]))
    assert torch.equal(cache.key_pages, before)


@pytest.mark.parametrize("case", ["expanded", "requires_grad", "inference"])
def test_copy_blocks_refuses_unwritable_pages_before_writing(case):
    """Every page and scale tensor is checked writable before the first is written: key pages
    (valid) stay as they were when the value pages or scales cannot be written in place."""
    cache = init_paged_cache(4, 2, 1, 2, torch.float32, kv_dtype="int8")
    cache.key_pages.random_(-100, 100)
    before = cache.key_pages.clone()
    name, bad = {"expanded": ("value_pages", torch.zeros(1, 2, 1, 2, dtype=torch.int8).expand(4, 2, 1, 2)),
                 "requires_grad": ("value_scales", torch.ones(4, 2, 1, requires_grad=True)),
                 "inference": ("value_scales", None)}[case]
    if bad is None:
        with torch.inference_mode():
            bad = torch.ones(4, 2, 1)
    fields = dict(key_pages=cache.key_pages, value_pages=cache.value_pages, key_scales=cache.key_scales,
                  value_scales=cache.value_scales)
    fields[name] = bad
    odd = type(cache)(**fields)
    with pytest.raises(ValueError, match=f"{name} cannot be written in place"):
        odd.copy_blocks(torch.tensor([0]), torch.tensor([1]))
    assert torch.equal(cache.key_pages, before)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64, torch.int8])
def test_init_refuses_a_dtype_no_op_takes(dtype):
    with pytest.raises(TypeError, match="dtype must be torch.float32, torch.bfloat16 or torch.float16"):
        init_paged_cache(4, 2, 1, 2, dtype)


# ------------------------------------------------------------------- errors ---

def attend_args(**over):
    q, kp, vp, table, lens, cu = make_case([10, 6], [2, 1], block_size=4)
    a = dict(q=q, key_pages=kp, value_pages=vp, block_table=table, context_lens=lens,
             cu_seqlens_q=cu)
    a.update(over)
    return a





@pytest.mark.parametrize("name,over,exc,match", [
    ("page out of range", "table99", ValueError, r"block_table must hold pages in \[0, num_blocks=\d+\) for every block a query sees, got 99 at \[0, 1\]"),
    ("page -1 seen", "table-1", ValueError, r"block_table must hold pages .* got -1 at \[1, 0\]"),
    ("length beyond table", "len", ValueError, r"context_lens must be <= max_blocks \* block_size = \d+"),
    ("cu decreasing", "cu_dec", ValueError, r"cu_seqlens_q must not decrease, got 4 then 3 at index 2"),
    ("cu start", "cu_start", ValueError, r"cu_seqlens_q must start at 0, got 1"),
    ("cu end", "cu_end", ValueError, r"cu_seqlens_q must end at most at total_q=3 \(q's first dim\), got 4"),
    ("fewer ctx than q", "ctx_small", ValueError, r"context_lens must be >= the sequence's queries \(2"),
    ("table dtype", "table64", TypeError, r"block_table must have dtype torch.int32 \(no implicit casts\), got torch.int64"),
    ("q dtype", "qbf16", TypeError, r"q is torch.bfloat16 but key_pages are torch.float32"),
    ("q shape", "q4d", ValueError, r"q must be a 3-D tensor"),
    ("scales on plain", "scales", ValueError, r"key_scales and value_scales are the scales of quantized pages"),
    ("scale overflow", "scale", ValueError, r"scale=1e\+38 makes scores overflow float32"),
    ("window float", "window1.5", TypeError, r"window must be an int, got float"),
    ("window huge", "window2**63", ValueError, r"window must fit in int64 \(0: no window\), got 9223372036854775808"),
    ("window tensor", "windowT", TypeError, r"window must be an int or None, got a tensor: pass a Python int"),
    ("scale tensor", "scaleT", TypeError, r"scale must be a float or None, got a tensor: pass a Python number"),
    ("softcap tensor", "softcapT", TypeError, r"softcap must be a float or None, got a tensor"),
    ("pages float64", "pages64", TypeError, r"key_pages are torch.float64: paged_attend reads pages of torch.float32, "
                                            r"torch.bfloat16 or torch.float16 \(q's dtype\), or torch.int8 / "
                                            r"torch.float8_e4m3fn with key_scales and value_scales"),
])
def test_attend_errors(name, over, exc, match):
    a = attend_args()
    if over == "table99":
        a["block_table"] = a["block_table"].clone(); a["block_table"][0, 1] = 99
    elif over == "table-1":
        a["block_table"] = a["block_table"].clone(); a["block_table"][1, 0] = -1
    elif over == "len":
        a["context_lens"] = torch.tensor([10, 10**6], dtype=torch.int32)
    elif over == "cu_dec":
        a["cu_seqlens_q"] = torch.tensor([0, 4, 3], dtype=torch.int32); a["q"] = torch.randn(3, 4, 16)
    elif over == "cu_start":
        a["cu_seqlens_q"] = torch.tensor([1, 2, 3], dtype=torch.int32)
    elif over == "cu_end":
        a["cu_seqlens_q"] = torch.tensor([0, 2, 4], dtype=torch.int32)
    elif over == "ctx_small":
        a["context_lens"] = torch.tensor([1, 6], dtype=torch.int32)
    elif over == "table64":
        a["block_table"] = a["block_table"].long()
    elif over == "qbf16":
        a["q"] = a["q"].bfloat16()
    elif over == "q4d":
        a["q"] = a["q"][None]
    elif over == "scales":
        a["key_scales"] = torch.ones(a["key_pages"].shape[:3])
        a["value_scales"] = torch.ones(a["key_pages"].shape[:3])
    elif over == "scale":
        a["scale"] = 1e38
    elif over == "window1.5":
        a["window"] = 1.5
    elif over == "window2**63":
        a["window"] = 2 ** 63
    elif over == "windowT":  # eager would read it on the host; compiled, the op cannot take it
        a["window"] = torch.tensor(3)
    elif over == "scaleT":
        a["scale"] = torch.tensor(0.5)
    elif over == "softcapT":
        a["softcap"] = torch.tensor(2.0)
    elif over == "pages64":  # a dtype no attend reads: the pages are named, not q
        a["key_pages"] = a["key_pages"].double()
        a["value_pages"] = a["value_pages"].double()
    q = a.pop("q")
    with pytest.raises(exc, match=match):
        attend_pages(q, **a)
    # Traced code raises what eager raises (values known only at run time are checked by the
    # kernel when the compiled program runs).
    torch._dynamo.reset()
    with pytest.raises(Exception, match=match):
        torch.compile(lambda q: attend_pages(q, **a), fullgraph=True)(q)


@pytest.mark.parametrize("case,exc,match", [
    ("slot high", ValueError, r"slot_mapping must hold -1 \(skip\) or a slot in \[0, num_blocks \* block_size = 24\), got 24 at index 2"),
    ("slot low", ValueError, r"got -2 at index 0"),
    ("dup", ValueError, r"slot_mapping gives slot 5 to more than one token"),
    ("dtype", TypeError, r"key is torch.float16 but key_pages are torch.float32"),
    ("shape", ValueError, r"key must have shape \(num_tokens, num_kv_heads=3, head_dim=8\)"),
    ("slots shape", ValueError, r"slot_mapping must have shape \(num_tokens=3,\)"),
    ("alias", ValueError, r"key must not share memory with key_pages"),
    # As update_ raises for the same mistakes: the data's dtype does not fit the write's format.
    ("missing scales", TypeError, r"pass both key_scales and value_scales"),
    ("scales on plain", TypeError, r"key_scales and value_scales are the scales of quantized pages"),
    ("one scale", ValueError, r"key_scales is given without value_scales"),
])
def test_write_errors_write_nothing(case, exc, match):
    c = init_paged_cache(6, 4, 3, 8, torch.float32)
    c.key_pages.normal_()
    c.value_pages.normal_()
    before = (c.key_pages.clone(), c.value_pages.clone())
    key, value = torch.randn(3, 3, 8), torch.randn(3, 3, 8)
    slots = torch.tensor([1, 2, 3])
    kp, vp, ks, vs = c.key_pages, c.value_pages, None, None
    if case == "slot high":
        slots = torch.tensor([1, 2, 24])
    elif case == "slot low":
        slots = torch.tensor([-2, 2, 3])
    elif case == "dup":
        slots = torch.tensor([5, 2, 5])
    elif case == "dtype":
        key = key.half()
    elif case == "shape":
        key = torch.randn(3, 2, 8)
    elif case == "slots shape":
        slots = torch.tensor([1, 2])
    elif case == "alias":
        key = c.key_pages.view(-1, 3, 8)[:3]
    elif case == "missing scales":
        q = init_paged_cache(6, 4, 3, 8, torch.float32, kv_dtype="int8")
        kp, vp = q.key_pages, q.value_pages
        before = (kp.clone(), vp.clone())
    elif case == "scales on plain":
        ks, vs = torch.ones(6, 4, 3), torch.ones(6, 4, 3)
    elif case == "one scale":
        q = init_paged_cache(6, 4, 3, 8, torch.float32, kv_dtype="int8")
        kp, vp, ks = q.key_pages, q.value_pages, q.key_scales
        before = (kp.clone(), vp.clone())
    with pytest.raises(exc, match=match):
        write_pages(kp, vp, key, value, slots, ks, vs)
    assert torch.equal(kp, before[0]) and torch.equal(vp, before[1])


# ------------------------------------------------------------ traced paths ---

def test_compile_fullgraph_no_graph_break():
    q, kp, vp, table, lens, cu = make_case([20, 9], [1, 1], block_size=8)
    key, value = torch.randn(2, 2, 16), torch.randn(2, 2, 16)
    slots = torch.tensor([int(table[0, 2]) * 8 + 3, int(table[1, 1]) * 8])

    def step(q, key, value):
        write_pages(kp, vp, key, value, slots)
        return attend_pages(q, kp, vp, table, lens, cu)

    kp2, vp2 = kp.clone(), vp.clone()
    want_k = kp.clone()
    want_k.view(-1, 2, 16)[slots] = key
    torch._dynamo.reset()
    out = torch.compile(step, fullgraph=True)(q, key, value)
    assert torch.equal(kp, want_k)
    ref = reference(q, kp, vp, table, lens, cu)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    del kp2, vp2


def test_opcheck():
    q, kp, vp, table, lens, cu = make_case([20, 9], [2, 1], block_size=8)
    torch.library.opcheck(torch.ops.kvcache.paged_attend.default, (q, kp, vp, table, lens, cu))
    key, value = torch.randn(2, 2, 16), torch.randn(2, 2, 16)
    torch.library.opcheck(torch.ops.kvcache.paged_write_.default,
                          (kp, vp, key, value, torch.tensor([0, 9])))
    c = init_paged_cache(4, 8, 2, 16, torch.float32, kv_dtype="int8")
    torch.library.opcheck(torch.ops.kvcache.paged_write_.default,
                          (c.key_pages, c.value_pages, key, value, torch.tensor([0, 9])),
                          dict(key_scales=c.key_scales, value_scales=c.value_scales))
