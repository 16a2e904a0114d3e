"""Rows 24, 25 and 26: real ``python -m eventbus run --stall-timeout``
jobs, 2 gloo workers on CPU (tests/jobs/health_job.py).

A rank that spins forever in a Python loop (its peer recording on, or waiting for it in a
gloo ``all_reduce``) becomes ``WORKER_STALLED`` with its stack, the group restarts and
attempt 1 finishes; a reactor's STOP on a stall ends the job with ``--stop-exit-code``; a
slow start, slow steady steps and an announced checkpoint write are never stalls; a 3x
straggler gets ``WORKER_SLOW``, balanced ranks never do; a STOP on one of two nodes
ends both agents with the STOP exit code.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.launcher_helpers import JobRun
from tests.launcher_helpers import run_job

STALL_TIMEOUT_S = 3.0
MONITOR_INTERVAL_S = 0.1
#: the store transport polls an idle worker queue at most this far apart
TRANSPORT_IDLE_S = 0.5


def _health_job(tmp_path: Path, *job_args: str, eventbus_args: tuple[str, ...] = (),
                max_restarts: int = 1, stall_timeout: str = str(STALL_TIMEOUT_S),
                ) -> tuple[JobRun, float]:
    started = time.monotonic()
    run = run_job(tmp_path, job="health_job.py", job_args=list(job_args),
                  eventbus_args=["--stall-timeout", stall_timeout, *eventbus_args],
                  torchrun_args=["--max-restarts", str(max_restarts)], timeout=180)
    return run, time.monotonic() - started


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("hang", ["loop", "collective"])
def test_a_hung_rank_is_stalled_with_its_stack_and_the_group_restarts(
    tmp_path: Path, figure: Callable[[int, str], None], hang: str,
) -> None:
    """Rank 1 spins in spin_forever() (rank 0 recording on, or blocked in all_reduce):
    WORKER_STALLED(worker_id=1) within the timeout plus one monitor interval (and the
    transport's idle poll), its stack names spin_forever, the reactors are asked, the group
    restarts once and attempt 1 ends with EPOCH_END from both ranks, far inside gloo's
    30-minute timeout."""
    run, wall_s = _health_job(tmp_path, "--hang", hang)
    assert run.returncode == 0, run.describe()
    stalls = [e for e in run.of("WORKER_STALLED") if e["worker_id"] == 1]
    assert len(stalls) == 1, run.describe()
    (stall,) = stalls
    hung_at = float((run.out / "attempt0_rank1.hung").read_text())
    detection_s = stall["timestamp"] - hung_at
    figure(24, f"--hang {hang}: WORKER_STALLED {detection_s:.2f} s after the hang "
               f"(timeout {STALL_TIMEOUT_S:g} s), job wall {wall_s:.1f} s")
    assert "spin_forever" in stall["data"]["stack"]
    assert stall["data"]["attempt"] == 0 and stall["silent_s"] > STALL_TIMEOUT_S
    if hang == "collective":
        assert "all_reduce" in stall["data"]["peer_stacks"]["0"]
    assert detection_s > STALL_TIMEOUT_S
    assert detection_s < STALL_TIMEOUT_S + MONITOR_INTERVAL_S + TRANSPORT_IDLE_S + 1.0
    (restart,) = run.of("WORKER_RESTART")
    assert restart["attempt"] == 1 and "stalled" in restart["reason"]
    assert sorted(e["context"]["rank"] for e in run.of("EPOCH_END", restart_count=1)) == [0, 1]
    assert [e["state"] for e in run.of("AGENT_EXIT")] == ["SUCCEEDED"]
    assert wall_s < 120  # gloo's own timeout is 30 min


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_stalled_rank_that_ignores_sigterm_is_killed_after_the_grace(
    tmp_path: Path, figure: Callable[[int, str], None],
) -> None:
    """Rank 1 ignores SIGTERM, then spins: after WORKER_STALLED the agent's SIGTERM does
    nothing, its SIGKILL after the grace (5 s) ends it (WORKER_EXIT signal SIGKILL, stopped
    by the agent), the group restarts and attempt 1 finishes."""
    run, wall_s = _health_job(tmp_path, "--hang", "loop", "--ignore-sigterm")
    assert run.returncode == 0, run.describe()
    (stall,) = [e for e in run.of("WORKER_STALLED") if e["worker_id"] == 1]
    (killed,) = [e for e in run.of("WORKER_EXIT", worker_id=1, restart_count=0)]
    assert killed["signal"] == "SIGKILL" and killed["exit_code"] == -9, run.describe()
    assert killed["data"]["stopped_by_agent"] and killed["data"]["stalled"]
    figure(24, f"SIGTERM ignored: SIGKILL {killed['timestamp'] - stall['timestamp']:.2f} s "
               f"after WORKER_STALLED (grace 5 s), job wall {wall_s:.1f} s")
    assert len(run.of("WORKER_RESTART")) == 1
    assert sorted(e["context"]["rank"] for e in run.of("EPOCH_END", restart_count=1)) == [0, 1]
    assert [e["state"] for e in run.of("AGENT_EXIT")] == ["SUCCEEDED"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_stall_timeout_auto_learns_the_rhythm_and_detects_a_hang(
    tmp_path: Path, figure: Callable[[int, str], None],
) -> None:
    """--stall-timeout auto --stall-auto-floor 2: rank 1 records every 0.8 s, then hangs;
    its timeout is learnt from that rhythm (5 x the longest interval, above the floor),
    WORKER_STALLED comes after it, and the group restarts; attempt 1 finishes."""
    run, wall_s = _health_job(tmp_path, "--hang", "loop", "--beat-s", "0.8",
                              stall_timeout="auto",
                              eventbus_args=("--stall-auto-floor", "2"))
    assert run.returncode == 0, run.describe()
    (stall,) = [e for e in run.of("WORKER_STALLED") if e["worker_id"] == 1]
    hung_at = float((run.out / "attempt0_rank1.hung").read_text())
    detection_s = stall["timestamp"] - hung_at
    figure(24, f"auto (floor 2 s, beat 0.8 s): timeout {stall['timeout_s']:.2f} s, "
               f"WORKER_STALLED {detection_s:.2f} s after the hang, job wall {wall_s:.1f} s")
    assert stall["timeout_s"] > 2.0  # learnt: 5 x ~0.8 s, not the floor
    assert stall["silent_s"] > stall["timeout_s"]
    assert "spin_forever" in stall["data"]["stack"]
    assert len(run.of("WORKER_RESTART")) == 1
    assert [e["state"] for e in run.of("AGENT_EXIT")] == ["SUCCEEDED"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_reactor_stop_on_a_stall_ends_the_job_with_the_stop_exit_code(
    tmp_path: Path, figure: Callable[[int, str], None],
) -> None:
    """A reactor that STOPs on WORKER_STALLED: no second attempt, exit code =
    --stop-exit-code, AGENT_EXIT carries it."""
    run, wall_s = _health_job(tmp_path, "--hang", "collective", max_restarts=3,
                              eventbus_args=("--reactor", "tests.jobs.reactors:stop_on_stall",
                                             "--stop-exit-code", "42"))
    figure(26, f"STOP on a stall (one node): exit {run.returncode}, wall {wall_s:.1f} s")
    assert run.returncode == 42, run.describe()
    assert run.of("WORKER_RESTART") == []
    assert run.of("WORKER_START", restart_count=1) == []
    (agent_exit,) = run.of("AGENT_EXIT")
    assert agent_exit["exit_code"] == 42 and "STOP from" in agent_exit["reason"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_slow_start_slow_steps_and_an_announced_checkpoint_are_never_stalls(
    tmp_path: Path, figure: Callable[[int, str], None],
) -> None:
    """With --stall-timeout 3, three jobs side by side (each mostly sleeps, and each
    adds load to the others: a harder case for a false stall): 3.5 s before the first
    event, 4 steps of 1.5 s, a 3.5 s checkpoint write announced by an event
    (expect_silence_s): no WORKER_STALLED, and (balanced ranks) no WORKER_SLOW; every
    job succeeds."""
    runs = 3
    with ThreadPoolExecutor(max_workers=runs) as pool:
        done = list(pool.map(lambda n: _health_job(
            tmp_path / f"run{n}", "--start-delay", "3.5", "--steps", "4", "--step-s", "1.5",
            "--checkpoint-s", "3.5")[0], range(runs)))
    stalls = slows = 0
    for run in done:
        assert run.returncode == 0, run.describe()
        assert len(run.of("EPOCH_END")) == 2
        stalls += len(run.of("WORKER_STALLED"))
        slows += len(run.of("WORKER_SLOW"))
    figure(25, f"false stalls {stalls}, false WORKER_SLOW {slows} in {runs} job(s) at once "
               f"(slow start 3.5 s, steps 1.5 s, checkpoint 3.5 s; timeout {STALL_TIMEOUT_S:g} s)")
    assert stalls == 0 and slows == 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_3x_straggler_gets_worker_slow(
    tmp_path: Path, figure: Callable[[str, str], None],
) -> None:
    """Rank 1 steps 3x slower than rank 0 (no collective syncs them): WORKER_SLOW for
    rank 1 with a factor near 3, never for rank 0."""
    run = run_job(tmp_path, job="health_job.py",
                  job_args=["--steps", "20", "--step-s", "0.1", "--slow-rank", "1",
                            "--slow-x", "3"])
    assert run.returncode == 0, run.describe()
    slow = run.of("WORKER_SLOW")
    figure("straggler", f"WORKER_SLOW for ranks {sorted({e['worker_id'] for e in slow})}, "
                        f"factor {[round(e['factor'], 1) for e in slow]}")
    assert slow and {e["worker_id"] for e in slow} == {1}
    assert all(2.0 <= e["factor"] <= 4.5 for e in slow)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_stop_on_one_node_ends_both_agents_with_the_stop_exit_code(
    tmp_path: Path, figure: Callable[[int, str], None],
) -> None:
    """Two agents (two nodes on this machine, c10d rendezvous), rank 3 exits 3 and the
    reactor of its node STOPs: both agents end, both with --stop-exit-code and an
    AGENT_EXIT carrying it, and neither starts a second attempt."""
    from eventbus.subscribers.jsonl import read_jsonl
    from tests.launcher_helpers import JOBS
    from tests.launcher_helpers import job_env

    out = tmp_path / "out"
    out.mkdir()
    port = _free_port()
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "eventbus", "run",
               "--events-jsonl", str(tmp_path / f"node{node}.jsonl"),
               "--reactor", "tests.jobs.reactors:exit_3_is_fatal", "--stop-exit-code", "42",
               "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes",
               "--max-restarts", "2", "--monitor-interval", "0.1",
               str(JOBS / "gloo_fail_once.py"), "--out", str(out), "--fail-rank", "3"]
        procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=job_env(), text=True,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      start_new_session=True))
    ended: dict[int, float] = {}
    errors: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 240
        while len(ended) < 2 and time.monotonic() < deadline:
            for node, proc in enumerate(procs):
                if node not in ended and proc.poll() is not None:
                    ended[node] = time.time()
            time.sleep(0.05)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            errors[procs.index(proc)] = proc.communicate(timeout=30)[1][-3000:]
    assert len(ended) == 2, errors
    failed_at = float((out / "attempt0_rank3.exit").read_text())
    figure(26, "STOP on node of rank 3: agents ended "
               + ", ".join(f"node {n} {ended[n] - failed_at:.1f} s" for n in sorted(ended))
               + " after the failure; exit codes "
               + str([p.returncode for p in procs]))
    assert [p.returncode for p in procs] == [42, 42], errors
    for node in (0, 1):
        events = list(read_jsonl(tmp_path / f"node{node}.jsonl"))
        (agent_exit,) = [e for e in events if e["type"] == "AGENT_EXIT"]
        assert agent_exit["exit_code"] == 42 and "STOP" in agent_exit["reason"], agent_exit
        assert not [e for e in events if e["type"] == "WORKER_RESTART"]
        assert ended[node] - failed_at < 60, errors
