"""Reliability of the row and attention operators: one group of tests per item of issue 17.

  1. reset trusted `rows`: a 1-entry mask broadcast to every row, -1 wrapped to
     the last row, an index past the batch raised after row 0 was reset; int32
     indices refused; through kvcache.hf layer 0 was reset before layer 1 raised
  2. select_rows_kv_layer_cache (and rollback) on an expand()ed length moved the
     rows, then copy_ raised: every length write is checked before the op runs
  3. traced append raised other errors than eager (those cases are in
     test_error_parity.py; here: the compiled step still matches eager)
  4. attend: scale/softcap that float32 cannot hold
  5. rollback refused a 0-D length with a per-row kv_start that attend accepts

Every expected value comes from plain PyTorch on the inputs, never from our ops.
"""

from __future__ import annotations

import pytest
import torch

import kvcache

from kv_testing import random_tensor

B, H, T, D = 4, 2, 16, 8
ops = torch.ops.kvcache


def ragged(lengths=(3, 4, 5, 6), length_dtype=torch.int32):
    k = random_tensor((B, H, T, D), torch.float32, seed=1)
    v = random_tensor((B, H, T, D), torch.float32, seed=2)
    return kvcache.KVLayerCache(k, v, torch.tensor(lengths, dtype=length_dtype))


def snapshot(cache):
    return cache.keys.clone(), cache.values.clone(), cache.length.clone()


def unchanged(cache, snap):
    k, v, n = snap
    return torch.equal(cache.keys, k) and torch.equal(cache.values, v) and torch.equal(cache.length, n)


def reference_reset(lengths, rows):
    out = lengths.clone()
    if rows.dtype == torch.bool:
        out[rows] = 0
    else:
        for r in rows.reshape(-1).tolist():
            out[r] = 0
    return out


# ------------------------------------------------------------------ 1. reset


@pytest.mark.parametrize(
    "rows",
    [
        torch.tensor([True, False, True, False]),
        torch.tensor([False] * 4),
        torch.tensor([3, 1]),
        torch.tensor([2, 2], dtype=torch.int32),
        torch.tensor(1, dtype=torch.int32),
        torch.tensor([], dtype=torch.int64),
        torch.tensor([True, False] * 4)[::2],  # a strided mask
    ],
    ids=["mask", "mask-none", "int64", "int32-repeat", "int32-0d", "empty", "mask-strided"],
)
@pytest.mark.parametrize("length_dtype", [torch.int32, torch.int64])
def test_reset_rows_matches_reference(rows, length_dtype):
    cache = ragged(length_dtype=length_dtype)
    keys, values = cache.keys.clone(), cache.values.clone()
    expect = reference_reset(cache.length, rows)
    address = cache.length.data_ptr()
    assert kvcache.reset_rows_kv_layer_cache(cache, rows) is cache
    assert torch.equal(cache.length, expect) and cache.length.dtype == length_dtype
    assert cache.length.data_ptr() == address
    assert torch.equal(cache.keys, keys) and torch.equal(cache.values, values)


BAD_ROWS = [
    (torch.tensor([True]), ValueError, r"rows \(a bool mask\) must have shape \(batch=4,\), got shape \[1\]"),
    (torch.tensor([True] * 5), ValueError, r"rows \(a bool mask\) must have shape \(batch=4,\), got shape \[5\]"),
    (torch.tensor([[True] * 4]), ValueError, r"rows \(a bool mask\) must have shape \(batch=4,\), got shape \[1, 4\]"),
    (torch.tensor([-1]), ValueError, r"rows must be in \[0, batch=4\), got -1 at index 0"),
    (torch.tensor([0, 9]), ValueError, r"rows must be in \[0, batch=4\), got 9 at index 1"),
    (torch.tensor(4, dtype=torch.int32), ValueError, r"rows must be in \[0, batch=4\), got 4$"),
    (torch.tensor([[0, 1]]), ValueError, r"rows \(row indices\) must be a 0-D or 1-D tensor, got shape \[1, 2\]"),
    (torch.tensor([0], dtype=torch.int16), TypeError, r"rows must be a bool mask or an int32 or int64 tensor of row "
     r"indices, got dtype torch.int16"),
    (torch.tensor([0], dtype=torch.uint8), TypeError, r"got dtype torch.uint8"),
    (torch.tensor([0.0]), TypeError, r"got dtype torch.float32"),
    ([0, 1], TypeError, r"rows must be a bool mask or an int32 or int64 tensor of row indices, got list"),
    (torch.tensor([0], device="meta"), ValueError, r"rows must be on the device of lengths"),
]


@pytest.mark.parametrize("rows,exc,msg", BAD_ROWS, ids=[m[:40] for _, _, m in BAD_ROWS])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_reset_rows_refuses_bad_rows_before_any_change(rows, exc, msg, compiled):
    cache = ragged()
    snap = snapshot(cache)
    fn = kvcache.reset_rows_kv_layer_cache
    if compiled:
        if not isinstance(rows, torch.Tensor) or rows.device.type == "meta":
            pytest.skip("a list / meta tensor is not a compiled-code input")
        torch._dynamo.reset()
        fn = torch.compile(lambda c, r: kvcache.reset_rows_kv_layer_cache(c, r).length + 0, fullgraph=True)
    with pytest.raises(Exception) as info:
        fn(cache, rows)
    err = info.value
    if isinstance(err, torch._dynamo.exc.TorchRuntimeError):  # Dynamo wraps trace-time errors, quoting them
        assert exc.__name__ in str(err)
    else:
        assert type(err) is exc
    import re

    assert re.search(msg, str(err)), str(err)
    assert unchanged(cache, snap)


def test_reset_rows_shared_length_refused():
    cache = ragged()
    shared = kvcache.KVLayerCache(cache.keys, cache.values, torch.tensor(3, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"needs a per-row length of shape \(batch,\).*expand\(batch\)\.clone\(\)"):
        kvcache.reset_rows_kv_layer_cache(shared, torch.tensor([0]))
    assert shared.length.item() == 3


def test_reset_rows_op_opcheck():
    from torch.library import opcheck

    checks = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    for lengths, rows in (
        (torch.tensor([3, 4, 5, 6], dtype=torch.int32), torch.tensor([True, False, False, True])),
        (torch.tensor([3, 4, 5, 6]), torch.tensor([2, 0], dtype=torch.int32)),
        (torch.tensor([3, 4, 5, 6]), torch.tensor(1)),
    ):
        result = opcheck(ops.reset_rows.default, (lengths, rows), test_utils=checks)
        assert all(v == "SUCCESS" for v in result.values()), result


def test_compiled_reset_matches_eager_without_recompiles():
    torch._dynamo.reset()

    def step(cache, rows, k, v):
        kvcache.reset_rows_kv_layer_cache(cache, rows)
        kvcache.append_kv_layer_cache(cache, k, v)
        return cache.length + 0

    compiled = torch.compile(step, fullgraph=True)
    eager, comp = ragged(), ragged()
    g = torch.Generator().manual_seed(0)
    for i in range(4):
        rows = torch.rand(B, generator=g) < 0.5
        k, v = torch.randn(B, H, 1, D, generator=g), torch.randn(B, H, 1, D, generator=g)
        if i == 1:
            torch.compiler.set_stance("fail_on_recompile")
        try:
            out = compiled(comp, rows, k, v)
        finally:
            torch.compiler.set_stance("default")
        assert torch.equal(out, step(eager, rows, k, v))
        assert torch.equal(comp.keys, eager.keys)


# ------------------------------------------------- 2. checked length writes


def expanded_cache():
    k = random_tensor((B, H, T, D), torch.float32, seed=3)
    v = random_tensor((B, H, T, D), torch.float32, seed=4)
    return kvcache.KVLayerCache(k, v, torch.tensor(5, dtype=torch.int32).expand(B))


OVERLAP = r"^lengths must not have internally overlapping memory \(it is written in place, one entry per row\)$"


@pytest.mark.parametrize(
    "write",
    [
        lambda c: kvcache.select_rows_kv_layer_cache(c, torch.tensor([1, 0, 3, 2])),
        lambda c: kvcache.rollback_kv_layer_cache(c, 1),
        lambda c: kvcache.rollback_kv_layer_cache(c, torch.tensor([1, 0, 0, 1])),
        lambda c: kvcache.reset_rows_kv_layer_cache(c, torch.tensor([0])),
        lambda c: kvcache.append_kv_layer_cache(c, torch.ones(B, H, 1, D), torch.ones(B, H, 1, D)),
    ],
    ids=["select", "rollback", "rollback-per-row", "reset", "append"],
)
def test_expanded_length_refused_before_anything_moves(write):
    cache = expanded_cache()
    snap = snapshot(cache)
    with pytest.raises(ValueError, match=OVERLAP):
        write(cache)
    assert unchanged(cache, snap)


# -------------------------------------------------------- 4. scale, softcap


def att_args():
    q = random_tensor((B, 4, 1, D), torch.float32, seed=5)
    return q, ragged()


@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(scale=1e39), r"scale must be a finite number > 0 in float32 range .*got 1e\+39"),
        (dict(scale=1e300), r"scale must be a finite number > 0 in float32 range .*got 1e\+300"),
        (dict(scale=1e-46), r"scale must be a finite number > 0 in float32 range .*got 1e-46"),
        (dict(softcap=1e39), r"softcap must be 0 \(no cap\) or a finite number > 0 in float32 range .*got 1e\+39"),
        (dict(softcap=1e-46), r"softcap must be 0 \(no cap\) or a finite number > 0 in float32 range .*got 1e-46"),
        (dict(softcap=-1.0), r"softcap must be 0 \(no cap\) or a finite number > 0"),
        (dict(softcap=1e-44), r"softcap=1e-44 is too small for scale=0.35355"),
    ],
    ids=["scale-1e39", "scale-1e300", "scale-1e-46", "softcap-1e39", "softcap-1e-46", "softcap-neg", "softcap-ratio"],
)
def test_attend_refuses_scale_and_softcap_outside_float32(kw, msg):
    q, cache = att_args()
    with pytest.raises(ValueError, match=msg):
        kvcache.attend(q, cache, **kw)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as m:  # the fake kernel runs the same check
        fq, fk, fv, fl = (m.from_tensor(t) for t in (q, cache.keys, cache.values, cache.length))
        with pytest.raises(ValueError, match=msg):
            ops.attend(fq, fk, fv, fl, **kw)


def attend_reference(q, cache, scale, softcap=0.0):
    """float64 attention over each row's filled slots (the queries are the last seq slots)."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    g = q.shape[1] // cache.keys.shape[1]
    for b in range(q.shape[0]):
        n = int(cache.length[b])
        k = cache.keys[b, :, :n].double().repeat_interleave(g, 0)
        v = cache.values[b, :, :n].double().repeat_interleave(g, 0)
        s = q[b].double() @ k.transpose(-1, -2) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        out[b] = torch.softmax(s, -1) @ v
    return out


@pytest.mark.parametrize("kw", [dict(scale=1e-30), dict(softcap=1e-20), dict(softcap=1e30), dict(softcap=0.0)])
def test_attend_accepts_float32_scale_and_softcap(kw):
    q, cache = att_args()
    out = kvcache.attend(q, cache, **kw)
    ref = attend_reference(q, cache, kw.get("scale", D**-0.5), kw.get("softcap", 0.0))
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)


# ------------------------------------------ 5. 0-D length, per-row kv_start


def test_rollback_broadcasts_shared_length_over_per_row_kv_start():
    k = random_tensor((3, H, T, D), torch.float32, seed=6)
    v = random_tensor((3, H, T, D), torch.float32, seed=7)
    c = kvcache.update_kv_layer_cache(kvcache.KVLayerCache(k, v, torch.tensor(0)), torch.ones(3, H, 8, D),
                                      torch.ones(3, H, 8, D), 0)
    assert c.length.dim() == 0 and int(c.length) == 8
    kv_start = torch.tensor([0, 3, 5])
    q = random_tensor((3, 4, 1, D), torch.float32, seed=8)
    kvcache.attend(q, c, kv_start=kv_start)  # attend takes the pair
    kvcache.rollback_kv_layer_cache(c, 2, kv_start=kv_start)  # and so does rollback now
    assert c.length.dim() == 0 and int(c.length) == 6
    kvcache.rollback_kv_layer_cache(c, torch.tensor(1, dtype=torch.int32), kv_start=kv_start.int())
    assert int(c.length) == 5
    # Row 2 would go below its kv_start (5 - 1 < 5): refused, naming the row, nothing changes.
    with pytest.raises(ValueError, match=r"cannot roll back more tokens than the row holds: n=1 but lengths=5 - "
                                         r"kv_start=5 leaves 0 at index 2"):
        kvcache.rollback_kv_layer_cache(c, 1, kv_start=kv_start)
    assert int(c.length) == 5
    with pytest.raises(ValueError, match=r"kv_start must be in \[0, lengths\] = \[0, 5\], got 6 at index 1"):
        ops.rollback(c.length, torch.tensor(0), kv_start=torch.tensor([0, 6, 0]))
    with pytest.raises(ValueError, match=r"kv_start must be a 0-D tensor or have shape \(batch,\), got shape \[1, 3\]"):
        ops.rollback(c.length, torch.tensor(0), kv_start=torch.tensor([[0, 1, 0]]))
    with pytest.raises(ValueError, match=r"n must be a 0-D tensor or have the shape of lengths \[\]"):
        ops.rollback(c.length, torch.tensor([1, 1, 1]), kv_start=kv_start)
    from torch.library import opcheck

    checks = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    result = opcheck(ops.rollback.default, (torch.tensor(8), torch.tensor(2)), {"kv_start": kv_start},
                     test_utils=checks)
    assert all(v == "SUCCESS" for v in result.values()), result


# ------------------------------------------------------- 3. traced append


@pytest.mark.parametrize("length_dtype", [torch.int32, torch.int64])
def test_append_returning_writes_like_append_and_returns_lengths(length_dtype):
    """What traced append calls: the same writes as append_, the new lengths returned, lengths untouched."""
    cache = ragged(lengths=(3, 0, 14, 6), length_dtype=length_dtype)
    kn = random_tensor((B, H, 2, D), torch.float32, seed=9)
    vn = random_tensor((B, H, 2, D), torch.float32, seed=10)
    expect_k, expect_v = cache.keys.clone(), cache.values.clone()
    for b, n in enumerate((3, 0, 14, 6)):
        expect_k[b, :, n:n + 2] = kn[b]
        expect_v[b, :, n:n + 2] = vn[b]
    out = ops.append_returning_(cache.keys, cache.values, cache.length, kn, vn)
    assert out.tolist() == [5, 2, 16, 8] and out.dtype == length_dtype
    assert cache.length.tolist() == [3, 0, 14, 6]
    assert torch.equal(cache.keys, expect_k) and torch.equal(cache.values, expect_v)

