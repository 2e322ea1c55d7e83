"""Row operations given bad input refuse it before anything changes (adversarial review).

  1. reset_rows_ring_layer_cache trusted `rows`: a 1-entry mask emptied every row,
     -1 emptied the last row, a (batch, 1) mask or an index past the batch wiped
     positions and then raised, and int32 indices raised IndexError. It now
     validates through the reset_rows operator, as reset_rows_kv_layer_cache does.
  2. write_ring_layer_cache on an expand()ed length wrote keys, values, positions
     and scales, then raised.
  3. select_rows on quantized caches (linear and ring) whose scales alias each
     other or the data, or are one slot short, and on a ring whose positions are
     one column short: moved rows, then raised (or did not raise at all).
  4. The deprecated aliases called warnings.warn, a graph break under
     torch.compile(fullgraph=True).

After every refused call the cache is compared, bit for bit, with clones taken
before the call: keys, values, positions, lengths and scales.
"""

from __future__ import annotations

import dataclasses
import re
import warnings

import pytest
import torch

import kvcache

from kv_testing import assert_same, cuda_ready, random_tensor

B, H, D, WINDOW, MAX_STEP = 3, 2, 8, 4, 2
T = 6  # max_len of the linear caches


def ring(kv_dtype=None, device="cpu"):
    """A 3-row ring with ragged per-row lengths and wrapped rows (every slot holds a position)."""
    r = kvcache.init_ring_layer_cache(B, H, D, WINDOW, torch.float32, device, max_step=MAX_STEP, kv_dtype=kv_dtype)
    kn = random_tensor((B, H, 7, D), torch.float32, device, seed=1)
    vn = random_tensor((B, H, 7, D), torch.float32, device, seed=2)
    return kvcache.update_ring_layer_cache(r, kn, vn, torch.tensor([0, 1, 2], dtype=torch.int32, device=device))


def linear(kv_dtype=None):
    c = kvcache.init_kv_layer_cache(B, H, D, T, torch.float32, kv_dtype=kv_dtype)
    kn = random_tensor((B, H, 4, D), torch.float32, seed=3)
    vn = random_tensor((B, H, 4, D), torch.float32, seed=4)
    return kvcache.update_kv_layer_cache(c, kn, vn, torch.tensor([0, 1, 2]))


def fields(cache):
    names = ("keys", "values", "positions", "length", "k_scale", "v_scale")
    return {n: getattr(cache, n) for n in names if getattr(cache, n, None) is not None}


def snapshot(cache):
    return {n: t.clone() for n, t in fields(cache).items()}


def assert_unchanged(cache, snap):
    now = fields(cache)
    assert now.keys() == snap.keys()
    for name, before in snap.items():
        try:
            assert_same(now[name], before)
        except AssertionError:
            raise AssertionError(f"{name} changed") from None


def raise_same(fn, args, exc, msg, compiled):
    """Calls fn eagerly or compiled; the error (a trace-time one quoted by Dynamo) must be exc with msg."""
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(fn, fullgraph=True)
    with pytest.raises(Exception) as info:
        fn(*args)
    err = info.value
    # Dynamo wraps trace-time errors, quoting them: an operator check's in a TorchRuntimeError, a
    # Python check's in an Unsupported ("raised exception ValueError(...)").
    if isinstance(err, (torch._dynamo.exc.TorchRuntimeError, torch._dynamo.exc.Unsupported)):
        assert exc.__name__ in str(err), str(err)
    else:
        assert type(err) is exc, repr(err)
    assert re.search(msg, str(err)), str(err)


MODES = pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])


# ------------------------------------------------------------ 1. ring reset


def reference_reset(ring_cache, rows):
    length, positions = ring_cache.length.clone(), ring_cache.positions.clone()
    hit = torch.zeros(B, dtype=torch.bool)
    if rows.dtype == torch.bool:
        hit |= rows
    else:
        hit[rows.reshape(-1).long()] = True
    length[hit] = 0
    positions[hit] = -1
    return length, positions


@pytest.mark.parametrize(
    "rows",
    [
        torch.tensor([True, False, True]),
        torch.tensor([False] * 3),
        torch.tensor([2, 0]),
        torch.tensor([1, 1], dtype=torch.int32),
        torch.tensor(2, dtype=torch.int32),
        torch.tensor([], dtype=torch.int64),
        torch.tensor([True, False] * 3)[::2],
    ],
    ids=["mask", "mask-none", "int64", "int32-repeat", "int32-0d", "empty", "mask-strided"],
)
def test_ring_reset_rows_matches_reference(rows):
    r = ring()
    # A row whose length is 0 but that is not reset keeps its positions.
    r.length[1] = 0
    snap = snapshot(r)
    expect_length, expect_positions = reference_reset(r, rows)
    address = r.length.data_ptr()
    assert kvcache.reset_rows_ring_layer_cache(r, rows) is r
    assert_same(r.length, expect_length)
    assert_same(r.positions, expect_positions)
    assert r.length.data_ptr() == address
    assert_same(r.keys, snap["keys"])
    assert_same(r.values, snap["values"])


BAD_ROWS = [
    (torch.tensor([True]), ValueError, r"rows \(a bool mask\) must have shape \(batch=3,\), got shape \[1\]"),
    (torch.tensor([True] * 4), ValueError, r"rows \(a bool mask\) must have shape \(batch=3,\), got shape \[4\]"),
    (torch.tensor([[True]] * 3), ValueError, r"rows \(a bool mask\) must have shape \(batch=3,\), got shape \[3, 1\]"),
    (torch.tensor([-1]), ValueError, r"rows must be in \[0, batch=3\), got -1 at index 0"),
    (torch.tensor([0, 7]), ValueError, r"rows must be in \[0, batch=3\), got 7 at index 1"),
    (torch.tensor(3, dtype=torch.int32), ValueError, r"rows must be in \[0, batch=3\), got 3$"),
    (torch.tensor([[0, 1]]), ValueError, r"rows \(row indices\) must be a 0-D or 1-D tensor, got shape \[1, 2\]"),
    (torch.tensor([0], dtype=torch.int16), TypeError, r"rows must be a bool mask or an int32 or int64 tensor of row "
     r"indices, got dtype torch.int16"),
    (torch.tensor([0.0]), TypeError, r"got dtype torch.float32"),
    ([0, 1], TypeError, r"rows must be a bool mask or an int32 or int64 tensor of row indices, got list"),
]


@pytest.mark.parametrize("rows,exc,msg", BAD_ROWS, ids=[m[:40] for _, _, m in BAD_ROWS])
@MODES
def test_ring_reset_rows_refuses_bad_rows_before_any_change(rows, exc, msg, compiled):
    if compiled and not isinstance(rows, torch.Tensor):
        pytest.skip("a list is not a compiled-code input")
    r = ring()
    snap = snapshot(r)

    def reset(cache, rows):
        return kvcache.reset_rows_ring_layer_cache(cache, rows).length + 0

    raise_same(reset, (r, rows), exc, msg, compiled)
    assert_unchanged(r, snap)


def test_ring_reset_rows_refuses_shared_length_and_expanded_length():
    r = ring()
    shared = dataclasses.replace(r, length=torch.tensor(5, dtype=torch.int32))
    snap = snapshot(shared)
    with pytest.raises(ValueError, match=r"needs a per-row length of shape \(batch,\)"):
        kvcache.reset_rows_ring_layer_cache(shared, torch.tensor([0]))
    assert_unchanged(shared, snap)
    expanded = dataclasses.replace(r, length=torch.tensor(5, dtype=torch.int32).expand(B))
    snap = snapshot(expanded)
    with pytest.raises(ValueError, match=r"lengths must not have internally overlapping memory"):
        kvcache.reset_rows_ring_layer_cache(expanded, torch.tensor([0]))
    assert_unchanged(expanded, snap)


@pytest.mark.skipif(not cuda_ready(), reason="needs a GPU and a CUDA build of kvcache")
def test_ring_reset_rows_bad_index_on_cuda_wipes_nothing_and_poisons_lengths():
    r = ring(device="cuda")
    snap = snapshot(r)
    kvcache.reset_rows_ring_layer_cache(r, torch.tensor([0, 7], device="cuda"))
    assert (r.length == -1).all()
    for name in ("keys", "values", "positions"):
        assert_same(getattr(r, name), snap[name])


# ------------------------------------------- 2. write on an expanded length


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
@pytest.mark.parametrize("chunk", [1, MAX_STEP + 3], ids=["short-chunk", "long-chunk"])
@MODES
def test_write_ring_on_expanded_length_refused_before_any_write(kv_dtype, chunk, compiled):
    r = ring(kv_dtype)
    r = dataclasses.replace(r, length=torch.tensor(9, dtype=torch.int32).expand(B))
    snap = snapshot(r)
    kn = random_tensor((B, H, chunk, D), torch.float32, seed=5)
    vn = random_tensor((B, H, chunk, D), torch.float32, seed=6)

    def write(cache, kn, vn):
        return kvcache.write_ring_layer_cache(cache, kn, vn).length + 0

    raise_same(write, (r, kn, vn), ValueError, r"lengths must not have internally overlapping memory", compiled)
    assert_unchanged(r, snap)


def test_write_ring_with_start_on_expanded_length_still_writes():
    # With an explicit start the ring's length is not written: nothing to refuse.
    r = ring()
    r = dataclasses.replace(r, length=torch.tensor(9, dtype=torch.int32).expand(B))
    kn = random_tensor((B, H, 1, D), torch.float32, seed=5)
    kv = kvcache.write_ring_layer_cache(r, kn, kn + 1, 9)
    assert int(kv.length) == 10


# ------------------------------------------- 3. select_rows, bad scales / positions


INDEX = torch.tensor([2, 0, 0])


def scale_view_of_data(t):
    """A float32 (batch, heads, slots) view of an int8 (batch, heads, slots, head_dim=8) buffer."""
    return t.view(torch.float32)[..., 0]


def shifted_views(scale):
    """Two overlapping (batch, heads, slots) views of one buffer, one slot apart."""
    base = torch.ones(scale.shape[0], scale.shape[1], scale.shape[2] + 1)
    return base[:, :, :-1], base[:, :, 1:]


def bad_scales(cache, slots):
    k, v = cache.k_scale, cache.v_scale
    a, b = shifted_views(k)
    short = r"must have shape \(batch=3, num_kv_heads=2, max_len=%d\) to match the cache, got \[3, 2, %d\]" % (
        slots,
        slots - 1,
    )
    return {
        "k-is-v": (dict(v_scale=k), r"k_scale and v_scale must not share memory"),
        "k-v-views-of-one-buffer": (dict(k_scale=a, v_scale=b), r"k_scale and v_scale must not share memory"),
        "k-scale-views-keys": (dict(k_scale=scale_view_of_data(cache.keys)), r"k_scale must not share memory with "
                               r"keys or values"),
        "v-scale-views-values": (dict(v_scale=scale_view_of_data(cache.values)), r"v_scale must not share memory "
                                 r"with keys or values"),
        "k-scale-short": (dict(k_scale=k[:, :, :-1]), r"k_scale " + short),
        "v-scale-short": (dict(v_scale=v[:, :, :-1]), r"v_scale " + short),
        "both-short": (dict(k_scale=k[:, :, :-1], v_scale=v[:, :, :-1]), r"k_scale " + short),
    }


SCALE_CASES = list(bad_scales(linear("int8"), T))


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("case", SCALE_CASES)
@MODES
def test_select_rows_linear_refuses_bad_scales_before_any_move(case, compiled, kv_dtype):
    c = linear(kv_dtype)
    change, msg = bad_scales(c, T)[case]
    bad = dataclasses.replace(c, **change)
    snap = snapshot(bad)

    def select(cache, index):
        return kvcache.select_rows_kv_layer_cache(cache, index).length + 0

    raise_same(select, (bad, INDEX), ValueError, msg, compiled)
    assert_unchanged(bad, snap)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("case", SCALE_CASES)
@MODES
def test_select_rows_ring_refuses_bad_scales_before_any_move(case, compiled, kv_dtype):
    r = ring(kv_dtype)
    change, msg = bad_scales(r, r.capacity)[case]
    bad = dataclasses.replace(r, **change)
    snap = snapshot(bad)

    def select(cache, index):
        return kvcache.select_rows_ring_layer_cache(cache, index).length + 0

    raise_same(select, (bad, INDEX), ValueError, msg, compiled)
    assert_unchanged(bad, snap)


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
@MODES
def test_select_rows_ring_refuses_short_positions_before_any_move(kv_dtype, compiled):
    r = ring(kv_dtype)
    bad = dataclasses.replace(r, positions=r.positions[:, :-1])
    snap = snapshot(bad)
    msg = r"positions must have shape \(batch=3, capacity=%d\) to match the cache, got \[3, %d\]" % (
        r.capacity,
        r.capacity - 1,
    )

    def select(cache, index):
        return kvcache.select_rows_ring_layer_cache(cache, index).length + 0

    raise_same(select, (bad, INDEX), ValueError, msg, compiled)
    assert_unchanged(bad, snap)


def test_select_rows_accepts_interleaved_scales_of_one_buffer():
    # Disjoint views of one buffer share no byte: accepted, and they move as separate scales do.
    for make, select in ((linear, kvcache.select_rows_kv_layer_cache), (ring, kvcache.select_rows_ring_layer_cache)):
        expect, cache = make("int8"), make("int8")
        base = torch.empty(*cache.k_scale.shape, 2)
        base[..., 0] = cache.k_scale
        base[..., 1] = cache.v_scale
        c = dataclasses.replace(cache, k_scale=base[..., 0], v_scale=base[..., 1])
        select(expect, INDEX)
        select(c, INDEX)
        for name, t in fields(expect).items():
            assert_same(getattr(c, name), t)


def test_select_rows_ring_moves_scales_and_positions():
    r = ring("int8")
    snap = snapshot(r)
    kvcache.select_rows_ring_layer_cache(r, INDEX)
    for name, before in snap.items():
        assert_same(getattr(r, name), before[INDEX])


# ------------------------------------------------------ 4. deprecated aliases


def ragged_linear():
    c = linear()
    return kvcache.KVLayerCache(c.keys, c.values, c.length.clone())


@pytest.mark.parametrize(
    "old,new,arg",
    [
        ("select_kv_layer_cache_rows", "select_rows_kv_layer_cache", torch.tensor([2, 0, 1])),
        ("reset_kv_layer_cache_rows", "reset_rows_kv_layer_cache", torch.tensor([True, False, True])),
    ],
    ids=["select", "reset"],
)
def test_deprecated_aliases_warn_eagerly_and_compile_fullgraph(old, new, arg):
    old_fn, new_fn = getattr(kvcache, old), getattr(kvcache, new)
    expect, eager = ragged_linear(), ragged_linear()
    new_fn(expect, arg)
    with pytest.warns(DeprecationWarning, match=f"kvcache.{old} is deprecated: use kvcache.{new}"):
        assert old_fn(eager, arg) is eager
    for name in ("keys", "values", "length"):
        assert_same(getattr(eager, name), getattr(expect, name))

    torch._dynamo.reset()
    compiled_cache = ragged_linear()
    step = torch.compile(lambda c, a: old_fn(c, a).length + 0, fullgraph=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # a compiled call need not warn; it must compile
        out = step(compiled_cache, arg)
    assert_same(out, expect.length)
    for name in ("keys", "values", "length"):
        assert_same(getattr(compiled_cache, name), getattr(expect, name))


# ------------------------------------------------- 5. ring length and positions
# (a second adversarial review: select_rows_ring_layer_cache moved keys, values and positions,
# then failed or accepted a length of the wrong shape or dtype; reset_rows_ring_layer_cache
# wrote any positions it was given, an expand()ed one's every row at once)


@pytest.mark.parametrize("length,exc,msg", [
    (torch.tensor([3, 3], dtype=torch.int32), ValueError,
     r"length must be a 0-D tensor \(one value for every row\) or have shape \(batch=3,\), got shape \(2,\)"),
    (torch.tensor([[3], [3], [3]], dtype=torch.int32), ValueError, r"got shape \(3, 1\)"),
    (torch.tensor([3.0, 3.0, 3.0]), TypeError, "length must be an int32 or int64 tensor, got torch.float32"),
    (torch.tensor([True, True, True]), TypeError, "got torch.bool"),
], ids=["short", "2-D", "float", "bool"])
@MODES
def test_select_rows_ring_refuses_bad_length_before_any_move(length, exc, msg, compiled):
    bad = dataclasses.replace(ring(), length=length)
    snap = snapshot(bad)

    def select(cache, index):
        return kvcache.select_rows_ring_layer_cache(cache, index).positions + 0

    raise_same(select, (bad, INDEX), exc, msg, compiled)
    assert_unchanged(bad, snap)


@pytest.mark.parametrize("case", ["expanded", "wide", "int64"])
@MODES
def test_reset_rows_ring_refuses_bad_positions_before_any_change(case, compiled):
    r = ring()
    positions = {"expanded": r.positions[:1].expand(B, -1),
                 "wide": torch.cat([r.positions, r.positions[:, :1]], 1),
                 "int64": r.positions.long()}[case]
    bad = dataclasses.replace(r, positions=positions)
    snap = snapshot(bad)
    exc, msg = {"expanded": (ValueError, "positions must not have internally overlapping memory"),
                "wide": (ValueError, r"positions must have shape \(batch=3, capacity=%d\)" % r.capacity),
                "int64": (TypeError, "positions")}[case]

    def reset(cache, rows):
        return kvcache.reset_rows_ring_layer_cache(cache, rows).length + 0

    raise_same(reset, (bad, torch.tensor([1])), exc, msg, compiled)
    assert_unchanged(bad, snap)


@pytest.mark.parametrize("layout", ["linear", "ring"])
@pytest.mark.parametrize("inside", ["data", "scales"])
def test_quantized_select_refuses_an_index_inside_the_cache_before_any_move(layout, inside):
    """A quantized select moves data and scales in two operator calls: an index lying in the
    memory of either is refused before the first moves anything."""
    cache = ring("int8") if layout == "ring" else linear("int8")
    if layout == "linear":
        cache = dataclasses.replace(cache, length=torch.full((B,), 3, dtype=torch.int32))
    holder = cache.keys if inside == "data" else cache.k_scale
    index = holder.reshape(-1).view(torch.int32)[-B:]  # the last B int32s of the holder's memory
    index.copy_(torch.tensor([2, 0, 1], dtype=torch.int32))
    snap = snapshot(cache)
    select = kvcache.select_rows_ring_layer_cache if layout == "ring" else kvcache.select_rows_kv_layer_cache
    with pytest.raises(ValueError, match="index must not share memory"):
        select(cache, index)
    assert_unchanged(cache, snap)
