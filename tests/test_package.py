"""The packages themselves: light imports, explicit public names."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import eventbus
import eventbus.publishers
import eventbus.subscribers
from tests.conftest import ROOT
from tests.conftest import subprocess_env


def test_import_does_not_pull_in_torch() -> None:
    """import eventbus, eventbus.publishers, eventbus.subscribers loads no torch, numpy nor
    orjson (and prints its import time)."""
    code = ("import sys, time; t = time.perf_counter(); import eventbus, eventbus.publishers, "
            "eventbus.subscribers; ms = (time.perf_counter() - t) * 1000; "
            "print(f'{ms:.1f}', 'torch' in sys.modules, 'numpy' in sys.modules, "
            "'orjson' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=subprocess_env(), timeout=60, check=True).stdout.split()
    print(f"import eventbus, publishers, subscribers: {out[0]} ms")
    assert out[1:] == ["False", "False", "False"]  # orjson: on the first batch


def test_the_core_and_its_wire_import_no_socket_nor_logging() -> None:
    """Every process imports the core and the wire (the worker hook reads the wire's
    variables): neither loads ``socket`` (the store's clients live in
    ``eventbus.store_client``, imported by a sender or receiver) nor ``logging``."""
    code = ("import sys, eventbus, eventbus.wire, eventbus.exit_ledger, eventbus.preemption; "
            "print([m for m in ('socket', 'logging', 'eventbus.store_client') "
            "if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=subprocess_env(), timeout=60, check=True).stdout.strip()
    assert out == "[]"


@pytest.mark.parametrize("module", [eventbus, eventbus.publishers, eventbus.subscribers])
def test_all_is_sorted_and_complete(module: object) -> None:
    """__all__ is sorted, names only what exists, and every public attribute is in it."""
    names = module.__all__  # type: ignore[attr-defined]
    assert names == sorted(names)
    for name in names:
        assert hasattr(module, name), name
    import types

    public = {n for n, v in vars(module).items()
              if not n.startswith("_") and not isinstance(v, types.ModuleType)
              and n not in {"annotations", "TYPE_CHECKING"}}
    assert public <= set(names), sorted(public - set(names))


def test_python_dash_m_eventbus_help_works() -> None:
    """python -m eventbus --help lists the subcommands."""
    out = subprocess.run([sys.executable, "-m", "eventbus", "--help"], capture_output=True,
                         text=True, env=subprocess_env(), timeout=60, check=True).stdout
    for command in ("run", "trace", "plot", "tail"):
        assert command in out


#: what a module-level side effect of ``import eventbus`` would change, read in a child
_SIDE_EFFECTS = r"""
import faulthandler, json, os, signal, sys, threading
def state():
    return {"threads": sorted(t.name for t in threading.enumerate()),
            "handlers": {int(s): repr(signal.getsignal(s)) for s in signal.valid_signals()
                         if s not in (signal.SIGKILL, signal.SIGSTOP)},
            "os": {n: id(getattr(os, n)) for n in ("_exit", "kill", "fork")},
            "signal": {n: id(getattr(signal, n)) for n in ("signal", "getsignal")},
            "faulthandler": faulthandler.is_enabled(), "torch": "torch" in sys.modules,
            "files": sorted(os.listdir(sys.argv[1]))}
before = state()
import eventbus, eventbus.publishers, eventbus.subscribers
eventbus.record(eventbus.EventType.WORKER_EXIT, worker_id=0, exit_code=0)
after = state()
print(json.dumps([before == after, {k: (before[k], after[k]) for k in before
                                    if before[k] != after[k]}]))
"""


@pytest.mark.parametrize("env", [
    {},
    {"EVENTBUS_AGENT_STORE": "127.0.0.1:29500", "EVENTBUS_STORE_PREFIX": "eventbus/r/0",
     "RANK": "0", "EVENTBUS_STACK_SIGNAL": "SIGUSR2"},
    {"EVENTBUS_AGENT_STORE": "bogus", "EVENTBUS_STACK_SIGNAL": "SIGBOGUS", "RANK": "x"},
], ids=["plain", "worker-environment", "bad-values"])
def test_import_eventbus_is_inert_in_any_environment(tmp_path: Path, env: dict[str, str]
                                                     ) -> None:
    """import eventbus (and its publishers and subscribers) starts no thread, installs no
    signal handler, replaces nothing of os or signal, arms no faulthandler, writes no file
    and imports no torch: with no eventbus variables, with a worker's, and with bad ones."""
    out = subprocess.run(
        [sys.executable, "-c", _SIDE_EFFECTS, str(tmp_path)], capture_output=True, text=True,
        env=subprocess_env(EVENTBUS_STACK_DIR=str(tmp_path), **env), timeout=60, check=True)
    same, changed = json.loads(out.stdout)
    assert same, changed
    assert out.stderr == ""


@pytest.mark.slow  # pip builds a wheel from a copy of the tree: ~5 s
def test_the_wheel_installs_one_import_name(tmp_path: Path) -> None:
    """A wheel built from this tree holds one top-level import name, ``eventbus``, with
    the publishers, the subscribers and the application under it."""
    # From a copy of the tree as git sees it: a build in the checkout would reuse (and
    # leave) its build/ folder, whose stale files would go into the wheel.
    source = tmp_path / "source"
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                            "--exclude-standard"], cwd=ROOT, check=True, timeout=60,
                           capture_output=True).stdout.decode().split("\0")
    for name in filter(None, files):
        origin, copy = ROOT / name, source / name
        if origin.is_symlink() or origin.is_file():
            copy.parent.mkdir(parents=True, exist_ok=True)
            if origin.is_symlink():
                copy.symlink_to(os.readlink(origin))
            else:
                shutil.copy2(origin, copy)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                    str(tmp_path), str(source)], check=True, timeout=600,
                   capture_output=True)
    (wheel,) = tmp_path.glob("eventbus-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    dist_info = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
    top_level = {n.split("/")[0] for n in names} - dist_info
    assert top_level == {"eventbus"}
    for module in ("eventbus/publishers/__init__.py", "eventbus/subscribers/queued.py",
                   "eventbus/app/cli.py", "eventbus/app/worker/__main__.py",
                   "eventbus/app/plugins.py", "eventbus/publishers/py.typed",
                   # the job view's page ships in the package (no CDN)
                   "eventbus/app/ui/static/index.html", "eventbus/app/ui/static/app.js",
                   "eventbus/app/ui/static/app.css"):
        assert module in names, module
    (entry_points,) = (n for n in names if n.endswith("entry_points.txt"))
    with zipfile.ZipFile(wheel) as zf:
        assert "eventbus = eventbus.app.cli:main" in zf.read(entry_points).decode()


def test_every_package_of_the_tree_is_in_the_wheel() -> None:
    """pyproject's package list is explicit: a folder with an __init__.py that it misses
    would import here (from the checkout) and be absent from the wheel
    (eventbus.app.protocol was, once)."""
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # 3.11+

    root = Path(__file__).resolve().parents[1]
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    folders = {"eventbus": "eventbus", **{name: folder for name, folder in
                                          config["package-dir"].items()}}
    found = set()
    for name, folder in folders.items():
        base = root / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            if any(part.startswith((".", "__")) for part in rel.parts):
                continue
            if name == "eventbus" and rel.parts[:1] in (("publishers",), ("subscribers",),
                                                        ("app",)):
                continue  # the links to the other folders
            found.add(".".join([name, *rel.parts]))
    assert found - listed == set(), f"add these to [tool.setuptools] packages: {found - listed}"
