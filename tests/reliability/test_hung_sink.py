"""Row 5: a sink that blocks forever. Memory stays bounded, drops are counted per
reason, close() and interpreter exit return within their budget.

Runs in a child interpreter so that peak RSS is the load's own and a hang shows as a
timeout. EVENTBUS_FULL_MATRIX=1 records the matrix's 1,000,000 events.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable

import pytest
from matrix import full_or
from matrix import subprocess_env

N = full_or(200_000, 1_000_000)
MAX_EVENTS = 10_000
BUDGET_S = 1.0

SCRIPT = r"""
import json, resource, sys, threading, time
from eventbus import Bus
from eventbus.subscribers.queued import QueuedSink

n, overflow, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
bus = Bus("row5")
forever = threading.Event()

def hung(batch):
    forever.wait()

sink = QueuedSink(hung, name="hung", max_events=MAX_EVENTS, max_bytes=64 << 20,
                  overflow=overflow, close_timeout=BUDGET)
bus.subscribe("METRIC", on_event=sink)

def rss_mib():
    # VmHWM: this image's peak RSS. (ru_maxrss would carry the forking parent's over exec.)
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

out = {"rss_start": rss_mib()}
for i in range(n):
    bus.record("METRIC", step=i, data={"loss": 0.5, "note": "x" * 200})
    if i == n // 10:
        out["rss_10pct"] = rss_mib()
out["rss_peak"] = rss_mib()
out["before_close"] = sink.stats()
if mode == "close":
    t0 = time.monotonic()
    out["close_ok"] = sink.close(timeout=BUDGET)
    out["close_s"] = time.monotonic() - t0
    out["after_close"] = sink.stats()
    bus.record("METRIC", step=n)  # after close: counted, not lost silently
    out["after_late"] = sink.stats()
out["exiting_at"] = time.time()
print(json.dumps(out), flush=True)
""".replace("MAX_EVENTS", str(MAX_EVENTS)).replace("BUDGET", str(BUDGET_S))


def _run(overflow: str, mode: str) -> tuple[dict[str, object], float]:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(N), overflow, mode],
                          env=subprocess_env(), check=False, capture_output=True, text=True,
                          timeout=300)
    ended = time.time()
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1]), ended


def _accounted(stats: dict) -> int:  # type: ignore[type-arg]
    return stats["handled"] + stats["failed"] + stats["pending"] + sum(stats["dropped"].values())


@pytest.mark.slow
@pytest.mark.parametrize("overflow", ["drop-newest", "drop-oldest"])
def test_hung_sink_bounded_counted_and_closes_in_budget(
    overflow: str, figure: Callable[[int, str], None],
) -> None:
    """N events into a sink that never returns: RSS does not grow past the queue's bound
    after it filled; every event is delivered, pending or dropped per reason (none
    unaccounted); close() returns within its budget (+ slack for a loaded machine); an
    event recorded after close is counted as dropped "closed"."""
    out, _ = _run(overflow, "close")
    before, after, late = out["before_close"], out["after_close"], out["after_late"]
    growth = out["rss_peak"] - out["rss_10pct"]
    assert growth < 32, f"RSS grew {growth:.0f} MiB after the queue filled"
    assert _accounted(before) == N
    assert before["dropped"]["queue full"] >= N - MAX_EVENTS - before["pending"]
    assert before["pending"] <= MAX_EVENTS + 1_000  # the queue plus the batch in the sink
    assert out["close_ok"] is False
    assert out["close_s"] < BUDGET_S + 2.0  # slack for a loaded machine, not a speed test
    assert _accounted(after) == N
    assert after["dropped"].get("closed before delivery", 0) > 0
    assert late["dropped"]["closed"] == 1
    dropped = sum(after["dropped"].values())
    figure(5, f"{overflow}: peak RSS {out['rss_peak']:.0f} MiB (+{growth:.1f} after 10%), "
              f"dropped {dropped:,}/{N:,} {after['dropped']}, close {out['close_s']:.2f} s "
              f"(budget {BUDGET_S} s)")


@pytest.mark.slow
def test_hung_sink_does_not_hang_interpreter_exit(figure: Callable[[int, str], None]) -> None:
    """No explicit close: the atexit hook closes the hung sink within its close_timeout,
    so the process still exits."""
    out, ended = _run("drop-newest", "exit")
    exit_s = ended - out["exiting_at"]
    assert exit_s < BUDGET_S + 10.0
    figure(5, f"interpreter exit with a hung sink took {exit_s:.2f} s (budget {BUDGET_S} s)")
