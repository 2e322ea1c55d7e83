"""torch.export and AOTInductor of the decode step (the package also run from C++ by kvcache_run)."""

from __future__ import annotations

import subprocess

import pytest
import torch

import kvcache
from kvcache.models import Decoder, StatefulDecoder

CFG = kvcache.TransformerConfig(num_layers=2, num_heads=8, d_model=64, max_len=32, num_kv_heads=2)
BATCH = 2
STEPS = 8


@pytest.fixture(scope="module")
def model():
    return Decoder(CFG, seed=3).eval()


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, CFG.vocab_size, (BATCH, STEPS), generator=torch.Generator().manual_seed(1))


def eager_steps(model, tokens):
    """Reference: the eager StatefulDecoder fed one token per step."""
    ref = StatefulDecoder(model, batch_size=BATCH)
    with torch.no_grad():
        return [ref(tokens[:, i : i + 1]) for i in range(tokens.shape[1])]


@pytest.fixture(scope="module")
def exported(model, tokens):
    step = StatefulDecoder(model, batch_size=BATCH)
    with torch.no_grad():  # an inference graph: kvcache ops refuse inputs that require grad
        # A contiguous example: an AOTInductor package assumes its example inputs' strides (it
        # does not check them), and kvcache_run feeds contiguous (batch, 1) tokens.
        return torch.export.export(step, (tokens[:, :1].contiguous(),))


def empty_caches(exported):
    """Empties the program's caches: its lengths buffers are state that every run advances."""
    for store in (exported.state_dict, exported.constants):
        for name, buf in store.items():
            if name.endswith("lengths"):
                buf.zero_()
    return exported


def fresh_module(exported):
    """The exported step with empty caches."""
    module = empty_caches(exported).module()
    for name, buf in module.named_buffers():
        if name.endswith("lengths"):
            buf.zero_()
    return module


def test_exported_decode_step_has_the_ops_and_mutates_buffers(exported):
    """The write and attend run on the whole cache buffers; functionalized, exactly those are mutated.

    Traced, append_kv_layer_cache writes with append_returning_ at the lengths and
    copies the new lengths back (a functional length: see cache._append).
    """
    buffers = exported.graph_signature.inputs_to_buffers
    calls = [n for n in exported.graph.nodes
             if n.op == "call_function" and "kvcache.append_returning_" in str(n.target)]
    assert len(calls) == CFG.num_layers
    for i, node in enumerate(calls):
        assert buffers[node.args[0].name] == f"caches.{i}.keys"
        assert buffers[node.args[1].name] == f"caches.{i}.values"
        assert buffers[node.args[2].name] == f"caches.{i}.lengths"
    attends = [n for n in exported.graph.nodes if n.op == "call_function" and "kvcache.attend" in str(n.target)]
    assert len(attends) == CFG.num_layers
    mutated = exported.run_decompositions().graph_signature.buffers_to_mutate
    assert sorted(mutated.values()) == sorted(
        f"caches.{i}.{kind}" for i in range(CFG.num_layers) for kind in ("keys", "values", "lengths")
    )


def test_exported_program_matches_eager(model, tokens, exported):
    ref = eager_steps(model, tokens)
    module = fresh_module(exported)
    with torch.no_grad():
        for i in range(STEPS):
            out = module(tokens[:, i : i + 1])
            assert torch.equal(out, ref[i]), i


def test_export_save_load_roundtrip(model, tokens, exported, tmp_path):
    path = tmp_path / "decode_step.pt2"
    torch.export.save(exported, path)
    module = fresh_module(torch.export.load(path))
    ref = eager_steps(model, tokens)
    with torch.no_grad():
        for i in range(STEPS):
            assert torch.equal(module(tokens[:, i : i + 1]), ref[i]), i


def test_aoti_package_runs_with_the_ops(model, tokens, exported, tmp_path):
    """AOTInductor compiles the step to C++; the custom op is called through the dispatcher."""
    package = torch._inductor.aoti_compile_and_package(empty_caches(exported), package_path=str(tmp_path / "step.pt2"))
    runner = torch._inductor.aoti_load_package(package)
    ref = eager_steps(model, tokens)
    with torch.no_grad():
        for i in range(STEPS):
            out = runner(tokens[:, i : i + 1].contiguous())
            # Inductor fuses differently from eager: equal to float32 rounding, not bit for bit
            torch.testing.assert_close(out, ref[i], rtol=1e-4, atol=1e-4)


def test_cpp_runner_runs_the_aoti_package(model, exported, tmp_path):
    """kvcache_run loads the AOTInductor package in C++ (AOTIModelPackageLoader), feeds it the
    prompt one token a step and decodes greedily: the tokens of eager generation, the logits to
    float32 rounding (Inductor fuses differently from eager)."""
    from test_torchscript import eager_generate, find_or_build_runner

    runner = find_or_build_runner()
    package = torch._inductor.aoti_compile_and_package(empty_caches(exported),
                                                       package_path=str(tmp_path / "step.pt2"))
    prompt = torch.randint(0, CFG.vocab_size, (BATCH, 5), generator=torch.Generator().manual_seed(7))
    torch.save(prompt, tmp_path / "prompt.pt")
    new_tokens = 6
    out = tmp_path / "out.pt"
    proc = subprocess.run([runner, package, str(tmp_path / "prompt.pt"), str(new_tokens), str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    tokens, logits = torch.load(out)
    ref_tokens, ref_logits = eager_generate(model, prompt, new_tokens)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)


def test_cpp_runner_refuses_what_the_package_was_not_compiled_for(exported, tmp_path):
    """A prompt of another batch size than the export's: the package's input checks refuse it
    (it would read past the token buffer), a clear error and exit 1; so does a bad NEW_TOKENS."""
    from test_torchscript import find_or_build_runner

    runner = find_or_build_runner()
    package = torch._inductor.aoti_compile_and_package(empty_caches(exported),
                                                       package_path=str(tmp_path / "step.pt2"))
    torch.save(torch.zeros(BATCH + 1, 3, dtype=torch.int64), tmp_path / "prompt.pt")
    for count, expected in (("4", f"expected: {BATCH}, but got: {BATCH + 1}"), ("4x", "NEW_TOKENS")):
        proc = subprocess.run([runner, package, str(tmp_path / "prompt.pt"), count, str(tmp_path / "o.pt")],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 1 and expected in proc.stderr, proc.stderr
        assert "frame #" not in proc.stderr  # the message, not a C++ backtrace
