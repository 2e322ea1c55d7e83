"""Sphinx directives that generate kvcache's reference pages from the code itself.

``.. kvcache-api:: MODULE`` documents every public name of a module (its ``__all__``, else the
public functions, classes and constants it defines) with autodoc; a name that the module only
re-exports from a module documented elsewhere (``kvcache.rows.rollback_kv_layer_cache`` is
``kvcache.rollback_kv_layer_cache``) becomes a link instead of a second description.

``.. kvcache-operators::`` lists every operator registered as ``torch.ops.kvcache.*``: each
overload's schema, read from the loaded library (``OpOverload._schema``), and its description,
read from the comment block "What each operator does" of ``csrc/ops/operators.h``, the one list of
the operators. An operator without a description there, or a description of an operator that is
not registered, is a build warning (so ``-W`` fails the build): nothing here is typed by hand.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
from typing import Dict, List, Optional, Tuple

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OPERATORS_H = os.path.join(ROOT, "csrc", "ops", "operators.h")
logger = logging.getLogger(__name__)

# Where a name re-exported by several modules is documented (its canonical page).
CANONICAL = ("kvcache", "kvcache.hf")


# --------------------------------------------------------------------------- Python API

def public_names(module_name: str) -> List[str]:
    """The public names of a module: ``__all__`` if it has one, else the functions, classes and
    UPPER_CASE constants defined in it whose names do not start with an underscore."""
    mod = importlib.import_module(module_name)
    names = getattr(mod, "__all__", None)
    if names is not None:
        return list(names)
    out = []
    for name, obj in vars(mod).items():
        if name.startswith("_"):
            continue
        if inspect.isfunction(obj) or inspect.isclass(obj):
            if getattr(obj, "__module__", None) == module_name:
                out.append(name)
        elif name.isupper() and not inspect.ismodule(obj):
            out.append(name)
    return sorted(out)


def documented_elsewhere(module_name: str, name: str) -> Optional[str]:
    """The canonical full name of ``module_name.name`` when another page documents it, else None."""
    if module_name in CANONICAL:
        return None
    obj = getattr(importlib.import_module(module_name), name)
    if not (inspect.isfunction(obj) or inspect.isclass(obj)):
        return None
    for canon in CANONICAL:
        try:
            mod = importlib.import_module(canon)
        except ImportError:
            continue
        if name in getattr(mod, "__all__", ()) and getattr(mod, name) is obj:
            return f"{canon}.{name}"
    return None


def api_lines(module_name: str) -> List[str]:
    """reST for one module's reference: autodoc directives, or links for re-exported names."""
    mod = importlib.import_module(module_name)
    lines = [f".. py:module:: {module_name}", ""]
    links = []
    for name in public_names(module_name):
        obj = getattr(mod, name)
        canon = documented_elsewhere(module_name, name)
        if canon is not None:
            role = "class" if inspect.isclass(obj) else "func"
            links.append(f"* ``{name}``: :py:{role}:`{canon}`")
            continue
        full = f"{module_name}.{name}"
        if inspect.isclass(obj):
            lines += [f".. autoclass:: {full}", "   :members:", ""]
        elif callable(obj):
            lines += [f".. autofunction:: {full}", ""]
        else:
            lines += [f".. autodata:: {full}", "   :no-value:", ""]
    if links:
        lines += ["Also here, documented with the package:", ""] + links + [""]
    return lines


class ApiDirective(SphinxDirective):
    required_arguments = 1

    def run(self):
        module_name = self.arguments[0]
        self.env.note_dependency(importlib.import_module(module_name).__file__)
        return self.parse(api_lines(module_name))

    def parse(self, lines: List[str]):
        node = nodes.container()
        nested_parse_with_titles(self.state, StringList(lines, source=f"<{self.name}>"), node)
        return node.children


# --------------------------------------------------------------------------- operators

def operator_descriptions(path: str = OPERATORS_H) -> Dict[str, str]:
    """``{"update_": text, "update_.Tensor": text, ...}`` from operators.h's description block.

    An entry starts with ``//   name [/ name ...]  text`` (three spaces after the slashes, the
    names separated by `` / ``, two spaces before the text); its continuation lines are indented
    further. The block runs from "What each operator does" to "Adding an operator".
    """
    with open(path, encoding="utf-8") as f:
        text = f.read()
    start = text.index("What each operator does")
    end = text.index("Adding an operator", start)
    out: Dict[str, str] = {}
    names: List[str] = []
    body: List[str] = []

    def flush():
        for n in names:
            out[n] = " ".join(body).strip()

    for line in text[start:end].splitlines()[1:]:
        line = line[2:] if line.startswith("//") else line
        m = re.match(r"^   (\S.*?)  (\S.*)$", line)
        if m and not line.startswith("    "):
            flush()
            names = [n.strip() for n in m.group(1).split(" / ")]
            body = [m.group(2).strip()]
        elif line.strip() and names:
            body.append(line.strip())
    flush()
    return out


def registered_operators() -> List[Tuple[str, str, str]]:
    """``(op, overload name, schema)`` of every ``torch.ops.kvcache`` overload, sorted."""
    import torch

    import kvcache  # noqa: F401  (loads the library)

    # Every name the dispatcher has registered in the namespace ("kvcache::op" or "kvcache::op.overload"),
    # not dir(torch.ops.kvcache), which lists only the packets Python has already resolved.
    names = sorted({n.split("::", 1)[1].split(".", 1)[0] for n in torch._C._dispatch_get_all_op_names()
                    if n.startswith("kvcache::")})
    out = []
    for name in names:
        packet = getattr(torch.ops.kvcache, name)
        for ov in packet.overloads():
            out.append((name, ov, str(getattr(packet, ov)._schema)))
    return out


def rst_escape(text: str) -> str:
    """Description text as reST: `x` spans as literals, and nothing else special."""
    text = text.replace("\\", "\\\\").replace("*", "\\*").replace("|", "\\|")
    text = re.sub(r"(\w)_(?=\W|$)", r"\1\\_", text)  # update_ is not a reference to "update"
    return re.sub(r"`([^`]+)`", r"``\1``", text)


def operator_lines() -> Tuple[List[str], List[str]]:
    """(reST, problems): one section per operator, its overloads' schemas and its description."""
    desc = operator_descriptions()
    ops = registered_operators()
    problems = []
    lines: List[str] = []
    by_op: Dict[str, List[Tuple[str, str]]] = {}
    for name, ov, schema in ops:
        by_op.setdefault(name, []).append((ov, schema))
    seen = set()
    for name, overloads in by_op.items():
        lines += [f".. _op-{name}:", "", f"``{name}``", "-" * (len(name) + 4), "", ".. code-block:: text", ""]
        for ov, schema in overloads:
            lines.append(f"   {schema}")
        lines.append("")
        texts = []
        for ov, _ in overloads:
            key = name if ov == "default" else f"{name}.{ov}"
            seen.add(key)
            if key in desc and desc[key] not in texts:
                texts.append(desc[key])
            elif key not in desc:
                problems.append(f"torch.ops.kvcache.{key} has no description in csrc/ops/operators.h")
        for t in texts:
            lines += [rst_escape(t), ""]
    for key in desc:
        if key not in seen:
            problems.append(f"csrc/ops/operators.h describes {key}, which is not a registered operator")
    return lines, problems


class OperatorsDirective(SphinxDirective):
    def run(self):
        self.env.note_dependency(OPERATORS_H)
        lines, problems = operator_lines()
        for p in problems:
            logger.warning(p, location=(self.env.docname, self.lineno))
        node = nodes.container()
        nested_parse_with_titles(self.state, StringList(lines, source="<kvcache-operators>"), node)
        return node.children


# --------------------------------------------------------------------------- short references

def resolve_short_reference(app, env, node, contnode):
    """Resolves a Python reference that names a kvcache object by a path other than the one it is
    documented under (``:func:`DEFAULT_MAX_STEP``` in kvcache.ring, ``kvcache.ring.attend_ring``,
    documented as ``kvcache.attend_ring``): the one documented kvcache object with that last
    name. Several candidates, or none, leave the reference broken (a warning under ``-n``)."""
    if node.get("refdomain") != "py":
        return None
    target = node.get("reftarget", "")
    short = target.rsplit(".", 1)[-1]
    domain = env.get_domain("py")
    matches = [name for name, obj in domain.objects.items()
               if name.startswith("kvcache") and name.rsplit(".", 1)[-1] == short and not obj.aliased]
    if len(matches) != 1:
        return None
    return domain.resolve_xref(env, node.get("refdoc"), app.builder, "obj", matches[0], node, contnode)


def setup(app):
    app.connect("missing-reference", resolve_short_reference)
    app.add_directive("kvcache-api", ApiDirective)
    app.add_directive("kvcache-operators", OperatorsDirective)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
