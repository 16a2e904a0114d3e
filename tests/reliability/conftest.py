"""Shared pieces of the fault and bad-input matrix (shared/RELIABILITY.md).

Each row's test prints its figure (``row N: ...``) and hands it to :func:`figure`, which
also lists every figure in pytest's terminal summary, so ``pytest tests/reliability``
shows the matrix without ``-s``.

Large loads run at a CI size by default; ``EVENTBUS_FULL_MATRIX=1`` runs the sizes of the
matrix (1e6 events, 100 MiB payloads).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from collections.abc import Iterator
from pathlib import Path

import pytest

import eventbus.bus as bus_module
from eventbus import Bus

REPO_ROOT = Path(__file__).resolve().parents[2]

#: run the matrix at its full sizes
FULL = os.environ.get("EVENTBUS_FULL_MATRIX", "") not in ("", "0")

_FIGURES: list[tuple[str, str]] = []


def full_or(ci: int, full: int) -> int:
    """``full`` under EVENTBUS_FULL_MATRIX=1, else ``ci``."""
    return full if FULL else ci


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for a child python that imports the tree under test."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])]
    )
    env.update(extra)
    return env


@pytest.fixture
def figure(request: pytest.FixtureRequest) -> Callable[[int | str, str], None]:
    """``figure(row, text)``: print ``row N: text`` and list it in the terminal summary."""

    def report(row: int | str, text: str) -> None:
        line = f"row {row}: {text}" if isinstance(row, int) else f"{row}: {text}"
        print(line)
        _FIGURES.append((request.node.nodeid, line))

    return report


@pytest.fixture
def bus() -> Iterator[Bus]:
    """A fresh, non-strict bus."""
    yield Bus("reliability")


@pytest.fixture
def report_interval(monkeypatch: pytest.MonkeyPatch) -> Callable[[float], None]:
    """Set the bus's failure-report interval (restored after the test)."""

    def set_interval(seconds: float) -> None:
        monkeypatch.setattr(bus_module, "REPORT_INTERVAL_S", seconds)

    return set_interval


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _FIGURES:
        return
    terminalreporter.section("reliability matrix figures")
    size = "full (EVENTBUS_FULL_MATRIX=1)" if FULL else "CI default"
    terminalreporter.write_line(f"sizes: {size}; python {sys.version.split()[0]}")
    for nodeid, line in _FIGURES:
        terminalreporter.write_line(f"{line}    [{nodeid.split('::')[-1]}]")
