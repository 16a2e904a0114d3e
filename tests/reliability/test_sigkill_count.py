"""A SIGKILLed worker's last events reach the agent or are counted as lost, with their true
number (issue 25, item 3).

A flooding worker is killed with SIGKILL at a random moment, 20 times (a fresh worker,
forked from one that imported torch, each time; each its own rank of one attempt). The
agent's store transport drains their queues of a real TCPStore while they run, and at its
exit reads their record counters. Each worker keeps its own truth in a shared mapping:
record() calls begun and returned. Per worker:

* the agent's accounting is exact: delivered + reported lost = its record counter;
* the counter is the truth: at least the calls that returned, at most those begun (the
  one call in flight when the kill came counts if its event was already queued);
* so the reported loss is the true loss, to that one call in flight.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import queue
import random
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import eventbus
from eventbus import EventType
from eventbus.app.launcher.transport.store import StoreTransport
from eventbus.app.plugins import RendezvousInfo
from eventbus.exit_ledger import ENV_LEDGER_DIR
from eventbus.exit_ledger import read_counters
from eventbus.wire import ENV_BELL
from eventbus.wire import ENV_PREFIX
from tests.conftest import ROOT
from tests.conftest import subprocess_env

torch_dist = pytest.importorskip("torch.distributed")

pytestmark = pytest.mark.slow

KILLS = 20


def _reader(proc: subprocess.Popen[str]) -> queue.Queue[str]:
    """The lines of ``proc``'s stdout, read on a daemon thread ("" at its end)."""
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put("")

    threading.Thread(target=read, daemon=True).start()
    return lines


def _read_line(proc: subprocess.Popen[str], lines: queue.Queue[str], want: str,
               timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"no {want!r} line within {timeout} s") from None
        if not line:
            raise AssertionError(f"the flood process ended (exit {proc.poll()}) before {want!r}")
        if line.startswith(want):
            return line.split()[1]


def test_a_flooding_worker_killed_20_times_reports_its_true_loss(tmp_path: Path) -> None:
    store = torch_dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                timeout=datetime.timedelta(seconds=30))
    bus = eventbus.Bus("agent")
    delivered = [0] * KILLS
    lost: list[dict[str, int]] = [{} for _ in range(KILLS)]

    def on_metric(e: eventbus.Event) -> None:
        delivered[e.data["r"]] += 1

    def on_lost(e: eventbus.Event) -> None:
        rank = int(str(e.data.get("queue", "")).rsplit("/", 1)[-1].lstrip("w") or -1)
        lost[rank][e.reason] = lost[rank].get(e.reason, 0) + e.count

    bus.subscribe(EventType.METRIC, on_event=on_metric)
    bus.subscribe(EventType.EVENTS_LOST, on_event=on_lost)
    agent = StoreTransport(linger=1.0)
    info = RendezvousInfo(store_host="127.0.0.1", store_port=store.port, run_id="soak",
                          group_rank=0, group_world_size=1, restart_count=0,
                          local_world_size=KILLS, world_size=KILLS,
                          global_ranks=tuple(range(KILLS)), bus=bus)
    env = dict(agent.after_rendezvous(info))
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "jobs" / "sigkill_flood.py"), "127.0.0.1",
         str(store.port), env[ENV_PREFIX], env[ENV_BELL], env[ENV_LEDGER_DIR], str(tmp_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=subprocess_env(),
        cwd=ROOT, start_new_session=True)  # its group: the flooding child dies with it
    lines = _reader(proc)
    rng = random.Random(25)
    waits: list[float] = []
    try:
        assert proc.stdin is not None
        for rank in range(KILLS):
            proc.stdin.write(f"go {rank}\n")
            proc.stdin.flush()
            pid = int(_read_line(proc, lines, "pid"))
            wait = rng.uniform(0.0, 1.5)
            waits.append(wait)
            time.sleep(wait)
            os.kill(pid, signal.SIGKILL)
            _read_line(proc, lines, "reaped")
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        # a failure above leaves a forked child flooding: the whole group goes
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    counts, refused = read_counters(env[ENV_LEDGER_DIR])  # before the agent removes them
    assert not refused
    counter = {int(c.key.rsplit("/w", 1)[1]): c.recorded for c in counts}
    agent.before_exit(timeout=30.0)

    rows = []
    for rank in range(KILLS):
        raw = (tmp_path / f"truth-{rank}").read_bytes()
        begun, returned = struct.unpack("=QQ", raw)
        reported = sum(lost[rank].values())
        counted = delivered[rank] + reported
        rows.append((rank, round(waits[rank], 3), begun, returned, counter[rank],
                     delivered[rank], reported, dict(lost[rank])))
        assert counted == counter[rank], rows[-1]
        assert returned <= counted <= begun, rows[-1]
    print("rank, kill after (s), record() begun, returned, counter, delivered, "
          "reported lost, reasons")
    for row in rows:
        print(*row)
    # The kills did cost events, and the counter is what reported them.
    from_counter = sum(n for per in lost for reason, n in per.items()
                       if "record counter" in reason)
    assert from_counter > 0
    assert agent.ledger_stats["counters"] == KILLS
