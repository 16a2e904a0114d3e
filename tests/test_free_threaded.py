"""What eventbus does on a free-threaded interpreter (PEP 703): no compiled path.

eventbus/_speedups.c relies on the GIL. setup.py builds no extension where
``Py_GIL_DISABLED`` is set, and eventbus/_compiled.py refuses to import one there, so the
pure-Python path runs. No free-threaded interpreter could be had on the machine these were
written on (docs/run.md, "Tested with"): the decisions are tested as functions here.
"""

from __future__ import annotations

import runpy
import sysconfig
from pathlib import Path
from typing import Any

import pytest

from eventbus import _compiled
from eventbus._compiled import compiled_refused
from tests.conftest import ROOT


def test_the_compiled_path_is_refused_without_a_gil() -> None:
    reason = compiled_refused(pure_python="", gil_disabled=True)
    assert reason is not None and "free-threaded" in reason


def test_the_compiled_path_is_allowed_with_a_gil_unless_disabled() -> None:
    assert compiled_refused(pure_python="", gil_disabled=False) is None
    assert compiled_refused(pure_python="0", gil_disabled=False) is None
    assert compiled_refused(pure_python="1", gil_disabled=False) == "EVENTBUS_PURE_PYTHON is set"


def test_free_threaded_reads_the_build_and_the_running_gil(
        monkeypatch: pytest.MonkeyPatch) -> None:
    gil_build = {"Py_GIL_DISABLED": 0}
    monkeypatch.setattr(sysconfig, "get_config_var", gil_build.get)
    assert not _compiled.free_threaded()
    gil_build["Py_GIL_DISABLED"] = 1
    monkeypatch.setattr(_compiled.sys, "_is_gil_enabled", lambda: False, raising=False)
    assert _compiled.free_threaded()
    # python3.13t -X gil=1: a free-threaded build running with its GIL
    monkeypatch.setattr(_compiled.sys, "_is_gil_enabled", lambda: True, raising=False)
    assert not _compiled.free_threaded()


def _setup_kwargs(monkeypatch: pytest.MonkeyPatch, gil_disabled: object) -> dict[str, Any]:
    setuptools = pytest.importorskip("setuptools")  # a 3.12+ venv may lack it
    seen: dict[str, Any] = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kw: seen.update(kw))
    monkeypatch.setattr(sysconfig, "get_config_var",
                        lambda name: gil_disabled if name == "Py_GIL_DISABLED" else None)
    runpy.run_path(str(Path(ROOT) / "setup.py"))
    return seen


def test_setup_builds_no_extension_for_a_free_threaded_interpreter(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert _setup_kwargs(monkeypatch, 1)["ext_modules"] == []


def test_setup_builds_the_extension_with_a_gil(monkeypatch: pytest.MonkeyPatch) -> None:
    (ext,) = _setup_kwargs(monkeypatch, 0)["ext_modules"]
    assert ext.name == "eventbus._speedups" and ext.optional
