"""Row 27: the rendezvous store dies inside a real ``eventbus run`` job. The c10d store
is served by a child process at ``--rdzv-endpoint`` (the agent becomes its client), and
the test kills that process while 2 workers record numbered events. The workers go on
and exit, record() never raises, and the agent, which cannot reach the store any more,
reports each worker's true loss from the worker's exit ledger: per worker, the
``EVENTS_LOST`` counts in the agent's JSONL == recorded - delivered."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from launcher_helpers import JOBS
from launcher_helpers import job_env
from launcher_helpers import run_command
from matrix import free_port

from eventbus.subscribers.jsonl import read_jsonl


@pytest.mark.slow
def test_store_killed_mid_job_reports_the_true_loss(
    tmp_path: Path, store_process: Callable[[int], subprocess.Popen[str]],
    figure: Callable[[int, str], None],
) -> None:
    """Kill the rendezvous store 2 s after both workers started recording for 6 s: workers
    finish, no record() error, and per worker the EVENTS_LOST reported by the agent ==
    recorded - delivered."""
    port = free_port()
    server = store_process(port)
    out = tmp_path / "out"
    out.mkdir()
    events = tmp_path / "events.jsonl"
    cmd = [sys.executable, "-m", "eventbus", "run", "--events-jsonl", str(events),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--nnodes", "1", "--nproc-per-node", "2", "--monitor-interval", "0.1",
           # the rows count the script's events; heartbeats would be counted with them
           "--progress", "off",
           str(JOBS / "record_loop.py"), "--out", str(out), "--seconds", "6"]
    env = job_env()
    env["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    started = time.monotonic()

    def kill_when_recording() -> None:
        deadline = time.monotonic() + 120
        # from the moment both workers record, not from their start: the first record()
        # imports torch, which alone took longer than 2 s on a loaded machine
        while len(list(out.glob("rank*.recording"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(2.0)
        server.kill()
        server.wait(10)

    killer = threading.Thread(target=kill_when_recording, daemon=True)
    killer.start()
    done = run_command(cmd, cwd=tmp_path, env=env, timeout=180)
    killer.join(10)
    elapsed = time.monotonic() - started
    results: dict[int, tuple[int, int, int, int, str]] = {}
    for path in out.glob("rank*.result"):
        head, sender = path.read_text().split("\n")
        recorded, errors, lost, numbered = (int(x) for x in head.split())
        results[int(path.stem[4:])] = (recorded, errors, lost, numbered, sender)
    delivered = {r: 0 for r in results}
    reported = {r: 0 for r in results}
    by_sender = {results[r][4]: r for r in results}
    reasons: set[str] = set()
    for rec in read_jsonl(events):
        if rec["type"] == "EPOCH_END" and rec["context"].get("rank") in delivered:
            delivered[rec["context"]["rank"]] += 1
        if rec["type"] == "EVENTS_LOST" and rec.get("source") in by_sender:
            reported[by_sender[rec["source"]]] += rec.get("count", 0)
            reasons.add(str(rec.get("reason")))
    figure(27, f"job rc {done.returncode} in {elapsed:.0f} s; per rank (recorded, numbered, "
               f"record() errors, counted lost by the worker, delivered, EVENTS_LOST "
               f"reported by the agent, actual lost): "
               + "; ".join(f"rank {r}: {results[r][0]}, {results[r][3]}, {results[r][1]}, "
                           f"{results[r][2]}, {delivered[r]}, {reported[r]}, "
                           f"{results[r][0] - delivered[r]}" for r in sorted(results))
               + f"; reasons {sorted(reasons)}")
    assert sorted(results) == [0, 1], done.stderr[-4000:]
    for rank, (recorded, errors, _lost, numbered, _sender) in results.items():
        assert errors == 0
        assert numbered == recorded  # the worker's bus carries only the loop's events
        assert 0 < delivered[rank] < recorded
        # the exit ledger counts torch's silent loss too: the first queue_push after the
        # server died returns OK and the value is gone (RELIABILITY.md, row 20)
        assert reported[rank] == recorded - delivered[rank], (rank, results, delivered,
                                                              reported, done.stderr[-3000:])
