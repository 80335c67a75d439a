"""The package's dependencies point one way, without cycles, and private APIs stay in ortlab/_compat.

Every ``import`` of every module is read from its source (those inside functions too;
``if TYPE_CHECKING:`` blocks are not imports at run time). Each module sits on a layer
(see ARCHITECTURE.md): a module may import its own layer and the layers below, never
one above; no two modules may import each other, directly or around a cycle; and only
``ortlab/_compat/`` may name a private torch or onnxruntime API.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "ortlab"

# Lowest first. A module's layer is that of the longest prefix listed here.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("ortlab._compat", "ortlab.errors", "ortlab.config", "ortlab._openmp", "ortlab._versions", "ortlab._cache_files",
     "ortlab._workers", "ortlab._index_guards"),
    ("ortlab.provenance", "ortlab.sizes", "ortlab.stages", "ortlab.torchlib", "ortlab.report", "ortlab.artifacts"),
    ("ortlab.capture",),
    ("ortlab.partition",),
    ("ortlab.onnx",),
    ("ortlab.placement",),
    ("ortlab.runtime",),
    ("ortlab.ondevice", "ortlab.optim"),
    ("ortlab.pipeline",),
    ("ortlab.ortmodule", "ortlab.models"),
    ("ortlab.inspect",),
    ("ortlab.ui",),
    ("ortlab.hf", "ortlab.examples"),
    ("ortlab.cli", "ortlab.__main__", "ortlab"),
)
PRIVATE_ROOTS = ("torch", "onnxruntime", "ort", "onnxscript", "onnx_ir", "onnx")


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> int:
    best, layer = -1, None
    for i, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, layer = len(name), i
    assert layer is not None, f"{module} is on no layer: add it to LAYERS (and ARCHITECTURE.md)"
    return layer


class _Imports(ast.NodeVisitor):
    """Imports (outside ``if TYPE_CHECKING:``) and private names of one module."""

    def __init__(self, module: str, is_package: bool) -> None:
        self.module, self.is_package = module, is_package
        self.imports: set[str] = set()
        self.private: list[str] = []

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def _absolute(self, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = self.module.split(".")
        if not self.is_package:
            base = base[:-1]
        base = base[: len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def _check_private(self, name: str, line: int) -> None:
        parts = name.split(".")
        if parts[0] in PRIVATE_ROOTS and any(p.startswith("_") and not p.startswith("__") for p in parts[1:]):
            self.private.append(f"{self.module}:{line} {name}")

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.imports.add(alias.name)
            self._check_private(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = self._absolute(node)
        for alias in node.names:
            full = f"{base}.{alias.name}"
            self.imports.add(full)
            self._check_private(full, node.lineno)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        chain, cur = [], node
        while isinstance(cur, ast.Attribute):
            chain.append(cur.attr)
            cur = cur.value
        if isinstance(cur, ast.Name):
            self._check_private(".".join([cur.id, *reversed(chain)]), node.lineno)
            return  # the whole chain is checked; its inner Attributes are prefixes of it
        self.generic_visit(node)


def _scan() -> tuple[dict[str, set[str]], list[str]]:
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    private: list[str] = []
    for name, path in modules.items():
        visitor = _Imports(name, path.name == "__init__.py")
        visitor.visit(ast.parse(path.read_text(), str(path)))
        targets = set()
        for imported in visitor.imports:
            # "ortlab.stages.label" is module ortlab.stages; "ortlab.ui" a package.
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name and imported.startswith("ortlab"):
                targets.add(imported)
        graph[name] = targets
        if not name.startswith("ortlab._compat"):
            private += visitor.private
    return graph, private


GRAPH, PRIVATE = _scan()


def test_every_module_sits_on_a_layer():
    for module in GRAPH:
        _layer(module)


def test_imports_point_down_the_layers():
    upward = []
    for module, targets in GRAPH.items():
        if module == "ortlab":  # the package facade sits on top and may reach anything
            continue
        for target in targets:
            if target == "ortlab":
                continue  # submodules import the package for its lazy attributes only at run time
            if _layer(target) > _layer(module):
                upward.append(f"{module} (layer {_layer(module)}) imports {target} (layer {_layer(target)})")
    assert not upward, "imports that point up the layers:\n" + "\n".join(sorted(upward))


def test_no_import_cycles():
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH.get(v, ()):
            if w == "ortlab":
                continue
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
                cycles.append(sorted(component))

    for module in sorted(GRAPH):
        if module not in index:
            visit(module)
    assert not cycles, f"import cycles: {cycles}"


def test_private_apis_only_in_compat():
    assert not PRIVATE, "private torch/onnxruntime APIs outside ortlab/_compat:\n" + "\n".join(PRIVATE)


@pytest.mark.parametrize("bad", [
    "import torch._dynamo",
    "from torch._subclasses.fake_tensor import FakeTensorMode",
    "x = torch._ops.OpOverload",
    "from onnxruntime.capi import _pybind_state",
])
def test_the_private_api_check_catches(bad):
    visitor = _Imports("ortlab.example", False)
    visitor.visit(ast.parse(bad))
    assert visitor.private, bad


def test_the_layer_check_catches_an_upward_import():
    visitor = _Imports("ortlab.runtime.session", False)
    visitor.visit(ast.parse("def f():\n    from ortlab.ui import monitor\n"))
    assert "ortlab.ui.monitor" in visitor.imports and _layer("ortlab.ui") > _layer("ortlab.runtime.session")
