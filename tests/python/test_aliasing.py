"""Aliasing: which overlaps of keys, values, new data and integer tensors are refused (the exact
byte-range test of csrc/core/overlap.cpp, for dense and strided views) and which are allowed
(reading rows that are not written, a fused (..., 2, head_dim) buffer). Refusals write nothing.
"""

from __future__ import annotations

import pytest
import torch

import kvcache  # noqa: F401  (loads the operators)
from kv_testing import Guarded, assert_same, random_tensor, raises_nothing_written
from kv_testing import guarded_new_kv as new_kv

B, H, T, D = 2, 3, 8, 4
ops = torch.ops.kvcache


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
