"""A scheduler's drain signal to every process of the step, as SLURM sends it (``--signal``,
``scancel``, ``scontrol requeue``, preemption): real ``python -m eventbus run`` jobs on
this machine (tests/jobs/drain_train.py, gloo on CPU), each agent in a session of its own
like srun's step; the test signals every process of every agent at once: the agent's
process group and each of its descendants (torch starts each worker in a session of its
own).

- Two nodes, SIGUSR1 or SIGTERM to all: one drain, one ``PREEMPTING`` in the job (group
  rank 0's stream holds the job's; node 1's holds it only when it announced it), every
  rank stopped at one step, no worker killed by the signal, exit 75.
- A second signal to all, seconds later (past ``--drain-signal-window``): it escalates.
- A script with its own SIGUSR1 handler still gets it (and still drains at one step).
- A signal sent by hand to one worker alone drains the job (the worker asks its agent).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

# the test extra installs psutil; the torch-free runs on other Pythons (make test-pythons)
# have neither it nor these jobs
psutil = pytest.importorskip("psutil")

from tests.reliability.test_drain_jobs import Job  # noqa: E402
from tests.reliability.test_drain_jobs import _finish_all  # noqa: E402
from tests.reliability.test_drain_jobs import _free_port  # noqa: E402

pytestmark = pytest.mark.slow


def _every_process(job: Job) -> list[int]:
    """The agent and every process under it (workers, warm spares)."""
    agent = psutil.Process(job.proc.pid)
    return [agent.pid, *(p.pid for p in agent.children(recursive=True))]


def _signal_step(jobs: Sequence[Job], signum: int) -> None:
    """What SLURM does: the signal to every process of every node's step, at once."""
    pids = [pid for job in jobs for pid in _every_process(job)]
    for job in jobs:
        job.signalled = job.signalled or time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.proc.pid, signum)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def _no_worker_signalled(job: Job) -> None:
    codes = {e["worker_id"]: e["exit_code"] for e in job.events("WORKER_EXIT")}
    assert codes and all(code == 0 for code in codes.values()), (codes, job.stderr[-3000:])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGTERM], ids=["USR1", "TERM"])
def test_a_signal_to_every_process_of_two_nodes_is_one_drain(tmp_path: Path,
                                                             signum: int) -> None:
    port = _free_port()
    jobs = [Job(tmp_path, "--drain-grace", "30", name=f"node{n}", nodes=(n, port, 2))
            for n in (0, 1)]
    try:
        for job in jobs:
            job.wait_for("ready_rank0", "ready_rank1")
        _signal_step(jobs, signum)
    finally:
        _finish_all(jobs)
    assert all((jobs[0].out / f"stopped_rank{r}.json").exists() for r in (0, 1)), \
        "\n".join(job.stderr[-3000:] for job in jobs)
    stops = [jobs[0].json(f"stopped_rank{r}.json")["step"] for r in (0, 1)]
    assert stops[0] == stops[1], stops
    announced = set()
    for node, job in enumerate(jobs):
        assert job.proc.returncode == 75, (node, job.stderr[-4000:])
        preempting = job.events("PREEMPTING")
        # group rank 0's stream holds the job's (the job view); another node's, its own
        assert len(preempting) <= 1 and (node or preempting), \
            (node, preempting, job.stderr[-3000:])
        announced.update((e["node"], e["timestamp"]) for e in preempting)
        (agent_exit,) = job.events("AGENT_EXIT")
        facts = agent_exit["data"]["drain"]
        assert agent_exit["state"] == "PREEMPTED"
        assert facts["stop_step"] == stops[0] and not facts["escalated"], facts
        assert facts["late_ranks"] == [] and facts["failed_ranks"] == {}, facts
        _no_worker_signalled(job)
        (line,) = [line for line in job.lines() if "drained" in line]
        assert f"every rank stopped at step {stops[0]};" in line, line
        assert signal.Signals(signum).name in line and "again" not in job.stderr, line
    assert len(announced) == 1, announced  # one PREEMPTING in the job


@pytest.mark.timeout(180)
def test_a_second_signal_to_every_process_seconds_later_escalates(tmp_path: Path) -> None:
    """The save takes 60 s; the second SIGTERM to all comes past the 1 s window."""
    job = Job(tmp_path, "--drain-grace", "120", "--drain-signal-window", "1", save_s="60")
    job.wait_for("ready_rank0", "ready_rank1")
    _signal_step([job], signal.SIGTERM)
    time.sleep(0.3)
    _signal_step([job], signal.SIGTERM)  # a copy within the window: the same drain
    time.sleep(2.5)
    assert job.proc.poll() is None, job.stderr[-3000:]
    _signal_step([job], signal.SIGTERM)
    _finish_all([job])
    assert job.proc.returncode == 75, job.stderr[-4000:]
    assert len(job.events("PREEMPTING")) == 1
    (agent_exit,) = job.events("AGENT_EXIT")
    facts = agent_exit["data"]["drain"]
    assert facts["escalated"], facts
    assert job.took < 3 + 5 + 15, job.took  # not the 60 s save, nor the 120 s grace
    assert sum("again during the drain" in line for line in job.stderr.splitlines()) == 1


@pytest.mark.timeout(180)
def test_a_scripts_own_sigusr1_handler_still_gets_it(tmp_path: Path) -> None:
    job = Job(tmp_path, "--drain-grace", "30", mode="own_usr1")
    job.wait_for("ready_rank0", "ready_rank1")
    sent = time.time()
    _signal_step([job], signal.SIGUSR1)
    _finish_all([job])
    assert job.proc.returncode == 75, job.stderr[-4000:]
    for rank in (0, 1):
        assert float((job.out / f"usr1_rank{rank}").read_text()) - sent < 5.0
    stops = [job.json(f"stopped_rank{r}.json")["step"] for r in (0, 1)]
    assert stops[0] == stops[1], stops
    assert len(job.events("PREEMPTING")) == 1
    _no_worker_signalled(job)


@pytest.mark.timeout(180)
def test_a_signal_to_one_worker_alone_drains_the_job(tmp_path: Path) -> None:
    job = Job(tmp_path, "--drain-grace", "30")
    job.wait_for("ready_rank0", "ready_rank1")
    workers = [p for p in psutil.Process(job.proc.pid).children(recursive=True)
               if p.environ().get("RANK") == "1"]
    assert len(workers) == 1, workers
    job.signalled = time.monotonic()
    os.kill(workers[0].pid, signal.SIGUSR1)
    _finish_all([job])
    assert job.proc.returncode == 75, job.stderr[-4000:]
    stops = [job.json(f"stopped_rank{r}.json")["step"] for r in (0, 1)]
    assert stops[0] == stops[1], stops
    (preempting,) = job.events("PREEMPTING")
    assert preempting["signal"] == "SIGUSR1", preempting
    _no_worker_signalled(job)
    (line,) = [line for line in job.lines() if "drained" in line]
    assert line.startswith("eventbus: SIGUSR1 on node 0: the job drained (every rank "
                           f"stopped at step {stops[0]};"), line
