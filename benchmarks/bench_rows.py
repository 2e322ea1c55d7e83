"""Row operations: select_rows_ (beam reorder) and rollback against what peers do, and speculative decoding.

``python benchmarks/bench_rows.py [--threads 1 0] [--quick] [--json F]``

Cases (each at every ``--threads`` setting, methods interleaved; see common.py):

* reorder: a beam-search reorder of a cache (batch 8, 8 KV heads, head_dim 128,
  float32, capacity 8192, 512 filled slots per row): kvcache's ``select_rows_``
  (copies the filled slots of the rows that move) against ``index_select`` of
  the whole buffers + ``copy_`` back (what Hugging Face's ``reorder_cache`` and
  most static caches do, O(capacity)), and ``index_select`` alone (a new
  buffer, losing the fixed address).
* rollback: dropping per-row token counts (kvcache ``rollback`` + copy into the
  lengths) against a plain ``lengths.sub_(n)`` (no checks).
* speculative: tokens/s of batched greedy speculative decoding (early-exit
  draft) against plain greedy decoding with the same target, and the
  acceptance rate.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
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
from kvcache.models import Decoder, greedy_generate  # noqa: E402
from kvcache.models.speculative import EarlyExitDraft, speculative_generate  # noqa: E402


def case_reorder(args, device, threads) -> List[dict]:
    b, h, d = 8, 8, 128
    out = []
    for cap, filled in ([(8192, 512)] if args.quick else [(8192, 512), (8192, 4096), (2048, 512)]):
        keys = torch.randn(b, h, cap, d, device=device)
        values = torch.randn_like(keys)
        lengths = torch.full((b,), filled, dtype=torch.int32, device=device)
        cache = kvcache.KVLayerCache(keys, values, lengths)
        index = torch.tensor([1, 0, 3, 2, 5, 4, 7, 6], device=device)  # every row moves
        fns = {
            "kvcache select_rows_kv_layer_cache": lambda: kvcache.select_rows_kv_layer_cache(cache, index),
            "torch.ops.kvcache.select_rows_": lambda: torch.ops.kvcache.select_rows_.default(
                keys, values, lengths, index),
            "index_select + copy_ (whole buffers)": lambda: (
                keys.copy_(keys.index_select(0, index)), values.copy_(values.index_select(0, index))),
            "index_select (new buffers)": lambda: (keys.index_select(0, index), values.index_select(0, index)),
        }
        res = measure_many(fns, device, args.min_time, args.rounds)
        ref = res["index_select + copy_ (whole buffers)"]["median_us"]
        for name, m in res.items():
            out.append(dict(case="reorder", threads=threads, capacity=cap, filled=filled, method=name, **m,
                            speedup_vs_index_select_copy=ref / m["median_us"]))
    return out


def case_rollback(args, device, threads) -> List[dict]:
    out = []
    for b in (8, 64):
        lengths = torch.full((b,), 1000, dtype=torch.int32, device=device)
        n = torch.zeros(b, dtype=torch.int32, device=device)  # keeps the lengths steady across calls
        cache = kvcache.KVLayerCache(torch.empty(b, 1, 1, 1, device=device), torch.empty(b, 1, 1, 1, device=device),
                                     lengths)
        fns = {
            "kvcache rollback_kv_layer_cache": lambda: kvcache.rollback_kv_layer_cache(cache, n),
            "torch.ops.kvcache.rollback": lambda: torch.ops.kvcache.rollback.default(lengths, n),
            "lengths.sub_(n) (no checks)": lambda: lengths.sub_(n),
        }
        res = measure_many(fns, device, args.min_time, args.rounds)
        for name, m in res.items():
            out.append(dict(case="rollback", threads=threads, batch=b, method=name, **m))
    return out


def case_speculative(args, device, threads) -> List[dict]:
    cfg = kvcache.TransformerConfig(num_layers=args.spec_layers, num_heads=8, d_model=args.spec_d_model,
                                    max_len=4096, num_kv_heads=2)
    target = Decoder(cfg, seed=0).to(device).eval()
    prompt = torch.randint(0, cfg.vocab_size, (args.spec_batch, 32), generator=torch.Generator().manual_seed(1))
    prompt = prompt.to(device)
    n = args.spec_tokens
    out = []

    def caches():
        return list(kvcache.init_decoder_kv_caches_from_config(cfg, batch_size=args.spec_batch, max_len=32 + n,
                                                                device=device))

    with torch.inference_mode():
        greedy_generate(target, prompt, 2, caches())  # warm-up
        t0 = time.perf_counter()
        ref, _ = greedy_generate(target, prompt, n, caches())
        t_greedy = time.perf_counter() - t0
        out.append(dict(case="speculative", threads=threads, method="plain greedy (target)", k=0, draft_layers=0,
                        tokens_per_s=args.spec_batch * n / t_greedy, acceptance=None, same_tokens=True))
        for draft_layers in sorted({1, args.spec_layers // 2, args.spec_layers - 1}):
            draft = EarlyExitDraft(target, draft_layers)
            for k in (2, 4):
                speculative_generate(target, draft, prompt, 2, k=k)  # warm-up
                t0 = time.perf_counter()
                tokens, stats = speculative_generate(target, draft, prompt, n, k=k)
                t = time.perf_counter() - t0
                out.append(dict(case="speculative", threads=threads, method="speculative (early-exit draft)", k=k,
                                draft_layers=draft_layers, tokens_per_s=args.spec_batch * n / t,
                                acceptance=stats["acceptance_rate"], speedup=t_greedy / t,
                                same_tokens=bool(torch.equal(tokens, ref))))
    return out


CASES = {
    "reorder": (case_reorder, "beam reorder (batch 8, 8 KV heads, head_dim 128, float32), µs",
                ["threads", "capacity", "filled", "method", "median_us", "min_us", "max_us",
                 "speedup_vs_index_select_copy"]),
    "rollback": (case_rollback, "per-row rollback, µs", ["threads", "batch", "method", "median_us", "min_us", "max_us"]),
    "speculative": (case_speculative, "speculative decoding vs plain greedy",
                    ["threads", "method", "draft_layers", "k", "tokens_per_s", "acceptance", "speedup", "same_tokens"]),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/bench_rows.py", description=__doc__.splitlines()[0])
    add_common_args(p)
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--spec-layers", type=int, default=4)
    p.add_argument("--spec-d-model", type=int, default=256)
    p.add_argument("--spec-batch", type=int, default=4)
    p.add_argument("--spec-tokens", type=int, default=64)
    args = p.parse_args(argv)
    if args.quick:
        args.min_time = min(args.min_time, 0.05)
        args.spec_tokens = min(args.spec_tokens, 16)
    device = torch.device(args.device)
    env = environment(device)
    print(f"## kvcache row benchmarks: torch {env['torch']}, {device}, default {env['default_threads']} CPU threads")
    rows: List[dict] = []
    for case in args.cases:
        fn, title, cols = CASES[case]
        for t in thread_settings(args.threads if device.type == "cpu" else [0]):
            with num_threads(t) as actual, torch.inference_mode():
                r = fn(args, device, actual)
            rows.extend(r)
            print_table(f"{title}, {actual} thread(s)", r, cols[1:])
    write_json(args.json, env, args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
