"""Bounds: starts, lengths and counts at the int64/int32 limits, through every operator and
route (host and device starts, Python ints >= 2**63, exported programs). The check is always
start > max_len - chunk: start + chunk wraps for a start near 2**63. Every error: the exact
type and message, and nothing written anywhere (the bytes around the cache included).
"""

from __future__ import annotations

import pytest
import torch

import kvcache
from kv_testing import INT32_MAX, INT32_MIN, INT64_MAX, INT64_MIN, Guarded, raises_nothing_written
from kv_testing import guarded_new_kv as new_kv

B, H, T, D = 2, 3, 8, 4
ops = torch.ops.kvcache


# Starts for which start + chunk (chunk 1 or 3) overflows int64, or lands
# exactly at the limit: the old check (start + chunk > max_len) wrapped
# negative, passed, and wrote before the buffer.
OVERFLOWING = [INT64_MAX, INT64_MAX - 1, INT64_MAX - 2, 2**62, 2**32 + 5, INT32_MAX]


def _overflow_params():
    for route in ("api-int", "update_", "update_.Tensor-0d", "update_.Tensor-rows", "api-tensor"):
        host = route in ("api-int", "update_")
        for dtype in (torch.int64,) if host else (torch.int32, torch.int64):
            for start in OVERFLOWING:
                if dtype == torch.int32 and start > INT32_MAX:
                    continue
                for chunk in (1, 3):
                    yield pytest.param(route, start, chunk, dtype, id=f"{route}-{str(dtype)[6:]}-{start}-chunk{chunk}")


@pytest.mark.parametrize("route,start,chunk,dtype", list(_overflow_params()))
def test_overflowing_start_raises_and_writes_nothing(route, start, chunk, dtype):
    g = Guarded()
    kn, vn = new_kv(chunk)
    end = start + chunk
    if route == "api-int":
        fn = lambda: kvcache.update_kv_layer_cache(g.cache, kn, vn, start)  # noqa: E731
        match = rf"^KV cache overflow: end={end} exceeds max_len={T}$"
    elif route == "update_":
        fn = lambda: ops.update_(g.keys, g.values, kn, vn, start)  # noqa: E731
        match = rf"^KV cache overflow: end={end} exceeds max_len={T}$"
    elif route in ("update_.Tensor-0d", "api-tensor"):
        s = torch.tensor(start, dtype=dtype)
        if route == "api-tensor":
            fn = lambda: kvcache.update_kv_layer_cache(g.cache, kn, vn, s)  # noqa: E731
        else:
            fn = lambda: ops.update_.Tensor(g.keys, g.values, kn, vn, s)  # noqa: E731
        match = rf"^KV cache overflow: end={end} exceeds max_len={T} \(start={start}, chunk={chunk}\)$"
    else:  # row 0 valid, row 1 overflowing: all or nothing
        s = torch.tensor([0, start], dtype=dtype)
        fn = lambda: ops.update_.Tensor(g.keys, g.values, kn, vn, s)  # noqa: E731
        match = rf"^KV cache overflow: end={end} exceeds max_len={T} \(start\[1\]={start}, chunk={chunk}\)$"
    raises_nothing_written(g, ValueError, match, fn)


@pytest.mark.parametrize("start", [-1, INT64_MIN, INT32_MIN])
def test_negative_start_every_route(start):
    g = Guarded()
    kn, vn = new_kv(2)
    raises_nothing_written(g, ValueError, rf"^start must be >= 0, got {start}$",
                           lambda: ops.update_(g.keys, g.values, kn, vn, start))
    raises_nothing_written(g, ValueError, rf"^start must be >= 0, got {start}$",
                           lambda: kvcache.update_kv_layer_cache(g.cache, kn, vn, start))
    s = torch.tensor([0, start], dtype=torch.int64)
    raises_nothing_written(g, ValueError, rf"^start must be >= 0, got {start} at index 1$",
                           lambda: ops.update_.Tensor(g.keys, g.values, kn, vn, s))


@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("value", [INT64_MAX, INT64_MAX - 1, INT64_MIN])
def test_append_overflowing_lengths(per_row, value):
    g = Guarded()
    kn, vn = new_kv(2)
    lengths = torch.tensor([1, value] if per_row else value, dtype=torch.int64)
    g.watch(lengths)
    if value < 0:
        match = rf"^lengths must be >= 0, got {value}" + (" at index 1$" if per_row else "$")
    else:
        idx = r"lengths\[1\]" if per_row else "lengths"
        match = rf"^KV cache overflow: end={value + 2} exceeds max_len={T} \({idx}={value}, chunk=2\)$"
    raises_nothing_written(g, ValueError, match, lambda: ops.append_(g.keys, g.values, lengths, kn, vn))


def test_rollback_select_attend_extreme_values():
    lengths = torch.tensor([3, 5], dtype=torch.int64)
    before = lengths.clone()
    for n, match in [
        (torch.tensor([0, INT64_MIN]), rf"^n must be >= 0, got {INT64_MIN} at index 1$"),
        (torch.tensor([0, INT64_MAX]), "cannot roll back more tokens than the row holds"),
    ]:
        with pytest.raises(ValueError, match=match):
            ops.rollback(lengths, n)
        assert torch.equal(lengths, before)
    with pytest.raises(ValueError, match=r"kv_start must be in \[0, lengths\]"):
        ops.rollback(lengths, torch.tensor(0), kv_start=torch.tensor([0, INT64_MIN]))
    assert torch.equal(lengths, before)
    g = Guarded()
    g.watch(lengths)
    for index, match in [
        (torch.tensor([0, INT64_MAX]), rf"^index must be in \[0, batch=2\), got {INT64_MAX} at index 1$"),
        (torch.tensor([INT64_MIN, 0]), rf"^index must be in \[0, batch=2\), got {INT64_MIN} at index 0$"),
        (torch.tensor([1, INT32_MIN], dtype=torch.int32), rf"got {INT32_MIN} at index 1$"),
    ]:
        raises_nothing_written(g, ValueError, match, lambda: ops.select_rows_(g.keys, g.values, lengths, index))
    bad_len = torch.tensor([INT64_MAX, 1])
    g.watch(bad_len)
    raises_nothing_written(g, ValueError, rf"^lengths must be in \[0, max_len={T}\], got {INT64_MAX} at index 0$",
                           lambda: ops.select_rows_(g.keys, g.values, bad_len, torch.tensor([1, 0])))
    q = torch.randn(B, H, 1, D)
    with pytest.raises(ValueError, match=rf"^lengths must be <= max_len={T}, got {INT64_MAX} at index 0$"):
        ops.attend(q, g.keys, g.values, bad_len)
    with pytest.raises(ValueError, match=rf"^lengths must be >= seq=1 .* got {INT64_MIN}$"):
        ops.attend(q, g.keys, g.values, torch.tensor(INT64_MIN))


class _Step(torch.nn.Module):
    """Owns a cache (buffers) and writes one chunk at a tensor start."""

    def __init__(self):
        super().__init__()
        self.register_buffer("keys", torch.zeros(1, 2, 8, 4))
        self.register_buffer("values", torch.zeros(1, 2, 8, 4))
        self.register_buffer("lengths", torch.zeros((), dtype=torch.int64))

    def forward(self, kn, vn, start):
        length = ops.update_.Tensor(self.keys, self.values, kn, vn, start)
        ops.append_(self.keys, self.values, self.lengths, kn, vn)
        return length


def test_exported_program_overflowing_start():
    """The exported program raises what eager raises, and writes nothing."""
    kn, vn = torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4)
    with torch.no_grad():
        ep = torch.export.export(_Step(), (kn, vn, torch.tensor(0)))
    m = ep.module()
    before = [b.clone() for b in m.buffers()]
    for start in (INT64_MAX, 2**62, -1, 8):
        with pytest.raises(ValueError, match=r"^(KV cache overflow: end=\d+ exceeds max_len=8 \(start=|start must be >= 0)"):
            m(kn, vn, torch.tensor(start))
        for b, a in zip(before, m.buffers()):
            assert torch.equal(a, b)
    m(kn, vn, torch.tensor(3))  # and a valid start still writes
    assert torch.equal(m.keys[:, :, 3], kn[:, :, 0]) and torch.equal(m.keys[:, :, 0], kn[:, :, 0])


@pytest.mark.parametrize("start", [2**63, 2**64 + 3, 10**30])
def test_python_int_start_beyond_int64(start):
    g = Guarded()
    kn, vn = new_kv(1)
    raises_nothing_written(g, ValueError, rf"^KV cache overflow: end={start + 1} exceeds max_len={T} \(start={start} does not fit in int64\)$",
                           lambda: kvcache.update_kv_layer_cache(g.cache, kn, vn, start))
    raises_nothing_written(g, ValueError, rf"^start must be >= 0, got -{start}$",
                           lambda: kvcache.update_kv_layer_cache(g.cache, kn, vn, -start))


@pytest.mark.parametrize("n", [2**63, -(2**63) - 1, 2**70])
def test_python_int_rollback_beyond_int64(n):
    cache = kvcache.init_kv_layer_cache(1, 1, 4, 8, torch.float32)
    cache = kvcache.KVLayerCache(cache.keys, cache.values, torch.tensor(5, dtype=torch.int32))
    match = (rf"^n must be >= 0, got {n}$" if n < 0
             else rf"^cannot roll back more tokens than the row holds: n={n} does not fit in int64$")
    with pytest.raises(ValueError, match=match):
        kvcache.rollback_kv_layer_cache(cache, n)
    assert int(cache.length) == 5


@pytest.mark.parametrize("name", ["batch_size", "num_kv_heads", "head_dim", "max_len"])
def test_python_int_sizes_beyond_int64(name):
    sizes = dict(batch_size=1, num_kv_heads=1, head_dim=1, max_len=1)
    sizes[name] = 2**63
    with pytest.raises(ValueError, match=rf"^{name} must fit in int64"):
        kvcache.init_kv_layer_cache(**sizes, dtype=torch.float32)
