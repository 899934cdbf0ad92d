"""The package's structure, read from its source: the import graph of fused_attn's and score_mods'
modules (every import statement, function-level ones included) has no loop, and no arrow from a
lower layer to a higher one; engines never import each other."""

from __future__ import annotations

import ast
import os
from typing import Dict, List, Set

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: lowest first: a module may import its own layer and the ones below it
LAYERS = (
    ("score_mods", lambda m: m == "score_mods" or m.startswith("score_mods.")),
    ("base", lambda m: m in {f"fused_attn.{n}" for n in (
        "problem", "spec", "layouts", "validation", "length_checks", "memo", "cache_registry", "cache", "key_range",
        "static", "mod_values", "extensions", "planning", "mod_axes", "graph_store", "graph_file", "engine_table",
        "engine_speed", "device_facts", "tensor_kind", "progress", "split_runner", "lse_backward")}),
    ("backends", lambda m: m.startswith("fused_attn.backends")),
    ("engines", lambda m: m == "fused_attn.engines"),
    ("runtime", lambda m: m in {"fused_attn.plan", "fused_attn.autograd", "fused_attn.ops", "fused_attn.abstract"}),
    ("entry points", lambda m: m in {f"fused_attn.{n}" for n in (
        "functional", "module", "varlen", "doc_packed", "graph_cache", "testing")}),
    ("distributed and integrations", lambda m: m.startswith(("fused_attn.distributed", "fused_attn.integrations"))),
    ("top", lambda m: True),  # the package, its wiring and the CLI
)


def _modules() -> Dict[str, str]:
    out = {}
    for pkg in ("fused_attn", "score_mods"):
        for folder, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(folder, f)
                    name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    out[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


def _graph() -> Dict[str, Set[str]]:
    mods = _modules()
    edges: Dict[str, Set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        package = m.split(".") if path.endswith("__init__.py") else m.split(".")[:-1]
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else node.module
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != m and not m.startswith(t + "."):
                    edges[m].add(t)
    return edges


def _layer(m: str) -> int:
    return next(i for i, (_, inside) in enumerate(LAYERS) if inside(m))


def test_no_import_loops():
    edges = _graph()
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    loops: List[List[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                loops.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert not loops, f"import loops: {loops}"


def test_arrows_point_down():
    up = [f"{m} ({LAYERS[_layer(m)][0]}) -> {t} ({LAYERS[_layer(t)][0]})"
          for m, ts in sorted(_graph().items()) for t in sorted(ts) if _layer(t) > _layer(m)]
    assert not up, "imports from a lower layer to a higher one:\n" + "\n".join(up)


def test_engines_never_import_each_other():
    def engine_of(m: str) -> str:
        if m.startswith("fused_attn.backends.cudnn"):
            return "cudnn"
        if m.startswith("fused_attn.backends.reference"):
            return "reference"
        if m.startswith("fused_attn.backends.torch"):
            return "torch"
        if m.startswith("fused_attn.backends.fa4"):
            return "fa4"
        return ""

    crossing = [(m, t) for m, ts in _graph().items() for t in ts
                if engine_of(m) and engine_of(t) and engine_of(m) != engine_of(t)]
    assert not crossing, f"engines importing each other: {crossing}"


def test_the_core_names_no_cudnn_version():
    """Only the cuDNN backend's quirk table (and its version gate) speak of cuDNN versions."""
    import re

    pattern = re.compile(r"cuDNN\s*(?:<|>=|<=|>)?\s*9\.\d+")
    found = []
    for m, path in _modules().items():
        if m.startswith("fused_attn.backends.cudnn") or not m.startswith("fused_attn"):
            continue
        for i, line in enumerate(open(path), 1):
            if pattern.search(line):
                found.append(f"{m}:{i}: {line.strip()}")
    assert not found, "cuDNN versions named outside the cuDNN backend:\n" + "\n".join(found)


def test_the_library_never_imports_benchmarks_or_test_code():
    """fused_attn and score_mods are what the wheel ships: no import of the benchmarks package or of
    test helpers (the CLI's `bench` command finds a checkout's benchmarks at run time)."""
    found = []
    for m, path in _modules().items():
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            found += [f"{m}: {n}" for n in names if n.split(".")[0] in ("benchmarks", "helpers", "tests", "conftest")]
    assert not found, found


def test_the_wheel_ships_the_library_only():
    tomllib = pytest.importorskip("tomllib")
    from setuptools import find_packages

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        include = tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]["include"]
    shipped = find_packages(ROOT, include=include)
    assert "fused_attn" in shipped and "score_mods" in shipped
    assert all(p.split(".")[0] in ("fused_attn", "score_mods") for p in shipped), shipped


def test_no_source_file_over_400_lines():
    """Small modules with one job each: no file of the library or the benchmarks over 400 lines."""
    limit = 400
    long = []
    for pkg in ("fused_attn", "score_mods", "benchmarks"):
        for folder, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(folder, f)
                    with open(path) as fh:
                        n = sum(1 for _ in fh)
                    if n > limit:
                        long.append(f"{os.path.relpath(path, ROOT)}: {n} lines")
    assert not long, f"files over {limit} lines:\n" + "\n".join(long)
