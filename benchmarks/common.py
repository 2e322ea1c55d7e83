"""Shared benchmark helpers: timing with spreads, thread settings, tables, JSON.

Every comparison is timed side by side in one process: the methods of a case
are interleaved over several rounds (so drift on a shared machine hits all
alike), each round is a ``torch.utils.benchmark`` blocked autorange, and a
row reports the median over rounds with the spread (min and max of the round
medians) and the IQR of the fastest round. Cases run at 1 thread and at the
default thread count: on a 2-core machine shared with other work, an OpenMP
region can cost milliseconds, and the 1-thread figure is the stable one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from contextlib import contextmanager
from typing import Callable, Dict, Iterable, List, Optional

import torch
from torch.utils import benchmark

import kvcache
from kvcache.demo import cpu_model  # noqa: F401  (re-exported: the benchmarks import it from here)

import isa_cap  # benchmarks/ is on sys.path: every benchmark imports common from there


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def num_threads(n: int):
    """Runs the block with ``n`` intra-op threads (0: leave the default)."""
    saved = torch.get_num_threads()
    if n > 0:
        torch.set_num_threads(n)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(saved)


def _round(fn: Callable[[], object], device: torch.device, min_run_time: float) -> Dict[str, float]:
    timer = benchmark.Timer(
        stmt="fn(); sync(device)" if device.type == "cuda" else "fn()",
        globals={"fn": fn, "sync": sync, "device": device},
        num_threads=torch.get_num_threads(),
    )
    m = timer.blocked_autorange(min_run_time=min_run_time)
    return {"median_us": m.median * 1e6, "iqr_us": m.iqr * 1e6}


def measure_many(
    fns: Dict[str, Callable[[], object]], device: torch.device, min_time: float, rounds: int = 3
) -> Dict[str, Dict[str, float]]:
    """Median time of one call of each method, in microseconds, with its spread.

    Returns, per method: ``median_us`` (median of the round medians),
    ``min_us`` / ``max_us`` (their range: the spread), ``iqr_us`` (within the
    median round) and ``rounds``.
    """
    for fn in fns.values():  # warm-up: allocator, caches, lazy init
        for _ in range(3):
            fn()
    sync(device)
    samples: Dict[str, List[Dict[str, float]]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(_round(fn, device, min_time / rounds))
    out = {}
    for name, ms in samples.items():
        medians = sorted(m["median_us"] for m in ms)
        mid = sorted(ms, key=lambda m: m["median_us"])[len(ms) // 2]
        out[name] = {
            "median_us": statistics.median(medians),
            "min_us": medians[0],
            "max_us": medians[-1],
            "iqr_us": mid["iqr_us"],
            "rounds": len(ms),
        }
    return out


def cpu_times(fns: Dict[str, Callable[[], object]], min_time: float, rounds: int = 3,
              warmup: bool = True, best: bool = False) -> Dict[str, float]:
    """Per-call CPU time of the calling thread (µs, median over interleaved rounds; with
    ``best``, the fastest round: what the code costs when no other work evicts its caches).

    On a machine shared with other work, wall time at 1 thread includes the
    time the process waits for a core; the thread's CPU time does not. Only
    meaningful when the work runs on the calling thread (1 thread).
    """
    samples: Dict[str, List[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            if warmup:
                fn()
            t0, n = time.thread_time_ns(), 0
            while time.thread_time_ns() - t0 < min_time / rounds * 1e9 or n < (2 if warmup else 1):
                fn()
                n += 1
            samples[name].append((time.thread_time_ns() - t0) / n / 1e3)
    return {k: (min(v) if best else statistics.median(v)) for k, v in samples.items()}


def print_table(title: str, rows: List[dict], cols: List[str]) -> None:
    print(f"\n### {title}\n")
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in cols]
    print("| " + " | ".join(c.ljust(w) for c, w in zip(cols, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(cols, widths)) + " |")


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:,.0f}"
    return "" if v is None else str(v)


def spread(row: dict) -> str:
    """'median (min-max)' of a measured row, for tables."""
    return f"{_fmt(row['median_us'])} ({_fmt(row['min_us'])}-{_fmt(row['max_us'])})"


def attend_isa() -> str:
    """The instruction-set path the CPU attend kernel takes (asked of the loaded library)."""
    fn = getattr(kvcache._C, "attend_cpu_isa", None)
    isa = fn() if fn is not None else "unknown"
    forced = os.environ.get("KVCACHE_ATTEND_ISA")
    return f"{isa} (KVCACHE_ATTEND_ISA={forced})" if forced else isa


def l2_bytes() -> int:
    """Per-core L2 cache size in bytes (sysfs; 512 KiB when unknown)."""
    try:
        for idx in range(8):
            base = f"/sys/devices/system/cpu/cpu0/cache/index{idx}"
            with open(f"{base}/level") as f:
                if f.read().strip() != "2":
                    continue
            with open(f"{base}/size") as f:
                text = f.read().strip()
            mult = {"K": 1024, "M": 1024 * 1024}.get(text[-1], 1)
            return int(text.rstrip("KM")) * mult
    except (OSError, ValueError):
        pass
    return 512 * 1024


def environment(device: torch.device) -> dict:
    """The machine a run measured (saved with its rows: scripts/perf_page.py names its page by it)."""
    return dict(
        cpu_model=cpu_model(),
        logical_cpus=os.cpu_count(),
        attend_isa=attend_isa() if device.type == "cpu" else None,
        peer_caps=isa_cap.describe() if device.type == "cpu" else None,
        torch=torch.__version__,
        device=str(device),
        python=platform.python_version(),
        machine=platform.machine(),
        processor=platform.processor(),
        default_threads=torch.get_num_threads(),
        gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        kvcache_build=kvcache.build_info(),
    )


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 0],
                   help="intra-op thread counts to run every case at (0: the default)")
    p.add_argument("--min-time", type=float, default=0.3, help="seconds of timing per method and shape")
    p.add_argument("--quick", action="store_true", help="fewer shapes, less time (a smoke run)")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")


def thread_settings(values: Iterable[int]) -> List[int]:
    out = []
    for v in values:
        if v not in out:
            out.append(v)
    return out


def write_json(path: Optional[str], env: dict, args: argparse.Namespace, rows: List[dict]) -> None:
    if not path:
        return
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    env = dict(env)
    # The thread counts the rows ran at, 0 (the default) resolved: with the CPU model, the ISA
    # path and the torch version, what a reader needs to compare two runs.
    threads = getattr(args, "threads", None)
    if threads is not None:
        default = env.get("default_threads") or torch.get_num_threads()
        env.setdefault("threads", [t or default for t in thread_settings(threads)])
    env.setdefault("benchmark", os.path.basename(sys.argv[0]))
    env.setdefault("date", time.strftime("%Y-%m-%d"))
    with open(path, "w") as f:
        json.dump(dict(env=env, args=vars(args), rows=rows), f, indent=1)
    print(f"\nresults written to {path}")
