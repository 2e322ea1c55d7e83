"""Reliability: one focused test per item of the reliability issue (#8).

Each test targets a bug the previous implementation had (or a rule it did
not enforce) and asserts the behaviour against plain PyTorch: the error type
and message, and that nothing was written anywhere, including the bytes
around a cache sliced from a larger buffer (canaries).

  1. int64 overflow of start + chunk (every op and route), Python ints >= 2**63
  2. aliasing the old overlap test (at::get_overlap_status) let through
  3. autograd: version counters, requires_grad inputs
  4. lazy conj/neg bits, inference tensors, nested/sparse/MKLDNN inputs,
     caches of 2**31 positions or more
"""

from __future__ import annotations

import pytest
import torch

import kvcache
from kv_testing import assert_same, random_tensor

INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)
INT32_MAX = 2**31 - 1
INT32_MIN = -(2**31)
B, H, T, D = 2, 3, 8, 4
ops = torch.ops.kvcache


class Guarded:
    """A cache pair sliced out of larger random buffers: every byte around the
    cache is a canary. ``snapshot()``/``unchanged()`` compare every byte of the
    backing buffers (cache and canaries) and of any extra tensors."""

    def __init__(self, b=B, h=H, t=T, d=D, dtype=torch.float32, layout="bhtd", seed=0):
        self.extra = []
        if layout == "bhtd":  # padding on every side of every dimension
            kb = random_tensor((b + 2, h + 2, t + 3, d + 2), dtype, seed=seed)
            vb = random_tensor((b + 2, h + 2, t + 3, d + 2), dtype, seed=seed + 1)
            self.keys = kb[1 : b + 1, 1 : h + 1, 1 : t + 1, 1 : d + 1]
            self.values = vb[1 : b + 1, 1 : h + 1, 2 : t + 2, 1 : d + 1]
            self.bufs = [kb, vb]
        elif layout == "bthd":  # (batch, seq, heads, head_dim) memory, transposed
            kb = random_tensor((b, t + 2, h, d), dtype, seed=seed)
            vb = random_tensor((b, t + 2, h, d), dtype, seed=seed + 1)
            self.keys = kb[:, 1 : t + 1].transpose(1, 2)
            self.values = vb[:, 1 : t + 1].transpose(1, 2)
            self.bufs = [kb, vb]
        elif layout == "fused":  # one (batch, heads, max_len, 2, head_dim) buffer
            fb = random_tensor((b, h, t + 1, 2, d), dtype, seed=seed)
            self.keys = fb[:, :, :t, 0]
            self.values = fb[:, :, :t, 1]
            self.bufs = [fb]
        else:
            raise AssertionError(layout)
        self.length = torch.zeros((), dtype=torch.int32)
        self.snapshot()

    @property
    def cache(self):
        return kvcache.KVLayerCache(self.keys, self.values, self.length)

    def watch(self, *tensors):
        self.extra += list(tensors)
        self.snapshot()

    def snapshot(self):
        self._before = [t.clone() for t in self.bufs + self.extra]

    def unchanged(self):
        for before, now in zip(self._before, self.bufs + self.extra):
            assert_same(now, before)
        return True


def new_kv(chunk=1, b=B, h=H, d=D, dtype=torch.float32, seed=10):
    return (
        random_tensor((b, h, chunk, d), dtype, seed=seed),
        random_tensor((b, h, chunk, d), dtype, seed=seed + 1),
    )


def raises_nothing_written(g, exc, match, fn):
    g.snapshot()
    with pytest.raises(exc, match=match):
        fn()
    assert g.unchanged()


# ---------------------------------------------------------------------------
# 1. int64 overflow of start + chunk
# ---------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------
# 2. Aliasing
# ---------------------------------------------------------------------------

SHARE_KV = r"^keys and values must not share memory"


def test_keys_values_same_window_of_one_buffer_non_dense():
    """Two views of the same (non-dense) window: at::get_overlap_status said "too hard"."""
    buf = random_tensor((B, H, 2 * T + 2, 2 * D), torch.float32)
    before = buf.clone()
    kn, vn = new_kv(1)
    s0, s1, s2, _ = buf.stride()
    rows2 = lambda off: buf.as_strided((B, H, T, D), (s0, s1, 2 * s2, 1), off)  # noqa: E731  every other row
    for keys, values in [
        (buf[..., :D], buf[..., :D]),  # the same window
        (buf[..., :D], buf[..., 1 : D + 1]),  # shifted by one element
        (buf[..., ::2], buf[..., ::2]),  # every other element
        (rows2(0), rows2(2 * s2)),  # every other row, shifted by two rows: rows 2, 4, ... shared
        (rows2(0), rows2(2 * s2 + D - 1)),  # ... and by a partial row: one element shared
    ]:
        with pytest.raises(ValueError, match=SHARE_KV):
            ops.update_(keys, values, kn, vn, 0)
        assert_same(buf, before)
    # even rows and odd rows of one buffer share no byte: allowed
    ops.update_(rows2(0), rows2(s2), kn, vn, 1)
    before[:, :, 2:3, :D] = kn
    before[:, :, 3:4, :D] = vn
    assert_same(buf, before)


def test_fused_kv_same_slot_rejected_interleaved_allowed():
    fused = random_tensor((B, H, T, 2, D), torch.float32)
    before = fused.clone()
    kn, vn = new_kv(2)
    with pytest.raises(ValueError, match=SHARE_KV):
        ops.update_(fused[..., 0, :], fused[..., 0, :], kn, vn, 3)
    with pytest.raises(ValueError, match=SHARE_KV):  # the halves of one slot overlapping
        ops.update_(fused.view(B, H, T, 2 * D)[..., :D], fused.view(B, H, T, 2 * D)[..., 2:D + 2], kn, vn, 3)
    assert_same(fused, before)
    # keys and values interleaved in one buffer: no byte shared, allowed
    ops.update_(fused[..., 0, :], fused[..., 1, :], kn, vn, 3)
    before[:, :, 3:5, 0] = kn
    before[:, :, 3:5, 1] = vn
    assert_same(fused, before)


@pytest.mark.parametrize("rows", [(3, 5), (4, 6), (2, 4)])
def test_new_data_viewing_written_rows_of_transposed_cache(rows):
    """A (batch, seq, heads, head_dim) cache, new keys/values taken from the rows written (or overlapping them)."""
    g = Guarded(layout="bthd")
    lo, hi = rows
    src_k = g.keys[:, :, lo:hi]
    src_v = g.values[:, :, lo:hi]
    vn = torch.randn(B, H, hi - lo, D)
    for start in (lo - 1, lo, hi - 1):  # written rows [start, start + 2) intersect [lo, hi)
        raises_nothing_written(g, ValueError, "^keys_new must not share memory with the rows of keys that it is written to$",
                               lambda: ops.update_(g.keys, g.values, src_k, vn, start))
        raises_nothing_written(g, ValueError, "^values_new must not share memory with the rows of values",
                               lambda: ops.update_(g.keys, g.values, vn, src_v, start))
        raises_nothing_written(g, ValueError, "^keys_new must not share memory with the rows of keys",
                               lambda: ops.update_.Tensor(g.keys, g.values, src_k, vn, torch.tensor([start, 0])))


def test_keys_new_values_new_swap_rejected():
    g = Guarded(layout="bthd")
    kn, vn = g.values[:, :, 4:6], g.keys[:, :, 4:6]
    # keys is checked first: values_new reads its written rows
    msg = "^values_new must not share memory with the rows of keys that it is written to"
    raises_nothing_written(g, ValueError, msg + "$", lambda: ops.update_(g.keys, g.values, kn, vn, 4))
    raises_nothing_written(g, ValueError, msg,
                           lambda: ops.update_.Tensor(g.keys, g.values, kn, vn, torch.tensor(4, dtype=torch.int32)))
    lengths = torch.tensor(4)
    g.watch(lengths)
    raises_nothing_written(g, ValueError, msg, lambda: ops.append_(g.keys, g.values, lengths, kn, vn))
    # only one half of the swap aliasing a written row is enough
    raises_nothing_written(g, ValueError, "^keys_new must not share memory with the rows of values that it is written to$",
                           lambda: ops.update_(g.keys, g.values, kn, torch.randn(B, H, 2, D), 4))


@pytest.mark.parametrize("layout", ["bhtd", "bthd", "fused"])
def test_reading_rows_not_written_is_allowed(layout):
    """update_ (a host start): moving cached rows (and swapping K/V rows that are not written) is allowed and exact."""
    g = Guarded(layout=layout)
    kn, vn = g.values[:, :, 0:2], g.keys[:, :, 1:3]  # a swap, from rows that are not written
    ek, ev = g.keys.clone(), g.values.clone()
    ek[:, :, 5:7] = ev[:, :, 0:2].clone()
    ev[:, :, 5:7] = g.keys[:, :, 1:3].clone()
    ops.update_(g.keys, g.values, kn, vn, 5)
    assert_same(g.keys, ek)
    assert_same(g.values, ev)


START_TENSOR_ALIAS = (r"^keys_new must not share memory with the rows of keys that it is written to \(with a start "
                      r"tensor the rows written are only known when the kernel runs, so new data must not view the "
                      r"cache at all\)$")


@pytest.mark.parametrize("layout", ["bhtd", "bthd", "fused"])
def test_start_tensor_new_data_must_not_view_the_cache(layout):
    """With a start tensor the rows are only known when the kernel runs (on CUDA, on the device):
    any view of the cache as new data is refused, on every device and in traced code alike
    (eager CPU used to allow rows not written while the fake kernels refused them)."""
    g = Guarded(layout=layout, seed=5)
    kn, vn = g.keys[:, :, 0:2], torch.randn(B, H, 2, D)  # rows 0..1, never written at starts 3 and 6
    raises_nothing_written(g, ValueError, START_TENSOR_ALIAS,
                           lambda: ops.update_.Tensor(g.keys, g.values, kn, vn, torch.tensor([3, 6])))
    lengths = torch.tensor([3, 6])
    g.watch(lengths)
    raises_nothing_written(g, ValueError, START_TENSOR_ALIAS, lambda: ops.append_(g.keys, g.values, lengths, kn, vn))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fk, fv = mode.from_tensor(g.keys), mode.from_tensor(g.values)
        with pytest.raises(ValueError, match=START_TENSOR_ALIAS):
            ops.update_.Tensor(fk, fv, fk[:, :, 0:2], mode.from_tensor(vn), mode.from_tensor(torch.tensor([3, 6])))


def test_int_tensors_aliasing_the_cache_rejected():
    """An int cache whose bytes hold the start/lengths/index read or written by the op."""
    keys = torch.zeros(B, H, T, D, dtype=torch.int64)
    values = torch.zeros(B, H, T, D, dtype=torch.int64)
    kn, vn = torch.ones(B, H, 1, D, dtype=torch.int64), torch.ones(B, H, 1, D, dtype=torch.int64)
    with pytest.raises(ValueError, match="^start must not share memory with keys or values$"):
        ops.update_.Tensor(keys, values, kn, vn, keys[:, 0, 0, 0])
    with pytest.raises(ValueError, match="^lengths must not share memory with keys or values$"):
        ops.append_(keys, values, values[:, 0, 0, 0], kn, vn)
    with pytest.raises(ValueError, match="^lengths must not share memory with keys_new or values_new$"):
        ops.append_(keys, values, vn[:, 0, 0, 0], kn, vn)
    with pytest.raises(ValueError, match="^index must not share memory with keys or values$"):
        ops.select_rows_(keys, values, torch.zeros(B, dtype=torch.int64), keys[:, 0, 0, 0])
    assert torch.count_nonzero(keys) == 0 and torch.count_nonzero(values) == 0
    # index or n may share memory with lengths: rollback and select_rows_ only
    # read lengths and return new ones
    lengths = torch.tensor([1, 1, 0], dtype=torch.int64)
    assert ops.select_rows_(keys, values, lengths[:B], lengths[1:]).tolist() == [1, 1]  # index [1, 0]
    assert ops.rollback(lengths[:B], lengths[1:]).tolist() == [0, 1]


# ---------------------------------------------------------------------------
# 3. Autograd and in-place semantics
# ---------------------------------------------------------------------------


WRITERS = {
    "update_": lambda c, kn, vn: ops.update_(c.keys, c.values, kn, vn, 1),
    "update_.Tensor": lambda c, kn, vn: ops.update_.Tensor(c.keys, c.values, kn, vn, torch.tensor([1, 2])),
    "append_": lambda c, kn, vn: ops.append_(c.keys, c.values, c.length, kn, vn),
    "select_rows_": lambda c, kn, vn: ops.select_rows_(c.keys, c.values, c.length, torch.tensor([1, 0])),
}


@pytest.mark.parametrize("op", list(WRITERS))
def test_backward_through_saved_keys_detects_the_update(op):
    """A backward that saved the keys before an update raises, as with any in-place op."""
    c = kvcache.KVLayerCache(torch.randn(B, H, T, D), torch.randn(B, H, T, D), torch.tensor([2, 3]))
    w = torch.randn(B, H, T, D, requires_grad=True)
    loss = (w * c.keys).sum() + (w * c.values).sum()  # mul saves keys and values for w's grad
    kv0, vv0 = c.keys._version, c.values._version
    kn, vn = new_kv(2)
    WRITERS[op](c, kn, vn)
    assert c.keys._version > kv0 and c.values._version > vv0
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_lengths_version_bumped_only_where_written():
    lengths = torch.tensor([3, 4])
    c = kvcache.KVLayerCache(torch.zeros(B, H, T, D), torch.zeros(B, H, T, D), lengths)
    v1 = lengths._version
    ops.append_(c.keys, c.values, lengths, *new_kv(1))
    assert lengths._version > v1 and lengths.tolist() == [4, 5]
    # rollback and select_rows_ return new lengths: the input is not written
    v2 = lengths._version
    assert ops.rollback(lengths, torch.tensor(1)).tolist() == [3, 4]
    assert ops.select_rows_(c.keys, c.values, lengths, torch.tensor([1, 1])).tolist() == [5, 5]
    assert lengths._version == v2 and lengths.tolist() == [4, 5]


@pytest.mark.parametrize("which", ["keys", "values"])
@pytest.mark.parametrize("op", list(WRITERS))
def test_requires_grad_cache_refused(which, op):
    c = kvcache.KVLayerCache(torch.randn(B, H, T, D), torch.randn(B, H, T, D), torch.tensor([2, 3]))
    getattr(c, which).requires_grad_(True)
    before = (c.keys.detach().clone(), c.values.detach().clone(), c.length.clone())
    kn, vn = new_kv(2)
    with pytest.raises(ValueError, match=rf"{which} requires grad, but kvcache operators have no backward"):
        WRITERS[op](c, kn, vn)
    assert torch.equal(c.keys, before[0]) and torch.equal(c.values, before[1]) and torch.equal(c.length, before[2])
    with torch.no_grad():  # as built-in in-place ops: allowed on a leaf under no_grad
        WRITERS[op](c, kn, vn)


@pytest.mark.parametrize("which", ["keys_new", "values_new"])
@pytest.mark.parametrize("op", ["update_", "update_.Tensor", "append_"])
def test_new_data_requiring_grad_refused(which, op):
    """Silently detaching keys_new would drop its gradient: refused, nothing written."""
    g = Guarded()
    kn, vn = new_kv(2)
    (kn if which == "keys_new" else vn).requires_grad_(True)
    lengths = torch.tensor([0, 1])
    g.watch(lengths)
    c = kvcache.KVLayerCache(g.keys, g.values, lengths)
    raises_nothing_written(g, ValueError, rf"{which} requires grad", lambda: WRITERS[op](c, kn, vn))


def test_attend_query_requiring_grad_refused():
    c = kvcache.KVLayerCache(torch.randn(B, H, T, D), torch.randn(B, H, T, D), torch.tensor(3))
    q = torch.randn(B, H, 1, D, requires_grad=True)
    with pytest.raises(ValueError, match="q requires grad"):
        kvcache.attend(q, c)
    with torch.no_grad():
        assert kvcache.attend(q, c).shape == (B, H, 1, D)


# ---------------------------------------------------------------------------
# 4. Lazy bits, inference tensors, layouts, huge caches
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("bit", ["conj", "neg"])
@pytest.mark.parametrize("which", ["keys", "values"])
@pytest.mark.parametrize("op", list(WRITERS))
def test_lazy_bit_cache_refused_before_any_write(bit, which, op):
    """The other buffer used to be written before torch's fallback failed on this one."""
    dtype = torch.complex64 if bit == "conj" else torch.float32
    kb = random_tensor((B, H, T, D), dtype, seed=1)
    vb = random_tensor((B, H, T, D), dtype, seed=2)
    lengths = torch.tensor([1, 2])
    before = [kb.clone(), vb.clone(), lengths.clone()]
    lazy = (lambda t: t.conj()) if bit == "conj" else torch._neg_view
    keys, values = (lazy(kb), vb) if which == "keys" else (kb, lazy(vb))
    assert getattr(keys if which == "keys" else values, f"is_{bit}")()
    c = kvcache.KVLayerCache(keys, values, lengths)
    kn, vn = new_kv(2, dtype=dtype)
    name = "conjugate" if bit == "conj" else "negative"
    with pytest.raises(ValueError, match=rf"^{which} must not have the {name} bit set"):
        WRITERS[op](c, kn, vn)
    for b, a in zip(before, (kb, vb, lengths)):
        assert_same(a, b)


@pytest.mark.parametrize("bit", ["conj", "neg"])
def test_lazy_bit_new_data_is_read_resolved(bit):
    dtype = torch.complex64 if bit == "conj" else torch.float32
    c = kvcache.KVLayerCache(torch.zeros(B, H, T, D, dtype=dtype), torch.zeros(B, H, T, D, dtype=dtype), torch.tensor(0))
    kn, vn = new_kv(2, dtype=dtype)
    lazy = (lambda t: t.conj()) if bit == "conj" else torch._neg_view
    ops.update_(c.keys, c.values, lazy(kn), vn, 1)
    assert torch.equal(c.keys[:, :, 1:3], lazy(kn).resolve_conj().resolve_neg())
    assert torch.equal(c.values[:, :, 1:3], vn)


def test_lazy_bit_lengths_refused():
    lengths = torch._neg_view(torch.tensor([3, 4]))
    c = kvcache.KVLayerCache(torch.zeros(B, H, T, D), torch.zeros(B, H, T, D), lengths)
    with pytest.raises(ValueError, match="^lengths must not have the negative bit set"):
        ops.append_(c.keys, c.values, lengths, *new_kv(1))
    assert torch.count_nonzero(c.keys) == 0


def _inference_msg():
    with torch.inference_mode():
        t = torch.zeros(2)
    with pytest.raises(RuntimeError) as info:
        t.add_(1)
    return str(info.value)


@pytest.mark.parametrize("op", list(WRITERS) + ["rollback"])
def test_inference_tensor_written_outside_inference_mode(op):
    """PyTorch's own RuntimeError (type and message) for a built-in in-place op, before any write."""
    with torch.inference_mode():
        c = kvcache.KVLayerCache(torch.randn(B, H, T, D), torch.randn(B, H, T, D), torch.tensor([2, 3]))
    before = [c.keys.clone(), c.values.clone(), c.length.clone()]
    kn, vn = new_kv(2)
    ref = _inference_msg()
    with pytest.raises(RuntimeError) as info:
        if op == "rollback":  # the API copies the new lengths into cache.length
            kvcache.rollback_kv_layer_cache(c, 1)
        else:
            WRITERS[op](c, kn, vn)
    assert str(info.value).startswith(ref.split(".")[0]), (str(info.value), ref)
    for b, a in zip(before, (c.keys, c.values, c.length)):
        assert_same(a, b)
    with torch.inference_mode():  # inside inference mode: fine
        WRITERS["update_"](c, kn, vn) if op == "rollback" else WRITERS[op](c, kn, vn)


def test_only_values_inference_tensor_keys_untouched():
    with torch.inference_mode():
        values = torch.randn(B, H, T, D)
    keys = torch.randn(B, H, T, D)
    kb = keys.clone()
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
        ops.update_(keys, values, *new_kv(1), 0)
    assert torch.equal(keys, kb)


def test_inference_tensor_new_data_is_read_fine():
    """Reading an inference tensor outside inference mode is allowed, as for built-in ops."""
    with torch.inference_mode():
        kn, vn = new_kv(1)
    c = kvcache.KVLayerCache(torch.zeros(B, H, T, D), torch.zeros(B, H, T, D), torch.tensor(0))
    ops.update_(c.keys, c.values, kn, vn, 2)
    assert torch.equal(c.keys[:, :, 2:3], kn) and torch.equal(c.values[:, :, 2:3], vn)


def _layouts():
    out = {
        "nested": lambda t: torch.nested.nested_tensor(list(t.unbind(0))),
        "sparse_coo": lambda t: t.to_sparse(),
        "sparse_csr": lambda t: t.reshape(-1, t.shape[-1]).to_sparse_csr(),
    }
    if torch.backends.mkldnn.is_available():
        out["mkldnn"] = lambda t: t.to_mkldnn()
    return out


@pytest.mark.filterwarnings("ignore")  # nested/sparse CSR "prototype"/"beta" warnings
@pytest.mark.parametrize("layout", list(_layouts()))
@pytest.mark.parametrize("which", ["keys", "values", "keys_new", "values_new"])
def test_non_strided_inputs_value_error(layout, which):
    g = Guarded()
    kn, vn = new_kv(1)
    args = dict(keys=g.keys, values=g.values, keys_new=kn, values_new=vn)
    try:
        args[which] = _layouts()[layout](args[which].contiguous())
    except RuntimeError as exc:  # pragma: no cover - layout unsupported by this torch build
        pytest.skip(str(exc))
    g.snapshot()
    with pytest.raises(ValueError, match=rf"^{which} must be a strided \(dense\) tensor, got "):
        ops.update_(args["keys"], args["values"], args["keys_new"], args["values_new"], 0)
    assert g.unchanged()


def test_zero_tensor_cache_refused():
    keys = torch._efficientzerotensor((B, H, T, D))
    values = torch.randn(B, H, T, D)
    before = values.clone()
    with pytest.raises((RuntimeError, ValueError), match="ZeroTensors are immutable|keys"):
        ops.update_(keys, values, *new_kv(1), 0)
    assert torch.equal(values, before)


MAXLEN = r"keys has max_len=2147483648 positions; lengths are int32, so a cache holds at most 2147483647 positions"


@pytest.mark.parametrize("route", ["expand", "as_strided", "fake"])
def test_cache_of_2_31_positions_refused(route):
    """No allocation: a stride-0 view, or fake tensors. The length would wrap negative in int32."""
    n = 2**31
    if route == "fake":
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode():
            keys = torch.empty(1, 1, n, 1)
            values = torch.empty(1, 1, n, 1)
            kn = torch.empty(1, 1, 1, 1)
            with pytest.raises(ValueError, match=MAXLEN):
                ops.update_(keys, values, kn, kn, n - 1)
            with pytest.raises(ValueError, match=MAXLEN):
                ops.update_.Tensor(keys, values, kn, kn, torch.tensor(0))
            with pytest.raises(ValueError, match=MAXLEN):
                ops.attend(kn, keys, values, torch.tensor(1))
        return
    base = torch.zeros(1)
    view = base.expand(1, 1, n, 1) if route == "expand" else base.as_strided((1, 1, n, 1), (0, 0, 0, 0))
    values = torch.zeros(1).expand(1, 1, n, 1)
    kn = torch.ones(1, 1, 1, 1)
    with pytest.raises(ValueError, match=MAXLEN):
        ops.update_(view, values, kn, kn, n - 1)
    with pytest.raises(ValueError, match=MAXLEN):
        ops.append_(view, values, torch.tensor(n - 1, dtype=torch.int64), kn, kn)
    with pytest.raises(ValueError, match=MAXLEN):
        ops.select_rows_(view, values, torch.tensor(0), torch.tensor([0]))
    with pytest.raises(ValueError, match=MAXLEN):
        ops.attend(kn, view, values, torch.tensor(1))
    with pytest.raises(ValueError, match=r"max_len must be <= 2147483647 \(lengths are int32\), got 2147483648"):
        kvcache.init_kv_layer_cache(1, 1, 1, n, torch.float32)
    assert float(base) == 0.0
