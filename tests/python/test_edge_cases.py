"""Edge cases found by review, each against an independent reference (plain PyTorch, float64).

1. The CPU's integer loops (an int8 cache read by bf16 queries) over the whole float32 range:
   value scales so small that the weights' int16 factor overflowed, queries so small that the
   queries' one did (both rounded everything to 0).
2. attend's scale and softcap: a value whose scores overflow float32 is refused (ValueError
   naming it) instead of giving NaN; the largest accepted values give finite, exact results.
3. A split row (flash-decoding's merge of the parts of a long decode row) gives NaN where the
   unsplit row and the float64 reference do: a NaN key, query or scale, a +inf score.
4. rollback refuses a kv_start whose shape does not fit lengths (an empty one with a 0-D lengths:
   no row to check the rollback against) before any kernel runs.

CUDA's side of these (the split-K combine, select_rows_ with batch 0, long ring chunks) is in
test_cuda.py.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import kvcache
from kv_testing import forced_split, random_tensor
from references import attention_reference as reference

ops = torch.ops.kvcache
FLT_MAX = torch.finfo(torch.float32).max
LOG2E = 1.4426950408889634
BF16_TOL = 2e-2  # bf16 output rounding (2^-8) with margin, as test_attend_int8_dot.py


def dequantize(q, scale):
    return q.double() * scale.double()[..., None]


def int8_cache(b, kvh, t, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randint(-127, 128, (b, kvh, t, d), generator=g).to(torch.int8)
    values = torch.randint(-127, 128, (b, kvh, t, d), generator=g).to(torch.int8)
    return keys, values, g


def log_uniform(shape, lo, hi, g):
    """float32 values spread evenly in log scale over [lo, hi]."""
    u = torch.rand(shape, generator=g, dtype=torch.float64)
    return torch.exp(torch.log(torch.tensor(lo, dtype=torch.float64)) * (1 - u)
                     + torch.log(torch.tensor(hi, dtype=torch.float64)) * u).float()


def assert_close_relative(out, ref, tol):
    """out within tol of ref relative to ref's own magnitude (which may be 1e-32: an absolute
    tolerance would accept anything, zeros included)."""
    assert ref.abs().max() > 0
    torch.testing.assert_close(out.double(), ref, atol=tol * float(ref.abs().max()), rtol=tol)


# ------------------------------------------------- 1. integer loops, tiny scales


@pytest.mark.parametrize(
    "lo,hi",
    [(1e-35, 3e-35), (1e-34, 4e-34), (4e-34, 1e-33), (1e-35, 1e-30)],
    ids=["factor-overflows", "scale-subnormal", "at-the-edge", "mixed"],
)
def test_int8_tiny_value_scales_bf16_queries(lo, hi):
    """Value scales of 1e-35..1e-30: the weights times the scales are ~1e-35 per slot, far inside
    float32's range, and so is the output (~1e-32), which must match float64 attention over the
    dequantized cache, not be 0. Before the fix the weights' int16 factor kQMax / wmax overflowed
    to inf (wmax < 9.6e-35) or its inverse went subnormal (wmax < 3.9e-34)."""
    b, h, kvh, t, d = 2, 8, 2, 300, 64
    keys, values, g = int8_cache(b, kvh, t, d, seed=1)
    ks = torch.rand(b, kvh, t, generator=g) * 0.02 + 1e-3
    vs = log_uniform((b, kvh, t), lo, hi, g)
    q = (random_tensor((b, h, 1, d), torch.float32, seed=2) * 0.6).to(torch.bfloat16)
    lengths = torch.tensor([300, 131], dtype=torch.int32)
    for seq_q in (q, torch.cat([q] * 3, dim=2)):  # decode, and a chunk of 3 positions
        out = ops.attend(seq_q, keys, values, lengths, k_scale=ks, v_scale=vs)
        ref = reference(seq_q, dequantize(keys, ks), dequantize(values, vs), lengths)
        assert_close_relative(out, ref, BF16_TOL)


def test_int8_tiny_value_scales_in_split_rows():
    """The same in a split row (the parts' accumulators are merged): still the float64 answer."""
    keys, values, g = int8_cache(1, 1, 2000, 64, seed=3)
    ks = torch.rand(1, 1, 2000, generator=g) * 0.02 + 1e-3
    vs = log_uniform((1, 1, 2000), 1e-35, 5e-35, g)
    q = (random_tensor((1, 4, 1, 64), torch.float32, seed=4) * 0.6).to(torch.bfloat16)
    lengths = torch.tensor([1999], dtype=torch.int32)
    with forced_split():
        out = ops.attend(q, keys, values, lengths, k_scale=ks, v_scale=vs)
    ref = reference(q, dequantize(keys, ks), dequantize(values, vs), lengths)
    assert_close_relative(out, ref, BF16_TOL)


@pytest.mark.parametrize("q_size", [1e-36, 3e-35, 2e-34, 1e-33], ids=["1e-36", "3e-35", "2e-34", "1e-33"])
def test_int8_tiny_queries_huge_key_scales(q_size):
    """The score loop's rounding of the queries has the pattern of the weights': queries of
    ~1e-36 (bf16 holds them at full precision) over keys whose scales are ~1e34 give scores of a
    few units, which must decide the softmax as in float64. Before the fix the queries' int16
    factor overflowed and every score was 0 (the output the values' plain mean)."""
    b, h, kvh, t, d = 1, 4, 1, 200, 64
    keys, values, g = int8_cache(b, kvh, t, d, seed=5)
    # score ~ scale * sqrt(d) * |q| * E|k| * ks: a few units.
    ks = (torch.rand(b, kvh, t, generator=g) + 0.5) * (0.5 / q_size / 73.0)
    vs = torch.rand(b, kvh, t, generator=g) * 0.05 + 1e-3
    q = (random_tensor((b, h, 1, d), torch.float32, seed=6) / 4 * q_size).to(torch.bfloat16)
    assert (q.float().abs().max() > 0) and torch.isfinite(ks).all()
    lengths = torch.tensor([t], dtype=torch.int32)
    out = ops.attend(q, keys, values, lengths, k_scale=ks, v_scale=vs)
    ref = reference(q, dequantize(keys, ks), dequantize(values, vs), lengths)
    mean = dequantize(values, vs)[0, 0].mean(0)
    # The softmax is far from flat: the plain mean is not an answer within tolerance.
    assert (ref[0, :, 0] - mean).abs().max() > 10 * BF16_TOL * ref.abs().max()
    assert_close_relative(out, ref, BF16_TOL)


# ---------------------------------------------------- 2. scale and softcap bound


def small_case(d=64, dtype=torch.float32):
    q = random_tensor((2, 4, 1, d), torch.float32, seed=7).clamp(-1, 1).to(dtype)
    keys = random_tensor((2, 2, 16, d), torch.float32, seed=8).clamp(-1, 1).to(dtype)
    values = random_tensor((2, 2, 16, d), torch.float32, seed=9).to(dtype)
    return q, keys, values, torch.tensor([16, 9])


def scale_bound(d):
    """The largest scale attend accepts (no softcap): a score of unit query and key elements,
    |q . k| <= head_dim, times log2(e) (the kernels' base-2 units) fits float32."""
    return FLT_MAX / (LOG2E * d)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(scale=1e38), r"scale=1e\+38 makes scores overflow float32"),
        (dict(scale=2 * scale_bound(64)), r"scale=.* makes scores overflow float32"),
        (dict(scale=1e38, softcap=1e30), r"scale=1e\+38 makes scores overflow float32"),
        (dict(softcap=3e38), r"softcap=3e\+38 makes capped scores overflow float32"),
        (dict(softcap=FLT_MAX), r"softcap=.* makes capped scores overflow float32"),
        (dict(scale=1.0, softcap=1e-37), r"softcap=1e-37 is too small for scale=1"),
    ],
    ids=["scale-1e38", "scale-2x-bound", "scale-with-softcap", "softcap-3e38", "softcap-flt-max", "ratio"],
)
def test_attend_refuses_scale_or_softcap_whose_scores_overflow(kw, match):
    """scale=1e38 gave NaN (its scores overflowed to inf, and inf - inf is NaN in the softmax);
    softcap=3e38 too (softcap * log2(e) is inf). Both are refused before the kernel runs, eagerly
    and in the fake kernel (the same C++ check), naming the argument and the bound."""
    q, keys, values, lengths = small_case()
    with pytest.raises(ValueError, match=match) as eager:
        ops.attend(q, keys, values, lengths, **kw)
    assert "head_dim" in str(eager.value) or "log2(e)" in str(eager.value)
    with FakeTensorMode() as m:
        fakes = [m.from_tensor(t) for t in (q, keys, values, lengths)]
        with pytest.raises(ValueError) as traced:
            ops.attend(*fakes, **kw)
    assert str(traced.value) == str(eager.value)


def test_attend_scale_at_the_bound_is_finite_and_exact():
    """Just under the bound, with query and key elements at +-1 (the bound's premise), the largest
    score reaches ~FLT_MAX and the output is finite: the one-hot softmax of float64 attention."""
    d = 64
    q, keys, values, lengths = small_case(d)
    q = q.sign()
    q[q == 0] = 1.0
    keys[0, 0, 5] = q[0, 0, 0]  # the best key of head 0, row 0: score head_dim * scale
    keys[1, 1, 3] = -q[1, 3, 0]  # row 1, head 3: its best key is less aligned
    scale = 0.99 * scale_bound(d)
    out = ops.attend(q, keys, values, lengths, scale=scale)
    ref = reference(q, keys, values, lengths, scale=scale)
    assert torch.isfinite(out).all() and torch.isfinite(ref).all()
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    cap = 0.99 * FLT_MAX / LOG2E
    out = ops.attend(q, keys, values, lengths, softcap=cap)
    ref = reference(q, keys, values, lengths, softcap=cap)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------- 3. NaN through split rows


def poison(kind, q, keys, values, ks=None):
    """Puts the bad value where head 0..1 of row 0 (KV head 0) sees it."""
    if kind == "nan-key":
        keys[0, 0, 700, 3] = float("nan")
    elif kind == "nan-query":
        q[0, 0, 0, 3] = float("nan")
    elif kind == "inf-score":
        keys[0, 0, 700] = float("inf")
        q[0, 0:2] = q[0, 0:2].abs()  # q . inf-key = +inf for both query heads
    elif kind == "nan-key-scale":
        ks[0, 0, 700] = float("nan")
    else:
        raise AssertionError(kind)


def nan_case(kind, dtype):
    b, h, kvh, t, d = 2, 4, 2, 1500, 64
    q = random_tensor((b, h, 1, d), torch.float32, seed=10) / 4
    lengths = torch.tensor([1500, 1200], dtype=torch.int32)
    if kind == "nan-key-scale":
        keys, values, g = int8_cache(b, kvh, t, d, seed=11)
        ks = torch.rand(b, kvh, t, generator=g) * 0.02 + 1e-3
        vs = torch.rand(b, kvh, t, generator=g) * 0.05 + 1e-3
        poison(kind, q, keys, values, ks)
        q = q.to(dtype)
        return (q, keys, values, lengths), dict(k_scale=ks, v_scale=vs), (dequantize(keys, ks), dequantize(values, vs))
    keys = random_tensor((b, kvh, t, d), torch.float32, seed=12) / 4
    values = random_tensor((b, kvh, t, d), torch.float32, seed=13)
    poison(kind, q, keys, values)
    q, keys, values = q.to(dtype), keys.to(dtype), values.to(dtype)
    return (q, keys, values, lengths), {}, (keys, values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["nan-key", "nan-query", "inf-score", "nan-key-scale"])
def test_nan_reaches_the_output_of_a_split_row(kind, dtype):
    """A long decode row split into parts (forced_split: 64-slot parts, 2 threads) and merged:
    the rows that see the NaN (or the +inf score) give NaN exactly where float64 attention does,
    the others the float64 answer; the same as the unsplit call. Before the fix a NaN query gave
    zeros in a split row (its parts' running max stayed -inf, so the merge took them for parts
    that saw nothing)."""
    args, kw, (k_ref, v_ref) = nan_case(kind, dtype)
    ref = reference(args[0], k_ref, v_ref, args[3])
    nan = torch.isnan(ref)
    assert nan[0, 0].all() and not nan[1].any()  # the case is what it claims
    with forced_split():
        out = ops.attend(*args, **kw)
    serial = ops.attend(*args, **kw)
    for got in (out, serial):
        assert torch.equal(torch.isnan(got), nan), (kind, torch.isnan(got).sum(), nan.sum())
        tol = 1e-5 if dtype == torch.float32 else BF16_TOL
        torch.testing.assert_close(got[~nan].double(), ref[~nan], atol=tol, rtol=tol)


# --------------------------------------------------------- 4. rollback kv_start


def test_rollback_refuses_empty_kv_start_with_0d_lengths():
    """A 0-D lengths is checked against each row's kv_start; an empty kv_start has no row, and the
    CPU returned 0 (CUDA read one element past it). Refused by the shared check, eagerly and
    while tracing, before any kernel."""
    length = torch.tensor(8)
    for dtype in (torch.int64, torch.int32):
        empty = torch.zeros(0, dtype=dtype)
        with pytest.raises(ValueError, match=r"kv_start must be a 0-D tensor or have shape \(batch,\) with "
                                             r"batch >= 1 .* got shape \[0\]") as eager:
            ops.rollback(length, torch.tensor(2), kv_start=empty)
        with FakeTensorMode() as m:
            with pytest.raises(ValueError) as traced:
                ops.rollback(m.from_tensor(length), m.from_tensor(torch.tensor(2)), kv_start=m.from_tensor(empty))
        assert str(traced.value) == str(eager.value)
    # What still works: a 0-D or (k >= 1,) kv_start with a 0-D lengths, an empty one with an
    # empty per-row lengths (nothing to roll back).
    assert int(ops.rollback(length, torch.tensor(2), kv_start=torch.tensor(3))) == 6
    assert int(ops.rollback(length, torch.tensor(2), kv_start=torch.tensor([0, 6]))) == 6
    none = ops.rollback(torch.zeros(0, dtype=torch.int64), torch.tensor(2), kv_start=torch.zeros(0, dtype=torch.int64))
    assert none.shape == (0,)
    # A per-row lengths with a kv_start of another length: refused as before.
    with pytest.raises(ValueError, match=r"kv_start must be a 0-D tensor or have the shape of lengths \[2\]"):
        ops.rollback(torch.tensor([5, 6]), torch.tensor(1), kv_start=torch.zeros(0, dtype=torch.int64))
