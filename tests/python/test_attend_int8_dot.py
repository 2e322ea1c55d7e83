"""CPU attend over int8 caches with bf16/fp16 queries: the integer-dot-product loops.

On AVX2 (and AVX-512) machines, an int8 cache read with 16-bit queries is scored and weighted by
integer dot products (csrc/cpu/attend_kernel.h, qk_block_i8 / pv_block_i8): each query row and each
block's weights are rounded to int16 with their own scale. Every check is against float64
attention over the dequantized cache (references.attention_reference) with the queries' own
values, at the tolerance of the output dtype: the rounding must stay below what the 16-bit output
rounding already allows. The shapes cover every tile of the loops (1-4 query rows per tile and
more, odd slot counts, blocks of 64 and their tails), the head_dims the loops take and the ones
they leave to the float loops, splits, rings, and the edges: int32 sums at their largest, NaN and
infinite scales, queries that are all zero.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import kvcache
from kv_testing import forced_split, random_tensor
from references import attention_reference as reference

ops = torch.ops.kvcache
HERE = os.path.dirname(os.path.abspath(__file__))
TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-3}


def dequantize(q, scale):
    return q.double() * scale.double()[..., None]


def int8_cache(b, kvh, t, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randint(-127, 128, (b, kvh, t, d), generator=g).to(torch.int8)
    values = torch.randint(-127, 128, (b, kvh, t, d), generator=g).to(torch.int8)
    ks = torch.rand(b, kvh, t, generator=g) * 0.02 + 1e-3
    vs = torch.rand(b, kvh, t, generator=g) * 0.05 + 1e-3
    return keys, values, ks, vs


def check(b, h, kvh, s, d, t, lengths, dtype, q_scale=1.0, seed=0, **kw):
    keys, values, ks, vs = int8_cache(b, kvh, t, d, seed)
    # Scores spread over several units (the softmax neither flat nor one-hot).
    q = (random_tensor((b, h, s, d), torch.float32, seed=seed + 5) * q_scale).to(dtype)
    lengths = torch.tensor(lengths, dtype=torch.int32)
    kv_start = kw.pop("kv_start", None)
    kv_start = None if kv_start is None else torch.tensor(kv_start, dtype=torch.int32)
    out = ops.attend(q, keys, values, lengths, kv_start=kv_start, k_scale=ks, v_scale=vs, **kw)
    ref = reference(q, dequantize(keys, ks), dequantize(values, vs), lengths, kv_start=kv_start, **kw)
    assert out.dtype == dtype
    tol = TOL[dtype]
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    return out, ref


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "h,kvh,s",
    [(1, 1, 1), (2, 1, 1), (3, 1, 1), (9, 3, 1), (4, 1, 1), (5, 1, 1), (8, 1, 1), (32, 8, 1),
     (6, 2, 3), (4, 2, 4), (2, 2, 17)],
)
def test_every_row_tile(h, kvh, s, dtype):
    """1-4 query rows per tile, groups over 4 (tiles of 4 then the rest), chunks of positions."""
    check(2, h, kvh, s, 64, 300, [300, 77], dtype, q_scale=0.6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [16, 32, 48, 80, 128, 256, 8, 24, 72, 272])
def test_head_dims_taken_and_left_to_the_float_loops(d, dtype):
    """Multiples of 16 up to 256 take the integer loops; 8, 24, 72 (not multiples of 16) and 272
    (int32 sums no longer exact by the bound) take the float loops: both are correct."""
    check(1, 4, 2, 2, d, 140, [131], dtype, q_scale=4.0 / d**0.5)


@pytest.mark.parametrize("n", [1, 2, 3, 63, 64, 65, 127, 129, 200])
def test_slot_counts_odd_and_block_tails(n):
    """Slots go by pairs in the weighted sum (an odd count leaves one alone) and by blocks of 64."""
    check(1, 3, 1, 1, 64, 256, [n], torch.float16)


def test_ragged_rows_kv_start_window_softcap():
    check(3, 8, 2, 5, 64, 400, [400, 9, 250], torch.float16, kv_start=[7, 0, 100], window=130, softcap=20.0)
    check(2, 4, 4, 1, 128, 300, [5, 300], torch.bfloat16, kv_start=[5, 0])  # a row that sees nothing: zeros


def test_split_rows():
    with forced_split():
        check(1, 9, 3, 1, 64, 3000, [2999], torch.float16, kv_start=[5])
        check(2, 8, 2, 1, 128, 2000, [2000, 1000], torch.bfloat16)


def test_sharp_and_flat_softmax():
    """Very large scores (a near one-hot softmax: the weights of a block span many orders, the
    small ones rounding to 0) and tiny ones (a flat softmax)."""
    check(1, 4, 1, 1, 64, 500, [500], torch.float16, q_scale=40.0)
    check(1, 4, 1, 1, 64, 500, [500], torch.float16, q_scale=1e-3)


def test_int32_sums_at_their_largest():
    """head_dim 256, keys at -128 and 127 (the int8 extremes; -128 is never written by the format
    but a cache may hold it), every query element at the row's maximum: the largest integer sums
    the loops can make, exact by the bound. Any wrap would flip which slot wins."""
    b, kvh, t, d = 1, 1, 8, 256
    keys = torch.full((b, kvh, t, d), 127, dtype=torch.int8)
    keys[:, :, ::2] = -128
    values = torch.arange(t, dtype=torch.float32).view(1, 1, t, 1).expand(b, kvh, t, d).to(torch.int8).clone()
    values[:, :, :, 1::2] = -128
    ks = torch.full((b, kvh, t), 1e-3)
    vs = torch.full((b, kvh, t), 1.0)
    for sign in (1.0, -1.0):
        q = torch.full((b, 1, 1, d), sign * 0.5, dtype=torch.float16)
        out = ops.attend(q, keys, values, torch.tensor(t), k_scale=ks, v_scale=vs)
        ref = reference(q, dequantize(keys, ks), dequantize(values, vs), torch.tensor(t))
        torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=2e-3)


def test_zero_queries_give_the_mean():
    keys, values, ks, vs = int8_cache(1, 1, 50, 64, seed=3)
    q = torch.zeros(1, 2, 1, 64, dtype=torch.bfloat16)
    out = ops.attend(q, keys, values, torch.tensor(50), k_scale=ks, v_scale=vs)
    want = dequantize(values, vs)[0, 0].mean(0)
    torch.testing.assert_close(out[0, :, 0].double(), want.expand(2, 64), atol=2e-2, rtol=2e-2)


def test_nan_scales_propagate():
    """A NaN scale on a visible slot makes that row's output NaN, as the dequantized float64
    attention does (a NaN weight hands its block to the float loops); the other row stays finite
    and correct."""
    for bad in (float("nan"),):
        for which in ("k", "v"):
            keys, values, ks, vs = int8_cache(2, 1, 70, 64, seed=4)
            (ks if which == "k" else vs)[0, 0, 33] = bad
            q = random_tensor((2, 2, 1, 64), torch.float32, seed=1).to(torch.float16)
            out = ops.attend(q, keys, values, torch.tensor([70, 70]), k_scale=ks, v_scale=vs)
            assert out[0].isnan().all(), (bad, which)
            ref = reference(q[1:], dequantize(keys[1:], ks[1:]), dequantize(values[1:], vs[1:]), torch.tensor(70))
            torch.testing.assert_close(out[1:].double(), ref, atol=2e-3, rtol=2e-3)


def test_nan_queries_give_nan():
    keys, values, ks, vs = int8_cache(1, 1, 20, 64, seed=6)
    q = torch.randn(1, 2, 1, 64).to(torch.bfloat16)
    q[0, 0, 0, 5] = float("nan")
    out = ops.attend(q, keys, values, torch.tensor(20), k_scale=ks, v_scale=vs)
    assert out[0, 0].isnan().all() and not out[0, 1].isnan().any()


def test_ring_runs_and_gathered_blocks():
    """An int8 ring with bf16 queries: blocks of consecutive slots are read in place by the integer
    loops, the blocks that span the wrap are gathered (float loops)."""
    d, window = 64, 150
    ring = kvcache.init_ring_layer_cache(2, 2, d, window, torch.float32, sinks=4, max_step=16, kv_dtype="int8")
    g = torch.Generator().manual_seed(9)
    for start in range(0, 400, 16):
        kn = torch.randn(2, 2, 16, d, generator=g)
        vn = torch.randn(2, 2, 16, d, generator=g)
        ring = kvcache.update_ring_layer_cache(ring, kn, vn, start)
    for dtype in (torch.bfloat16, torch.float16):
        q = (torch.randn(2, 6, 3, d, generator=g) * 0.5).to(dtype)
        out = kvcache.attend_ring(q, ring)
        ref = reference(q, dequantize(ring.keys, ring.k_scale), dequantize(ring.values, ring.v_scale),
                        ring.length, positions=ring.positions, window=window, sinks=4)
        torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=TOL[dtype])


def run_forced_isa(isa, script, tmp_path):
    """What `script` (formatted with here=HERE) saves to the path in its argv[1], run in a
    subprocess whose kernel path is capped at `isa` (KVCACHE_ATTEND_ISA)."""
    path = tmp_path / f"{isa}.pt"
    env = dict(os.environ, KVCACHE_ATTEND_ISA=isa)
    proc = subprocess.run([sys.executable, "-c", script.format(here=HERE), str(path)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(path)


GENERIC_SCRIPT = """
import sys, torch
sys.path.insert(0, {here!r})
import kvcache
import test_attend_int8_dot as t
assert kvcache._C.attend_cpu_isa() == "generic"
torch.save(t.check(2, 9, 3, 2, 64, 300, [300, 77], torch.float16, q_scale=0.6)[0], sys.argv[1])
"""


def test_the_integer_loops_ran(tmp_path):
    """On an AVX2 machine the same call through the float loops (KVCACHE_ATTEND_ISA=generic) gives
    other bits: the integer loops really ran here (and both are within tolerance)."""
    if kvcache._C.attend_cpu_isa() == "generic":
        pytest.skip("this CPU runs the float loops only")
    there = run_forced_isa("generic", GENERIC_SCRIPT, tmp_path)
    here = check(2, 9, 3, 2, 64, 300, [300, 77], torch.float16, q_scale=0.6)[0]
    assert not torch.equal(there, here)


AVX512_SCRIPT = """
import sys, torch
sys.path.insert(0, {here!r})
import kvcache
import test_attend_int8_dot as t
assert kvcache._C.attend_cpu_isa() == "avx512"
torch.save(t.vnni_cases(), sys.argv[1])
"""


def vnni_cases():
    """Outputs of int8-cache calls that cover the integer loops' tiles: decode over 1-4 query rows
    a tile, a chunk, odd slot counts and a tail block (each checked against float64 by check)."""
    return [check(1, 9, 3, 1, 64, 300, [299], torch.bfloat16)[0],
            check(2, 8, 2, 3, 128, 200, [200, 77], torch.float16)[0],
            check(1, 4, 4, 1, 256, 130, [129], torch.bfloat16)[0],
            check(1, 8, 2, 5, 96, 150, [141], torch.bfloat16, q_scale=0.6)[0]]


def test_vnni_loops_match_the_avx512_ones(tmp_path):
    """On AVX512-VNNI (the avx512vnni and avx512bf16 paths) the integer loops fuse each multiply
    and add (vpdpwssd); their int32 sums are the same integers, so the outputs are bit-identical
    to the avx512 path's (KVCACHE_ATTEND_ISA=avx512), and both are within tolerance."""
    if kvcache._C.attend_cpu_isa() not in ("avx512vnni", "avx512bf16"):
        pytest.skip("this CPU has no AVX512-VNNI path")
    for a, b in zip(run_forced_isa("avx512", AVX512_SCRIPT, tmp_path), vnni_cases()):
        assert torch.equal(a, b)
