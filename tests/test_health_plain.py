"""Job health for a script that never imports eventbus: real
``python -m eventbus run`` jobs, 2 gloo ranks on CPU, running tests/jobs/plain_train.py.

The workers' progress watch (eventbus_app/worker/progress.py) is the heartbeat: a hang in
Python before a collective is WORKER_STALLED for the hung rank alone, with a diagnosis that
names it, the collective and the script's line, and the group restarts far inside gloo's
30-minute timeout; a collective mismatch that hangs is diagnosed as one and STOPs with
``--stop-exit-code``; a size mismatch aborts a rank (SIGABRT); a straggler in lock-step
training gets WORKER_SLOW, its peer none; a slow start and healthy steps are no stall.
Two agents on this machine (two nodes) find the culprit on node 1 from group rank 0.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from eventbus.subscribers.jsonl import read_jsonl
from tests.launcher_helpers import JOBS
from tests.launcher_helpers import JobRun
from tests.launcher_helpers import job_env
from tests.launcher_helpers import run_command

SCRIPT = JOBS / "plain_train.py"
STALL_TIMEOUT_S = 4.0
#: gloo's own collective timeout: every hang must end far before it
GLOO_TIMEOUT_S = 1800.0


def _hang_line() -> int:
    """The line of plain_train.py's hang (marked ``# the hang``)."""
    for number, line in enumerate(SCRIPT.read_text().splitlines(), start=1):
        if "# the hang" in line:
            return number
    raise AssertionError("plain_train.py lost its '# the hang' marker")


def _env(**plain: str) -> dict[str, str]:
    env = job_env()
    env.update({f"PLAIN_{k.upper()}": v for k, v in plain.items()})
    return env


def _plain_job(tmp_path: Path, *eventbus_args: str, max_restarts: int = 1,
               timeout: float = 150, **plain: str) -> tuple[JobRun, float]:
    out = tmp_path / "out"
    out.mkdir(parents=True, exist_ok=True)
    events = tmp_path / "events.jsonl"
    cmd = [sys.executable, "-m", "eventbus", "run", "--events-jsonl", str(events),
           "--stall-timeout", str(STALL_TIMEOUT_S), *eventbus_args, "--standalone",
           "--nproc-per-node", "2", "--monitor-interval", "0.1",
           "--max-restarts", str(max_restarts), str(SCRIPT)]
    started = time.monotonic()
    done = run_command(cmd, cwd=tmp_path, timeout=timeout,
                       env=_env(out=str(out), **plain))
    wall = time.monotonic() - started
    run = JobRun(done.returncode, done.stdout, done.stderr, out)
    if events.exists():
        run.events = list(read_jsonl(events))
    return run, wall


def _bad_at(run: JobRun, attempt: int = 0, rank: int = 1) -> float:
    return float((run.out / f"attempt{attempt}_rank{rank}.bad").read_text())


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_hang_in_python_names_the_hung_rank_and_restarts(tmp_path: Path) -> None:
    """Rank 1 spins in Python before step 5's all_reduce; rank 0 waits in it. Only rank 1
    is WORKER_STALLED; its diagnosis names rank 1, all_reduce and plain_train.py:LINE;
    rank 0 is a waiting rank, never stalled; the group restarts and attempt 1 finishes."""
    run, wall = _plain_job(tmp_path, mode="hang", step="5", steps="10")
    assert run.returncode == 0, run.describe()
    stalls = run.of("WORKER_STALLED")
    assert [e["worker_id"] for e in stalls] == [1], run.describe()
    (stall,) = stalls
    data = stall["data"]
    assert data["culprit_ranks"] == [1] and data["waiting_ranks"] == [0]
    assert data["collective"]["op"] == "all_reduce" and data["collective"]["pg"] == "0"
    diagnosis = data["diagnosis"]
    assert diagnosis.startswith("rank 1 has not entered all_reduce #"), diagnosis
    assert "which rank 0 has waited in for" in diagnosis
    assert f"plain_train.py:{_hang_line()}" in diagnosis, diagnosis
    assert "spin" in data["stack"]  # the culprit's own stack comes first
    assert set(data["peer_stacks"]) == {"0"}
    dump_dir = Path(data["fr_dump_dir"])
    assert sorted(p.name for p in dump_dir.glob("fr_trace_rank_*")) == [
        "fr_trace_rank_0", "fr_trace_rank_1"]
    detection = stall["timestamp"] - _bad_at(run)
    assert STALL_TIMEOUT_S < detection < STALL_TIMEOUT_S + 5.0, detection
    (restart,) = run.of("WORKER_RESTART")
    assert restart["attempt"] == 1 and "rank 1 stalled" in restart["reason"]
    assert not run.of("WORKER_STALLED", restart_count=1)
    assert wall < GLOO_TIMEOUT_S / 10


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_collective_mismatch_that_hangs_is_diagnosed_and_stops(tmp_path: Path) -> None:
    """Rank 1 calls broadcast where rank 0 calls all_reduce (both hang on gloo): one
    WORKER_STALLED, for rank 1, whose diagnosis says mismatch and names both ops; the
    reactor's STOP ends the job with --stop-exit-code."""
    run, wall = _plain_job(tmp_path, "--reactor", "tests.jobs.reactors:stop_on_stall",
                           "--stop-exit-code", "42", mode="mismatch", step="5", steps="10")
    assert run.returncode == 42, run.describe()
    stalls = run.of("WORKER_STALLED")
    assert [e["worker_id"] for e in stalls] == [1], run.describe()
    data = stalls[0]["data"]
    assert data["mismatch"] is True
    assert data["diagnosis"].startswith("collective mismatch at #"), data["diagnosis"]
    assert "rank 0 is in all_reduce" in data["diagnosis"]
    assert "rank 1 is in broadcast" in data["diagnosis"]
    assert not run.of("WORKER_RESTART")
    assert wall < GLOO_TIMEOUT_S / 10


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_size_mismatch_aborts_a_rank_and_the_group_restarts(tmp_path: Path) -> None:
    """Rank 1's all_reduce has one element more: gloo aborts the receiving rank (SIGABRT);
    its WORKER_EXIT carries a diagnosis (its last collective, gloo's way of ending a size
    mismatch), no rank is reported stalled, and the group restarts."""
    # Step 100 (about 2 s of training): the diagnosis reads the aborted rank's last
    # heartbeat with its process group, and a progressing rank beats once a second; at
    # step 30 (0.6 s) whether one was sent before the abort was the phase of the idle
    # beats (2 of 5 runs had none: no diagnosis).
    run, _ = _plain_job(tmp_path, mode="size_mismatch", step="100", steps="110")
    assert run.returncode == 0, run.describe()
    aborted = [e for e in run.of("WORKER_EXIT", restart_count=0) if e["signal"] == "SIGABRT"]
    assert aborted, run.describe()
    diagnosis = aborted[0]["data"]["diagnosis"]
    assert diagnosis.startswith(f"rank {aborted[0]['worker_id']} ended by SIGABRT after "
                                "collective #"), diagnosis
    assert "Received data size doesn't match expected size" in diagnosis
    assert not run.of("WORKER_STALLED")
    assert run.of("WORKER_RESTART")


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_straggler_in_lock_step_training_gets_worker_slow(tmp_path: Path) -> None:
    """Rank 1 sleeps 0.25 s more per step; both ranks step at its pace (one all_reduce per
    step) and no event carries a step time. WORKER_SLOW for rank 1, none for rank 0, no
    stall."""
    run, _ = _plain_job(tmp_path, mode="straggler", step="2", steps="40")
    assert run.returncode == 0, run.describe()
    slow = run.of("WORKER_SLOW")
    assert slow and {e["worker_id"] for e in slow} == {1}, run.describe()
    assert slow[0]["data"]["basis"] == "compute_s"
    assert not run.of("WORKER_STALLED")


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_slow_start_and_healthy_steps_are_no_stall(tmp_path: Path) -> None:
    """Rank 1 sleeps twice the stall timeout before its first step while rank 0 waits in
    the first all_reduce (a slow start, not a hang); then 40 healthy steps: no
    WORKER_STALLED, no WORKER_SLOW, no restart."""
    run, _ = _plain_job(tmp_path, mode="slow_start", delay=str(2 * STALL_TIMEOUT_S),
                        steps="40")
    assert run.returncode == 0, run.describe()
    assert not run.of("WORKER_STALLED"), run.describe()
    assert not run.of("WORKER_SLOW"), run.describe()
    assert not run.of("WORKER_RESTART")
    beats = run.of("WORKER_PROGRESS")
    assert {e["worker_id"] for e in beats} == {0, 1}


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_healthy_steps_are_no_stall_and_no_straggler(tmp_path: Path) -> None:
    run, _ = _plain_job(tmp_path, mode="healthy", steps="60")
    assert run.returncode == 0, run.describe()
    assert not run.of("WORKER_STALLED"), run.describe()
    assert not run.of("WORKER_SLOW"), run.describe()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_nodes_the_culprit_on_node_1_is_named_by_group_rank_0(tmp_path: Path) -> None:
    """Two agents on this machine (--nnodes 2, one rank each, c10d rendezvous). Rank 1, on
    node 1, hangs in Python; rank 0 waits for it on node 0. Group rank 0 (node 0) runs
    the analysis over both nodes' heartbeats: WORKER_STALLED for rank 1 only, published
    by node 0, with rank 1's stack from its idle heartbeats; node 1 publishes no stall.
    The reactor STOPs: node 1 learns it through the job-wide STOP key and both agents end
    with --stop-exit-code, neither starting a second attempt. (A RESTART instead reaches
    node 1 through the rendezvous: torch's agent there sees node 0 waiting and restarts
    its workers, "membership change"; not asserted here, as the hang would repeat on
    node 1, whose restart count a membership change leaves at 0.)"""
    out = tmp_path / "out"
    out.mkdir()
    port = _free_port()
    procs: list[subprocess.Popen[str]] = []
    errors: dict[int, str] = {}
    for node in (0, 1):
        cmd = [sys.executable, "-m", "eventbus", "run",
               "--events-jsonl", str(tmp_path / f"node{node}.jsonl"),
               "--stall-timeout", str(STALL_TIMEOUT_S),
               "--reactor", "tests.jobs.reactors:stop_on_stall", "--stop-exit-code", "42",
               "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", f"plain-two-nodes-{port}", "--max-restarts", "1",
               "--monitor-interval", "0.1", str(SCRIPT)]
        procs.append(subprocess.Popen(
            cmd, cwd=tmp_path, env=_env(out=str(out), mode="hang", step="5", steps="10"),
            text=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            start_new_session=True))
    try:
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.1)
    finally:
        for node, proc in enumerate(procs):
            if proc.poll() is None:  # SIGTERM first: the agent stops the workers it
                os.killpg(proc.pid, signal.SIGTERM)  # started (each in its own session)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
            errors[node] = proc.communicate(timeout=30)[1][-4000:]
    events: dict[int, list[dict[str, Any]]] = {
        node: list(read_jsonl(tmp_path / f"node{node}.jsonl")) for node in (0, 1)}

    def of(node: int, kind: str) -> list[dict[str, Any]]:
        return [e for e in events[node] if e["type"] == kind]

    assert [p.returncode for p in procs] == [42, 42], errors
    # node 0 sees rank 1's stall as the judge; node 1 published none of its own
    own_stalls = [e for e in of(0, "WORKER_STALLED") if e["context"].get("group_rank") == 0]
    assert [e["worker_id"] for e in own_stalls] == [1], errors
    data = own_stalls[0]["data"]
    assert data["waiting_ranks"] == [0]
    assert data["diagnosis"].startswith("rank 1 has not entered all_reduce #")
    assert f"plain_train.py:{_hang_line()}" in data["diagnosis"]
    assert "spin" in data["stack"]  # from rank 1's idle heartbeat (node 1)
    assert own_stalls[0]["worker_pid"] is None  # not a process of node 0
    assert not of(1, "WORKER_STALLED")
    for node in (0, 1):
        assert not of(node, "WORKER_RESTART"), (node, errors[node])
        (agent_exit,) = of(node, "AGENT_EXIT")
        assert agent_exit["exit_code"] == 42 and "STOP" in agent_exit["reason"], agent_exit
