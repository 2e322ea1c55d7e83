#!/usr/bin/env python3
"""Turns benchmark JSON (``benchmarks/*.py --json F``) into a performance page of the docs.

    python scripts/perf_page.py attend.json e2e.json update.json   # save the JSON, write the page
    python scripts/perf_page.py --all                               # regenerate every page
    python scripts/perf_page.py --all --check                       # fail if a page is stale

The files of one run are copied to ``docs/performance/data/<machine>/`` (the machine slug comes from
the CPU model and the attend kernel's ISA path each JSON records), and the page
``docs/performance/<machine>.md`` is written from them with its plots in
``docs/performance/<machine>/``: attend against its peers over filled slots, decode tokens/s against
context, memory per cache format, and continuous-batching throughput against requests when
``bench_generate_batch.py`` JSON is among them, and paged attend against contiguous attend when
``bench_paged.py`` JSON is. ``docs/performance/index.md`` lists the pages.

``bench_generate_batch.py`` runs in slices (paged|sdpa takes minutes per row): each slice's JSON is
kept as ``generate_batch-<axes>.json`` (``slice_name``) beside the others, and the page shows the
rows of every slice, each with its own command.
Nothing on a page is typed by hand: to change it, rerun the benchmark and this script.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import sys
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PERF = os.path.join(ROOT, "docs", "performance")
DATA = os.path.join(PERF, "data")

# Memory per format: bytes per element of keys/values, and whether a float32 scale per
# (KV head, slot) is stored beside them (the formats of the quantized caches guide).
FORMATS = [("float32", 4, False), ("bfloat16", 2, False), ("int8 + scales", 1, True), ("fp8 + scales", 1, True)]
# The cache whose memory the page shows: SmolLM2-135M's (30 layers, 3 KV heads, head_dim 64).
MEMORY_MODEL = dict(name="SmolLM2-135M", layers=30, kv_heads=3, head_dim=64)


# --------------------------------------------------------------------------- reading

def kind_of(doc: dict) -> str:
    """Which benchmark wrote a JSON document, from its rows' fields."""
    rows = doc.get("rows", [])
    keys = set().union(*(r.keys() for r in rows)) if rows else set()
    if {"requests", "tokens_per_s"} <= keys:
        return "generate_batch"
    if "tok_per_s" in keys and "capacity" in keys:
        return "e2e"
    if any(r.get("case") in ("decode", "chunk") and "vs_best" in r for r in rows) or "vs_prefix_sdpa" in keys:
        return "attend"
    if "vs_index_copy" in keys or any(r.get("case") == "scaling" for r in rows):
        return "update"
    if "vs_token_major" in keys:
        return "paged"
    return "other"


def machine_slug(env: dict) -> str:
    """``amd-epyc-f25-m17-avx512bf16``: the CPU model (family/model numbers shortened) and ISA path."""
    cpu = env.get("cpu_model") or "unknown-cpu"
    cpu = re.sub(r"\(family (\d+), model (\d+)\)", r"f\1 m\2", cpu)
    cpu = re.sub(r"\(R\)|\(TM\)|CPU|Processor|@.*$", "", cpu)
    parts = [cpu]
    isa = (env.get("attend_isa") or "").split(" ")[0]
    if isa and isa != "unknown":
        parts.append(isa)
    if env.get("gpu"):
        parts = [env["gpu"]]
    return re.sub(r"[^a-z0-9]+", "-", " ".join(parts).lower()).strip("-")


def slice_name(doc: dict) -> str:
    """``generate_batch-smollm2-float32-r32-t2-p64-1024-n64``: a generate_batch JSON's file name,
    from the axes it was run with (paths left out), so slices of one grid sit side by side."""
    a = doc.get("args", {})

    def axis(v):
        return "_".join(map(str, v)) if isinstance(v, list) else str(v)

    parts = [a.get("model", "smollm2"), axis(a.get("dtype", "")), "r" + axis(a.get("requests", "")),
             "t" + axis(a.get("threads", "")), f"p{a.get('prompt_min', '')}-{a.get('prompt_max', '')}",
             f"n{a.get('new_tokens', '')}"]
    return "generate_batch-" + re.sub(r"[^A-Za-z0-9_.-]+", "", "-".join(parts))


def data_name(doc: dict) -> str:
    """The name (without ``.json``) a benchmark JSON is saved under in ``docs/performance/data/``:
    its kind, or for a generate_batch slice its ``slice_name``."""
    kind = kind_of(doc)
    return slice_name(doc) if kind == "generate_batch" else kind


def merge_slices(slices: List[dict]) -> dict:
    """One generate_batch document from its slices: the first's env, every slice's rows (each with
    its model, ``new_per_request`` and prompt range, the axes the rows do not carry) and the slices
    themselves (``slices``: their commands)."""
    rows = []
    for d in slices:
        a = d.get("args", {})
        for r in d["rows"]:
            extra = {"model": a.get("model", "smollm2")}
            if "new_tokens" in a:
                extra["new_per_request"] = a["new_tokens"]
            if "prompt_min" in a:
                extra["prompts"] = f"{a['prompt_min']}-{a.get('prompt_max', '')}"
            rows.append(dict(r, **extra))
    return dict(env=slices[0]["env"], args=slices[0].get("args", {}), rows=rows, slices=slices)


def load(paths: List[str]) -> Dict[str, dict]:
    docs: Dict[str, dict] = {}
    slices: List[dict] = []
    for p in paths:
        with open(p, encoding="utf-8") as f:
            doc = json.load(f)
        if kind_of(doc) == "generate_batch":
            slices.append(doc)
        else:
            docs[kind_of(doc)] = doc
    if slices:
        docs["generate_batch"] = merge_slices(slices)
    return docs


# --------------------------------------------------------------------------- formatting

def fmt(v, digits=3) -> str:
    if v is None or v == "":
        return ""
    if isinstance(v, float):
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        return f"{v:.{digits}g}"
    return str(v)


def table(header: List[str], rows: List[List]) -> List[str]:
    out = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    # A "|" inside a cell (paged|kvcache) is escaped, or the row splits into one cell more.
    out += ["| " + " | ".join(fmt(c).replace("|", "\\|") for c in r) + " |" for r in rows]
    return out + [""]


def threads_label(t: int, env: dict) -> str:
    return f"{t or env.get('default_threads', '?')}"


# --------------------------------------------------------------------------- plots

def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"figure.figsize": (6.4, 3.6), "figure.dpi": 80, "font.size": 9,
                         "svg.hashsalt": "kvcache"})
    return plt


def save(fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, metadata={"Software": None})
    import matplotlib.pyplot as plt

    plt.close(fig)


# --------------------------------------------------------------------------- sections

PEERS = ["kvcache attend", "SDPA prefix view", "SDPA prefix, enable_gqa", "masked SDPA, whole buffer"]


def attend_section(doc: dict, outdir: str, rel: str) -> List[str]:
    env, rows = doc["env"], [r for r in doc["rows"] if r.get("case") == "decode"]
    if not rows:
        return []
    lines = ["## attend against its peers (decode)", "",
             "One decode step (one query token per row) of `kvcache.attend` against scaled-dot-product "
             "attention on the exact prefix (groups folded, or `enable_gqa`) and masked SDPA over the "
             "whole buffer, as a static cache does. Median over interleaved rounds, µs per call.", ""]
    plt = _plt()
    dtypes = sorted({r["dtype"] for r in rows})
    threads = sorted({r["threads"] for r in rows}, key=lambda t: (t == 0, t))
    shape = rows[0]
    fig, axes = plt.subplots(1, len(dtypes), squeeze=False, sharey=True)
    t0 = threads[0]
    for ax, dt in zip(axes[0], dtypes):
        sel = [r for r in rows if r["dtype"] == dt and r["threads"] == t0]
        cap = max(r["capacity"] for r in sel)
        for m in PEERS:
            pts = sorted((r["filled"], r["median_us"]) for r in sel if r["method"] == m
                         and (m != "masked SDPA, whole buffer" or r["capacity"] == cap)
                         and (m == "masked SDPA, whole buffer" or r["capacity"] == max(
                             x["capacity"] for x in sel if x["filled"] == r["filled"])))
            if pts:
                label = m + (f" (capacity {cap})" if m.startswith("masked") else "")
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("filled slots")
        ax.set_title(f"{dt}, {threads_label(t0, env)} thread(s)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("µs per decode call")
    axes[0][0].legend(fontsize=7)
    save(fig, os.path.join(outdir, "attend_decode.png"))
    lines += [f"![attend and its peers over filled slots]({rel}/attend_decode.png)", "",
              f"Shape: batch {shape.get('batch')}, head_dim {shape.get('head_dim')}; the table has every "
              "row the run measured.", ""]
    for t in threads:
        body = []
        for r in sorted((r for r in rows if r["threads"] == t and r["method"] == "kvcache attend"),
                        key=lambda r: (r["dtype"], r["filled"], r["capacity"])):
            peer = r.get("best_peer", "")
            body.append([r["dtype"], r["filled"], r["capacity"], r["median_us"],
                         f"{r['min_us']:.3g}-{r['max_us']:.3g}", peer, r.get("vs_best"),
                         r.get("masked_over_this"), r.get("bw_frac")])
        lines += [f"### {threads_label(t, env)} thread(s)", ""]
        lines += table(["dtype", "filled", "capacity", "attend µs", "spread", "best peer", "attend / best peer",
                        "masked SDPA / attend", "fraction of a streaming read"], body)
    chunk = [r for r in doc["rows"] if r.get("case") == "chunk" and r.get("method") == "kvcache attend"]
    if chunk:
        body = [[r["threads"] or env.get("default_threads"), r["dtype"], r.get("seq"), r["filled"], r["median_us"],
                 r.get("best_peer", ""), r.get("vs_best"), r.get("gemm_frac")]
                for r in sorted(chunk, key=lambda r: (r["threads"] == 0, r["threads"], r["dtype"], r.get("seq"),
                                                      r["filled"]))]
        lines += ["### Chunks (several queries per row: speculative verification, chunked prefill)", ""]
        lines += table(["threads", "dtype", "seq", "filled", "attend µs", "best peer", "attend / best peer",
                        "fraction of the GEMM rate"], body)
    return lines


def decode_section(attend: Optional[dict], e2e: Optional[dict], outdir: str, rel: str) -> List[str]:
    if attend is None and e2e is None:
        return []
    plt = _plt()
    lines = ["## Decode tokens/s against context", ""]
    fig, ax = plt.subplots()
    if e2e is not None:
        env = e2e["env"]
        rows = e2e["rows"]
        for t in sorted({r["threads"] for r in rows}):
            for path in sorted({r["path"] for r in rows}):
                pts = sorted((r["capacity"], r["tok_per_s"]) for r in rows if r["threads"] == t and r["path"] == path)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                        label=f"Decoder, {path}, {threads_label(t, env)} thr")
        ax.set_xlabel("cache capacity (slots)")
        lines += ["The package `Decoder` (benchmarks/bench_e2e.py: 4 layers, d_model 256, batch 8, a 200-token "
                  "prompt) decoding greedily, `attend` (reads the filled slots) against masked SDPA over the "
                  "whole buffer, as the cache's capacity grows:", ""]
        body = [[threads_label(r["threads"], env), r["capacity"], r["path"], r["tok_per_s"], r.get("spread", ""),
                 r.get("vs_sdpa")] for r in sorted(rows, key=lambda r: (r["threads"], r["capacity"], r["path"]))]
        lines += table(["threads", "capacity", "attention", "tokens/s", "spread", "vs masked SDPA"], body)
    elif attend is not None:
        env = attend["env"]
        rows = [r for r in attend["rows"] if r.get("case") == "decode" and r["method"] == "kvcache attend"]
        for t in sorted({r["threads"] for r in rows}):
            for dt in sorted({r["dtype"] for r in rows}):
                pts = sorted({r["filled"]: 1e6 / r["median_us"] for r in rows
                              if r["threads"] == t and r["dtype"] == dt}.items())
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                        label=f"attend {dt}, {threads_label(t, env)} thr")
        ax.set_xlabel("context (filled slots)")
        lines += ["Decode calls of one layer's `attend` per second against the context it reads "
                  "(no bench_e2e.py JSON in this run).", ""]
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_ylabel("tokens/s")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    save(fig, os.path.join(outdir, "decode_tokens.png"))
    return lines[:2] + [f"![decode tokens/s against context]({rel}/decode_tokens.png)", ""] + lines[2:]


def memory_section(outdir: str, rel: str, slots=(4096, 32768)) -> List[str]:
    plt = _plt()
    m = MEMORY_MODEL
    per_elem = m["layers"] * 2 * m["kv_heads"] * m["head_dim"]  # keys + values, per slot of a row
    per_scale = m["layers"] * 2 * m["kv_heads"] * 4
    body, mib = [], {}
    for name, size, scaled in FORMATS:
        b = per_elem * size + (per_scale if scaled else 0)
        mib[name] = [b * s / 2**20 for s in slots]
        body.append([name, b] + mib[name] + [b / (per_elem * 4)])
    fig, ax = plt.subplots()
    names = [f[0] for f in FORMATS]
    ax.bar(names, [mib[n][0] for n in names])
    ax.set_ylabel(f"MiB at {slots[0]} slots, batch 1")
    ax.set_title(f"{m['name']}'s cache per format")
    save(fig, os.path.join(outdir, "memory.png"))
    lines = ["## Memory per cache format", "",
             f"Computed from the storage formats (not timed): {m['name']}'s cache ({m['layers']} layers, "
             f"{m['kv_heads']} KV heads, head_dim {m['head_dim']}), keys and values plus, for the quantized "
             "formats, one float32 scale per (KV head, slot) each; batch 1. The same on every machine.", "",
             f"![memory per format]({rel}/memory.png)", ""]
    lines += table(["format", "bytes per token"] + [f"MiB at {s} slots" for s in slots] + ["vs float32"], body)
    return lines


def update_section(doc: dict) -> List[str]:
    env, rows = doc["env"], [r for r in doc["rows"] if r.get("case") == "decode"]
    if not rows:
        return []
    lines = ["## Writes (one decode token)", "",
             "benchmarks/bench_update.py: one token's keys and values written per step, µs, against "
             "Hugging Face's static-cache `index_copy_` pair.", ""]
    body = [[threads_label(r["threads"], env), r.get("batch"), r.get("max_len"), r["method"], r["median_us"],
             r.get("vs_index_copy")]
            for r in sorted(rows, key=lambda r: (r["threads"] == 0, r["threads"], r.get("batch"), r.get("max_len")))]
    return lines + table(["threads", "batch", "capacity", "method", "µs", "vs 2x index_copy_"], body)


def paged_section(doc: dict) -> List[str]:
    """benchmarks/bench_paged.py's rows: paged attend against contiguous attend over the same tokens."""
    env, rows = doc["env"], doc["rows"]
    huge = any("huge_gain" in r for r in rows)
    lines = ["## Paged attend against contiguous attend", "",
             "benchmarks/bench_paged.py: one step (each sequence's last `queries each` tokens) over sequences "
             "from 1/8 of the longest to the longest, in shuffled pages (`attend_pages`), against `attend` over "
             "the same tokens in a head-major cache (`ratio`: paged over it) and in token-major memory, the "
             "pages' slot layout without a block table (`vs token-major`: what the block table itself costs); "
             "µs, median of interleaved rounds.", ""]
    header = ["threads", "dtype", "page slots", "sequences", "queries each", "longest", "contiguous µs",
              "token-major µs", "paged µs", "ratio", "vs token-major"] + (["huge-page gain"] if huge else [])
    body = [[threads_label(r["threads"], env), r["dtype"], r["block_size"], r["batch"], r.get("q_len", 1),
             r.get("max_len"), r["contiguous_us"], r["token_major_us"], r["paged_us"], r["ratio"],
             r["vs_token_major"]]
            + ([r.get("huge_gain")] if huge else [])
            for r in rows]
    return lines + table(header, body)


def batch_section(doc: dict, outdir: str, rel: str) -> List[str]:
    rows = doc["rows"]
    plt = _plt()
    fig, ax = plt.subplots()
    # One line per model, attention and setting of the other axes (new tokens, prompts, dtype, threads).
    def line(r):
        return tuple(str(r.get(k, "")) for k in ("model", "attn", "dtype", "threads", "prompts", "new_per_request"))

    for key in sorted({line(r) for r in rows}):
        pts = sorted((r["requests"], r["tokens_per_s"]) for r in rows if line(r) == key)
        model, attn, dtype, threads, prompts, new = key
        label = " ".join(x for x in (model, attn, dtype, threads and f"{threads}t", prompts and f"prompts {prompts}",
                                     new and f"+{new}") if x)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("tokens/s")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the plot, not over it
    fig.set_size_inches(9.6, 3.6)
    save(fig, os.path.join(outdir, "generate_batch.png"))
    lead = ["model", "requests", "attn", "dtype", "threads", "prompts", "new_per_request", "tokens_per_s", "vs_sdpa",
            "same_as_sdpa"]
    present = {k for r in rows for k in r}
    cols = [c for c in lead if c in present] + sorted(present - set(lead))
    order = ("model", "dtype", "threads", "prompts", "new_per_request", "attn")
    body = [[r.get(c, "") for c in cols]
            for r in sorted(rows, key=lambda r: tuple(str(r.get(k, "")) for k in order) + (r["requests"],))]
    return (["## Continuous batching throughput", "",
             "benchmarks/bench_generate_batch.py: tokens/s of `generate_batch` against the number of requests.",
             "", f"![continuous batching throughput]({rel}/generate_batch.png)", ""] + table(cols, body))


# --------------------------------------------------------------------------- page

# The arguments of a run's command line shown beside --threads, by kind of benchmark.
AXES = {"generate_batch": ("requests", "dtype", "model", "prompt_min", "prompt_max", "new_tokens",
                           "max_batch_tokens", "attn"),
        "paged": ("dtypes", "block_sizes", "batch", "q_len", "huge_pages", "rounds", "min_time")}


def machine_lines(docs: Dict[str, dict]) -> List[str]:
    env = next(iter(docs.values()))["env"]
    build = env.get("kvcache_build") or {}
    rows = [["CPU", env.get("cpu_model")], ["logical CPUs", env.get("logical_cpus", "")],
            ["attend kernel ISA path", env.get("attend_isa")], ["peer libraries' ISA", env.get("peer_caps", "")],
            ["torch", env.get("torch")], ["kvcache build", ", ".join(f"{k}={v}" for k, v in build.items() if v != "")],
            ["Python", env.get("python")], ["default threads", env.get("default_threads")]]
    lines = ["## Machine", ""] + table(["", ""], rows)
    lines += ["Runs (one command each, from the repository root):", "", "```bash"]
    runs = [(kind, d) for kind, doc in sorted(docs.items()) for d in doc.get("slices", [doc])]
    for kind, doc in runs:
        a = doc.get("args", {})
        script = doc["env"].get("benchmark") or {"attend": "bench_attend.py", "e2e": "bench_e2e.py",
                                                  "update": "bench_update.py", "paged": "bench_paged.py",
                                                  "generate_batch": "bench_generate_batch.py"}.get(kind, kind)
        flags = []
        if a.get("quick"):
            flags.append("--quick")
        if a.get("threads"):
            flags.append("--threads " + " ".join(map(str, a["threads"])))
        if a.get("filled"):
            flags.append("--filled " + " ".join(map(str, a["filled"])))
        # Every axis it was run with (paths left out).
        for k in AXES.get(kind, ()):
            v = a.get(k)
            if v is not None:
                shown = " ".join(map(str, v)) if isinstance(v, list) else str(v)
                flags.append(f"--{k.replace('_', '-')} {shown}")
        date = doc["env"].get("date", "")
        lines.append(f"python benchmarks/{script} {' '.join(flags)} --json {data_name(doc)}.json"
                     + (f"   # {date}" if date else ""))
    lines += ["```", "", "Threads: `0` is the default (all cores); a shared machine's figures move with its load: "
              "each figure is the median of interleaved rounds, with its spread.", ""]
    return lines


def render(slug: str, docs: Dict[str, dict], outdir: Optional[str] = None) -> str:
    """The page's Markdown; its plots are written to ``outdir`` (default docs/performance/<slug>/)."""
    outdir = outdir or os.path.join(PERF, slug)
    os.makedirs(outdir, exist_ok=True)
    env = next(iter(docs.values()))["env"]
    lines = [f"# {env.get('cpu_model', slug)}, {(env.get('attend_isa') or '').split(' ')[0]}", "",
             "Generated by `scripts/perf_page.py` from the JSON in "
             f"`docs/performance/data/{slug}/`; do not edit by hand.", ""]
    lines += machine_lines(docs)
    if "attend" in docs:
        lines += attend_section(docs["attend"], outdir, slug)
    lines += decode_section(docs.get("attend"), docs.get("e2e"), outdir, slug)
    lines += memory_section(outdir, slug)
    if "update" in docs:
        lines += update_section(docs["update"])
    if "paged" in docs:
        lines += paged_section(docs["paged"])
    if "generate_batch" in docs:
        lines += batch_section(docs["generate_batch"], outdir, slug)
    return "\n".join(lines).rstrip() + "\n"


def index_text(slugs: List[str]) -> str:
    lines = ["# Performance", "",
             "One page per machine, each generated by `scripts/perf_page.py` from the JSON a benchmark "
             "run saved (`benchmarks/*.py --json F`). To add a machine: run the benchmarks there with "
             "`--json`, then `python scripts/perf_page.py FILE...`. What the measurements taught the "
             "design is in [the design notes](../design.md#what-measurements-taught).", "",
             "```{toctree}", ":maxdepth: 1", ""] + slugs + ["```", ""]
    return "\n".join(lines)


def write_if_changed(path: str, text: str, check: bool, stale: List[str]) -> None:
    old = open(path, encoding="utf-8").read() if os.path.exists(path) else None
    if old == text:
        return
    if check:
        stale.append(os.path.relpath(path, ROOT))
    else:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", nargs="*", help="the JSON files of one run (benchmarks/*.py --json F)")
    p.add_argument("--all", action="store_true", help="regenerate every page from docs/performance/data/")
    p.add_argument("--check", action="store_true", help="write nothing; fail if a page differs from its data")
    args = p.parse_args(argv)
    if not args.json and not args.all:
        p.error("give JSON files, or --all")
    os.makedirs(DATA, exist_ok=True)
    if args.json:
        docs = load(args.json)
        slugs = {machine_slug(d["env"]) for d in docs.values()}
        if len(slugs) != 1:
            p.error(f"the files come from different machines: {sorted(slugs)}")
        slug = slugs.pop()
        os.makedirs(os.path.join(DATA, slug), exist_ok=True)
        for src in args.json:
            doc = json.load(open(src, encoding="utf-8"))
            shutil.copyfile(src, os.path.join(DATA, slug, f"{data_name(doc)}.json"))
    stale: List[str] = []
    slugs = sorted(d for d in os.listdir(DATA) if glob.glob(os.path.join(DATA, d, "*.json")))
    only = {machine_slug(d["env"]) for d in load(args.json).values()} if args.json and not args.all else None
    for slug in slugs:
        if only is not None and slug not in only:
            continue
        docs = load(sorted(glob.glob(os.path.join(DATA, slug, "*.json"))))
        if args.check:  # plots to a scratch folder: a check writes nothing under docs/
            import tempfile

            with tempfile.TemporaryDirectory() as tmp:
                text = render(slug, docs, tmp)
            missing = [f for f in re.findall(r"\]\(([^)]+\.png)\)", text)
                       if not os.path.exists(os.path.join(PERF, f))]
            stale += [f"docs/performance/{f} (missing)" for f in missing]
        else:
            text = render(slug, docs)
        write_if_changed(os.path.join(PERF, f"{slug}.md"), text, args.check, stale)
        print(f"{'checked' if args.check else 'wrote'} docs/performance/{slug}.md")
    write_if_changed(os.path.join(PERF, "index.md"), index_text(slugs), args.check, stale)
    if stale:
        print("stale (run python scripts/perf_page.py --all): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
