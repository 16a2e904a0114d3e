"""Fixtures of the fault and bad-input matrix (the cases of docs/guarantees.md).

Each row's test prints its figure (``row N: ...``) through :func:`figure`, which also lists
every figure in pytest's terminal summary, so ``pytest tests/reliability`` shows the
matrix without ``-s``. Helpers the row modules import live in matrix.py.

Large loads run at a CI size by default; ``EVENTBUS_FULL_MATRIX=1`` runs the sizes of the
matrix (1e6 events, 100 MiB payloads).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

import pytest
from matrix import FULL
from matrix import STORE_SERVER
from matrix import subprocess_env

import eventbus.bus as bus_module
from eventbus import Bus

_FIGURES: list[tuple[str, str]] = []


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


@pytest.fixture
def store() -> Iterator[Any]:
    """A real TCPStore server (libuv, the default) on a free port, in this process."""
    import datetime

    dist = pytest.importorskip("torch.distributed")
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    yield server


@pytest.fixture
def store_process() -> Iterator[Callable[[int], subprocess.Popen[str]]]:
    """``start(port)``: a TCPStore server in a child process (so a test can kill it);
    every one started is killed at teardown."""
    started: list[subprocess.Popen[str]] = []

    def start(port: int) -> subprocess.Popen[str]:
        proc = subprocess.Popen([sys.executable, "-c", STORE_SERVER, str(port)],
                                env=subprocess_env(), stdout=subprocess.PIPE, text=True)
        started.append(proc)
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "up"
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
