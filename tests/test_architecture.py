"""The package's shape, as docs/architecture.md draws it: no import circle, no borrowing of another
module's private names, and each layer importing only the layers below it.

Imports are read from the source (every `import` statement, those inside functions included), so a
lazy import cannot hide a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "dstrain"

# Which parts of the package a layer must never import. The launcher process and the rank
# processes meet only through the run directory (dstrain.rundir) and shared leaf modules.
FORBIDDEN = {
    "dstrain.config": ("dstrain.launcher", "dstrain.rank", "dstrain.tools", "dstrain.models", "dstrain.data"),
    "dstrain.models": ("dstrain.launcher", "dstrain.rank", "dstrain.tools"),
    "dstrain.data": ("dstrain.launcher", "dstrain.rank", "dstrain.tools", "dstrain.models"),
    "dstrain.launcher": ("dstrain.rank",),
    "dstrain.rank": ("dstrain.launcher", "dstrain.cli"),
    "dstrain.tools": ("dstrain.rank", "dstrain.cli"),
    "dstrain.checkpoints": ("dstrain.launcher", "dstrain.rank", "dstrain.tools"),
    "dstrain.rundir": ("dstrain.launcher", "dstrain.rank", "dstrain.tools"),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str) -> list[tuple[str, str]]:
    """(imported module, imported name or '') for every dstrain import in module `name`."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names if alias.name.startswith("dstrain")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import: resolve against this module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base.startswith("dstrain"):
                found += [(base, alias.name) for alias in node.names]
    return found


def _edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {name: set() for name in MODULES}
    for name in MODULES:
        for base, member in _imports(name):
            target = f"{base}.{member}" if f"{base}.{member}" in MODULES else base
            if target in MODULES and target != name:
                edges[name].add(target)
    return edges


def test_the_package_is_read_from_this_checkout():
    assert {"dstrain.cli", "dstrain.launcher.job", "dstrain.rank.worker", "dstrain.rank.loop"} <= set(MODULES)


def test_no_import_circle_between_modules():
    edges = _edges()
    circles, state = [], {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for target in sorted(edges[name]):
            if state.get(target) == "open":
                circles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[name] = "done"

    for name in sorted(edges):
        if name not in state:
            visit(name, [name])
    assert circles == []


def test_no_module_imports_another_modules_private_names():
    borrowed = [f"{name} imports {base}.{member}" for name in MODULES for base, member in _imports(name)
                if member.startswith("_") and not member.startswith("__")]
    assert borrowed == []


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_a_layer_imports_only_what_sits_below_it(layer):
    edges = _edges()
    crossings = [f"{name} -> {target}" for name, targets in edges.items()
                 if name == layer or name.startswith(layer + ".")
                 for target in targets if target.startswith(FORBIDDEN[layer])]
    assert crossings == []


def test_every_module_says_what_it_owns():
    undocumented = [name for name, path in MODULES.items()
                    if ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) is None]
    assert undocumented == []
