"""Row 13: a process that records 10k events and exits normally loses none of them; what
it records after the recorder shut down is counted, not lost silently."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from matrix import subprocess_env

from eventbus.subscribers.jsonl import read_jsonl

N = 10_000
LATE = 5

SCRIPT = r"""
import atexit, json, sys
import eventbus

path, n, late, how = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]

def record_after_shutdown():
    # registered before eventbus.subscribers.queued is imported, so it runs after its exit hook
    for i in range(late):
        eventbus.record("METRIC", step=n + i)
    print(json.dumps(recorder.stats()), flush=True)

atexit.register(record_after_shutdown)

from eventbus.subscribers.jsonl import JsonlRecorder

recorder = JsonlRecorder(path)
eventbus.get_default_bus().subscribe(eventbus.ALL, on_event=recorder)
for i in range(n):
    eventbus.record("METRIC", step=i, data={"loss": 1.0 / (i + 1)})
if how == "sys.exit":
    sys.exit(0)
"""


def _run(tmp_path: Path, how: str) -> tuple[Path, dict[str, object]]:
    path = tmp_path / f"{how}.jsonl"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(path), str(N), str(LATE), how],
                          env=subprocess_env(), check=False, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return path, json.loads(proc.stdout.splitlines()[-1])


def test_normal_exit_writes_every_line(
    tmp_path: Path, figure: Callable[[int, str], None],
) -> None:
    """Falling off the end of the script and sys.exit(0): all 10,000 events are in the
    file, in order, with no torn line; the 5 recorded after the exit hook closed the
    recorder are counted as dropped ("closed")."""
    for how in ("end-of-script", "sys.exit"):
        path, stats = _run(tmp_path, how)
        read = read_jsonl(path)
        steps = [r["step"] for r in read]
        assert steps == list(range(N)), how
        assert read.torn == 0 and read.foreign == 0
        assert stats["lines_written"] == N
        assert stats["dropped"] == {"closed": LATE}, stats
        figure(13, f"{how}: lines {len(steps):,}/{N:,}; after shutdown: {LATE} counted as "
                   f"dropped {stats['dropped']}")
