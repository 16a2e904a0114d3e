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
import time
from collections.abc import Callable
from collections.abc import Iterator
from pathlib import Path

import pytest

from eventbus.app.launcher.hosts.history import outcomes_from_files
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


#: train.py, a step every 0.2 s, reporting each attempt's world from its first step, until
#: $OUT/stop exists (then every rank saves and ends, as on a drain)
SLOW = f"""\
import os, runpy, sys, time
from pathlib import Path
import torch.distributed as dist
import eventbus.preemption

OUT = Path(os.environ["OUT"])
real = eventbus.preemption.should_stop


def should_stop(step=None):
    if step == 1:
        report = OUT / f"world-{{os.environ['EVENTBUS_ATTEMPT']}}-{{dist.get_rank()}}"
        report.write_text(f"{{dist.get_world_size()}} {{os.environ['SLURMD_NODENAME']}}")
    time.sleep(0.2)
    return real(step=step) or (OUT / "stop").exists()


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
               f"--events-jsonl {out / 'events.jsonl'} "
               "--max-restarts 3 --evict-after 2 --monitor-interval 0.2 "
               "--rdzv-conf last_call_timeout=2", "--steps 20")
    submitted["badhost"] = (_submit(slurm_cluster, out, "--exclude=n3", env=env), out)
    out = _out(slurm_cluster, "lost")
    slow = out / "slow.py"
    slow.write_text(SLOW)
    env = _env(out, slow, f"--host-ledger {out / 'hosts.sqlite'} --nnodes 2:3 "
               f"--max-restarts 3 --monitor-interval 0.2 --events-jsonl {out / 'events.jsonl'} "
               "--rdzv-conf last_call_timeout=2", "--steps 100000 --collective-timeout 8")
    # srun's own --no-kill (sbatch's is the allocation's: srun does not inherit it)
    env.update(OUT=str(out), SLURM_NO_KILL="set")
    submitted["lost"] = (_submit(slurm_cluster, out, "-N3", "--no-kill", env=env), out)
    yield submitted


def test_a_node_that_segfaults_twice_is_evicted_and_named_in_the_ledger(
        slurm_cluster: SlurmCluster, jobs: dict[str, tuple[int, Path]]) -> None:
    """n1's worker dies of SIGSEGV on every attempt of the first run: n1 is evicted
    (exit 76), n2 trains on alone (--nnodes 1:2), and the ledger names n1 by its Slurm
    name with no EVENTBUS_HOSTNAME set. The job requeued by hand (same id,
    SLURM_RESTART_COUNT 1) runs clean and keeps those faults, in the ledger and in the
    rows ``eventbus hosts --from`` reads from the job's events file; the next submission,
    with ``$(eventbus hosts --format slurm)``, runs off n1."""
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
    # the events file (both runs, both nodes) gives the same runs apart: --from
    outcomes, _ = outcomes_from_files([out / "events.jsonl"])
    runs = {(o.host, o.job): o for o in outcomes if o.faults or o.clean}
    assert sum(o.faults.get("signal", 0) for o in outcomes
               if (o.host, o.job) == ("n1", str(job))) == 2, outcomes
    assert runs[("n1", f"{job}+requeue1")].clean, outcomes
    assert not any(o.faults for o in outcomes if o.job == f"{job}+requeue1"), outcomes

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


def _wait_for(what: str, until: Callable[[], bool], timeout: float, cluster: SlurmCluster,
              out: Path) -> None:
    deadline = time.monotonic() + timeout
    while not until():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not in {timeout} s\n{_log(out)}\n{cluster.tails()}")
        time.sleep(0.2)


def test_a_node_lost_for_real_leaves_the_job_going_on_and_is_named(
        slurm_cluster: SlurmCluster, jobs: dict[str, tuple[int, Path]]) -> None:
    """Three nodes, --nnodes 2:3, --no-kill: n3 dies (its slurmd, agent and workers
    SIGKILLed, its link down). The survivors' collectives time out, they re-form as two
    nodes and train on; the new round's rank 0 names n3 on the console, the RENDEZVOUS
    events carry it, and the ledger holds n3's row with a ``lost`` fault. Once the two
    finish, the job ends by itself: COMPLETED on n[1-2] (SLURM took n3 out of it)."""
    job, out = jobs["lost"]
    worlds = lambda: {p.name: p.read_text() for p in out.glob("world-*")}  # noqa: E731
    _wait_for("three ranks", lambda: len(worlds()) >= 3, 120, slurm_cluster, out)
    assert sorted(worlds().values()) == ["3 n1", "3 n2", "3 n3"], worlds()
    slurm_cluster.kill_node("n3")
    try:
        _wait_for("two ranks again", lambda: any(v.startswith("2 ") for v in worlds().values()),
                  90, slurm_cluster, out)
        after = sorted(v for k, v in worlds().items() if not k.startswith("world-0-"))
        assert after == ["2 n1", "2 n2"], worlds()
        (out / "stop").touch()
        _wait_for("the checkpoint", (out / "ckpt.pt.txt").exists, 60,
                  slurm_cluster, out)
        _wait_for("the survivors' end", lambda: _log(out).count("eventbus: goodput") >= 2, 60,
                  slurm_cluster, out)
        log = _log(out)
        assert re.search(r"eventbus: n3 lost: gone from the rendezvous without a word after "
                         r"attempt 0; attempt \d+ goes on with 2 nodes", log), log
        events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
        named = [e for e in events if e.get("type") == "RENDEZVOUS"
                 and (e.get("data") or {}).get("lost") == ["n3"]]
        assert named, [e for e in events if e.get("type") == "RENDEZVOUS"]
        rows = _ledger_rows(out / "hosts.sqlite")
        assert [(h, json.loads(f)) for h, _, f, _ in rows if h == "n3"] == [("n3", {"lost": 1})]
        assert all(json.loads(f) == {} for h, _, f, _ in rows if h != "n3"), rows
        # srun heard of n3's failure (SRUN_NODE_FAIL: its task counts as ended), so the
        # job ends by itself once the survivors have, with their exit code
        info = slurm_cluster.wait(job, timeout=30)
        assert "srun: error: Node failure on n3" in _log(out), _log(out)
        assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", info
        assert info["NodeList"] == "n[1-2]" and info["Restarts"] == "0", info
    finally:
        slurm_cluster.run("scancel", str(job), check=False)  # ended already, unless failed
        slurm_cluster.restart_node("n3")
