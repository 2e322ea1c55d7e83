"""Ring caches: a decode step (write + attend) at window 4096 against transformers'
StaticSlidingWindowLayer.update + SDPA, and the ring's decode step from context 1k to 32k.

``python benchmarks/bench_ring.py [--threads 1 0] [--quick] [--json F]``

Shapes: batch 1, 8 query heads / 2 KV heads, head_dim 128, float32, window 4096, one query per
step (decode), the ring full (wrapped).

* step: ``kvcache.write_ring_layer_cache`` + ``kvcache.attend`` (two ops; O(capacity) = O(window +
  63)) against ``StaticSlidingWindowLayer.update`` (full: a ``roll`` of the whole window, keys and
  values, then a copy back) + ``F.scaled_dot_product_attention(enable_gqa=True)`` over the
  returned window (one query: no mask). Both caches hold the last 4096 tokens.
* flat: the ring's step at logical context lengths 1k .. 32k (a prompt of that length written
  through the long-chunk path first): the cost must not grow with the context.
* quantized write: an int8 ring's write of a chunk (1, 64, 8192 tokens, bfloat16 new data) by
  ``ring_update_`` with the ring's scales (one call) against the former three-call path
  (``update_`` with scales into a chunk-sized staging buffer, then ``ring_update_`` for the data
  and for the scales).

Every case is timed interleaved over rounds (median, min-max spread of round medians; see
common.py), at each ``--threads`` setting. The CPU model and the attend kernel's ISA are printed.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kvcache  # noqa: E402
from common import (  # noqa: E402
    add_common_args,
    attend_isa,
    cpu_model,
    environment,
    measure_many,
    num_threads,
    print_table,
    spread,
    thread_settings,
    write_json,
)

HEADS, KV_HEADS, D, WINDOW = 8, 2, 128, 4096


def full_ring(context: int, g: torch.Generator):
    ring = kvcache.init_ring_layer_cache(1, KV_HEADS, D, WINDOW, torch.float32)
    k = torch.randn(1, KV_HEADS, context, D, generator=g)
    kvcache.write_ring_layer_cache(ring, k, k * 0.5)
    return ring


def hf_layer(g: torch.Generator):
    from transformers.cache_utils import StaticSlidingWindowLayer

    layer = StaticSlidingWindowLayer(max_cache_len=32768, sliding_window=WINDOW)
    k = torch.randn(1, KV_HEADS, WINDOW, D, generator=g)
    layer.update(k, k * 0.5)  # full: the next updates take the roll path
    return layer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(p)
    args = p.parse_args()
    env = environment(torch.device("cpu"))
    env.update(cpu_model=cpu_model(), attend_isa=attend_isa())
    print(f"CPU: {env['cpu_model']}; attend kernel ISA: {env['attend_isa']}; torch {torch.__version__}")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, HEADS, 1, D, generator=g)
    kn = torch.randn(1, KV_HEADS, 1, D, generator=g)
    vn = torch.randn(1, KV_HEADS, 1, D, generator=g)
    rows = []
    contexts = [1024, 4096, 8192, 16384, 32768] if not args.quick else [1024, 4096, 32768]
    for threads in thread_settings(args.threads):
        with num_threads(threads) as n:
            ring = full_ring(WINDOW + 1000, g)
            layer = hf_layer(g)

            def ring_step(ring=ring):
                # At a fixed start (a device tensor): every call rewrites the same
                # position of a full ring, the cost of a decode step.
                kv = kvcache.write_ring_layer_cache(ring, kn, vn, ring.length)
                return kvcache.attend(q, kv)

            def hf_step():
                k, v = layer.update(kn, vn)
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

            # The two agree (same window content up to the order of the slots).
            m = measure_many({"ring": ring_step, "hf": hf_step}, torch.device("cpu"), args.min_time)
            rows.append(dict(case="step, window 4096", threads=n, method="kvcache ring write + attend",
                             us=spread(m["ring"]), median_us=m["ring"]["median_us"]))
            rows.append(dict(case="step, window 4096", threads=n,
                             method="StaticSlidingWindowLayer.update + SDPA", us=spread(m["hf"]),
                             median_us=m["hf"]["median_us"],
                             speedup=f"{m['hf']['median_us'] / m['ring']['median_us']:.1f}x"))
            fns = {}
            for ctx in contexts:
                r = full_ring(ctx, g)

                def step(r=r):
                    kv = kvcache.write_ring_layer_cache(r, kn, vn, r.length)
                    return kvcache.attend(q, kv)

                fns[ctx] = step
            m = measure_many(fns, torch.device("cpu"), args.min_time)
            # Flat from a full window on (at 1k the window is not full yet).
            base = m[4096]["median_us"]
            for ctx in contexts:
                rows.append(dict(case=f"ring decode at context {ctx}", threads=n, method="write + attend",
                                 us=spread(m[ctx]), median_us=m[ctx]["median_us"],
                                 speedup=f"{m[ctx]['median_us'] / base:.2f}x of 4k"))
    qrows = quantized_write_rows(args, g)
    print_table("Quantized ring write (us: median (min-max of round medians))", qrows,
                ["case", "threads", "method", "us", "speedup"])
    rows += qrows
    print_table("Ring decode step (us: median (min-max of round medians))", rows[:len(rows) - len(qrows)],
                ["case", "threads", "method", "us", "speedup"])
    write_json(args.json, env, args, rows)


def quantized_write_rows(args, g: torch.Generator) -> list:
    ops = torch.ops.kvcache
    rows = []
    chunks = [1, 64, 8192] if not args.quick else [1, 8192]
    for threads in thread_settings(args.threads):
        with num_threads(threads) as n:
            ring = kvcache.init_ring_layer_cache(1, KV_HEADS, D, WINDOW, torch.float32, kv_dtype="int8")
            for chunk in chunks:
                kn = torch.randn(1, KV_HEADS, chunk, D, generator=g).bfloat16()
                vn = torch.randn(1, KV_HEADS, chunk, D, generator=g).bfloat16()
                start = torch.tensor(WINDOW + 1000, dtype=torch.int32)  # a full, wrapped ring

                def fused(kn=kn, vn=vn, start=start):
                    return ops.ring_update_(ring.keys, ring.values, ring.positions, kn, vn, start,
                                            sinks=ring.sinks, k_scale=ring.k_scale, v_scale=ring.v_scale)

                def three(kn=kn, vn=vn, start=start):
                    b, h, c, d = kn.shape
                    tk = torch.empty(b, h, c, d, dtype=torch.int8)
                    tv = torch.empty(b, h, c, d, dtype=torch.int8)
                    tks, tvs = torch.empty(b, h, c), torch.empty(b, h, c)
                    ops.update_(tk, tv, kn, vn, 0, k_scale=tks, v_scale=tvs)
                    length = ops.ring_update_(ring.keys, ring.values, ring.positions, tk, tv, start,
                                              sinks=ring.sinks)
                    ops.ring_update_(ring.k_scale.unsqueeze(-1), ring.v_scale.unsqueeze(-1), ring.positions,
                                     tks.unsqueeze(-1), tvs.unsqueeze(-1), start, sinks=ring.sinks)
                    return length

                m = measure_many({"fused": fused, "three": three}, torch.device("cpu"), args.min_time)
                case = f"int8 ring write, chunk {chunk}"
                rows.append(dict(case=case, threads=n, method="ring_update_ with scales (1 call)",
                                 us=spread(m["fused"]), median_us=m["fused"]["median_us"],
                                 speedup=f"{m['three']['median_us'] / m['fused']['median_us']:.2f}x"))
                rows.append(dict(case=case, threads=n, method="staging + 2x ring_update_ (3 calls)",
                                 us=spread(m["three"]), median_us=m["three"]["median_us"]))
    return rows


if __name__ == "__main__":
    main()
