"""CPU attend over chunks (many query rows per task): the GEMM micro-kernels.

A task whose block is seen by at least 32 query rows (csrc/cpu/attend_plan.h, kDefaultGemmRows;
the setting gemm_rows of kvcache._C.set_attend_cpu_tuning, or KVCACHE_ATTEND_GEMM_ROWS) packs the block's keys once, widened to float32 and
transposed, and runs S = Q K^T and O = P V as register-tiled GEMM loops (attend_kernel.h,
"Chunks"). Every check is against float64 attention over exactly the visible slots
(references.attention_reference) at the output dtype's tolerance. The shapes cover what the
packing and the tiles must get right: slot counts that leave a partial 8 x 8 tile and a partial
vector of columns, row counts that leave a partial row tile (1 to 11 rows after full tiles),
head_dims that are and are not multiples of the vector width, strided keys and values,
16-bit and quantized caches, causal chunks whose rows see different slots of a block, kv_start,
windows, softcap, sink logits, batches with ragged lengths and NaN in slots no query sees.
Every test here sets the threshold to 1 (every block through the GEMM loops); subprocess tests run
calls with the threshold at 1 and above every task (never), from the environment, on the best ISA
and on the portable one, and one test runs a chunk at the default threshold.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import kvcache
from kv_testing import random_tensor
from references import assert_close, attention_reference as reference

ops = torch.ops.kvcache
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(autouse=True)
def every_block_through_the_gemm_loops():
    """gemm_rows=1: every block of every call here takes the GEMM loops, whatever its rows (the
    default threshold would leave the small shapes to the dot-product loops)."""
    saved = kvcache._C.attend_cpu_tuning()
    kvcache._C.set_attend_cpu_tuning(gemm_rows=1)
    try:
        yield
    finally:
        kvcache._C.set_attend_cpu_tuning(**saved)


def check(b, h, kvh, s, d, t, lengths, dtype=torch.float32, seed=0, strided=False, **kw):
    q = random_tensor((b, h, s, d), torch.float32, seed=seed).mul(0.7).to(dtype)
    keys = random_tensor((b, kvh, t, d), torch.float32, seed=seed + 1).to(dtype)
    values = random_tensor((b, kvh, t, d), torch.float32, seed=seed + 2).to(dtype)
    if strided:  # element stride 2 along head_dim: keys and values packed through scratch
        keys = torch.stack([keys, torch.full_like(keys, float("nan"))], -1)[..., 0]
        values = torch.stack([values, torch.full_like(values, float("nan"))], -1)[..., 0]
        assert keys.stride(-1) == 2
    lengths = torch.tensor(lengths, dtype=torch.int32)
    kv_start = kw.pop("kv_start", None)
    kv_start = None if kv_start is None else torch.tensor(kv_start, dtype=torch.int32)
    # Slots past each row's length hold NaN: read by mistake, they would reach the output.
    for i, n in enumerate(lengths.tolist()):
        keys[i, :, n:] = float("nan")
        values[i, :, n:] = float("nan")
    out = ops.attend(q, keys, values, lengths, kv_start=kv_start, **kw)
    ref = reference(q, keys.double(), values.double(), lengths, kv_start=kv_start, **kw)
    assert_close(out, ref)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "h,kvh,s",
    # rows per task = group * positions: 16 (one full AVX2 tile of 6, twice, and 4), 17 .. 23,
    # 64, and groups 1, 2, 3, 4, 8, 9.
    [(4, 1, 4), (1, 1, 16), (1, 1, 17), (2, 1, 9), (3, 1, 7), (8, 2, 5), (9, 3, 6), (32, 8, 4),
     (4, 1, 23), (2, 2, 40), (4, 2, 128)],
)
def test_every_row_tile(h, kvh, s, dtype):
    check(1, h, kvh, s, 64, 200, [200], dtype)


def test_default_threshold():
    """At the threshold of 32 rows (the default), a chunk of 32 positions x 4 query heads per KV
    head (128 rows, one task of the larger chunk tiles) and one of 5 positions (20 rows: the
    dot-product loops)."""
    kvcache._C.set_attend_cpu_tuning(gemm_rows=32)
    check(1, 8, 2, 32, 64, 300, [300])
    check(2, 8, 2, 5, 64, 300, [300, 100], torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [16, 17, 23, 24, 31, 33, 63, 64, 65, 71, 100, 129])
def test_slot_counts_and_block_tails(n, dtype):
    """Blocks of 64 slots; a block's last 1-7 slots go through a zero-padded 8 x 8 tile and its
    columns through one vector or two; on the bf16 pair loops an odd block ends in a half pair."""
    check(1, 4, 1, 16, 64, 160, [n], dtype)


def test_bf16_key_rows_an_odd_number_of_elements_apart():
    """The bf16 pair loops read a key row's pairs as 32-bit words, so rows an odd number of
    elements apart (a view of a wider buffer) take the widening loops: still correct."""
    q = random_tensor((1, 8, 20, 64), torch.float32, seed=4).mul(0.7).bfloat16()
    buf = random_tensor((1, 2, 90, 65), torch.float32, seed=5).bfloat16()
    keys, values = buf[..., :64], buf[..., 1:]
    assert keys.stride(2) == 65 and keys.stride(3) == 1
    lengths = torch.tensor([90], dtype=torch.int32)
    out = ops.attend(q, keys, values, lengths)
    assert_close(out, reference(q, keys.double(), values.double(), lengths))


@pytest.mark.parametrize("d", [8, 16, 24, 40, 64, 72, 128, 136, 256, 12, 100])
def test_head_dims(d):
    """Multiples of 8 take the GEMM loops (8 x 8 packing tiles), whatever the vector width; 12 and
    100 are left to the dot-product loops."""
    check(1, 8, 2, 8, d, 90, [90], scale=d**-0.5)
    check(1, 8, 2, 8, d, 90, [90], torch.bfloat16, scale=d**-0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_keys_and_values(dtype):
    check(2, 8, 2, 9, 64, 150, [150, 99], dtype, strided=True)


def test_causal_rows_see_different_slots_of_a_block():
    """A chunk of 40 positions over 45 slots: the block's rows see 6 to 45 slots each."""
    check(1, 4, 1, 40, 32, 64, [45])


def test_ragged_batch_kv_start_window_softcap():
    check(3, 8, 2, 12, 64, 300, [300, 30, 170], kv_start=[9, 0, 100], window=70, softcap=30.0)
    check(2, 4, 1, 20, 64, 100, [20, 100], torch.bfloat16, kv_start=[20, 3])  # row 0 sees nothing


def test_sink_logits():
    sink = torch.linspace(-2.0, 3.0, 8)
    check(1, 8, 2, 10, 64, 120, [120], sink_logits=sink)


@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3fn"])
def test_quantized_caches(kv_dtype):
    """fp32 queries over an int8 or fp8 cache: the packing widens the quantized elements, the
    slot scales go on the scores and weights as in the dot-product loops."""
    if kv_dtype == "float8_e4m3fn" and not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("no float8 in this torch")
    b, h, kvh, s, d, t = 2, 8, 2, 8, 64, 140
    g = torch.Generator().manual_seed(3)
    if kv_dtype == "int8":
        keys = torch.randint(-127, 128, (b, kvh, t, d), generator=g).to(torch.int8)
        values = torch.randint(-127, 128, (b, kvh, t, d), generator=g).to(torch.int8)
    else:
        keys = torch.randn(b, kvh, t, d, generator=g).mul(8).to(torch.float8_e4m3fn)
        values = torch.randn(b, kvh, t, d, generator=g).mul(8).to(torch.float8_e4m3fn)
    ks = torch.rand(b, kvh, t, generator=g) * 0.02 + 1e-3
    vs = torch.rand(b, kvh, t, generator=g) * 0.05 + 1e-3
    q = torch.randn(b, h, s, d, generator=g)
    lengths = torch.tensor([140, 77], dtype=torch.int32)
    out = ops.attend(q, keys, values, lengths, k_scale=ks, v_scale=vs)
    ref = reference(q, keys.double() * ks.double()[..., None], values.double() * vs.double()[..., None], lengths)
    assert_close(out, ref)


def test_nan_in_a_visible_key_reaches_only_its_rows():
    b, h, kvh, s, d, t = 1, 4, 1, 16, 64, 64
    q = random_tensor((b, h, s, d), torch.float32, seed=1)
    keys = random_tensor((b, kvh, t, d), torch.float32, seed=2)
    values = random_tensor((b, kvh, t, d), torch.float32, seed=3)
    keys[0, 0, 55, 7] = float("nan")  # seen by the positions at 55 and after: the last 9
    out = ops.attend(q, keys, values, torch.tensor(64))
    pos = torch.arange(48, 64)
    assert out[0, :, pos >= 55].isnan().all()
    assert not out[0, :, pos < 55].isnan().any()


GEMM_ROWS_SCRIPT = """
import sys, torch
sys.path.insert(0, {here!r})
import test_attend_gemm as t
outs = [t.check(1, 4, 2, 3, 64, 150, [150]),          # 6 rows a task
        t.check(2, 8, 2, 33, 40, 200, [200, 61]),      # 132 rows (tiles of 16 positions)
        t.check(1, 3, 1, 5, 24, 70, [70], torch.bfloat16, window=20),
        t.check(1, 4, 1, 64, 64, 300, [300], kv_start=[5])]
torch.save(outs, sys.argv[1])
"""


@pytest.mark.parametrize("isa", ["best", "generic"])
def test_gemm_loops_forced_on_and_off(tmp_path, isa):
    """KVCACHE_ATTEND_GEMM_ROWS=1 sends every block (down to one row) through the GEMM loops, a
    threshold above every task sends none: both are correct (each check is against the float64
    reference), and they give other bits, so both loops really ran."""
    results = {}
    for rows in ("1", "100000"):
        env = dict(os.environ, KVCACHE_ATTEND_GEMM_ROWS=rows)
        if isa == "generic":
            env["KVCACHE_ATTEND_ISA"] = "generic"
        path = tmp_path / f"out{rows}.pt"
        proc = subprocess.run([sys.executable, "-c", GEMM_ROWS_SCRIPT.format(here=HERE), str(path)],
                              env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[rows] = torch.load(path)
    assert any(not torch.equal(a, b) for a, b in zip(results["1"], results["100000"]))


PAIRS_SCRIPT = """
import sys, torch
sys.path.insert(0, {here!r})
import kvcache
import test_attend_gemm as t
assert kvcache._C.attend_cpu_isa() == {isa!r}, kvcache._C.attend_cpu_isa()
bf = torch.bfloat16
outs = [t.check(1, 32, 8, 40, 128, 300, [300], bf),                      # GQA 4, 160 rows
        t.check(2, 8, 2, 33, 64, 200, [200, 61], bf, softcap=20.0),      # ragged, odd blocks
        t.check(1, 4, 1, 40, 256, 95, [95], bf, window=30, kv_start=[2]),
        t.check(1, 8, 2, 16, 16, 77, [77], bf, sink_logits=torch.linspace(-1, 2, 8))]
torch.save(outs, sys.argv[1])
"""


def test_bf16_pair_loops_against_the_widening_loops(tmp_path):
    """On AVX512-BF16 a bf16 chunk's blocks take the bf16 pair dot products (attend_kernel.h,
    "Chunks on bf16 pairs"; KVCACHE_ATTEND_ISA=avx512bf16), KVCACHE_ATTEND_ISA=avx512 the float32
    loops over widened keys and values: both within the bf16 tolerance of the float64 reference
    (each check), and with other bits, so the pair loops really ran."""
    flags = set()
    with open("/proc/cpuinfo") as f:
        flags = set(next((line for line in f if line.startswith("flags")), "").split())
    if not {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= flags:
        pytest.skip("this CPU lacks AVX512-BF16")
    results = {}
    for isa in ("avx512bf16", "avx512"):
        env = dict(os.environ, KVCACHE_ATTEND_ISA=isa, KVCACHE_ATTEND_GEMM_ROWS="1")
        path = tmp_path / f"{isa}.pt"
        proc = subprocess.run([sys.executable, "-c", PAIRS_SCRIPT.format(here=HERE, isa=isa), str(path)],
                              env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[isa] = torch.load(path)
    assert all(not torch.equal(a, b) for a, b in zip(results["avx512bf16"], results["avx512"]))
