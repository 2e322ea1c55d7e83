"""Rings through the CPU attend's one main loop (SlotRows::sel, a visibility mask per block), both
chunk paths forced: the per-row loops (gemm_rows huge) and the GEMM loops (gemm_rows 1, and the
default 32 with chunks of 31/32/33 query rows around it).

Against the float64 reference over each query's visible positions (references.attention_reference
on the recorded positions), after wraps, rollbacks (stale positions past the length), sinks,
windows 1 and 2, GQA groups 1..4, head_dim 12, transposed q, bf16/fp16 queries and int8/fp8 rings
(the reference reads their dequantized values). Also: a query whose history the ring lost is NaN
(visible_count), a row whose queries see nothing (kv_start at the length) is zeros, a NaN in a slot
no query of the chunk sees never reaches the output, and one in a slot a query sees makes that query
NaN, as a linear cache does.
"""

from __future__ import annotations

import pytest
import torch

import kvcache
from references import TOLERANCES, attention_reference, visible_slots

ATTEND = torch.ops.kvcache.attend.default
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


@pytest.fixture(params=["rows", "gemm", "default"])
def gemm_path(request):
    saved = kvcache._C.attend_cpu_tuning()
    rows = {"rows": 1 << 30, "gemm": 1, "default": 32}[request.param]
    kvcache._C.set_attend_cpu_tuning(gemm_rows=rows)
    yield request.param
    kvcache._C.set_attend_cpu_tuning(**saved)


def ring_positions(written: int, capacity: int, sinks: int) -> torch.Tensor:
    """Logical position per slot after writing positions [0, written) one by one (-1: empty)."""
    pos = torch.full((capacity,), -1, dtype=torch.int32)
    for p in range(written):
        pos[p if p < sinks else sinks + (p - sinks) % (capacity - sinks)] = p
    return pos


def needed(p: int, first: int, window: int, sinks: int) -> int:
    """How many positions the query at p sees when none is lost (core/visibility.h, restated)."""
    if p < first:
        return 0
    if window <= 0:
        return p + 1 - first
    n_sinks = max(min(p + 1, sinks) - first, 0)
    lo = max(first, sinks, p - window + 1)
    return n_sinks + max(p + 1 - lo, 0)


def make(b, kvh, capacity, d, lengths, sinks, qdtype, kv, *, rollback=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(b, kvh, capacity, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, kvh, capacity, d, generator=g, dtype=torch.float64)
    pos = torch.stack([ring_positions(n + rollback, capacity, sinks) for n in lengths])
    if kv is None:
        kc, vc = k.to(qdtype), v.to(qdtype)
        return kc, vc, pos, {}, kc.double(), vc.double()
    ks = (k.abs().amax(-1) / QMAX[kv]).float()
    vs = (v.abs().amax(-1) / QMAX[kv]).float()
    if kv == torch.int8:
        kc = (k / ks[..., None]).round().clamp(-127, 127).to(torch.int8)
        vc = (v / vs[..., None]).round().clamp(-127, 127).to(torch.int8)
    else:
        kc, vc = (k / ks[..., None]).to(kv), (v / vs[..., None]).to(kv)
    kr = kc.double() * ks.double()[..., None]
    vr = vc.double() * vs.double()[..., None]
    return kc, vc, pos, dict(k_scale=ks, v_scale=vs), kr, vr


def query(b, heads, seq, d, qdtype, transposed, seed):
    g = torch.Generator().manual_seed(seed + 1)
    if transposed:
        return torch.randn(b, seq, heads, d, generator=g).to(qdtype).transpose(1, 2)
    return torch.randn(b, heads, seq, d, generator=g).to(qdtype)


def expected(q, kr, vr, lengths_t, pos, window, sinks, kv_start=None):
    """The float64 reference, NaN for a query whose visible positions number fewer than it needs."""
    ref = attention_reference(q, kr, vr, lengths_t, kv_start=kv_start, window=window, positions=pos, sinks=sinks)
    b, _, seq, _ = q.shape
    lens = lengths_t.expand(b).tolist() if lengths_t.dim() == 0 else lengths_t.tolist()
    firsts = [0] * b if kv_start is None else kv_start.tolist()
    for r in range(b):
        for i in range(seq):
            p = lens[r] - seq + i
            n = visible_slots(lens[r], p, pos.shape[1], firsts[r], window, pos[r], sinks).numel()
            if n < needed(p, firsts[r], window, sinks):
                ref[r, :, i] = float("nan")
    return ref


def check(out, ref, qdtype, kv):
    assert torch.equal(out.isnan(), ref.isnan()), (out.isnan().sum(), ref.isnan().sum())
    o, r = out.double().nan_to_num(0.0), ref.nan_to_num(0.0)
    atol, rtol = TOLERANCES[qdtype]
    if kv is not None:  # the quantized loops round the query / weights: the int8 tests' bound
        atol, rtol = 2e-2, 2e-2
    scale = 1.0 + float(r.abs().max())
    torch.testing.assert_close(o, r, atol=atol * scale, rtol=rtol)


CASES = [
    # (kv heads, group, sinks, window, capacity without sinks, seq, lengths, rollback)
    (1, 1, 0, 1, 8, 8, [20], 0),
    (2, 2, 1, 2, 9, 9, [22, 31], 0),
    (1, 4, 0, 5, 40, 31, [95], 3),
    (2, 3, 4, 2, 40, 32, [77, 50], 0),
    (1, 2, 0, 40, 40, 33, [111, 61], 0),
    (2, 4, 1, 0, 70, 40, [130, 83], 3),
    (1, 3, 4, 70, 70, 2, [150], 0),
    (2, 1, 0, 16, 16, 16, [35, 16], 0),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "kvh{}-g{}-s{}-w{}-cap{}-seq{}".format(*c[:6]))
@pytest.mark.parametrize("qdtype,kv", [(torch.float32, None), (torch.bfloat16, None), (torch.float16, None),
                                       (torch.float32, torch.int8), (torch.bfloat16, torch.int8),
                                       (torch.float16, torch.float8_e4m3fn)], ids=str)
def test_ring_chunks_match_reference_on_both_loops(gemm_path, case, qdtype, kv):
    kvh, group, sinks, window, cap, seq, lengths, rollback = case
    capacity = cap + sinks
    b, d = len(lengths), 12
    kc, vc, pos, scales, kr, vr = make(b, kvh, capacity, d, lengths, sinks, qdtype, kv, rollback=rollback)
    for transposed in (False, True):
        q = query(b, kvh * group, seq, d, qdtype, transposed, seed=len(lengths))
        lengths_t = torch.tensor(lengths, dtype=torch.int32)
        out = ATTEND(q, kc, vc, lengths_t, window=window, positions=pos, sinks=sinks, **scales)
        check(out, expected(q, kr, vr, lengths_t, pos, window, sinks), qdtype, kv)


def test_rows_that_see_nothing_are_zeros(gemm_path):
    """kv_start at the length: every query of row 0 sees nothing (zeros); row 1 is the reference."""
    capacity, sinks, seq = 44, 4, 33
    lengths = [90, 70]
    kc, vc, pos, _, kr, vr = make(2, 2, capacity, 12, lengths, sinks, torch.float32, None)
    q = query(2, 4, seq, 12, torch.float32, True, seed=5)
    lengths_t = torch.tensor(lengths, dtype=torch.int32)
    kv_start = torch.tensor([90, 0], dtype=torch.int32)
    out = ATTEND(q, kc, vc, lengths_t, kv_start=kv_start, window=0, positions=pos, sinks=sinks)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    check(out, expected(q, kr, vr, lengths_t, pos, 0, sinks, kv_start), torch.float32, None)


@pytest.mark.parametrize("kv", [None, torch.int8], ids=str)
@pytest.mark.parametrize("seq", [1, 31, 33])
def test_nan_in_a_slot_only_where_a_query_sees_it(gemm_path, kv, seq):
    """NaN in a stale slot (rolled back) no query of the chunk sees: finite output equal to the
    reference; NaN in the key of a slot the chunk's last query sees: that query is NaN."""
    capacity, sinks, window, length = 44, 1, 5, 100
    kc, vc, pos, scales, kr, vr = make(1, 1, capacity, 12, [length], sinks, torch.bfloat16, kv, rollback=3)
    stale = int((pos[0] == length + 1).nonzero())  # a rolled-back position: no query sees it
    latest = int((pos[0] == length - 1).nonzero())  # the last query's own position
    q = query(1, 2, seq, 12, torch.bfloat16, False, seed=9)
    lengths_t = torch.tensor([length], dtype=torch.int32)
    ref = expected(q, kr, vr, lengths_t, pos, window, sinks)
    for buf in ("k", "v"):
        k2, v2 = kc.clone(), vc.clone()
        s2 = {n: t.clone() for n, t in scales.items()}
        if kv is None:
            (k2 if buf == "k" else v2)[0, :, stale] = float("nan")
        else:
            s2["k_scale" if buf == "k" else "v_scale"][0, :, stale] = float("nan")
        out = ATTEND(q, k2, v2, lengths_t, window=window, positions=pos, sinks=sinks, **s2)
        check(out, ref, torch.bfloat16, kv)
    k2 = kc.clone()
    s2 = {n: t.clone() for n, t in scales.items()}
    if kv is None:
        k2[0, :, latest] = float("nan")
    else:
        s2["k_scale"][0, :, latest] = float("nan")
    out = ATTEND(q, k2, vc, lengths_t, window=window, positions=pos, sinks=sinks, **s2)
    assert out[0, :, -1].isnan().all()
