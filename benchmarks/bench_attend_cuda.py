"""attend on CUDA against PyTorch's scaled_dot_product_attention (SDPA).

``python benchmarks/bench_attend_cuda.py [--quick] [--min-time S] [--json F]``

Cases (methods interleaved, median and spread over rounds; see common.py):

* decode: one query per row (32 query heads, 8 KV heads, head_dim 128), filled
  256 and 4096 slots, capacity 512 / 4096 / 32768: ``kvcache.attend`` (and the
  same call replayed from a CUDA graph: no launch overhead), SDPA on the exact
  prefix view (what a caller who knows the length on the host can do), and
  masked SDPA over the whole buffer (what a static cache without lengths does).
  ``GB/s`` is the K/V bytes of the filled slots over attend's time, against the
  device-to-device copy bandwidth measured in the same run.
* ragged: batch 8, lengths spread from 64 to 4096, against the sum of per-row
  prefix SDPA calls.
* prefill: seq 512 from an empty cache, against SDPA with ``is_causal=True``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kvcache  # noqa: E402
from common import environment, measure_many, print_table, spread, write_json  # noqa: E402

ATTEND = torch.ops.kvcache.attend.default
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def sdpa(q, k, v, **kw):
    """SDPA with grouped KV heads repeated to the query heads (works on every torch)."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, 1)
        v = v.repeat_interleave(group, 1)
    return F.scaled_dot_product_attention(q, k, v, **kw)


def graphed(fn, device):
    s = torch.cuda.Stream(device)
    s.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream(device).wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def copy_bandwidth(device, nbytes=1 << 30):
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    res = measure_many({"copy": lambda: dst.copy_(src)}, device, 0.2)
    return 2 * nbytes / (res["copy"]["median_us"] * 1e-6) / 1e9  # read + write


def case_decode(args, device, dtype_name, copy_gbs):
    dtype = DTYPES[dtype_name]
    b, h, kvh, d = 1, 32, 8, 128
    rows = []
    for filled in (256, 4096):
        for cap in (512, 4096, 32768) if not args.quick else (4096, 32768):
            if cap < filled:
                continue
            g = torch.Generator(device=device).manual_seed(0)
            keys = torch.randn(b, kvh, cap, d, device=device, generator=g).to(dtype)
            values = torch.randn(b, kvh, cap, d, device=device, generator=g).to(dtype)
            q = torch.randn(b, h, 1, d, device=device, generator=g).to(dtype)
            lengths = torch.full((b,), filled, dtype=torch.int32, device=device)
            mask = (torch.arange(cap, device=device) < filled)[None, None, None, :]
            fns = {
                "kvcache.attend": lambda: ATTEND(q, keys, values, lengths),
                "SDPA, prefix view": lambda: sdpa(q, keys[:, :, :filled], values[:, :, :filled]),
                "SDPA, masked buffer": lambda: sdpa(q, keys, values, attn_mask=mask),
            }
            fns["kvcache.attend, CUDA graph"] = graphed(fns["kvcache.attend"], device)
            res = measure_many(fns, device, args.min_time)
            kv_bytes = 2 * b * kvh * filled * d * keys.element_size()
            ref = res["SDPA, prefix view"]["median_us"]
            for name, m in res.items():
                row = dict(case="decode", dtype=dtype_name, filled=filled, capacity=cap, method=name,
                           time_us=spread(m), **m, vs_prefix_sdpa=m["median_us"] / ref)
                if name.startswith("kvcache"):
                    gbs = kv_bytes / (m["median_us"] * 1e-6) / 1e9
                    row.update(gb_s=gbs, of_copy_bw=gbs / copy_gbs)
                rows.append(row)
    return rows


def case_ragged(args, device, dtype_name):
    dtype = DTYPES[dtype_name]
    b, h, kvh, d, cap = 8, 32, 8, 128, 4096
    lens = [64, 128, 256, 512, 1024, 2048, 3072, 4096]
    g = torch.Generator(device=device).manual_seed(1)
    keys = torch.randn(b, kvh, cap, d, device=device, generator=g).to(dtype)
    values = torch.randn(b, kvh, cap, d, device=device, generator=g).to(dtype)
    q = torch.randn(b, h, 1, d, device=device, generator=g).to(dtype)
    lengths = torch.tensor(lens, dtype=torch.int32, device=device)

    def per_row():
        for r, n in enumerate(lens):
            sdpa(q[r : r + 1], keys[r : r + 1, :, :n], values[r : r + 1, :, :n])

    fns = {"kvcache.attend": lambda: ATTEND(q, keys, values, lengths), "per-row prefix SDPA (sum)": per_row}
    fns["kvcache.attend, CUDA graph"] = graphed(fns["kvcache.attend"], device)
    fns["per-row prefix SDPA, CUDA graph"] = graphed(per_row, device)
    res = measure_many(fns, device, args.min_time)
    ref = res["per-row prefix SDPA (sum)"]["median_us"]
    return [dict(case="ragged", dtype=dtype_name, method=n, time_us=spread(m), **m, vs_ref=m["median_us"] / ref)
            for n, m in res.items()]


def case_prefill(args, device, dtype_name):
    dtype = DTYPES[dtype_name]
    b, h, kvh, d, s = 1, 32, 8, 128, 512
    g = torch.Generator(device=device).manual_seed(2)
    keys = torch.randn(b, kvh, s, d, device=device, generator=g).to(dtype)
    values = torch.randn(b, kvh, s, d, device=device, generator=g).to(dtype)
    q = torch.randn(b, h, s, d, device=device, generator=g).to(dtype)
    lengths = torch.full((b,), s, dtype=torch.int32, device=device)
    fns = {
        "kvcache.attend": lambda: ATTEND(q, keys, values, lengths),
        "SDPA is_causal": lambda: sdpa(q, keys, values, is_causal=True),
    }
    res = measure_many(fns, device, args.min_time)
    ref = res["SDPA is_causal"]["median_us"]
    return [dict(case="prefill", dtype=dtype_name, seq=s, method=n, time_us=spread(m), **m, vs_ref=m["median_us"] / ref)
            for n, m in res.items()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--min-time", type=float, default=0.3, help="seconds of timing per method and shape")
    p.add_argument("--quick", action="store_true", help="fewer shapes, less time")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=sorted(DTYPES))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attend_cuda: no CUDA device", file=sys.stderr)
        return 1
    device = torch.device("cuda")
    env = environment(device)
    print(env)
    copy_gbs = copy_bandwidth(device)
    print(f"device-to-device copy: {copy_gbs:,.0f} GB/s (read + write)")
    rows = []
    for dtype_name in args.dtypes:
        with torch.no_grad():
            dec = case_decode(args, device, dtype_name, copy_gbs)
            print_table(f"decode, {dtype_name}, B=1, 32/8 heads, head_dim 128 (us)", dec,
                        ["filled", "capacity", "method", "time_us", "vs_prefix_sdpa", "gb_s", "of_copy_bw"])
            rag = case_ragged(args, device, dtype_name)
            print_table(f"ragged batch 8, {dtype_name} (us)", rag, ["method", "time_us", "vs_ref"])
            pre = case_prefill(args, device, dtype_name)
            print_table(f"prefill seq 512, {dtype_name} (us)", pre, ["method", "time_us", "vs_ref"])
        rows += dec + rag + pre
    write_json(args.json, dict(env, copy_gb_s=copy_gbs), args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
