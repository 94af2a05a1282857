"""The import graph of ``inferd`` against the layer table of ARCHITECTURE.md: no cycle, and no
import a layer's row does not allow. Read with ``ast``, so every import counts: module-level,
inside functions, under ``TYPE_CHECKING``, and ``importlib.import_module("inferd....")`` with a
literal name."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "inferd"


@dataclass(frozen=True, slots=True)
class Layer:
    name: str
    modules: tuple[str, ...]  # relative to the package; the package itself is "inferd"
    may_import: frozenset[str]  # other layers (its own is always allowed)


def read_layers(architecture_md: Path) -> list[Layer]:
    """The rows of the ``| layer | modules | may import |`` table."""
    rows = [line for line in architecture_md.read_text().splitlines() if line.startswith("|")]
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    assert header == ["layer", "modules", "may import"], header
    layers = []
    for row in rows[2:]:  # past the header and its ---- line
        name, modules, may = (c.strip() for c in row.strip("|").split("|"))
        allowed = frozenset(x.strip() for x in may.split(",") if x.strip())
        layers.append(Layer(name, tuple(re.findall(r"`([^`]+)`", modules)), allowed))
    return layers


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the package directory ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports_of(module: str, path: Path, known: set[str]) -> Iterator[tuple[str, int]]:
    """(imported module of the package, line) for every import statement in ``path``.

    ``from pkg import name`` imports the submodule ``pkg.name`` when there is one, else ``pkg``.
    """
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (dynamic := _dynamic_import(node)) is not None:
            yield _nearest(dynamic, known), node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == PACKAGE:
                    yield _nearest(alias.name, known), node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            if base.split(".")[0] != PACKAGE:
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield (sub if sub in known else _nearest(base, known)), node.lineno


def _dynamic_import(node: ast.AST) -> str | None:
    """The package module a call ``import_module("inferd.x")`` or ``__import__("inferd.x")``
    names by a literal (a deferred import the statements above would miss); else None."""
    if not isinstance(node, ast.Call) or not node.args:
        return None
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    first = node.args[0]
    if name not in ("import_module", "__import__") or not isinstance(first, ast.Constant):
        return None
    target = first.value
    return target if isinstance(target, str) and target.split(".")[0] == PACKAGE else None


def _nearest(name: str, known: set[str]) -> str:
    """The module itself, or the closest package above it that exists."""
    while name not in known and "." in name:
        name = name.rpartition(".")[0]
    return name


def layer_of(module: str, layers: list[Layer]) -> Layer | None:
    """The row naming the module or the deepest package above it."""
    relative = module.removeprefix(PACKAGE + ".") if module != PACKAGE else PACKAGE
    best: tuple[int, Layer] | None = None
    for layer in layers:
        for name in layer.modules:
            if relative == name or relative.startswith(name + "."):
                depth = name.count(".") + 1
                if best is None or depth > best[0]:
                    best = (depth, layer)
    return best[1] if best else None


def import_graph(root: Path) -> dict[str, dict[str, int]]:
    """module -> {imported module: first line}, within the package."""
    files = module_files(root)
    known = set(files)
    graph: dict[str, dict[str, int]] = {}
    for module, path in files.items():
        edges = graph.setdefault(module, {})
        for target, line in imports_of(module, path, known):
            if target != module:
                edges.setdefault(target, line)
    return graph


def layer_violations(graph: dict[str, dict[str, int]], layers: list[Layer]) -> list[str]:
    out = []
    for module, edges in sorted(graph.items()):
        mine = layer_of(module, layers)
        if mine is None:
            out.append(f"{module}: in no layer of ARCHITECTURE.md")
            continue
        for target, line in sorted(edges.items()):
            theirs = layer_of(target, layers)
            if theirs is None or theirs is mine:
                continue  # an unplaced target is reported as a module of its own
            if theirs.name not in mine.may_import:
                out.append(f"{module}:{line} ({mine.name}) imports {target} ({theirs.name})")
    return out


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


@pytest.fixture(scope="module")
def layers() -> list[Layer]:
    return read_layers(REPO / "ARCHITECTURE.md")


@pytest.fixture(scope="module")
def graph() -> dict[str, dict[str, int]]:
    return import_graph(REPO / PACKAGE)


def test_no_import_cycle(graph: dict[str, dict[str, int]]) -> None:
    assert cycles(graph) == []


def test_imports_follow_the_layers(graph: dict[str, dict[str, int]], layers: list[Layer]) -> None:
    assert layer_violations(graph, layers) == []


def test_the_table_names_real_layers_and_the_graph_is_read(
    graph: dict[str, dict[str, int]], layers: list[Layer]
) -> None:
    names = {layer.name for layer in layers}
    assert {"engine", "loading", "models", "serving", "server", "base"} <= names
    for layer in layers:
        assert layer.may_import <= names, layer
    # the walk sees function-level and TYPE_CHECKING imports, and resolves submodules
    assert "inferd.api" in graph["inferd"]  # inside the facade's __getattr__
    assert "inferd.server.sse" in graph["inferd.server.generation"]  # from inferd.server import sse


def test_the_server_sees_the_engine_through_serving_only(layers: list[Layer]) -> None:
    """The server's engine types come through ``serving/interface.py``; the layers below
    serving are not the server's to import, however deferred the import."""
    (server,) = (layer for layer in layers if layer.name == "server")
    assert not server.may_import & {"engine", "loading", "models", "layers", "kernels"}


def test_a_deferred_import_below_serving_is_caught(tmp_path: Path, layers: list[Layer]) -> None:
    pkg = tmp_path / PACKAGE
    for rel, text in {
        "__init__.py": "",
        "engine/__init__.py": "",
        "engine/sampling.py": "",
        "layers/__init__.py": "",
        "layers/linear.py": "",
        "loading/__init__.py": "",
        "loading/lora.py": "",
        "serving/__init__.py": "",
        "serving/interface.py": "from inferd.engine.sampling import *\n",
        "server/__init__.py": "",
        "server/handler.py": "from inferd.serving.interface import *\n\n\n"
        "def f():\n    from inferd.engine.sampling import SamplingParams\n\n\n"
        "def g():\n    import importlib\n    importlib.import_module('inferd.loading.lora')\n"
        "    return __import__('inferd.layers.linear')\n",
    }.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    assert layer_violations(import_graph(pkg), layers) == [
        "inferd.server.handler:5 (server) imports inferd.engine.sampling (engine)",
        "inferd.server.handler:11 (server) imports inferd.layers.linear (layers)",
        "inferd.server.handler:10 (server) imports inferd.loading.lora (loading)",
    ]


def test_a_cycle_and_an_upward_import_are_caught(tmp_path: Path, layers: list[Layer]) -> None:
    pkg = tmp_path / PACKAGE
    for rel, text in {
        "__init__.py": "",
        "engine/__init__.py": "",
        "engine/core.py": "def f():\n    from inferd.serving import spec\n",
        "serving/__init__.py": "",
        "serving/spec.py": "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from inferd.engine.core import f\n",
    }.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    graph = import_graph(pkg)
    assert cycles(graph) == [["inferd.engine.core", "inferd.serving.spec"]]
    assert layer_violations(graph, layers) == [
        "inferd.engine.core:2 (engine) imports inferd.serving.spec (serving)"
    ]
