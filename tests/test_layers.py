"""The layer rule of docs/architecture.md, read from the source with ``ast``.

Four layers, arrows down only: the core (``eventbus``), then ``publishers`` and
``subscribers`` side by side, then the application (``eventbus.app``). ``python -m
eventbus`` (``eventbus/__main__.py``) is the application's entry point and belongs to it.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ROOT

#: repository folder -> the module prefix it installs as (pyproject.toml's package-dir)
FOLDERS = {
    "eventbus": "eventbus",
    "publishers": "eventbus.publishers",
    "subscribers": "eventbus.subscribers",
    "eventbus_app": "eventbus.app",
}
CORE, PUBLISHERS, SUBSCRIBERS, APP = FOLDERS.values()

#: the core's only lazy import of a layer above, required by the API:
#: get_logging_handler() returns a subscriber
ALLOWED_LAZY_CORE_IMPORTS = {
    ("eventbus", "get_logging_handler", "eventbus.subscribers.log_handler"),
}


def _module_name(folder: str, path: Path) -> str:
    parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([FOLDERS[folder], *parts])


def _modules() -> dict[str, Path]:
    """Every module of the four folders, read from the folders themselves (os.walk does
    not follow the checkout's eventbus/{publishers,subscribers,app} links)."""
    found: dict[str, Path] = {}
    for folder in FOLDERS:
        for directory, _, files in os.walk(ROOT / folder):
            for name in sorted(files):
                if name.endswith(".py"):
                    path = Path(directory) / name
                    found[_module_name(folder, path)] = path
    return found


def _layer(module: str) -> str:
    if module == "eventbus.__main__":
        return APP
    for layer in (PUBLISHERS, SUBSCRIBERS, APP):
        if module == layer or module.startswith(layer + "."):
            return layer
    return CORE


def _ours(module: str) -> bool:
    return module == CORE or module.startswith(CORE + ".")


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module, module: str, known: set[str]
             ) -> Iterator[tuple[str, str | None]]:
    """(imported project module, enclosing function or None at module level) for every
    import that runs: ``if TYPE_CHECKING:`` blocks do not."""

    def targets(node: ast.Import | ast.ImportFrom) -> Iterator[str]:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
            return
        base = node.module or ""
        if node.level:  # relative import
            package = module.split(".")
            anchor = package[:len(package) - node.level + (1 if module in _packages else 0)]
            base = ".".join([*anchor, base] if base else anchor)
        for alias in node.names:
            full = f"{base}.{alias.name}"
            yield full if full in known else base

    def walk(nodes: list[ast.stmt], function: str | None) -> Iterator[tuple[str, str | None]]:
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in targets(node):
                    if _ours(target):
                        yield target, function
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from walk(node.body, function or node.name)
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                yield from walk(node.orelse, function)
            else:
                for field in ("body", "orelse", "finalbody", "handlers"):
                    children = getattr(node, field, None)
                    if children:
                        yield from walk(children, function)

    yield from walk(tree.body, None)


_packages = {name for name, path in _modules().items() if path.name == "__init__.py"}


def _graph() -> dict[str, list[tuple[str, str | None]]]:
    modules = _modules()
    known = set(modules)
    return {name: list(_imports(ast.parse(path.read_text()), name, known))
            for name, path in modules.items()}


GRAPH = _graph()


def test_the_core_imports_no_layer_above_at_module_level() -> None:
    """No module of the core imports publishers, subscribers or the application when it is
    imported; its only lazy imports of them are the two the API requires."""
    module_level = [(m, t) for m, imports in GRAPH.items() if _layer(m) == CORE
                    for t, function in imports if function is None and _layer(t) != CORE]
    assert module_level == []
    lazy = {(m, function, t) for m, imports in GRAPH.items() if _layer(m) == CORE
            for t, function in imports if function is not None and _layer(t) != CORE}
    assert lazy == ALLOWED_LAZY_CORE_IMPORTS


@pytest.mark.parametrize(("layer", "other"), [(PUBLISHERS, SUBSCRIBERS),
                                              (SUBSCRIBERS, PUBLISHERS)])
def test_publishers_and_subscribers_never_import_each_other(layer: str, other: str) -> None:
    """Events in and events out sit side by side: no import either way, lazy ones included."""
    crossing = [(m, t) for m, imports in GRAPH.items() if _layer(m) == layer
                for t, _ in imports if _layer(t) == other]
    assert crossing == []


def test_nothing_below_imports_the_application() -> None:
    """The application composes the layers below; none of them imports it, even lazily
    (``python -m eventbus`` is the application's own entry point)."""
    upward = [(m, t) for m, imports in GRAPH.items() if _layer(m) != APP
              for t, _ in imports if _layer(t) == APP]
    assert upward == []


def test_no_module_level_import_cycle() -> None:
    """Module-level imports between the project's modules form no cycle (a package's
    ``__init__`` importing its submodules is an edge like any other)."""
    edges = {m: sorted({t for t, function in imports if function is None and t != m})
             for m, imports in GRAPH.items()}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for target in edges.get(node, []):
            if state.get(target) == 1:
                cycles.append([*stack[stack.index(target):], target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)
    assert cycles == []


def test_the_check_sees_the_imports_it_guards() -> None:
    """The scanner is not blind: it finds known imports of each kind (module level, lazy,
    relative-free ``from package import module``)."""
    assert ("eventbus.wire", None) in GRAPH["eventbus.subscribers.store_forwarder"]
    assert ("eventbus.subscribers.log_handler", "get_logging_handler") in GRAPH["eventbus"]
    assert ("eventbus.app.cli", None) in GRAPH["eventbus.__main__"]
    assert any(t == "eventbus.publishers.store_receiver" and f is None
               for t, f in GRAPH["eventbus.app.launcher.store_transport"])
