"""``eventbus run`` end to end in the real Slurm cluster (tests/slurm_cluster.py), through
the sbatch template of the docs (examples/slurm/train.sbatch) as it is: bad hosts evicted
and named in the host ledger under their Slurm names, a requeued run that keeps their
faults, ``sbatch $(eventbus hosts --format slurm)``, and a node lost for real.

The jobs are submitted together by a module fixture and run side by side; each test waits
on its own. The zero-configuration job itself (two nodes, no rendezvous option) is
tests/test_slurm_cluster.py's ``test_eventbus_run_over_two_nodes``.
"""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.slurm_cluster import SlurmCluster

pytestmark = pytest.mark.slow

TEMPLATE = ROOT / "examples" / "slurm" / "train.sbatch"
TRAIN = ROOT / "examples" / "slurm" / "train.py"

#: train.py whose worker dies of SIGSEGV at step 3 on n1 in the job's first run (after the
#: first collectives: its peer fails on the lost connection, as it would on a real crash)
CRASHY = f"""\
import os, runpy, signal, sys
import eventbus.preemption

CRASH = os.environ.get("SLURMD_NODENAME") == "n1" and not os.environ.get("SLURM_RESTART_COUNT")
real = eventbus.preemption.should_stop


def should_stop(step=None):
    if CRASH and step == 3:
        os.kill(os.getpid(), signal.SIGSEGV)
    return real(step=step)


eventbus.preemption.should_stop = should_stop
sys.argv[0] = {str(TRAIN)!r}
runpy.run_path({str(TRAIN)!r}, run_name="__main__")
"""


def _out(cluster: SlurmCluster, name: str) -> Path:
    folder = cluster.root / "out" / name
    folder.mkdir(parents=True)
    folder.chmod(0o777)
    return folder


def _env(out: Path, script: Path, eventbus_args: str, train_args: str) -> dict[str, str]:
    """The template's settings: this interpreter and tree, a script, options."""
    return {"PYTHON": sys.executable, "PYTHONPATH": str(ROOT), "SCRIPT": str(script),
            "CHECKPOINT": str(out / "ckpt.pt"), "EVENTBUS_ARGS": eventbus_args,
            "TRAIN_ARGS": train_args,
            # the test's nodes share this machine's hostname, which resolves to loopback:
            # gloo would bind there (docs/slurm.md, "What the tests run")
            "GLOO_SOCKET_IFNAME": "eth0",
            "EVENTBUS_WARM_SPARES": "off", "OMP_NUM_THREADS": "1"}


def _submit(cluster: SlurmCluster, out: Path, *args: str, env: dict[str, str]) -> int:
    return cluster.sbatch(TEMPLATE, f"--chdir={out}", f"--output={out}/slurm-%j.out",
                          "--open-mode=append", "--time=5", *args, env=env)


def _log(out: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted(out.glob("slurm-*.out")))


def _ledger_rows(path: Path) -> list[tuple[str, str, str, int]]:
    db = sqlite3.connect(path)
    try:
        return sorted(db.execute("SELECT host, job, faults, clean FROM "
                                 "eventbus_host_outcomes").fetchall())
    finally:
        db.close()


@pytest.fixture(scope="module")
def jobs(slurm_cluster: SlurmCluster) -> Iterator[dict[str, tuple[int, Path]]]:
    """The jobs, submitted at once."""
    submitted: dict[str, tuple[int, Path]] = {}
    out = _out(slurm_cluster, "badhost")
    crashy = out / "crashy.py"
    crashy.write_text(CRASHY)
    env = _env(out, crashy, f"--host-ledger {out / 'hosts.sqlite'} --nnodes 1:2 "
               "--max-restarts 3 --evict-after 2 --monitor-interval 0.2 "
               "--rdzv-conf last_call_timeout=2", "--steps 20")
    submitted["badhost"] = (_submit(slurm_cluster, out, "--exclude=n3", env=env), out)
    yield submitted


def test_a_node_that_segfaults_twice_is_evicted_and_named_in_the_ledger(
        slurm_cluster: SlurmCluster, jobs: dict[str, tuple[int, Path]]) -> None:
    """n1's worker dies of SIGSEGV on every attempt of the first run: n1 is evicted
    (exit 76), n2 trains on alone (--nnodes 1:2), and the ledger names n1 by its Slurm
    name with no EVENTBUS_HOSTNAME set. The job requeued by hand (same id,
    SLURM_RESTART_COUNT 1) runs clean and keeps those faults; the next submission, with
    ``$(eventbus hosts --format slurm)``, runs off n1."""
    job, out = jobs["badhost"]
    ledger = out / "hosts.sqlite"
    info = slurm_cluster.wait(job, timeout=180)
    log = _log(out)
    assert info["NodeList"] == "n[1-2]", info
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "76:0", f"{info}\n{log}"
    assert re.search(r"srun: error: n1: task \d+: Exited with exit code 76", log), log
    assert "eventbus: n1 evicted after 2 host faults (2 signal)" in log, log
    assert "n2: task" not in log, log  # n2's agent ended well
    assert (out / "ckpt.pt.txt").read_text().startswith("step 20 "), log
    first = _ledger_rows(ledger)
    faults = {host: json.loads(f) for host, _, f, _ in first if json.loads(f)}
    assert faults == {"n1": {"signal": 1}}, first  # one row per attempt
    assert sum(1 for host, _, f, _ in first if host == "n1" and json.loads(f)) == 2, first

    # requeued: the same job id, SLURM_RESTART_COUNT 1, the crash gone
    slurm_cluster.scontrol("requeue", str(job))
    info = slurm_cluster.wait(job, timeout=120)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", f"{info}\n{_log(out)}"
    again = _ledger_rows(ledger)
    assert set(first) <= set(again), again  # the first run's faults are kept
    requeued = sorted((host, clean) for host, key, _, clean in again
                      if key == f"{job}+requeue1")
    assert len(requeued) == 2 and all(clean == 1 for _, clean in requeued), again

    # the ledger keeps the next job off n1, through the real sbatch
    hosts = subprocess.run(
        [sys.executable, "-m", "eventbus", "hosts", "--ledger", str(ledger), "--format",
         "slurm"], capture_output=True, text=True, timeout=60, check=True,
        env={**slurm_cluster.env, "PYTHONPATH": str(ROOT)})
    assert hosts.stdout.split() == ["--exclude=n1"], hosts
    next_out = _out(slurm_cluster, "badhost-next")
    env = _env(next_out, TRAIN, "", "--steps 5")
    nxt = _submit(slurm_cluster, next_out, *hosts.stdout.split(), env=env)
    info = slurm_cluster.wait(nxt, timeout=120)
    assert info["JobState"] == "COMPLETED", f"{info}\n{_log(next_out)}"
    assert info["NodeList"] == "n[2-3]", info
