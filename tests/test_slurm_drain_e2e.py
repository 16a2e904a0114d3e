"""The drain under a real SLURM (tests/slurm_cluster.py's cluster): a two-node ``python -m
eventbus run`` job from the sbatch template (examples/slurm/train.sbatch, ``--requeue``)
running tests/jobs/drain_train.py; ``scancel --signal=USR1`` sends SIGUSR1 to every
process of the step on both nodes, the agents and the workers.

The job drains as one (every rank stopped at one step, no worker killed by the signal),
requeues itself (``scontrol requeue``: Restarts=1, with no RequeueExit in slurm.conf),
and the second run resumes from the stop step's checkpoint and completes. A plain
``scancel`` (SIGTERM to every process, SIGKILL ``KillWait`` = 20 s later in this
cluster): the template's grace (20 s) is fitted to it (12 s), said in one line, every rank
stops at one step with its checkpoint within it, no worker is killed, and the job stays
cancelled. A one-minute job with no ``--signal``: it drains
ahead of its time limit (its EndTime, read with squeue) and requeues itself.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytest.importorskip("tests.slurm_cluster", reason="the SLURM cluster fixture is not here")

from tests.slurm_cluster import KILL_WAIT_S
from tests.slurm_cluster import SlurmCluster

pytestmark = pytest.mark.slow


def _wait(paths: list[Path], timeout: float, cluster: SlurmCluster, out: Path) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            logs = "".join(p.read_text(errors="replace") for p in out.glob("slurm-*.out"))
            raise AssertionError(f"no {paths} in {timeout} s\n{logs[-4000:]}\n"
                                 f"{cluster.tails()}")
        time.sleep(0.2)


def _submit(cluster: SlurmCluster, name: str, *args: str, steps: int = 300,
            step_s: float = 0.02, signal: bool = True) -> tuple[int, Path]:
    """The template, as it is or (``signal=False``) without its ``--signal`` line."""
    out = cluster.root / "out" / name
    out.mkdir(parents=True)
    out.chmod(0o777)
    template = ROOT / "examples" / "slurm" / "train.sbatch"
    script: Path | str = template if signal else "".join(
        line for line in template.read_text().splitlines(keepends=True)
        if not line.startswith("#SBATCH --signal"))
    job = cluster.sbatch(
        script, f"--chdir={out}",
        f"--output={out}/slurm-%j.out", "--open-mode=append", "--exclude=n3",
        *(args or ("--time=5",)), env={"PYTHON": sys.executable, "PYTHONPATH": str(ROOT),
             "SCRIPT": str(ROOT / "tests" / "jobs" / "drain_train.py"),
             "GLOO_SOCKET_IFNAME": "eth0", "DRAIN_OUT": str(out), "DRAIN_STEPS": str(steps),
             "DRAIN_STEP_S": str(step_s), "DRAIN_READY_AT": "20"})
    return job, out


@pytest.mark.timeout(300)
def test_scancel_signal_to_the_whole_step_drains_requeues_and_resumes(
        slurm_cluster: SlurmCluster) -> None:
    job, out = _submit(slurm_cluster, "drain-requeue")
    _wait([out / "ready_rank0", out / "ready_rank1"], 120, slurm_cluster, out)
    slurm_cluster.run("scancel", "--signal=USR1", str(job))
    _wait([out / "stopped_rank0.json", out / "stopped_rank1.json"], 60, slurm_cluster, out)
    stops = [json.loads((out / f"stopped_rank{r}.json").read_text()) for r in (0, 1)]
    assert stops[0]["step"] == stops[1]["step"], stops
    info = slurm_cluster.wait(job, states=("COMPLETED", "FAILED", "CANCELLED"), timeout=200)
    text = "\n".join(p.read_text(errors="replace") for p in out.glob("slurm-*.out"))
    assert info["JobState"] == "COMPLETED", f"{info}\n{text[-6000:]}"
    assert info["Restarts"] == "1", info  # requeued by the drain, with no RequeueExit
    finals = [json.loads((out / f"final_rank{r}.json").read_text()) for r in (0, 1)]
    assert [f["resumed_from"] for f in finals] == [stops[0]["step"]] * 2, finals
    drained = [line for line in text.splitlines() if "the job drained" in line]
    assert drained and all(f"every rank stopped at step {stops[0]['step']}" in line
                           for line in drained), text[-6000:]
    assert "ended on SIGUSR1" not in text and "again during the drain" not in text
    assert any("requeued" in line for line in text.splitlines()), text[-6000:]


@pytest.mark.timeout(300)
def test_scancel_drains_within_killwait_and_the_job_stays_cancelled(
        slurm_cluster: SlurmCluster) -> None:
    job, out = _submit(slurm_cluster, "drain-scancel")
    _wait([out / "ready_rank0", out / "ready_rank1"], 120, slurm_cluster, out)
    slurm_cluster.run("scancel", str(job))
    info = slurm_cluster.wait(job, timeout=60)
    text = "\n".join(p.read_text(errors="replace") for p in out.glob("slurm-*.out"))
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", info
    stops = [json.loads((out / f"stopped_rank{r}.json").read_text())["step"] for r in (0, 1)]
    assert stops[0] == stops[1], (stops, text[-6000:])
    fitted = [line for line in text.splitlines()
              if f"does not fit SLURM's KillWait ({KILL_WAIT_S} s)" in line]
    assert fitted and all(line.endswith(f"this drain's grace is {KILL_WAIT_S - 8} s")
                          for line in fitted), text[-6000:]
    drained = [line for line in text.splitlines() if "the job drained" in line]
    assert len(drained) == 2 and all(
        line.startswith("eventbus: SIGTERM on node ")
        and f"every rank stopped at step {stops[0]};" in line for line in drained), \
        text[-6000:]
    assert "ended on SIGTERM" not in text and "did not stop in time" not in text, \
        text[-6000:]


@pytest.mark.timeout(300)
def test_the_time_limit_without_signal_drains_ahead_of_it_and_requeues(
        slurm_cluster: SlurmCluster) -> None:
    """--time=1: each run drains 20 + 5 + 3 s before its end (about 32 s in), while it
    still trains (400 steps of 0.1 s take longer than that: 260 did not once the start
    got faster, and the run ended at 30 s); it requeues, and the run that can finish
    resumes from the last run's stop step and completes."""
    job, out = _submit(slurm_cluster, "drain-limit", "--time=1", steps=400, step_s=0.1,
                       signal=False)
    try:
        info = slurm_cluster.wait(job, timeout=200)
    finally:  # what the runs said, for a failure's report
        text = "\n".join(p.read_text(errors="replace") for p in out.glob("slurm-*.out"))
        print(text[-8000:])
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) >= 1, info
    last = [json.loads((out / f"stopped_rank{r}.json").read_text())["step"] for r in (0, 1)]
    assert last[0] == last[1], last
    drained = [line for line in text.splitlines() if "the job drained" in line]
    assert drained and all(line.startswith("eventbus: the time limit on node ")
                           and "every rank stopped at step" in line
                           for line in drained), text[-6000:]
    finals = [json.loads((out / f"final_rank{r}.json").read_text()) for r in (0, 1)]
    assert [f["resumed_from"] for f in finals] == [last[0]] * 2, finals
