"""torch.library.opcheck (schema, autograd registration, fake tensor, AOT dispatch) on every operator.

The operators come from the one list (``kvcache._C.operators``, csrc/ops/operators.h): each has
samples in ``SAMPLES`` below, and a test fails when one is missing.
"""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

import kvcache  # noqa: F401

from kv_testing import random_tensor

ALL_CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def update_samples():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        keys = torch.zeros(2, 3, 16, 8, dtype=dtype)
        values = torch.zeros(2, 3, 16, 8, dtype=dtype)
        kn = random_tensor((2, 3, 4, 8), dtype, seed=1)
        vn = random_tensor((2, 3, 4, 8), dtype, seed=2)
        yield keys, values, kn, vn
    # transposed inputs and a (batch, max_len, heads, head_dim) cache layout
    keys = torch.zeros(2, 16, 3, 8).transpose(1, 2)
    values = torch.zeros(2, 16, 3, 8).transpose(1, 2)
    kn = torch.randn(2, 1, 3, 8).transpose(1, 2)
    vn = torch.randn(2, 1, 3, 8).transpose(1, 2)
    yield keys, values, kn, vn


@pytest.mark.parametrize("sample", list(update_samples()), ids=lambda s: f"{s[0].dtype}-{tuple(s[2].shape)}-{s[0].is_contiguous()}")
@pytest.mark.parametrize("start", [0, 5])
def test_opcheck_update(sample, start):
    keys, values, kn, vn = sample
    result = opcheck(torch.ops.kvcache.update_.default, (keys, values, kn, vn, start), test_utils=ALL_CHECKS)
    assert set(result) == set(ALL_CHECKS) and all(v == "SUCCESS" for v in result.values()), result


@pytest.mark.parametrize("sample", list(update_samples()), ids=lambda s: f"{s[0].dtype}-{tuple(s[2].shape)}-{s[0].is_contiguous()}")
@pytest.mark.parametrize("positions", [torch.tensor(3), torch.tensor([0, 9], dtype=torch.int32)], ids=["scalar", "ragged"])
def test_opcheck_update_at(sample, positions):
    keys, values, kn, vn = sample
    result = opcheck(torch.ops.kvcache.update_.Tensor, (keys, values, kn, vn, positions), test_utils=ALL_CHECKS)
    assert all(v == "SUCCESS" for v in result.values()), result


@pytest.mark.parametrize("sample", list(update_samples()), ids=lambda s: f"{s[0].dtype}-{tuple(s[2].shape)}-{s[0].is_contiguous()}")
@pytest.mark.parametrize("lengths", [torch.tensor(3), torch.tensor([0, 9], dtype=torch.int32)], ids=["scalar", "ragged"])
def test_opcheck_append_returning(sample, lengths):
    keys, values, kn, vn = sample
    result = opcheck(torch.ops.kvcache.append_returning_.default, (keys, values, lengths, kn, vn),
                     test_utils=ALL_CHECKS)
    assert all(v == "SUCCESS" for v in result.values()), result


@pytest.mark.parametrize("dtype", [None, torch.float32, torch.bfloat16, torch.int8])
def test_opcheck_init(dtype):
    result = opcheck(
        torch.ops.kvcache.init_layer_cache.default,
        (2, 3, 8, 16),
        {"dtype": dtype, "device": torch.device("cpu")},
        test_utils=ALL_CHECKS,
    )
    assert all(v == "SUCCESS" for v in result.values()), result


def _cache(batch=2, heads=2, max_len=16, dim=8, dtype=torch.float32):
    keys = random_tensor((batch, heads, max_len, dim), dtype, seed=3)
    values = random_tensor((batch, heads, max_len, dim), dtype, seed=4)
    return keys, values


def _append_samples():
    for lengths in (torch.tensor(2, dtype=torch.int32), torch.tensor([0, 7], dtype=torch.int64)):
        keys, values = _cache()
        kn = random_tensor((2, 2, 3, 8), torch.float32, seed=5)
        vn = random_tensor((2, 2, 3, 8), torch.float32, seed=6)
        yield (keys, values, lengths, kn, vn), {}


def _attend_samples():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        keys, values = _cache(dtype=dtype)
        q = random_tensor((2, 4, 2, 8), dtype, seed=7)
        lengths = torch.tensor([5, 16], dtype=torch.int32)
        yield (q, keys, values, lengths), {}
        yield (q, keys, values, lengths), {"kv_start": torch.tensor([1, 3]), "window": 3, "softcap": 5.0, "scale": 0.5}
        yield (q, keys, values, lengths), {"sink_logits": torch.tensor([0.5, -1.0, 2.0, 0.0])}


def _ring_attend_samples():
    # A ring of capacity 7 (window 4, sinks 1, max_step 3) after 9 tokens: wrapped.
    ring = kvcache.init_ring_layer_cache(2, 2, 8, 4, torch.float32, sinks=1, max_step=3)
    kvcache.update_ring_layer_cache(ring, *_cache(max_len=9), 0)
    q = random_tensor((2, 4, 2, 8), torch.float32, seed=7)
    yield (q, ring.keys, ring.values, torch.tensor(9, dtype=torch.int32)), {"window": 4, "positions": ring.positions,
                                                                            "sinks": 1}


def _ring_update_samples():
    for start in (torch.tensor(3), torch.tensor([0, 9], dtype=torch.int32)):
        keys, values = _cache(max_len=7)
        positions = torch.full((2, 7), -1, dtype=torch.int32)
        kn = random_tensor((2, 2, 3, 8), torch.float32, seed=5)
        vn = random_tensor((2, 2, 3, 8), torch.float32, seed=6)
        yield (keys, values, positions, kn, vn, start), {"sinks": 2}


def _ring_update_quantized_samples():
    # A ring of capacity 7 with 2 sinks: host and per-row starts, a wrap, a chunk longer than the ring.
    for kv_dtype in (torch.int8, torch.float8_e4m3fn):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for start, chunk in ((torch.tensor(3), 3), (torch.tensor([0, 9], dtype=torch.int32), 3),
                                 (torch.tensor(1, dtype=torch.int64), 11)):
                k, v, ks, vs = _quant_cache(kv_dtype, max_len=7)
                positions = torch.full((2, 7), -1, dtype=torch.int32)
                kn = random_tensor((2, 2, chunk, 8), dtype, seed=5)
                vn = random_tensor((2, 2, chunk, 8), dtype, seed=6)
                yield (k, v, ks, vs, positions, kn, vn, start), {"sinks": 2}


def _rollback_samples():
    yield (torch.tensor([5, 9], dtype=torch.int32), torch.tensor([2, 0], dtype=torch.int32)), {}
    yield (torch.tensor(6), torch.tensor(1)), {"kv_start": torch.tensor(2)}


def _select_rows_samples():
    for index in (torch.tensor([1, 0]), torch.tensor([1, 1], dtype=torch.int32)):
        keys, values = _cache()
        yield (keys, values, torch.tensor([4, 9], dtype=torch.int32), index), {}


def _update_samples(start):
    for keys, values, kn, vn in update_samples():
        yield (keys, values, kn, vn, start), {}


def _quant_cache(kv_dtype, batch=2, heads=2, max_len=16, dim=8):
    keys = torch.zeros(batch, heads, max_len, dim, dtype=kv_dtype)
    values = torch.zeros(batch, heads, max_len, dim, dtype=kv_dtype)
    return keys, values, torch.ones(batch, heads, max_len), torch.ones(batch, heads, max_len)


def _update_quantized_samples(start):
    for kv_dtype in (torch.int8, torch.float8_e4m3fn):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            kn = random_tensor((2, 2, 3, 8), dtype, seed=8)
            vn = random_tensor((2, 2, 3, 8), dtype, seed=9)
            yield (*_quant_cache(kv_dtype), kn, vn, start), {}
    # transposed new data (a (batch, chunk, heads, head_dim) projection)
    kn = torch.randn(2, 3, 2, 8).transpose(1, 2)
    yield (*_quant_cache(torch.int8), kn, kn.clone(), start), {}


def _append_quantized_samples():
    for kv_dtype in (torch.int8, torch.float8_e4m3fn):
        for lengths in (torch.tensor(2, dtype=torch.int32), torch.tensor([0, 7], dtype=torch.int64)):
            kn = random_tensor((2, 2, 3, 8), torch.float32, seed=5)
            vn = random_tensor((2, 2, 3, 8), torch.float32, seed=6)
            k, v, ks, vs = _quant_cache(kv_dtype)
            yield (k, v, ks, vs, lengths, kn, vn), {}


def _attend_quantized_samples():
    for kv_dtype in (torch.int8, torch.float8_e4m3fn):
        k, v, ks, vs = _quant_cache(kv_dtype)
        k.copy_(torch.randint(-127, 128, k.shape).to(kv_dtype))
        v.copy_(torch.randint(-127, 128, v.shape).to(kv_dtype))
        ks.uniform_(0.001, 0.01)
        vs.uniform_(0.001, 0.01)
        for dtype in (torch.float32, torch.bfloat16):
            q = random_tensor((2, 4, 2, 8), dtype, seed=7)
            lengths = torch.tensor([5, 16], dtype=torch.int32)
            yield (q, k, v, lengths), {"k_scale": ks, "v_scale": vs}
            yield (q, k, v, lengths), {"kv_start": torch.tensor([1, 3]), "window": 3, "softcap": 5.0, "k_scale": ks,
                                        "v_scale": vs}


def _paged_samples(op):
    g = torch.Generator().manual_seed(0)
    kp, vp = torch.randn(4, 8, 2, 16, generator=g), torch.randn(4, 8, 2, 16, generator=g)
    if op == "write":
        key, value = torch.randn(3, 2, 16, generator=g), torch.randn(3, 2, 16, generator=g)
        out = [((kp, vp, key, value, torch.tensor([0, -1, 9])), {})]
        for kv in (torch.int8, torch.float8_e4m3fn):
            qk, qv = torch.zeros(4, 8, 2, 16, dtype=kv), torch.zeros(4, 8, 2, 16, dtype=kv)
            out.append(((qk, qv, key, value, torch.tensor([3, 31, -1], dtype=torch.int32)),
                        {"key_scales": torch.ones(4, 8, 2), "value_scales": torch.ones(4, 8, 2)}))
        return out
    table = torch.tensor([[2, 0, -1], [1, 3, -1]], dtype=torch.int32)
    lens = torch.tensor([12, 9], dtype=torch.int32)
    cu = torch.tensor([0, 2, 3], dtype=torch.int32)
    q = torch.randn(3, 4, 16, generator=g)
    return [((q, kp, vp, table, lens, cu), {}), ((q, kp, vp, table, lens, cu), {"window": 4, "softcap": 2.0})]


def _with_scales(samples, at):
    """The quantized samples of an alias as samples of the new write: the scales (positional at `at` in
    the alias) moved to the keyword-only k_scale / v_scale of the new schema."""
    for args, kwargs in samples:
        args = list(args)
        ks, vs = args.pop(at), args.pop(at)
        yield tuple(args), {**kwargs, "k_scale": ks, "v_scale": vs}


def _as_ring_write(ring_samples):
    # ring_update_'s (keys, values, positions, kn, vn, start) -> update_.Tensor's, positions= keyword
    for args, kwargs in ring_samples:
        k, v, pos, kn, vn, s = args
        yield (k, v, kn, vn, s), {**kwargs, "positions": pos}


def _scaled(alias_samples):
    # (keys, values, k_scale, v_scale, ...) -> (keys, values, ...), k_scale=, v_scale=
    return list(_with_scales(alias_samples, 2))


# Samples (args, kwargs) of every operator, by its dispatcher name. The writes' samples include their
# quantized form (k_scale / v_scale given); the deprecated aliases keep their own.
SAMPLES = {
    "paged_write_": lambda: _paged_samples("write"),
    "paged_attend": lambda: _paged_samples("attend"),
    "init_layer_cache": lambda: [((2, 3, 8, 16), {"dtype": d, "device": torch.device("cpu")}) for d in (None, torch.bfloat16)],
    "update_": lambda: [*_update_samples(5), *_scaled(_update_quantized_samples(5))],
    "update_.Tensor": lambda: [*_update_samples(torch.tensor([0, 9], dtype=torch.int32)),
                               *_scaled(_update_quantized_samples(torch.tensor([0, 9], dtype=torch.int32))),
                               *_as_ring_write(_ring_update_samples()),
                               *_as_ring_write(_scaled(_ring_update_quantized_samples()))],
    "append_": lambda: [*_append_samples(), *_scaled(_append_quantized_samples())],
    "update_quantized_": lambda: _update_quantized_samples(5),
    "update_quantized_.Tensor": lambda: _update_quantized_samples(torch.tensor([0, 9], dtype=torch.int32)),
    "append_quantized_": _append_quantized_samples,
    "attend": lambda: [*_attend_samples(), *_ring_attend_samples(), *_attend_quantized_samples()],
    "ring_update_": lambda: [*_ring_update_samples(), *_scaled(_ring_update_quantized_samples())],
    "ring_update_quantized_": _ring_update_quantized_samples,
    "rollback": _rollback_samples,
    "select_rows_": _select_rows_samples,
    "append_returning_": lambda: [*_append_samples(), *_scaled(_append_quantized_samples())],
    "reset_rows": lambda: [((torch.tensor([3, 4, 5], dtype=torch.int32), r), {})
                           for r in (torch.tensor([True, False, True]), torch.tensor([2, 0]), torch.tensor(1))],
    "check_lengths_writable": lambda: [((torch.tensor([3, 4], dtype=torch.int32),), {}), ((torch.tensor(5),), {})],
}
OPERATORS = [op["name"] for op in kvcache._C.operators]


def test_every_operator_has_samples():
    assert sorted(SAMPLES) == sorted(OPERATORS)


@pytest.mark.parametrize("name", OPERATORS)
def test_opcheck_every_operator(name):
    op, _, overload = name.partition(".")
    overload_packet = getattr(torch.ops.kvcache, op)
    handle = getattr(overload_packet, overload or "default")
    samples = list(SAMPLES[name]())
    assert samples
    for args, kwargs in samples:
        checks = ALL_CHECKS
        if any(isinstance(a, torch.Tensor) and a.dtype == torch.float8_e4m3fn for a in (*args, *kwargs.values())):
            # torch's SchemaCheckMode (test_schema) compares tensors with a mul that float8 lacks on CPU
            # ("mul_cpu_reduced_float" not implemented for 'Float8_e4m3fn'); the int8 samples of the same
            # operators run it.
            checks = tuple(c for c in ALL_CHECKS if c != "test_schema")
        result = opcheck(handle, args, kwargs, test_utils=checks)
        assert set(result) == set(checks) and all(v == "SUCCESS" for v in result.values()), (name, result)


def test_fake_update_raises_same_errors():
    """Tracing with fake tensors reports the same errors as eager."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        keys = torch.empty(2, 3, 16, 8)
        values = torch.empty(2, 3, 16, 8)
        kn = torch.empty(2, 3, 4, 8)
        with pytest.raises(ValueError, match="KV cache overflow: end=17 exceeds max_len=16"):
            torch.ops.kvcache.update_(keys, values, kn, kn.clone(), 13)
        with pytest.raises(TypeError, match="keys_new must have the cache dtype"):
            torch.ops.kvcache.update_(keys, values, kn.half(), kn.clone(), 0)
        with pytest.raises(ValueError, match=r"start must be a 0-D tensor"):
            torch.ops.kvcache.update_(keys, values, kn, kn.clone(), torch.zeros(3, dtype=torch.int64))
        with pytest.raises(TypeError, match="start must be an int32 or int64"):
            torch.ops.kvcache.update_(keys, values, kn, kn.clone(), torch.zeros(()))
        k2, v2, length = torch.ops.kvcache.init_layer_cache(1, 2, 4, 8, dtype=torch.float16)
        assert k2.shape == (1, 2, 8, 4) and k2.dtype == torch.float16 and length.dtype == torch.int32
