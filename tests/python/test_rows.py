"""rollback, select_rows_ and per-row reset against plain-PyTorch references."""

from __future__ import annotations

import pytest
import torch

import kvcache

from kv_testing import ALL_DTYPES, assert_same, random_tensor
from kv_testing import device  # noqa: F401  (the device fixture)
from references import select_reference

B, H, T, D = 4, 2, 16, 8


def ragged_cache(dtype=torch.float32, lengths=(5, 16, 0, 9), length_dtype=torch.int32, seed=0, device="cpu"):
    """A cache whose rows hold random data up to different lengths (and other junk after)."""
    cache = kvcache.init_kv_layer_cache(B, H, D, T, dtype, device=device)
    cache.keys.copy_(random_tensor((B, H, T, D), dtype, device, seed=seed))
    cache.values.copy_(random_tensor((B, H, T, D), dtype, device, seed=seed + 1))
    return kvcache.KVLayerCache(cache.keys, cache.values, torch.tensor(lengths, dtype=length_dtype, device=device))


def filled(cache, b):
    n = int(cache.length[b]) if cache.length.dim() else int(cache.length)
    return cache.keys[b, :, :n], cache.values[b, :, :n]


# ---------------------------------------------------------------- rollback ---


@pytest.mark.parametrize("n_dtype", [torch.int32, torch.int64])
def test_rollback_per_row_moves_lengths_only(n_dtype, device):
    cache = ragged_cache(device=device)
    keys, values = cache.keys.clone(), cache.values.clone()
    address = cache.length.data_ptr()
    out = kvcache.rollback_kv_layer_cache(cache, torch.tensor([2, 16, 0, 9], dtype=n_dtype, device=device))
    assert out is cache and cache.length.data_ptr() == address  # in place, same tensor
    assert cache.length.tolist() == [3, 0, 0, 0] and cache.length.dtype == torch.int32
    assert torch.equal(cache.keys, keys) and torch.equal(cache.values, values)  # nothing copied


def test_rollback_then_rewrite_equals_never_written():
    """Write 5 tokens, roll 3 back, write 2 others: same as writing 2 then those 2."""
    k0, v0 = random_tensor((B, H, 4, D), torch.float32, seed=3), random_tensor((B, H, 4, D), torch.float32, seed=4)
    k1, v1 = random_tensor((B, H, 5, D), torch.float32, seed=5), random_tensor((B, H, 5, D), torch.float32, seed=6)
    k2, v2 = random_tensor((B, H, 2, D), torch.float32, seed=7), random_tensor((B, H, 2, D), torch.float32, seed=8)
    a = kvcache.init_kv_layer_cache(B, H, D, T, torch.float32)
    a = kvcache.KVLayerCache(a.keys, a.values, torch.zeros(B, dtype=torch.int32))
    kvcache.append_kv_layer_cache(a, k0, v0)
    kvcache.append_kv_layer_cache(a, k1, v1)
    kvcache.rollback_kv_layer_cache(a, 3)
    kvcache.append_kv_layer_cache(a, k2, v2)
    ref_k = torch.cat([k0, k1[:, :, :2], k2], dim=2)
    ref_v = torch.cat([v0, v1[:, :, :2], v2], dim=2)
    assert a.length.tolist() == [8] * B
    assert_same(a.keys[:, :, :8], ref_k)
    assert_same(a.values[:, :, :8], ref_v)
    # and attention sees exactly the surviving tokens
    q = random_tensor((B, 4, 1, D), torch.float32, seed=9)
    ref = kvcache.attend(q, kvcache.KVLayerCache(ref_k.contiguous(), ref_v.contiguous(), torch.full((B,), 8)))
    torch.testing.assert_close(kvcache.attend(q, a), ref, rtol=0, atol=0)


def test_rollback_0d_lengths_and_int_n():
    cache = ragged_cache(lengths=7)
    cache = kvcache.KVLayerCache(cache.keys, cache.values, torch.tensor(7, dtype=torch.int32))
    kvcache.rollback_kv_layer_cache(cache, 4)
    assert cache.length.shape == () and int(cache.length) == 3


def test_rollback_respects_kv_start():
    cache = ragged_cache(lengths=(5, 10, 3, 9))
    kv_start = torch.tensor([2, 0, 3, 1])
    kvcache.rollback_kv_layer_cache(cache, torch.tensor([3, 10, 0, 8]), kv_start=kv_start)
    assert cache.length.tolist() == [2, 0, 3, 1]


@pytest.mark.parametrize(
    "n,kv_start,match",
    [
        ([1, 17, 0, 0], None, r"cannot roll back more tokens than the row holds: n=17 but lengths=16 leaves 16 at index 1"),
        ([0, 0, 1, 0], None, r"n=1 but lengths=0 leaves 0 at index 2"),
        ([-1, 0, 0, 0], None, r"n must be >= 0, got -1 at index 0"),
        ([5, 0, 0, 0], [1, 0, 0, 0], r"n=5 but lengths=5 - kv_start=1 leaves 4 at index 0"),
        ([0, 0, 0, 0], [6, 0, 0, 0], r"kv_start must be in \[0, lengths\] = \[0, 5\], got 6 at index 0"),
        ([2**62, 0, 0, 0], None, r"n=4611686018427387904 but lengths=5"),
    ],
)
def test_rollback_errors_change_nothing(n, kv_start, match):
    cache = ragged_cache()
    before = cache.length.clone()
    with pytest.raises(ValueError, match=match):
        kvcache.rollback_kv_layer_cache(
            cache, torch.tensor(n), kv_start=None if kv_start is None else torch.tensor(kv_start)
        )
    assert torch.equal(cache.length, before)


def test_rollback_shape_and_type_errors():
    cache = ragged_cache()
    with pytest.raises(ValueError, match=r"n must be a 0-D tensor or have the shape of lengths \[4\]"):
        kvcache.rollback_kv_layer_cache(cache, torch.tensor([1, 2]))
    with pytest.raises(TypeError, match="n must be an int32 or int64 tensor, got dtype torch.float32"):
        kvcache.rollback_kv_layer_cache(cache, torch.tensor(1.0))
    with pytest.raises(TypeError, match="n must be an int"):
        kvcache.rollback_kv_layer_cache(cache, 1.5)
    shared = kvcache.KVLayerCache(cache.keys, cache.values, torch.tensor(5, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"n must be a 0-D tensor or have the shape of lengths \[\]"):
        kvcache.rollback_kv_layer_cache(shared, torch.tensor([1, 1, 1, 1]))
    with pytest.raises(ValueError, match="lengths must be >= 0, got -1 at index 3"):
        torch.ops.kvcache.rollback(torch.tensor([1, 1, 1, -1]), torch.tensor(0))


def test_rollback_op_returns_new_tensor():
    lengths = torch.tensor([4, 6], dtype=torch.int64)
    out = torch.ops.kvcache.rollback(lengths, torch.tensor([1, 2], dtype=torch.int32))
    assert out.tolist() == [3, 4] and out.dtype == torch.int64
    assert lengths.tolist() == [4, 6] and out.data_ptr() != lengths.data_ptr()


# ------------------------------------------------------------- select rows ---


def reference_select(cache, index):
    return select_reference(cache.keys, cache.values, cache.length, index)


@pytest.mark.parametrize(
    "index",
    [[0, 1, 2, 3], [3, 2, 1, 0], [1, 0, 3, 2], [1, 1, 1, 1], [3, 3, 0, 0], [2, 0, 1, 2]],
    ids=["identity", "reverse", "swap-pairs", "fork-one", "repeats", "subset"],
)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_select_rows_matches_indexing_a_clone(index, index_dtype, device):
    cache = ragged_cache(device=device)
    ref_k, ref_v, ref_len = reference_select(cache, index)
    addresses = (cache.keys.data_ptr(), cache.values.data_ptr(), cache.length.data_ptr())
    kvcache.select_rows_kv_layer_cache(cache, torch.tensor(index, dtype=index_dtype, device=device))
    assert (cache.keys.data_ptr(), cache.values.data_ptr(), cache.length.data_ptr()) == addresses
    assert_same(cache.length, ref_len)
    for b in range(B):  # the filled part of every row is the source's
        for got, exp in zip(filled(cache, b), (ref_k[b, :, : int(ref_len[b])], ref_v[b, :, : int(ref_len[b])])):
            assert_same(got, exp)


def _random_indexes():
    """Index vectors over 9 rows whose moved rows form every shape a function can: cycles of
    every length (swaps, rotations), trees hanging off cycles and off fixed rows, repeats."""
    g = torch.Generator().manual_seed(5)
    fixed = [[1, 2, 0, 4, 3, 3, 7, 8, 6],  # 3-cycle, 2-cycle with a tree, 3-cycle
             [1, 2, 3, 4, 5, 6, 7, 8, 0],  # one 9-cycle
             [0, 0, 1, 1, 2, 2, 3, 3, 4],  # a tree on a fixed row (beam-search style)
             [8, 8, 8, 8, 8, 8, 8, 8, 7]]  # a 2-cycle that every other row reads
    return fixed + [torch.randint(0, 9, (9,), generator=g).tolist() for _ in range(40)]


@pytest.mark.parametrize("index", _random_indexes())
def test_select_rows_cycles_and_trees(index):
    """Rows that are read by others and written themselves: each is written only after its readers."""
    big = kvcache.init_kv_layer_cache(9, H, D, T, torch.float32)
    big.keys.copy_(random_tensor((9, H, T, D), torch.float32, seed=7))
    big.values.copy_(random_tensor((9, H, T, D), torch.float32, seed=8))
    cache = kvcache.KVLayerCache(big.keys, big.values, torch.tensor([5, 16, 0, 9, 1, 16, 3, 12, 7]))
    ref_k, ref_v, ref_len = reference_select(cache, index)
    kvcache.select_rows_kv_layer_cache(cache, torch.tensor(index))
    assert_same(cache.length, ref_len)
    assert_same(cache.keys, ref_k)  # filled slots from the source; past them, the row's own bytes
    assert_same(cache.values, ref_v)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_select_rows_every_dtype_and_strided_cache(dtype):
    big = random_tensor((B, T, H, 2, D), dtype, seed=2)  # fused K/V, (batch, seq, heads) layout
    keys, values = big[:, :, :, 0].transpose(1, 2), big[:, :, :, 1].transpose(1, 2)
    cache = kvcache.KVLayerCache(keys, values, torch.tensor([3, 0, 16, 7]))
    index = [2, 3, 3, 0]
    ref_k, ref_v, ref_len = reference_select(cache, index)
    kvcache.select_rows_kv_layer_cache(cache, torch.tensor(index))
    assert_same(cache.length, ref_len)
    for b in range(B):
        n = int(ref_len[b])
        assert_same(cache.keys[b, :, :n], ref_k[b, :, :n])
        assert_same(cache.values[b, :, :n], ref_v[b, :, :n])


def test_select_rows_copies_only_filled_slots():
    """Slots past each source row's length are not copied (O(content)): the destination keeps its bytes there."""
    cache = ragged_cache(lengths=(2, 3, 0, 1))
    before = cache.keys.clone()
    kvcache.select_rows_kv_layer_cache(cache, torch.tensor([1, 0, 3, 2]))
    assert torch.equal(cache.keys[0, :, 3:], before[0, :, 3:])  # row 0 took 3 slots of row 1
    assert torch.equal(cache.keys[1, :, 2:], before[1, :, 2:])
    assert torch.equal(cache.keys[3, :, :], before[3, :, :])  # its source (row 2) is empty


def test_select_rows_with_0d_lengths():
    cache = ragged_cache()
    cache = kvcache.KVLayerCache(cache.keys, cache.values, torch.tensor(6, dtype=torch.int32))
    ref_k, ref_v, _ = reference_select(cache, [3, 3, 1, 0])
    kvcache.select_rows_kv_layer_cache(cache, torch.tensor([3, 3, 1, 0]))
    assert int(cache.length) == 6
    assert_same(cache.keys[:, :, :6], ref_k[:, :, :6])
    assert_same(cache.values[:, :, :6], ref_v[:, :, :6])


@pytest.mark.parametrize(
    "index,match",
    [
        ([0, 1, 4, 0], r"index must be in \[0, batch=4\), got 4 at index 2"),
        ([-1, 1, 2, 0], r"index must be in \[0, batch=4\), got -1 at index 0"),
    ],
)
def test_select_rows_bad_index_writes_nothing(index, match):
    cache = ragged_cache()
    before = (cache.keys.clone(), cache.values.clone(), cache.length.clone())
    with pytest.raises(ValueError, match=match):
        kvcache.select_rows_kv_layer_cache(cache, torch.tensor(index))
    for a, b in zip((cache.keys, cache.values, cache.length), before):
        assert torch.equal(a, b)


def test_select_rows_argument_errors():
    cache = ragged_cache()
    with pytest.raises(ValueError, match=r"index must have shape \(batch=4,\), got shape \[3\]"):
        kvcache.select_rows_kv_layer_cache(cache, torch.tensor([0, 1, 2]))
    with pytest.raises(TypeError, match="index must be an int32 or int64 tensor, got dtype torch.float32"):
        kvcache.select_rows_kv_layer_cache(cache, torch.zeros(4))
    with pytest.raises(ValueError, match="lengths must be in \\[0, max_len=16\\], got 17 at index 1"):
        torch.ops.kvcache.select_rows_(cache.keys, cache.values, torch.tensor([0, 17, 0, 0]), torch.arange(4))
    # an index read from the cache's own memory (the kernel reads it while rows move)
    aliased = cache.keys.view(torch.int32).reshape(-1)[:B]
    with pytest.raises(ValueError, match="index must not share memory with keys or values"):
        torch.ops.kvcache.select_rows_(cache.keys, cache.values, cache.length, aliased)


# ------------------------------------------------------------------- reset ---


def test_reset_rows_then_prefill_equals_fresh_cache():
    cache = ragged_cache(lengths=(5, 16, 2, 9))
    kvcache.reset_rows_kv_layer_cache(cache, torch.tensor([False, True, False, True]))
    assert cache.length.tolist() == [5, 0, 2, 0]
    kvcache.reset_rows_kv_layer_cache(cache, torch.tensor([0]))
    assert cache.length.tolist() == [0, 0, 2, 0]
    # row 1 takes a new request: prefill 3 tokens through append (row 3 too, its own request)
    k = random_tensor((B, H, 3, D), torch.float32, seed=11)
    v = random_tensor((B, H, 3, D), torch.float32, seed=12)
    fresh = kvcache.init_kv_layer_cache(B, H, D, T, torch.float32)
    fresh = kvcache.KVLayerCache(fresh.keys, fresh.values, torch.tensor([0, 0, 2, 0], dtype=torch.int32))
    fresh.keys[2, :, :2] = cache.keys[2, :, :2]
    fresh.values[2, :, :2] = cache.values[2, :, :2]
    for c in (cache, fresh):
        kvcache.append_kv_layer_cache(c, k, v)
    q = random_tensor((B, 8, 3, D), torch.float32, seed=13)
    assert cache.length.tolist() == fresh.length.tolist() == [3, 3, 5, 3]
    torch.testing.assert_close(kvcache.attend(q, cache), kvcache.attend(q, fresh), rtol=0, atol=0)


def test_reset_rows_errors():
    cache = ragged_cache()
    shared = kvcache.KVLayerCache(cache.keys, cache.values, torch.tensor(3))
    with pytest.raises(ValueError, match=r"needs a per-row length of shape \(batch,\)"):
        kvcache.reset_rows_kv_layer_cache(shared, torch.tensor([0]))
    with pytest.raises(TypeError, match="rows must be a bool mask or an int32 or int64 tensor of row indices"):
        kvcache.reset_rows_kv_layer_cache(cache, torch.tensor([0.0]))


# ------------------------------------------------------------ compile/opcheck ---


@torch.no_grad()
def test_compiled_rollback_and_select_no_recompiles():
    """One graph for rollback + select + append + attend as lengths change; same results as eager."""
    torch._dynamo.reset()

    def step(cache, n, index, k, v, q):
        kvcache.rollback_kv_layer_cache(cache, n)
        kvcache.select_rows_kv_layer_cache(cache, index)
        kvcache.append_kv_layer_cache(cache, k, v)
        return kvcache.attend(q, cache)

    compiled = torch.compile(step, fullgraph=True)
    eager_cache, comp_cache = ragged_cache(lengths=(9, 10, 11, 12)), ragged_cache(lengths=(9, 10, 11, 12))
    g = torch.Generator().manual_seed(0)
    for i in range(6):
        n = torch.randint(0, 3, (B,), generator=g)
        index = torch.randint(0, B, (B,), generator=g)
        k, v = torch.randn(B, H, 1, D, generator=g), torch.randn(B, H, 1, D, generator=g)
        q = torch.randn(B, 4, 1, D, generator=g)
        ref = step(eager_cache, n, index, k, v, q)
        if i == 1:
            torch.compiler.set_stance("fail_on_recompile")
        try:
            out = compiled(comp_cache, n, index, k, v, q)
        finally:
            torch.compiler.set_stance("default")
        torch.testing.assert_close(out, ref)
        assert torch.equal(comp_cache.length, eager_cache.length)
        assert torch.equal(comp_cache.keys, eager_cache.keys)


def test_opcheck_rows_ops():
    from torch.library import opcheck

    checks = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    cache = ragged_cache()
    for args in (
        (cache.length, torch.tensor([1, 2, 0, 3])),
        (torch.tensor(5), torch.tensor(2)),
    ):
        result = opcheck(torch.ops.kvcache.rollback.default, args, test_utils=checks)
        assert all(v == "SUCCESS" for v in result.values()), result
    result = opcheck(torch.ops.kvcache.rollback.default, (cache.length, torch.tensor(0)),
                     {"kv_start": torch.tensor([0, 1, 0, 2])}, test_utils=checks)
    assert all(v == "SUCCESS" for v in result.values()), result
    for lengths in (cache.length, torch.tensor(4)):
        result = opcheck(torch.ops.kvcache.select_rows_.default,
                         (cache.keys.clone(), cache.values.clone(), lengths, torch.tensor([3, 0, 0, 1])),
                         test_utils=checks)
        assert all(v == "SUCCESS" for v in result.values()), result


def test_previous_names_are_deprecated_aliases():
    """select_kv_layer_cache_rows / reset_kv_layer_cache_rows still work for one release, warning."""
    cache = ragged_cache()
    ref_k, _, ref_len = reference_select(cache, [1, 0, 3, 2])
    with pytest.warns(DeprecationWarning, match="select_rows_kv_layer_cache"):
        assert kvcache.select_kv_layer_cache_rows(cache, torch.tensor([1, 0, 3, 2])) is cache
    assert_same(cache.length, ref_len)
    with pytest.warns(DeprecationWarning, match="reset_rows_kv_layer_cache"):
        kvcache.reset_kv_layer_cache_rows(cache, torch.tensor([0]))
    assert cache.length.tolist() == [0] + ref_len.tolist()[1:]
