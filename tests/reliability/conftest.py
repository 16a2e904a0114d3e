"""Shared pieces of the fault and bad-input matrix (shared/RELIABILITY.md).

Each row's test prints its figure (``row N: ...``) and hands it to :func:`figure`, which
also lists every figure in pytest's terminal summary, so ``pytest tests/reliability``
shows the matrix without ``-s``.

Large loads run at a CI size by default; ``EVENTBUS_FULL_MATRIX=1`` runs the sizes of the
matrix (1e6 events, 100 MiB payloads).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


# -- the c10d store rows (11, 12, 14, 17, 19, 20, 21) ----------------------------------------

STORE_SERVER = r"""
import datetime, sys, time
from torch.distributed import TCPStore
store = TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True, wait_for_workers=False,
                 timeout=datetime.timedelta(seconds=30))
print("up", flush=True)
time.sleep(3600)
"""


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


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


def drain_until_ended(receiver: Any, *, senders: int = 1, timeout: float = 60.0) -> bool:
    """Drain ``receiver`` until ``senders`` senders sent their end marker (True) or the
    timeout passed (False); then drain what is left."""
    import time

    deadline = time.monotonic() + timeout
    ended = False
    while time.monotonic() < deadline:
        receiver.drain_once()
        seen = receiver.stats()["senders"]
        if len(seen) >= senders and all(s["ended"] for s in seen.values()):
            ended = True
            break
        time.sleep(0.02)
    receiver.drain(timeout=10)
    return ended
