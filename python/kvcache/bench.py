"""Benchmarks of kvcache against the usual ways to update a KV cache.

``python -m kvcache.bench [--device cpu|cuda] [--quick] [--json FILE] [--plot FILE.png]``

Every comparison is measured side by side in one run with
``torch.utils.benchmark`` (warm-up, repeated blocks, median and IQR) and
printed as a table; the figures also go to JSON. Cases:

* decode: one-token update latency: the public API, ``torch.ops.kvcache``,
  two ``index_copy_`` calls (Hugging Face StaticCache), two slice ``copy_``
  calls, ``index_put_`` (gpt-fast), and clone-then-write (a literal port of
  the JAX functional update); on CUDA also the update replayed from a CUDA
  graph.
* prefill: write bandwidth of a chunk against one contiguous ``copy_`` of the
  same bytes (the memory-bandwidth limit).
* scaling: decode update time as ``max_len`` grows, beside the functional port.
* e2e: decode tokens/s of the small decoder with kvcache against the same
  model with an ``index_copy_`` cache.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from contextlib import contextmanager
from typing import Callable, Dict, List

import torch
from torch.utils import benchmark

import kvcache
from kvcache import cache as cache_mod
from kvcache.models import decoder as decoder_mod
from kvcache.demo import sync
from kvcache.models import Decoder, greedy_generate

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# ---------------------------------------------------------------- timing ---


def measure(fn: Callable[[], object], device: torch.device, min_run_time: float) -> Dict[str, float]:
    """Median and IQR of one call, in microseconds."""
    for _ in range(20):  # warm-up
        fn()
    sync(device)
    timer = benchmark.Timer(
        stmt="fn(); sync(device)" if device.type == "cuda" else "fn()",
        globals={"fn": fn, "sync": sync, "device": device},
        num_threads=torch.get_num_threads(),
    )
    m = timer.blocked_autorange(min_run_time=min_run_time)
    return {"median_us": m.median * 1e6, "iqr_us": m.iqr * 1e6, "runs": len(m.times)}


def measure_many(fns: Dict[str, Callable[[], object]], device, min_run_time, rounds=3):
    """Interleaves the methods over a few rounds so drift hits all alike."""
    samples: Dict[str, List[Dict[str, float]]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(measure(fn, device, min_run_time / rounds))
    out = {}
    for name, ms in samples.items():
        best = sorted(ms, key=lambda m: m["median_us"])[len(ms) // 2]
        out[name] = best
    return out


# --------------------------------------------------------- the contenders ---


def decode_methods(b, h, d, max_len, dtype, device, pos=100):
    keys = torch.zeros(b, h, max_len, d, dtype=dtype, device=device)
    values = torch.zeros_like(keys)
    k = torch.randn(b, h, 1, d, device=device).to(dtype)
    v = torch.randn(b, h, 1, d, device=device).to(dtype)
    cache = kvcache.KVLayerCache(keys, values, torch.zeros((), dtype=torch.int32, device=device))
    pos_t = torch.tensor([pos], device=device)
    pos_0d = torch.tensor(pos, device=device)
    update, update_at = torch.ops.kvcache.update_.default, torch.ops.kvcache.update_.Tensor

    def index_put():
        keys[:, :, pos_t] = k
        values[:, :, pos_t] = v

    def functional():
        nk = keys.clone()
        nv = values.clone()
        nk[:, :, pos : pos + 1] = k
        nv[:, :, pos : pos + 1] = v
        return nk, nv

    return {
        "kvcache API (int pos)": lambda: kvcache.update_kv_layer_cache(cache, k, v, pos),
        "kvcache API (tensor pos)": lambda: kvcache.update_kv_layer_cache(cache, k, v, pos_0d),
        "torch.ops.kvcache.update_": lambda: update(keys, values, k, v, pos),
        "torch.ops.kvcache.update_.Tensor": lambda: update_at(keys, values, k, v, pos_0d),
        "2x index_copy_ (HF)": lambda: (keys.index_copy_(2, pos_t, k), values.index_copy_(2, pos_t, v)),
        "2x slice copy_": lambda: (keys[:, :, pos : pos + 1].copy_(k), values[:, :, pos : pos + 1].copy_(v)),
        "index_put_ (gpt-fast)": index_put,
        "clone+write (JAX port)": functional,
    }


def cuda_graph_method(b, h, d, max_len, dtype, device, steps=64):
    """update_at_ captured in a CUDA graph, `steps` updates per replay, the position advancing."""
    keys = torch.zeros(b, h, max_len, d, dtype=dtype, device=device)
    values = torch.zeros_like(keys)
    k = torch.randn(b, h, 1, d, device=device).to(dtype)
    v = torch.randn(b, h, 1, d, device=device).to(dtype)
    pos = torch.zeros((), dtype=torch.int64, device=device)
    op = torch.ops.kvcache.update_.Tensor
    s = torch.cuda.Stream(device)
    s.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(s):
        op(keys, values, k, v, pos)
    torch.cuda.current_stream(device).wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(steps):
            op(keys, values, k, v, pos)
            pos.add_(1)
    pos.zero_()

    def replay():
        pos.zero_()
        graph.replay()

    return replay, steps


# ------------------------------------------------------------------ cases ---


def ratio_row(results, name, ref):
    return results[name]["median_us"] / results[ref]["median_us"]


def case_decode(args, device, rows):
    # (batch, kv_heads, head_dim): grouped KV heads of 8- to 32-head models, and 32 KV heads
    shapes = [(1, 8, 128), (4, 8, 64), (16, 8, 128), (2, 32, 64)] if not args.quick else [(1, 8, 128)]
    out = []
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        for b, h, d in shapes:
            res = measure_many(decode_methods(b, h, d, args.max_len, dtype, device), device, args.min_time)
            if device.type == "cuda":
                replay, steps = cuda_graph_method(b, h, d, args.max_len, dtype, device)
                m = measure(replay, device, args.min_time)
                res["update_at_ in CUDA graph (per update)"] = {
                    k: (val / steps if k != "runs" else val) for k, val in m.items()
                }
            ref = "2x index_copy_ (HF)"
            for name, m in res.items():
                out.append(
                    dict(case="decode", dtype=dtype_name, batch=b, kv_heads=h, head_dim=d,
                         max_len=args.max_len, method=name, **m, vs_index_copy=ratio_row(res, name, ref))
                )
    rows.extend(out)
    return out


def case_prefill(args, device, rows):
    chunks = [128, 512, 4096] if not args.quick else [512]
    b, h, d = 1, 8, 128
    max_len = max(chunks) * 2
    out = []
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        for chunk in chunks:
            keys = torch.zeros(b, h, max_len, d, dtype=dtype, device=device)
            values = torch.zeros_like(keys)
            kn = torch.randn(b, h, chunk, d, device=device).to(dtype)
            vn = torch.randn(b, h, chunk, d, device=device).to(dtype)
            src = torch.cat([kn, vn]).contiguous()
            dst = torch.empty_like(src)
            cache = kvcache.KVLayerCache(keys, values, torch.zeros((), dtype=torch.int32, device=device))
            pos_t = torch.arange(3, 3 + chunk, device=device)
            fns = {
                "kvcache API": lambda: kvcache.update_kv_layer_cache(cache, kn, vn, 3),
                "torch.ops.kvcache.update_": lambda: torch.ops.kvcache.update_.default(keys, values, kn, vn, 3),
                "2x index_copy_ (HF)": lambda: (keys.index_copy_(2, pos_t, kn), values.index_copy_(2, pos_t, vn)),
                "2x slice copy_": lambda: (keys[:, :, 3 : 3 + chunk].copy_(kn), values[:, :, 3 : 3 + chunk].copy_(vn)),
                "contiguous copy_ (limit)": lambda: dst.copy_(src),
            }
            res = measure_many(fns, device, args.min_time)
            nbytes = 2 * kn.numel() * kn.element_size()
            limit = nbytes / res["contiguous copy_ (limit)"]["median_us"]
            for name, m in res.items():
                gbps = nbytes / m["median_us"] / 1e3
                out.append(
                    dict(case="prefill", dtype=dtype_name, batch=b, kv_heads=h, head_dim=d, chunk=chunk,
                         method=name, **m, GB_per_s=gbps, vs_copy_limit=gbps * 1e3 / limit)
                )
    rows.extend(out)
    return out


def case_scaling(args, device, rows):
    lens = [512, 2048, 8192, 32768] if not args.quick else [512, 32768]
    b, h, d = 1, 8, 128
    dtype_name = args.dtypes[0]
    out = []
    for max_len in lens:
        methods = decode_methods(b, h, d, max_len, DTYPES[dtype_name], device)
        keep = ["kvcache API (int pos)", "torch.ops.kvcache.update_", "clone+write (JAX port)"]
        res = measure_many({k: methods[k] for k in keep}, device, args.min_time)
        for name, m in res.items():
            out.append(dict(case="scaling", dtype=dtype_name, batch=b, kv_heads=h, head_dim=d,
                            max_len=max_len, method=name, **m))
    rows.extend(out)
    return out


def index_copy_update(cache, keys_new, values_new, start):
    """The Hugging Face StaticCache way: two index_copy_ calls at arange(start, start+chunk)."""
    chunk = keys_new.shape[2]
    if isinstance(start, torch.Tensor):
        if start.dim() != 0:
            raise ValueError("the index_copy_ baseline needs one start for all rows")
        idx = start + torch.arange(chunk, device=start.device)
    else:
        idx = torch.arange(start, start + chunk, device=cache.keys.device)
    cache.keys.index_copy_(2, idx, keys_new)
    cache.values.index_copy_(2, idx, values_new)
    length = (idx[-1:] + 1).reshape(()).to(torch.int32)
    return cache_mod.KVLayerCache(cache.keys, cache.values, length)


@contextmanager
def patched_update(fn):
    saved = decoder_mod.update_kv_layer_cache
    decoder_mod.update_kv_layer_cache = fn
    try:
        yield
    finally:
        decoder_mod.update_kv_layer_cache = saved


def case_e2e(args, device, rows):
    cfg = kvcache.TransformerConfig(num_layers=args.e2e_layers, num_heads=8, d_model=args.e2e_d_model,
                                    max_len=args.e2e_prompt + args.e2e_tokens, num_kv_heads=2)
    dtype_name = args.dtypes[0]
    dtype = DTYPES[dtype_name]
    model = Decoder(cfg, seed=0, dtype=dtype).to(device).eval()
    prompt = torch.randint(0, cfg.vocab_size, (args.e2e_batch, args.e2e_prompt), generator=torch.Generator().manual_seed(0)).to(device)

    def run(n):
        caches = list(kvcache.init_decoder_kv_caches_from_config(cfg, batch_size=args.e2e_batch, dtype=dtype, device=device))
        sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            # one start for all rows here (the index_copy_ baseline cannot do ragged rows)
            toks, _ = greedy_generate(model, prompt, n, caches, prompt_lengths=None)
        sync(device)
        return time.perf_counter() - t0, toks

    results = {}
    tokens = {}
    for _ in range(args.e2e_repeats):
        for name, fn in (("kvcache", cache_mod.update_kv_layer_cache), ("index_copy_ cache", index_copy_update)):
            with patched_update(fn):
                run(2)
                t, toks = run(args.e2e_tokens)
            results.setdefault(name, []).append(args.e2e_batch * args.e2e_tokens / t)
            tokens[name] = toks
    same = torch.equal(tokens["kvcache"], tokens["index_copy_ cache"])
    out = []
    for name, tps in results.items():
        tps = sorted(tps)
        out.append(dict(case="e2e", dtype=dtype_name, batch=args.e2e_batch, method=name,
                        tokens_per_s=tps[len(tps) // 2], tokens_per_s_all=tps, same_tokens=same))
    rows.extend(out)
    return out


# ------------------------------------------------------------- reporting ---


def print_table(title, rows, cols):
    print(f"\n## {title}\n")
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in cols]
    print("| " + " | ".join(c.ljust(w) for c, w in zip(cols, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(cols, widths)) + " |")


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:,.0f}"
    return "" if v is None else str(v)


def targets(rows):
    """The issue's targets, as measured in this run."""
    lines = []
    dec = [r for r in rows if r["case"] == "decode"]
    if dec:
        ops = max(r["vs_index_copy"] for r in dec if r["method"] == "torch.ops.kvcache.update_")
        api = max(r["vs_index_copy"] for r in dec if r["method"] == "kvcache API (int pos)")
        lines.append(f"decode, torch.ops vs 2x index_copy_ (worst shape): {ops:.2f}x (target <= 1.0x)"
                     f" -> {'met' if ops <= 1.0 else 'MISSED'}")
        lines.append(f"decode, public API vs 2x index_copy_ (worst shape): {api:.2f}x (target <= 1.3x)"
                     f" -> {'met' if api <= 1.3 else 'MISSED'}")
    pre = [r for r in rows if r["case"] == "prefill" and r["method"] == "torch.ops.kvcache.update_"]
    if pre:
        worst = min(r["vs_copy_limit"] for r in pre)
        lines.append(f"prefill, op bandwidth vs contiguous copy_ (worst chunk): {worst:.2f}x (target >= 0.85x)"
                     f" -> {'met' if worst >= 0.85 else 'MISSED'}")
    sc = [r for r in rows if r["case"] == "scaling" and r["method"] == "kvcache API (int pos)"]
    if len(sc) >= 2:
        lo = min(sc, key=lambda r: r["max_len"])
        hi = max(sc, key=lambda r: r["max_len"])
        ratio = hi["median_us"] / lo["median_us"]
        lines.append(f"decode at max_len {hi['max_len']} vs {lo['max_len']}: {ratio:.2f}x (target <= 1.1x)"
                     f" -> {'met' if ratio <= 1.1 else 'MISSED'}")
    e2e = {r["method"]: r for r in rows if r["case"] == "e2e"}
    if len(e2e) == 2:
        ratio = e2e["kvcache"]["tokens_per_s"] / e2e["index_copy_ cache"]["tokens_per_s"]
        lines.append(f"end-to-end decode tokens/s vs index_copy_ cache: {ratio:.2f}x (target >= 1.0x)"
                     f" -> {'met' if ratio >= 1.0 else 'MISSED'}")
    return lines


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    dec = [r for r in rows if r["case"] == "decode"]
    if dec:
        first = (dec[0]["dtype"], dec[0]["batch"], dec[0]["kv_heads"], dec[0]["head_dim"])
        sel = [r for r in dec if (r["dtype"], r["batch"], r["kv_heads"], r["head_dim"]) == first]
        axes[0].barh([r["method"] for r in sel], [r["median_us"] for r in sel], xerr=[r["iqr_us"] for r in sel])
        axes[0].set_xscale("log")
        axes[0].set_xlabel("µs per decode update (median, IQR; log scale)")
        axes[0].set_title(f"decode update, {first[0]}, B={first[1]} H={first[2]} D={first[3]}")
        axes[0].invert_yaxis()
    sc = [r for r in rows if r["case"] == "scaling"]
    for method in sorted({r["method"] for r in sc}):
        pts = sorted((r["max_len"], r["median_us"]) for r in sc if r["method"] == method)
        axes[1].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
    axes[1].set_xscale("log", base=2)
    axes[1].set_yscale("log")
    axes[1].set_xlabel("max_len")
    axes[1].set_ylabel("µs per decode update")
    axes[1].set_title("decode update vs cache capacity")
    axes[1].legend(fontsize=8)
    pre = [r for r in rows if r["case"] == "prefill"]
    if pre:
        dt = pre[0]["dtype"]
        for method in sorted({r["method"] for r in pre}):
            pts = sorted((r["chunk"], r["GB_per_s"]) for r in pre if r["method"] == method and r["dtype"] == dt)
            axes[2].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
        axes[2].set_xscale("log", base=2)
        axes[2].set_xlabel("prefill chunk (tokens)")
        axes[2].set_ylabel("GB/s written (keys + values)")
        axes[2].set_title(f"prefill write bandwidth, {dt}")
        axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"\nplot written to {path}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m kvcache.bench", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=sorted(DTYPES))
    p.add_argument("--cases", nargs="+", default=["decode", "prefill", "scaling", "e2e"],
                   choices=["decode", "prefill", "scaling", "e2e"])
    p.add_argument("--max-len", type=int, default=2048, help="cache capacity for the decode case")
    p.add_argument("--min-time", type=float, default=0.3, help="seconds of timing per method and shape")
    p.add_argument("--e2e-batch", type=int, default=1)
    p.add_argument("--e2e-layers", type=int, default=4)
    p.add_argument("--e2e-d-model", type=int, default=128)
    p.add_argument("--e2e-prompt", type=int, default=64)
    p.add_argument("--e2e-tokens", type=int, default=128)
    p.add_argument("--e2e-repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="fewer shapes and less time (a smoke run)")
    p.add_argument("--json", default=os.path.join("bench-results", "bench.json"))
    p.add_argument("--plot", default=None, help="write a matplotlib figure to this PNG")
    args = p.parse_args(argv)
    if args.quick:
        args.min_time = min(args.min_time, 0.05)
        args.e2e_tokens = min(args.e2e_tokens, 8)
        args.e2e_repeats = 1
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA was asked for but is not available", file=sys.stderr)
        return 2
    env = dict(
        torch=torch.__version__, device=str(device), python=platform.python_version(),
        machine=platform.machine(), cpu_threads=torch.get_num_threads(),
        gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        kvcache_build=kvcache.build_info(),
    )
    print(f"kvcache benchmarks: torch {env['torch']}, {device}"
          f"{' (' + env['gpu'] + ')' if env['gpu'] else ''}, {env['cpu_threads']} CPU threads")
    rows: List[dict] = []
    with torch.inference_mode():
        if "decode" in args.cases:
            r = case_decode(args, device, rows)
            print_table("decode update (chunk 1), µs", r,
                        ["dtype", "batch", "kv_heads", "head_dim", "method", "median_us", "iqr_us", "vs_index_copy"])
        if "prefill" in args.cases:
            r = case_prefill(args, device, rows)
            print_table("prefill write (batch 1, 8 KV heads, head_dim 128)", r,
                        ["dtype", "chunk", "method", "median_us", "GB_per_s", "vs_copy_limit"])
        if "scaling" in args.cases:
            r = case_scaling(args, device, rows)
            print_table("decode update vs max_len, µs", r, ["dtype", "max_len", "method", "median_us", "iqr_us"])
    if "e2e" in args.cases:
        r = case_e2e(args, device, rows)
        print_table(f"end-to-end greedy decode ({args.e2e_layers} layers, d_model {args.e2e_d_model}, 8/2 heads, "
                    f"batch {args.e2e_batch}, {args.e2e_tokens} tokens)", r,
                    ["dtype", "batch", "method", "tokens_per_s", "same_tokens"])
    lines = targets(rows)
    print("\n## targets\n")
    for line in lines:
        print("- " + line)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(dict(env=env, args=vars(args), rows=rows, targets=lines), f, indent=1)
        print(f"\nresults written to {args.json}")
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
