"""The agent's own acts on its workers' processes: read a child's exit without reaping it,
and stop a set of processes (SIGTERM, then SIGKILL after a grace). Torch-free.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

__all__ = ["peek_exit", "stop_processes"]


def peek_exit(pid: int) -> int | None:
    """The exit code of child ``pid`` if it has exited (``-signum`` if a signal ended it),
    without reaping it; ``None`` while it runs or when that cannot be known.

    Torch's process context, on the first failed worker, terminates the others before it
    returns the failure: ``waitid(WNOWAIT)`` lets the agent see each exit first, and torch
    still reaps and reports it as usual."""
    waitid = getattr(os, "waitid", None)
    if waitid is None:
        return None
    try:
        info = waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except (ChildProcessError, OSError):
        return None
    if info is None or info.si_pid == 0:
        return None
    if info.si_code == os.CLD_EXITED:
        return int(info.si_status)
    return -int(info.si_status)


def stop_processes(pids: Mapping[int, Any], *, grace_s: float,
                   alive: Callable[[int], bool], signum: int = signal.SIGTERM) -> None:
    """``signum`` (SIGTERM) to each pid, and SIGKILL to those still ``alive`` after
    ``grace_s`` seconds."""
    for pid in pids:
        if alive(pid):
            _kill(pid, signum)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(alive(pid) for pid in pids):
        time.sleep(0.05)
    for pid in pids:
        if alive(pid):
            _kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and any(alive(pid) for pid in pids):
        time.sleep(0.05)


def _kill(pid: int, signum: int) -> None:
    with contextlib.suppress(OSError):
        os.kill(pid, signum)
