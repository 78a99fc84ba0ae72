"""The package structure, read from the source with ``ast`` (nothing is imported): no import cycles, the one-way
layering ``schemas -> constraints -> decoding -> agent -> bench``, no other package's private names, and no
benchmark (BFCL) code in the product packages.

An import counts wherever it is written, inside functions too (a lazy import that closes a cycle still ties the two
modules together), except under ``if TYPE_CHECKING:`` (never executed).
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import ROOT

SCANNED = ("agent", "constraints", "decoding", "schemas", "bench", "scripts")
PRODUCT = ("schemas", "constraints", "decoding", "agent")  # in layer order: each may import only those before it
# what each package must not import (scripts are tools on top of everything; bench may import any product package)
FORBIDDEN = {"schemas": {"constraints", "decoding", "agent", "bench", "scripts"},
             "constraints": {"decoding", "agent", "bench", "scripts"},
             "decoding": {"agent", "bench", "scripts"},
             "agent": {"bench", "scripts"},
             "bench": {"scripts"}}
# agent -> bench is allowed only lazily, inside functions of the CLI (its ``bfcl`` subcommand runs the benchmark)
LAZY_BENCH_IMPORTERS = {"agent.__main__"}


@dataclass(frozen=True)
class Import:
    importer: str  # module name, e.g. "agent.agent"
    target: str  # the imported module (internal ones only)
    names: tuple[str, ...]  # ``from target import names`` (empty for ``import target``)
    lazy: bool  # inside a function
    line: int


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def python_files(root: Path, packages=SCANNED) -> dict[str, Path]:
    """Module name -> file for every ``.py`` under ``packages`` of ``root``."""
    out = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            if "__pycache__" not in path.parts:
                out[module_name(root, path)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    """(node, lazy) for every import statement, skipping the bodies of ``if TYPE_CHECKING:``."""
    def walk(node, lazy):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for sub in child.orelse:  # the else branch runs
                    yield from walk_one(sub, lazy)
                continue
            yield from walk_one(child, lazy)

    def walk_one(node, lazy):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, lazy
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from walk(node, True)
        else:
            yield from walk(node, lazy)

    yield from walk(tree, False)


def _resolve(name: str, modules: set[str], importer: str) -> str | None:
    """The internal module ``name`` refers to (its longest prefix that is a module; a sibling script for
    ``scripts/``, which import each other through ``sys.path``), or None when it is external."""
    candidates = [name]
    if importer.startswith("scripts."):
        candidates.append(f"scripts.{name}")
    for cand in candidates:
        parts = cand.split(".")
        for n in range(len(parts), 0, -1):
            prefix = ".".join(parts[:n])
            if prefix in modules:
                return prefix
    return None


def imports_of(root: Path, packages=SCANNED) -> list[Import]:
    files = python_files(root, packages)
    modules = set(files)
    out = []
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        for node, lazy in _import_nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    target = _resolve(alias.name, modules, mod)
                    if target is not None:
                        out.append(Import(mod, target, (), lazy, node.lineno))
                continue
            if node.level:  # relative: from the importer's package, one level up per extra dot
                package = mod if is_pkg else mod.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{node.module}" if node.module else package
            else:
                base = node.module or ""
            base_target = _resolve(base, modules, mod)
            if base_target is None:
                continue
            plain = []
            for alias in node.names:
                sub = f"{base_target}.{alias.name}"
                if base_target == base and sub in modules:  # ``from pkg import module``
                    out.append(Import(mod, sub, (), lazy, node.lineno))
                else:
                    plain.append(alias.name)
            if plain:
                out.append(Import(mod, base_target, tuple(plain), lazy, node.lineno))
    return out


def import_graph(imports: list[Import]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for imp in imports:
        if imp.target != imp.importer:
            graph.setdefault(imp.importer, set()).add(imp.target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted; sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def _describe(component: list[str], imports: list[Import]) -> str:
    """The component's modules and one shortest cycle through its first module, each import with its line."""
    inside = set(component)
    edge = {}
    for i in imports:
        if i.importer in inside and i.target in inside and i.importer != i.target:
            edge.setdefault((i.importer, i.target), f"line {i.line}{', lazy' if i.lazy else ''}")
    start = component[0]
    paths = {start: [start]}
    queue = [start]
    cycle = None
    while queue and cycle is None:
        v = queue.pop(0)
        for w in sorted(t for (s, t) in edge if s == v):
            if w == start:
                cycle = paths[v] + [start]
                break
            if w not in paths:
                paths[w] = paths[v] + [w]
                queue.append(w)
    steps = " -> ".join(f"{a} ({edge[a, b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {start}"
    return f"{{{', '.join(component)}}}: {steps}"


@pytest.fixture(scope="module")
def imports():
    return imports_of(ROOT)


def test_there_is_no_import_cycle(imports):
    found = cycles(import_graph(imports))
    assert not found, "import cycles:\n" + "\n".join(_describe(c, imports) for c in found)


def test_packages_import_only_the_layers_below(imports):
    bad = []
    for imp in imports:
        src, dst = imp.importer.split(".")[0], imp.target.split(".")[0]
        if dst not in FORBIDDEN.get(src, set()):
            continue
        if src == "agent" and dst == "bench" and imp.lazy and imp.importer in LAZY_BENCH_IMPORTERS:
            continue
        bad.append(f"{imp.importer} (line {imp.line}{', lazy' if imp.lazy else ''}) imports {imp.target}")
    assert not bad, "imports against the layering schemas -> constraints -> decoding -> agent -> bench:\n" + \
        "\n".join(bad)


def test_no_module_imports_another_packages_private_names(imports):
    bad = []
    for imp in imports:
        if imp.importer.split(".")[0] == imp.target.split(".")[0]:
            continue
        private = [p for p in imp.target.split(".") if p.startswith("_") and not p.startswith("__")]
        private += [n for n in imp.names if n.startswith("_") and not n.startswith("__")]
        if private:
            bad.append(f"{imp.importer} (line {imp.line}) imports {', '.join(private)} from {imp.target}")
    assert not bad, "private names imported across packages:\n" + "\n".join(bad)


def test_product_packages_hold_no_benchmark_code():
    """BFCL (the benchmark's question set) lives in bench/; only the CLI's ``bfcl`` subcommand names it."""
    allowed = {ROOT / "agent" / "__main__.py"}
    bad = []
    for pkg in PRODUCT:
        for path in sorted((ROOT / pkg).rglob("*")):
            if not path.is_file() or "__pycache__" in path.parts or path in allowed:
                continue
            n = path.read_bytes().decode("utf-8", "replace").lower().count("bfcl")
            if n:
                bad.append(f"{path.relative_to(ROOT)}: {n}")
    assert not bad, "product files that mention bfcl (move the benchmark code to bench/):\n" + "\n".join(bad)


# -- the checker itself, on a made-up tree -------------------------------------------------------------------------
def test_checker_finds_lazy_cycles_and_ignores_type_checking_imports(tmp_path):
    files = {
        "p/__init__.py": "from .a import A\n",
        "p/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\nA = 1\n",
        "p/b.py": "def f():\n    from p import c\n",
        "p/c.py": "import p.b\nfrom . import a\nfrom q import _hidden\n",
        "q/__init__.py": "_hidden = 1\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = imports_of(tmp_path, ("p", "q"))
    graph = import_graph(found)
    assert graph == {"p": {"p.a"}, "p.b": {"p.c"}, "p.c": {"p.b", "p.a", "q"}}  # a -> b only under TYPE_CHECKING
    assert cycles(graph) == [["p.b", "p.c"]]
    assert [i.lazy for i in found if i.importer == "p.b"] == [True]
    assert [i.names for i in found if i.target == "q"] == [("_hidden",)]
