"""The layer rule of docs/architecture.md, read from the source with ``ast``.

Four layers, arrows down only: the core (``eventbus``), then ``publishers`` and
``subscribers`` side by side, then the application (``eventbus.app``). ``python -m
eventbus`` (``eventbus/__main__.py``) is the application's entry point and belongs to it.

Inside the application the same rule holds between its parts (:data:`APP_ORDER`, bottom to
top): the shared base modules, then the worker, the readers and the sinks side by side,
then the job view, the launcher, and the command line on top.
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

#: the application's parts, bottom to top: a part is a module or a package right under
#: ``eventbus.app`` (``app``: the package itself; ``__main__``: ``python -m eventbus``).
#: A module imports, even lazily, only its own part and the parts of the levels below
#: (docs/architecture.md, "The application's parts"); parts on one level never import
#: each other
APP_ORDER: tuple[tuple[str, ...], ...] = (
    # shared by all: the stack reading, the plugin API, the agent <-> worker protocol,
    # the pause of garbage collection for large builds
    ("plugins", "protocol", "heap"),
    # job health: the stacks, what a silent rank does, the watches, the culprit, the judge
    ("health",),
    # one sentence per event (reads the stacks)
    ("sentences",),
    ("worker", "readers", "sinks"),
    # the job view
    ("ui",),
    ("launcher",),
    ("cli",),
    ("app", "__main__"),
)
APP_LEVEL = {part: level for level, parts in enumerate(APP_ORDER) for part in parts}

#: the launcher's rooms, bottom to top (docs/architecture.md, "The launcher's rooms"): a
#: module of a sub-package imports, even lazily, only its own room and the rooms below;
#: rooms on one level never import each other. The modules right under the launcher (the
#: agent, the command line's parser, the job-health plugin: the wiring) may import any.
LAUNCHER = f"{APP}.launcher"
LAUNCHER_ORDER: tuple[tuple[str, ...], ...] = (
    ("slurm",),
    ("cli",),
    ("group",),
    ("decisions",),
    ("drain", "recovery", "transport", "hosts"),
)
LAUNCHER_LEVEL = {room: level for level, rooms in enumerate(LAUNCHER_ORDER) for room in rooms}

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


def _part(module: str) -> str:
    """The application's part ``module`` belongs to (see :data:`APP_ORDER`)."""
    if module == "eventbus.__main__":
        return "__main__"
    if module == APP:
        return "app"
    return module[len(APP) + 1:].split(".", maxsplit=1)[0]


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


def _cycles(edges: dict[str, list[str]]) -> list[list[str]]:
    """The cycles a depth-first walk of ``edges`` meets (each as its nodes, first = last)."""
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
    return cycles


def test_no_module_level_import_cycle() -> None:
    """Module-level imports between the project's modules form no cycle (a package's
    ``__init__`` importing its submodules is an edge like any other)."""
    edges = {m: sorted({t for t, function in imports if function is None and t != m})
             for m, imports in GRAPH.items()}
    assert _cycles(edges) == []


def _app_imports() -> list[tuple[str, str, str | None]]:
    """(module, imported module, enclosing function) for every import between two
    modules of the application, lazy ones included."""
    return [(m, t, function) for m, imports in GRAPH.items() if _layer(m) == APP
            for t, function in imports if _layer(t) == APP]


def test_every_part_of_the_application_has_its_place() -> None:
    """Every module of the application belongs to a part named in APP_ORDER (a new module
    or package right under eventbus_app/ is given its level there)."""
    unplaced = sorted(m for m in GRAPH if _layer(m) == APP and _part(m) not in APP_LEVEL)
    assert unplaced == []


def test_no_part_of_the_application_imports_one_above_or_beside_it() -> None:
    """Inside the application, a module imports (even lazily, TYPE_CHECKING aside) only
    its own part and the parts below it: the base modules import no package of the
    application, the readers, sinks and worker neither each other nor the job view or the
    launcher, the job view not the launcher."""
    wrong = sorted((m, t, function) for m, t, function in _app_imports()
                   if _part(t) != _part(m)
                   and APP_LEVEL.get(_part(t), -1) >= APP_LEVEL.get(_part(m), -1))
    assert wrong == []


def test_no_cycle_between_the_applications_parts() -> None:
    """The parts of the application and their imports (lazy ones included) form no
    cycle: shared code lives below the parts that use it."""
    edges: dict[str, set[str]] = {}
    for m, t, _ in _app_imports():
        if _part(t) != _part(m):
            edges.setdefault(_part(m), set()).add(_part(t))
    assert _cycles({part: sorted(targets) for part, targets in edges.items()}) == []


def test_the_check_sees_the_imports_it_guards() -> None:
    """The scanner is not blind: it finds known imports of each kind (module level, lazy,
    relative-free ``from package import module``)."""
    assert ("eventbus.wire", None) in GRAPH["eventbus.subscribers.store_forwarder"]
    assert ("eventbus.subscribers.log_handler", "get_logging_handler") in GRAPH["eventbus"]
    assert ("eventbus.app.cli", None) in GRAPH["eventbus.__main__"]
    assert any(t == "eventbus.publishers.store_receiver" and f is None
               for t, f in GRAPH["eventbus.app.launcher.transport.store"])
    # inside the application: a base module at module level, a lazy import of a package
    assert ("eventbus.app.sentences", None) in GRAPH["eventbus.app.sinks.base"]
    assert ("eventbus.app.readers.tail", "_tail") in GRAPH["eventbus.app.cli"]
    assert _part("eventbus.app.readers.tail") == "readers" and _part(APP) == "app"


def _room(module: str) -> str | None:
    """The launcher's sub-package ``module`` belongs to; None for the launcher's own
    modules (the wiring) and for modules outside the launcher."""
    if not module.startswith(LAUNCHER + "."):
        return None
    rest = module[len(LAUNCHER) + 1:].split(".")
    return rest[0] if len(rest) > 1 or rest[0] in LAUNCHER_LEVEL else None


def test_every_room_of_the_launcher_has_its_place() -> None:
    """Every sub-package of the launcher is named in LAUNCHER_ORDER."""
    unplaced = sorted({room for m in GRAPH if (room := _room(m)) is not None
                       and room not in LAUNCHER_LEVEL})
    assert unplaced == []


def test_no_room_of_the_launcher_imports_one_above_or_beside_it() -> None:
    """A room imports (even lazily, TYPE_CHECKING aside) only itself and the rooms below it,
    never the launcher's wiring: so the rooms form no package cycle either."""
    wrong = []
    for m, t, function in _app_imports():
        room = _room(m)
        if room is None or not t.startswith(LAUNCHER):
            continue
        target = _room(t)
        if target == room:
            continue
        if target is None or LAUNCHER_LEVEL[target] >= LAUNCHER_LEVEL[room]:
            wrong.append((m, t, function))
    assert sorted(wrong) == []


#: a class past either bound is split by concern, as the judge and the decider were split
#: out of the agent
MAX_CLASS_LINES = 500
MAX_CLASS_METHODS = 25


def test_no_class_is_past_the_size_a_reader_can_hold() -> None:
    """Every class of the four folders stays within MAX_CLASS_LINES lines and
    MAX_CLASS_METHODS methods (its own ``def``s, properties included)."""
    too_big = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                methods = sum(isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
                              for item in node.body)
                if lines > MAX_CLASS_LINES or methods > MAX_CLASS_METHODS:
                    too_big.append(f"{name}.{node.name}: {lines} lines, {methods} methods")
    assert too_big == []
