"""Attention benchmarks: kvcache.attend against scaled-dot-product attention over a KV cache.

``python benchmarks/bench_attend.py [--threads 1 0] [--cases decode ragged prefill] [--quick] [--json F]``
``python benchmarks/bench_attend.py --cases decode chunk --head-dims 64 128 256 --batches 1 8`` (issue 22's grid)

Shapes: 32 query heads / 8 KV heads (grouped-query attention, group 4),
head_dim 128, float32 and bfloat16; the decode and chunk cases also run at
every ``--head-dims`` x ``--batches`` pair (every row of a batch filled to the
same length; the capacity sweep only at batch 1, head_dim 128) and at the
``--filled`` lengths given. Each case runs at every ``--threads``
setting, its methods interleaved over rounds (median and min-max spread of
the round medians, see common.py); the decode case interleaves every
capacity of a filled length in one run.

* decode (batch 1, one query, 256 or 4096 filled slots, capacity 512, 4096
  or 32768): ``torch.ops.kvcache.attend`` against
  - "SDPA prefix view": ``F.scaled_dot_product_attention`` on the exact
    filled prefix ``keys[:, :, :filled]`` (a view, no copy), the group folded
    into the query axis as ``models/decoder.py::grouped_attention`` does
    (``q.reshape(b, kv_heads, group * seq, d)``; every KV row read once per
    group; no mask needed for one query). On CPU this is faster than
    ``enable_gqa=True``, which expands the keys and values to all heads.
  - "masked SDPA, whole buffer": ``grouped_attention`` itself, the package
    Decoder's ``attention="sdpa"`` path: a boolean mask over the whole
    capacity, built per call as the model builds it.
* gemmrows (batch 1, 4096 filled, chunks of 1 .. 128 positions): attend with the chunk (GEMM)
  loops forced on (``set_attend_cpu_tuning(gemm_rows=1)``), forced off, and at the default
  threshold, to measure where packing the keys pays.
* ragged (batch 8, one query per row, lengths spread geometrically from 64
  to 4096, capacity 4096): one attend call against the sum of 8 per-row
  "SDPA prefix view" calls (each row's own prefix, timed as one loop), and
  masked SDPA over the whole buffer.
* prefill (seq 512 from an empty cache of capacity 4096): attend against
  ``F.scaled_dot_product_attention(is_causal=True)`` on the same tensors
  (q and the 512-slot prefix views, ``enable_gqa=True``), and against SDPA on
  keys/values already expanded to 32 heads (the expansion not timed).

* chunk (seq 4: speculative verification; seq 128: chunked prefill; batch 1,
  256 or 4096 filled, the chunk's queries at the last positions): attend
  against SDPA on the prefix with the bottom-right causal mask (enable_gqa,
  and the group folded into the query axis with the mask repeated); each row
  prints the GFLOP/s reached and its fraction of the GEMM rate measured in
  the same interleaved rounds at the same thread count (``torch.mm``,
  1024 x 1024 x 1024, the faster of the row's dtype and float32).
* ring (batch 1, one query, a wrapped ring of window 4096, sinks 4): attend
  over the ring against attend over a linear cache with the same number of
  visible slots (4096 filled).
* crossover (batch 1, one query, 16 .. 2048 filled): attend forced serial,
  forced parallel (``kvcache._C.set_attend_cpu_tuning(parallel_work=0)``)
  and at the default threshold, to measure where helper threads pay.

Every decode row prints the bytes of keys and values the kernel reads, the
GB/s it reaches and ``bw_frac``: that rate divided by the rate of a
same-size, same-thread-count streaming read (``x.sum()`` over a float32
buffer of the same bytes) measured in the same run; and ``roof_frac``, the
fraction of the roofline the row reaches: its lower bound on the time, the
larger of that streaming read's time and its multiply-adds at the GEMM rate
measured in the same rounds (as for chunks), over the time it takes, with
``bound`` naming which of the two is larger. Where the bound is compute, a
``bw_frac`` of 1 is out of reach of any kernel on the machine. Peers: "SDPA prefix
view" (folded groups), "SDPA prefix, enable_gqa", compiled
``flex_attention`` with ``--flex`` (compiles per shape: slow), ExecuTorch's
``custom_sdpa`` when ``executorch`` is importable (skipped otherwise);
``vs_best`` is attend's time over the fastest peer's. The CPU model and the
kernel's ISA path head the output. ``--busy`` runs a spinning process
beside the benchmark (the other core busy). ``--isa avx2`` (or ``generic``,
``avx512``) runs everything as on a CPU with no more than that instruction
set: our kernel and the peers' libraries (ATen, oneDNN, MKL) alike, see
``isa_cap.py``; ``KVCACHE_ATTEND_ISA`` alone would cap only ours.

At 1 thread each method is also timed in CPU time of the calling thread
(``cpu_us``): on a machine shared with other work, wall time includes the
waits for a core, CPU time does not. The last tables check the targets of
issue 9 on both.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import subprocess
import sys
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import isa_cap  # noqa: E402  (no torch import: --isa re-executes before torch loads)

isa_cap.apply()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import kvcache  # noqa: E402
from common import (  # noqa: E402
    cpu_times,
    add_common_args,
    l2_bytes,
    environment,
    measure_many,
    num_threads,
    print_table,
    thread_settings,
    write_json,
)
from kvcache.models.decoder import grouped_attention  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
DEFAULT_SHAPE = (1, HEAD_DIM)  # (batch, head_dim) of issue 9's rows: capacity sweep, masked SDPA, CPU times
ATTEND = torch.ops.kvcache.attend.default


def make_cache(b, capacity, dtype, seed=0, head_dim=HEAD_DIM):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(b, KV_HEADS, capacity, head_dim, generator=g, dtype=dtype)
    values = torch.randn(b, KV_HEADS, capacity, head_dim, generator=g, dtype=dtype)
    return keys, values


def sdpa_prefix(q, keys, values, filled):
    """SDPA on the filled prefix (a view), the query group folded into the query axis."""
    b, h, s, d = q.shape
    qg = q.reshape(b, KV_HEADS, (h // KV_HEADS) * s, d)
    out = F.scaled_dot_product_attention(qg, keys[:, :, :filled], values[:, :, :filled])
    return out.reshape(b, h, s, d)


def elem_bytes(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def stream_read(nbytes: int):
    """A streaming read of nbytes (x.sum() over a float32 buffer of that size)."""
    buf = torch.rand(max(1, nbytes // 4))
    return lambda: buf.sum()


def sdpa_prefix_gqa(q, keys, values, filled, mask=None):
    return F.scaled_dot_product_attention(q, keys[:, :, :filled], values[:, :, :filled], attn_mask=mask,
                                          enable_gqa=True)


_FLEX = {}


def flex_peer(q, keys, values, filled):
    """Compiled flex_attention on the prefix (GQA), or None where it does not compile on this CPU."""
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError:
        return None
    if "fn" not in _FLEX:
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    fn = _FLEX["fn"]
    kp, vp = keys[:, :, :filled], values[:, :, :filled]

    def run():
        return fn(q, kp, vp, enable_gqa=True)

    try:
        run()
    except Exception as e:  # noqa: BLE001 - any compile failure: no peer
        print(f"(flex_attention skipped: {type(e).__name__}: {str(e).splitlines()[0][:120]})")
        return None
    return run


def executorch_peer(q, keys, values, filled):
    """ExecuTorch's CPU custom_sdpa (layout (b, s, h, d), start_pos), or None when not importable."""
    try:
        import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401
        op = torch.ops.llama.custom_sdpa
    except Exception:  # noqa: BLE001 - not installed, or a torch pin mismatch
        return None
    seq = q.shape[2]
    qt = q.transpose(1, 2).contiguous()
    kt = keys.transpose(1, 2).contiguous()
    vt = values.transpose(1, 2).contiguous()
    return lambda: op(qt, kt, vt, filled - seq, None, 0.0, True)


def decode_methods(filled, capacity, dtype, args=None, peers=True, batch=1, head_dim=HEAD_DIM):
    keys, values = make_cache(batch, capacity, dtype, head_dim=head_dim)
    q = torch.randn(batch, HEADS, 1, head_dim).to(dtype)
    lengths = torch.full((batch,), filled, dtype=torch.int32)
    positions = torch.full((batch, 1), filled - 1)
    fns = {
        "kvcache attend": lambda: ATTEND(q, keys, values, lengths),
        "SDPA prefix view": lambda: sdpa_prefix(q, keys, values, filled),
    }
    if peers:
        fns["SDPA prefix, enable_gqa"] = lambda: sdpa_prefix_gqa(q, keys, values, filled)
        if (batch, head_dim) == DEFAULT_SHAPE:  # not a peer: issue 9's rows only (slow at the grid's sizes)
            fns["masked SDPA, whole buffer"] = lambda: grouped_attention(q, keys, values, positions)
        if args is not None and args.flex:
            f = flex_peer(q, keys, values, filled)
            if f is not None:
                fns["flex_attention (compiled)"] = f
        e = executorch_peer(q, keys, values, filled)
        if e is not None:
            fns["ExecuTorch custom_sdpa"] = e
        fns["stream read (same bytes)"] = stream_read(kv_bytes(batch, filled, head_dim, dtype))
    return fns


def kv_bytes(batch, filled, head_dim, dtype) -> int:
    """Bytes of keys and values attend reads over `filled` slots of every row."""
    return 2 * batch * KV_HEADS * filled * head_dim * elem_bytes(dtype)


def shapes(args):
    """The (batch, head_dim) pairs of --batches x --head-dims, the default pair (1, 128) first."""
    out = [(b, d) for b in args.batches for d in args.head_dims]
    return sorted(out, key=lambda bd: bd != DEFAULT_SHAPE)


PEERS = ("SDPA prefix view", "SDPA prefix, enable_gqa", "flex_attention (compiled)", "ExecuTorch custom_sdpa")


def ratio(res, a, b, key="median_us"):
    return res[a][key] / res[b][key]


def add_limits(r: Dict, row: Dict, name: str, kv_bytes: int, flops: float = 0.0, rate: float = 0.0) -> None:
    """bytes, GB/s, bw_frac and vs_best for method `name` of one measured set `r`; with the row's
    flops and the GEMM rate (GFLOP/s) measured beside it, roof_frac and bound."""
    t = r[name]["median_us"]
    row["kv_MB"] = kv_bytes / 1e6
    row["GB_s"] = kv_bytes / t / 1e3
    if "stream read (same bytes)" in r:
        stream_us = r["stream read (same bytes)"]["median_us"]
        row["bw_frac"] = stream_us / t
        if flops > 0 and rate > 0:
            compute_us = flops / rate / 1e3
            row["roof_frac"] = max(stream_us, compute_us) / t
            row["bound"] = "compute" if compute_us > stream_us else "memory"
    peers = [r[p]["median_us"] for p in PEERS if p in r]
    if peers:
        best = min(peers)
        row["best_peer"] = next(p for p in PEERS if p in r and r[p]["median_us"] == best)
        row["vs_best"] = t / best


def measure(fns: Dict, args, threads: int, scale: float = 1.0, cpu: bool = True) -> Dict:
    """Wall time (common.measure_many) and, at 1 thread with `cpu`, CPU time (cpu_us)."""
    res = measure_many(fns, torch.device("cpu"), args.min_time * scale, args.rounds)
    cpu = cpu_times(fns, args.min_time * scale, args.rounds) if threads == 1 and cpu else {}
    for k, m in res.items():
        m["cpu_us"] = cpu.get(k)
    return res


def case_decode(args, threads):
    # Every capacity of one filled length is measured in one interleaved
    # run, so the capacity comparison does not ride on drift between runs.
    filled_caps = {256: [512, 4096, 32768], 4096: [4096, 32768], 16384: [16384]}
    if args.quick:
        filled_caps = {256: [512, 32768]}
    if args.filled:
        filled_caps = {f: filled_caps.get(f, [f]) for f in args.filled}
    out = []
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        for batch, head_dim in shapes(args):
            for filled, caps in filled_caps.items():
                if (batch, head_dim) != DEFAULT_SHAPE:
                    caps = caps[:1]  # the capacity sweep (issue 9's targets) only for the default shape
                fns = {}
                for cap in caps:
                    for name, fn in decode_methods(filled, cap, dtype, args, batch=batch, head_dim=head_dim).items():
                        fns[(cap, name)] = fn
                for name, fn in gemm_refs(dtype).items():  # the roofline's compute rate, once a set
                    fns[(None, name)] = fn
                # CPU times only where issue 9's targets read them (the default shape).
                res = measure(fns, args, threads, len(caps), cpu=(batch, head_dim) == DEFAULT_SHAPE)
                out.extend(decode_rows(res, caps, threads, dtype_name, batch, head_dim, filled))
                del fns, res  # free this shape's caches before the next one is made
    return out


def decode_rows(res, caps, threads, dtype_name, batch, head_dim, filled):
    out = []
    nbytes = kv_bytes(batch, filled, head_dim, DTYPES[dtype_name])
    gemm = {name: m for (c, name), m in res.items() if c is None}
    rate = gemm_rate(gemm) if gemm else 0.0
    flops = 4.0 * batch * HEADS * head_dim * filled  # Q.K and P.V, 2 flops a multiply-add
    for cap in caps:
        r = {name: m for (c, name), m in res.items() if c == cap}
        for name, m in r.items():
            if name == "stream read (same bytes)":
                continue
            row = dict(case="decode", threads=threads, dtype=dtype_name, batch=batch,
                       head_dim=head_dim, filled=filled, capacity=cap, method=name, **m,
                       vs_prefix_sdpa=ratio(r, name, "SDPA prefix view"))
            masked = "masked SDPA, whole buffer" in r
            if masked:
                row["masked_over_this"] = ratio(r, "masked SDPA, whole buffer", name)
            if name == "kvcache attend":
                add_limits(r, row, name, nbytes, flops, rate)
            if m["cpu_us"] is not None and masked:
                row["cpu_vs_prefix_sdpa"] = ratio(r, name, "SDPA prefix view", "cpu_us")
                row["cpu_masked_over_this"] = ratio(r, "masked SDPA, whole buffer", name, "cpu_us")
            out.append(row)
    return out


def chunk_mask(seq: int, filled: int) -> torch.Tensor:
    """Bottom-right causal mask: query i (position filled - seq + i) sees slots <= its position."""
    return torch.arange(filled)[None, :] <= (torch.arange(seq)[:, None] + filled - seq)


GEMM_N = 1024


def gemm_refs(dtype) -> Dict:
    """The machine's GEMM, timed beside each chunk row (same rounds, so the rate drifts with the
    row's): torch.mm (1024 x 1024 x 1024) in `dtype` and in float32. The row's rate is the faster
    of the two (a CPU without native bf16 arithmetic runs torch's bf16 mm far below its float32
    rate, and attend widens bf16 to float32: the float32 rate is what the machine can do)."""
    fns = {}
    for dt in {dtype, torch.float32}:
        a, b = torch.randn(GEMM_N, GEMM_N).to(dt), torch.randn(GEMM_N, GEMM_N).to(dt)
        fns[f"GEMM reference ({dt})"] = lambda a=a, b=b: torch.mm(a, b)
    return fns


def gemm_rate(res: Dict) -> float:
    """GFLOP/s of the fastest GEMM reference in one measured set."""
    return max(2 * GEMM_N**3 / m["median_us"] / 1e3 for k, m in res.items() if k.startswith("GEMM reference"))


def case_chunk(args, threads):
    seqs, filleds = (4, 128), (256, 4096)
    if args.quick:
        filleds = (256,)
    if args.filled:
        filleds = tuple(args.filled)
    out = []
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        for (batch, head_dim), seq, filled in itertools.product(shapes(args), seqs, filleds):
            keys, values = make_cache(batch, filled, dtype, head_dim=head_dim)
            q = torch.randn(batch, HEADS, seq, head_dim).to(dtype)
            lengths = torch.full((batch,), filled, dtype=torch.int32)
            mask = chunk_mask(seq, filled)
            group = HEADS // KV_HEADS
            mask_folded = mask.repeat(group, 1)
            qf = q.reshape(batch, KV_HEADS, group * seq, head_dim)
            fns = {
                "kvcache attend": lambda: ATTEND(q, keys, values, lengths),
                "SDPA prefix, enable_gqa": lambda: sdpa_prefix_gqa(q, keys, values, filled, mask),
                "SDPA prefix view": lambda: F.scaled_dot_product_attention(qf, keys, values,
                                                                           attn_mask=mask_folded),
            }
            e = executorch_peer(q, keys, values, filled)
            if e is not None:
                fns["ExecuTorch custom_sdpa"] = e
            fns.update(gemm_refs(dtype))
            res = measure(fns, args, threads, cpu=False)
            rate = gemm_rate(res)
            visible = sum(filled - seq + i + 1 for i in range(seq))
            flops = 4.0 * batch * HEADS * head_dim * visible  # Q.K and P.V, 2 flops a multiply-add
            for name, m in res.items():
                if name.startswith("GEMM reference"):
                    continue
                row = dict(case="chunk", threads=threads, dtype=dtype_name, batch=batch, head_dim=head_dim,
                           seq=seq, filled=filled, method=name, **m, GFLOP_s=flops / m["median_us"] / 1e3,
                           gemm_GFLOP_s=rate)
                row["gemm_frac"] = row["GFLOP_s"] / rate
                if name == "kvcache attend":
                    add_limits(res, row, name, kv_bytes(batch, filled, head_dim, dtype), flops, rate)
                out.append(row)
            del fns, res, keys, values
    return out


def case_ring(args, threads):
    window, sinks = 4096, 4
    out = []
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        g = torch.Generator().manual_seed(0)
        ring = kvcache.init_ring_layer_cache(1, KV_HEADS, HEAD_DIM, window, dtype, sinks=sinks)
        context = window + 1000  # wrapped
        k = torch.randn(1, KV_HEADS, context, HEAD_DIM, generator=g).to(dtype)
        kvcache.write_ring_layer_cache(ring, k, k * 0.5)  # writes the ring in place
        q = torch.randn(1, HEADS, 1, HEAD_DIM, generator=g).to(dtype)
        lin = decode_methods(window, window, dtype, peers=False)
        fns = {
            "kvcache attend, ring": lambda: kvcache.attend(q, ring),
            "kvcache attend, linear (same visible count)": lin["kvcache attend"],
            "stream read (same bytes)": stream_read(2 * KV_HEADS * window * HEAD_DIM * elem_bytes(dtype)),
        }
        res = measure(fns, args, threads)
        kv_bytes = 2 * KV_HEADS * window * HEAD_DIM * elem_bytes(dtype)
        for name, m in res.items():
            if name.startswith("stream"):
                continue
            row = dict(case="ring", threads=threads, dtype=dtype_name, window=window, sinks=sinks, method=name,
                       **m, vs_linear=ratio(res, name, "kvcache attend, linear (same visible count)"))
            add_limits(res, row, name, kv_bytes)
            out.append(row)
    return out


def case_crossover(args, threads):
    """Serial against forced-parallel attend over short rows: where helper threads start to pay."""
    if threads < 2:
        return []
    set_tuning = kvcache._C.set_attend_cpu_tuning
    default = kvcache._C.attend_cpu_tuning()["parallel_work"]
    filleds = (16, 32, 64, 128, 256, 512, 1024, 2048) if not args.quick else (64, 256, 1024)
    out = []
    try:
        for dtype_name in args.dtypes:
            dtype = DTYPES[dtype_name]
            fns = {}
            for filled in filleds:
                f = decode_methods(filled, filled, dtype, peers=False)["kvcache attend"]
                for name, work in (("serial", 1e300), ("parallel", 0.0), ("default", default)):
                    def run(f=f, work=work):
                        set_tuning(parallel_work=work)
                        return f()
                    fns[(filled, name)] = run
            res = measure(fns, args, threads)
            for filled in filleds:
                s, p, d = (res[(filled, n)]["median_us"] for n in ("serial", "parallel", "default"))
                out.append(dict(case="crossover", threads=threads, dtype=dtype_name, filled=filled,
                                serial_us=s, parallel_us=p, default_us=d, parallel_over_serial=p / s,
                                default_over_best=d / min(s, p),
                                serial_spread=f"{res[(filled, 'serial')]['min_us']:.0f}-"
                                              f"{res[(filled, 'serial')]['max_us']:.0f}",
                                parallel_spread=f"{res[(filled, 'parallel')]['min_us']:.0f}-"
                                                f"{res[(filled, 'parallel')]['max_us']:.0f}"))
    finally:
        set_tuning(parallel_work=default)
    return out


def case_gemmrows(args, threads):
    """attend over chunks of 1 .. 128 positions (batch 1, 4096 filled) with the chunk (GEMM) loops
    forced on (gemm_rows=1) and off: where packing the keys starts to pay. rows = query heads per
    KV head x positions, the number the gemm_rows setting compares."""
    set_tuning = kvcache._C.set_attend_cpu_tuning
    default = kvcache._C.attend_cpu_tuning()["gemm_rows"]
    seqs = (1, 2, 4, 8, 16, 32, 128) if not args.quick else (2, 8, 32)
    filled = 4096 if not args.quick else 1024
    group = HEADS // KV_HEADS
    out = []
    try:
        for dtype_name in args.dtypes:
            dtype = DTYPES[dtype_name]
            keys, values = make_cache(1, filled, dtype)
            lengths = torch.tensor([filled], dtype=torch.int32)
            fns = {}
            for seq in seqs:
                q = torch.randn(1, HEADS, seq, HEAD_DIM).to(dtype)
                for name, rows in (("gemm", 1), ("dot", 1 << 40), ("default", default)):
                    def run(q=q, rows=rows):
                        set_tuning(gemm_rows=rows)
                        return ATTEND(q, keys, values, lengths)
                    fns[(seq, name)] = run
            res = measure(fns, args, threads)
            for seq in seqs:
                g, d, dflt = (res[(seq, n)]["median_us"] for n in ("gemm", "dot", "default"))
                out.append(dict(case="gemmrows", threads=threads, dtype=dtype_name, seq=seq,
                                rows=group * seq, gemm_us=g, dot_us=d, default_us=dflt,
                                gemm_over_dot=g / d, default_over_best=dflt / min(g, d),
                                gemm_spread=f"{res[(seq, 'gemm')]['min_us']:.0f}-{res[(seq, 'gemm')]['max_us']:.0f}",
                                dot_spread=f"{res[(seq, 'dot')]['min_us']:.0f}-{res[(seq, 'dot')]['max_us']:.0f}"))
    finally:
        set_tuning(gemm_rows=default)
    return out


def ragged_lengths(b=8, lo=64, hi=4096):
    return [int(round(lo * (hi / lo) ** (i / (b - 1)))) for i in range(b)]


def case_ragged(args, threads):
    lens = ragged_lengths()
    cap = max(lens)
    b = len(lens)
    out = []
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        keys, values = make_cache(b, cap, dtype)
        q = torch.randn(b, HEADS, 1, HEAD_DIM).to(dtype)
        lengths = torch.tensor(lens, dtype=torch.int32)
        positions = (lengths - 1)[:, None]
        rows = [(q[r : r + 1], keys[r : r + 1], values[r : r + 1], n) for r, n in enumerate(lens)]

        def per_row_sdpa():
            return [sdpa_prefix(*row) for row in rows]

        fns = {
            "kvcache attend (one call)": lambda: ATTEND(q, keys, values, lengths),
            "sum of per-row SDPA prefix calls": per_row_sdpa,
            "masked SDPA, whole buffer": lambda: grouped_attention(q, keys, values, positions),
        }
        res = measure(fns, args, threads)
        ref = "sum of per-row SDPA prefix calls"
        for name, m in res.items():
            row = dict(case="ragged", threads=threads, dtype=dtype_name, lengths="64..4096 (8 rows)",
                       method=name, **m, vs_per_row_sdpa=ratio(res, name, ref))
            if threads == 1:
                row["cpu_vs_per_row_sdpa"] = ratio(res, name, ref, "cpu_us")
            out.append(row)
    return out


def case_prefill(args, threads):
    seq, cap = 512, 4096
    out = []
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        keys, values = make_cache(1, cap, dtype)
        q = torch.randn(1, HEADS, seq, HEAD_DIM).to(dtype)
        lengths = torch.tensor([seq], dtype=torch.int32)
        kp, vp = keys[:, :, :seq], values[:, :, :seq]
        group = HEADS // KV_HEADS
        kr, vr = kp.repeat_interleave(group, 1), vp.repeat_interleave(group, 1)
        fns = {
            "kvcache attend": lambda: ATTEND(q, keys, values, lengths),
            "SDPA causal (enable_gqa)": lambda: F.scaled_dot_product_attention(
                q, kp, vp, is_causal=True, enable_gqa=True),
            "SDPA causal, KV pre-expanded": lambda: F.scaled_dot_product_attention(q, kr, vr, is_causal=True),
        }
        res = measure(fns, args, threads)
        ref = "SDPA causal (enable_gqa)"
        for name, m in res.items():
            row = dict(case="prefill", threads=threads, dtype=dtype_name, seq=seq, method=name, **m,
                       vs_sdpa_causal=ratio(res, name, ref),
                       vs_sdpa_expanded=ratio(res, name, "SDPA causal, KV pre-expanded"))
            if threads == 1:
                row["cpu_vs_sdpa_causal"] = ratio(res, name, ref, "cpu_us")
            out.append(row)
    return out


CASES = {
    "decode": (case_decode, "decode, one query, 32/8 heads, µs",
               ["dtype", "batch", "head_dim", "filled", "capacity", "method", "median_us", "min_us", "max_us", "cpu_us",
                "vs_prefix_sdpa", "cpu_vs_prefix_sdpa", "masked_over_this", "kv_MB", "GB_s", "bw_frac",
                "roof_frac", "bound", "best_peer", "vs_best"]),
    "chunk": (case_chunk, "chunks (seq 4, 128), 32/8 heads, µs",
              ["dtype", "batch", "head_dim", "seq", "filled", "method", "median_us", "min_us", "max_us", "GFLOP_s", "gemm_GFLOP_s",
               "gemm_frac", "GB_s", "bw_frac", "roof_frac", "bound", "best_peer", "vs_best"]),
    "ring": (case_ring, "ring decode (window 4096, sinks 4, wrapped) against linear, batch 1, µs",
             ["dtype", "method", "median_us", "min_us", "max_us", "vs_linear", "GB_s", "bw_frac"]),
    "crossover": (case_crossover, "serial vs parallel decode over short rows, batch 1, µs",
                  ["dtype", "filled", "serial_us", "serial_spread", "parallel_us", "parallel_spread",
                   "default_us", "parallel_over_serial", "default_over_best"]),
    "gemmrows": (case_gemmrows, "chunk (GEMM) loops forced on and off, batch 1, 4096 filled, µs",
                 ["dtype", "seq", "rows", "gemm_us", "gemm_spread", "dot_us", "dot_spread", "default_us",
                  "gemm_over_dot", "default_over_best"]),
    "ragged": (case_ragged, "ragged decode, batch 8, lengths 64..4096, capacity 4096, µs",
               ["dtype", "method", "median_us", "min_us", "max_us", "cpu_us", "vs_per_row_sdpa",
                "cpu_vs_per_row_sdpa"]),
    "prefill": (case_prefill, "prefill, seq 512 from an empty cache, µs",
                ["dtype", "method", "median_us", "min_us", "max_us", "cpu_us", "vs_sdpa_causal",
                 "cpu_vs_sdpa_causal", "vs_sdpa_expanded"]),
}


def pick(rows, **kw) -> Dict:
    for r in rows:
        if all(r.get(k) == v for k, v in kw.items()):
            return r
    return {}


def targets(rows: List[dict], threads: int) -> List[dict]:
    """Issue 9's targets, from the rows measured at `threads`."""
    rows = [r for r in rows if r["threads"] == threads]
    out = []

    def add(name, value, goal, ok, cpu=None, cpu_ok=None):
        out.append(dict(target=name, measured=value, goal=goal, met="yes" if ok else "NO", cpu_time=cpu,
                        met_cpu=None if cpu is None else ("yes" if cpu_ok else "NO")))

    for dt in sorted({r["dtype"] for r in rows}):
        dec = {(r["filled"], r["capacity"]): r for r in rows
               if r["case"] == "decode" and r["dtype"] == dt and r["method"] == "kvcache attend"
               and (r["batch"], r["head_dim"]) == DEFAULT_SHAPE}
        for filled, base in ((256, 512), (4096, 4096)):
            if (filled, base) in dec and (filled, 32768) in dec:
                a, b = dec[(filled, 32768)], dec[(filled, base)]
                v = a["median_us"] / b["median_us"]
                c = a["cpu_us"] / b["cpu_us"] if a.get("cpu_us") else None
                add(f"{dt} decode {filled} filled: time at cap 32768 / cap {base}", v, "<= 1.1", v <= 1.1,
                    c, c is not None and c <= 1.1)
        for (filled, cap), r in sorted(dec.items()):
            c = r.get("cpu_vs_prefix_sdpa")
            add(f"{dt} decode {filled}/{cap}: attend / SDPA prefix view", r["vs_prefix_sdpa"], "<= 1.0",
                r["vs_prefix_sdpa"] <= 1.0, c, c is not None and c <= 1.0)
        for filled in (256, 4096):
            r = dec.get((filled, 32768))
            if r:
                c = r.get("cpu_masked_over_this")
                add(f"{dt} decode {filled}/32768: masked SDPA / attend", r["masked_over_this"], ">= 100",
                    r["masked_over_this"] >= 100, c, c is not None and c >= 100)
        r = pick(rows, case="ragged", dtype=dt, method="kvcache attend (one call)")
        if r:
            c = r.get("cpu_vs_per_row_sdpa")
            add(f"{dt} ragged batch 8: attend / sum of per-row SDPA", r["vs_per_row_sdpa"], "<= 1.2",
                r["vs_per_row_sdpa"] <= 1.2, c, c is not None and c <= 1.2)
        r = pick(rows, case="prefill", dtype=dt, method="kvcache attend")
        if r:
            c = r.get("cpu_vs_sdpa_causal")
            add(f"{dt} prefill 512: attend / SDPA causal (enable_gqa)", r["vs_sdpa_causal"], "<= 1.3",
                r["vs_sdpa_causal"] <= 1.3, c, c is not None and c <= 1.3)
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python benchmarks/bench_attend.py", description=__doc__.splitlines()[0])
    add_common_args(p)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=sorted(DTYPES))
    p.add_argument("--cases", nargs="+", default=["decode", "chunk", "ragged", "prefill", "ring"],
                   choices=list(CASES))
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per case (spread = their range)")
    p.add_argument("--flex", action="store_true", help="also time compiled flex_attention (compiles per shape)")
    p.add_argument("--busy", action="store_true", help="run a spinning process beside the benchmark")
    isa_cap.add_arg(p)
    p.add_argument("--head-dims", type=int, nargs="+", default=[HEAD_DIM],
                   help="head_dims of the decode and chunk cases (issue 22's grid: 64 128 256)")
    p.add_argument("--batches", type=int, nargs="+", default=[1],
                   help="batch sizes of the decode and chunk cases (issue 22's grid: 1 8)")
    p.add_argument("--filled", type=int, nargs="+", default=None,
                   help="filled slots of the decode and chunk cases (default: decode 256 4096 16384, chunk 256 4096)")
    args = p.parse_args(argv)
    if args.device != "cpu":
        p.error("bench_attend.py measures the CPU kernel (--device cpu)")
    if args.quick:
        args.min_time = min(args.min_time, 0.05)
        args.rounds = min(args.rounds, 3)
    return args


@contextlib.contextmanager
def busy_core(on: bool):
    """A spinning child process for the block (the other core busy), or nothing."""
    proc: Optional[subprocess.Popen] = None
    if on:
        proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()


def limit_fraction(r: dict, l2: int) -> Optional[tuple]:
    """The hardware-limit bar issue 22 sets for attend row `r`, as (name, measured, goal): the
    streaming-read fraction for decode where the K/V bytes exceed L2, the GEMM-rate fraction at
    seq 128; None elsewhere."""
    if r["case"] == "decode" and "bw_frac" in r and r["kv_MB"] * 1e6 > l2:
        return ("bw", r["bw_frac"], 0.8)
    if r["case"] == "chunk" and r["seq"] == 128:
        return ("gemm", r["gemm_frac"], 0.6)
    return None


def issue22_targets(rows: List[dict], threads: int) -> List[dict]:
    """Issue 22's bars, from the rows measured at `threads`."""
    out = []
    l2 = l2_bytes()
    for r in rows:
        if r["threads"] != threads or r.get("method") != "kvcache attend" or "vs_best" not in r:
            continue
        name = f"{r['dtype']} {r['case']} " + (f"seq {r['seq']} " if "seq" in r else "") + f"filled {r['filled']}"
        if "batch" in r and (r["batch"], r["head_dim"]) != DEFAULT_SHAPE:
            name += f" batch {r['batch']} head_dim {r['head_dim']}"
        if r["case"] == "decode":
            name += f" cap {r['capacity']}"
        out.append(dict(target=f"{name}: attend / best peer ({r['best_peer']})", goal="<= 0.9",
                        measured=r["vs_best"], met="yes" if r["vs_best"] <= 0.9 else "NO"))
        lim = limit_fraction(r, l2)
        if lim is not None:
            kind, value, goal = lim
            label = "streaming-read fraction" if kind == "bw" else "GEMM-rate fraction"
            roof = f"{r['roof_frac']:.2f} ({r['bound']})" if "roof_frac" in r else ""
            out.append(dict(target=f"{name}: {label}", goal=f">= {goal}", measured=value,
                            met="yes" if value >= goal else "NO", roofline=roof))
    return out


def grid_table(rows: List[dict], threads: int) -> List[dict]:
    """Issue 22's grid at `threads`, one line per (dtype, seq, batch, head_dim) and one column per
    filled length: attend's time over the best peer's, with its streaming-read fraction (decode,
    where the K/V bytes exceed L2) or GEMM-rate fraction (seq 128) in brackets. Decode rows at the
    smallest capacity measured for their filled length."""
    l2 = l2_bytes()
    cells: Dict[tuple, Dict[int, str]] = {}
    seen = set()
    for r in rows:
        if r["threads"] != threads or r.get("method") != "kvcache attend" or "vs_best" not in r:
            continue
        seq = r.get("seq", 1)
        key = (r["dtype"], seq, r["batch"], r["head_dim"])
        if (key, r["filled"]) in seen:  # decode: a larger capacity of the same filled length
            continue
        seen.add((key, r["filled"]))
        lim = limit_fraction(r, l2)
        frac = f" ({lim[0]} {lim[1]:.2f})" if lim is not None else ""
        if lim is not None and lim[0] == "bw" and "roof_frac" in r:
            frac = f" (bw {lim[1]:.2f}; roof {r['roof_frac']:.2f} {r['bound'][:3]})"
        cells.setdefault(key, {})[r["filled"]] = f"{r['vs_best']:.2f}{frac}"
    filleds = sorted({f for c in cells.values() for f in c})
    return [dict(dtype=k[0], seq=k[1], batch=k[2], head_dim=k[3],
                 **{f"filled {f}": c.get(f, "") for f in filleds}) for k, c in cells.items()]


def main(argv=None) -> int:
    args = parse_args(argv)
    env = environment(torch.device("cpu"))
    print(f"## kvcache attend benchmarks: torch {env['torch']}, cpu, default {env['default_threads']} threads, "
          f"{args.rounds} rounds of {args.min_time / args.rounds:.2f} s per method")
    print(f"CPU: {env['cpu_model']}; attend kernel ISA: {env['attend_isa']}; L2 {l2_bytes() // 1024} KiB"
          f"{'; a spinning process beside the benchmark (--busy)' if args.busy else ''}")
    print(f"peer library caps (--isa): {env['peer_caps']}")
    rows: List[dict] = []
    with torch.inference_mode(), busy_core(args.busy):
        for case in args.cases:
            fn, title, cols = CASES[case]
            for t in thread_settings(args.threads):
                with num_threads(t) as actual:
                    r = fn(args, actual)
                rows.extend(r)
                if r:  # crossover has no rows at 1 thread
                    print_table(f"{title}, {actual} thread(s)", r, cols)
    for t in sorted({r["threads"] for r in rows}):
        cols = ["target", "goal", "measured", "met"] + (["cpu_time", "met_cpu"] if t == 1 else [])
        if not targets(rows, t):
            continue
        print_table(f"targets (issue 9), {t} thread(s): measured = ratio of wall-time medians"
                    + ("; cpu_time = ratio of CPU-time medians" if t == 1 else ""), targets(rows, t), cols)
    for t in sorted({r["threads"] for r in rows}):
        tg = issue22_targets(rows, t)
        if tg:
            print_table(f"targets (issue 22), {t} thread(s); roofline: the fraction of the row's lower bound "
                        f"on time it reaches (the larger of the streaming read and its flops at the GEMM "
                        f"rate; which of the two in brackets)", tg,
                        ["target", "goal", "measured", "met", "roofline"])
        grid = grid_table(rows, t)
        if grid:
            print_table(f"issue 22's grid, {t} thread(s): attend / best peer (bars: <= 0.9; bw >= 0.8 "
                        f"where the K/V bytes exceed L2; gemm >= 0.6 at seq 128)", grid, list(grid[0]))
    write_json(args.json, env, args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
