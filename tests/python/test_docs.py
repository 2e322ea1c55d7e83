"""The documentation's generated parts cover the code, and the performance page renders from data.

The full Sphinx build (warnings as errors) is CI's docs step, scripts/docs.sh; these checks are
fast and need no Sphinx: the API pages list every public name of the package and of kvcache.hf,
the Operators page every registered operator with its schema and a description from
csrc/ops/operators.h, and scripts/perf_page.py writes a page with its plots from a small JSON
fixture.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest
import torch

import kvcache

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load(name, path):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


pytest.importorskip("docutils", reason="the doc tools are not installed (scripts/setup.sh installs them)")
pytest.importorskip("sphinx", reason="the doc tools are not installed (scripts/setup.sh installs them)")
sys.path.insert(0, os.path.join(ROOT, "docs", "_ext"))
docs_ext = load("kvcache_docs", "docs/_ext/kvcache_docs.py")


def test_api_page_documents_every_public_name():
    lines = "\n".join(docs_ext.api_lines("kvcache"))
    for name in kvcache.__all__:
        assert f"kvcache.{name}\n" in lines + "\n", f"kvcache.{name} is missing from the API page"


def test_hf_api_page_documents_every_public_name():
    hf = pytest.importorskip("kvcache.hf", reason="transformers is not installed")
    lines = "\n".join(docs_ext.api_lines("kvcache.hf"))
    for name in hf.__all__:
        assert f"kvcache.hf.{name}" in lines


@pytest.mark.parametrize("module", ["kvcache.rows", "kvcache.ring", "kvcache.common"])
def test_submodule_pages_cover_their_public_names(module):
    lines = "\n".join(docs_ext.api_lines(module))
    for name in docs_ext.public_names(module):
        assert f"{module}.{name}" in lines or f"kvcache.{name}`" in lines, name


def test_operators_page_has_every_operator_schema_and_description():
    lines, problems = docs_ext.operator_lines()
    text = "\n".join(lines)
    assert problems == []
    for name in dir(torch.ops.kvcache):
        packet = getattr(torch.ops.kvcache, name)
        if name.startswith("_") or not hasattr(packet, "overloads"):
            continue
        for ov in packet.overloads():
            assert str(getattr(packet, ov)._schema) in text, f"{name}.{ov}"


def test_operator_descriptions_parse():
    desc = docs_ext.operator_descriptions()
    assert "update_.Tensor" in desc and desc["update_.Tensor"] == desc["update_"]
    assert desc["attend"].startswith("attention of q")


def fixture_docs():
    env = dict(cpu_model="Test CPU (family 1, model 2)", attend_isa="avx2", torch="2.13.0", default_threads=2,
               threads=[1, 2], logical_cpus=2, benchmark="bench_attend.py", date="2026-01-01")
    attend = []
    for filled in (256, 1024):
        for method, us in (("kvcache attend", 10.0), ("SDPA prefix view", 20.0), ("masked SDPA, whole buffer", 80.0)):
            attend.append(dict(case="decode", threads=1, dtype="float32", batch=1, head_dim=64, filled=filled,
                               capacity=4096, method=method, median_us=us * filled / 256, min_us=us, max_us=us * 2,
                               vs_prefix_sdpa=us / 20, vs_best=0.5, best_peer="SDPA prefix view",
                               masked_over_this=8.0, bw_frac=0.5))
    batch = [dict(requests=r, attn=a, tokens_per_s=100.0 * r) for r in (1, 4) for a in ("paged", "sdpa")]
    paged = [dict(threads=1, dtype="bfloat16", block_size=16, batch=16, q_len=1, max_len=4096, contiguous_us=700.0,
                  token_major_us=720.0, paged_us=805.0, ratio=1.15, vs_token_major=1.118)]
    return {"attend": dict(env=env, args=dict(quick=True, threads=[1]), rows=attend),
            "generate_batch": dict(env=dict(env, benchmark="bench_generate_batch.py"), args={}, rows=batch),
            "paged": dict(env=dict(env, benchmark="bench_paged.py"),
                          args=dict(threads=[1], dtypes=["bfloat16"], block_sizes=[16]), rows=paged)}


def test_perf_page_renders_from_json(tmp_path):
    perf = load("perf_page", "scripts/perf_page.py")
    docs = fixture_docs()
    assert {perf.kind_of(d) for d in docs.values()} == {"attend", "generate_batch", "paged"}
    slug = perf.machine_slug(docs["attend"]["env"])
    assert slug == "test-f1-m2-avx2"
    text = perf.render(slug, docs, str(tmp_path))
    for png in ("attend_decode.png", "decode_tokens.png", "memory.png", "generate_batch.png"):
        assert (tmp_path / png).stat().st_size > 1000
        assert f"]({slug}/{png})" in text
    assert "| float32 | 256 | 4096 | 10 |" in text
    assert "## Continuous batching throughput" in text
    assert "47.8" in text  # SmolLM2's int8 cache at 4096 slots, MiB
    assert "## Paged attend against contiguous attend" in text
    assert "| 1 | bfloat16 | 16 | 16 | 1 | 4096 | 700 | 720 | 805 | 1.15 | 1.12 |" in text
    assert "python benchmarks/bench_paged.py --threads 1 --dtypes bfloat16 --block-sizes 16 --json paged.json" in text


def test_perf_page_merges_generate_batch_slices(tmp_path):
    """Two bench_generate_batch slices (other requests, other new tokens): one section with the rows
    of both, each row with its slice's new tokens, and each slice's own command."""
    perf = load("perf_page", "scripts/perf_page.py")
    env = fixture_docs()["generate_batch"]["env"]
    slices = []
    for requests, new in ((8, 24), (64, 64)):
        rows = [dict(requests=requests, attn=a, tokens_per_s=t) for a, t in (("kvcache", 9.5), ("sdpa", 1.25))]
        doc = dict(env=env, rows=rows, args=dict(requests=[requests], threads=[2], dtype=["float32"],
                                                 prompt_min=64, prompt_max=1024, new_tokens=new))
        path = tmp_path / f"{perf.slice_name(doc)}.json"
        path.write_text(json.dumps(doc))
        slices.append(str(path))
    assert [os.path.basename(s) for s in slices] == ["generate_batch-smollm2-float32-r8-t2-p64-1024-n24.json",
                                                     "generate_batch-smollm2-float32-r64-t2-p64-1024-n64.json"]
    docs = perf.load(slices)
    assert list(docs) == ["generate_batch"]
    assert sorted((r["requests"], r["new_per_request"], r["attn"]) for r in docs["generate_batch"]["rows"]) == [
        (8, 24, "kvcache"), (8, 24, "sdpa"), (64, 64, "kvcache"), (64, 64, "sdpa")]
    text = perf.render("test", docs, str(tmp_path))
    for s in slices:
        assert f"--json {os.path.basename(s)}" in text
    assert "--requests 64" in text and "--new-tokens 64" in text and "--new-tokens 24" in text
    assert text.count("| 9.5 |") == 2 and text.count("| 1.25 |") == 2


def test_saved_performance_pages_are_current():
    perf = load("perf_page", "scripts/perf_page.py")
    assert perf.main(["--all", "--check"]) == 0


def test_performance_json_carries_the_machine():
    data = os.path.join(ROOT, "docs", "performance", "data")
    files = [os.path.join(d, f) for d, _, fs in os.walk(data) for f in fs if f.endswith(".json")]
    assert files
    for f in files:
        with open(f, encoding="utf-8") as fh:
            env = json.load(fh)["env"]
        for key in ("cpu_model", "attend_isa", "torch", "threads"):
            assert env.get(key), f"{f}: no {key}"
