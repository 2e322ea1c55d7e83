"""ring_update_quantized_: a quantized ring's write (data, scales, positions) in one operator call.

Every result is checked against plain PyTorch written here from the formats' definitions
(csrc/core/quant.h, README "Quantized caches") and the ring's slot rule (csrc/core/visibility.h):
each kept position's quantized bytes and float32 scale at its slot, nothing else touched. The
three-launch path this op replaces (update_quantized_ into staging, then ring_update_ for data
and for scales) is checked to give the same bytes.
"""

from __future__ import annotations

import pytest
import torch

import kvcache
from kv_testing import as_bytes, random_tensor
from references import quantize_reference as quantize_ref

ops = torch.ops.kvcache
FLT_MIN = torch.finfo(torch.float32).tiny
KV_DTYPES = [torch.int8, torch.float8_e4m3fn]
NEW_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# ------------------------------------------------------------ references ---


def kept_slots(start, chunk, sinks, capacity):
    """(token index, position, slot) of every position of [start, start + chunk) the ring keeps."""
    end = start + chunk
    out = []
    for t in range(chunk):
        p = start + t
        if p < sinks or p >= end - (capacity - sinks):
            slot = p if p < sinks else sinks + (p - sinks) % (capacity - sinks)
            out.append((t, p, slot))
    return out


def expected(before, kn, vn, starts, sinks, kv_dtype):
    keys, values, ks, vs, pos = [t.clone() for t in before]
    qk, sk = quantize_ref(kn, kv_dtype)
    qv, sv = quantize_ref(vn, kv_dtype)
    capacity = keys.shape[2]
    for b, s in enumerate(starts):
        for t, p, slot in kept_slots(s, kn.shape[2], sinks, capacity):
            keys[b, :, slot] = qk[b, :, t]
            values[b, :, slot] = qv[b, :, t]
            ks[b, :, slot] = sk[b, :, t]
            vs[b, :, slot] = sv[b, :, t]
            pos[b, slot] = p
    return keys, values, ks, vs, pos


def qring(b, h, cap, d, kv_dtype, seed=70):
    """Ring buffers pre-filled with random bytes, scales and positions (untouched slots are checked)."""
    g = torch.Generator().manual_seed(seed)
    if kv_dtype == torch.int8:
        keys = torch.randint(-127, 128, (b, h, cap, d), generator=g).to(torch.int8)
        values = torch.randint(-127, 128, (b, h, cap, d), generator=g).to(torch.int8)
    else:
        keys = (torch.randn(b, h, cap, d, generator=g) * 50).clamp(-448, 448).to(kv_dtype)
        values = (torch.randn(b, h, cap, d, generator=g) * 50).clamp(-448, 448).to(kv_dtype)
    ks = torch.rand(b, h, cap, generator=g) * 0.05 + 1e-3
    vs = torch.rand(b, h, cap, generator=g) * 0.05 + 1e-3
    pos = torch.randint(-1, 1000, (b, cap), generator=g).to(torch.int32)
    return [keys, values, ks, vs, pos]


def assert_all_equal(got, want):
    for name, a, w in zip(("keys", "values", "k_scale", "v_scale", "positions"), got, want):
        assert a.shape == w.shape and a.dtype == w.dtype, name
        assert torch.equal(as_bytes(a), as_bytes(w)), name


def three_launch(bufs, kn, vn, start, sinks):
    # The path ring.py took before this op: staging, then ring_update_ for data and for scales.
    keys, values, ks, vs, pos = bufs
    b, h, c, d = kn.shape
    tk = torch.empty(b, h, c, d, dtype=keys.dtype)
    tv = torch.empty(b, h, c, d, dtype=keys.dtype)
    tks, tvs = torch.empty(b, h, c), torch.empty(b, h, c)
    ops.update_quantized_(tk, tv, tks, tvs, kn, vn, 0)
    length = ops.ring_update_(keys, values, pos, tk, tv, start, sinks=sinks)
    ops.ring_update_(ks.unsqueeze(-1), vs.unsqueeze(-1), pos, tks.unsqueeze(-1), tvs.unsqueeze(-1), start,
                     sinks=sinks)
    return length


# ---------------------------------------------------------------- writes ---


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", NEW_DTYPES, ids=str)
@pytest.mark.parametrize("sinks", [0, 2])
@pytest.mark.parametrize(
    "starts,chunk",
    [
        ((0,), 1),  # first token (a sink when sinks > 0)
        ((5,), 3),  # inside the ring
        ((8,), 4),  # wraps past the buffer's end
        ((1,), 6),  # from the sinks into the ring
        ((3,), 25),  # longer than the ring: only what it keeps, each slot once
        ((0, 13), 2),  # per-row starts
        ((2, 40), 11),  # per-row, longer than the ring
        ((0, 0), 0),  # empty chunk
    ],
)
def test_bit_exact_against_plain_pytorch(kv_dtype, dtype, sinks, starts, chunk):
    B, H, CAP, D = len(starts), 2, 9, 24
    bufs = qring(B, H, CAP, D, kv_dtype)
    before = [t.clone() for t in bufs]
    kn = random_tensor((B, H, chunk, D), dtype, seed=1)
    vn = random_tensor((B, H, chunk, D), dtype, seed=2) * 3
    start = torch.tensor(starts[0]) if len(starts) == 1 else torch.tensor(starts, dtype=torch.int32)
    got_len = ops.ring_update_quantized_(*bufs, kn, vn, start, sinks=sinks)
    want = expected(before, kn, vn, [starts[0]] * B if len(starts) == 1 else starts, sinks, kv_dtype)
    assert_all_equal(bufs, want)
    assert got_len.dtype == torch.int32 and got_len.shape == start.shape
    assert torch.equal(got_len, (start + chunk).to(torch.int32))


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("start_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("chunk", [1, 4, 17])
def test_same_bytes_as_the_three_launch_path(kv_dtype, start_dtype, per_row, chunk):
    B, H, CAP, D = 2, 3, 7, 16
    start = torch.tensor([3, 12] if per_row else 6, dtype=start_dtype)
    kn = random_tensor((B, H, chunk, D), torch.bfloat16, seed=3)
    vn = random_tensor((B, H, chunk, D), torch.bfloat16, seed=4)
    fused = qring(B, H, CAP, D, kv_dtype)
    old = [t.clone() for t in fused]
    a = ops.ring_update_quantized_(*fused, kn, vn, start, sinks=1)
    b = three_launch(old, kn, vn, start, 1)
    assert torch.equal(a, b)
    assert_all_equal(fused, old)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
def test_strided_new_data_and_scale_views(kv_dtype):
    # New data as a (batch, chunk, heads, head_dim) projection transposed; scales with row padding.
    B, H, CAP, D, C = 2, 2, 6, 8, 3
    bufs = qring(B, H, CAP, D, kv_dtype)
    ks_big = torch.rand(B, H, CAP + 3) + 0.1
    vs_big = torch.rand(B, H, CAP + 3) + 0.1
    bufs[2], bufs[3] = ks_big[..., :CAP], vs_big[..., :CAP]
    before = [t.clone() for t in bufs]
    pad_before = ks_big[..., CAP:].clone(), vs_big[..., CAP:].clone()
    kn = torch.randn(B, C, H, D).transpose(1, 2)
    vn = torch.randn(B, C, H, D * 2)[..., ::2].transpose(1, 2)
    ops.ring_update_quantized_(*bufs, kn, vn, torch.tensor(4), sinks=1)
    assert_all_equal(bufs, expected(before, kn, vn, [4] * B, 1, kv_dtype))
    assert torch.equal(ks_big[..., CAP:], pad_before[0]) and torch.equal(vs_big[..., CAP:], pad_before[1])


def test_nan_inf_and_zero_slots_follow_the_format():
    B, H, CAP, D = 1, 1, 4, 8
    for kv_dtype in KV_DTYPES:
        bufs = qring(B, H, CAP, D, kv_dtype)
        before = [t.clone() for t in bufs]
        kn = torch.randn(B, H, 3, D) * 1000
        kn[0, 0, 0] = 0.0  # all-zero slot: the scale floor, zeros stay zero
        kn[0, 0, 1, 2] = float("nan")  # ignored by absmax, stored as 0
        vn = torch.randn(B, H, 3, D) * 1e-30  # tiny values near the floor
        ops.ring_update_quantized_(*bufs, kn, vn, torch.tensor(0))
        assert_all_equal(bufs, expected(before, kn, vn, [0], 0, kv_dtype))
        assert bufs[2][0, 0, 0].item() == FLT_MIN


# ------------------------------------------------------- the Python API ---


def _ring(kv_dtype, b=2, kvh=2, d=8, window=5, sinks=1, max_step=3):
    return kvcache.init_ring_layer_cache(b, kvh, d, window, torch.float32, sinks=sinks, max_step=max_step,
                                         kv_dtype=kv_dtype)


def _old_write_ring(ring, kn, vn, start):
    # The three-launch write on copies of ring's buffers, returning them.
    bufs = [t.clone() for t in (ring.keys, ring.values, ring.k_scale, ring.v_scale, ring.positions)]
    three_launch(bufs, kn, vn, start, ring.sinks)
    return bufs


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
def test_ring_api_calls_the_fused_op_once_per_write(kv_dtype, monkeypatch):
    import kvcache.ring as ring_mod

    calls = []
    real = ring_mod._write_op

    def ring_update(*a, **k):
        # One operator for both formats: the quantized write is the one given the ring's scales.
        assert k.get("positions") is ring.positions  # the ring's write (update_.Tensor with positions)
        calls.append("q" if k.get("k_scale") is not None and k.get("v_scale") is not None else "plain")
        return real(*a, **k)

    monkeypatch.setattr(ring_mod, "_write_op", ring_update)
    monkeypatch.setattr(ring_mod, "_update_op", lambda *a, **k: calls.append("staging"))
    ring = _ring(kv_dtype)
    kvcache.append_ring_layer_cache(ring, torch.randn(2, 2, 2, 8), torch.randn(2, 2, 2, 8))
    kvcache.update_ring_layer_cache(ring, torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8), 2)
    kvcache.write_ring_layer_cache(ring, torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8))
    assert calls == ["q", "q", "q"]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
def test_ring_api_writes_match_the_three_launch_path(kv_dtype):
    # Every chunk-length path of the Python API (decode, max_step, longer than max_step, longer than the
    # ring), with a host start, the cache's own length and per-row start tensors.
    ring = _ring(kv_dtype)
    g = torch.Generator().manual_seed(9)
    for chunk, how in [(1, "append"), (3, "write"), (2, "update-int"), (12, "write"), (1, "write"), (4, "append"),
                       (20, "update-rows"), (5, "write"), (1, "append")]:
        kn = torch.randn(2, 2, chunk, 8, generator=g)
        vn = torch.randn(2, 2, chunk, 8, generator=g)
        start = ring.length.clone()
        if how == "update-int":
            start = torch.tensor(int(ring.length.max()), dtype=torch.int32)
        elif how == "update-rows":
            start = torch.tensor([int(ring.length.max()), int(ring.length.max()) + 3], dtype=torch.int32)
        want = _old_write_ring(ring, kn, vn, start)
        if how == "append":
            kvcache.append_ring_layer_cache(ring, kn, vn)
        elif how == "write":
            kv = kvcache.write_ring_layer_cache(ring, kn, vn)
            if chunk > ring.max_step:  # the long path's view: ring before the write + the quantized chunk
                qk, sk = quantize_ref(kn, kv_dtype)
                assert torch.equal(as_bytes(kv.keys[:, :, ring.capacity:]), as_bytes(qk))
                assert torch.equal(kv.k_scale[:, :, ring.capacity:], sk)
        elif how == "update-int":
            ring = kvcache.update_ring_layer_cache(ring, kn, vn, int(start))
        else:
            ring = kvcache.update_ring_layer_cache(ring, kn, vn, start)
        assert_all_equal([ring.keys, ring.values, ring.k_scale, ring.v_scale, ring.positions], want)
        assert torch.equal(ring.length, (start + chunk).to(torch.int32).expand_as(ring.length))


# ----------------------------------------------------------------- errors ---


def _args(kv_dtype=torch.int8, B=2, H=2, CAP=6, D=4, chunk=2):
    bufs = qring(B, H, CAP, D, kv_dtype)
    kn = torch.randn(B, H, chunk, D)
    vn = torch.randn(B, H, chunk, D)
    return bufs, kn, vn


def _bad_cases():
    # (id, exception, match, build) where build() -> (bufs, kn, vn, start, sinks); bufs are the five written tensors.
    def base(**kw):
        bufs, kn, vn = _args(**kw)
        return bufs, kn, vn, torch.tensor(0), 0

    def edit(fn):
        def build():
            bufs, kn, vn, start, sinks = base()
            return fn(bufs, kn, vn, start, sinks)

        return build

    def pos_in_scale(bufs, kn, vn, s, sinks):
        bufs[4] = bufs[2][:, 0, :].view(torch.int32)  # (B, CAP) int32 view of k_scale
        return bufs, kn, vn, s, sinks

    def kn_from_scale(bufs, kn, vn, s, sinks):
        kn = torch.as_strided(bufs[3], kn.shape, (12, 6, 1, 0))  # new keys read from v_scale
        return bufs, kn, vn, s, sinks

    def start_in_scale(bufs, kn, vn, s, sinks):
        return bufs, kn, vn, bufs[2][0, 0, :2].view(torch.int32), sinks

    def float_cache(bufs, kn, vn, s, sinks):
        bufs[0], bufs[1] = torch.zeros(2, 2, 6, 4), torch.zeros(2, 2, 6, 4)
        return bufs, kn, vn, s, sinks

    def mixed_format(bufs, kn, vn, s, sinks):
        bufs[1] = torch.zeros(2, 2, 6, 4, dtype=torch.float8_e4m3fn)
        return bufs, kn, vn, s, sinks

    def scale_at(i, t):
        def f(bufs, kn, vn, s, sinks):
            bufs[i] = t
            return bufs, kn, vn, s, sinks

        return f

    def shared_scales(bufs, kn, vn, s, sinks):
        bufs[3] = bufs[2]
        return bufs, kn, vn, s, sinks

    return [
        ("float-cache", TypeError, "int8 or torch.float8_e4m3fn", edit(float_cache)),
        ("values-format", TypeError, "values", edit(mixed_format)),
        ("keys_new-float64", TypeError, "keys_new must be a torch.float32",
         edit(lambda b, kn, vn, s, k: (b, kn.double(), vn.double(), s, k))),
        ("values_new-dtype", TypeError, "values_new",
         edit(lambda b, kn, vn, s, k: (b, kn, vn.half(), s, k))),
        ("keys_new-head_dim", ValueError, "keys_new must have shape",
         edit(lambda b, kn, vn, s, k: (b, torch.randn(2, 2, 2, 5), torch.randn(2, 2, 2, 5), s, k))),
        ("keys_new-3d", ValueError, "keys_new",
         edit(lambda b, kn, vn, s, k: (b, kn[:, :, 0], vn[:, :, 0], s, k))),
        ("k_scale-shape", ValueError, "k_scale", edit(scale_at(2, torch.ones(2, 2, 7)))),
        ("v_scale-dtype", TypeError, "v_scale", edit(scale_at(3, torch.ones(2, 2, 6, dtype=torch.float64)))),
        ("k_scale-expanded", ValueError, "k_scale", edit(scale_at(2, torch.ones(1, 1, 6).expand(2, 2, 6)))),
        ("scales-share", ValueError, "k_scale and v_scale", edit(shared_scales)),
        ("positions-int64", TypeError, "positions", edit(scale_at(4, torch.full((2, 6), -1, dtype=torch.int64)))),
        ("positions-shape", ValueError, "positions", edit(scale_at(4, torch.full((2, 5), -1, dtype=torch.int32)))),
        ("positions-in-k_scale", ValueError, "positions must not share memory with k_scale", edit(pos_in_scale)),
        ("keys_new-in-v_scale", ValueError, "v_scale", edit(kn_from_scale)),
        ("start-in-k_scale", ValueError, "start must not share memory with k_scale", edit(start_in_scale)),
        ("start-float", TypeError, "start", edit(lambda b, kn, vn, s, k: (b, kn, vn, torch.tensor(0.0), k))),
        ("start-shape", ValueError, "start", edit(lambda b, kn, vn, s, k: (b, kn, vn, torch.tensor([0, 1, 2]), k))),
        ("start-negative", ValueError, "start must be >= 0, got -1 at index 1",
         edit(lambda b, kn, vn, s, k: (b, kn, vn, torch.tensor([0, -1]), k))),
        ("start-int32-overflow", ValueError, "ring overflow",
         edit(lambda b, kn, vn, s, k: (b, kn, vn, torch.tensor(2**31 - 2), k))),
        ("sinks-negative", ValueError, "sinks must be >= 0", edit(lambda b, kn, vn, s, k: (b, kn, vn, s, -1))),
        ("sinks-capacity", ValueError, "more slots than sinks", edit(lambda b, kn, vn, s, k: (b, kn, vn, s, 6))),
    ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_input_raises_and_writes_nothing(case):
    _, exc, match, build = case
    bufs, kn, vn, start, sinks = build()
    before = [t.clone() for t in bufs]
    with pytest.raises(exc, match=match):
        ops.ring_update_quantized_(*bufs, kn, vn, start, sinks=sinks)
    for a, b in zip(bufs, before):
        assert torch.equal(as_bytes(a), as_bytes(b))


def test_ring_api_bad_write_writes_nothing():
    # Through the Python API (one op: its checks run before anything is written), every chunk-length path.
    ring = _ring(torch.int8)
    kvcache.append_ring_layer_cache(ring, torch.randn(2, 2, 2, 8), torch.randn(2, 2, 2, 8))
    state = [ring.keys, ring.values, ring.k_scale, ring.v_scale, ring.positions, ring.length]
    before = [t.clone() for t in state]
    for chunk in (1, 3, 12):
        for kn, vn, exc in [
            (torch.randn(2, 2, chunk, 8).double(), torch.randn(2, 2, chunk, 8).double(), TypeError),
            (torch.randn(2, 3, chunk, 8), torch.randn(2, 3, chunk, 8), ValueError),
            (torch.randn(2, 2, chunk, 8), torch.randn(2, 2, chunk, 8).half(), TypeError),
        ]:
            with pytest.raises(exc):
                kvcache.write_ring_layer_cache(ring, kn, vn)
            with pytest.raises(exc):
                kvcache.append_ring_layer_cache(ring, kn, vn)
            for a, b in zip(state, before):
                assert torch.equal(as_bytes(a), as_bytes(b))
        with pytest.raises(ValueError, match="start must be >= 0"):
            kvcache.update_ring_layer_cache(ring, torch.randn(2, 2, chunk, 8), torch.randn(2, 2, chunk, 8),
                                            torch.tensor([0, -3]))
        for a, b in zip(state, before):
            assert torch.equal(as_bytes(a), as_bytes(b))


def test_autograd_and_versions():
    bufs, kn, vn = _args()
    versions = [t._version for t in bufs]
    ops.ring_update_quantized_(*bufs, kn, vn, torch.tensor(1))
    assert all(t._version > v for t, v in zip(bufs, versions))
    before = [t.clone() for t in bufs]
    with pytest.raises(ValueError, match="keys_new requires grad"):
        ops.ring_update_quantized_(*bufs, kn.requires_grad_(), vn, torch.tensor(1))
    for a, b in zip(bufs, before):
        assert torch.equal(as_bytes(a), as_bytes(b))


# ----------------------------------------------------------------- traced ---


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
def test_compiled_decode_loop_matches_eager_without_recompiles(kv_dtype):
    torch._dynamo.reset()
    eager = _ring(kv_dtype)
    traced = _ring(kv_dtype)

    def step(ring, kn, vn):
        kvcache.append_ring_layer_cache(ring, kn, vn)
        return ring.length + 0

    compiled = torch.compile(step, fullgraph=True)
    g = torch.Generator().manual_seed(3)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i in range(12):  # wraps the ring (capacity 7) more than once
            kn = torch.randn(2, 2, 1, 8, generator=g)
            vn = torch.randn(2, 2, 1, 8, generator=g)
            step(eager, kn, vn)
            compiled(traced, kn, vn)
            for a, b in zip((eager.keys, eager.values, eager.k_scale, eager.v_scale, eager.positions, eager.length),
                            (traced.keys, traced.values, traced.k_scale, traced.v_scale, traced.positions,
                             traced.length)):
                assert torch.equal(as_bytes(a), as_bytes(b)), i


def test_compiled_op_with_changing_start_tensor_and_export():
    torch._dynamo.reset()
    B, H, CAP, D = 2, 2, 6, 8

    def write(k, v, ks, vs, pos, kn, vn, start):
        return ops.ring_update_quantized_(k, v, ks, vs, pos, kn, vn, start, sinks=1)

    compiled = torch.compile(write, fullgraph=True)
    eager_bufs = qring(B, H, CAP, D, torch.float8_e4m3fn)
    traced_bufs = [t.clone() for t in eager_bufs]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for s in (0, 3, 9, 14):
            kn, vn = torch.randn(B, H, 2, D), torch.randn(B, H, 2, D)
            start = torch.tensor([s, s + 1], dtype=torch.int32)
            a = write(*eager_bufs, kn, vn, start)
            b = compiled(*traced_bufs, kn, vn, start)
            assert torch.equal(a, b)
            assert_all_equal(traced_bufs, eager_bufs)

    class M(torch.nn.Module):
        def forward(self, *xs):
            return write(*xs)

    kn, vn = torch.randn(B, H, 2, D), torch.randn(B, H, 2, D)
    start = torch.tensor(5)
    ep = torch.export.export(M(), (*[t.clone() for t in eager_bufs], kn, vn, start))
    mine = [t.clone() for t in eager_bufs]
    ep.module()(*mine, kn, vn, start)
    write(*eager_bufs, kn, vn, start)
    assert_all_equal(mine, eager_bufs)


def test_opcheck():
    # More samples (every format and new dtype, a chunk longer than the ring) in test_opcheck.py.
    checks = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    for kv_dtype in KV_DTYPES:
        for start in (torch.tensor(4), torch.tensor([1, 8], dtype=torch.int64)):
            bufs, kn, vn = _args(kv_dtype, chunk=3)
            # float8 has no CPU mul for SchemaCheckMode's comparison (see test_opcheck.py).
            use = checks if kv_dtype == torch.int8 else checks[1:]
            result = torch.library.opcheck(ops.ring_update_quantized_.default, (*bufs, kn, vn, start),
                                           {"sinks": 1}, test_utils=use)
            assert all(v == "SUCCESS" for v in result.values()), result
