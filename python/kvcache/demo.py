"""Greedy generation with and without the kvcache cache: ``python -m kvcache.demo``.

Prints tokens per second with the cache, without it (recomputing the whole
prefix every step), the speed-up, and whether the cached and uncached logits
agree.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import kvcache
from kvcache.models import Decoder, greedy_generate

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Cached and uncached runs sum in different orders; these bound the drift.
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.25, torch.float16: 0.05}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvcache.demo", description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def progress(total: int, desc: str, disable: bool):
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is optional
        return None
    return tqdm(total=total, desc=desc, unit="tok", leave=False, disable=disable, file=sys.stderr)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_uncached(model, prompt, new_tokens, bar):
    """Greedy decoding that recomputes the whole prefix for every token."""
    seq = prompt
    out, step_logits = [], []
    for _ in range(new_tokens):
        last = model.forward_no_cache(seq)[:, -1]
        token = last.argmax(-1)
        out.append(token)
        step_logits.append(last)
        seq = torch.cat([seq, token[:, None]], dim=1)
        if bar is not None:
            bar.update(1)
    return torch.stack(out, dim=1), step_logits


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA was asked for but is not available", file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype]
    total_len = args.prompt_len + args.new_tokens
    config = kvcache.TransformerConfig(
        num_layers=args.layers,
        num_heads=args.heads,
        d_model=args.d_model,
        max_len=total_len,
        num_kv_heads=args.kv_heads,
    )
    model = Decoder(config, seed=args.seed, dtype=dtype).to(device).eval()
    g = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, config.vocab_size, (args.batch, args.prompt_len), generator=g).to(device)
    generated = args.batch * args.new_tokens
    print(
        f"kvcache demo: {args.layers} layers, d_model {args.d_model}, {args.heads} heads / "
        f"{config.kv_heads} KV heads, batch {args.batch}, prompt {args.prompt_len}, "
        f"{args.new_tokens} new tokens, {args.dtype} on {device} (torch {torch.__version__})"
    )

    with torch.inference_mode():
        # Warm-up, so one-time costs (allocator, kernels) count in neither run.
        caches = list(kvcache.init_decoder_kv_caches_from_config(config, batch_size=args.batch, dtype=dtype, device=device))
        greedy_generate(model, prompt, 2, caches)
        model.forward_no_cache(prompt)

        caches = list(kvcache.init_decoder_kv_caches_from_config(config, batch_size=args.batch, dtype=dtype, device=device))
        bar = progress(args.new_tokens, "with kvcache", args.no_progress)
        sync(device)
        t0 = time.perf_counter()
        tokens, cached_logits = greedy_generate(
            model, prompt, args.new_tokens, caches, step_callback=(bar.update if bar else None)
        )
        sync(device)
        t_cached = time.perf_counter() - t0
        if bar is not None:
            bar.close()

        bar = progress(args.new_tokens, "no cache", args.no_progress)
        sync(device)
        t0 = time.perf_counter()
        ref_tokens, ref_logits = run_uncached(model, prompt, args.new_tokens, bar)
        sync(device)
        t_uncached = time.perf_counter() - t0
        if bar is not None:
            bar.close()

    diff = max((a - b).abs().max().item() for a, b in zip(cached_logits, ref_logits))
    same_tokens = torch.equal(tokens, ref_tokens)
    ok = diff <= TOLERANCE[dtype]
    rows = [
        ("with kvcache", f"{generated / t_cached:,.1f} tok/s", f"{t_cached:.3f} s"),
        ("no cache (recompute)", f"{generated / t_uncached:,.1f} tok/s", f"{t_uncached:.3f} s"),
    ]
    print()
    print(f"{'run':<22}{'throughput':>16}{'time':>12}")
    for name, tput, t in rows:
        print(f"{name:<22}{tput:>16}{t:>12}")
    print(f"speed-up: {t_uncached / t_cached:.2f}x")
    print(
        f"logits check: max |cached - uncached| = {diff:.3g} (tolerance {TOLERANCE[dtype]:g}) "
        f"-> {'PASS' if ok else 'FAIL'}; greedy tokens identical: {same_tokens}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
