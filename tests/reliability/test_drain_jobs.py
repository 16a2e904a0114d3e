"""Preemption drains on real jobs (rows 38-39 of the fault matrix): real
``python -m eventbus run`` jobs of 2 gloo ranks on CPU running tests/jobs/drain_train.py,
the signal sent to the agent's pid alone (as a scheduler's kill of the main process).

- SIGTERM: every rank stops at the same step with its checkpoint complete; PREEMPTING and
  AGENT_EXIT PREEMPTED in the stream; one ``eventbus:`` line; no traceback; the drain code.
- SIGUSR1, then the same job again: it resumes from the saved step and finishes.
- A script with its own SIGTERM handler and no eventbus call gets the signal at once.
- A rank that ignores the notice is killed at the deadline and named; a rank that hangs
  holds its peers in the collective: both end by the deadline; a second signal cuts the
  grace short; a drain while the group restarts starts no new training.
- A peer's failure reaches the other rank's bus within a second, with the failed rank's
  context.
- Two agents on this machine (two nodes): the signal to node 1 drains both at one step.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from eventbus.subscribers.jsonl import read_jsonl
from tests.launcher_helpers import JOBS
from tests.launcher_helpers import job_env

SCRIPT = JOBS / "drain_train.py"
#: the kill grace after the forwarded signal (the agent's --stall-stop grace)
KILL_GRACE_S = 5.0

pytestmark = pytest.mark.slow


class Job:
    """One ``eventbus run`` job (or one node of it) in its own session."""

    def __init__(self, tmp_path: Path, *args: str, name: str = "job",
                 nodes: tuple[int, int, int] | None = None, **drain_env: str) -> None:
        self.out = tmp_path / "out"
        self.out.mkdir(exist_ok=True)
        self.events_path = tmp_path / f"{name}.jsonl"
        topology = ["--standalone", "--nproc-per-node", "2"]
        if nodes is not None:
            node, port, count = nodes
            topology = ["--nnodes", str(count), "--node-rank", str(node), "--nproc-per-node",
                        "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                        f"127.0.0.1:{port}", "--rdzv-id", f"drain-{port}"]
        cmd = [sys.executable, "-m", "eventbus", "run", "--events-jsonl",
               str(self.events_path), *args, *topology, "--monitor-interval", "0.1",
               str(SCRIPT)]
        env = job_env()
        env["DRAIN_OUT"] = str(self.out)
        env.update({f"DRAIN_{k.upper()}": v for k, v in drain_env.items()})
        self.proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, text=True,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     start_new_session=True)
        self.stderr = ""
        self.signalled: float | None = None
        self.ended: float | None = None

    def wait_for(self, *names: str, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while not all((self.out / n).exists() for n in names):
            if self.proc.poll() is not None:
                self.finish()
                raise AssertionError(f"the job ended before {names}: rc "
                                     f"{self.proc.returncode}\n{self.stderr[-4000:]}")
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"no {names} in {timeout} s\n{self.stderr[-4000:]}")
            time.sleep(0.05)

    def signal(self, signum: int = signal.SIGTERM) -> None:
        self.signalled = self.signalled or time.monotonic()
        os.kill(self.proc.pid, signum)  # the agent alone, as a scheduler signals it

    def finish(self, timeout: float = 90.0) -> int:
        try:
            _, self.stderr = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the job did not end in {timeout} s\n"
                                 f"{self.stderr[-4000:]}") from None
        self.ended = time.monotonic()
        return int(self.proc.returncode)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.stderr = self.proc.communicate(timeout=30)[1]

    @property
    def took(self) -> float:
        assert self.signalled is not None and self.ended is not None
        return self.ended - self.signalled

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        found = list(read_jsonl(self.events_path)) if self.events_path.exists() else []
        return [e for e in found if kind is None or e["type"] == kind]

    def lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.startswith("eventbus:")]

    def json(self, name: str) -> Any:
        return json.loads((self.out / name).read_text())


def _drained(job: Job, *, code: int = 75, restarts: int = 0) -> dict[str, Any]:
    """The checks every drained job passes; returns AGENT_EXIT's drain facts."""
    assert job.proc.returncode == code, job.stderr[-4000:]
    assert len(job.events("PREEMPTING")) == 1, job.stderr[-4000:]
    (agent_exit,) = job.events("AGENT_EXIT")
    assert agent_exit["state"] == "PREEMPTED" and agent_exit["exit_code"] == code
    assert agent_exit["cause"] == "preemption"
    assert len(job.events("WORKER_RESTART")) == restarts  # none after the drain
    drain_lines = [line for line in job.lines() if "the job drained" in line]
    assert len(drain_lines) == 1, job.lines()
    facts: dict[str, Any] = agent_exit["data"]["drain"]
    return facts


def _no_agent_traceback(job: Job) -> None:
    # a worker's own traceback says [rank<N>]: in front; the agent's would not
    agent = [line for line in job.stderr.splitlines()
             if line.startswith("Traceback") or "SignalException" in line]
    assert not agent, job.stderr[-4000:]



def _finish_all(jobs: Sequence[Job]) -> None:
    """Each job to its end; any still running after that (a failed wait) killed."""
    try:
        for job in jobs:
            job.finish()
    finally:
        for job in jobs:
            if job.proc.poll() is None:
                job.kill()

@pytest.mark.timeout(180)
def test_sigterm_drains_every_rank_at_one_step_with_its_checkpoint(
        tmp_path: Path, figure: Callable[[int, str], None]) -> None:
    import torch

    job = Job(tmp_path, "--drain-grace", "30")
    job.wait_for("ready_rank0", "ready_rank1")
    job.signal(signal.SIGTERM)
    job.finish()
    facts = _drained(job)
    stops = [job.json(f"stopped_rank{r}.json")["step"] for r in (0, 1)]
    assert stops[0] == stops[1] == facts["stop_step"], (stops, facts)
    for rank in (0, 1):  # complete and loadable, at that step
        assert torch.load(job.out / f"ckpt_rank{rank}.pt")["step"] == stops[0]
    assert facts["late_ranks"] == [] and facts["signal"] == "SIGTERM" and facts["node"] == 0
    assert job.took < 30, job.took
    (line,) = [line for line in job.lines() if "drained" in line]
    assert line.startswith(f"eventbus: SIGTERM on node 0: the job drained (every rank "
                           f"stopped at step {stops[0]};"), line
    assert line.endswith("exit code 75")
    (preempting,) = job.events("PREEMPTING")
    assert preempting["reason"] == "SIGTERM on node 0" and preempting["deadline_s"] <= 30
    assert {e["worker_id"]: e["exit_code"] for e in job.events("WORKER_EXIT")} == {0: 0, 1: 0}
    _no_agent_traceback(job)
    figure(38, f"SIGTERM: both ranks stopped at step {stops[0]}, checkpoints complete; job "
               f"ended {job.took:.1f} s after the signal (grace 30 s), exit 75")


@pytest.mark.timeout(180)
def test_a_subscriber_that_blocks_or_raises_on_preempting_costs_nothing_else(
        tmp_path: Path, figure: Callable[[int, str], None]) -> None:
    """Each rank's script subscribes to PREEMPTING one subscriber that blocks for good and
    one that raises: every rank still stops at one step with its checkpoint, the job ends
    drained long before the grace (row 39)."""
    job = Job(tmp_path, "--drain-grace", "60", blocker="1")
    job.wait_for("ready_rank0", "ready_rank1")
    job.signal()
    job.finish()
    facts = _drained(job)
    assert all((job.out / f"blocked_rank{r}").exists() for r in (0, 1))
    stops = [job.json(f"stopped_rank{r}.json")["step"] for r in (0, 1)]
    assert stops[0] == stops[1] == facts["stop_step"] and facts["late_ranks"] == []
    assert job.took < 30, job.took
    figure(39, f"a blocking and a raising PREEMPTING subscriber: both ranks stopped at step "
               f"{stops[0]}; ended {job.took:.1f} s after the signal (grace 60 s)")


@pytest.mark.timeout(240)
def test_sigusr1_drains_and_the_same_job_resumes_from_the_saved_step(tmp_path: Path) -> None:
    first = Job(tmp_path, "--drain-grace", "30", "--drain-exit-code", "143", name="first")
    first.wait_for("ready_rank0", "ready_rank1")
    first.signal(signal.SIGUSR1)
    first.finish()
    facts = _drained(first, code=143)
    assert facts["signal"] == "SIGUSR1"
    step = first.json("stopped_rank0.json")["step"]
    second = Job(tmp_path, name="second", steps=str(step + 30), ready_at="1000000")
    assert second.finish() == 0, second.stderr[-4000:]
    for rank in (0, 1):
        final = second.json(f"final_rank{rank}.json")
        assert final == {"resumed_from": step, "last": step + 30}


@pytest.mark.timeout(180)
def test_a_script_with_its_own_sigterm_handler_gets_the_signal_at_once(tmp_path: Path) -> None:
    """No eventbus call in the script (``plain``): each rank's own handler runs within a
    second of the agent's signal, as under torchrun; the run still ends as preempted."""
    job = Job(tmp_path, "--drain-grace", "60", mode="plain")
    job.wait_for("ready_rank0", "ready_rank1")
    sent = time.time()
    job.signal()
    job.finish()
    facts = _drained(job)
    for rank in (0, 1):
        got = float((job.out / f"sigterm_rank{rank}").read_text())
        assert got - sent < 2.0, got - sent
    assert facts["stop_step"] is None and facts["late_ranks"] == []
    assert job.took < 20  # not the 60 s grace


@pytest.mark.timeout(180)
def test_a_host_fault_during_the_drain_evicts_the_node_with_the_bad_host_code(
        tmp_path: Path, figure: Callable[[int, str], None]) -> None:
    """Row 46, an eviction while a drain is under way: rank 1 dies of SIGSEGV as the drain
    reaches it, with ``--evict-after 1``. The drain ends as drains do (no restart, rank 0's
    handler ran), and the node, whose host is now bad, says so (``HOST_EVICTED``) and exits
    with the bad-host code, 76, not the drain's 75: requeue, and elsewhere."""
    job = Job(tmp_path, "--drain-grace", "60", "--evict-after", "1",
              "--host-ledger", str(tmp_path / "hosts.sqlite"), mode="plain_segv")
    job.wait_for("ready_rank0", "ready_rank1")
    job.signal()
    code = job.finish()
    assert code == 76, job.stderr[-4000:]
    assert (job.out / "sigterm_rank0").exists()
    assert len(job.events("PREEMPTING")) == 1 and not job.events("WORKER_RESTART")
    (evicted,) = job.events("HOST_EVICTED")
    assert evicted["faults"] == 1, evicted
    faults = [e for e in job.events("WORKER_EXIT") if e.get("data", {}).get("host_fault")]
    assert [e["worker_id"] for e in faults] == [1], job.events("WORKER_EXIT")
    assert any("evicted after 1 host fault" in line for line in job.lines()), job.lines()
    (agent_exit,) = job.events("AGENT_EXIT")
    assert agent_exit["exit_code"] == 76, agent_exit
    _no_agent_traceback(job)
    figure(46, f"a SIGSEGV during a drain with --evict-after 1: exit {code}, HOST_EVICTED, "
               f"{job.took:.1f} s from the signal")


@pytest.mark.timeout(180)
def test_a_rank_that_ignores_the_notice_is_killed_at_the_deadline_and_named(
        tmp_path: Path, figure: Callable[[int, str], None]) -> None:
    """Rank 1 hears PREEMPTING and carries on; rank 0 stops at its step and saves. At the
    deadline rank 1 gets the signal, and the job ends within the kill grace."""
    job = Job(tmp_path, "--drain-grace", "6", mode="ignore")
    job.wait_for("ready_rank0", "ready_rank1")
    job.signal()
    job.finish()
    facts = _drained(job)
    assert (job.out / "heard_rank1").exists() and (job.out / "ckpt_rank0.pt").exists()
    assert facts["late_ranks"] == [1], facts
    assert 6 <= job.took < 6 + KILL_GRACE_S + 10, job.took
    exits = {e["worker_id"]: e for e in job.events("WORKER_EXIT")}
    assert exits[1]["cause"] == "preemption" and exits[1]["data"]["stopped_by_agent"]
    assert exits[0]["exit_code"] == 0 and exits[0]["data"]["drained"]  # stopped in time
    (line,) = [line for line in job.lines() if "drained" in line]
    assert "rank 1 did not stop in time (SIGTERM, then SIGKILL)" in line, line
    figure(38, f"a rank ignoring the notice: named late, job ended {job.took:.1f} s after the "
               f"signal (grace 6 s + kill grace {KILL_GRACE_S:g} s)")


@pytest.mark.timeout(180)
def test_a_drain_while_a_rank_hangs_ends_by_the_deadline(
        tmp_path: Path, figure: Callable[[int, str], None]) -> None:
    """Rank 1 spins in Python; rank 0 waits for it in the collective and never reaches the
    stop step. Both are ended at the deadline; nothing waits for gloo's 30 minutes."""
    job = Job(tmp_path, "--drain-grace", "5", mode="hang")
    job.wait_for("ready_rank0", "ready_rank1")
    time.sleep(0.5)
    job.signal()
    job.finish()
    facts = _drained(job)
    assert facts["late_ranks"] == [0, 1], facts
    assert job.took < 5 + KILL_GRACE_S + 10, job.took
    figure(38, f"a drain while a rank hangs: ended {job.took:.1f} s after the signal (grace "
               "5 s)")


@pytest.mark.timeout(180)
def test_a_second_signal_cuts_the_grace_short(tmp_path: Path) -> None:
    """The save takes 60 s: a second SIGTERM a second into the drain (past the 0.5 s
    window of copies of one signal) forwards it now."""
    job = Job(tmp_path, "--drain-grace", "120", "--drain-signal-window", "0.5", save_s="60")
    job.wait_for("ready_rank0", "ready_rank1")
    job.signal()
    time.sleep(1.0)
    job.signal()
    job.finish()
    facts = _drained(job)
    assert facts["escalated"] and facts["late_ranks"] == [0, 1], facts
    assert job.took < 1 + KILL_GRACE_S + 10, job.took


@pytest.mark.timeout(240)
def test_a_drain_while_the_group_restarts_starts_no_training(tmp_path: Path) -> None:
    """Rank 1 crashes; attempt 1's workers sleep before they start training. The drain
    reaches them (they act on none of it: the signal at once) and no step is taken."""
    job = Job(tmp_path, "--drain-grace", "30", "--max-restarts", "1", mode="slow_restart")
    job.wait_for("restarted_rank0", "restarted_rank1")
    job.signal()
    job.finish()
    facts = _drained(job, restarts=1)  # the crash's, before the drain
    assert job.took < 15, job.took  # the signal at once: not the 30 s grace
    assert not list(job.out.glob("stopped_rank*")) and not list(job.out.glob("final_*"))
    assert facts["late_ranks"] == [], facts
    attempt1 = [e for e in job.events("WORKER_EXIT") if e["data"].get("attempt") == 1]
    assert {e["exit_code"] for e in attempt1} == {-signal.SIGTERM}, attempt1


@pytest.mark.timeout(180)
def test_a_peer_failure_reaches_the_other_rank_within_a_second(tmp_path: Path) -> None:
    """Rank 1 exits 1; rank 0's subscriber to WORKER_EXIT hears it, with rank 1's global
    rank and the agent's context (who decided it), within a second of the agent's
    WORKER_EXIT (rank 0 writes what it heard in its SIGTERM handler: the agent stops the
    group at once after a failure)."""
    job = Job(tmp_path, "--max-restarts", "0", mode="crash")
    job.wait_for("crash_rank1", timeout=90)
    job.finish()
    heard = job.json("heard_rank0.json")
    assert heard["worker_id"] == 1 and heard["exit_code"] == 1
    assert heard["context_pid"] == job.proc.pid  # told by the agent, not rank 0's own
    (decided,) = [e for e in job.events("WORKER_EXIT") if e["worker_id"] == 1]
    assert heard["time"] - decided["timestamp"] < 1.0, heard["time"] - decided["timestamp"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(240)
def test_two_nodes_a_signal_to_node_1_drains_both_at_one_step(tmp_path: Path) -> None:
    port = _free_port()
    jobs: Sequence[Job] = [Job(tmp_path, "--drain-grace", "30", name=f"node{n}",
                               nodes=(n, port, 2)) for n in (0, 1)]
    try:
        for job in jobs:
            job.wait_for("ready_rank0", "ready_rank1")
        jobs[1].signal()
    finally:
        _finish_all(jobs)
    stops = [jobs[0].json(f"stopped_rank{r}.json")["step"] for r in (0, 1)]
    assert stops[0] == stops[1], stops
    for node, job in enumerate(jobs):
        assert job.proc.returncode == 75, (node, job.stderr[-4000:])
        (agent_exit,) = job.events("AGENT_EXIT")
        assert agent_exit["state"] == "PREEMPTED", (node, agent_exit)
        assert agent_exit["data"]["drain"]["node"] == 1
        assert agent_exit["data"]["drain"]["stop_step"] == stops[0]
        (line,) = [line for line in job.lines() if "drained" in line]
        assert line.startswith("eventbus: SIGTERM on node 1: the job drained"), line
    # node 1's PREEMPTING reached group rank 0's stream through the job view
    assert [e["node"] for e in jobs[0].events("PREEMPTING")] == [1]
    assert jobs[1].took < 30


@pytest.mark.timeout(240)
def test_the_store_gone_during_a_drain_still_ends_by_the_deadline(
        tmp_path: Path, figure: Callable[[int, str], None]) -> None:
    """Two nodes; node 1 gets SIGTERM, and node 0's agent (the store's host) is killed a
    moment later. Node 1 still ends drained, by its deadline plus the kill grace and its
    bounded exit (row 39)."""
    port = _free_port()
    jobs: Sequence[Job] = [Job(tmp_path, "--drain-grace", "8", name=f"node{n}",
                               nodes=(n, port, 2), save_s="2") for n in (0, 1)]
    orphans: list[int] = []
    try:
        for job in jobs:
            job.wait_for("ready_rank0", "ready_rank1")
        orphans = [e["worker_pid"] for e in jobs[0].events("WORKER_START")
                   if e.get("worker_pid")]
        jobs[1].signal()
        time.sleep(0.3)
        os.kill(jobs[0].proc.pid, signal.SIGKILL)
        code = jobs[1].finish(timeout=120)
    finally:
        for job in jobs:
            if job.proc.poll() is None:
                job.kill()
        for pid in orphans:  # node 0's workers lost their agent: end them
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert code == 75, jobs[1].stderr[-4000:]
    (agent_exit,) = jobs[1].events("AGENT_EXIT")
    assert agent_exit["state"] == "PREEMPTED"
    assert jobs[1].took < 8 + KILL_GRACE_S + 25, jobs[1].took
    figure(39, f"the store's host killed during a drain: node 1 ended drained "
               f"{jobs[1].took:.1f} s after the signal (grace 8 s)")

