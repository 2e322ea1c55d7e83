"""attend: attention over the filled slots of a KV cache, against a float64 reference.

The reference is plain PyTorch: per row, float64 scores over slots
[0, length), a boolean mask of what each query may see (causal, kv_start,
window), masked softmax, weighted sum. Queries that see nothing give zeros.
Unused slots are poisoned with NaN/Inf to prove the kernel never reads them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch.library import opcheck

import kvcache
from kv_testing import device  # noqa: F401  (the device fixture)
import kv_testing
from kv_testing import no_host_sync
from references import assert_close
from references import attention_reference as reference

ATTEND = torch.ops.kvcache.attend.default
HERE = os.path.dirname(os.path.abspath(__file__))

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# ------------------------------------------------------------- reference ---


def unused_slots(b, seq, max_len, lengths, kv_start, window):
    """Boolean (max_len,) per row: slots no query of the row may see."""
    lengths = lengths.expand(b) if lengths.dim() == 0 else lengths
    masks = []
    for r in range(b):
        n = int(lengths[r])
        first = 0 if kv_start is None else int(kv_start.expand(b)[r])
        if window > 0:
            first = max(first, n - seq - window + 1)  # the first query's window
        slot = torch.arange(max_len)
        masks.append((slot < first) | (slot >= n))
    return torch.stack(masks)


def poison_(t, unused):
    """Writes NaN, +Inf, -Inf (cycling) into the unused slots of a (b, kvh, T, d) view."""
    pattern = torch.tensor([float("nan"), float("inf"), float("-inf")])
    b, kvh, T, d = t.shape
    vals = pattern[torch.arange(kvh * T * d) % 3].reshape(kvh, T, d).to(t.device, t.dtype)
    for r in range(b):
        idx = unused[r].nonzero().flatten()
        if idx.numel():
            t[r, :, idx] = vals[:, idx]


@pytest.mark.parametrize("threads,T", [(1, 300), (2, 9000)], ids=["serial", "split"])
def test_nan_in_a_visible_slot_propagates(threads, T):
    """A NaN key that a query sees makes that query's output NaN (as SDPA does), not 0."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q = make_q(1, 8, 3, 64, torch.float32)
        keys, values = make_kv(1, 1, T, 64, torch.float32)
        keys[0, 0, T - 2, 5] = float("nan")  # seen by the last two queries only
        out = ATTEND(q, keys, values, torch.tensor([T], dtype=torch.int32))
    finally:
        torch.set_num_threads(saved)
    assert torch.isfinite(out[:, :, 0]).all()
    assert torch.isnan(out[:, :, 1:]).all()


# ------------------------------------------------------------- layouts ---


def make_q(b, h, s, d, dtype, layout="contiguous", seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):  # made on the device, then viewed: the layout is the device's too
        return torch.randn(*shape, generator=g).to(device, dtype)

    if layout == "contiguous":
        return rnd(b, h, s, d)
    if layout == "transposed":  # the model's (batch, seq, heads, head_dim) projection
        return rnd(b, s, h, d).transpose(1, 2)
    if layout == "strided":  # every other element of a wider buffer
        return rnd(b, h, s, d, 2)[..., 1]
    raise ValueError(layout)


def make_kv(b, kvh, T, d, dtype, layout="contiguous", seed=1, device="cpu"):
    """Keys and values (b, kvh, T, d) as views in various memory layouts."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    if layout == "contiguous":
        return rnd(b, kvh, T, d), rnd(b, kvh, T, d)
    if layout == "transposed":  # (batch, max_len, heads, head_dim) buffers
        return rnd(b, T, kvh, d).transpose(1, 2), rnd(b, T, kvh, d).transpose(1, 2)
    if layout == "slice":  # a window of larger buffers: every stride differs
        big_k, big_v = rnd(b + 1, kvh + 2, T + 5, d + 8), rnd(b + 1, kvh + 2, T + 5, d + 8)
        return big_k[1:, 1 : kvh + 1, 3 : T + 3, 4 : d + 4], big_v[1:, 2:, 2 : T + 2, :d]
    if layout == "fused":  # one (..., 2, head_dim) buffer: keys and values interleaved
        kv = rnd(b, kvh, T, 2, d)
        return kv[..., 0, :], kv[..., 1, :]
    if layout == "elem_strided":  # head_dim not unit-stride (the packing path)
        return rnd(b, kvh, T, d, 2)[..., 0], rnd(b, kvh, d, T).transpose(-1, -2)
    if layout == "mixed":  # keys unit-stride, values not
        return rnd(b, kvh, T, d), rnd(b, kvh, T, d, 2)[..., 1]
    raise ValueError(layout)


def check(
    b, h, kvh, s, d, T, lengths, dtype=torch.float32, *, kv_start=None, scale=None, window=0,
    softcap=0.0, q_layout="contiguous", kv_layout="contiguous", poison=True, seed=0, device="cpu",
):
    """Runs attend on poisoned caches; compares with the float64 reference on clean data
    and, exactly, with attend on the clean data."""
    lengths = torch.as_tensor(lengths, dtype=torch.int32).to(device)
    if kv_start is not None:
        kv_start = torch.as_tensor(kv_start, dtype=torch.int64).to(device)
    q = make_q(b, h, s, d, dtype, q_layout, seed, device)
    keys, values = make_kv(b, kvh, T, d, dtype, kv_layout, seed + 1, device)
    kwargs = dict(kv_start=kv_start, scale=scale, window=window, softcap=softcap)
    expected = reference(q, keys, values, lengths, **kwargs)
    with no_host_sync(device):
        clean = ATTEND(q, keys, values, lengths, **kwargs)
    if poison:
        unused = unused_slots(b, s, T, lengths.cpu(), None if kv_start is None else kv_start.cpu(), window)
        poison_(keys, unused)
        poison_(values, unused)
    with no_host_sync(device):
        out = ATTEND(q, keys, values, lengths, **kwargs)
    assert out.shape == (b, h, s, d) and out.dtype == dtype
    assert out.transpose(1, 2).is_contiguous()  # (batch, seq, heads, head_dim) memory
    assert torch.isfinite(out).all()
    assert_close(out, expected, dtype)
    assert torch.equal(out, clean), "unused slots changed the output"
    return out, expected


# --------------------------------------------------------------- numerics ---

# (batch, heads, kv_heads, seq, head_dim, max_len, lengths): every GQA ratio
# (1, 2, 4, 8), head_dim (64, 80, 96, 128, 256) and seq (1, 7, 64, 512)
# appears, in a sample of their combinations rather than the full product.
SHAPES = [
    (1, 4, 4, 1, 64, 100, [37]),
    (2, 8, 4, 1, 80, 300, [1, 300]),  # lengths == seq, and a full cache
    (3, 16, 4, 1, 128, 700, [700, 65, 129]),  # block edges
    (2, 32, 4, 1, 256, 200, [200, 3]),
    (2, 8, 1, 7, 96, 80, [7, 80]),  # group 8
    (1, 6, 3, 7, 128, 150, [100]),
    (2, 8, 2, 64, 64, 200, [64, 200]),
    (1, 8, 1, 64, 80, 130, [130]),
    (1, 4, 1, 512, 128, 600, [512]),  # prefill from empty
    (1, 2, 2, 512, 64, 520, [520]),  # chunk after 8 cached slots
]


def shape_id(shape):
    b, h, kvh, s, d, T, lengths = shape
    return f"b{b}-g{h // kvh}-s{s}-d{d}-T{T}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_matches_reference(shape, dtype, device):
    b, h, kvh, s, d, T, lengths = shape
    check(b, h, kvh, s, d, T, lengths, dtype, device=device)


@pytest.mark.parametrize("d", [1, 3, 20, 36, 72, 100])
def test_head_dim_not_multiple_of_8(d, device):
    check(2, 4, 2, 3, d, 90, [90, 5], device=device)


def test_zero_dim_lengths_applies_to_every_row():
    check(3, 4, 2, 2, 64, 40, 33)


def test_every_query_sees_exactly_its_prefix():
    """Chunked prefill of 9 queries one slot at a time equals 9 decode steps."""
    q = make_q(2, 8, 9, 64, torch.float32)
    keys, values = make_kv(2, 2, 30, 64, torch.float32)
    lengths = torch.tensor([20, 30], dtype=torch.int32)
    chunk = ATTEND(q, keys, values, lengths)
    for i in range(9):
        step = ATTEND(q[:, :, i : i + 1].contiguous(), keys, values, lengths - 8 + i)
        torch.testing.assert_close(chunk[:, :, i : i + 1], step, atol=1e-6, rtol=1e-6)


# ----------------------------------------------------- padding and windows ---


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_left_padding(dtype, device):
    check(3, 8, 2, 1, 64, 120, [100, 120, 7], dtype, kv_start=[3, 70, 6], device=device)


def test_left_padding_queries_that_see_nothing_get_zeros(device):
    # row 0: the first 4 of 7 queries sit before kv_start; row 1: nothing at all
    out, _ = check(2, 4, 2, 7, 32, 40, [20, 30], kv_start=[16, 30], device=device)
    assert torch.equal(out[0, :, :3], torch.zeros_like(out[0, :, :3]))
    assert out[0, :, 3:].abs().sum() > 0
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_kv_start_beyond_a_block_boundary_and_full_cache():
    check(2, 4, 1, 33, 128, 300, [300, 200], kv_start=[129, 64])


@pytest.mark.parametrize("window", [1, 5, 64, 65, 1000])
@pytest.mark.parametrize("s", [1, 7, 100])
def test_window(window, s, device):
    check(2, 8, 2, s, 64, 400, [s + 300, 400], window=window, device=device)


def test_window_with_left_padding_and_softcap_bf16():
    check(2, 8, 4, 5, 128, 300, [260, 300], torch.bfloat16, kv_start=[250, 10], window=30, softcap=20.0)


@pytest.mark.parametrize("softcap", [0.5, 5.0, 50.0])
def test_softcap(softcap, device):
    check(2, 8, 2, 9, 96, 150, [150, 40], softcap=softcap, scale=0.3, device=device)


@pytest.mark.parametrize("scale", [1e-3, 0.05, 1.0, 4.0])
def test_scale(scale, device):
    check(1, 4, 2, 3, 64, 70, [70], scale=scale, device=device)


def test_large_scores_do_not_overflow():
    """Scores around 1e4: the running maximum keeps exp() in range."""
    q = torch.full((1, 2, 2, 16), 30.0)
    keys = torch.randn(1, 1, 200, 16) * 30
    values = torch.randn(1, 1, 200, 16)
    lengths = torch.tensor([200], dtype=torch.int32)
    out = ATTEND(q, keys, values, lengths)
    assert_close(out, reference(q, keys, values, lengths), torch.float32)


# ------------------------------------------------------------- layouts ---


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kv_layout", ["transposed", "slice", "fused", "elem_strided", "mixed"])
def test_cache_layouts(kv_layout, dtype, device):
    check(2, 8, 2, 5, 64, 150, [150, 80], dtype, kv_layout=kv_layout, kv_start=[2, 0], window=100, device=device)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kv_layout", ["contiguous", "transposed", "slice", "fused", "mixed"])
def test_streamed_tasks_over_every_layout(kv_layout, dtype, threads):
    """Tasks whose keys and values exceed 512 KiB (the CPU kernel's streaming path: values
    asked for beside the keys, the weight pass by chunks of 8 slots) on every in-place layout,
    with lengths, kv_start and windows that end blocks and chunks off their edges."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        # 1 KiB of fp32 keys and values a slot at head_dim 128: 1100 slots are 1.1 MB a task.
        check(2, 8, 2, 1, 128, 1100, [1100, 1093], dtype, kv_layout=kv_layout, kv_start=[0, 5])
        check(1, 8, 2, 3, 128, 1100, [1037], dtype, kv_layout=kv_layout, kv_start=[61], window=1001)
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("d", [32, 96, 160])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 8])
def test_bf16_decode_every_group_and_tile_edge(group, d):
    """bf16 decode and short chunks over a bf16 cache (on AVX512-BF16 both products take bf16
    pair dot products: the scores 32 elements a step, 1-4 query rows by 4-16 slots a tile; the
    weights two slots a step, 1-4 rows by 32-128 columns a tile): every remainder of the row
    tiles (group 1-8), head_dims that are multiples of 32 but not of 64 or 128, and odd
    lengths that end slot pairs, tiles, blocks and (1799 slots: the streamed weight pass,
    by chunks) chunks off their edges."""
    check(2, 2 * group, 2, 1, d, 150, [150, 67], torch.bfloat16)
    check(1, group, 1, 3, d, 90, [77], torch.bfloat16, kv_start=[5], window=60, softcap=20.0)
    check(1, group, 1, 1, d, 140, [133], torch.bfloat16, kv_layout="slice")
    check(1, group, 1, 1, d, 1800, [1799], torch.bfloat16, kv_start=[3])


@pytest.mark.parametrize("q_layout", ["transposed", "strided"])
def test_query_layouts(q_layout, device):
    check(2, 8, 4, 6, 128, 100, [100, 50], q_layout=q_layout, kv_layout="transposed", device=device)
    # bf16 queries over a bf16 cache in place: the pair loops read the queries as given (a
    # decode, and a chunk of 40 x 4 rows that takes the GEMM loops on CPU).
    check(2, 8, 2, 1, 64, 100, [100, 51], torch.bfloat16, q_layout=q_layout, device=device)
    check(1, 8, 2, 40, 64, 300, [299], torch.bfloat16, q_layout=q_layout, device=device)


# --------------------------------------------------- threads and splits ---


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_long_rows_split_across_threads(threads, dtype):
    """Long rows of a small batch: with 2 threads, split along the slots and merged."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check(1, 8, 1, 1, 128, 9000, [8999], dtype, kv_start=[3])
        check(3, 4, 2, 1, 64, 9000, [9000, 40, 6000], dtype, kv_start=[0, 39, 5000], window=4000)
        check(1, 8, 2, 1, 128, 9000, [9000], dtype, kv_start=[8990])  # parts that see nothing
    finally:
        torch.set_num_threads(saved)


@pytest.fixture(name="forced_split")
def _forced_split():
    with kv_testing.forced_split():
        yield


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_k_decode_at_small_sizes(forced_split, dtype):
    """Batch-1 decode over a few hundred slots split into 64-slot parts and merged (max, sum, acc)."""
    check(1, 8, 1, 1, 128, 300, [256], dtype)  # one KV head: 4 parts
    check(1, 8, 2, 1, 64, 300, [300], dtype, kv_start=[70])  # a part before kv_start sees nothing
    check(1, 4, 1, 1, 128, 400, [390], dtype, window=100)  # parts outside the window
    check(1, 4, 1, 1, 20, 260, [200], dtype, softcap=5.0)  # head_dim 20: packed keys/values
    check(2, 8, 2, 1, 128, 500, [129, 500], dtype, kv_start=[0, 3])  # ragged rows, uneven parts


def test_split_k_parts_that_see_nothing_and_tiny_rows(forced_split):
    check(1, 8, 1, 1, 64, 300, [300], kv_start=[299])  # every part but the last sees nothing
    check(1, 8, 1, 1, 64, 300, [300], kv_start=[300])  # no part sees anything: zeros
    check(1, 8, 1, 1, 64, 300, [1])
    check(1, 8, 8, 1, 64, 64, [5])  # parallel, nothing to split


def test_split_k_softmax_scale_is_merged_exactly(forced_split):
    """Parts with very different maxima (one huge score): the merge rescales by 2^(m_s - M)."""
    q = torch.randn(1, 4, 1, 64)
    keys = torch.randn(1, 1, 256, 64).float()
    values = torch.randn(1, 1, 256, 64).float()
    keys[0, 0, 200] = q[0, 0, 0] * 8  # part 3 of 4 holds a dominant key for head 0
    lengths = torch.tensor([256], dtype=torch.int32)
    out = ATTEND(q, keys, values, lengths)
    assert_close(out, reference(q, keys, values, lengths), torch.float32)


def test_parallel_prefill_and_chunks_forced(forced_split):
    check(1, 8, 2, 4, 128, 300, [300])  # seq 4: tiles, no split
    check(2, 8, 2, 33, 64, 200, [200, 40], kv_start=[0, 5], window=30)


def test_attend_cpu_tuning_rejects_bad_values():
    saved = kvcache._C.attend_cpu_tuning()
    with pytest.raises(ValueError, match="parallel_work"):
        kvcache._C.set_attend_cpu_tuning(parallel_work=-1.0)
    with pytest.raises(ValueError, match="parallel_work"):
        kvcache._C.set_attend_cpu_tuning(parallel_work=float("nan"))
    with pytest.raises(ValueError, match="min_split"):
        kvcache._C.set_attend_cpu_tuning(min_split=0)
    with pytest.raises(ValueError, match="gemm_rows"):
        kvcache._C.set_attend_cpu_tuning(gemm_rows=0)
    assert kvcache._C.attend_cpu_tuning() == saved
    assert kvcache._C.attend_cpu_isa() in ("avx512bf16", "avx512vnni", "avx512", "avx2", "generic")


def test_ragged_batch_parallel_prefill():
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        check(3, 8, 2, 100, 64, 700, [700, 100, 350], kv_start=[0, 50, 3], window=200)
    finally:
        torch.set_num_threads(saved)


def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return set()


def _cpu_has_avx2() -> bool:
    return {"avx2", "fma", "f16c"} <= _cpu_flags()


# What each forced path needs of the CPU (KVCACHE_ATTEND_ISA caps the kernel's choice).
ISA_FLAGS = {"generic": set(), "avx2": {"avx2", "fma", "f16c"},
             "avx512": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"},
             "avx512vnni": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"},
             "avx512bf16": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                            "avx512_bf16"}}

ISA_SCRIPT = """
import sys, torch
sys.path.insert(0, {here!r})
import kvcache
import test_attend as t
assert kvcache._C.attend_cpu_isa() == {isa!r}, kvcache._C.attend_cpu_isa()
outs = []
for dt in (torch.float32, torch.bfloat16, torch.float16):
    outs.append(t.check(2, 8, 2, 7, 64, 150, [150, 40], dt, kv_start=[3, 0], window=100, softcap=5.0)[0])
outs.append(t.check(2, 4, 2, 3, 20, 90, [90, 5], kv_layout="elem_strided")[0])
for shape in t.SHAPES:
    t.check(*shape, torch.bfloat16)
t.check(1, 4, 1, 1, 72, 100, [77])  # head_dim 72: in place on 8 lanes, padded on 16
t.check(1, 4, 1, 1, 24, 100, [77], torch.float16)
torch.set_num_threads(2)
outs.append(t.check(1, 8, 1, 1, 128, 9000, [8999])[0])
kvcache._C.set_attend_cpu_tuning(parallel_work=0.0, min_split=1)
t.check(1, 8, 1, 1, 128, 300, [256], torch.bfloat16)
t.check(1, 3, 1, 1, 96, 140, [133], torch.bfloat16)  # bf16 pair scores: a 3-row tile, head_dim 96
import test_attend_ring_runs as rr
rr.run(1, 8, 2, 4, 128, 200, 4, [1000], torch.float32)
rr.run(1, 8, 2, 1, 128, 200, 4, [1000], torch.bfloat16)
# int8 caches with 16-bit queries: each path's integer loops (AVX2 tiles, the wide AVX-512
# tiles: 1-4 query rows, decode and chunks, a tail block) or, on generic, the float loops.
import test_attend_int8_dot as i8
i8.check(1, 9, 3, 1, 64, 300, [300], torch.bfloat16)
i8.check(2, 8, 2, 3, 128, 200, [200, 77], torch.float16)
i8.check(1, 4, 2, 5, 256, 130, [129], torch.bfloat16)
torch.save(outs, sys.argv[1])
"""


@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512", "avx512vnni", "avx512bf16"])
def test_forced_isa_path(isa, tmp_path):
    """Each kernel path the CPU has (KVCACHE_ATTEND_ISA=isa), against the float64 reference."""
    if not ISA_FLAGS[isa] <= _cpu_flags():
        pytest.skip(f"this CPU lacks {sorted(ISA_FLAGS[isa] - _cpu_flags())}")
    path = tmp_path / "outs.pt"
    env = dict(os.environ, KVCACHE_ATTEND_ISA=isa)
    proc = subprocess.run(
        [sys.executable, "-c", ISA_SCRIPT.format(here=HERE, isa=isa), str(path)],
        env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    if isa == "generic" and _cpu_has_avx2():
        # The two kernels round differently (separate multiply and add
        # against FMA, other summation orders): the subprocess really ran
        # the other one.
        here = check(2, 8, 2, 7, 64, 150, [150, 40], torch.float32, kv_start=[3, 0], window=100,
                     softcap=5.0)[0]
        assert not torch.equal(torch.load(path)[0], here)


# ------------------------------------------------------------- errors ---

B, H, KVH, S, D, T = 2, 4, 2, 1, 8, 16


def args(**over):
    a = dict(
        q=torch.randn(B, H, S, D), keys=torch.randn(B, KVH, T, D), values=torch.randn(B, KVH, T, D),
        lengths=torch.tensor([3, 4], dtype=torch.int32),
    )
    a.update(over)
    return a


ERRORS = [
    (ValueError, r"q must be a 4-D tensor of shape \(batch, num_heads, seq, head_dim\), got 3-D",
     args(q=torch.randn(H, S, D)), {}),
    (ValueError, r"keys must be a 4-D tensor .* got 5-D", args(keys=torch.randn(1, B, KVH, T, D)), {}),
    (ValueError, r"values must have the same shape as keys \[2, 2, 16, 8\], got \[2, 2, 8, 8\]",
     args(values=torch.randn(B, KVH, 8, D)), {}),
    (ValueError, r"q must have shape \(batch=2, num_heads, seq, head_dim=8\) to match the cache, got \[1, 4, 1, 8\]",
     args(q=torch.randn(1, H, S, D)), {}),
    (ValueError, r"q must have shape .* got \[2, 4, 1, 4\]", args(q=torch.randn(B, H, S, 4)), {}),
    (ValueError, r"q has num_heads=3, which must be a multiple of the cache's num_kv_heads=2",
     args(q=torch.randn(B, 3, S, D)), {}),
    (TypeError, r"q must be a torch.float32, torch.bfloat16 or torch.float16 tensor, got torch.float64",
     args(q=torch.randn(B, H, S, D, dtype=torch.float64), keys=torch.randn(B, KVH, T, D, dtype=torch.float64),
          values=torch.randn(B, KVH, T, D, dtype=torch.float64)), {}),
    (TypeError, r"q is torch.float32 but the cache's keys are torch.float16: q and the cache must have one "
                r"dtype \(no implicit casts\): pass q.to\(torch.float16\)",
     args(keys=torch.randn(B, KVH, T, D).half()), {}),
    (TypeError, r"the cache's keys are torch.float64: attend reads caches of torch.float32, torch.bfloat16 or "
                r"torch.float16 \(q's dtype\), or torch.int8 / torch.float8_e4m3fn with k_scale and v_scale",
     args(keys=torch.randn(B, KVH, T, D, dtype=torch.float64), values=torch.randn(B, KVH, T, D, dtype=torch.float64)),
     {}),
    (TypeError, r"values must have the dtype of keys torch.float32 .* got torch.bfloat16",
     args(values=torch.randn(B, KVH, T, D).bfloat16()), {}),
    (ValueError, r"keys must be on the device of q \(cpu\), got meta", args(keys=torch.empty(B, KVH, T, D, device="meta")), {}),
    (ValueError, r"lengths must be on the cache's device \(cpu\), got meta",
     args(lengths=torch.empty(B, dtype=torch.int32, device="meta")), {}),
    (ValueError, r"lengths must be <= max_len=16, got 17 at index 1", args(lengths=torch.tensor([3, 17])), {}),
    (ValueError, r"lengths must be <= max_len=16, got 1099511627776$", args(lengths=torch.tensor(2**40)), {}),
    (ValueError, r"lengths must be >= seq=1 \(the queries are the last seq filled slots\), got -1 at index 1",
     args(lengths=torch.tensor([3, -1])), {}),
    (ValueError, r"lengths must be >= seq=5 .* got 3 at index 0",
     args(q=torch.randn(B, H, 5, D), lengths=torch.tensor([3, 5])), {}),
    (ValueError, r"lengths must be >= seq=1 .* got 0$", args(lengths=torch.tensor(0)), {}),
    (TypeError, r"lengths must be an int32 or int64 tensor, got dtype torch.float32",
     args(lengths=torch.tensor([3.0, 4.0])), {}),
    (ValueError, r"lengths must be a 0-D tensor \(one value for every row\) or have shape \(batch=2,\), got shape \[3\]",
     args(lengths=torch.tensor([3, 4, 5])), {}),
    (ValueError, r"kv_start must be in \[0, lengths\] = \[0, 4\], got 5 at index 1", args(), {"kv_start": torch.tensor([0, 5])}),
    (ValueError, r"kv_start must be in \[0, lengths\] = \[0, 3\], got -1 at index 0", args(), {"kv_start": torch.tensor([-1, 0])}),
    (TypeError, r"kv_start must be an int32 or int64 tensor", args(), {"kv_start": torch.tensor([0.0, 0.0])}),
    (ValueError, r"kv_start must be a 0-D tensor .* got shape \[1, 2\]", args(), {"kv_start": torch.tensor([[0, 0]])}),
    (ValueError, r"scale must be a finite number > 0 in float32 range \(.*\), got 0", args(), {"scale": 0.0}),
    (ValueError, r"scale must be a finite number > 0 in float32 range \(.*\), got -1", args(), {"scale": -1.0}),
    (ValueError, r"scale must be a finite number > 0 in float32 range \(.*\), got nan", args(), {"scale": float("nan")}),
    (ValueError, r"scale must be a finite number > 0 in float32 range \(.*\), got inf", args(), {"scale": float("inf")}),
    (ValueError, r"window must be >= 0 \(0: no window\), got -1", args(), {"window": -1}),
    (ValueError, r"softcap must be 0 \(no cap\) or a finite number > 0 in float32 range \(.*\), got -1", args(), {"softcap": -1.0}),
    (ValueError, r"softcap must be 0 \(no cap\) or a finite number > 0 in float32 range \(.*\), got inf", args(), {"softcap": float("inf")}),
    (ValueError, r"q must be a strided \(dense\) tensor", args(q=torch.randn(B, H, S, D).to_sparse()), {}),
    (ValueError, r"q requires grad", args(q=torch.randn(B, H, S, D, requires_grad=True)), {}),
]


@pytest.mark.parametrize("exc,match,a,kw", ERRORS, ids=[e[1][:40] for e in ERRORS])
def test_errors(exc, match, a, kw):
    with pytest.raises(exc, match=match):
        ATTEND(a["q"], a["keys"], a["values"], a["lengths"], **kw)


# Checks that need only shapes, dtypes, devices and options (tracing does not
# know the values of lengths and kv_start).
TRACED_ERRORS = [
    e for e in ERRORS
    if not any(x in e[1] for x in ("lengths must be <=", "lengths must be >=", "kv_start must be in",
                                   "dense", "requires grad"))
]


@pytest.mark.parametrize("exc,match,a,kw", TRACED_ERRORS, ids=[e[1][:40] for e in TRACED_ERRORS])
def test_fake_errors_match_eager(exc, match, a, kw):
    """Traced code (fake tensors) raises what eager raises."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake = {k: mode.from_tensor(v) for k, v in a.items()}
        fkw = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
        with pytest.raises(exc, match=match):
            ATTEND(fake["q"], fake["keys"], fake["values"], fake["lengths"], **fkw)


def test_api_errors():
    cache = kvcache.init_kv_layer_cache(B, KVH, D, T, torch.float32)
    with pytest.raises(TypeError, match="cache must be a KVLayerCache, got tuple"):
        kvcache.attend(torch.randn(B, H, S, D), (cache.keys, cache.values, cache.length))
    with pytest.raises(ValueError, match="lengths must be >= seq=1"):
        kvcache.attend(torch.randn(B, H, S, D), cache)  # empty cache: nothing written yet


def test_errors_leave_inputs_untouched():
    a = args(lengths=torch.tensor([3, 17]))
    before = {k: v.clone() for k, v in a.items()}
    with pytest.raises(ValueError):
        ATTEND(a["q"], a["keys"], a["values"], a["lengths"])
    for k in a:
        assert torch.equal(a[k], before[k]), k


# --------------------------------------------------------- torch stack ---

ALL_CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def opcheck_samples():
    q, (k, v) = make_q(2, 8, 1, 64, torch.float32), make_kv(2, 2, 40, 64, torch.float32)
    yield "decode", (q, k, v, torch.tensor([40, 3], dtype=torch.int32)), {}
    q, (k, v) = make_q(2, 4, 6, 32, torch.bfloat16), make_kv(2, 2, 30, 32, torch.bfloat16)
    yield "prefill-bf16-kv_start", (q, k, v, torch.tensor([30, 6])), {"kv_start": torch.tensor([2, 0])}
    q, (k, v) = make_q(1, 4, 3, 24, torch.float16, "transposed"), make_kv(1, 1, 20, 24, torch.float16, "fused")
    yield "fp16-strided-window-softcap", (q, k, v, torch.tensor(17, dtype=torch.int32)), {
        "window": 4, "softcap": 10.0, "scale": 0.5}


@pytest.mark.parametrize("sample", list(opcheck_samples()), ids=lambda s: s[0])
def test_opcheck(sample):
    _, a, kw = sample
    result = opcheck(ATTEND, a, kw, test_utils=ALL_CHECKS)
    assert set(result) == set(ALL_CHECKS) and all(v == "SUCCESS" for v in result.values()), result


@torch.no_grad()
def test_compiled_decode_loop_without_recompiles():
    """append_ + attend under torch.compile(fullgraph=True): the lengths advance on the
    device, so one graph serves every step; results equal eager."""
    torch._dynamo.reset()
    b, kvh, h, d, cap = 2, 2, 8, 64, 96

    def step(q, cache, k, v):
        cache = kvcache.append_kv_layer_cache(cache, k, v)
        return kvcache.attend(q, cache, window=50, softcap=30.0)

    compiled = torch.compile(step, fullgraph=True)

    def fresh():
        c = kvcache.init_kv_layer_cache(b, kvh, d, cap, torch.float32)
        return kvcache.KVLayerCache(c.keys, c.values, torch.tensor([5, 9], dtype=torch.int32))

    eager_cache, comp_cache = fresh(), fresh()
    g = torch.Generator().manual_seed(7)
    inputs = [
        (torch.randn(b, h, 1, d, generator=g), torch.randn(b, kvh, 1, d, generator=g),
         torch.randn(b, kvh, 1, d, generator=g))
        for _ in range(40)
    ]
    for c in (eager_cache, comp_cache):
        c.keys[:, :, :9].copy_(torch.randn(b, kvh, 9, d, generator=torch.Generator().manual_seed(1)))
        c.values[:, :, :9].copy_(torch.randn(b, kvh, 9, d, generator=torch.Generator().manual_seed(2)))
    q, k, v = inputs[0]
    torch.testing.assert_close(compiled(q, comp_cache, k, v), step(q, eager_cache, k, v), atol=0, rtol=0)
    with torch.compiler.set_stance("fail_on_recompile"):
        for q, k, v in inputs[1:]:
            got = compiled(q, comp_cache, k, v)
            want = step(q, eager_cache, k, v)
            assert torch.equal(got, want)
    assert comp_cache.length.tolist() == [45, 49]


class AttendModule(torch.nn.Module):
    """A module whose cache lives in buffers; forward attends over it."""

    def __init__(self, keys, values, lengths):
        super().__init__()
        self.register_buffer("keys", keys)
        self.register_buffer("values", values)
        self.register_buffer("lengths", lengths)

    def forward(self, q, kv_start):
        cache = kvcache.KVLayerCache(self.keys, self.values, self.lengths)
        return kvcache.attend(q, cache, kv_start=kv_start, window=20)


@torch.no_grad()
def test_export():
    keys, values = make_kv(2, 2, 50, 32, torch.float32)
    module = AttendModule(keys, values, torch.tensor([50, 30], dtype=torch.int32))
    q = make_q(2, 4, 3, 32, torch.float32)
    kv_start = torch.tensor([0, 10])
    exported = torch.export.export(module, (q, kv_start))
    nodes = [n for n in exported.graph.nodes if n.op == "call_function" and "kvcache.attend" in str(n.target)]
    assert len(nodes) == 1
    q2 = make_q(2, 4, 3, 32, torch.float32, seed=5)
    got = exported.module()(q2, kv_start)
    want = reference(q2, keys, values, module.lengths, kv_start=kv_start, window=20)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1.3e-6)


def test_torchscript():
    def fn(q: torch.Tensor, cache: kvcache.KVLayerCache, kv_start: torch.Tensor) -> torch.Tensor:
        return kvcache.attend(q, cache, kv_start, 0.2, 10, 5.0)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scripted = torch.jit.script(fn)
    assert "kvcache::attend" in str(scripted.inlined_graph)
    keys, values = make_kv(2, 2, 40, 16, torch.float32)
    cache = kvcache.KVLayerCache(keys, values, torch.tensor([40, 25], dtype=torch.int32))
    q = make_q(2, 4, 2, 16, torch.float32)
    kv_start = torch.tensor([1, 20])
    got = scripted(q, cache, kv_start)
    want = reference(q, keys, values, cache.length, kv_start=kv_start, scale=0.2, window=10, softcap=5.0)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1.3e-6)


@torch.no_grad()
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-4), (torch.bfloat16, 0.25)], ids=["float32", "bfloat16"])
def test_decoder_cached_logits_match_uncached_across_blocks(dtype, tol):
    """Chunked prefill and decode through attend over more than two 64-slot blocks,
    against the model recomputed without a cache (a GQA ratio of 4)."""
    from kvcache.models import Decoder

    cfg = kvcache.TransformerConfig(num_layers=2, num_heads=8, d_model=128, max_len=200, num_kv_heads=2)
    model = Decoder(cfg, seed=4, dtype=dtype).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 150), generator=torch.Generator().manual_seed(9))
    full = model.forward_no_cache(tokens)
    caches = list(kvcache.init_decoder_kv_caches_from_config(cfg, batch_size=2, dtype=dtype))
    logits = []
    pos = 0
    for chunk in (70, 60):  # chunked prefill: 70, then 60 more
        out, caches = model(tokens[:, pos : pos + chunk], torch.tensor(pos), caches)
        logits.append(out)
        pos += chunk
    for _ in range(20):  # decode
        out, caches = model(tokens[:, pos : pos + 1], torch.tensor(pos), caches)
        logits.append(out)
        pos += 1
    torch.testing.assert_close(torch.cat(logits, 1), full, atol=tol, rtol=tol)
