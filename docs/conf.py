"""Sphinx configuration of kvcache's documentation (built by scripts/docs.sh into build/docs)."""

import os
import sys

# Sphinx (autodoc + napoleon + MyST), as PyTorch and FlashInfer use: the API pages come from the
# Google-style docstrings, and the guides stay Markdown that also reads well on GitHub.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "docs", "_ext"))

project = "kvcache"
copyright = "kvcache authors, Apache-2.0"
author = "kvcache authors"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "myst_parser",
    "kvcache_docs",  # docs/_ext: the API of every module's public names, the Operators page
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "_ext", "performance/*.json", "README.md"]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3  # [text](page.md#a-heading) links work as on GitHub

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_class_signature = "separated"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

# Names from other projects (no intersphinx: the build reaches no network). Everything of
# kvcache's own must resolve, so nitpicky mode (-n) fails a broken cross-reference.
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|transformers|typing|collections|dataclasses|numpy)(\..*)?"),
    (r"py:class", r"(Tensor|optional|callable|dtype|device|Cache|Ellipsis|PretrainedConfig|PreTrainedConfig)"),
    (r"py:class", r"(int|float|str|bool|dict|list|tuple|object|None|NoneType|type)"),
    (r"py:meth", r"get_max_length"),  # transformers' name before 5.16, not ours
]

html_theme = "furo"
html_title = "kvcache"
html_static_path = []
