"""A fixed quick set of 20 attend rows, optionally against another build, interleaved.

``python benchmarks/bench_quickset.py [--against DIR] [--rounds 5] [--json F]``

The regression check for kernel changes (issue 41: "no speed is lost"): decode at 4096 and 16384
filled slots and 128-query chunks over 4096; float32, bfloat16 and int8 caches; contiguous caches
and sliding-window rings; 1 and 2 threads. Geometry: batch 1, 16 query heads over 4 KV heads,
head_dim 128, int8 read by bfloat16 queries. Four rows of grouped decode tasks (every KV head of a
sequence in one task, read slot by slot) in SmolLM2's geometry, as ``bench_paged.py`` builds them:
16 sequences of 512-4096 tokens, 9 query heads over 3 KV heads, head_dim 64, in token-major memory
and in shuffled 16-slot pages (``attend_pages``).

``--against DIR``: the ``python`` folder of another build of kvcache (e.g. the old main, built
with ``git worktree add /tmp/old <rev> && cd /tmp/old && python setup.py build_ext --inplace``).
Each round runs one process per build, alternating which goes first, and each process times all 16
rows (best of two short blocked autoranges per row); a row's figure is the best over rounds (on a
shared machine the least disturbed estimate of a kernel's own time), the median beside it. The
table prints both columns and new/old. Without ``--against`` only this build's column is printed.
Under 10 minutes at the default 5 rounds on a 2-vCPU machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Dict, List

HEADS, KV_HEADS, HEAD_DIM = 16, 4, 128
WINDOW, SINKS = 4096, 4

# (name, layout, dtype, filled, queries, threads): 16 rows.
ROWS = [
    ("decode 4096 fp32", "linear", "float32", 4096, 1, 1),
    ("decode 4096 bf16", "linear", "bfloat16", 4096, 1, 1),
    ("decode 4096 int8", "linear", "int8", 4096, 1, 1),
    ("decode 16384 fp32", "linear", "float32", 16384, 1, 1),
    ("decode 16384 bf16", "linear", "bfloat16", 16384, 1, 1),
    ("decode 16384 int8", "linear", "int8", 16384, 1, 1),
    ("chunk128 4096 fp32", "linear", "float32", 4096, 128, 1),
    ("chunk128 4096 bf16", "linear", "bfloat16", 4096, 128, 1),
    ("chunk128 4096 int8", "linear", "int8", 4096, 128, 1),
    ("ring decode fp32", "ring", "float32", 0, 1, 1),
    ("ring chunk128 bf16", "ring", "bfloat16", 0, 128, 1),
    ("decode 16384 fp32", "linear", "float32", 16384, 1, 2),
    ("decode 16384 bf16", "linear", "bfloat16", 16384, 1, 2),
    ("decode 16384 int8", "linear", "int8", 16384, 1, 2),
    ("chunk128 4096 fp32", "linear", "float32", 4096, 128, 2),
    ("ring decode bf16", "ring", "bfloat16", 0, 1, 2),
    ("token-major fp32", "token_major", "float32", 4096, 1, 1),
    ("paged16 fp32", "paged16", "float32", 4096, 1, 1),
    ("paged16 bf16", "paged16", "bfloat16", 4096, 1, 1),
    ("paged16 bf16", "paged16", "bfloat16", 4096, 1, 2),
]


def _worker(min_time: float) -> None:
    """Times every row with the kvcache on sys.path; prints one JSON line {row index: µs}."""
    import torch
    from torch.utils import benchmark

    import bench_paged
    import kvcache

    out: Dict[str, float] = {"_file": kvcache.__file__}
    caches = {}
    for i, (name, layout, dt, filled, nq, threads) in enumerate(ROWS):
        torch.set_num_threads(threads)
        g = torch.Generator().manual_seed(i)
        qdtype = torch.bfloat16 if dt in ("bfloat16", "int8") else torch.float32
        grouped = layout in ("token_major", "paged16")
        key = ("grouped" if grouped else layout, dt, filled)
        if grouped:  # bench_paged's calls: (contiguous, token_major, paged, sdpa)
            if key not in caches:
                caches[key] = bench_paged.case(16, 9, 3, 64, filled, 16, qdtype)
            fn = caches[key][1 if layout == "token_major" else 2]
        elif key not in caches:
            if layout == "ring":
                cache = kvcache.init_ring_layer_cache(1, KV_HEADS, HEAD_DIM, WINDOW, qdtype, sinks=SINKS,
                                                      max_step=128)
                k = torch.randn(1, KV_HEADS, WINDOW + 1000, HEAD_DIM, generator=g).to(qdtype)
                cache = kvcache.write_ring_layer_cache(cache, k, k * 0.5)  # wrapped
            else:
                kv_dtype = torch.int8 if dt == "int8" else None
                cache = kvcache.init_kv_layer_cache(1, KV_HEADS, HEAD_DIM, filled + 128, qdtype, kv_dtype=kv_dtype)
                k = torch.randn(1, KV_HEADS, filled, HEAD_DIM, generator=g).to(qdtype)
                cache = kvcache.update_kv_layer_cache(cache, k, k * 0.5, 0)
            caches[key] = cache
        if not grouped:
            q = torch.randn(1, HEADS, nq, HEAD_DIM, generator=g).to(qdtype)
            fn = (lambda q=q, c=caches[key]: kvcache.attend(q, c))
        fn()
        t = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=threads)
        out[str(i)] = min(t.blocked_autorange(min_run_time=min_time).median for _ in range(2)) * 1e6
    print(json.dumps(out))


def _run(python_dir: str, min_time: float) -> Dict[str, float]:
    env = dict(os.environ)
    if python_dir:
        env["PYTHONPATH"] = python_dir + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--min-time", str(min_time)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--against", default=None, help="the python/ folder of another kvcache build")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--min-time", type=float, default=0.15, help="seconds per timing of a row")
    p.add_argument("--json", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args.min_time)
        return 0

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import attend_isa, cpu_model  # noqa: E402

    here = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    builds = {"new": here}
    if args.against:
        builds["old"] = os.path.abspath(args.against)
    times: Dict[str, List[Dict[str, float]]] = {b: [] for b in builds}
    t0 = time.time()
    for r in range(args.rounds):
        order = list(builds) if r % 2 == 0 else list(reversed(builds))
        for b in order:
            times[b].append(_run(builds[b], args.min_time))
    files = {b: times[b][0]["_file"] for b in builds}
    print(f"CPU: {cpu_model()} · ISA path: {attend_isa()} · rounds {args.rounds} · {time.time() - t0:.0f} s")
    for b, f in files.items():
        print(f"  {b}: {f}")
    print(f"batch 1, {HEADS} heads / {KV_HEADS} KV heads, head_dim {HEAD_DIM}; ring: window {WINDOW}, "
          f"sinks {SINKS}, wrapped; int8 read by bf16 queries; µs, best over rounds")
    head = f"{'row':<22}{'thr':>4}{'new µs':>11}" + (
        f"{'old µs':>11}{'new/old':>9}{'(medians)':>11}" if "old" in builds else "")
    print(head)
    rows = []
    for i, (name, *_rest) in enumerate(ROWS):
        threads = _rest[-1]
        best = {b: min(t[str(i)] for t in times[b]) for b in builds}
        med = {b: statistics.median(t[str(i)] for t in times[b]) for b in builds}
        line = f"{name:<22}{threads:>4}{best['new']:>11.1f}"
        row = dict(row=name, threads=threads, new_us=best["new"], new_median_us=med["new"])
        if "old" in builds:
            line += f"{best['old']:>11.1f}{best['new'] / best['old']:>9.3f}{med['new'] / med['old']:>11.3f}"
            row.update(old_us=best["old"], old_median_us=med["old"], ratio=best["new"] / best["old"],
                       median_ratio=med["new"] / med["old"])
        print(line)
        rows.append(row)
    if "old" in builds:
        ratios = [r["ratio"] for r in rows]
        print(f"geometric mean new/old: {statistics.geometric_mean(ratios):.3f}; worst {max(ratios):.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(cpu=cpu_model(), isa=attend_isa(), rows=rows, files=files), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
