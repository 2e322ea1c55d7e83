"""Greedy generation with kvcache: ``python -m kvcache.demo``.

Runs the small seeded decoder three ways and prints tokens per second for
each: with the kvcache cache read by :func:`kvcache.attend` (only the filled
slots), with the same cache read by masked scaled-dot-product attention over
the whole buffer (what a static cache usually costs), and with no cache
(recomputing the prefix every step); then whether the logits agree.

The methods are timed in interleaved rounds (attend, masked SDPA, no cache,
then again, ``--rounds`` times), and each is reported as its median over the
rounds with the spread (min-max), so a moment when the machine is busy slows
one round of every method instead of flipping the verdict. The header names
the CPU, the thread count (``--threads``) and the attend kernel's
instruction-set path, which the figures depend on.

``--speculative`` runs batched greedy speculative decoding instead (a draft
made of the target's first layers proposes ``--k`` tokens per row, the target
verifies them in one pass, both caches roll back per row) and compares it
with plain greedy decoding: acceptance rate, tokens/s, identical tokens. With
random weights the draft rarely agrees, so this checks the mechanism, not the
speed; ``examples/hf_speculative.py`` shows the speed-up on a real model.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import textwrap
import time
from typing import Callable, Dict, List, Tuple

import torch

import kvcache
from kvcache.models import Decoder, greedy_generate
from kvcache.models.speculative import EarlyExitDraft, speculative_generate

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Cached and uncached runs sum in different orders; these bound the drift.
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.25, torch.float16: 0.05}

WHAT_NEXT = """\
What to try next:
  python examples/hf_generate.py --threads 1   a real model (SmolLM2-135M) through kvcache.hf,
                                               against transformers' StaticCache
  python examples/hf_speculative.py            prompt-lookup speculative decoding on that model
  python -m kvcache.demo --speculative         speculative decoding on the package's own caches
  python -m kvcache.demo --threads 1           steadier figures on a shared machine
  README.md: "Python API" and "Stateful caches, rollback, row selection, reset" (the caches and
  their operations), "Hugging Face transformers" (the one-line switch in generate), "Rings"
  (sliding-window layers), "Quantized caches", "Performance" (measured figures and how)."""


def build_parser() -> argparse.ArgumentParser:
    # scripts/demo.sh --help prints a copy of these flags without starting Python
    # (tests/python/test_demo.py checks that the two name the same flags and defaults).
    p = argparse.ArgumentParser(
        prog="python -m kvcache.demo",
        description="Greedy generation on a small seeded decoder three ways: kvcache.attend, masked SDPA over "
                    "the whole cache, no cache; tokens/s of each (median and spread over interleaved rounds) "
                    "and whether the logits agree.")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (default: %(default)s)")
    p.add_argument("--d-model", type=int, default=256, help="model width (default: %(default)s)")
    p.add_argument("--heads", type=int, default=8, help="query heads (default: %(default)s)")
    p.add_argument("--kv-heads", type=int, default=2,
                   help="key/value heads; fewer than --heads is grouped-query attention (default: %(default)s)")
    p.add_argument("--batch", type=int, default=2, help="sequences decoded together (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per sequence (default: %(default)s)")
    p.add_argument("--new-tokens", type=int, default=128,
                   help="tokens generated per sequence (default: %(default)s)")
    p.add_argument("--capacity", type=int, default=4096,
                   help="cache capacity (max_len); the masked-SDPA path reads all of it every step "
                        "(default: %(default)s)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads (default: 0, torch's default: one per core); "
                        "1 gives steadier figures on a busy machine")
    p.add_argument("--rounds", type=int, default=5,
                   help="interleaved timing rounds: every method runs once per round, and each is "
                        "reported as its median with the min-max over the rounds (default: %(default)s)")
    p.add_argument("--speculative", action="store_true",
                   help="speculative decoding vs plain greedy, instead of the three-way comparison")
    p.add_argument("--k", type=int, default=4,
                   help="with --speculative: draft tokens per round (default: %(default)s)")
    p.add_argument("--draft-layers", type=int, default=None,
                   help="with --speculative: target layers the early-exit draft runs (default: half)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="weights and cache dtype (default: %(default)s)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the random weights and prompt (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.threads < 0:
        p.error("--threads must be >= 0 (0: torch's default)")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    return args


def cpu_model() -> str:
    """The CPU's model name with its family and model numbers (/proc/cpuinfo), else the platform's.

    Virtual machines often report a bare name ("AMD EPYC"), which hides the generation a figure
    belongs to (family 25 is Zen 3/4, 26 is Zen 5; Intel's model numbers name the core), so the
    numbers are appended whenever /proc/cpuinfo has them. The benchmarks and examples print it.
    """
    fields: Dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block is enough
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name")
    if name is None:
        return platform.processor() or platform.machine() or "unknown"
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return name


def attend_isa() -> str:
    """The instruction-set path of the CPU attend kernel (``kvcache._C.attend_cpu_isa()``)."""
    fn = getattr(getattr(kvcache, "_C", None), "attend_cpu_isa", None)
    if fn is None:
        return "unknown (this build does not report it)"
    try:
        return str(fn())
    except Exception as e:  # noqa: BLE001 - reporting only
        return f"unknown ({e})"


def machine_lines(device: torch.device, threads_flag: int) -> List[str]:
    """The lines naming what the figures depend on: CPU (or GPU), threads, the kernel path."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    cpu = f"CPU: {cpu_model()}, {cpus} logical CPU(s) available"
    try:
        load = os.getloadavg()[0]
        cpu += f", load average {load:.1f}"
        if load > cpus - 0.5:
            cpu += " (busy: other work competes for the cores, expect a wide spread)"
    except (AttributeError, OSError):
        pass
    lines = [cpu]
    n = torch.get_num_threads()
    if threads_flag > 0:
        lines.append(f"threads: {n} (--threads {threads_flag})")
    else:
        lines.append(f"threads: {n} (torch's default; --threads N sets it, --threads 1 is steadier on a busy "
                     "machine)")
    lines.append(f"attend kernel (CPU): {attend_isa()}")
    if device.type == "cuda":
        lines.append(f"GPU: {torch.cuda.get_device_name(device)}")
    return lines


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


def run_uncached(model, prompt, new_tokens, step_callback=None):
    """Greedy decoding that recomputes the whole prefix for every token."""
    seq = prompt
    out, step_logits = [], []
    for _ in range(new_tokens):
        last = model.forward_no_cache(seq)[:, -1]
        token = last.argmax(-1)
        out.append(token)
        step_logits.append(last)
        seq = torch.cat([seq, token[:, None]], dim=1)
        if step_callback is not None:
            step_callback(1)
    return torch.stack(out, dim=1), step_logits


def timed(fn, device):
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def interleaved(methods: Dict[str, Callable[[Callable], object]], rounds: int, device: torch.device,
                new_tokens: int, no_progress: bool) -> Tuple[Dict[str, object], Dict[str, List[float]]]:
    """Runs every method once per round, in turn, ``rounds`` times.

    Each method takes a step callback (for the progress bar; it may ignore it).
    Returns each method's first output and its time in every round: a busy
    moment on a shared machine then lands in one round of every method, not in
    all of one.
    """
    outputs: Dict[str, object] = {}
    times: Dict[str, List[float]] = {name: [] for name in methods}
    bar = progress(rounds * len(methods) * new_tokens, "timing", no_progress)
    step = bar.update if bar is not None else None
    try:
        for r in range(rounds):
            for i, (name, fn) in enumerate(methods.items()):
                if bar is not None:
                    bar.set_description(f"round {r + 1}/{rounds}: {name}")
                out, t = timed(lambda: fn(step), device)
                outputs.setdefault(name, out)
                times[name].append(t)
                if bar is not None:  # a method that reports no steps moves the bar when it ends
                    bar.update((r * len(methods) + i + 1) * new_tokens - bar.n)
    finally:
        if bar is not None:
            bar.close()
    return outputs, times


def spread_row(name: str, generated: int, times: List[float]) -> str:
    """One table row: median tokens/s, its min-max over the rounds, median time."""
    rates = [generated / t for t in times]
    spread = f"{min(rates):,.1f} - {max(rates):,.1f}"
    return f"{name:<24}{statistics.median(rates):>14,.1f}   {spread:^22}{statistics.median(times):>11.3f}s"


TABLE_HEAD = f"{'run':<24}{'median tok/s':>14}   {'spread (min - max)':^22}{'median time':>12}"


def timing_title(rounds: int, order: str) -> str:
    if rounds == 1:
        return "1 round (no spread; --rounds 3 or more gives a median and a min - max):"
    return f"{rounds} interleaved rounds ({order}, then again), each method's median and spread over them:"


def ratios(slow: List[float], fast: List[float]) -> List[float]:
    """Per-round speed-ups of ``fast`` over ``slow`` (the rounds pair the runs up)."""
    return [s / f for s, f in zip(slow, fast)]


def speedup_text(r: List[float]) -> str:
    text = f"{statistics.median(r):.2f}x"
    if len(r) > 1:
        text += f" (median; {min(r):.2f}-{max(r):.2f}x over {len(r)} rounds)"
    return text


def run_speculative(args, config, model, prompt, device) -> int:
    draft_layers = args.draft_layers or max(1, args.layers // 2)
    draft = EarlyExitDraft(model, draft_layers)
    caches = lambda: list(kvcache.init_decoder_kv_caches_from_config(  # noqa: E731
        config, batch_size=args.batch, max_len=args.prompt_len + args.new_tokens,
        dtype=model.embed.weight.dtype, device=device))
    methods = {
        "plain greedy (target)": lambda step: greedy_generate(model, prompt, args.new_tokens, caches(),
                                                               step_callback=step),
        "speculative": lambda step: speculative_generate(model, draft, prompt, args.new_tokens, k=args.k),
    }
    with torch.inference_mode():
        greedy_generate(model, prompt, 2, caches())  # warm-up
        speculative_generate(model, draft, prompt, 2, k=args.k)
        outputs, times = interleaved(methods, args.rounds, device, args.new_tokens, args.no_progress)
    ref, _ = outputs["plain greedy (target)"]
    tokens, stats = outputs["speculative"]
    generated = args.batch * args.new_tokens
    same = torch.equal(tokens, ref)
    r = ratios(times["plain greedy (target)"], times["speculative"])
    print(f"\nspeculative decoding: early-exit draft ({draft_layers} of {args.layers} layers), k={args.k}")
    print(timing_title(args.rounds, "plain greedy, speculative"))
    print(TABLE_HEAD)
    for name, t in times.items():
        print(spread_row(name, generated, t))
    print(f"acceptance rate: {stats['acceptance_rate']:.1%} ({stats['accepted']} of {stats['proposed']} "
          f"proposals, {stats['rounds']} verify passes); speed-up: {speedup_text(r)}")
    print(f"tokens identical to plain greedy decoding: {same} -> {'PASS' if same else 'FAIL'}")
    print()
    print("What this showed:")
    showed = [
        f"Speculative decoding on kvcache's caches (a draft proposes, the target verifies a chunk in one pass "
        f"through attend, both caches roll back the rejected tokens per row) "
        f"{'gave exactly' if same else 'did NOT give'} the target's greedy tokens.",
        "With random weights the draft rarely agrees with the target, so this checks the mechanism and its "
        "exactness, not speed: examples/hf_speculative.py shows the speed-up on a real model (SmolLM2-135M, "
        "prompt-lookup drafts through kvcache.hf).",
    ]
    for text in showed:
        print(textwrap.fill(text, width=100, initial_indent="  - ", subsequent_indent="    "))
    print()
    print(WHAT_NEXT)
    return 0 if same else 1


def verdict(r: List[float], capacity: int, filled: str) -> str:
    """The headline in plain words, from the per-round speed-ups of attend over masked SDPA."""
    faster = sum(x > 1 for x in r)
    n = len(r)
    every = "every round" if n > 1 else "the one round"
    if faster == n:
        return (f"kvcache.attend decoded faster than masked SDPA in {every}, {speedup_text(r)}: it reads only the "
                f"filled slots ({filled} of {capacity} per step), masked SDPA reads all {capacity} every step.")
    if faster == 0:
        return (f"In {every} masked SDPA was as fast as attend or faster: attend ran at {speedup_text(r)} its "
                f"speed. At this size the buffer is small enough that reading all of it costs little (try a "
                f"larger --capacity), or the machine is busy (try --threads 1, more --rounds).")
    return (f"The rounds disagree: attend was faster than masked SDPA in {faster} of {n} rounds, "
            f"{speedup_text(r)}; so the machine was busy or the two are close at this size: try --threads 1, "
            f"more --rounds, or a larger --capacity.")


def main(argv=None) -> int:
    args = parse_args(argv)
    saved_threads = torch.get_num_threads()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        return _main(args)
    finally:
        torch.set_num_threads(saved_threads)  # main() may run inside another program (the tests)


def _main(args: argparse.Namespace) -> int:
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
    for line in machine_lines(device, args.threads):
        print(line)
    sys.stdout.flush()
    if args.speculative:
        return run_speculative(args, config, model, prompt, device)

    def caches():
        return list(kvcache.init_decoder_kv_caches_from_config(config, batch_size=args.batch, dtype=dtype,
                                                                device=device))

    methods = {
        "kvcache + attend": lambda step: greedy_generate(model, prompt, args.new_tokens, caches(),
                                                         step_callback=step),
        "kvcache + masked SDPA": lambda step: greedy_generate(sdpa_model, prompt, args.new_tokens, caches(),
                                                              step_callback=step),
        "no cache (recompute)": lambda step: run_uncached(model, prompt, args.new_tokens, step),
    }
    with torch.inference_mode():
        # Warm-up, so one-time costs (allocator, kernels) count in no run.
        greedy_generate(model, prompt, 2, caches())
        greedy_generate(sdpa_model, prompt, 2, caches())
        model.forward_no_cache(prompt)
        outputs, times = interleaved(methods, args.rounds, device, args.new_tokens, args.no_progress)

    tokens, cached_logits = outputs["kvcache + attend"]
    sdpa_tokens, sdpa_logits = outputs["kvcache + masked SDPA"]
    ref_tokens, ref_logits = outputs["no cache (recompute)"]
    diff = max((a - b).abs().max().item() for a, b in zip(cached_logits, ref_logits))
    diff_sdpa = max((a - b).abs().max().item() for a, b in zip(sdpa_logits, ref_logits))
    same_tokens = torch.equal(tokens, ref_tokens) and torch.equal(sdpa_tokens, ref_tokens)
    ok = diff <= TOLERANCE[dtype] and diff_sdpa <= TOLERANCE[dtype]
    vs_sdpa = ratios(times["kvcache + masked SDPA"], times["kvcache + attend"])
    vs_none = ratios(times["no cache (recompute)"], times["kvcache + attend"])
    print()
    print(timing_title(args.rounds, "attend, masked SDPA, no cache"))
    print(TABLE_HEAD)
    for name, t in times.items():
        print(spread_row(name, generated, t))
    print(f"speed-up of attend over masked SDPA (capacity {capacity}): {speedup_text(vs_sdpa)}")
    print(f"speed-up of attend over no cache: {speedup_text(vs_none)}")
    print(
        f"logits check: max |cached - uncached| = {diff:.3g} (attend), {diff_sdpa:.3g} (masked SDPA), "
        f"tolerance {TOLERANCE[dtype]:g} -> {'PASS' if ok else 'FAIL'}; greedy tokens identical: {same_tokens}"
    )
    print()
    print("What this showed:")
    showed = [
        verdict(vs_sdpa, capacity, f"{args.prompt_len} to {total_len}"),
        f"Recomputing the whole prefix every step (no cache) took {speedup_text(vs_none)} as long as attend.",
        f"Cached and uncached logits {'agree' if ok else 'DO NOT agree'} within the {args.dtype} tolerance "
        f"({max(diff, diff_sdpa):.2g} vs {TOLERANCE[dtype]:g}); the greedy tokens of the three runs are "
        f"{'identical' if same_tokens else 'NOT identical'}.",
        "The speeds depend on this machine: its CPU, the threads and the load printed above.",
    ]
    for text in showed:
        print(textwrap.fill(text, width=100, initial_indent="  - ", subsequent_indent="    "))
    print()
    print(WHAT_NEXT)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
