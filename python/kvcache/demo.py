"""Greedy generation with kvcache: ``python -m kvcache.demo``.

Runs the small seeded decoder three ways and prints tokens per second for
each: with the kvcache cache read by :func:`kvcache.attend` (only the filled
slots), with the same cache read by masked scaled-dot-product attention over
the whole buffer (what a static cache usually costs), and with no cache
(recomputing the prefix every step); then whether the logits agree.

``--speculative`` runs batched greedy speculative decoding instead (a draft
made of the target's first layers proposes ``--k`` tokens per row, the target
verifies them in one pass, both caches roll back per row) and compares it
with plain greedy decoding: acceptance rate, tokens/s, identical tokens. With
random weights the draft rarely agrees, so this checks the mechanism, not the
speed; ``examples/hf_speculative.py`` shows the speed-up on a real model.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import kvcache
from kvcache.models import Decoder, greedy_generate
from kvcache.models.speculative import EarlyExitDraft, speculative_generate

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
    p.add_argument("--capacity", type=int, default=4096,
                   help="cache capacity (max_len); the masked-SDPA path reads all of it every step")
    p.add_argument("--speculative", action="store_true", help="speculative decoding vs plain greedy")
    p.add_argument("--k", type=int, default=4, help="draft tokens per round (--speculative)")
    p.add_argument("--draft-layers", type=int, default=None,
                   help="target layers the early-exit draft runs (default: half)")
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
    # disable=None: no bar when stderr is not a terminal (CI logs, pipes)
    return tqdm(total=total, desc=desc, unit="tok", leave=False, disable=True if disable else None, file=sys.stderr)


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


def timed(fn, device):
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def run_speculative(args, config, model, prompt, device) -> int:
    draft_layers = args.draft_layers or max(1, args.layers // 2)
    draft = EarlyExitDraft(model, draft_layers)
    caches = lambda: list(kvcache.init_decoder_kv_caches_from_config(  # noqa: E731
        config, batch_size=args.batch, max_len=args.prompt_len + args.new_tokens,
        dtype=model.embed.weight.dtype, device=device))
    with torch.inference_mode():
        greedy_generate(model, prompt, 2, caches())  # warm-up
        speculative_generate(model, draft, prompt, 2, k=args.k)
        (ref, _), t_greedy = timed(lambda: greedy_generate(model, prompt, args.new_tokens, caches()), device)
        (tokens, stats), t_spec = timed(
            lambda: speculative_generate(model, draft, prompt, args.new_tokens, k=args.k), device)
    generated = args.batch * args.new_tokens
    same = torch.equal(tokens, ref)
    print(f"\nspeculative decoding: early-exit draft ({draft_layers} of {args.layers} layers), k={args.k}")
    print(f"{'run':<26}{'throughput':>16}{'time':>12}")
    print(f"{'plain greedy (target)':<26}{generated / t_greedy:>12,.1f} tok/s{t_greedy:>11.3f}s")
    print(f"{'speculative':<26}{generated / t_spec:>12,.1f} tok/s{t_spec:>11.3f}s")
    print(f"acceptance rate: {stats['acceptance_rate']:.1%} ({stats['accepted']} of {stats['proposed']} "
          f"proposals, {stats['rounds']} rounds); speed-up: {t_greedy / t_spec:.2f}x")
    print(f"tokens identical to plain greedy decoding: {same} -> {'PASS' if same else 'FAIL'}")
    print("(random weights: a check of the mechanism and its exactness, not of speed; the speed-up on a real\n"
          " model: python examples/hf_speculative.py, SmolLM2-135M with prompt-lookup drafts through kvcache.hf)")
    return 0 if same else 1


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA was asked for but is not available", file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype]
    total_len = args.prompt_len + args.new_tokens
    capacity = max(args.capacity, total_len)
    config = kvcache.TransformerConfig(
        num_layers=args.layers,
        num_heads=args.heads,
        d_model=args.d_model,
        max_len=capacity,
        num_kv_heads=args.kv_heads,
    )
    model = Decoder(config, seed=args.seed, dtype=dtype).to(device).eval()
    # The same weights, reading the cache with masked SDPA over the whole buffer.
    sdpa_model = Decoder(config, seed=args.seed, dtype=dtype, attention="sdpa").to(device).eval()
    sdpa_model.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, config.vocab_size, (args.batch, args.prompt_len), generator=g).to(device)
    generated = args.batch * args.new_tokens
    print(
        f"kvcache demo: {args.layers} layers, d_model {args.d_model}, {args.heads} heads / "
        f"{config.num_kv_heads} KV heads, batch {args.batch}, prompt {args.prompt_len}, "
        f"{args.new_tokens} new tokens, cache capacity {capacity}, {args.dtype} on {device} "
        f"(torch {torch.__version__})"
    )
    if args.speculative:
        return run_speculative(args, config, model, prompt, device)

    def caches():
        return list(kvcache.init_decoder_kv_caches_from_config(config, batch_size=args.batch, dtype=dtype,
                                                                device=device))

    def generate(m, desc):
        bar = progress(args.new_tokens, desc, args.no_progress)
        out, t = timed(lambda: greedy_generate(m, prompt, args.new_tokens, caches(),
                                               step_callback=(bar.update if bar else None)), device)
        if bar is not None:
            bar.close()
        return out, t

    with torch.inference_mode():
        # Warm-up, so one-time costs (allocator, kernels) count in no run.
        greedy_generate(model, prompt, 2, caches())
        greedy_generate(sdpa_model, prompt, 2, caches())
        model.forward_no_cache(prompt)
        (tokens, cached_logits), t_cached = generate(model, "kvcache attend")
        (sdpa_tokens, sdpa_logits), t_sdpa = generate(sdpa_model, "masked SDPA")
        bar = progress(args.new_tokens, "no cache", args.no_progress)
        (ref_tokens, ref_logits), t_uncached = timed(lambda: run_uncached(model, prompt, args.new_tokens, bar), device)
        if bar is not None:
            bar.close()

    diff = max((a - b).abs().max().item() for a, b in zip(cached_logits, ref_logits))
    diff_sdpa = max((a - b).abs().max().item() for a, b in zip(sdpa_logits, ref_logits))
    same_tokens = torch.equal(tokens, ref_tokens) and torch.equal(sdpa_tokens, ref_tokens)
    ok = diff <= TOLERANCE[dtype] and diff_sdpa <= TOLERANCE[dtype]
    rows = [
        ("kvcache + attend", t_cached),
        ("kvcache + masked SDPA", t_sdpa),
        ("no cache (recompute)", t_uncached),
    ]
    print()
    print(f"{'run':<24}{'throughput':>16}{'time':>12}")
    for name, t in rows:
        print(f"{name:<24}{generated / t:>12,.1f} tok/s{t:>11.3f}s")
    print(f"speed-up of attend over masked SDPA (capacity {capacity}): {t_sdpa / t_cached:.2f}x; "
          f"over no cache: {t_uncached / t_cached:.2f}x")
    print(
        f"logits check: max |cached - uncached| = {diff:.3g} (attend), {diff_sdpa:.3g} (masked SDPA), "
        f"tolerance {TOLERANCE[dtype]:g} -> {'PASS' if ok else 'FAIL'}; greedy tokens identical: {same_tokens}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
