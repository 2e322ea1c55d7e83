"""The slot-mapped CPU write shared by paged_write_ and ring_update_ (csrc/cpu/slot_write.h).

Both layouts turn their slot mapping into runs of consecutive slots and hand them to one core (a copy,
or the quantizer with its scales). These tests aim at what the core decides: runs joined and cut (page
boundaries, -1 tokens, out-of-order slots), the loop order it picks for each memory layout of the new
data (token-major, head-major, strided head_dim), and big writes split over threads (more than 1 MiB),
plain and quantized, each against plain PyTorch (tests/python/references.py).
"""

from __future__ import annotations

import pytest
import torch

import kvcache  # noqa: F401
from kv_testing import as_bytes
from references import quantize_reference, ring_update_reference

ops = torch.ops.kvcache


def same_bytes(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(as_bytes(a), as_bytes(b))


def new_data(tokens, heads, dim, dtype, layout, seed):
    """(tokens, heads, dim) new data laid out in memory as `layout`."""
    g = torch.Generator().manual_seed(seed)
    if layout == "thd":
        return torch.randn(tokens, heads, dim, generator=g).to(dtype)
    if layout == "htd":  # head-major memory, viewed as (tokens, heads, dim)
        return torch.randn(heads, tokens, dim, generator=g).to(dtype).transpose(0, 1)
    if layout == "padded-tokens":  # heads dense, a gap between tokens
        return torch.randn(tokens, heads + 1, dim, generator=g).to(dtype)[:, :heads]
    assert layout == "strided-dim"
    return torch.randn(tokens, heads, 2 * dim, generator=g).to(dtype)[..., ::2]


def paged_reference(kp, vp, key, value, slots, ks=None, vs=None):
    """Copies of the pages after the write: token t at flat slot slots[t], -1 skipped."""
    nb, bs, h, d = kp.shape
    kp, vp = kp.clone().view(nb * bs, h, d), vp.clone().view(nb * bs, h, d)
    if ks is not None:
        ks, vs = ks.clone().view(nb * bs, h), vs.clone().view(nb * bs, h)
        key, sk = quantize_reference(key, kp.dtype)
        value, sv = quantize_reference(value, kp.dtype)
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        kp[s], vp[s] = key[t], value[t]
        if ks is not None:
            ks[s], vs[s] = sk[t], sv[t]
    out = [kp.view(nb, bs, h, d), vp.view(nb, bs, h, d)]
    if ks is not None:
        out += [ks.view(nb, bs, h), vs.view(nb, bs, h)]
    return out


# Slot mappings over pages of 8 slots: runs across a page boundary, cut by -1, out of order, single slots.
MAPPINGS = {
    "run-across-pages": list(range(5, 13)),
    "cut-by-skips": [0, 1, -1, 2, 3, -1, -1, 17, 18, 19],
    "out-of-order": [31, 30, 9, 10, 11, 2, 24],
    "decode": [3, 12, 27],
}


@pytest.mark.parametrize("layout", ["thd", "htd", "padded-tokens", "strided-dim"])
@pytest.mark.parametrize("mapping", list(MAPPINGS))
@pytest.mark.parametrize("kv", [None, torch.int8, torch.float8_e4m3fn], ids=str)
def test_paged_runs_against_reference(kv, mapping, layout):
    slots = torch.tensor(MAPPINGS[mapping])
    n, h, d = len(slots), 3, 16
    dtype = torch.bfloat16
    key = new_data(n, h, d, dtype, layout, seed=1)
    value = new_data(n, h, d, dtype, layout, seed=2)
    g = torch.Generator().manual_seed(3)
    if kv is None:
        kp, vp = torch.randn(4, 8, h, d, generator=g).to(dtype), torch.randn(4, 8, h, d, generator=g).to(dtype)
        scales = {}
        want = paged_reference(kp, vp, key, value, slots)
        got = [kp, vp]
    else:
        kp = torch.randint(-100, 100, (4, 8, h, d), generator=g).to(kv)
        vp = torch.randint(-100, 100, (4, 8, h, d), generator=g).to(kv)
        ks, vs = torch.rand(4, 8, h, generator=g), torch.rand(4, 8, h, generator=g)
        scales = {"key_scales": ks, "value_scales": vs}
        want = paged_reference(kp, vp, key, value, slots, ks, vs)
        got = [kp, vp, ks, vs]
    ops.paged_write_(kp, vp, key, value, slots, **scales)
    for a, b in zip(got, want):
        assert same_bytes(a, b)


@pytest.mark.parametrize("kv", [None, torch.int8], ids=str)
def test_big_paged_write_split_over_threads(kv):
    # 2 x 3000 tokens x 8 heads x 64 float32 = 12 MiB read: the threaded path, runs cut into pieces.
    n, h, d, bs = 3000, 8, 64, 16
    nb = (2 * n) // bs
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(4))
    # Pages in random order, each filled in order (runs of 16 slots), a skipped token every 100.
    i = torch.arange(n)
    slots = perm[i // bs] * bs + i % bs
    slots[::100] = -1
    key = torch.randn(n, h, d)
    value = torch.randn(n, h, d)
    if kv is None:
        kp, vp = torch.zeros(nb, bs, h, d), torch.zeros(nb, bs, h, d)
        want = paged_reference(kp, vp, key, value, slots)
        ops.paged_write_(kp, vp, key, value, slots)
        got = [kp, vp]
    else:
        kp, vp = torch.zeros(nb, bs, h, d, dtype=kv), torch.zeros(nb, bs, h, d, dtype=kv)
        ks, vs = torch.ones(nb, bs, h), torch.ones(nb, bs, h)
        want = paged_reference(kp, vp, key, value, slots, ks, vs)
        ops.paged_write_(kp, vp, key, value, slots, key_scales=ks, value_scales=vs)
        got = [kp, vp, ks, vs]
    for a, b in zip(got, want):
        assert same_bytes(a, b)


@pytest.mark.parametrize("kv", [None, torch.int8, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("chunk,start", [(1, [0, 40]), (700, [0, 1500]), (3000, [5, 2])])
def test_ring_runs_against_reference(kv, chunk, start):
    # Capacity 1031 (sinks 4): a decode step, a wrapping prefill, and a chunk longer than the ring (its
    # last 1027 positions kept); 2 x 3000 x 4 x 64 float32 new data is 6 MiB: the threaded path.
    b, h, d, cap, sinks = 2, 4, 64, 1031, 4
    g = torch.Generator().manual_seed(5)
    kn = torch.randn(b, chunk, h, d, generator=g).transpose(1, 2)  # (batch, chunk, heads, dim) memory
    vn = torch.randn(b, h, chunk, d, generator=g)
    pos = torch.full((b, cap), -1, dtype=torch.int32)
    if kv is None:
        k, v = torch.randn(b, h, cap, d, generator=g), torch.randn(b, h, cap, d, generator=g)
        want = ring_update_reference(k, v, pos, kn, vn, start, sinks)[:3]
        got = [k, v, pos]
        scales = {}
    else:
        k = (torch.randn(b, h, cap, d, generator=g) * 20).clamp(-100, 100).to(kv)
        v = k.clone()
        ks, vs = torch.rand(b, h, cap, generator=g), torch.rand(b, h, cap, generator=g)
        want = ring_update_reference(k, v, pos, kn, vn, start, sinks, ks, vs)
        got = [k, v, pos, ks, vs]
        scales = {"k_scale": ks, "v_scale": vs}
    length = ops.ring_update_(k, v, pos, kn, vn, torch.tensor(start), sinks=sinks, **scales)
    assert torch.equal(length, torch.tensor(start, dtype=torch.int32) + chunk)
    for a, w in zip(got, want):
        assert same_bytes(a, w)
