"""Write benchmarks: kvcache's update operators against the usual ways to fill a KV cache.

``python benchmarks/bench_update.py [--device cpu|cuda] [--threads 1 0] [--quick] [--json F] [--plot F.png]``

Cases (each at every ``--threads`` setting, methods interleaved, median and
spread over rounds; see common.py):

* decode: one-token update latency: the public API, ``torch.ops.kvcache``
  (host start, device start, append_), two ``index_copy_`` calls (Hugging
  Face StaticCache), two slice ``copy_`` calls, ``index_put_`` (gpt-fast),
  and clone-then-write (a literal port of the JAX functional update); on CUDA
  also the update replayed from a CUDA graph.
* prefill: write bandwidth of a chunk against one contiguous ``copy_`` of the
  same bytes (the memory-bandwidth limit).
* scaling: decode update time as ``max_len`` grows, beside the functional port.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kvcache  # noqa: E402
from common import (  # noqa: E402
    add_common_args,
    environment,
    measure_many,
    num_threads,
    print_table,
    thread_settings,
    write_json,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# --------------------------------------------------------- the contenders ---


def decode_methods(b, h, d, max_len, dtype, device, pos=100):
    keys = torch.zeros(b, h, max_len, d, dtype=dtype, device=device)
    values = torch.zeros_like(keys)
    k = torch.randn(b, h, 1, d, device=device).to(dtype)
    v = torch.randn(b, h, 1, d, device=device).to(dtype)
    cache = kvcache.KVLayerCache(keys, values, torch.zeros((), dtype=torch.int32, device=device))
    pos_t = torch.tensor([pos], device=device)
    pos_0d = torch.tensor(pos, device=device)
    lengths = torch.full((b,), pos, dtype=torch.int32, device=device)
    update, update_at = torch.ops.kvcache.update_.default, torch.ops.kvcache.update_.Tensor
    append = torch.ops.kvcache.append_.default

    def append_fixed():
        append(keys, values, lengths, k, v)
        lengths.sub_(1)  # stay at the same slot (the sub is timed too)

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
        "torch.ops.kvcache.append_ (+ sub_)": append_fixed,
        "2x index_copy_ (HF)": lambda: (keys.index_copy_(2, pos_t, k), values.index_copy_(2, pos_t, v)),
        "2x slice copy_": lambda: (keys[:, :, pos : pos + 1].copy_(k), values[:, :, pos : pos + 1].copy_(v)),
        "index_put_ (gpt-fast)": index_put,
        "clone+write (JAX port)": functional,
    }


def cuda_graph_method(b, h, d, max_len, dtype, device, steps=64):
    """update_.Tensor captured in a CUDA graph, `steps` updates per replay, the position advancing."""
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


def case_decode(args, device, threads):
    # (batch, kv_heads, head_dim): grouped KV heads of 8- to 32-head models, and 32 KV heads
    shapes = [(1, 8, 128), (4, 8, 64), (16, 8, 128), (2, 32, 64)] if not args.quick else [(1, 8, 128)]
    out = []
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        for b, h, d in shapes:
            fns = decode_methods(b, h, d, args.max_len, dtype, device)
            if device.type == "cuda":
                replay, steps = cuda_graph_method(b, h, d, args.max_len, dtype, device)
                fns["update_.Tensor in a CUDA graph (64 per replay)"] = replay
            res = measure_many(fns, device, args.min_time)
            if device.type == "cuda":
                res["update_.Tensor in a CUDA graph (per update)"] = {
                    k: (v / steps if k.endswith("_us") else v)
                    for k, v in res.pop("update_.Tensor in a CUDA graph (64 per replay)").items()
                }
            ref = "2x index_copy_ (HF)"
            for name, m in res.items():
                out.append(dict(case="decode", threads=threads, dtype=dtype_name, batch=b, kv_heads=h,
                                head_dim=d, max_len=args.max_len, method=name, **m,
                                vs_index_copy=ratio_row(res, name, ref)))
    return out


def case_prefill(args, device, threads):
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
            limit = res["contiguous copy_ (limit)"]["median_us"]
            for name, m in res.items():
                out.append(dict(case="prefill", threads=threads, dtype=dtype_name, batch=b, kv_heads=h,
                                head_dim=d, chunk=chunk, method=name, **m,
                                GB_per_s=nbytes / m["median_us"] / 1e3, vs_copy_limit=limit / m["median_us"]))
    return out


def case_scaling(args, device, threads):
    lens = [512, 2048, 8192, 32768] if not args.quick else [512, 32768]
    b, h, d = 1, 8, 128
    dtype_name = args.dtypes[0]
    out = []
    for max_len in lens:
        methods = decode_methods(b, h, d, max_len, DTYPES[dtype_name], device)
        keep = ["kvcache API (int pos)", "torch.ops.kvcache.update_", "clone+write (JAX port)"]
        res = measure_many({k: methods[k] for k in keep}, device, args.min_time)
        for name, m in res.items():
            out.append(dict(case="scaling", threads=threads, dtype=dtype_name, batch=b, kv_heads=h,
                            head_dim=d, max_len=max_len, method=name, **m))
    return out


CASES = {
    "decode": (case_decode, "decode update (chunk 1), µs",
               ["threads", "dtype", "batch", "kv_heads", "head_dim", "method", "median_us", "min_us", "max_us",
                "vs_index_copy"]),
    "prefill": (case_prefill, "prefill write (batch 1, 8 KV heads, head_dim 128)",
                ["threads", "dtype", "chunk", "method", "median_us", "min_us", "max_us", "GB_per_s",
                 "vs_copy_limit"]),
    "scaling": (case_scaling, "decode update vs max_len, µs",
                ["threads", "dtype", "max_len", "method", "median_us", "min_us", "max_us"]),
}


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    one = [r for r in rows if r["threads"] == 1]
    dec = [r for r in one if r["case"] == "decode"]
    if dec:
        first = (dec[0]["dtype"], dec[0]["batch"], dec[0]["kv_heads"], dec[0]["head_dim"])
        sel = [r for r in dec if (r["dtype"], r["batch"], r["kv_heads"], r["head_dim"]) == first]
        err = [[r["median_us"] - r["min_us"] for r in sel], [r["max_us"] - r["median_us"] for r in sel]]
        axes[0].barh([r["method"] for r in sel], [r["median_us"] for r in sel], xerr=err)
        axes[0].set_xscale("log")
        axes[0].set_xlabel("µs per decode update (median, min-max over rounds; log scale)")
        axes[0].set_title(f"decode update, 1 thread, {first[0]}, B={first[1]} H={first[2]} D={first[3]}")
        axes[0].invert_yaxis()
    sc = [r for r in one if r["case"] == "scaling"]
    for method in sorted({r["method"] for r in sc}):
        pts = sorted((r["max_len"], r["median_us"]) for r in sc if r["method"] == method)
        axes[1].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
    axes[1].set_xscale("log", base=2)
    axes[1].set_yscale("log")
    axes[1].set_xlabel("max_len")
    axes[1].set_ylabel("µs per decode update")
    axes[1].set_title("decode update vs cache capacity, 1 thread")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"\nplot written to {path}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python benchmarks/bench_update.py", description=__doc__.splitlines()[0])
    add_common_args(p)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=sorted(DTYPES))
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--max-len", type=int, default=2048, help="cache capacity for the decode case")
    p.add_argument("--plot", default=None, help="write a matplotlib figure to this PNG")
    args = p.parse_args(argv)
    if args.quick:
        args.min_time = min(args.min_time, 0.05)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA was asked for but is not available", file=sys.stderr)
        return 2
    env = environment(device)
    print(f"## kvcache write benchmarks: torch {env['torch']}, {device}"
          f"{' (' + env['gpu'] + ')' if env['gpu'] else ''}, default {env['default_threads']} CPU threads")
    rows: List[dict] = []
    with torch.inference_mode():
        for case in args.cases:
            fn, title, cols = CASES[case]
            for t in thread_settings(args.threads if device.type == "cpu" else [0]):
                with num_threads(t) as actual:
                    r = fn(args, device, actual)
                rows.extend(r)
                print_table(f"{title}, {r[0]['threads'] if r else actual} thread(s)", r, cols[1:])
    write_json(args.json, env, args, rows)
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
