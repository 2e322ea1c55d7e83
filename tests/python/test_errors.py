"""Every invalid argument raises ValueError/TypeError naming it, and nothing is written."""

from __future__ import annotations

import warnings

import pytest
import torch

import kvcache

B, H, T, D = 2, 3, 8, 4


@pytest.fixture
def cache():
    c = kvcache.init_kv_layer_cache(B, H, D, T, torch.float32)
    c.keys.copy_(torch.randn(B, H, T, D))
    c.values.copy_(torch.randn(B, H, T, D))
    return c


def new(chunk=2, dtype=torch.float32, b=B, h=H, d=D):
    return torch.randn(b, h, chunk, d).to(dtype), torch.randn(b, h, chunk, d).to(dtype)


def expect_no_write(cache, exc, match, *args, op="api"):
    before_k, before_v = cache.keys.clone(), cache.values.clone()
    with pytest.raises(exc, match=match):
        if op == "api":
            kvcache.update_kv_layer_cache(cache, *args)
        elif op == "update_":
            torch.ops.kvcache.update_(cache.keys, cache.values, *args)
        else:
            torch.ops.kvcache.update_.Tensor(cache.keys, cache.values, *args)
    assert torch.equal(cache.keys, before_k), "keys were written despite the error"
    assert torch.equal(cache.values, before_v), "values were written despite the error"


@pytest.mark.parametrize("op", ["api", "update_"])
def test_overflow_message(cache, op):
    kn, vn = new(3)
    expect_no_write(cache, ValueError, r"^KV cache overflow: end=9 exceeds max_len=8$", kn, vn, 6, op=op)


@pytest.mark.parametrize("op", ["api", "update_"])
def test_negative_start(cache, op):
    kn, vn = new(1)
    expect_no_write(cache, ValueError, "start must be >= 0, got -1", kn, vn, -1, op=op)


@pytest.mark.parametrize(
    "kshape,match",
    [
        ((B, H, 2), "keys_new must be a 4-D tensor"),
        ((B + 1, H, 2, D), r"keys_new must have shape \(batch=2, num_kv_heads=3, chunk, head_dim=4\)"),
        ((B, H + 1, 2, D), "keys_new must have shape"),
        ((B, H, 2, D + 1), "keys_new must have shape"),
    ],
)
def test_keys_new_shape(cache, kshape, match):
    kn = torch.randn(kshape)
    vn = torch.randn(B, H, 2, D)
    expect_no_write(cache, ValueError, match, kn, vn, 0)


def test_values_new_shape_mismatch(cache):
    kn = torch.randn(B, H, 2, D)
    vn = torch.randn(B, H, 3, D)
    expect_no_write(cache, ValueError, "values_new must have the same shape as keys_new", kn, vn, 0)


def test_cache_rank_and_shape(cache):
    kn, vn = new(1)
    with pytest.raises(ValueError, match="keys must be a 4-D tensor"):
        torch.ops.kvcache.update_(torch.zeros(B, H, T), cache.values, kn, vn, 0)
    before = cache.values.clone()
    with pytest.raises(ValueError, match="values must have the same shape as keys"):
        torch.ops.kvcache.update_(cache.keys, torch.zeros(B, H, T + 1, D), kn, vn, 0)
    with pytest.raises(ValueError, match="values must have the same shape as keys"):
        torch.ops.kvcache.update_(torch.zeros(B, H, T + 1, D), cache.values, kn, vn, 0)
    assert torch.equal(cache.values, before)


@pytest.mark.parametrize("which", ["keys_new", "values_new"])
def test_dtype_mismatch_is_type_error(cache, which):
    kn, vn = new(1)
    if which == "keys_new":
        kn = kn.double()
    else:
        vn = vn.half()
    expect_no_write(cache, TypeError, rf"{which} must have the cache dtype torch.float32 \(no implicit casts\), got torch.float(64|16)", kn, vn, 0)
    expect_no_write(cache, TypeError, f"{which} must have the cache dtype", kn, vn, torch.tensor(0))


def test_cache_dtype_mismatch_between_keys_and_values(cache):
    kn, vn = new(1)
    with pytest.raises(TypeError, match="values must have the same dtype as keys"):
        torch.ops.kvcache.update_(cache.keys, cache.values.double(), kn, vn, 0)


def test_device_mismatch_meta(cache):
    kn, vn = new(1)
    kn = kn.to("meta")
    expect_no_write(cache, ValueError, r"keys_new must be on the cache's device \(cpu\), got meta", kn, vn, 0)


def test_positions_dtype(cache):
    kn, vn = new(1)
    for bad in (torch.tensor(1.0), torch.tensor(True), torch.tensor(1, dtype=torch.int16)):
        expect_no_write(cache, TypeError, "start must be an int32 or int64 tensor", kn, vn, bad)


@pytest.mark.parametrize("shape", [(B + 1,), (1,), (B, 1), (1, B)])
def test_positions_shape(cache, shape):
    kn, vn = new(1)
    pos = torch.zeros(shape, dtype=torch.int64)
    expect_no_write(cache, ValueError, r"start must be a 0-D tensor .* shape \(batch=2,\)", kn, vn, pos)


def test_positions_device(cache):
    kn, vn = new(1)
    pos = torch.zeros((), dtype=torch.int64, device="meta")
    expect_no_write(cache, ValueError, r"start must be on the cache's device \(cpu\)", kn, vn, pos)


@pytest.mark.parametrize("op", ["api", "update_.Tensor"])
def test_positions_out_of_range_writes_nothing(cache, op):
    kn, vn = new(2)
    # Row 0 is valid, row 1 overflows: no row may be written.
    expect_no_write(
        cache, ValueError, r"KV cache overflow: end=9 exceeds max_len=8 \(start\[1\]=7",
        kn, vn, torch.tensor([0, 7]), op=op,
    )
    expect_no_write(cache, ValueError, "start must be >= 0, got -1 at index 0", kn, vn, torch.tensor([-1, 0]), op=op)
    expect_no_write(cache, ValueError, "KV cache overflow: end=10 exceeds max_len=8", kn, vn, torch.tensor(8, dtype=torch.int32), op=op)


def test_start_wrong_type(cache):
    kn, vn = new(1)
    for bad in (1.5, "3", None, True):
        expect_no_write(cache, TypeError, "start must be an int", kn, vn, bad)


def test_cache_wrong_type():
    kn, vn = new(1)
    with pytest.raises(TypeError, match="cache must be a KVLayerCache"):
        kvcache.update_kv_layer_cache((kn, vn, 0), kn, vn, 0)


def test_keys_and_values_same_buffer_rejected():
    """The JAX original's shared zeros buffer would alias keys and values here."""
    buf = torch.zeros(B, H, T, D)
    kn, vn = new(1)
    with pytest.raises(ValueError, match="keys and values must not share memory"):
        torch.ops.kvcache.update_(buf, buf, kn, vn, 0)
    # Two dense windows of one flat buffer that overlap by one position.
    flat = torch.zeros(B * H * T * D + D)
    keys = flat[: B * H * T * D].view(B, H, T, D)
    values = flat[D:].view(B, H, T, D)
    with pytest.raises(ValueError, match="keys and values must not share memory"):
        torch.ops.kvcache.update_(keys, values, kn, vn, 0)
    assert torch.count_nonzero(buf) == 0 and torch.count_nonzero(flat) == 0


def test_expanded_cache_rejected():
    keys = torch.zeros(1, H, T, D).expand(B, H, T, D)
    values = torch.zeros(B, H, T, D)
    kn, vn = new(1)
    with pytest.raises(ValueError, match="keys must not have internally overlapping memory"):
        torch.ops.kvcache.update_(keys, values, kn, vn, 0)
    assert torch.count_nonzero(values) == 0


def test_new_data_from_written_rows_rejected_other_rows_allowed():
    cache = kvcache.init_kv_layer_cache(1, 1, D, T, torch.float32)
    cache.keys.copy_(torch.randn(1, 1, T, D))
    cache.values.copy_(torch.randn(1, 1, T, D))
    vn = torch.randn(1, 1, 2, D)
    # rows 3..4 of the cache are read while rows 4..5 are written: refused
    expect_no_write(cache, ValueError, "keys_new must not share memory with the rows of keys that it is written to",
                    cache.keys[:, :, 3:5], vn, 4)
    expect_no_write(cache, ValueError, "values_new must not share memory with the rows of values", vn,
                    cache.values[:, :, 5:7], 4)
    # keys_new read from the values rows being written (a swap): refused too
    expect_no_write(cache, ValueError, "keys_new must not share memory with the rows of values",
                    cache.values[:, :, 4:6], vn, 4)
    # reading rows that are not written is fine (moving cached rows)
    src_k, src_v = cache.keys[:, :, 0:2], cache.values[:, :, 0:2]
    exp_k, exp_v = cache.keys.clone(), cache.values.clone()
    exp_k[:, :, 4:6] = src_k
    exp_v[:, :, 4:6] = src_v
    kvcache.update_kv_layer_cache(cache, src_k, src_v, 4)
    assert torch.equal(cache.keys, exp_k) and torch.equal(cache.values, exp_v)


def test_sparse_and_quantized_rejected(cache):
    kn, vn = new(1)
    with pytest.raises(ValueError, match="keys_new must be a strided"):
        torch.ops.kvcache.update_(cache.keys, cache.values, kn.to_sparse(), vn, 0)
    with pytest.raises(ValueError, match="values_new must be a strided"):
        torch.ops.kvcache.update_(cache.keys, cache.values, kn, vn.to_sparse(), torch.tensor(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated, still rejected
        q = torch.quantize_per_tensor(torch.zeros(B, H, T, D), 0.1, 0, torch.qint8)
    with pytest.raises(TypeError, match="keys must not be a quantized tensor, got dtype torch.qint8"):
        torch.ops.kvcache.update_(q, q.clone(), kn, vn, 0)
    with pytest.raises(TypeError, match="dtype must not be a quantized type"):
        torch.ops.kvcache.init_layer_cache(1, 1, 1, 1, dtype=torch.qint8)


@pytest.mark.parametrize("window,exc,match", [
    (1.5, TypeError, "window must be an int, got float"),
    (True, TypeError, "window must be an int, got bool"),
    (2 ** 63, ValueError, r"window must fit in int64 \(0: no window\), got 9223372036854775808"),
    (torch.tensor(3), TypeError, r"window must be an int or None, got a tensor: pass a Python int"),
])
def test_attend_window_argument(cache, window, exc, match):
    """attend's window is checked in Python (the dispatcher's own message names no argument)."""
    cache = kvcache.update_kv_layer_cache(cache, *new(3), 0)
    with pytest.raises(exc, match=match):
        kvcache.attend(torch.randn(B, H, 1, D), cache, window=window)


@pytest.mark.parametrize("name", ["scale", "softcap"])
@pytest.mark.parametrize("value,got", [(True, "bool"), ("0.5", "str"), (torch.tensor(0.5), "a tensor")])
@pytest.mark.parametrize("layout", ["rows", "ring", "pages"])
def test_attend_float_options_are_numbers(cache, name, value, got, layout):
    """scale / softcap: a bool (which the dispatcher took as 1.0), a str (its RuntimeError named
    no argument) or a tensor (read on the host in eager; under torch.compile the operator cannot
    take it) is a TypeError naming the option, on every layout; numbers and numpy scalars pass."""
    import numpy as np

    from kvcache.paged import attend_pages, init_paged_cache

    q = torch.randn(B, H, 1, D)
    if layout == "rows":
        cache = kvcache.update_kv_layer_cache(cache, *new(3), 0)
        call = lambda **kw: kvcache.attend(q, cache, **kw)  # noqa: E731
    elif layout == "ring":
        ring = kvcache.ring.init_ring_layer_cache(B, H, D, window=4, dtype=torch.float32)
        ring = kvcache.ring.update_ring_layer_cache(ring, *new(3), 0)
        call = lambda **kw: kvcache.attend(q, ring, **kw)  # noqa: E731
    else:
        pages = init_paged_cache(4, 4, H, D, torch.float32)
        table = torch.tensor([[0]] * B, dtype=torch.int32)
        lens = torch.ones(B, dtype=torch.int32)
        cu = torch.arange(B + 1, dtype=torch.int32)
        q3 = q[:, :, 0].contiguous()
        call = lambda **kw: attend_pages(q3, pages.key_pages, pages.value_pages, table, lens, cu, **kw)  # noqa: E731
    with pytest.raises(TypeError, match=f"{name} must be a float or None, got {got}"):
        call(**{name: value})
    for ok in (0.5, 2, np.float32(0.5)):
        call(**{name: ok})


# A list, a numpy array or None where a tensor goes: a TypeError naming the argument (the
# operators' own parsing would raise a RuntimeError), before anything is written.
def _plain_lin():
    c = kvcache.init_kv_layer_cache(2, 1, 4, 8, torch.float32)
    return kvcache.KVLayerCache(c.keys, c.values, torch.tensor([3, 3], dtype=torch.int32))


def _plain_ring():
    import dataclasses

    r = kvcache.init_ring_layer_cache(2, 1, 4, 4, torch.float32, max_step=2)
    return dataclasses.replace(r, length=torch.tensor([3, 3], dtype=torch.int32))


_KN = torch.randn(2, 1, 1, 4)
_Q = torch.randn(2, 2, 1, 4)
NOT_TENSORS = [
    ("kv_start", "list", lambda c: kvcache.attend(_Q, c, kv_start=[0, 1])),
    ("kv_start", "int", lambda c: kvcache.attend(_Q, c, kv_start=1)),
    ("sink_logits", "list", lambda c: kvcache.attend(_Q, c, sink_logits=[0.0, 0.0])),
    ("q", "ndarray", lambda c: kvcache.attend(_Q.numpy(), c)),
    ("keys_new", "ndarray", lambda c: kvcache.update_kv_layer_cache(c, _KN.numpy(), _KN, 1)),
    ("keys_new", "NoneType", lambda c: kvcache.update_kv_layer_cache(c, None, _KN, 1)),
    ("values_new", "list", lambda c: kvcache.append_kv_layer_cache(c, _KN, [1.0])),
    ("index", "list", lambda c: kvcache.select_rows_kv_layer_cache(c, [1, 0])),
    ("kv_start", "list", lambda c: kvcache.rollback_kv_layer_cache(c, 1, kv_start=[0, 0])),
]
RING_NOT_TENSORS = [
    ("index", "list", lambda r: kvcache.select_rows_ring_layer_cache(r, [1, 0])),
    ("values_new", "list", lambda r: kvcache.update_ring_layer_cache(r, _KN, [1.0], 0)),
    ("keys_new", "ndarray", lambda r: kvcache.write_ring_layer_cache(r, _KN.numpy(), _KN)),
    ("kv_start", "list", lambda r: kvcache.attend(_Q, r, kv_start=[0, 0])),
]


@pytest.mark.parametrize("layout", ["linear", "ring"])
def test_not_a_tensor_is_a_type_error_naming_it(layout):
    make, cases = (_plain_lin, NOT_TENSORS) if layout == "linear" else (_plain_ring, RING_NOT_TENSORS)
    for name, kind, call in cases:
        cache = make()
        before = [t.clone() for t in (cache.keys, cache.values, cache.length)]
        with pytest.raises(TypeError, match=rf"^{name} must be a torch.Tensor( or None)?, got {kind}$"):
            call(cache)
        assert all(torch.equal(a, b) for a, b in zip(before, (cache.keys, cache.values, cache.length))), name


def test_paged_not_a_tensor_is_a_type_error_naming_it():
    from kvcache.paged import attend_pages, init_paged_cache, write_pages

    pc = init_paged_cache(4, 2, 1, 4, torch.float32)
    with pytest.raises(TypeError, match=r"^slot_mapping must be a torch.Tensor, got list$"):
        write_pages(pc.key_pages, pc.value_pages, torch.randn(2, 1, 4), torch.randn(2, 1, 4), [0, 1])
    with pytest.raises(TypeError, match=r"^context_lens must be a torch.Tensor, got list$"):
        attend_pages(torch.randn(1, 1, 4), pc.key_pages, pc.value_pages, torch.zeros(1, 1, dtype=torch.int32), [1],
                      torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(TypeError, match=r"^sink_logits must be a torch.Tensor or None, got list$"):
        attend_pages(torch.randn(1, 1, 4), pc.key_pages, pc.value_pages, torch.zeros(1, 1, dtype=torch.int32),
                     torch.tensor([1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), sink_logits=[0.0])
    assert not pc.key_pages.any()
