"""The demo (python -m kvcache.demo) and its launcher (scripts/demo.sh) as a first-time user meets them.

The demo names the machine its figures belong to (CPU, threads, the attend kernel's path), times
the methods in interleaved rounds and reports each as a median with its spread, and ends by saying
what it showed and what to try next. ``bash scripts/demo.sh --help`` answers at once, without the
setup (no virtual environment created, no build), and lists the same flags as the demo's parser.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from kvcache import demo

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO_SH = os.path.join(ROOT, "scripts", "demo.sh")
TINY = ["--layers", "1", "--d-model", "32", "--heads", "4", "--kv-heads", "2", "--batch", "1",
        "--prompt-len", "4", "--new-tokens", "3", "--capacity", "64", "--no-progress"]
NUM = r"[\d,]+\.\d"


def run_demo(*args: str) -> str:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "kvcache.demo", *TINY, *args], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def value(text: str) -> float:
    return float(text.replace(",", ""))


def assert_row(out: str, name: str) -> None:
    """``name``'s row has a median tok/s, a min - max spread around it, and a median time."""
    m = re.search(rf"^{re.escape(name)}\s+({NUM})\s+({NUM}) - ({NUM})\s+(\d+\.\d+)s$", out, re.M)
    assert m, f"no median/spread row for {name!r} in:\n{out}"
    median, lo, hi = (value(g) for g in m.groups()[:3])
    assert lo <= median <= hi


def test_demo_names_the_machine_and_reports_medians_with_spreads():
    out = run_demo("--threads", "1", "--rounds", "3")
    assert re.search(r"^threads: 1 \(--threads 1\)$", out, re.M), out
    assert re.search(r"^CPU: \S.*logical CPU", out, re.M), out
    assert re.search(r"^attend kernel \(CPU\): \S+", out, re.M), out
    assert "3 interleaved rounds" in out
    assert re.search(r"median tok/s\s+spread \(min - max\)", out), out
    for name in ("kvcache + attend", "kvcache + masked SDPA", "no cache (recompute)"):
        assert_row(out, name)
    assert re.search(r"speed-up of attend over masked SDPA .*x \(median; \d+\.\d+-\d+\.\d+x over 3 rounds\)", out)
    assert "-> PASS" in out
    # the closing words: what was shown, in plain words, and where to go next
    showed = " ".join(out[out.index("What this showed:"):].split())
    assert "masked SDPA" in showed and "depend on this machine" in showed
    nxt = out[out.index("What to try next:"):]
    assert "examples/hf_generate.py" in nxt and "examples/hf_speculative.py" in nxt and "README.md" in nxt


def test_demo_says_its_default_thread_count_and_times_speculative_in_rounds():
    out = run_demo("--speculative", "--k", "2", "--rounds", "2")
    assert re.search(r"^threads: \d+ \(torch's default; --threads N sets it", out, re.M), out
    assert re.search(r"^CPU: \S", out, re.M)
    assert "2 interleaved rounds" in out
    assert_row(out, "plain greedy (target)")
    assert_row(out, "speculative")
    assert "-> PASS" in out
    assert "What this showed:" in out and "What to try next:" in out


def test_demo_main_restores_the_callers_thread_count(capsys):
    import torch

    before = torch.get_num_threads()
    assert demo.main([*TINY, "--rounds", "1", "--threads", "1"]) == 0
    assert torch.get_num_threads() == before
    assert "1 round (no spread" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--threads", "-1"]])
def test_demo_refuses_bad_timing_flags(argv, capsys):
    with pytest.raises(SystemExit):
        demo.parse_args(argv)
    assert argv[0] in capsys.readouterr().err


def test_every_demo_flag_has_help_text():
    for action in demo.build_parser()._actions:
        assert action.help, f"{action.option_strings} has no help text"


def demo_sh(*args: str, venv: str, cwd: str = ROOT, script: str = DEMO_SH):
    env = dict(os.environ, KVCACHE_VENV=venv)
    env.pop("VIRTUAL_ENV", None)
    start = time.monotonic()
    proc = subprocess.run(["bash", script, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    return proc, time.monotonic() - start


@pytest.mark.parametrize("args", [["--help"], ["-h"], ["--threads", "1", "--help"]])
def test_demo_sh_help_answers_at_once_without_setup(args, tmp_path):
    venv = tmp_path / "no-venv-here"
    dot_venv = os.path.join(ROOT, ".venv")
    before = os.stat(dot_venv).st_mtime_ns if os.path.exists(dot_venv) else None
    proc, seconds = demo_sh(*args, venv=str(venv))
    assert proc.returncode == 0, proc.stderr
    assert seconds < 5, f"--help took {seconds:.1f}s: did it run the setup?"
    assert not venv.exists(), "--help created the virtual environment (it ran scripts/setup.sh)"
    after = os.stat(dot_venv).st_mtime_ns if os.path.exists(dot_venv) else None
    assert after == before, "--help touched .venv"
    assert "--threads" in proc.stdout and "--rounds" in proc.stdout
    assert "setup" in proc.stdout and "few minutes" in proc.stdout
    assert "== demo.sh: setting up" not in proc.stdout


def sh_flag_entries(text: str) -> dict:
    """Flag -> its entry's text, from the 'Demo flags' section of demo.sh's usage."""
    section = text[text.index("Demo flags"):]
    section = section[:section.index("\nExamples")] if "\nExamples" in section else section
    entries, current = {}, None
    for line in section.splitlines()[1:]:
        if re.match(r"^  -", line):
            head = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
            flags = re.findall(r"--?[a-z][\w-]*", head)
            current = flags
            for f in flags:
                entries[f] = line
        elif current and line.strip():
            for f in current:
                entries[f] += " " + line.strip()
    return entries


def test_demo_sh_help_lists_the_demos_flags_and_defaults(tmp_path):
    proc, _ = demo_sh("--help", venv=str(tmp_path / "venv"))
    entries = sh_flag_entries(proc.stdout)
    parser = demo.build_parser()
    flags = {s for a in parser._actions for s in a.option_strings}
    assert set(entries) == flags, "scripts/demo.sh's usage and kvcache.demo's parser name different flags"
    for action in parser._actions:
        if action.default in (None, False) or action.dest == "help":
            continue
        for s in action.option_strings:
            assert f"(default: {action.default}" in entries[s], f"{s}: default {action.default} not in {entries[s]!r}"


def test_demo_sh_says_what_setup_does_then_runs_the_demo_with_the_flags(tmp_path):
    """The non-help path, with scripts/setup.sh and the environment stubbed (no real setup, no build)."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(DEMO_SH, tmp_path / "scripts" / "demo.sh")
    (tmp_path / "scripts" / "setup.sh").write_text("echo stub-setup-ran\n")
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "activate").write_text('python() { echo "stub-python $*"; }\n')
    proc, _ = demo_sh("--threads", "1", venv=str(tmp_path / "venv"), cwd=str(tmp_path),
                      script=str(tmp_path / "scripts" / "demo.sh"))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.index("== demo.sh: setting up") < out.index("stub-setup-ran") < out.index("== setup done in")
    assert "a few minutes" in out
    assert "stub-python -m kvcache.demo --threads 1" in out
