"""Helpers of the fault and bad-input matrix (imported by the row tests as ``matrix``;
the fixtures are in conftest.py)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

#: how `eventbus run` starts each worker: the worker bootstrap, then the script or code
WORKER = (sys.executable, "-m", "eventbus.app.worker")

#: run the matrix at its full sizes (EVENTBUS_FULL_MATRIX=1)
FULL = os.environ.get("EVENTBUS_FULL_MATRIX", "") not in ("", "0")

STORE_SERVER = r"""
import datetime, sys, time
from torch.distributed import TCPStore
store = TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True, wait_for_workers=False,
                 timeout=datetime.timedelta(seconds=30))
print("up", flush=True)
time.sleep(3600)
"""


def full_or(ci: int, full: int) -> int:
    """``full`` under EVENTBUS_FULL_MATRIX=1, else ``ci``."""
    return full if FULL else ci


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for a child python that imports the tree under test.

    The progress watch is off (``EVENTBUS_PROGRESS=off``) unless ``extra`` says otherwise.
    The launcher's worker variables are dropped unless given in ``extra``: an in-process
    agent test may have left them in ``os.environ``, and a child that inherits them
    attaches a store forwarder (and imports torch) it was not meant to.
    """
    env = {k: v for k, v in os.environ.items()
           if k not in ("EVENTBUS_AGENT_STORE", "EVENTBUS_STORE_PREFIX")}
    # The rows count the script's own events: the progress watch's heartbeats (eventbus's
    # own, 1/s while the script records) would be counted with them. Its tests are
    # tests/test_progress_watch.py and tests/test_health_plain.py; a row may turn it on.
    env["EVENTBUS_PROGRESS"] = "off"
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])]
    )
    env.update(extra)
    return env


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def drain_until_ended(receiver: Any, *, senders: int = 1, timeout: float = 60.0) -> bool:
    """Drain ``receiver`` until ``senders`` senders sent their end marker (True) or the
    timeout passed (False); then drain what is left."""
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


#: row 17's loads: one string and one mapping far over the limits (CI size / full size)
STRING_CHARS = full_or(8 << 20, 100 << 20)
KEYS = full_or(100_000, 1_000_000)


def deep_dict(depth: int) -> dict[str, Any]:
    """``{"a": {"a": ...}}`` nested ``depth`` levels."""
    root: dict[str, Any] = {}
    cur = root
    for _ in range(depth):
        cur["a"] = {}
        cur = cur["a"]
    return root


@contextlib.contextmanager
def small_tmpfs(mnt: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted on ``mnt`` for a test, unmounted after it (remounted
    writable first, in case the test made it read-only); skips where mounting is not
    permitted."""
    mnt.mkdir(exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root; this user is not")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                          capture_output=True, text=True, timeout=30, check=False)
    if done.returncode != 0:
        pytest.skip(f"mount -t tmpfs is not permitted here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(mnt)], capture_output=True,
                       timeout=30, check=False)
        subprocess.run(["umount", "-l", str(mnt)], timeout=30, check=False)
