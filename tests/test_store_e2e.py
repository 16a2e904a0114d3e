"""Worker events reach the agent's JSONL through real `python -m eventbus run` jobs (CPU,
gloo): across a restart with the agent's SIGTERM, and across two agents (nodes)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import subprocess_env

pytestmark = pytest.mark.slow

N = 2_000

# Each rank records N METRIC events per attempt (data: rank, attempt, i). On attempt 0,
# rank 1 waits until rank 0 has recorded all of its events, then fails with exit code 3;
# rank 0 waits for the agent's SIGTERM. Attempt 1 runs to completion.
JOB = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    import torch
    import torch.distributed as dist
    import eventbus
    from eventbus import EventType

    out = Path(sys.argv[1])
    n = int(sys.argv[2])
    fail = sys.argv[3] == "fail"
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    for i in range(n):
        eventbus.record(EventType.METRIC, step=i,
                        data={"rank": rank, "attempt": attempt, "i": i})
    eventbus.record(EventType.EPOCH_END, epoch=attempt)
    (out / f"a{attempt}r{rank}.recorded").write_text("1")
    if fail and attempt == 0:
        if rank == 1:
            deadline = time.time() + 60
            while not (out / "a0r0.recorded").exists() and time.time() < deadline:
                time.sleep(0.01)
            sys.exit(3)
        time.sleep(120)  # until the agent's SIGTERM
        sys.exit(9)
    dist.barrier()
    dist.destroy_process_group()
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _metrics(lines: list[dict[str, Any]]) -> Counter[tuple[int, int, int]]:
    return Counter((d["data"]["rank"], d["data"]["attempt"], d["data"]["i"])
                   for d in lines if d["type"] == "METRIC")


def _run(tmp_path: Path, args: list[str], *, timeout: float = 240) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "eventbus", "run", *args],
                            env=subprocess_env(LOGLEVEL="WARNING"), cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_restart_with_sigterm_loses_and_doubles_nothing(tmp_path: Path) -> None:
    """2 workers x 2,000 events per attempt, rank 1 fails on attempt 0 and the group
    restarts: the agent's JSONL holds every event of each rank in each attempt exactly
    once, including what rank 0 recorded before the agent's SIGTERM stopped it."""
    script = tmp_path / "job.py"
    script.write_text(JOB)
    jsonl = tmp_path / "events.jsonl"
    proc = _run(tmp_path, ["--events-jsonl", str(jsonl), "--standalone",
                           "--nproc-per-node", "2", "--max-restarts", "1",
                           "--monitor-interval", "0.1", str(script), str(tmp_path), str(N),
                           "fail"])
    _out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-4000:]
    lines = _read(jsonl)
    metrics = _metrics(lines)
    expected = {(r, a, i) for r in (0, 1) for a in (0, 1) for i in range(N)}
    assert set(metrics) == expected, f"missing {len(expected - set(metrics))}"
    assert max(metrics.values()) == 1, "nothing doubled"
    assert not [d for d in lines if d["type"] == "EVENTS_LOST"]
    # the worker events carry their attempt, next to the agent's view of the failure
    exits = [d for d in lines if d["type"] == "WORKER_EXIT" and d["exit_code"] == 3]
    assert exits and exits[0]["worker_id"] == 1
    epoch_ends = Counter((d["context"]["rank"], d["context"]["restart_count"])
                         for d in lines if d["type"] == "EPOCH_END")
    assert epoch_ends == {(0, 0): 1, (1, 0): 1, (0, 1): 1, (1, 1): 1}


def test_two_agents_group_rank_0_holds_both_nodes_worker_events(tmp_path: Path) -> None:
    """Two agents on one machine (--nnodes 2, c10d rendezvous on 127.0.0.1): group rank
    0's JSONL holds every worker event of both nodes; each node's JSONL its own."""
    script = tmp_path / "job.py"
    script.write_text(JOB)
    port = _free_port()
    procs = []
    for node in (0, 1):
        procs.append(_run(tmp_path, [
            "--events-jsonl", str(tmp_path / f"node{node}.jsonl"), "--nnodes", "2",
            "--nproc-per-node", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "store-e2e",
            "--monitor-interval", "0.1", str(script), str(tmp_path), "500", "ok"]))
    results = []
    for proc in procs:
        try:
            results.append(proc.communicate(timeout=300))
        finally:
            if proc.poll() is None:
                proc.kill()
    for proc, (_, err) in zip(procs, results, strict=True):
        assert proc.returncode == 0, err[-4000:]
    views = {}
    for node in (0, 1):
        lines = _read(tmp_path / f"node{node}.jsonl")
        rdzv = [d for d in lines if d["type"] == "RENDEZVOUS" and d["state"] == "SUCCEEDED"]
        views[rdzv[-1]["data"]["group_rank"]] = lines
    assert sorted(views) == [0, 1]
    job_view = _metrics(views[0])
    assert set(job_view) == {(r, 0, i) for r in range(4) for i in range(500)}
    assert max(job_view.values()) == 1
    node1 = _metrics(views[1])
    local_ranks = {r for r, _, _ in node1}
    assert len(local_ranks) == 2 and set(node1) == {(r, 0, i) for r in local_ranks
                                                    for i in range(500)}
    assert not [d for d in views[0] + views[1] if d["type"] == "EVENTS_LOST"]
    # the other node's agent events reach the job view too
    assert any(d["type"] == "WORKER_START" and d["context"]["group_rank"] == 1
               for d in views[0])
