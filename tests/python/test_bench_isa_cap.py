"""benchmarks/isa_cap.py: ``--isa X`` caps our kernel and torch's own CPU dispatch alike.

The benchmarks' AVX2 rows are only honest if the peers (SDPA, oneDNN, MKL) run at AVX2 too; the
cap works by re-executing the benchmark with the libraries' environment variables set before
torch loads. These tests run a tiny script through that path and ask torch and kvcache, in the
re-executed process, which instruction set they dispatch to.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "benchmarks")
needs_source = pytest.mark.skipif(not os.path.isdir(BENCH), reason="needs the source tree")

SCRIPT = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, {bench!r})
    import isa_cap
    isa_cap.apply()
    import torch
    import kvcache
    print("torch", torch.backends.cpu.get_cpu_capability())
    print("kvcache", kvcache._C.attend_cpu_isa())
    print("caps", isa_cap.describe())
    print("argv", sys.argv[1:])
    """
)


def run(tmp_path, *args):
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT.format(bench=BENCH))
    env = {k: v for k, v in os.environ.items()
           if k not in ("KVCACHE_ATTEND_ISA", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
                        "MKL_ENABLE_INSTRUCTIONS", "KVCACHE_BENCH_ISA")}
    out = subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return dict(line.split(" ", 1) for line in out.stdout.strip().splitlines())


def best_isa():
    return torch.backends.cpu.get_cpu_capability()


@needs_source
@pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64", reason="x86-64 ISA caps")
@pytest.mark.parametrize("form", [("--isa", "avx2"), ("--isa=avx2",)])
def test_avx2_caps_torch_and_kvcache(tmp_path, form):
    if best_isa() not in ("AVX2", "AVX512"):
        pytest.skip(f"this CPU's ATen dispatch is {best_isa()}")
    got = run(tmp_path, *form, "--other", "1")
    assert got["torch"] == "AVX2"
    assert got["kvcache"] == "avx2"
    assert "ONEDNN_MAX_CPU_ISA=AVX2" in got["caps"] and "MKL_ENABLE_INSTRUCTIONS=AVX2" in got["caps"]
    # The re-executed process sees the same arguments, once.
    assert got["argv"] == repr([*form, "--other", "1"])


@needs_source
def test_no_isa_leaves_everything_alone(tmp_path):
    got = run(tmp_path, "--other", "1")
    assert got["torch"] == best_isa()
    assert got["caps"].startswith("none")
    assert got["argv"] == repr(["--other", "1"])


@needs_source
def test_unknown_isa_is_left_to_argparse(tmp_path):
    # No re-exec, no caps: the benchmark's parser (choices=CAPS) rejects the value.
    got = run(tmp_path, "--isa", "sse9")
    assert got["caps"].startswith("none")
    sys.path.insert(0, BENCH)
    try:
        import argparse

        import isa_cap
        p = argparse.ArgumentParser()
        isa_cap.add_arg(p)
        with pytest.raises(SystemExit):
            p.parse_args(["--isa", "sse9"])
        assert p.parse_args(["--isa", "avx2"]).isa == "avx2"
    finally:
        sys.path.remove(BENCH)
