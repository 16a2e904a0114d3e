"""Row 15: ``kill -9`` while the JSONL recorder writes ~1 MiB lines. The reader recovers
every complete line and counts at most one torn line; the next writer starts on a fresh
line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from matrix import subprocess_env

import eventbus
from eventbus.subscribers.jsonl import JsonlRecorder
from eventbus.subscribers.jsonl import read_jsonl

# a child writing ~40 MiB before the kill: ~5 s on 2 cores, in `make test-slow`; the fast
# loop has tests/test_jsonl.py's in-process check of a file cut mid-line
pytestmark = pytest.mark.slow

# under LIMITS.max_line_bytes, in strings under LIMITS.max_string: written whole, one line
# per event
LINE_CHARS = 1_000_000

SCRIPT = r"""
import sys
import eventbus
from eventbus.subscribers.jsonl import JsonlRecorder

recorder = JsonlRecorder(sys.argv[1])
eventbus.get_default_bus().subscribe(eventbus.ALL, on_event=recorder)
blob = ["x" * 10_000] * (int(sys.argv[2]) // 10_000)
i = 0
while True:
    eventbus.record("METRIC", step=i, data={"blob": blob})
    i += 1
"""


def test_kill_9_mid_write_loses_at_most_the_line_being_written(
    tmp_path: Path, figure: Callable[[int, str], None],
) -> None:
    """SIGKILL once ~40 MiB are on disk (the writer appends batches of up to 64 MiB, so the
    kill usually lands inside a write): every complete line parses and the steps are
    0..N-1 without a hole; at most one line is torn; a new recorder on the same file ends
    the torn line first, so its own lines all parse."""
    path = tmp_path / "events.jsonl"
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(path), str(LINE_CHARS)],
                            env=subprocess_env(), stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if path.exists() and path.stat().st_size > 40 * LINE_CHARS:
                break
            time.sleep(0.01)
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:] if proc.stderr else ""
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL

    read = read_jsonl(path)
    steps = [r["step"] for r in read]
    assert steps == list(range(len(steps)))
    assert read.torn <= 1
    assert read.foreign == 0
    seen = read.records + read.torn
    torn_at_end = not path.read_bytes().endswith(b"\n")

    bus = eventbus.Bus("row15-next-writer")
    recorder = JsonlRecorder(path)
    bus.subscribe(eventbus.ALL, on_event=recorder)
    for i in range(3):
        bus.record("EPOCH_END", epoch=i)
    assert recorder.close(timeout=10)
    again = read_jsonl(path)
    records = list(again)
    assert [r["epoch"] for r in records if r["type"] == "EPOCH_END"] == [0, 1, 2]
    assert again.records == read.records + 3
    assert again.torn == read.torn
    figure(15, f"recovered {read.records}/{seen} lines (torn {read.torn}, file ended "
               f"mid-line: {torn_at_end}); next writer: 3/3 lines on fresh lines")
