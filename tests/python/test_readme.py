"""The README's Python example runs as written."""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_readme_python_api_example_runs():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    example = re.findall(r"```python\n(.*?)```", text, re.S)[0]
    scope: dict = {}
    exec(compile(example, "README.md", "exec"), scope)
    cache = scope["cache"]
    # the example ends with a ragged update: one length per row
    assert cache.length.tolist() == [25, 31, 18, 6]
    assert cache.keys.shape == (4, 2, 512, 32)
