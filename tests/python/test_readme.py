"""The README's code blocks run as written.

Every ```python block runs on its own, in a fresh interpreter on CPU, from an
empty folder (what a reader who pastes it gets); a block that cannot starts
with ``# needs: cuda`` or ``# needs: model`` and is only counted. The C++
snippet is built and run by scripts/check_wheel.sh against the installed
wheel (its C++ route).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MARKERS = ("# needs: cuda", "# needs: model")


def readme() -> str:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return f.read()


def python_blocks():
    """(section heading, block) for every ```python block, in order."""
    text = readme()
    out = []
    for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
        heads = re.findall(r"^#+ (.+)$", text[: m.start()], re.M)
        out.append((heads[-1] if heads else "top", m.group(1)))
    return out


BLOCKS = python_blocks()


def test_readme_python_api_example_runs():
    example = BLOCKS[0][1]
    scope: dict = {}
    exec(compile(example, "README.md", "exec"), scope)
    cache = scope["cache"]
    # the example ends with a ragged update: one length per row
    assert cache.length.tolist() == [25, 31, 18, 6]
    assert cache.keys.shape == (4, 2, 512, 32)


def test_readme_marks_few_blocks():
    assert len(BLOCKS) >= 7
    marked = [h for h, b in BLOCKS if b.startswith(MARKERS)]
    assert len(marked) <= 2, f"blocks that do not run on CPU: {marked}"
    for head, block in BLOCKS:
        if block.startswith("# needs:"):
            assert block.startswith(MARKERS), block.splitlines()[0]
        compile(block, f"README.md ({head})", "exec")  # marked blocks are at least valid Python


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=[f"{i}-{h[:30]}" for i, (h, _) in enumerate(BLOCKS)])
def test_readme_python_block_runs_alone(index, tmp_path):
    head, block = BLOCKS[index]
    if block.startswith(MARKERS):
        pytest.skip(block.splitlines()[0])
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env.pop("PYTHONPATH", None)
    # From an empty folder: nothing of the checkout is importable but the installed package.
    proc = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"README block in '{head}' failed:\n{block}\n--- stderr:\n{proc.stderr[-4000:]}"


def test_readme_stateful_block_prints_the_lengths(tmp_path):
    """The printed lengths in the stateful block's comment are what it prints."""
    head, block = next((h, b) for h, b in BLOCKS if "reset_rows_kv_layer_cache" in b)
    expected = re.search(r"print\(cache\.length\)\s+# (.+)", block).group(1).strip()
    proc = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == expected
