"""The package layering, read from the source (CPU): ``kdtree_engine`` (the product, the wheel)
imports nothing of ``kdtree_pipeline`` (the proof), and neither package has an import circle.

Every import statement counts, also one inside a function: a circle held together by imports
inside functions is still a circle (it only moves the failure to the first call).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGES = ("kdtree_engine", "kdtree_pipeline")


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((SRC / pkg).rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules ``name`` imports: ``from a.b import c`` counts as ``a.b.c`` when that is
    a module, else as ``a.b``; relative imports are resolved against the module's package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        for t in targets:
            # the deepest project module the name lies in (``a.b.c.attr`` -> ``a.b.c``)
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def _parents(name: str) -> set[str]:
    """A module's packages: importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first,
    but that is Python's doing, not an arrow of the code's: it is left out of the circles."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Every elementary circle's members, one list per strongly connected component of size > 1
    (Tarjan), edges from a module to its own parent packages ignored."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(g[v] - _parents(v)):
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
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_the_product_imports_nothing_of_the_proof():
    g = graph()
    arrows = sorted(f"{a} -> {b}" for a, bs in g.items() if a.startswith("kdtree_engine")
                    for b in bs if b.startswith("kdtree_pipeline"))
    assert not arrows, "kdtree_engine (the wheel) imports the pipeline: " + "; ".join(arrows)


def test_no_import_circles():
    found = cycles(graph())
    assert not found, "import circles: " + " | ".join(" <-> ".join(c) for c in found)


def test_the_walk_sees_function_level_imports_and_circles(tmp_path, monkeypatch):
    """The checks above could pass by seeing nothing: on a made-up tree, an import inside a
    function is an arrow, and two modules importing each other make a circle."""
    pkg = tmp_path / "kdtree_engine"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from kdtree_engine import b\n    return b\n")
    (pkg / "b.py").write_text("from . import a\n")
    (tmp_path / "kdtree_pipeline").mkdir()
    (tmp_path / "kdtree_pipeline" / "__init__.py").write_text("")
    (tmp_path / "kdtree_pipeline" / "g.py").write_text("import kdtree_engine.a\n")
    monkeypatch.setattr(__import__(__name__), "SRC", tmp_path)
    g = graph()
    assert g["kdtree_engine.a"] == {"kdtree_engine.b"}
    assert g["kdtree_engine.b"] == {"kdtree_engine.a"}
    assert g["kdtree_pipeline.g"] == {"kdtree_engine.a"}
    assert cycles(g) == [["kdtree_engine.a", "kdtree_engine.b"]]
    with pytest.raises(AssertionError, match="import circles"):
        test_no_import_circles()
