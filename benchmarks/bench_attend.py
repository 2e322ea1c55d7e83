"""Attention benchmarks: kvcache.attend against scaled-dot-product attention over a KV cache.

``python benchmarks/bench_attend.py [--threads 1 0] [--cases decode ragged prefill] [--quick] [--json F]``

Shapes: 32 query heads / 8 KV heads (grouped-query attention, group 4),
head_dim 128, float32 and bfloat16. Each case runs at every ``--threads``
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
* ragged (batch 8, one query per row, lengths spread geometrically from 64
  to 4096, capacity 4096): one attend call against the sum of 8 per-row
  "SDPA prefix view" calls (each row's own prefix, timed as one loop), and
  masked SDPA over the whole buffer.
* prefill (seq 512 from an empty cache of capacity 4096): attend against
  ``F.scaled_dot_product_attention(is_causal=True)`` on the same tensors
  (q and the 512-slot prefix views, ``enable_gqa=True``), and against SDPA on
  keys/values already expanded to 32 heads (the expansion not timed).

At 1 thread each method is also timed in CPU time of the calling thread
(``cpu_us``): on a machine shared with other work, wall time includes the
waits for a core, CPU time does not. The last tables check the targets of
issue 9 on both.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kvcache  # noqa: E402
from common import (  # noqa: E402
    cpu_times,
    add_common_args,
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
ATTEND = torch.ops.kvcache.attend.default


def make_cache(b, capacity, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(b, KV_HEADS, capacity, HEAD_DIM, generator=g).to(dtype)
    values = torch.randn(b, KV_HEADS, capacity, HEAD_DIM, generator=g).to(dtype)
    return keys, values


def sdpa_prefix(q, keys, values, filled):
    """SDPA on the filled prefix (a view), the query group folded into the query axis."""
    b, h, s, d = q.shape
    qg = q.reshape(b, KV_HEADS, (h // KV_HEADS) * s, d)
    out = F.scaled_dot_product_attention(qg, keys[:, :, :filled], values[:, :, :filled])
    return out.reshape(b, h, s, d)


def decode_methods(filled, capacity, dtype):
    keys, values = make_cache(1, capacity, dtype)
    q = torch.randn(1, HEADS, 1, HEAD_DIM).to(dtype)
    lengths = torch.tensor([filled], dtype=torch.int32)
    positions = torch.tensor([[filled - 1]])
    return {
        "kvcache attend": lambda: ATTEND(q, keys, values, lengths),
        "SDPA prefix view": lambda: sdpa_prefix(q, keys, values, filled),
        "masked SDPA, whole buffer": lambda: grouped_attention(q, keys, values, positions),
    }


def ratio(res, a, b, key="median_us"):
    return res[a][key] / res[b][key]


def measure(fns: Dict, args, threads: int, scale: float = 1.0) -> Dict:
    """Wall time (common.measure_many) and, at 1 thread, CPU time (cpu_us)."""
    res = measure_many(fns, torch.device("cpu"), args.min_time * scale, args.rounds)
    cpu = cpu_times(fns, args.min_time * scale, args.rounds) if threads == 1 else {}
    for k, m in res.items():
        m["cpu_us"] = cpu.get(k)
    return res


def case_decode(args, threads):
    # Every capacity of one filled length is measured in one interleaved
    # run, so the capacity comparison does not ride on drift between runs.
    filled_caps = {256: [512, 4096, 32768], 4096: [4096, 32768]}
    if args.quick:
        filled_caps = {256: [512, 32768]}
    out = []
    for dtype_name in args.dtypes:
        for filled, caps in filled_caps.items():
            fns = {}
            for cap in caps:
                for name, fn in decode_methods(filled, cap, DTYPES[dtype_name]).items():
                    fns[(cap, name)] = fn
            res = measure(fns, args, threads, len(caps))
            for cap in caps:
                r = {name: m for (c, name), m in res.items() if c == cap}
                for name, m in r.items():
                    row = dict(case="decode", threads=threads, dtype=dtype_name, filled=filled, capacity=cap,
                               method=name, **m,
                               vs_prefix_sdpa=ratio(r, name, "SDPA prefix view"),
                               masked_over_this=ratio(r, "masked SDPA, whole buffer", name))
                    if threads == 1:
                        row["cpu_vs_prefix_sdpa"] = ratio(r, name, "SDPA prefix view", "cpu_us")
                        row["cpu_masked_over_this"] = ratio(r, "masked SDPA, whole buffer", name, "cpu_us")
                    out.append(row)
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
    "decode": (case_decode, "decode, batch 1, 32/8 heads, head_dim 128, µs",
               ["dtype", "filled", "capacity", "method", "median_us", "min_us", "max_us", "cpu_us",
                "vs_prefix_sdpa", "cpu_vs_prefix_sdpa", "masked_over_this"]),
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
               if r["case"] == "decode" and r["dtype"] == dt and r["method"] == "kvcache attend"}
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
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per case (spread = their range)")
    args = p.parse_args(argv)
    if args.device != "cpu":
        p.error("bench_attend.py measures the CPU kernel (--device cpu)")
    if args.quick:
        args.min_time = min(args.min_time, 0.05)
        args.rounds = min(args.rounds, 3)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    env = environment(torch.device("cpu"))
    print(f"## kvcache attend benchmarks: torch {env['torch']}, cpu, default {env['default_threads']} threads, "
          f"{args.rounds} rounds of {args.min_time / args.rounds:.2f} s per method")
    rows: List[dict] = []
    with torch.inference_mode():
        for case in args.cases:
            fn, title, cols = CASES[case]
            for t in thread_settings(args.threads):
                with num_threads(t) as actual:
                    r = fn(args, actual)
                rows.extend(r)
                print_table(f"{title}, {actual} thread(s)", r, cols)
    for t in sorted({r["threads"] for r in rows}):
        cols = ["target", "goal", "measured", "met"] + (["cpu_time", "met_cpu"] if t == 1 else [])
        print_table(f"targets (issue 9), {t} thread(s): measured = ratio of wall-time medians"
                    + ("; cpu_time = ratio of CPU-time medians" if t == 1 else ""), targets(rows, t), cols)
    write_json(args.json, env, args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
