"""The test Slurm cluster (tests/slurm_cluster.py) behaves as the scheduler features the
project relies on promise: steps over several nodes at their own addresses, requeue with
SLURM_RESTART_COUNT, node exclusion, scancel's and --signal's delivery, preemption by a
higher-priority partition, and a two-node ``python -m eventbus run`` job from the sbatch
template the docs show (examples/slurm/train.sbatch).

The jobs that wait on the scheduler's clock (the requeue, the ``--signal=USR1@N`` warning)
are submitted together by a module fixture and run side by side while the other tests run.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.slurm_cluster import SlurmCluster

pytestmark = pytest.mark.slow

#: a step that records each SIGUSR1 it gets (one line per task) until ``done`` exists
STEP = ('trap "echo \\$SLURM_PROCID >> $OUT/step.usr1" USR1; touch $OUT/step.ready; '
        'while [ ! -e $OUT/done ]; do sleep 0.1; done')

SIGNALLED = f"""#!/bin/bash
trap 'echo batch >> "$OUT/batch.usr1"' USR1
srun bash -c '{STEP}' &
while [ ! -e "$OUT/done" ]; do sleep 0.1; done
wait
"""

REQUEUED = """#!/bin/bash
#SBATCH --requeue
echo "run ${SLURM_RESTART_COUNT:-0}" >> "$OUT/runs"
if [ -z "${SLURM_RESTART_COUNT:-}" ]; then
    scontrol requeue "$SLURM_JOB_ID"
    sleep 60
fi
"""


def _out(cluster: SlurmCluster, name: str) -> Path:
    folder = cluster.root / "out" / name
    folder.mkdir(parents=True)
    folder.chmod(0o777)
    return folder


def _wait_file(path: Path, timeout: float, cluster: SlurmCluster) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return path.read_text()
        time.sleep(0.1)
    raise AssertionError(f"{path} did not appear in {timeout} s\n{cluster.tails()}")


@pytest.fixture(scope="module")
def early(slurm_cluster: SlurmCluster) -> Iterator[dict[str, tuple[int, Path]]]:
    """The jobs that take time, submitted at once to run beside the other tests: the
    requeue (held for cred_expire after its requeue), the --signal=USR1@N warning (the
    controller checks time limits every 30 s or so), and the two-node eventbus job (off
    n3, which the preemption and node-failure tests take)."""
    jobs: dict[str, tuple[int, Path]] = {}
    out = _out(slurm_cluster, "requeue")
    jobs["requeue"] = (slurm_cluster.sbatch(REQUEUED, "-x", "n3", env={"OUT": str(out)}), out)
    out = _out(slurm_cluster, "warning")
    jobs["warning"] = (slurm_cluster.sbatch(
        SIGNALLED, "-w", "n2", "--time=1", "--signal=USR1@55", env={"OUT": str(out)}), out)
    out = _out(slurm_cluster, "eventbus")
    jobs["eventbus"] = (slurm_cluster.sbatch(
        ROOT / "examples" / "slurm" / "train.sbatch", f"--chdir={out}",
        f"--output={out}/slurm-%j.out", "--time=5", "--exclude=n3",
        env={"PYTHON": sys.executable, "PYTHONPATH": str(ROOT),
             "SCRIPT": str(ROOT / "examples" / "slurm" / "train.py"),
             "GLOO_SOCKET_IFNAME": "eth0", "CHECKPOINT": str(out / "ckpt.pt"),
             "TRAIN_ARGS": f"--steps 20 --report-dir {out}"}), out)
    yield jobs


def test_a_step_runs_on_three_nodes_at_three_addresses(
        slurm_cluster: SlurmCluster, early: dict[str, tuple[int, Path]]) -> None:
    done = slurm_cluster.run(
        "srun", "-N3", "-n3", "--ntasks-per-node=1", "bash", "-c",
        "echo $SLURMD_NODENAME $(ip -4 -o addr show eth0 | awk '{print $4}')", timeout=30)
    seen = dict(line.split() for line in done.stdout.splitlines())
    assert seen == {n.name: f"{n.addr}/{slurm_cluster.prefixlen}"
                    for n in slurm_cluster.nodes}
    assert len(set(seen.values())) == 3


def test_exclude_keeps_the_job_off_the_node(slurm_cluster: SlurmCluster) -> None:
    out = _out(slurm_cluster, "exclude")
    job = slurm_cluster.sbatch(
        "#!/bin/bash\nsrun bash -c 'echo $SLURMD_NODENAME' > \"$OUT/nodes\"\n",
        "-N2", "--exclude=n1", env={"OUT": str(out)})
    info = slurm_cluster.wait(job, timeout=30)
    assert info["JobState"] == "COMPLETED", info
    assert info["NodeList"] == "n[2-3]"
    assert sorted((out / "nodes").read_text().split()) == ["n2", "n3"]


@pytest.mark.parametrize("how, batch_gets, step_gets", [
    ("--batch", True, False),
    ("--full", True, True),
    ("", False, True),
])
def test_scancel_signal_reaches(slurm_cluster: SlurmCluster, how: str, batch_gets: bool,
                                step_gets: bool) -> None:
    out = _out(slurm_cluster, f"scancel{how}")
    job = slurm_cluster.sbatch(SIGNALLED, "-w", "n1", env={"OUT": str(out)})
    slurm_cluster.wait(job, states=["RUNNING"], timeout=30)
    _wait_file(out / "step.ready", 30, slurm_cluster)
    slurm_cluster.run("scancel", "--signal=USR1", *filter(None, [how]), str(job))
    _wait_file(out / ("batch.usr1" if batch_gets else "step.usr1"), 15, slurm_cluster)
    time.sleep(0.5)  # what else arrives, arrives with it
    (out / "done").touch()
    info = slurm_cluster.wait(job, timeout=30)
    assert info["JobState"] == "COMPLETED", info
    assert (out / "batch.usr1").exists() == batch_gets
    assert (out / "step.usr1").exists() == step_gets
    if step_gets:
        assert (out / "step.usr1").read_text().split() == ["0"]


def test_a_higher_priority_partition_preempts_and_requeues(
        slurm_cluster: SlurmCluster) -> None:
    out = _out(slurm_cluster, "preempt")
    low = slurm_cluster.sbatch(
        '#!/bin/bash\necho "run ${SLURM_RESTART_COUNT:-0}" >> "$OUT/runs"\n'
        'while [ ! -e "$OUT/done" ]; do sleep 0.1; done\n',
        "-p", "low", "-w", "n3", "-c", "4", "--requeue", env={"OUT": str(out)})
    slurm_cluster.wait(low, states=["RUNNING"], timeout=30)
    _wait_file(out / "runs", 30, slurm_cluster)
    high = slurm_cluster.sbatch("#!/bin/bash\ntrue\n", "-p", "high", "-w", "n3", "-c", "4")
    assert slurm_cluster.wait(high, timeout=60)["JobState"] == "COMPLETED"
    info = slurm_cluster.wait(low, states=["RUNNING"], timeout=60)
    assert info["Restarts"] == "1"
    _wait_file_lines(out / "runs", 2, 30, slurm_cluster)
    (out / "done").touch()
    assert slurm_cluster.wait(low, timeout=30)["JobState"] == "COMPLETED"
    assert (out / "runs").read_text().splitlines() == ["run 0", "run 1"]


def _wait_file_lines(path: Path, lines: int, timeout: float, cluster: SlurmCluster) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= lines:
            return
        time.sleep(0.1)
    raise AssertionError(f"{path} has not {lines} lines after {timeout} s\n{cluster.tails()}")


def test_a_killed_node_requeues_its_job_and_comes_back(slurm_cluster: SlurmCluster) -> None:
    out = _out(slurm_cluster, "killed")
    job = slurm_cluster.sbatch(
        '#!/bin/bash\necho "run ${SLURM_RESTART_COUNT:-0}" >> "$OUT/runs"\n'
        '[ -n "${SLURM_RESTART_COUNT:-}" ] || sleep 120\n',
        "-w", "n3", "--requeue", env={"OUT": str(out)})
    _wait_file(out / "runs", 30, slurm_cluster)
    slurm_cluster.kill_node("n3")
    deadline = time.monotonic() + 40
    while "DOWN" not in slurm_cluster.node_state("n3") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "DOWN" in slurm_cluster.node_state("n3"), slurm_cluster.tails()
    info = slurm_cluster.job_info(job)
    assert info["JobState"] in ("PENDING", "REQUEUED", "REQUEUE_HOLD"), info
    assert info["Restarts"] == "1"
    slurm_cluster.restart_node("n3")
    info = slurm_cluster.wait(job, timeout=60)
    assert info["JobState"] == "COMPLETED", info
    assert (out / "runs").read_text().splitlines() == ["run 0", "run 1"]


def test_requeue_runs_the_job_again(slurm_cluster: SlurmCluster,
                                    early: dict[str, tuple[int, Path]]) -> None:
    job, out = early["requeue"]
    info = slurm_cluster.wait(job, timeout=60)
    assert info["JobState"] == "COMPLETED", info
    assert info["Restarts"] == "1"
    assert (out / "runs").read_text().splitlines() == ["run 0", "run 1"]


def test_signal_before_the_time_limit_reaches_the_step(
        slurm_cluster: SlurmCluster, early: dict[str, tuple[int, Path]]) -> None:
    job, out = early["warning"]
    _wait_file(out / "step.usr1", 50, slurm_cluster)
    (out / "done").touch()
    info = slurm_cluster.wait(job, timeout=30)
    assert info["JobState"] == "COMPLETED", info
    assert (out / "step.usr1").read_text().split() == ["0"]
    assert not (out / "batch.usr1").exists()  # no B: prefix: the steps only


def test_eventbus_run_over_two_nodes(slurm_cluster: SlurmCluster,
                                     early: dict[str, tuple[int, Path]]) -> None:
    """examples/slurm/train.sbatch: one ``python -m eventbus run`` agent per node, with
    no rendezvous option (zero configuration under srun, docs/slurm.md): c10d rendezvous
    at the first node's NodeAddr, each node advertising its own NodeAddr (its hostname
    resolves to loopback here), gloo between the nodes' own addresses."""
    job, out = early["eventbus"]
    info = slurm_cluster.wait(job, timeout=150)
    log = next(out.glob("slurm-*.out")).read_text(errors="replace")
    assert info["JobState"] == "COMPLETED", f"{info}\n{log}\n{slurm_cluster.tails()}"
    ranks = sorted(p.read_text().split() for p in out.glob("rank*.txt"))
    assert [r[0] for r in ranks] == ["0", "1"], log
    nodes = {r[1] for r in ranks}
    assert len(nodes) == 2 and "n3" not in nodes, ranks
    assert {r[2] for r in ranks} == {slurm_cluster.node(n).addr for n in nodes}, ranks
    assert (out / "ckpt.pt.txt").read_text().startswith("step 20 "), log
    port = 15000 + job % 10000
    first = slurm_cluster.node(sorted(nodes)[0]).addr
    for node in nodes:
        hosts = "; this node hosts the rendezvous" if slurm_cluster.node(node).addr == first else ""
        assert (f"eventbus: SLURM job {job} step 0 (2 nodes {info['NodeList']}, this one "
                f"{node}): derived --nnodes 2 --rdzv-backend c10d --rdzv-endpoint "
                f"{first}:{port} --rdzv-id {job} --local-addr "
                f"{slurm_cluster.node(node).addr} ({sorted(nodes)[0]}'s NodeAddr{hosts}); an "
                "option given on the command line wins") in log, log
