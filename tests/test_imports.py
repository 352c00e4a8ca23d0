"""The package's import rules, read from the source (every import statement at any depth, so a
lazy import counts too): no import circle between keras_cct's modules, no module takes a name
from the package root, which offers everything (``from keras_cct import HybridConv2D``; a
submodule such as ``keras_cct.errors`` is fine; the sub-packages' fronts are the circle test's), no module over about 600 lines but the
generated Caffe schema. (keras_cct.caffe's own one-way rules: tests/caffe/test_layering.py.)"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

PACKAGE = Path(__file__).resolve().parents[1] / "keras_cct"
MAX_LINES = 620
GENERATED = {"keras_cct/caffe/io/_schema.py"}


def _modules() -> Dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(path: Path) -> Iterator[Tuple[str, List[str], int]]:
    """(module, names taken from it, line) of every absolute import in ``path``."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, [], node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, [a.name for a in node.names], node.lineno


def _graph() -> Dict[str, Set[str]]:
    """module -> the keras_cct modules importing it runs (a package's __init__ included)."""
    graph: Dict[str, Set[str]] = {m: set() for m in MODULES}
    for mod, path in MODULES.items():
        for target, names, _ in _imports(path):
            if not target.startswith("keras_cct"):
                continue
            full = [target] + [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES]
            for name in full:
                parts = name.split(".")
                for i in range(2, len(parts) + 1):  # the root runs for everyone: left out
                    dep = ".".join(parts[:i])
                    if dep in MODULES and dep != mod and not mod.startswith(dep + "."):
                        graph[mod].add(dep)
    return graph


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    assert _cycles(_graph()) == []


def test_the_circle_finder_finds_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_takes_names_from_the_package_root():
    bad = []
    for mod, path in MODULES.items():
        for target, names, line in _imports(path):
            if target == "keras_cct" and mod != "keras_cct":
                taken = [n for n in names if f"{target}.{n}" not in MODULES]
                if taken:
                    bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} takes {taken} "
                               f"from {target}")
    assert not bad, "import the module that defines the name:\n" + "\n".join(bad)


def test_modules_stay_small():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(PACKAGE.parent))
        n = len(path.read_text().splitlines())
        if rel not in GENERATED and n > MAX_LINES:
            long.append(f"{rel} ({n} lines)")
    assert not long, long
