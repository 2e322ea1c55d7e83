"""Autograd and in-place semantics: version counters bumped for what is written (and only
that), inputs that require grad refused while grad mode is on.
"""

from __future__ import annotations

import pytest
import torch

import kvcache
from kv_testing import Guarded, raises_nothing_written
from kv_testing import WRITERS
from kv_testing import guarded_new_kv as new_kv

B, H, T, D = 2, 3, 8, 4
ops = torch.ops.kvcache


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
