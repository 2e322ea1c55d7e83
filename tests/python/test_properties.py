"""Property tests (hypothesis) of every operator against plain-PyTorch references.

Random shapes (zero sizes included), every dtype for the write operators,
strided/transposed caches and inputs, caches sliced from larger buffers
(every byte around them is a canary), fused K/V buffers, and positions of
every kind, valid and invalid (negative, overflowing, near the int32/int64
limits). On every error: the exact exception and message, and nothing
written anywhere (cache, canaries, lengths). attend is compared with a
float64 reference; rollback_/select_rows_ with clone + indexing; the
overlap checks with a brute-force element-set reference.

Profiles (``KVCACHE_HYPOTHESIS_PROFILE``):
  default   a quick run for development (random seed each run)
  ci        bounded and derandomized (the same examples every run: a gate
            must not flake), deadline off (the CI machine is shared)
  thorough  many examples, for a local soak before a release
"""

from __future__ import annotations

import os

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import kvcache  # noqa: E402,F401
from kv_testing import ALL_DTYPES, random_tensor  # noqa: E402
from references import assert_close, attention_reference  # noqa: E402

_COMMON = dict(
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile("default", max_examples=40, **_COMMON)
settings.register_profile("ci", max_examples=300, derandomize=True, **_COMMON)
settings.register_profile("thorough", max_examples=3000, **_COMMON)
settings.load_profile(os.environ.get("KVCACHE_HYPOTHESIS_PROFILE", "default"))

ops = torch.ops.kvcache
INT64_MAX, INT64_MIN = 2**63 - 1, -(2**63)
INT32_MAX, INT32_MIN = 2**31 - 1, -(2**31)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes (NaNs, float8, empty tensors of any strides compare exactly)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(as_bytes(a), as_bytes(b))


@pytest.mark.skipif(not os.environ.get("KVCACHE_EXPECT_LIB"), reason="only in scripts/sanitize.sh")
def test_sanitized_library_is_the_one_loaded():
    """scripts/sanitize.sh: these tests ran against the sanitized libkvcache.so, under ASan."""
    with open("/proc/self/maps") as f:
        maps = [line.split()[-1] for line in f if "/" in line]
    libs = {os.path.realpath(p) for p in maps if os.path.basename(p) == "libkvcache.so"}
    assert libs == {os.path.realpath(os.environ["KVCACHE_EXPECT_LIB"])}, libs
    assert any("libasan" in os.path.basename(p) for p in maps)


# ---------------------------------------------------------------------------
# Layouts: a (batch, heads, max_len, head_dim) pair carved out of backing
# buffers with canaries around it, in one of several memory layouts.
# ---------------------------------------------------------------------------

LAYOUTS = ["contiguous", "padded", "bthd", "fused", "permuted", "separate_strided"]


def make_cache(layout, b, h, t, d, dtype, seed, perm=(0, 1, 2, 3)):
    """Returns (keys, values, backing buffers)."""
    if layout == "contiguous":
        k = random_tensor((b, h, t, d), dtype, seed=seed)
        v = random_tensor((b, h, t, d), dtype, seed=seed + 1)
        return k, v, [k, v]
    if layout == "padded":  # a slice of a larger buffer: canaries on every side
        kb = random_tensor((b + 1, h + 2, t + 2, d + 3), dtype, seed=seed)
        vb = random_tensor((b + 2, h + 1, t + 3, d + 1), dtype, seed=seed + 1)
        return kb[1:, 1 : h + 1, 2:, 1 : d + 1], vb[1 : b + 1, :h, 1 : t + 1, 1:], [kb, vb]
    if layout == "bthd":  # (batch, seq, heads, head_dim) memory
        kb = random_tensor((b, t + 1, h, d), dtype, seed=seed)
        vb = random_tensor((b, t + 1, h, d), dtype, seed=seed + 1)
        return kb[:, 1:].transpose(1, 2), vb[:, :t].transpose(1, 2), [kb, vb]
    if layout == "fused":  # keys and values interleaved in one buffer
        fb = random_tensor((b, t, h, 2, d + 1), dtype, seed=seed)
        return fb[..., 0, :d].transpose(1, 2), fb[..., 1, 1:].transpose(1, 2), [fb]
    if layout == "permuted":  # any order of the four dims in memory
        shape = (b, h, t, d)
        mem = tuple(shape[p] for p in perm)
        inv = [perm.index(i) for i in range(4)]
        kb = random_tensor(mem, dtype, seed=seed)
        vb = random_tensor(mem, dtype, seed=seed + 1)
        return kb.permute(*inv), vb.permute(*inv), [kb, vb]
    if layout == "separate_strided":  # every other head_dim element
        kb = random_tensor((b, h, t, 2 * d + 1), dtype, seed=seed)
        vb = random_tensor((b, h, t, 2 * d + 1), dtype, seed=seed + 1)
        return kb[..., 1::2][..., :d], vb[..., ::2][..., :d], [kb, vb]
    raise AssertionError(layout)


def make_new(layout, b, h, c, d, dtype, seed):
    """New keys/values (batch, heads, chunk, head_dim) in a given layout."""
    if layout == "contiguous":
        return random_tensor((b, h, c, d), dtype, seed=seed), random_tensor((b, h, c, d), dtype, seed=seed + 1)
    if layout == "bthd":  # a model's (batch, seq, heads, head_dim) projection
        return (random_tensor((b, c, h, d), dtype, seed=seed).transpose(1, 2),
                random_tensor((b, c, h, d), dtype, seed=seed + 1).transpose(1, 2))
    if layout == "sliced":
        return (random_tensor((b, h, c + 1, d + 2), dtype, seed=seed)[:, :, 1:, 2:],
                random_tensor((b, h, c, 2 * d), dtype, seed=seed + 1)[..., ::2])
    if layout == "expanded":  # read-only inputs may repeat elements
        return (random_tensor((1, h, c, d), dtype, seed=seed).expand(b, h, c, d),
                random_tensor((b, 1, c, 1), dtype, seed=seed + 1).expand(b, h, c, d))
    raise AssertionError(layout)


@st.composite
def geometry(draw, max_b=3, max_h=3, max_t=9, max_d=5):
    b = draw(st.integers(0, max_b))
    h = draw(st.integers(0, max_h))
    t = draw(st.integers(0, max_t))
    d = draw(st.integers(0, max_d))
    return b, h, t, d


def start_values(max_len, chunk):
    """Valid and invalid starts of every kind for one row."""
    hi = max_len - chunk  # the largest valid start (negative: none valid)
    valid = st.integers(0, hi) if hi >= 0 else st.nothing()
    candidates = [-1, INT32_MIN, INT64_MIN, INT64_MIN + 1, hi + 1, max_len + 1, INT32_MAX, INT32_MAX - chunk + 1,
                  2**32 + max(hi, 0), 2**32 - 1, INT64_MAX, INT64_MAX - chunk + 1, INT64_MAX - max_len, 2**62]
    # The ops take int64 (Python ints beyond it are the Python API's job: test_bounds).
    invalid = st.sampled_from([v for v in candidates if INT64_MIN <= v <= INT64_MAX and not 0 <= v <= hi])
    return st.one_of(valid, valid, invalid)  # valid twice as often


def first_bad(starts, chunk, max_len, name, zero_d, host):
    """The message the write operators raise for these starts, or None."""
    for i, s in enumerate(starts):
        at = "" if zero_d else f" at index {i}"
        if s < 0:
            return f"{name} must be >= 0, got {s}{at}"
        if s > max_len - chunk:
            if host:
                return f"KV cache overflow: end={s + chunk} exceeds max_len={max_len}"
            idx = name if zero_d else f"{name}[{i}]"
            return f"KV cache overflow: end={s + chunk} exceeds max_len={max_len} ({idx}={s}, chunk={chunk})"
    return None


def fits(dtype, v):
    return (INT32_MIN <= v <= INT32_MAX) if dtype == torch.int32 else (INT64_MIN <= v <= INT64_MAX)


@given(data=st.data(), geo=geometry(), dtype=st.sampled_from(ALL_DTYPES),
       cache_layout=st.sampled_from(LAYOUTS), new_layout=st.sampled_from(["contiguous", "bthd", "sliced", "expanded"]),
       route=st.sampled_from(["update_", "update_.Tensor", "append_"]),
       start_dtype=st.sampled_from([torch.int32, torch.int64]), per_row=st.booleans(),
       perm=st.permutations(range(4)))
def test_write_ops_match_slicing(data, geo, dtype, cache_layout, new_layout, route, start_dtype, per_row, perm):
    b, h, t, d = geo
    chunk = data.draw(st.integers(0, t + 2), label="chunk")
    keys, values, bufs = make_cache(cache_layout, b, h, t, d, dtype, seed=1, perm=tuple(perm))
    kn, vn = make_new(new_layout, b, h, chunk, d, dtype, seed=7)
    host = route == "update_"
    zero_d = host or not per_row
    n = 1 if zero_d else b
    starts = [data.draw(start_values(t, chunk), label=f"start{i}") for i in range(n)]
    if not host and not all(fits(start_dtype, s) for s in starts):
        starts = [max(min(s, INT32_MAX), INT32_MIN) for s in starts]  # int32 saturates: still near the limit
    before = [x.clone() for x in bufs]
    expect = first_bad(starts, chunk, t, "lengths" if route == "append_" else "start", zero_d, host)

    start_t = None if host else torch.tensor(starts[0] if zero_d else starts, dtype=start_dtype)
    start_before = None if host else start_t.clone()

    def call():
        if route == "update_":
            return ops.update_(keys, values, kn, vn, starts[0])
        if route == "update_.Tensor":
            return ops.update_.Tensor(keys, values, kn, vn, start_t)
        ops.append_(keys, values, start_t, kn, vn)
        return None

    if expect is not None:
        with pytest.raises(ValueError) as info:
            call()
        assert str(info.value) == expect
        assert all(same_bytes(x, y) for x, y in zip(bufs, before)), "written despite the error"
        if start_t is not None:
            assert torch.equal(start_t, start_before)
        return

    # Reference: plain slicing on the backing buffers' clones, through the same views.
    ref_bufs = [x.clone() for x in before]
    rk, rv, _ = make_cache_like(cache_layout, ref_bufs, b, h, t, d, perm=tuple(perm))
    for i in range(b):
        s = starts[0] if zero_d else starts[i]
        rk[i, :, s : s + chunk] = kn[i]
        rv[i, :, s : s + chunk] = vn[i]
    out = call()
    for x, y in zip(bufs, ref_bufs):
        assert same_bytes(x, y), "cache (or the bytes around it) differs from slicing"
    new_len = [s + chunk for s in starts]
    if route == "append_":
        assert start_t.dtype == start_dtype and start_t.tolist() == (new_len[0] if zero_d else new_len)
    else:
        assert out.dtype == torch.int32 and out.shape == (() if zero_d else (b,))
        assert out.tolist() == (new_len[0] if zero_d else new_len)


def make_cache_like(layout, bufs, b, h, t, d, perm):
    """The views make_cache takes, on other backing buffers (the reference's clones)."""
    if layout == "contiguous":
        return bufs[0], bufs[1], bufs
    if layout == "padded":
        kb, vb = bufs
        return kb[1:, 1 : h + 1, 2:, 1 : d + 1], vb[1 : b + 1, :h, 1 : t + 1, 1:], bufs
    if layout == "bthd":
        return bufs[0][:, 1:].transpose(1, 2), bufs[1][:, :t].transpose(1, 2), bufs
    if layout == "fused":
        return bufs[0][..., 0, :d].transpose(1, 2), bufs[0][..., 1, 1:].transpose(1, 2), bufs
    if layout == "permuted":
        inv = [perm.index(i) for i in range(4)]
        return bufs[0].permute(*inv), bufs[1].permute(*inv), bufs
    if layout == "separate_strided":
        return bufs[0][..., 1::2][..., :d], bufs[1][..., ::2][..., :d], bufs
    raise AssertionError(layout)


# ---------------------------------------------------------------------------
# Overlap checks: exact against a brute-force element-set reference.
# ---------------------------------------------------------------------------


def element_set(t: torch.Tensor) -> list:
    """Storage element indices each element of a strided view covers (with repeats)."""
    idx = torch.arange(t.untyped_storage().nbytes() // t.element_size())
    return idx.as_strided(t.shape, t.stride(), t.storage_offset()).flatten().tolist()


@st.composite
def strided_view(draw, storage_len, shape):
    strides = tuple(draw(st.integers(0, 12)) for _ in shape)
    extent = sum((s - 1) * st_ for s, st_ in zip(shape, strides)) + 1 if all(shape) else 0
    assume(extent <= storage_len)
    offset = draw(st.integers(0, storage_len - extent))
    return strides, offset


@given(data=st.data(), shape=st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 4), st.integers(1, 4)))
def test_overlap_checks_are_exact(data, shape):
    """update_ refuses keys/values that share an element, or a cache with repeated elements, exactly when they do."""
    n = 400
    storage = torch.zeros(n)
    ks, ko = data.draw(strided_view(n, shape), label="keys")
    same = data.draw(st.booleans(), label="values from the same storage")
    if same:
        vs, vo = data.draw(strided_view(n, shape), label="values")
        values = storage.as_strided(shape, vs, vo)
    else:
        values = torch.zeros(shape)
    keys = storage.as_strided(shape, ks, ko)
    kset, vset = element_set(keys), element_set(values)
    k_self = len(set(kset)) < len(kset)
    v_self = len(set(vset)) < len(vset)
    share = same and bool(set(kset) & set(vset))
    kn = torch.ones(shape[0], shape[1], 1, shape[3])
    before = storage.clone()
    if k_self:
        expect = "keys must not have internally overlapping memory"
    elif v_self:
        expect = "values must not have internally overlapping memory"
    elif share:
        expect = "keys and values must not share memory"
    else:
        expect = None
    if expect is None:
        ops.update_(keys, values, kn, 2 * kn, 0)
        assert torch.equal(keys[:, :, 0:1], kn) and torch.equal(values[:, :, 0:1], 2 * kn)
    else:
        with pytest.raises(ValueError, match="^" + expect):
            ops.update_(keys, values, kn, 2 * kn, 0)
        assert torch.equal(storage, before)


@given(data=st.data(), shape=st.tuples(st.integers(1, 2), st.integers(1, 3), st.integers(2, 6), st.integers(1, 4)))
def test_new_data_alias_check_is_exact(data, shape):
    """New data viewing the cache's storage is refused exactly when it shares an element with the rows written."""
    b, h, t, d = shape
    storage = torch.arange(float(b * h * t * d * 4))
    keys = storage[: b * h * t * d].view(b, h, t, d)
    values = torch.zeros(b, h, t, d)
    chunk = data.draw(st.integers(1, t), label="chunk")
    start = data.draw(st.integers(0, t - chunk), label="start")
    src_shape = (b, h, chunk, d)
    ss, so = data.draw(strided_view(storage.numel(), src_shape), label="keys_new")
    kn = storage.as_strided(src_shape, ss, so)
    written = set(element_set(keys[:, :, start : start + chunk]))
    hit = bool(written & set(element_set(kn)))
    before = storage.clone()
    if hit:
        with pytest.raises(ValueError, match="^keys_new must not share memory with the rows of keys that it is written to$"):
            ops.update_(keys, values, kn, torch.zeros(src_shape), start)
        assert torch.equal(storage, before)
    else:
        expect = kn.clone()
        ops.update_(keys, values, kn, torch.zeros(src_shape), start)
        assert torch.equal(keys[:, :, start : start + chunk], expect)
    # A start tensor: the rows written are only known when the kernel runs,
    # so any element of the cache read as new data is refused.
    any_hit = bool(set(element_set(keys)) & set(element_set(kn)))
    keys.copy_(before[: keys.numel()].view_as(keys))
    if any_hit:
        with pytest.raises(ValueError, match="^keys_new must not share memory with the rows of keys"):
            ops.update_.Tensor(keys, values, kn, torch.zeros(src_shape), torch.tensor(start))


# ---------------------------------------------------------------------------
# attend: float64 reference
# ---------------------------------------------------------------------------




@given(data=st.data(), b=st.integers(0, 3), kvh=st.integers(0, 2), group=st.integers(1, 3), d=st.integers(1, 8),
       t=st.integers(1, 10), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       layout=st.sampled_from(["contiguous", "padded", "bthd", "fused"]), q_t=st.booleans())
def test_attend_matches_float64_reference(data, b, kvh, group, d, t, dtype, layout, q_t):
    nh = kvh * group
    seq = data.draw(st.integers(1, t), label="seq")
    keys, values, bufs = make_cache(layout, b, kvh, t, d, dtype, seed=3)
    q = (random_tensor((b, seq, nh, d), dtype, seed=5).transpose(1, 2) if q_t
         else random_tensor((b, nh, seq, d), dtype, seed=5))
    per_row = data.draw(st.booleans(), label="per-row lengths")
    n = b if per_row else 1
    valid = st.integers(seq, t)
    bad = st.sampled_from([seq - 1, t + 1, -1, INT32_MAX, INT64_MAX, INT64_MIN])
    lens = [data.draw(st.one_of(valid, valid, valid, bad), label=f"len{i}") for i in range(n)]
    ldt = data.draw(st.sampled_from([torch.int32, torch.int64]), label="lengths dtype")
    lens = [max(min(v, INT32_MAX), INT32_MIN) if ldt == torch.int32 else v for v in lens]
    lengths = torch.tensor(lens if per_row else lens[0], dtype=ldt)
    kv_start = None
    if data.draw(st.booleans(), label="kv_start"):
        kv_start = torch.tensor([data.draw(st.integers(-1, t + 1), label=f"ks{i}") for i in range(b)], dtype=torch.int64)
    scale = data.draw(st.one_of(st.none(), st.floats(0.05, 2.0)), label="scale")
    window = data.draw(st.one_of(st.integers(0, t + 1), st.just(INT64_MAX)), label="window")
    softcap = data.draw(st.sampled_from([0.0, 0.5, 5.0]), label="softcap")
    before = [x.clone() for x in bufs] + [q.clone(), lengths.clone()]

    # Expected error: lengths first (row order), then kv_start.
    expect = None
    rows = lens if per_row else [lens[0]] * max(b, 1)
    for i, v in enumerate(rows if b else []):  # a batch of 0 rows reads no length
        at = f" at index {i}" if per_row else ""
        if v < seq:
            expect = f"lengths must be >= seq={seq} (the queries are the last seq filled slots), got {v}{at}"
        elif v > t:
            expect = f"lengths must be <= max_len={t}, got {v}{at}"
        if expect:
            break
    if expect is None and kv_start is not None:
        for i in range(b):
            f = int(kv_start[i])
            if not 0 <= f <= rows[i]:
                expect = f"kv_start must be in [0, lengths] = [0, {rows[i]}], got {f} at index {i}"
                break
    if expect is not None:
        with pytest.raises(ValueError) as info:
            ops.attend(q, keys, values, lengths, kv_start=kv_start, scale=scale, window=window, softcap=softcap)
        assert str(info.value) == expect
    else:
        out = ops.attend(q, keys, values, lengths, kv_start=kv_start, scale=scale, window=window, softcap=softcap)
        assert out.shape == q.shape and out.dtype == dtype
        eff_scale = scale if scale is not None else d**-0.5
        ref = attention_reference(q, keys, values, lengths.expand(b) if b else lengths, kv_start, eff_scale,
                                  window, softcap)
        assert_close(out, ref, dtype)
    for x, y in zip(bufs + [q, lengths], before):
        assert same_bytes(x, y), "attend wrote to an input"


# ---------------------------------------------------------------------------
# rollback and select_rows_: clone + indexing references
# ---------------------------------------------------------------------------


@given(data=st.data(), rows=st.integers(0, 4), ldt=st.sampled_from([torch.int32, torch.int64]),
       zero_d=st.booleans(), n_zero_d=st.booleans(), with_start=st.booleans())
def test_rollback_matches_subtraction(data, rows, ldt, zero_d, n_zero_d, with_start):
    anyv = st.one_of(st.integers(0, 12), st.sampled_from([-1, INT32_MIN, INT32_MAX, INT64_MIN, INT64_MAX]))
    clamp = lambda v, dt: max(min(v, INT32_MAX), INT32_MIN) if dt == torch.int32 else v  # noqa: E731
    nl = 1 if zero_d else rows
    lens = [clamp(data.draw(anyv, label="len"), ldt) for _ in range(nl)]
    ndt = data.draw(st.sampled_from([torch.int32, torch.int64]), label="n dtype")
    nn = 1 if (n_zero_d or zero_d) else rows
    drops = [clamp(data.draw(anyv, label="n"), ndt) for _ in range(nn)]
    firsts = [clamp(data.draw(anyv, label="kv_start"), ndt) for _ in range(nn)] if with_start else None
    lengths = torch.tensor(lens[0] if zero_d else lens, dtype=ldt)
    n = torch.tensor(drops[0] if nn == 1 and (n_zero_d or zero_d) else drops, dtype=ndt)
    kv_start = None if firsts is None else torch.tensor(firsts[0] if n.dim() == 0 else firsts, dtype=ndt)
    before = lengths.clone()
    expect, out = None, []
    for i in range(lengths.numel()):
        at = "" if lengths.dim() == 0 else f" at index {i}"
        ln, dr = lens[i if nl > 1 else 0], drops[i if nn > 1 else 0]
        fs = 0 if firsts is None else firsts[i if nn > 1 else 0]
        if ln < 0:
            expect = f"lengths must be >= 0, got {ln}{at}"
        elif not 0 <= fs <= ln:
            expect = f"kv_start must be in [0, lengths] = [0, {ln}], got {fs}{at}"
        elif dr < 0:
            expect = f"n must be >= 0, got {dr}{at}"
        elif dr > ln - fs:
            ks = "" if firsts is None else f" - kv_start={fs}"
            expect = f"cannot roll back more tokens than the row holds: n={dr} but lengths={ln}{ks} leaves {ln - fs}{at}"
        if expect:
            break
        out.append(ln - dr)
    if expect is not None:
        with pytest.raises(ValueError) as info:
            ops.rollback(lengths, n, kv_start=kv_start)
        assert str(info.value) == expect
        assert torch.equal(lengths, before)
    else:
        new = ops.rollback(lengths, n, kv_start=kv_start)
        assert new.dtype == ldt and new.tolist() == (out[0] if zero_d else out)
        assert torch.equal(lengths, before)  # the input is only read


@given(data=st.data(), geo=geometry(max_b=4), dtype=st.sampled_from(ALL_DTYPES), layout=st.sampled_from(LAYOUTS),
       ldt=st.sampled_from([torch.int32, torch.int64]), idt=st.sampled_from([torch.int32, torch.int64]),
       zero_d=st.booleans(), perm=st.permutations(range(4)))
def test_select_rows_matches_indexing(data, geo, dtype, layout, ldt, idt, zero_d, perm):
    b, h, t, d = geo
    keys, values, bufs = make_cache(layout, b, h, t, d, dtype, seed=11, perm=tuple(perm))
    bad_len = st.sampled_from([-1, t + 1, INT32_MAX, INT32_MIN, INT64_MAX, INT64_MIN])
    bad_idx = st.sampled_from([-1, b, INT32_MAX, INT32_MIN, INT64_MAX, INT64_MIN])
    clamp = lambda v, dt: max(min(v, INT32_MAX), INT32_MIN) if dt == torch.int32 else v  # noqa: E731
    nl = 1 if zero_d else b
    lens = [clamp(data.draw(st.one_of(st.integers(0, t), st.integers(0, t), bad_len), label="len"), ldt) for _ in range(nl)]
    idx = [clamp(data.draw(st.one_of(st.integers(0, max(b - 1, 0)), st.integers(0, max(b - 1, 0)), bad_idx), label="idx"), idt)
           for _ in range(b)]
    lengths = torch.tensor(lens[0] if zero_d else lens, dtype=ldt)
    index = torch.tensor(idx, dtype=idt)
    before = [x.clone() for x in bufs]
    lbefore = lengths.clone()
    expect = None
    for i in range(b):
        ln = lens[0 if zero_d else i]
        at = "" if zero_d else f" at index {i}"
        if not 0 <= ln <= t:
            expect = f"lengths must be in [0, max_len={t}], got {ln}{at}"
        elif not 0 <= idx[i] < b:
            expect = f"index must be in [0, batch={b}), got {idx[i]} at index {i}"
        if expect:
            break
    if expect is not None:
        with pytest.raises(ValueError) as info:
            ops.select_rows_(keys, values, lengths, index)
        assert str(info.value) == expect
        assert all(same_bytes(x, y) for x, y in zip(bufs, before)) and torch.equal(lengths, lbefore)
        return
    ref_bufs = [x.clone() for x in before]
    rk, rv, _ = make_cache_like(layout, ref_bufs, b, h, t, d, perm=tuple(perm))
    ok, ov = rk.clone(), rv.clone()  # the rows as they were before the call
    row_len = [lens[0 if zero_d else i] for i in range(b)]
    for i in range(b):
        src = idx[i]
        if src != i:  # only the filled slots of the source row move
            rk[i, :, : row_len[src]] = ok[src, :, : row_len[src]]
            rv[i, :, : row_len[src]] = ov[src, :, : row_len[src]]
    new = ops.select_rows_(keys, values, lengths, index)
    for x, y in zip(bufs, ref_bufs):
        assert same_bytes(x, y)
    assert new.dtype == ldt and new.tolist() == (lens[0] if zero_d else [row_len[idx[i]] for i in range(b)])
    assert torch.equal(lengths, lbefore)  # the input is only read
