"""Quantized caches (int8 and float8_e4m3fn with per-slot float32 scales).

Every check is against plain PyTorch: the quantization against a reference
written here from the format's definition (README "Quantized caches"), the
attention against float64 attention over the dequantized cache
(test_attend.reference), row operations against slicing.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import kvcache
from references import attention_reference as reference
from references import quantize_reference as ref_quantize
from references import QUANT_MAX as QMAX
from kv_testing import as_bytes, random_tensor

ops = torch.ops.kvcache
HERE = os.path.dirname(os.path.abspath(__file__))
FLT_MIN = torch.finfo(torch.float32).tiny
KV_DTYPES = [torch.int8, torch.float8_e4m3fn]


# ------------------------------------------------------------ reference ---


def dequantize(q, scale):
    return q.double() * scale.double()[..., None]


def qcache(b, h, t, d, kv_dtype, seed=50):
    """A quantized cache pre-filled with random bytes and scales (untouched slots are checked too)."""
    c = kvcache.init_kv_layer_cache(b, h, d, t, torch.float32, kv_dtype=kv_dtype)
    g = torch.Generator().manual_seed(seed)
    if kv_dtype == torch.int8:
        c.keys.copy_(torch.randint(-127, 128, c.keys.shape, generator=g).to(torch.int8))
        c.values.copy_(torch.randint(-127, 128, c.keys.shape, generator=g).to(torch.int8))
    else:
        c.keys.copy_((torch.randn(c.keys.shape, generator=g) * 50).clamp(-448, 448).to(kv_dtype))
        c.values.copy_((torch.randn(c.keys.shape, generator=g) * 50).clamp(-448, 448).to(kv_dtype))
    c.k_scale.copy_(torch.rand(c.k_scale.shape, generator=g) * 0.05 + 1e-3)
    c.v_scale.copy_(torch.rand(c.v_scale.shape, generator=g) * 0.05 + 1e-3)
    return c


def snapshot(c):
    return [t.clone() for t in (c.keys, c.values, c.k_scale, c.v_scale)]


def assert_bytes_equal(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.equal(as_bytes(a), as_bytes(b))


def expected_after_write(before, kn, vn, starts, kv_dtype):
    keys, values, ks, vs = [t.clone() for t in before]
    qk, sk = ref_quantize(kn, kv_dtype)
    qv, sv = ref_quantize(vn, kv_dtype)
    chunk = kn.shape[2]
    for b, s in enumerate(starts):
        keys[b, :, s : s + chunk] = qk[b]
        values[b, :, s : s + chunk] = qv[b]
        ks[b, :, s : s + chunk] = sk[b]
        vs[b, :, s : s + chunk] = sv[b]
    return keys, values, ks, vs


# ------------------------------------------------------------- formats ---


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("mode", ["host", "tensor-ragged", "append"])
def test_write_is_bit_exact(kv_dtype, dtype, mode):
    B, H, T, D, C = 3, 2, 20, 24, 5
    c = qcache(B, H, T, D, kv_dtype)
    kn = (random_tensor((B, H, C, D), torch.float32, seed=1) * 3).to(dtype)
    vn = (random_tensor((B, H, C, D), torch.float32, seed=2) * 0.01).to(dtype)
    kn[0, 0, 0] = 0  # an all-zero slot: scale at the floor, zeros stay zeros
    before = snapshot(c)
    if mode == "host":
        out = kvcache.update_kv_layer_cache(c, kn, vn, 7)
        starts = [7] * B
        assert int(out.length) == 12
    elif mode == "tensor-ragged":
        starts = [0, 15, 6]
        out = kvcache.update_kv_layer_cache(c, kn, vn, torch.tensor(starts))
        assert out.length.tolist() == [s + C for s in starts]
    else:
        starts = [2, 0, 9]
        c = kvcache.KVLayerCache(c.keys, c.values, torch.tensor(starts, dtype=torch.int32), c.k_scale, c.v_scale)
        kvcache.append_kv_layer_cache(c, kn, vn)
        assert c.length.tolist() == [s + C for s in starts]
    want = expected_after_write(before, kn, vn, starts, kv_dtype)
    for got, exp in zip((c.keys, c.values, c.k_scale, c.v_scale), want):
        assert_bytes_equal(got, exp)
    assert float(c.k_scale[0, 0, starts[0]]) == FLT_MIN
    assert torch.equal(c.keys[0, 0, starts[0]].float(), torch.zeros(D))


def test_int8_rounds_half_away_from_zero_and_clamps():
    # absmax 127 -> scale exactly 1: the stored value is round(x).
    vals = [127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.49999997, -0.49999997, 126.5, -127.0, 3.4999998, 0.0, -0.0]
    x = torch.tensor(vals).reshape(1, 1, 1, -1)
    c = kvcache.init_kv_layer_cache(1, 1, x.shape[-1], 4, torch.float32, kv_dtype="int8")
    kvcache.update_kv_layer_cache(c, x, x.clone(), 0)
    assert float(c.k_scale[0, 0, 0]) == 1.0
    assert c.keys[0, 0, 0].tolist() == [127, 1, 2, 3, -1, -2, -3, 0, 0, 127, -127, 3, 0, 0]


def test_fp8_rounding_matches_torch_on_every_midpoint():
    """With absmax 448 the scale is 1 and the stored value is e4m3(x): every representable value,
    every midpoint between neighbours (ties to even) and points just off them, against torch's cast."""
    e4m3 = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    mids = (e4m3[1:] + e4m3[:-1]) / 2
    eps = torch.finfo(torch.float32).eps
    pts = torch.cat([e4m3, mids, mids * (1 + eps), mids * (1 - eps), torch.rand(2000) * 448])
    pts = torch.cat([pts, -pts, torch.tensor([448.0])])
    pts = torch.cat([pts, torch.full(((-pts.numel()) % 63,), 448.0)]).reshape(-1, 63)
    x = torch.cat([pts, torch.full((pts.shape[0], 1), 448.0)], 1).reshape(1, 1, -1, 64)  # every slot holds 448
    c = kvcache.init_kv_layer_cache(1, 1, 64, x.shape[2], torch.float32, kv_dtype="fp8")
    kvcache.update_kv_layer_cache(c, x, x.clone(), 0)
    assert torch.equal(c.k_scale, torch.ones_like(c.k_scale))
    assert_bytes_equal(c.keys, x.to(torch.float8_e4m3fn))
    assert not c.keys.float().isnan().any()


def test_fp8_saturates_never_nan():
    # Tiny slot scales below the floor and values whose quotient rounds above 448.
    x = torch.tensor([[3.0e-39, -1.0e-39, 0.0, 2.9e-39], [1.0, 0.999999, -1.0, 0.5]]).reshape(1, 1, 2, 4)
    c = kvcache.init_kv_layer_cache(1, 1, 4, 2, torch.float32, kv_dtype="fp8")
    kvcache.update_kv_layer_cache(c, x, x.clone(), 0)
    q, s = ref_quantize(x, torch.float8_e4m3fn)
    assert_bytes_equal(c.keys, q)
    assert torch.equal(c.k_scale, s)
    assert not c.keys.float().isnan().any()
    assert c.keys.float().abs().max() <= 448


def test_nan_input_is_ignored_by_absmax_and_stored_as_zero():
    x = torch.tensor([float("nan"), 2.0, -1.0, 0.5]).reshape(1, 1, 1, 4)
    for kv_dtype in KV_DTYPES:
        c = kvcache.init_kv_layer_cache(1, 1, 4, 1, torch.float32, kv_dtype=kv_dtype)
        kvcache.update_kv_layer_cache(c, x, x.clone(), 0)
        q, s = ref_quantize(x, kv_dtype)
        assert_bytes_equal(c.keys, q)
        assert float(c.k_scale) == float(torch.tensor(2.0) / QMAX[kv_dtype]) and float(c.keys[0, 0, 0, 0]) == 0.0


def test_infinite_input_makes_the_slot_scale_infinite():
    """An infinite element makes its slot's absmax, so its scale, infinite and every stored value 0:
    the slot reads back as NaN (0 x inf), as attention over an infinite key would give; the other
    slots are quantized as always."""
    x = torch.tensor([[float("inf"), 2.0, -1.0, 0.5], [1.0, float("-inf"), 3.0, 0.0],
                      [1.0, -2.0, 3.0, 0.25]]).reshape(1, 1, 3, 4)
    for kv_dtype in KV_DTYPES:
        c = kvcache.init_kv_layer_cache(1, 1, 4, 3, torch.float32, kv_dtype=kv_dtype)
        kvcache.update_kv_layer_cache(c, x, x.clone(), 0)
        q, s = ref_quantize(x, kv_dtype)
        assert_bytes_equal(c.keys, q)
        assert torch.equal(c.k_scale, s)
        assert c.k_scale[0, 0, :2].isinf().all() and not c.keys[0, 0, :2].float().any()
        assert float(c.k_scale[0, 0, 2]) == float(torch.tensor(3.0) / QMAX[kv_dtype])


def test_strided_new_data_and_cache():
    """A (batch, chunk, heads, head_dim) projection and a (batch, max_len, heads, head_dim) cache."""
    B, H, T, D, C = 2, 3, 10, 16, 4
    keys = torch.zeros(B, T, H, D, dtype=torch.int8).transpose(1, 2)
    values = torch.zeros(B, T, H, D, dtype=torch.int8).transpose(1, 2)
    ks = torch.zeros(B, T, H).transpose(1, 2)
    vs = torch.zeros(B, T, H).transpose(1, 2)
    kn = torch.randn(B, C, H, D).transpose(1, 2)
    vn = torch.randn(B, C, H, D).transpose(1, 2)
    ops.update_quantized_(keys, values, ks, vs, kn, vn, 3)
    qk, sk = ref_quantize(kn, torch.int8)
    assert torch.equal(keys[:, :, 3:7], qk) and torch.equal(ks[:, :, 3:7], sk)
    assert torch.equal(keys[:, :, :3], torch.zeros_like(keys[:, :, :3]))
    q = torch.randn(B, H, 2, D)
    out = ops.attend(q, keys, values, torch.tensor(7), k_scale=ks, v_scale=vs)
    ref = reference(q, dequantize(keys, ks), dequantize(values, vs), torch.tensor(7))
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)


# -------------------------------------------------------------- attend ---


def check_attend(b, h, kvh, s, d, t, lengths, kv_dtype, dtype=torch.float32, **kw):
    c = qcache(b, kvh, t, d, kv_dtype, seed=7)
    lengths = torch.tensor(lengths, dtype=torch.int32)
    q = random_tensor((b, h, s, d), torch.float32, seed=3).to(dtype) * 0.3
    kv_start = kw.pop("kv_start", None)
    ks = None if kv_start is None else torch.tensor(kv_start)
    out = ops.attend(q, c.keys, c.values, lengths, kv_start=ks, k_scale=c.k_scale, v_scale=c.v_scale, **kw)
    ref = reference(q, dequantize(c.keys, c.k_scale), dequantize(c.values, c.v_scale), lengths, kv_start=ks, **kw)
    tol = {torch.float32: (2e-5, 1e-4), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}[dtype]
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, atol=tol[0], rtol=tol[1])
    return out


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize(
    "shape",
    [
        (1, 4, 4, 1, 64, 100, [77]),  # decode, MHA
        (2, 8, 2, 1, 64, 300, [300, 31]),  # decode, GQA, ragged
        (2, 9, 3, 64, 64, 200, [200, 64]),  # prefill chunk, GQA 3 (SmolLM2's)
        (3, 4, 1, 7, 20, 90, [90, 7, 50]),  # head_dim not a multiple of 8, MQA
    ],
    ids=lambda s: "x".join(map(str, s[:6])),
)
def test_attend_matches_float64_over_dequantized(kv_dtype, shape):
    check_attend(*shape, kv_dtype)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_attend_half_queries(kv_dtype, dtype):
    check_attend(2, 8, 2, 3, 64, 150, [150, 40], kv_dtype, dtype)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
def test_attend_kv_start_window_softcap_scale(kv_dtype):
    check_attend(2, 8, 2, 7, 64, 150, [150, 40], kv_dtype, kv_start=[3, 0], window=100, softcap=5.0)
    check_attend(2, 4, 2, 5, 32, 100, [100, 70], kv_dtype, kv_start=[90, 10], scale=0.3)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
def test_attend_long_rows_split_across_threads(threads, kv_dtype):
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check_attend(1, 9, 3, 1, 64, 5000, [4999], kv_dtype, kv_start=[3])
        check_attend(3, 4, 2, 1, 64, 3000, [3000, 40, 2000], kv_dtype, kv_start=[0, 39, 1500], window=1200)
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
def test_chunked_prefill_through_the_cache(kv_dtype):
    """Chunks of 16 written and attended in turn: every chunk reads the quantized history."""
    B, H, KVH, D, T, C = 2, 6, 2, 32, 96, 16
    c = kvcache.init_kv_layer_cache(B, KVH, D, T, torch.float32, kv_dtype=kv_dtype)
    c = kvcache.KVLayerCache(c.keys, c.values, torch.zeros(B, dtype=torch.int32), c.k_scale, c.v_scale)
    g = torch.Generator().manual_seed(0)
    ks = torch.randn(B, KVH, T, D, generator=g)
    vs = torch.randn(B, KVH, T, D, generator=g)
    for i in range(T // C):
        q = torch.randn(B, H, C, D, generator=g)
        kvcache.append_kv_layer_cache(c, ks[:, :, i * C : (i + 1) * C], vs[:, :, i * C : (i + 1) * C])
        out = kvcache.attend(q, c, window=40)
        qk, sk = ref_quantize(ks[:, :, : (i + 1) * C], kv_dtype)
        qv, sv = ref_quantize(vs[:, :, : (i + 1) * C], kv_dtype)
        ref = reference(q, dequantize(qk, sk), dequantize(qv, sv), c.length, window=40)
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
        # and close to attention over the unquantized keys/values
        exact = reference(q, ks[:, :, : (i + 1) * C], vs[:, :, : (i + 1) * C], c.length, window=40)
        tol = 0.02 if kv_dtype == torch.int8 else 0.15
        assert (out.double() - exact).abs().max() < tol


def test_portable_kernel_on_quantized_cache(tmp_path):
    """The baseline-ISA kernel (KVCACHE_ATTEND_ISA=generic) against the reference."""
    script = (
        "import sys, torch\nsys.path.insert(0, {here!r})\nimport test_quant as t\n"
        "for kd in t.KV_DTYPES:\n"
        "    t.check_attend(2, 8, 2, 7, 64, 150, [150, 40], kd, kv_start=[3, 0], window=100, softcap=5.0)\n"
        "    t.check_attend(3, 4, 1, 7, 20, 90, [90, 7, 50], kd, torch.bfloat16)\n"
        "print('ok')\n"
    ).format(here=HERE)
    env = dict(os.environ, KVCACHE_ATTEND_ISA="generic")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


# ---------------------------------------------------------- row ops ---


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
def test_select_rows_moves_scales_with_data(kv_dtype):
    c = qcache(3, 2, 12, 8, kv_dtype)
    c = kvcache.KVLayerCache(c.keys, c.values, torch.tensor([5, 12, 3], dtype=torch.int32), c.k_scale, c.v_scale)
    before = snapshot(c)
    index = torch.tensor([2, 0, 0])
    kvcache.select_rows_kv_layer_cache(c, index)
    assert c.length.tolist() == [3, 5, 5]
    for got, old in zip((c.keys, c.values, c.k_scale, c.v_scale), before):
        for b, src in enumerate(index.tolist()):
            n = int(c.length[b])
            assert_bytes_equal(got[b, :, :n], old[src, :, :n])
    q = torch.randn(3, 4, 1, 8)
    out = kvcache.attend(q, c)
    ref = reference(q, dequantize(c.keys, c.k_scale), dequantize(c.values, c.v_scale), c.length)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)


def test_rollback_and_reset_touch_only_lengths():
    c = qcache(2, 2, 12, 8, torch.int8)
    c = kvcache.KVLayerCache(c.keys, c.values, torch.tensor([5, 9], dtype=torch.int32), c.k_scale, c.v_scale)
    before = snapshot(c)
    kvcache.rollback_kv_layer_cache(c, torch.tensor([2, 4]))
    assert c.length.tolist() == [3, 5]
    kvcache.reset_rows_kv_layer_cache(c, torch.tensor([False, True]))
    assert c.length.tolist() == [3, 0]
    for got, old in zip((c.keys, c.values, c.k_scale, c.v_scale), before):
        assert_bytes_equal(got, old)
    # the next write goes where the rows now end
    kn = torch.randn(2, 2, 1, 8)
    kvcache.append_kv_layer_cache(c, kn, kn.clone())
    q, s = ref_quantize(kn, torch.int8)
    assert torch.equal(c.keys[0, :, 3], q[0, :, 0]) and torch.equal(c.keys[1, :, 0], q[1, :, 0])
    assert torch.equal(c.k_scale[1, :, 0], s[1, :, 0])


# ------------------------------------------------------- bad input ---


def _write_errors(kv_dtype):
    B, H, T, D = 2, 2, 8, 4
    k = torch.zeros(B, H, T, D, dtype=kv_dtype)
    v = torch.zeros(B, H, T, D, dtype=kv_dtype)
    ks, vs = torch.ones(B, H, T), torch.ones(B, H, T)
    kn, vn = torch.randn(B, H, 2, D), torch.randn(B, H, 2, D)
    yield ValueError, "KV cache overflow: end=9 exceeds max_len=8", (k, v, ks, vs, kn, vn, 7)
    yield ValueError, r"k_scale must have shape \(batch=2, num_kv_heads=2, max_len=8\)", (
        k, v, torch.ones(B, H, T + 1), vs, kn, vn, 0)
    yield TypeError, "v_scale must have the scale dtype torch.float32", (k, v, ks, vs.double(), kn, vn, 0)
    yield ValueError, "k_scale and v_scale must not share memory", (k, v, ks, ks, kn, vn, 0)
    yield ValueError, "k_scale must not share memory with keys or values", (
        k, v, k.view(torch.float32).reshape(B, H, T), vs, kn, vn, 0)
    yield TypeError, "keys_new must be a torch.float32, torch.bfloat16 or torch.float16 tensor", (
        k, v, ks, vs, kn.double(), vn.double(), 0)
    yield TypeError, "values_new must have the dtype of keys_new torch.float32", (k, v, ks, vs, kn, vn.half(), 0)
    other = torch.float8_e4m3fn if kv_dtype == torch.int8 else torch.int8
    yield TypeError, "values must have the same dtype as keys", (k, v.to(other), ks, vs, kn, vn, 0)
    yield TypeError, "keys must be a torch.int8 or torch.float8_e4m3fn tensor", (
        k.float(), v.float(), ks, vs, kn, vn, 0)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
def test_bad_writes_raise_and_write_nothing(kv_dtype):
    for exc, match, args in _write_errors(kv_dtype):
        before = [a.clone() for a in args[:4]]
        with pytest.raises(exc, match=match):
            ops.update_quantized_(*args)
        for a, b in zip(args[:4], before):
            assert_bytes_equal(a, b)
        # the same with a start tensor (one per row), and append_
        start = torch.tensor([args[-1], 0])
        with pytest.raises(exc, match=match):
            ops.update_quantized_.Tensor(*args[:-1], start)
        lengths = start.clone()
        with pytest.raises(exc, match=match):
            ops.append_quantized_(*args[:4], lengths, *args[4:6])
        assert lengths.tolist() == start.tolist()
        for a, b in zip(args[:4], before):
            assert_bytes_equal(a, b)


def test_attend_errors():
    c = qcache(2, 2, 8, 4, torch.int8)
    q = torch.randn(2, 2, 1, 4)
    n = torch.tensor(3)
    with pytest.raises(ValueError, match=r"quantized cache \(torch.int8\): pass both k_scale and v_scale"):
        ops.attend(q, c.keys, c.values, n, k_scale=c.k_scale)
    with pytest.raises(ValueError, match="k_scale and v_scale are the scales of a quantized cache"):
        ops.attend(q, c.keys.float(), c.values.float(), n, k_scale=c.k_scale, v_scale=c.v_scale)
    with pytest.raises(TypeError, match="values must have the dtype of keys"):
        ops.attend(q, c.keys, c.values.to(torch.float8_e4m3fn), n, k_scale=c.k_scale, v_scale=c.v_scale)
    with pytest.raises(ValueError, match=r"v_scale must have shape \(batch=2, num_kv_heads=2, max_len=8\)"):
        ops.attend(q, c.keys, c.values, n, k_scale=c.k_scale, v_scale=c.v_scale[:, :, :4])


def test_kv_dtype_spellings():
    for spelling, dt in (("int8", torch.int8), ("fp8", torch.float8_e4m3fn), (torch.int8, torch.int8),
                         (torch.float8_e4m3fn, torch.float8_e4m3fn)):
        c = kvcache.init_kv_layer_cache(2, 3, 8, 16, torch.bfloat16, kv_dtype=spelling)
        assert c.keys.dtype == dt and c.values.dtype == dt and c.quantized
        assert c.k_scale.shape == (2, 3, 16) and c.k_scale.dtype == torch.float32
    with pytest.raises(TypeError, match='kv_dtype must be None, "int8", "fp8"'):
        kvcache.init_kv_layer_cache(2, 3, 8, 16, torch.float32, kv_dtype="int4")
    caches = kvcache.init_decoder_kv_caches(
        num_layers=2, batch_size=1, num_kv_heads=1, head_dim=8, max_len=4, dtype=torch.float32, kv_dtype="fp8"
    )
    assert all(c.quantized and c.keys.dtype == torch.float8_e4m3fn for c in caches)
    assert not kvcache.init_kv_layer_cache(1, 1, 8, 4, torch.float32).quantized


def test_memory_is_about_a_quarter_of_fp32():
    B, H, T, D = 1, 3, 2048, 64
    plain = kvcache.init_kv_layer_cache(B, H, D, T, torch.float32)
    q = kvcache.init_kv_layer_cache(B, H, D, T, torch.float32, kv_dtype="int8")
    nbytes = lambda *ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    ratio = nbytes(q.keys, q.values, q.k_scale, q.v_scale) / nbytes(plain.keys, plain.values)
    assert ratio == pytest.approx((D + 4) / (4 * D))  # 0.265 at head_dim 64
    assert ratio <= 0.30


# ------------------------------------------------- compile and export ---


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
def test_compiled_decode_loop_does_not_recompile(kv_dtype):
    B, H, KVH, D, T = 2, 4, 2, 16, 32

    def step(cache, k, v, q):
        cache = kvcache.update_kv_layer_cache(cache, k, v, cache.length)
        return cache.length, kvcache.attend(q, cache)

    c = kvcache.init_kv_layer_cache(B, KVH, D, T, torch.float32, kv_dtype=kv_dtype)
    c = kvcache.KVLayerCache(c.keys, c.values, torch.tensor([3, 0], dtype=torch.int32), c.k_scale, c.v_scale)
    ref = kvcache.KVLayerCache(c.keys.clone(), c.values.clone(), c.length.clone(), c.k_scale.clone(),
                               c.v_scale.clone())
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    g = torch.Generator().manual_seed(0)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(5):
            k, v, q = (torch.randn(B, KVH, 1, D, generator=g), torch.randn(B, KVH, 1, D, generator=g),
                       torch.randn(B, H, 1, D, generator=g))
            length, out = compiled(c, k, v, q)
            c = kvcache.KVLayerCache(c.keys, c.values, length, c.k_scale, c.v_scale)
            rlength, rout = step(ref, k, v, q)
            ref = kvcache.KVLayerCache(ref.keys, ref.values, rlength, ref.k_scale, ref.v_scale)
            assert torch.equal(length, rlength)
            torch.testing.assert_close(out, rout, atol=1e-6, rtol=1e-5)
    for a, b in zip(snapshot(c), snapshot(ref)):
        assert_bytes_equal(a, b)


def test_compiled_append_and_export():
    B, KVH, D, T = 1, 2, 8, 16
    c = kvcache.init_kv_layer_cache(B, KVH, D, T, torch.float32, kv_dtype="int8")
    kn = torch.randn(B, KVH, 3, D)

    def f(keys, values, ks, vs, lengths, kn, vn):
        cache = kvcache.KVLayerCache(keys, values, lengths, ks, vs)
        kvcache.append_kv_layer_cache(cache, kn, vn)
        return kvcache.attend(torch.ones(B, 2, 3, D), cache)

    eager_c = [t.clone() for t in (c.keys, c.values, c.k_scale, c.v_scale, c.length)]
    want = f(*eager_c, kn, kn * 2)
    torch._dynamo.reset()
    got_c = [t.clone() for t in (c.keys, c.values, c.k_scale, c.v_scale, c.length)]
    got = torch.compile(f, fullgraph=True)(*got_c, kn, kn * 2)
    torch.testing.assert_close(got, want)
    for a, b in zip(got_c, eager_c):
        assert_bytes_equal(a, b)

    class M(torch.nn.Module):
        def forward(self, keys, values, ks, vs, lengths, kn, vn):
            return f(keys, values, ks, vs, lengths, kn, vn)

    ex_c = [t.clone() for t in (c.keys, c.values, c.k_scale, c.v_scale, c.length)]
    ep = torch.export.export(M(), (*ex_c, kn, kn * 2))
    ex_c = [t.clone() for t in (c.keys, c.values, c.k_scale, c.v_scale, c.length)]
    torch.testing.assert_close(ep.module()(*ex_c, kn, kn * 2), want)


# ----------------------------------------------------------- property ---

try:
    from hypothesis import given, settings
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover
    given = None

if given is not None:

    @settings(max_examples=40, deadline=None)
    @given(
        b=st.integers(1, 3),
        h=st.integers(1, 3),
        d=st.integers(1, 40),
        chunk=st.integers(1, 6),
        extra=st.integers(0, 5),
        kv=st.sampled_from(KV_DTYPES),
        dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
        magnitude=st.sampled_from([1e-30, 1e-3, 1.0, 1e4]),
        seed=st.integers(0, 2**16),
    )
    def test_property_write_then_attend(b, h, d, chunk, extra, kv, dtype, magnitude, seed):
        t = chunk + extra
        g = torch.Generator().manual_seed(seed)
        kn = (torch.randn(b, h, chunk, d, generator=g) * magnitude).to(dtype)
        vn = (torch.randn(b, h, chunk, d, generator=g) * magnitude).to(dtype)
        starts = torch.randint(0, extra + 1, (b,), generator=g)
        c = qcache(b, h, t, d, kv, seed=seed)
        before = snapshot(c)
        out = kvcache.update_kv_layer_cache(c, kn, vn, starts)
        want = expected_after_write(before, kn, vn, starts.tolist(), kv)
        for got, exp in zip((c.keys, c.values, c.k_scale, c.v_scale), want):
            assert_bytes_equal(got, exp)
        q = torch.randn(b, 2 * h, 1, d, generator=g)
        res = kvcache.attend(q, out)
        keys = dequantize(c.keys, c.k_scale)
        ref = reference(q, keys, dequantize(c.values, c.v_scale), out.length)
        scale = ref.abs().max().item() + 1e-30
        # float32 scores carry an absolute error of a few ulps of their magnitude, which the
        # softmax turns into that relative error of the weights: at magnitude 1e4 scores reach
        # ~2e4, so 1e-3 of the output's scale (seen: 2e-4 with fp8 keys, old and new kernels).
        kk = keys.double().repeat_interleave(2, dim=1)
        filled = (torch.arange(t) < out.length.view(-1, 1)).view(b, 1, 1, t)  # unfilled: random bytes
        score = ((q.double() @ kk.transpose(-1, -2)) / d**0.5).where(filled, 0.0).abs().max().item()
        assert (res.double() - ref).abs().max().item() <= (1e-4 + 4 * 2**-24 * score) * scale


# ------------------------------------------------------- transformers ---


def test_hf_kvcache_kv_dtype():
    transformers = pytest.importorskip("transformers")
    import kvcache.hf as kh

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation("kvcache")
    ids = torch.randint(0, 64, (2, 12))
    with torch.inference_mode():
        ref = model(input_ids=ids, past_key_values=kh.KVCache(cfg, 32)).logits
        for spelling, dt in (("int8", torch.int8), (torch.float8_e4m3fn, torch.float8_e4m3fn)):
            cache = kh.KVCache(cfg, 32, kv_dtype=spelling)
            got = model(input_ids=ids[:, :7], past_key_values=cache).logits
            got = torch.cat([got, model(input_ids=ids[:, 7:], past_key_values=cache).logits], 1)
            layer = cache.layers[0]
            assert layer.keys.dtype == dt and layer.k_scale.shape == (2, 2, 32)
            assert layer.lengths.tolist() == [12, 12]
            # the scales of the written slots are those of the keys the model wrote (not the initial ones)
            assert not torch.equal(layer.k_scale[:, :, :12], torch.ones(2, 2, 12))
            tol = 0.05 if dt == torch.int8 else 0.2
            assert (got - ref).abs().max() < tol
            before = layer.k_scale.clone(), layer.keys.clone()
            cache.reorder_cache(torch.tensor([1, 0]))  # moves the scales with the rows
            assert torch.equal(layer.k_scale[0, :, :12], before[0][1, :, :12])
            assert torch.equal(layer.k_scale[1, :, :12], before[0][0, :, :12])
            assert torch.equal(layer.keys[0, :, :12].view(torch.uint8), before[1][1, :, :12].view(torch.uint8))
    model.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match="quantized kvcache.hf.KVCache .* is read by attn_implementation='kvcache'"):
        model(input_ids=ids, past_key_values=kh.KVCache(cfg, 32, kv_dtype="int8"))
    with pytest.raises(TypeError, match="kv_dtype must be"):
        kh.KVCache(cfg, 32, kv_dtype="int4")


# ------------------------------------------------------ quantized rings ---


def _ring_steps(window, sinks, max_step):
    # Decode past several wraps, a chunk of max_step, one longer than the ring, then decode.
    cap = sinks + window + max_step - 1
    return [1] * (3 * cap) + [max_step, cap + 3, 2, 1, 1]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("window,sinks,max_step", [(1, 0, 1), (8, 0, 3), (8, 2, 4), (16, 4, 5)])
def test_quantized_ring_matches_float64_over_its_quantized_positions(kv_dtype, window, sinks, max_step):
    # The ring stores exactly the plain-PyTorch quantization of every position it keeps (bit-exact
    # data and scales), and attend over it equals float64 attention over the dequantized history
    # with the window/sink rule, through wraps, long chunks and a ragged batch of 2.
    b, kvh, h, d = 2, 2, 4, 16
    ring = kvcache.init_ring_layer_cache(b, kvh, d, window, torch.float32, sinks=sinks, max_step=max_step,
                                         kv_dtype=kv_dtype)
    assert ring.quantized and ring.keys.dtype == kv_dtype and ring.k_scale.shape == (b, kvh, ring.capacity)
    length = torch.tensor([0, 3], dtype=torch.int32)  # row 1 starts 3 positions later (ragged)
    ring = kvcache.RingLayerCache(ring.keys, ring.values, ring.positions, length, window, sinks, max_step,
                                  ring.k_scale, ring.v_scale)
    kv_start = torch.tensor([0, 3], dtype=torch.int32)  # row 1 holds positions from 3 (left padding)
    hist_k, hist_v = [[], []], [[], []]
    seed = 0
    for step in _ring_steps(window, sinks, max_step):
        seed += 1
        kn = random_tensor((b, kvh, step, d), torch.float32, seed=seed)
        vn = random_tensor((b, kvh, step, d), torch.float32, seed=seed + 1000)
        q = random_tensor((b, h, step, d), torch.float32, seed=seed + 2000) * 0.5
        kv = kvcache.write_ring_layer_cache(ring, kn, vn)
        out = kvcache.attend(q, kv, kv_start=kv_start)
        for r in range(b):
            hist_k[r].append(kn[r]); hist_v[r].append(vn[r])
        for r in range(b):
            K = torch.cat(hist_k[r], dim=1)
            V = torch.cat(hist_v[r], dim=1)
            qk, sk = ref_quantize(K, kv_dtype)
            qv, sv = ref_quantize(V, kv_dtype)
            start = 3 * r  # row 1's positions begin at 3
            n = K.shape[1]
            pos = torch.arange(start, start + n, dtype=torch.int32).view(1, n)
            ref = reference(q[r:r + 1], dequantize(qk, sk)[None], dequantize(qv, sv)[None],
                            torch.tensor([start + n], dtype=torch.int32),
                            kv_start=torch.tensor([start]), window=window, positions=pos, sinks=sinks)
            torch.testing.assert_close(out[r:r + 1].double(), ref, atol=2e-5, rtol=1e-4)
        # What the ring keeps is bit-exact: each kept slot holds its position's quantization.
        for r in range(b):
            K = torch.cat(hist_k[r], dim=1)
            qk, sk = ref_quantize(K, kv_dtype)
            for slot, p in enumerate(ring.positions[r].tolist()):
                if p < 0:
                    continue
                i = p - 3 * r
                assert torch.equal(ring.keys[r, :, slot].view(torch.uint8), qk[:, i].view(torch.uint8))
                assert torch.equal(ring.k_scale[r, :, slot], sk[:, i])


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
def test_quantized_ring_rollback_select_and_reset(kv_dtype):
    # Rollback after a wrap is bit-identical to never having decoded the rolled-back tokens; row
    # selection moves data, scales and positions; reset empties a row.
    b, kvh, h, d, window, R = 2, 1, 2, 8, 6, 3
    def fresh():
        c = kvcache.init_ring_layer_cache(b, kvh, d, window, torch.float32, max_step=R, kv_dtype=kv_dtype)
        return kvcache.RingLayerCache(c.keys, c.values, c.positions, torch.zeros(b, dtype=torch.int32),
                                      window, 0, R, c.k_scale, c.v_scale)
    toks = [random_tensor((b, kvh, 1, d), torch.float32, seed=i) for i in range(40)]
    q = random_tensor((b, h, 1, d), torch.float32, seed=99)
    a, c = fresh(), fresh()
    for t in toks[:30]:
        kvcache.append_ring_layer_cache(a, t, -t)
    for t in toks[30:33]:  # a draft of R tokens, rejected
        kvcache.append_ring_layer_cache(a, t * 3, t)
    kvcache.rollback_ring_layer_cache(a, R)
    for t in toks[:30]:
        kvcache.append_ring_layer_cache(c, t, -t)
    for t in toks[33:36]:
        kvcache.append_ring_layer_cache(a, t, -t)
        kvcache.append_ring_layer_cache(c, t, -t)
    assert torch.equal(kvcache.attend(q, a), kvcache.attend(q, c))
    before = [x.clone() for x in (a.keys, a.values, a.k_scale, a.v_scale, a.positions)]
    kvcache.select_rows_ring_layer_cache(a, torch.tensor([1, 1]))
    for got, old in zip((a.keys, a.values, a.k_scale, a.v_scale, a.positions), before):
        assert torch.equal(got[0].view(torch.uint8) if got.dtype == kv_dtype else got[0],
                           old[1].view(torch.uint8) if old.dtype == kv_dtype else old[1])
    with pytest.raises(ValueError, match="index"):
        kvcache.select_rows_ring_layer_cache(a, torch.tensor([0, 2]))
    kvcache.reset_rows_ring_layer_cache(a, torch.tensor([True, False]))
    assert int(a.length[0]) == 0 and (a.positions[0] == -1).all()


def test_quantized_ring_bad_writes_raise_and_write_nothing():
    c = kvcache.init_ring_layer_cache(1, 2, 8, 4, torch.float32, max_step=2, kv_dtype="int8")
    before = [x.clone() for x in (c.keys, c.values, c.k_scale, c.v_scale, c.positions, c.length)]
    kn = torch.randn(1, 2, 1, 8)
    for bad, err, match in [
        ((torch.randn(1, 2, 1, 4), kn), ValueError, "shape"),  # head_dim mismatch
        ((kn.double(), kn.double()), TypeError, "float"),  # float64 new data
        ((torch.randn(1, 3, 1, 8), torch.randn(1, 3, 1, 8)), ValueError, "heads"),  # wrong heads
        ((torch.randn(2, 8), kn), ValueError, "keys_new"),  # not 4-D
    ]:
        with pytest.raises(err, match=match):
            kvcache.append_ring_layer_cache(c, *bad)
        for got, old in zip((c.keys, c.values, c.k_scale, c.v_scale, c.positions, c.length), before):
            assert torch.equal(got.view(torch.uint8) if got.dtype == torch.int8 else got,
                               old.view(torch.uint8) if old.dtype == torch.int8 else old)
    with pytest.raises(ValueError, match="start"):
        kvcache.update_ring_layer_cache(c, kn, kn, -1)
