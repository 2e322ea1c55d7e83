"""End to end: greedy decode tokens/s of the package Decoder, attend vs masked SDPA, against cache capacity.

``python benchmarks/bench_e2e.py [--threads 1 0] [--capacities 512 4096 32768] [--plot F.png] [--json F]``

The same model (same seed, same weights) runs with ``attention="kvcache"``
(``kvcache.attend``: reads the filled slots only) and ``attention="sdpa"``
(masked ``F.scaled_dot_product_attention`` over the whole cache buffer, the
usual static-cache way). Both prefill the same prompt (not timed); a timed
call then decodes ``--new-tokens`` tokens greedily from the same position,
so every call rewrites the same slots and the cache content is the same at
every capacity. Only the capacity changes. All capacities and both paths
are measured in one interleaved run (every cache allocated at once: about
2.2 GB per path at capacity 32768 with the default model).

At 1 thread each call is also timed in CPU time of the calling thread
(``cpu_tok_per_s``), which leaves out the waits for a core that wall time
includes on a shared machine.

Default model: 4 layers, d_model 256, 4 heads of 64 with 4 KV heads, MLP
1024, batch 8, prompt 200 + 8 new tokens (at most 208 filled slots). Its
weights are small (1 MB a layer) next to its KV cache (64 KB a token a
layer at batch 8): a model whose decode cost is attention-bound at long
capacity, which is where reading O(capacity) hurts.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kvcache  # noqa: E402
from common import add_common_args, cpu_times, environment, measure_many, num_threads, print_table, thread_settings, write_json  # noqa: E402,E501
from kvcache.models import Decoder  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PATHS = ("kvcache", "sdpa")


def build(args, capacity: int, attention: str):
    cfg = kvcache.TransformerConfig(
        num_layers=args.layers, num_heads=args.heads, d_model=args.d_model, max_len=capacity,
        num_kv_heads=args.kv_heads, d_ff=args.d_ff,
    )
    dtype = DTYPES[args.dtype]
    model = Decoder(cfg, seed=args.seed, dtype=dtype, attention=attention).eval()
    caches = list(kvcache.init_decoder_kv_caches_from_config(cfg, batch_size=args.batch, dtype=dtype))
    return model, caches


def decoder_fn(args, capacity: int, attention: str, prompt: torch.Tensor):
    """A callable that greedily decodes args.new_tokens tokens from position len(prompt)."""
    model, caches = build(args, capacity, attention)
    logits, caches = model(prompt, torch.tensor(0, dtype=torch.int32), caches)
    first = logits[:, -1].argmax(-1)
    start = prompt.shape[1]

    def decode():
        tok, pos, out = first, torch.tensor(start, dtype=torch.int32), []
        for _ in range(args.new_tokens):
            logits, _ = model(tok[:, None], pos, caches)
            tok = logits[:, 0].argmax(-1)
            out.append(tok)
            pos = pos + 1
        return torch.stack(out, 1)

    return decode


def run(args, threads: int) -> List[dict]:
    g = torch.Generator().manual_seed(args.seed + 1)
    prompt = torch.randint(0, 256, (args.batch, args.prompt_len), generator=g)
    # Every (capacity, path) in one interleaved run: the capacity comparison
    # does not ride on load drift between runs.
    fns, same = {}, {}
    for cap in args.capacities:
        for path in PATHS:
            fns[(cap, path)] = decoder_fn(args, cap, path, prompt)
        same[cap] = torch.equal(fns[(cap, "kvcache")](), fns[(cap, "sdpa")]())
    res = measure_many(fns, torch.device("cpu"), args.min_time * len(fns), args.rounds)
    cpu = cpu_times(fns, args.min_time * len(fns), args.rounds, warmup=False) if threads == 1 else {}
    del fns
    tokens = args.batch * args.new_tokens
    rows = []
    for (cap, path), m in res.items():
        rows.append(dict(
            threads=threads, capacity=cap, path=path,
            tok_per_s=tokens / m["median_us"] * 1e6,
            tok_per_s_min=tokens / m["max_us"] * 1e6, tok_per_s_max=tokens / m["min_us"] * 1e6,
            ms_per_step=m["median_us"] / args.new_tokens / 1e3,
            vs_sdpa=res[(cap, "sdpa")]["median_us"] / m["median_us"], same_tokens="yes" if same[cap] else "NO",
            cpu_tok_per_s=tokens / cpu[(cap, path)] * 1e6 if cpu else None,
            cpu_vs_sdpa=cpu[(cap, "sdpa")] / cpu[(cap, path)] if cpu else None,
        ))
    for r in rows:
        base = next(x for x in rows if x["path"] == r["path"] and x["capacity"] == min(args.capacities))
        r["vs_smallest_capacity"] = r["tok_per_s"] / base["tok_per_s"]
        r["spread"] = f"{r['tok_per_s_min']:.0f}-{r['tok_per_s_max']:.0f}"
    return rows


def targets(rows: List[dict], threads: int) -> List[dict]:
    rows = [r for r in rows if r["threads"] == threads]
    out = []
    k = {r["capacity"]: r for r in rows if r["path"] == "kvcache"}

    def add(name, goal, v, ok, c, c_ok):
        out.append(dict(target=name, goal=goal, measured=v, met="yes" if ok else "NO", cpu_time=c,
                        met_cpu=None if c is None else ("yes" if c_ok else "NO")))

    if 4096 in k:
        v, c = k[4096]["vs_sdpa"], k[4096]["cpu_vs_sdpa"]
        add("tokens/s at capacity 4096: kvcache / masked SDPA", ">= 3", v, v >= 3, c, c is not None and c >= 3)
    caps = sorted(k)
    if len(caps) > 1:
        tps = [k[c]["tok_per_s"] for c in caps]
        v = max(tps) / min(tps)
        c = None
        if k[caps[0]]["cpu_tok_per_s"] is not None:
            ctps = [k[x]["cpu_tok_per_s"] for x in caps]
            c = max(ctps) / min(ctps)
        add(f"kvcache tokens/s, max / min over capacities {caps[0]}..{caps[-1]}", "<= 1.1", v, v <= 1.1,
            c, c is not None and c <= 1.1)
    return out


def plot(rows: List[dict], path: str, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    styles = {"kvcache": ("tab:blue", "kvcache.attend (filled slots)"),
              "sdpa": ("tab:red", "masked SDPA (whole buffer)")}
    for threads in sorted({r["threads"] for r in rows}):
        for p in PATHS:
            sel = sorted((r for r in rows if r["threads"] == threads and r["path"] == p), key=lambda r: r["capacity"])
            if not sel:
                continue
            color, label = styles[p]
            y = [r["tok_per_s"] for r in sel]
            err = [[r["tok_per_s"] - r["tok_per_s_min"] for r in sel], [r["tok_per_s_max"] - r["tok_per_s"] for r in sel]]
            ax.errorbar([r["capacity"] for r in sel], y, yerr=err, color=color, marker="o", capsize=3,
                        linestyle="-" if threads == 1 else "--", label=f"{label}, {threads} thread(s)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("cache capacity (slots); filled slots stay <= %d" % (args.prompt_len + args.new_tokens))
    ax.set_ylabel("decode tokens/s (median, min-max)")
    ax.set_title(f"Decoder greedy decode, {args.layers} layers, d_model {args.d_model}, "
                 f"{args.heads}/{args.kv_heads} heads, batch {args.batch}, {args.dtype}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"\nplot written to {path}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python benchmarks/bench_e2e.py", description=__doc__.splitlines()[0])
    add_common_args(p)
    p.add_argument("--capacities", type=int, nargs="+", default=[512, 4096, 32768])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--d-ff", type=int, default=None, help="MLP width (default 4 * d_model)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--plot", default=None, help="write tokens/s vs capacity to this PNG")
    args = p.parse_args(argv)
    if args.device != "cpu":
        p.error("bench_e2e.py measures the CPU path (--device cpu)")
    if args.prompt_len + args.new_tokens > min(args.capacities):
        p.error("prompt-len + new-tokens must fit the smallest capacity")
    if args.quick:
        args.min_time = min(args.min_time, 0.05)
        args.new_tokens = min(args.new_tokens, 4)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    env = environment(torch.device("cpu"))
    print(f"## Decoder greedy decode, kvcache.attend vs masked SDPA: torch {env['torch']}, cpu, "
          f"default {env['default_threads']} threads; {args.layers} layers, d_model {args.d_model}, "
          f"{args.heads} heads / {args.kv_heads} KV heads, batch {args.batch}, {args.dtype}, "
          f"prompt {args.prompt_len}, {args.new_tokens} tokens per timed call")
    rows: List[dict] = []
    cols = ["capacity", "path", "tok_per_s", "spread", "ms_per_step", "vs_sdpa", "vs_smallest_capacity",
            "cpu_tok_per_s", "cpu_vs_sdpa", "same_tokens"]
    with torch.inference_mode():
        for t in thread_settings(args.threads):
            with num_threads(t) as actual:
                r = run(args, actual)
            rows.extend(r)
            print_table(f"tokens/s (median, min-max over rounds), {actual} thread(s)", r, cols)
    for t in sorted({r["threads"] for r in rows}):
        cols = ["target", "goal", "measured", "met"] + (["cpu_time", "met_cpu"] if t == 1 else [])
        print_table(f"targets (issue 9), {t} thread(s): measured = wall-time medians"
                    + ("; cpu_time = CPU-time medians" if t == 1 else ""), targets(rows, t), cols)
    write_json(args.json, env, args, rows)
    if args.plot:
        plot(rows, args.plot, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
