"""Hugging Face generate: StaticCache + sdpa against kvcache.hf.KVCache + kvcache attention.

``python benchmarks/bench_hf.py [--threads 1 0] [--max-cache-lens 1024 4096] [--quick] [--json F]``

Eager greedy ``model.generate`` of a random-weight Llama-style model (4
layers, hidden 512, 8 heads, 2 KV heads, head_dim 64, MLP 1536, vocab 32000 by default), a
16-token prompt, 128 new tokens, at each ``max_cache_len``. The contenders
run interleaved in one process (see common.py: median and min-max over
rounds):

* ``StaticCache + sdpa``: transformers' static cache; each step writes with
  ``index_copy_`` and attends over the whole ``max_cache_len`` buffer
  through a mask.
* ``KVCache + kvcache``: one ``append_`` per layer per step, ``attend``
  reads only the filled slots.
* ``DynamicCache + sdpa`` (reference point): grows by concatenation, reads
  only what it holds, not compileable.

Each timed call resets its cache (``reset()``: O(capacity) zeroing for
StaticCache, O(1) for KVCache) and generates; tokens/s = batch * 128 / time
(``ms_per_step``: one decode step of the whole batch). The
tokens of the three are checked to be identical before timing.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (  # noqa: E402
    add_common_args,
    environment,
    measure_many,
    num_threads,
    print_table,
    thread_settings,
    write_json,
)

try:
    import transformers  # noqa: E402
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache  # noqa: E402

    import kvcache.hf as kh  # noqa: E402
except ImportError as e:  # pragma: no cover
    print(f"bench_hf needs transformers (pip install '.[hf]'): {e}", file=sys.stderr)
    sys.exit(2)


def build_model(args, device):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=512,
        intermediate_size=args.intermediate,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=max(args.max_cache_lens) * 2,
    )
    model = LlamaForCausalLM(cfg).to(device=device, dtype=args.torch_dtype).eval()
    model.generation_config.pad_token_id = 0
    return model


def contenders(model, prompt, max_cache_len, new_tokens):
    cfg = model.config
    gen = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    b, dev, dtype = prompt.shape[0], prompt.device, model.dtype
    static = StaticCache(cfg, max_cache_len)
    ours = kh.KVCache(cfg, max_cache_len, batch_size=b, dtype=dtype, device=dev)

    def run(cache, impl):
        def fn():
            model.set_attn_implementation(impl)
            if cache is None:
                return model.generate(prompt, **gen)
            cache.reset()
            return model.generate(prompt, **{kh.CACHE_ARG: cache}, **gen)

        return fn

    return {
        "StaticCache + sdpa": run(static, "sdpa"),
        "KVCache + kvcache": run(ours, "kvcache"),
        "DynamicCache + sdpa": run(None, "sdpa"),
    }


def case_generate(args, device, threads):
    model = build_model(args, device)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, args.vocab, (args.batch, args.prompt_len), generator=g).to(device)
    out = []
    for max_cache_len in args.max_cache_lens:
        fns = contenders(model, prompt, max_cache_len, args.new_tokens)
        outs = {k: fn() for k, fn in fns.items()}
        ref = outs["StaticCache + sdpa"]
        same = {k: bool(torch.equal(v, ref)) for k, v in outs.items()}
        res = measure_many(fns, device, args.min_time, rounds=args.rounds)
        base = res["StaticCache + sdpa"]["median_us"]
        toks = args.batch * args.new_tokens  # generated tokens per call, all rows
        for name, m in res.items():
            out.append(dict(
                threads=threads, max_cache_len=max_cache_len, method=name,
                tokens_per_s=toks / (m["median_us"] / 1e6),
                tps_min=toks / (m["max_us"] / 1e6), tps_max=toks / (m["min_us"] / 1e6),
                ms_per_step=m["median_us"] / 1e3 / args.new_tokens,
                speedup_vs_static=base / m["median_us"], same_tokens=same[name], **m,
            ))
    return out


COLS = ["max_cache_len", "method", "tokens_per_s", "tps_min", "tps_max", "ms_per_step", "speedup_vs_static",
        "same_tokens"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python benchmarks/bench_hf.py", description=__doc__.splitlines()[0])
    add_common_args(p)
    p.add_argument("--max-cache-lens", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--intermediate", type=int, default=1536, help="MLP width")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per case (spread = min-max over them)")
    p.set_defaults(min_time=10.0)
    args = p.parse_args(argv)
    args.torch_dtype = getattr(torch, args.dtype)
    if args.quick:
        args.min_time, args.rounds, args.new_tokens = 0.5, 2, min(args.new_tokens, 32)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA was asked for but is not available", file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore", category=FutureWarning)
    env = environment(device)
    env["transformers"] = transformers.__version__
    print(f"## Hugging Face generate: torch {env['torch']}, transformers {env['transformers']}, {device}, "
          f"default {env['default_threads']} CPU threads; Llama 4 layers, hidden 512, 8 heads, 2 KV heads, "
          f"MLP {args.intermediate}, vocab {args.vocab}, {args.dtype}, batch {args.batch}, prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens, greedy, eager")
    rows: List[dict] = []
    for t in thread_settings(args.threads if device.type == "cpu" else [0]):
        with num_threads(t) as actual:
            r = case_generate(args, device, actual)
        rows.extend(r)
        print_table(f"greedy decode tokens/s (median, min-max over {args.rounds} rounds), {actual} thread(s)", r, COLS)
    args.torch_dtype = str(args.torch_dtype)
    write_json(args.json, env, args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
