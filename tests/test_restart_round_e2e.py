"""restart_round.py with real agents: two ``eventbus run`` nodes on this machine (a c10d
rendezvous on 127.0.0.1, one gloo worker each) restart together, and a third node that
comes while two run is admitted by torch's round. The restart's round is torch's own in
both (the members and ranks agreed through it); what changes is the sleeps in it, which
each node's ``RENDEZVOUS`` counts in ``data["restart_round"]``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.reliability.test_bad_hosts import Nodes
from tests.reliability.test_bad_hosts import _attempts

JOBS = Path(__file__).resolve().parent / "jobs"


@pytest.fixture
def made() -> Iterator[list[Nodes]]:
    jobs: list[Nodes] = []
    yield jobs
    for job in jobs:
        job.kill()


def _rendezvous(job: Nodes, host: str) -> list[dict[str, Any]]:
    """The rendezvous ``host``'s agent formed (group rank 0's file has the others' too)."""
    return [e for e in job.events(host)
            if e["type"] == "RENDEZVOUS" and e.get("state") == "SUCCEEDED"
            and e["context"].get("hostname") == host]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_nodes_restart_through_torchs_round_without_its_sleeps(
        tmp_path: Path, made: list[Nodes]) -> None:
    """Rank 1 (node-b's worker) fails on attempt 0: both nodes restart into attempt 1,
    through one round of torch's rendezvous (the same attempt, group ranks 0 and 1, world
    2 and one workers' store on both), and each node's restart round skipped the first
    run's jitter. Both ranks of attempt 1 end 0."""
    job = Nodes(tmp_path, job=JOBS / "gloo_fail_once.py", nnodes="2:2", max_restarts=1,
                 job_args=["--fail-on", "0", "--fail-rank", "1"])
    made.append(job)
    job.start("node-a")
    job.start("node-b")
    codes = job.wait(240)
    outputs = job.kill()
    assert codes == {"node-a": 0, "node-b": 0}, outputs
    # node-a's workers may fail, or be re-formed by node-b's wait (torch then counts no
    # restart in their TORCHELASTIC_RESTART_COUNT): the agents' attempt is the job's
    ended = {(e["worker_id"], e["exit_code"]) for e in job.events("node-a")
             if e["type"] == "WORKER_EXIT" and e["context"]["restart_count"] == 1}
    assert ended == {(0, 0), (1, 0)}, (ended, outputs)
    formed = {host: _rendezvous(job, host) for host in ("node-a", "node-b")}
    for host, rounds in formed.items():
        assert len(rounds) == 2, (host, rounds)
        first, restart = rounds
        assert "restart_round" not in first["data"], first  # the first keeps its jitter
        counts = restart["data"]["restart_round"]
        assert counts["jitter_skipped"] == 1 and counts["quick_polls"] >= 0, counts
        assert restart["data"]["group_world_size"] == 2, restart
    ranks = {restart["data"]["group_rank"] for _, restart in formed.values()}
    attempts = {restart["context"]["restart_count"] for _, restart in formed.values()}
    assert ranks == {0, 1} and attempts == {1}, formed
    ports = {restart["data"]["master_port"] for _, restart in formed.values()}
    assert len(ports) == 1, ports  # one attempt: one workers' store for both nodes
    print("restart_round: " + json.dumps(
        {host: rounds[1]["data"]["restart_round"] | {
            "duration_s": round(rounds[1]["duration_s"], 3)}
         for host, rounds in formed.items()}))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_node_that_comes_while_two_run_joins_through_torchs_round(
        tmp_path: Path, made: list[Nodes]) -> None:
    """``--nnodes 2:3``: node-a and node-b run; node-c comes once they trained. It waits
    (torch's wait list), the running nodes see it (``num_nodes_waiting``) and re-form, and
    torch's round admits it: the next attempt has three nodes, ranks 0-2, on every node.
    The running nodes' re-form is a restart round (its sleeps cut); node-c's first round
    is not."""
    job = Nodes(tmp_path, job=JOBS / "bad_host_job.py", nnodes="2:3", max_restarts=3,
                 job_args=["--steps", "80"])
    made.append(job)
    job.start("node-a")
    job.start("node-b")
    job.wait_for_a_worker("node-a", 200)
    job.start("node-c")
    codes = job.wait(300)
    outputs = job.kill()
    assert codes == {"node-a": 0, "node-b": 0, "node-c": 0}, outputs
    assert (job.out / "step").read_text() == "80"
    three = {host: [e for e in _rendezvous(job, host)
                    if e["data"]["group_world_size"] == 3]
             for host in ("node-a", "node-b", "node-c")}
    assert all(three.values()), (three, outputs)
    firsts = {host: rounds[0] for host, rounds in three.items()}
    assert {e["data"]["group_rank"] for e in firsts.values()} == {0, 1, 2}, firsts
    assert len({e["context"]["restart_count"] for e in firsts.values()}) == 1, firsts
    assert "restart_round" in firsts["node-a"]["data"], firsts["node-a"]
    assert "restart_round" in firsts["node-b"]["data"], firsts["node-b"]
    assert "restart_round" not in _rendezvous(job, "node-c")[0]["data"]
    for host in ("node-a", "node-b", "node-c"):
        assert max(_attempts(job.out, host).items())[1][1] == 3, (host, outputs[host])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_workers_exit_wakes_the_monitor_long_before_its_interval(tmp_path: Path) -> None:
    """``--monitor-interval 20``: rank 1 exits on attempt 0 and both ranks end on attempt
    1. Each exit wakes the agent (exit_watch.py): the failure is published within 2 s of
    the exit, and the job ends within 8 s of the ranks' last event (their interpreters'
    teardown), where a 20 s tick would see each 10 s later on average."""
    from tests.launcher_helpers import run_job

    run = run_job(tmp_path, torchrun_args=["--max-restarts", "1", "--monitor-interval", "20"],
                  job_args=["--fail-on", "0"], timeout=240)
    assert run.returncode == 0, run.describe()
    (failure,) = run.of("WORKER_EXIT", worker_id=1, exit_code=3)
    exited = float((run.out / "attempt0_rank1.exit").read_text())
    assert 0 <= failure["timestamp"] - exited < 2.0, failure["timestamp"] - exited
    last = max(e["timestamp"] for e in run.of("EPOCH_END", restart_count=1))
    (agent_exit,) = run.of("AGENT_EXIT")
    assert agent_exit["state"] == "SUCCEEDED", run.describe()
    assert agent_exit["timestamp"] - last < 8.0, agent_exit["timestamp"] - last
