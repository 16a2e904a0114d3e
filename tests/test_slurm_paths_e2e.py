"""The drain on SLURM's other paths, in the real cluster of tests/slurm_cluster.py: the
time limit with ``--signal=USR1@N``, ``scontrol requeue`` from outside, and preemption by
a job of the higher-priority partition ``high`` (``PreemptMode=REQUEUE``).

Each is a two-node ``python -m eventbus run`` job of tests/jobs/drain_train.py (one worker
per node, each node's events in a file of its own per run). Each drains as one: the
``eventbus:`` lines name one stop step N, both ranks' checkpoints are at N, no worker
ends on the signal itself, the nodes' events files hold one ``PREEMPTING``; then the job
runs again (``Restarts=1``: requeued once, by the agent after the time limit, by SLURM
itself after ``scontrol requeue`` and the preemption), resumes from step N and ends
``COMPLETED``. Every rank exits within the grace (``--drain-grace 10``), and each node
says so in one line ("every rank stopped at step N"): after the time limit's SIGUSR1
because the agent that requeues the job waits until every node's drain ended; after a
SIGTERM because this cluster's ``KillWait`` (20 s) holds the whole drain (the grace, the
kill grace and the agents' exit: 18 s), so the grace is not shortened
(docs/preemption.md, "SLURM's paths").

The three jobs are submitted together by a module fixture and run side by side (one CPU
of each of their nodes; each its own rendezvous port): the time limit's job and the
requeued one on n1 and n2, the preempted one on n2 and n3, where the ``high`` job takes
all of n3 (it preempts only that job).
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT

pytest.importorskip("tests.slurm_cluster", reason="the SLURM cluster fixture is not here")

from tests.slurm_cluster import SlurmCluster
from tests.test_slurm_drain_e2e import _wait

pytestmark = pytest.mark.slow

#: two nodes, one ``eventbus run`` agent on each with one worker. The first run trains
#: until its drain; a run after a requeue trains 30 steps past the first run's stop step
#: (rank 0's ``stopped_rank0.json``) and completes, with a time limit of 5 minutes (root
#: may raise it; the agents read it after): a one-minute run's SIGUSR1, as early as 25 s
#: in, would otherwise race its workers' start on this machine's loaded CPUs. No
#: ``--kill-on-bad-exit``: the first agent's exit 75 would make srun SIGTERM the other
#: agent while it ends its drain.
JOB = r"""#!/bin/bash
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --requeue
set -euo pipefail
export DRAIN_STEPS=100000
if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then
    export DRAIN_STEPS=$("$PYTHON" -c 'import json, sys
print(json.load(open(sys.argv[1]))["step"] + 30)' "$DRAIN_OUT/stopped_rank0.json")
    scontrol update JobId="$SLURM_JOB_ID" TimeLimit=5
fi
node_addr() { scontrol show node -o "$1" | sed -n 's/.* NodeAddr=\([^ ]*\) .*/\1/p'; }
export -f node_addr
export HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export RDZV_ENDPOINT="$(node_addr "$HEAD_NODE"):$RDZV_PORT"
srun bash -c '
    exec "$PYTHON" -m eventbus run --nproc-per-node 1 --drain-grace "$DRAIN_GRACE" \
        --events-jsonl "$DRAIN_OUT/events-$SLURMD_NODENAME-${SLURM_RESTART_COUNT:-0}.jsonl" \
        --nnodes "$SLURM_JOB_NUM_NODES" --rdzv-backend c10d \
        --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "$SLURM_JOB_ID" \
        --rdzv-conf "is_host=$([ "$SLURMD_NODENAME" = "$HEAD_NODE" ] && echo 1 || echo 0)" \
        --local-addr "$(node_addr "$SLURMD_NODENAME")" "$SCRIPT"'
"""


def _submit(cluster: SlurmCluster, name: str, port: int, *args: str) -> tuple[int, Path]:
    out = cluster.root / "out" / name
    out.mkdir(parents=True)
    out.chmod(0o777)
    job = cluster.sbatch(
        JOB, f"--chdir={out}", f"--output={out}/slurm-%j.out", "--open-mode=append", *args,
        env={"PYTHON": sys.executable, "PYTHONPATH": str(ROOT), "RDZV_PORT": str(port),
             "SCRIPT": str(ROOT / "tests" / "jobs" / "drain_train.py"),
             "GLOO_SOCKET_IFNAME": "eth0", "DRAIN_OUT": str(out), "DRAIN_STEP_S": "0.05",
             "DRAIN_GRACE": "10", "DRAIN_READY_AT": "20", "DRAIN_SAVE_S": "0.05"})
    return job, out


@pytest.fixture(scope="module")
def jobs(slurm_cluster: SlurmCluster) -> Iterator[dict[str, tuple[int, Path]]]:
    """The three jobs, each training until its drain: the time limit's first, the other
    two once it trains (its clock runs from its start: three jobs starting together on
    this machine's CPUs take most of its minute to reach their first step). Each of
    those two is requeued (``scontrol requeue``) or preempted (a ``high`` job on n3) as
    soon as both its ranks are past step 20."""
    # the time limit: SLURM's USR1 5 to 35 s before the end (the controller checks every
    # 30 s and sends it at the check before the 5 s mark); the agent's own drain 10 + 5 +
    # 3 s before it, inside that window: either may come first
    limit = _submit(slurm_cluster, "paths-limit", 29611, "--time=1", "--signal=USR1@5",
                    "--exclude=n3")
    _wait([limit[1] / "ready_rank0", limit[1] / "ready_rank1"], 120, slurm_cluster, limit[1])
    submitted = {
        "limit": limit,
        "requeue": _submit(slurm_cluster, "paths-requeue", 29612, "--time=5", "--exclude=n3"),
        "preempt": _submit(slurm_cluster, "paths-preempt", 29613, "--time=5", "-w", "n2,n3"),
    }

    def requeue(job: int, out: Path) -> None:
        slurm_cluster.scontrol("requeue", str(job))

    def preempt(job: int, out: Path) -> None:
        slurm_cluster.sbatch("#!/bin/bash\nsleep 3\n", "-p", "high", "-w", "n3",
                             "--exclusive", f"--output={out}/high-%j.out")

    waiting = {"requeue": requeue, "preempt": preempt}
    deadline = time.monotonic() + 120
    while waiting:
        for name, act in list(waiting.items()):
            job, out = submitted[name]
            if (out / "ready_rank0").exists() and (out / "ready_rank1").exists():
                act(job, out)
                del waiting[name]
        if time.monotonic() > deadline:
            raise AssertionError(f"{sorted(waiting)} not past step 20 in 120 s\n"
                                 f"{slurm_cluster.tails()}")
        time.sleep(0.2)
    yield submitted


def _text(out: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted(out.glob("slurm-*.out")))


def _stops(out: Path, cluster: SlurmCluster, timeout: float) -> int:
    """The first run's stop step, the same on both ranks."""
    _wait([out / "stopped_rank0.json", out / "stopped_rank1.json"], timeout, cluster, out)
    time.sleep(0.2)  # the second rank's file may be mid-write
    stops = [json.loads((out / f"stopped_rank{r}.json").read_text()) for r in (0, 1)]
    assert stops[0]["step"] == stops[1]["step"], stops
    assert stops[0]["resumed_from"] == 0, stops
    return int(stops[0]["step"])


def _events(out: Path, run: int, kind: str) -> list[dict[str, Any]]:
    """``kind``'s events in both nodes' events files of run ``run``."""
    found = []
    for path in sorted(out.glob(f"events-*-{run}.jsonl")):
        found += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [e for e in found if e.get("type") == kind]


def _drained_as_one(info: dict[str, str], out: Path, stop: int, *reasons: str) -> str:
    """What every path asserts once its job ended: COMPLETED after one requeue, both
    ranks resumed from ``stop``, one drain line per node naming one of ``reasons`` and
    "every rank stopped at step ``stop``", no worker ended by the signal or late, no
    grace shortened, one PREEMPTING in the first run's events. The job's output."""
    text = _text(out)
    assert info["JobState"] == "COMPLETED", f"{info}\n{text[-6000:]}"
    assert info["Restarts"] == "1", f"{info}\n{text[-6000:]}"  # requeued once, not twice
    finals = [json.loads((out / f"final_rank{r}.json").read_text()) for r in (0, 1)]
    assert [f["resumed_from"] for f in finals] == [stop] * 2, finals
    drained = [line for line in text.splitlines() if "the job drained" in line]
    assert len(drained) == 2, f"{drained}\n{text[-6000:]}"  # one per node, in the first run
    assert all(line.startswith("eventbus: ") and any(f"{reason} on node " in line
                                                     for reason in reasons)
               and f"every rank stopped at step {stop};" in line
               for line in drained), f"{drained} (stop {stop})\n{text[-3000:]}"
    assert " at once (the script does not act" not in text, text[-6000:]
    assert "again during the drain" not in text, text[-6000:]
    assert "did not stop in time" not in text, text[-6000:]
    assert "does not fit" not in text, text[-6000:]  # the grace was not shortened
    assert "had not ended their drain" not in text, text[-6000:]
    assert not re.search(r"srun: error: .*(Terminated|Killed)", text), text[-6000:]
    # the job's one PREEMPTING: a node's file may record the job's copy of the other
    # node's event (the same timestamp and reason), never a second drain
    preempting = _events(out, 0, "PREEMPTING")
    assert preempting, text[-6000:]
    assert len({(e["timestamp"], e["reason"]) for e in preempting}) == 1, preempting
    assert not _events(out, 1, "PREEMPTING"), text[-6000:]
    print("\n".join(drained))
    return text


@pytest.mark.timeout(300)
def test_the_time_limit_with_signal_is_one_drain_and_the_job_requeues_and_resumes(
        slurm_cluster: SlurmCluster, jobs: dict[str, tuple[int, Path]]) -> None:
    """``--time=1 --signal=USR1@5``: SLURM's USR1 (5 to 35 s before the end) and the
    agent's own drain ahead of the time limit (18 s before it) are one drain, whichever
    comes first: the ranks stopped at one step; the agent requeues the job once both
    nodes ended their drain. The second run resumes at the stop step and completes."""
    job, out = jobs["limit"]
    stop = _stops(out, slurm_cluster, 120)
    info = slurm_cluster.wait(job, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"),
                              timeout=120)
    text = _drained_as_one(info, out, stop, "SIGUSR1", "the time limit")
    assert f"job {job} requeued: it resumes from the checkpoint of step {stop}" in text, \
        text[-6000:]


@pytest.mark.timeout(300)
def test_scontrol_requeue_drains_and_slurm_alone_requeues_the_job(
        slurm_cluster: SlurmCluster, jobs: dict[str, tuple[int, Path]]) -> None:
    """``scontrol requeue``: SLURM sends the step SIGTERM (SIGKILL KillWait = 20 s later)
    and requeues the job itself; every rank stops at one step with its checkpoint within
    the grace, the agent sees the job no longer RUNNING and does not requeue it again."""
    job, out = jobs["requeue"]
    stop = _stops(out, slurm_cluster, 60)
    info = slurm_cluster.wait(job, states=("COMPLETED", "FAILED", "CANCELLED"), timeout=120)
    text = _drained_as_one(info, out, stop, "SIGTERM")
    assert f"job {job} requeued" not in text, text[-6000:]
    assert f"job {job} is COMPLETING: not requeued" in text, text[-6000:]


@pytest.mark.timeout(300)
def test_a_preempted_job_drains_and_resumes_after_the_high_priority_job(
        slurm_cluster: SlurmCluster, jobs: dict[str, tuple[int, Path]]) -> None:
    """A job of partition ``high`` that needs all of n3 preempts the low job on n2 and n3
    (``PreemptMode=REQUEUE``: SIGTERM, SIGKILL 20 s later, requeued by SLURM): it drains,
    runs again once the high job has ended, resumes at the stop step and completes."""
    job, out = jobs["preempt"]
    stop = _stops(out, slurm_cluster, 60)
    (high_out,) = out.glob("high-*.out")
    high = int(high_out.stem.split("-")[1])
    high_info = slurm_cluster.wait(high, timeout=60)
    assert high_info["JobState"] == "COMPLETED", high_info
    info = slurm_cluster.wait(job, states=("COMPLETED", "FAILED", "CANCELLED"), timeout=120)
    text = _drained_as_one(info, out, stop, "SIGTERM")
    assert f"job {job} requeued" not in text, text[-6000:]
    started = [slurm_cluster.job_info(j)["StartTime"] for j in (high, job)]
    assert started[1] > started[0], started  # the low job ran again after the high one
