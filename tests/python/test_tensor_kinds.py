"""Tensors of every kind at the operators' boundary: lazy conj/neg bits (refused when written,
resolved when read), inference tensors outside inference mode, sparse/MKLDNN/nested inputs,
zero-size and 2**31-position caches. Every refusal comes before anything is written.
"""

from __future__ import annotations

import pytest
import torch

import kvcache
from kv_testing import Guarded, assert_same, random_tensor
from kv_testing import WRITERS
from kv_testing import guarded_new_kv as new_kv

B, H, T, D = 2, 3, 8, 4
ops = torch.ops.kvcache


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
