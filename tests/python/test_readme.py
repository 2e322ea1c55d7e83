"""The code blocks of the README and of the docs' pages run as written.

Every ```python block runs on its own, in a fresh interpreter on CPU, from an
empty folder (what a reader who pastes it gets); a block that cannot starts
with ``# needs: cuda`` or ``# needs: model`` and is only compiled. The
README's C++ snippet is built and run by scripts/check_wheel.sh against the
installed wheel (its C++ route).
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MARKERS = ("# needs: cuda", "# needs: model")


def readme(path: str = "README.md") -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def python_blocks(path: str = "README.md"):
    """(section heading, block) for every ```python block of ``path``, in order."""
    text = readme(path)
    out = []
    for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
        heads = re.findall(r"^#+ (.+)$", text[: m.start()], re.M)
        out.append((heads[-1] if heads else "top", m.group(1)))
    return out


BLOCKS = python_blocks()
# The docs' pages (the guides, the design notes): (page, heading, block).
PAGES = sorted(rel for rel in (os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"),
                                                                          recursive=True))
               if not rel.startswith(os.path.join("docs", "performance") + os.sep))
PAGE_BLOCKS = [(page, head, block) for page in PAGES for head, block in python_blocks(page)]


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


def _runs_alone(where: str, block: str, cwd) -> None:
    if block.startswith(MARKERS):
        compile(block, where, "exec")  # at least valid Python
        pytest.skip(block.splitlines()[0])
    assert not block.startswith("# needs:"), f"{where}: unknown marker {block.splitlines()[0]!r} (one of {MARKERS})"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env.pop("PYTHONPATH", None)
    # From an empty folder: nothing of the checkout is importable but the installed package. Run
    # from a file, as a reader who saves it does (TorchScript reads its functions' source).
    script = os.path.join(cwd, "example.py")
    with open(script, "w", encoding="utf-8") as f:
        f.write(block)
    proc = subprocess.run([sys.executable, script], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"{where} failed:\n{block}\n--- stderr:\n{proc.stderr[-4000:]}"


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=[f"{i}-{h[:30]}" for i, (h, _) in enumerate(BLOCKS)])
def test_readme_python_block_runs_alone(index, tmp_path):
    head, block = BLOCKS[index]
    _runs_alone(f"README block in '{head}'", block, tmp_path)


def test_docs_pages_have_blocks():
    # The guides hold examples: an empty list would make the test below collect nothing.
    assert len(PAGE_BLOCKS) >= 15 and any(p.startswith(os.path.join("docs", "guides")) for p, _, _ in PAGE_BLOCKS)


@pytest.mark.parametrize("index", range(len(PAGE_BLOCKS)),
                         ids=[f"{p}-{h[:30]}" for p, h, _ in PAGE_BLOCKS])
def test_docs_python_block_runs_alone(index, tmp_path):
    page, head, block = PAGE_BLOCKS[index]
    _runs_alone(f"{page} block in '{head}'", block, tmp_path)


def test_readme_stateful_block_prints_the_lengths(tmp_path):
    """The printed lengths in the stateful block's comment are what it prints."""
    head, block = next((h, b) for h, b in BLOCKS if "reset_rows_kv_layer_cache" in b)
    expected = re.search(r"print\(cache\.length\)\s+# (.+)", block).group(1).strip()
    proc = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == expected
