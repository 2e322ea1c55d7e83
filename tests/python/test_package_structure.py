"""The Python package's shape: one cache family with no import cycle and no module too big to read.

Read from the sources (ast), not by importing: the rules hold for every import statement,
also those inside functions (except a module's ``__getattr__`` shim for moved names).
"""

from __future__ import annotations

import ast
import os

import pytest

import kvcache

PKG = os.path.dirname(os.path.abspath(kvcache.__file__))
MAX_LINES = 500


def modules():
    """{dotted name: path} of every module of the package."""
    out = {}
    for root, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                rel = os.path.relpath(path, os.path.dirname(PKG))[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                out[".".join(rel)] = path
    return out


def is_package(name, mods):
    return mods[name].endswith("__init__.py")


def resolve(name, mods, node):
    """The package modules an ImportFrom / Import node of module `name` names."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in mods]
    base = name if is_package(name, mods) else name.rsplit(".", 1)[0]
    for _ in range(node.level - 1):
        base = base.rsplit(".", 1)[0]
    target = (base + "." + node.module if node.module else base) if node.level else (node.module or "")
    out = []
    for a in node.names:  # `from .. import cache`: the submodule itself
        if f"{target}.{a.name}" in mods:
            out.append(f"{target}.{a.name}")
        elif target in mods:
            out.append(target)
    return out


def import_graph():
    mods = modules()
    graph = {}
    for name, path in mods.items():
        tree = ast.parse(open(path, encoding="utf-8").read())
        # A module-level __getattr__ that resolves a moved name on first access (the shim that
        # keeps an old import path working) is the one lazy import allowed to point back.
        shims = {id(n) for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "__getattr__"
                 for n in ast.walk(f)}
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in shims:
                deps.update(d for d in resolve(name, mods, node) if d != name)
        graph[name] = deps
    return graph


def test_no_import_cycle():
    graph = import_graph()
    # A package's __init__ imports its submodules by design; a submodule importing its own
    # package (`from . import x`) resolves to the submodule x, not the __init__.
    state = {}
    stack = []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for d in sorted(graph[n]):
            if d == n.rsplit(".", 1)[0] or n.startswith(d + "."):
                continue  # a module reaching its parent package's __init__
            if state.get(d) == "open":
                cycle = stack[stack.index(d):] + [d]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        stack.pop()
        state[n] = "done"

    for n in sorted(graph):
        if n not in state:
            visit(n)


def test_hf_uses_no_private_name_of_another_module():
    mods = modules()
    bad = []
    for name, path in mods.items():
        if not name.startswith("kvcache.hf"):
            continue
        tree = ast.parse(open(path, encoding="utf-8").read())
        aliases = {}  # local alias -> module it names (outside kvcache.hf)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                for target in resolve(name, mods, node):
                    if target.startswith("kvcache.hf"):
                        continue
                    for a in node.names:
                        if a.name.startswith("_"):
                            bad.append(f"{name}: from {target} import {a.name}")
                        if f"{target.rsplit('.', 1)[0]}.{a.name}" in mods or f"kvcache.{a.name}" == target:
                            aliases[a.asname or a.name] = target
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.attr.startswith("_")):
                bad.append(f"{name}: {node.value.id}.{node.attr} ({aliases[node.value.id]})")
    assert not bad, "kvcache.hf reaches private names of other modules:\n" + "\n".join(sorted(set(bad)))


@pytest.mark.parametrize("name", sorted(modules()))
def test_module_is_short_enough_to_read(name):
    with open(modules()[name], encoding="utf-8") as f:
        n = sum(1 for _ in f)
    assert n <= MAX_LINES, f"{name} has {n} lines (at most {MAX_LINES}: split it by what it does)"
