"""The layers' import graph: dependencies point one way, no modules import each other in a circle,
every import names the phalanx namespace, and the package list that installs the namespace names
every package folder."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Each layer and the layers it may import (README, "How it is built").
# ``config`` is the bottom layer: it imports none, and every layer may import it.
ALLOWED: dict[str, set[str]] = {
    "config": set(),
    "protocol": {"config"},
    "kernels": {"config"},
    "models": {"config", "kernels"},
    "worker": {"config", "protocol", "models", "kernels"},
    "executor": {"config", "protocol"},
    "scheduler": {"config", "protocol"},
    "engine": {"config", "scheduler", "executor", "protocol"},
    "server": {"config", "engine", "protocol"},
    "tools": {
        "config",
        "protocol",
        "kernels",
        "models",
        "worker",
        "executor",
        "scheduler",
        "engine",
        "server",
    },
}


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    """Every module ``path`` imports, at any depth (function-level imports count too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def _sources(*folders: str) -> list[Path]:
    return sorted(path for folder in folders for path in (ROOT / folder).rglob("*.py"))


def test_every_layer_imports_only_the_layers_below_it() -> None:
    wrong = []
    for layer, allowed in ALLOWED.items():
        for path in _sources(layer):
            for line, module in _imported_modules(path):
                parts = module.split(".")
                if parts[0] == "phalanx" and len(parts) > 1 and parts[1] not in allowed | {layer}:
                    wrong.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert wrong == []


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["phalanx", *parts])


def _module_graph() -> dict[str, set[str]]:
    """Each module of every layer and the modules of every layer it imports, at any depth
    (``from phalanx.a import b`` names the module ``phalanx.a.b`` where there is one)."""
    modules = {_module_name(path): path for path in _sources(*ALLOWED)}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets |= {
                    f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                    for alias in node.names
                }
        graph[name] = {target for target in targets if target in modules and target != name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    order: dict[str, int] = {}
    lowest: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(module: str) -> None:
        order[module] = lowest[module] = len(order)
        stack.append(module)
        for target in sorted(graph[module]):
            if target not in order:
                visit(target)
                lowest[module] = min(lowest[module], lowest[target])
            elif target in stack:
                lowest[module] = min(lowest[module], order[target])
        if lowest[module] == order[module]:
            group = stack[stack.index(module) :]
            del stack[stack.index(module) :]
            if len(group) > 1:
                circles.append(sorted(group))

    for module in sorted(graph):
        if module not in order:
            visit(module)
    return circles


def test_no_modules_import_each_other_in_a_circle() -> None:
    """Function-level imports count: one that breaks a circle at import time still ties the two
    modules into one piece that can be read, tested or moved only whole."""
    assert _circles(_module_graph()) == []


def test_no_module_imports_a_layer_outside_the_namespace() -> None:
    """``import executor`` would load a second copy of the layer beside ``phalanx.executor``."""
    bare = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in _sources(*ALLOWED, "tests")
        for line, module in _imported_modules(path)
        if module.split(".")[0] in ALLOWED
    ]
    assert bare == []


def test_the_installed_namespace_names_every_package_folder() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {
        "phalanx." + ".".join(init.parent.relative_to(ROOT).parts)
        for layer in ALLOWED
        for init in (ROOT / layer).rglob("__init__.py")
    }
    assert config["package-dir"] == {"phalanx": "."}
    assert sorted(config["packages"]) == sorted(folders)
