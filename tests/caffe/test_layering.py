"""keras_cct.caffe's three layers import one way: io <- net <- train <- the cct commands
(``commands``, ``train_commands``, ``cli_args``, ``tools``) and the pycaffe API (``pycaffe``); io imports no deep-learning library; no module
imports the package root; no module is longer than about 600 lines but the generated schema.
Read from the source (every import statement, at any depth), so a lazy import counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CAFFE = Path(__file__).resolve().parents[2] / "keras_cct" / "caffe"
LIBRARIES = ("keras", "tensorflow", "tf_keras", "jax", "jaxlib", "torch")
COMMANDS = ("keras_cct.caffe.commands", "keras_cct.caffe.train_commands",
            "keras_cct.caffe.cli_args", "keras_cct.caffe.tools", "keras_cct.caffe.pycaffe")
#: what each layer may not import
FORBIDDEN = {
    "io": ("keras_cct.caffe.net", "keras_cct.caffe.train", "keras_cct.layers",
           "keras_cct.lowering", "keras_cct.strategy", "keras_cct.ops", "keras_cct.devices",
           "keras_cct.export") + COMMANDS,
    "net": ("keras_cct.caffe.train",) + COMMANDS,
    "train": COMMANDS,
}


def _imports(path: Path):
    """(module, line) of every import in ``path``; ``from a import b`` gives ``a.b`` too."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module, node.lineno
            for alias in node.names:
                yield f"{node.module}.{alias.name}", node.lineno


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_imports_run_one_way(layer):
    bad = []
    for path in sorted((CAFFE / layer).rglob("*.py")):
        for name, line in _imports(path):
            banned = FORBIDDEN[layer] + (LIBRARIES if layer == "io" else ())
            if any(_under(name, b) for b in banned):
                bad.append(f"{path.relative_to(CAFFE)}:{line} imports {name}")
    assert not bad, "\n".join(bad)


def test_no_module_imports_the_package_root():
    root_names = {"keras_cct", "keras_cct.caffe"}
    bad = []
    for path in sorted(CAFFE.rglob("*.py")):
        if path.name == "__init__.py" and path.parent == CAFFE:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import) and any(a.name in root_names for a in node.names):
                bad.append(f"{path.relative_to(CAFFE)}:{node.lineno}")
            elif isinstance(node, ast.ImportFrom) and node.module in root_names:
                bad.append(f"{path.relative_to(CAFFE)}:{node.lineno}")
    assert not bad, "import the module that defines a name, not a package root: " + ", ".join(bad)


def test_modules_stay_small():
    long = [f"{p.relative_to(CAFFE)} ({n} lines)" for p in sorted(CAFFE.rglob("*.py"))
            if p.name != "_schema.py" and (n := len(p.read_text().splitlines())) > 620]
    assert not long, long
