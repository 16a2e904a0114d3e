"""Row 46: evicting a node. Real agents on this machine as separate nodes, each with its own
host name (``EVENTBUS_HOSTNAME``), a c10d rendezvous with ``--nnodes 2:3``, one gloo
worker per node (tests/jobs/bad_host_job.py, which never imports eventbus).

- node-c's worker dies of a real SIGSEGV on every attempt: after the second, node-c's agent
  publishes ``HOST_EVICTED`` (heard on the other nodes too), exits with the bad-host code
  and leaves the rendezvous open; the job finishes on node-a and node-b, rc 0;
- node-d, started once node-c left, takes its place in the running job; so does node-d
  started while the three run (it waits beyond MAX, membership.py, until node-c leaves);
- a script bug on node-c (a Python exception on every attempt) is never a host fault:
  no eviction, the job fails as torchrun's would.

Each agent records its outcomes in one SQLite host ledger, read back at the end.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from eventbus.app.launcher.hosts.host_ledger import HostOutcome
from eventbus.app.launcher.hosts.host_ledger import read_outcomes
from tests.launcher_helpers import job_env
from tests.reliability.matrix import free_port

JOB = Path(__file__).resolve().parents[1] / "jobs" / "bad_host_job.py"
BAD_HOST_EXIT = 76


class Nodes:
    """The agents of one job, started and ended by the test."""

    def __init__(self, tmp_path: Path, *, job_args: list[str], max_restarts: int = 3,
                 agent_args: tuple[str, ...] = ("--stall-timeout", "off"),
                 nnodes: str = "2:3", rdzv_conf: str = "", job: Path = JOB) -> None:
        self.tmp = tmp_path
        self.out = tmp_path / "out"
        self.out.mkdir()
        self.ledger = tmp_path / "hosts.sqlite"
        self.port = free_port()
        self.job = job
        self.job_args = job_args
        self.max_restarts = max_restarts
        self.agent_args = list(agent_args)
        self.nnodes = nnodes
        self.rdzv_conf = "last_call_timeout=2,join_timeout=120" + (
            f",{rdzv_conf}" if rdzv_conf else "")
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.started: dict[str, float] = {}

    def start(self, host: str) -> None:
        cmd = [sys.executable, "-m", "eventbus", "run",
               "--events-jsonl", str(self.tmp / f"{host}.jsonl"),
               "--host-ledger", str(self.ledger), *self.agent_args,
               "--nnodes", self.nnodes, "--nproc-per-node", "1", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", "bad-hosts",
               "--rdzv-conf", self.rdzv_conf,
               "--max-restarts", str(self.max_restarts), "--monitor-interval", "0.1",
               str(self.job), "--out", str(self.out), *self.job_args]
        env = {**job_env(), "EVENTBUS_HOSTNAME": host}
        self.procs[host] = subprocess.Popen(
            cmd, cwd=self.tmp, env=env, text=True, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True)
        self.started[host] = time.monotonic()

    def wait_for_a_worker(self, host: str, timeout: float) -> None:
        """Until ``host``'s first worker wrote its attempt file (at most ``timeout`` s)."""
        deadline = time.monotonic() + timeout
        while not _attempts(self.out, host) and time.monotonic() < deadline:
            time.sleep(0.1)

    def wait(self, timeout: float) -> dict[str, int | None]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(p.poll() is None for p in
                                                   self.procs.values()):
            time.sleep(0.1)
        return {host: p.poll() for host, p in self.procs.items()}

    def run_three(self, timeout: float = 300) -> tuple[dict[str, int | None], dict[str, str]]:
        """node-a, node-b and node-c to their ends: their exit codes and outputs."""
        for host in ("node-a", "node-b", "node-c"):
            self.start(host)
        codes = self.wait(timeout)
        return codes, self.kill()

    def kill(self) -> dict[str, str]:
        outputs = {}
        for host, proc in self.procs.items():
            if proc.poll() is None:
                # its workers first: they live in sessions of their own, and one that hangs
                # (--fault hang) would outlive a failed test by an hour
                for pid in _descendants(proc.pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                os.killpg(proc.pid, signal.SIGKILL)
            text = proc.communicate(timeout=30)[0]
            if os.environ.get("EVENTBUS_TEST_KEEP"):
                Path(os.environ["EVENTBUS_TEST_KEEP"], f"{host}.log").write_text(text)
            outputs[host] = text[-4000:]
        return outputs

    def events(self, host: str) -> list[dict[str, Any]]:
        path = self.tmp / f"{host}.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def ledger_rows(self) -> list[HostOutcome]:
        return sorted(read_outcomes(str(self.ledger)), key=lambda o: (o.host, o.attempt))


def _descendants(root: int) -> list[int]:
    """The live processes below ``root`` (from /proc; empty where there is none)."""
    parents: dict[int, int] = {}
    for name in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    parents[int(name)] = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [], [root]
    while frontier:
        children = [pid for pid, ppid in parents.items() if ppid in frontier]
        found.extend(children)
        frontier = children
    return found


@pytest.fixture
def nodes(tmp_path: Path) -> Any:
    made: list[Nodes] = []

    def make(**kwargs: Any) -> Nodes:
        made.append(Nodes(tmp_path, **kwargs))
        return made[-1]

    yield make
    for n in made:
        n.kill()


def _attempts(out: Path, host: str) -> dict[int, tuple[int, int]]:
    found = {}
    for path in out.glob(f"{host}.attempt*"):
        rank, world = path.read_text().split()
        found[int(path.name.rpartition("attempt")[2])] = (int(rank), int(world))
    return found


def _node_d_replaces_node_c(job: Nodes, steps: int, *, when: Callable[[], bool]) -> tuple[
        dict[int, tuple[int, int]], dict[str, str]]:
    """Start node-a/b/c, then node-d once ``when()`` holds; node-c (the bad host) ends with
    the bad-host code, the others with 0, node-d having run in a world of 3, and all the
    steps done. node-d's attempts and the nodes' outputs."""
    for host in ("node-a", "node-b", "node-c"):
        job.start(host)
    deadline = time.monotonic() + 200
    while not when() and time.monotonic() < deadline:
        time.sleep(0.1)
    job.start("node-d")
    codes = job.wait(300)
    outputs = job.kill()
    assert codes == {"node-a": 0, "node-b": 0, "node-c": BAD_HOST_EXIT, "node-d": 0}, outputs
    joined = _attempts(job.out, "node-d")
    assert joined and max(w for _, w in joined.values()) == 3, (joined, outputs)
    assert (job.out / "step").read_text() == str(steps)
    return joined, outputs


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_node_that_segfaults_twice_is_evicted_and_the_job_finishes_on_two(
        nodes: Callable[..., Nodes], figure: Callable[[int, str], None]) -> None:
    job = nodes(job_args=["--bad-host", "node-c", "--fault", "segv", "--steps", "40"])
    codes, outputs = job.run_three()
    assert codes == {"node-a": 0, "node-b": 0, "node-c": BAD_HOST_EXIT}, outputs
    assert (job.out / "step").read_text() == "40"
    last = max(_attempts(job.out, "node-a"))
    assert _attempts(job.out, "node-a")[last][1] == 2 and last not in _attempts(
        job.out, "node-c"), outputs
    exits = [e for e in job.events("node-c") if e["type"] == "WORKER_EXIT"
             and e.get("data", {}).get("host_fault")]
    assert [e["data"]["host_fault"] for e in exits] == ["signal", "signal"], outputs["node-c"]
    (evicted,) = [e for e in job.events("node-c") if e["type"] == "HOST_EVICTED"]
    assert evicted["host"] == "node-c" and evicted["faults"] == 2
    heard = [e for host in ("node-a", "node-b") for e in job.events(host)
             if e["type"] == "HOST_EVICTED"]
    assert heard and all(e["host"] == "node-c" for e in heard), "not heard on node-a/b"
    assert "eventbus: node-c evicted after 2 host faults" in outputs["node-c"], outputs["node-c"]
    rows = job.ledger_rows()
    assert sum(r.faults.get("signal", 0) for r in rows if r.host == "node-c") == 2, rows
    assert any(r.host == "node-a" and r.clean for r in rows), rows
    figure(46, f"SIGSEGV twice on node-c of 3 (--nnodes 2:3): node-c exit {codes['node-c']}, "
               f"node-a/b rc 0 on world 2 at attempt {last}; ledger rows {len(rows)}")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_node_that_comes_after_the_eviction_takes_the_free_place(
        nodes: Callable[..., Nodes], figure: Callable[[int, str], None]) -> None:
    """node-c is evicted; node-d, started once it left (a replacement the scheduler sent),
    joins the running job through torch's membership change: the job ends on three nodes
    again, and node-c, whichever node served the rendezvous's store, ends with the bad-host
    code after the others.
    (A node that waits while the rendezvous is full, beyond MAX: the next test.)"""
    job = nodes(job_args=["--bad-host", "node-c", "--fault", "segv", "--steps", "150",
                          "--fault-at", "5"])
    joined, _ = _node_d_replaces_node_c(job, 150, when=lambda: any(
        e["type"] == "HOST_EVICTED" for e in job.events("node-c")))
    figure(46, f"a node started after node-c's eviction joined: attempts {sorted(joined)} "
               f"on node-d, world {max(w for _, w in joined.values())}")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_script_bug_on_one_node_is_never_a_host_fault(
        nodes: Callable[..., Nodes]) -> None:
    job = nodes(job_args=["--bad-host", "node-c", "--fault", "raise", "--steps", "40"],
                max_restarts=2)
    codes, outputs = job.run_three()
    assert codes["node-c"] == 1 and BAD_HOST_EXIT not in codes.values(), (codes, outputs)
    for host in ("node-a", "node-b", "node-c"):
        assert not [e for e in job.events(host) if e["type"] == "HOST_EVICTED"
                    or e.get("data", {}).get("host_fault")], host


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_exclude_bad_hosts_refuses_a_host_over_the_threshold_before_the_rendezvous(
        tmp_path: Path) -> None:
    """A ledger where node-c had two ECC faults today: `eventbus run --exclude-bad-hosts`
    on node-c exits with the bad-host code at once and says why, before any rendezvous; on
    node-a (clean) the same command runs the job."""
    from eventbus.app.launcher.hosts.host_ledger import write_outcomes

    ledger = tmp_path / "hosts.sqlite"
    write_outcomes(str(ledger), [
        HostOutcome(host="node-c", job="old-job", attempt=a, time=time.time() - 60,
                    faults={"ecc": 1}) for a in (0, 1)])
    script = tmp_path / "ok.py"
    script.write_text("print('ran')\n")
    runs = {}
    for host in ("node-c", "node-a"):
        proc = subprocess.run(
            [sys.executable, "-m", "eventbus", "run", "--exclude-bad-hosts",
             "--host-ledger", str(ledger), "--standalone", "--nproc-per-node", "1",
             str(script)], cwd=tmp_path, env={**job_env(), "EVENTBUS_HOSTNAME": host},
            capture_output=True, text=True, timeout=120, check=False)
        runs[host] = proc
    refused = runs["node-c"]
    assert refused.returncode == BAD_HOST_EXIT, refused.stderr
    assert "eventbus: node-c scores 4.00 in the host ledger (over --bad-host-threshold 1)" \
        in refused.stderr and "RENDEZVOUS" not in refused.stderr and "ran" not in refused.stdout
    assert runs["node-a"].returncode == 0 and "ran" in runs["node-a"].stdout, \
        runs["node-a"].stderr


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_restarts_spent_on_a_hang_end_with_the_hang_exit_code(tmp_path: Path) -> None:
    """A rank that spins forever, no restart allowed: the stall verdict ends the job with
    --hang-exit-code (124), not torchrun's 1, and says so; the culprit's WORKER_STALLED
    counts against its host (data["host_fault"] is "hang")."""
    from tests.launcher_helpers import run_job

    run = run_job(tmp_path, job="health_job.py", job_args=["--hang", "loop"],
                  eventbus_args=["--stall-timeout", "3"], torchrun_args=["--max-restarts", "0"],
                  timeout=150)
    assert run.returncode == 124, run.describe()
    assert "eventbus: the restarts were spent on hangs: exit 124" in run.stderr
    stalls = run.of("WORKER_STALLED")
    assert stalls and all(e["data"].get("host_fault") == "hang" for e in stalls), stalls


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_spare_node_waiting_beyond_max_takes_the_evicted_nodes_place(
        nodes: Callable[..., Nodes], figure: Callable[[int, str], None]) -> None:
    """Four nodes for `--nnodes 2:3`: node-d comes while the first three run their second
    attempt (after node-c's first fault), so torch keeps it waiting (its redundancy list).
    node-c faults again and is evicted; node-d takes its place and the job ends on three
    nodes, rc 0 everywhere but node-c. (Started during the first attempt, node-d may take
    node-c's place at the first re-form instead: node-c is then left out, the next test.)"""
    job = nodes(job_args=["--bad-host", "node-c", "--fault", "segv", "--steps", "200",
                          "--fault-at", "60"])
    joined, outputs = _node_d_replaces_node_c(job, 200,
                                              when=lambda: len(_attempts(job.out, "node-c")) > 1)
    # the waiting node never made the running group re-form while it was full (before
    # membership.py, 13 re-forms in 40 s, each leaving another node out)
    reforms = {host: sum(1 for e in job.events(host) if e["type"] == "WORKER_RESTART"
                         and e.get("cause") == "membership")
               for host in ("node-a", "node-b", "node-d")}
    assert max(reforms.values()) <= 2, (reforms, outputs)
    figure(46, f"a spare waiting beyond MAX took node-c's place: attempts {sorted(joined)} "
               f"on node-d, world {max(w for _, w in joined.values())}; membership "
               f"re-forms {reforms}")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_node_left_waiting_when_the_job_ends_exits_0_and_says_so(
        nodes: Callable[..., Nodes], figure: Callable[[int, str], None]) -> None:
    """`--nnodes 1:1`: node-a runs the job; node-b, started once node-a's attempt ran,
    finds the round full and waits (torch's redundancy list) until node-a ends and the
    rendezvous closes under it. torch's run() then returns None and its launch_agent fails
    on it (exit 1, an AttributeError); node-b ends with 0 and one line saying it was left
    out, its AGENT_EXIT says so, and the ledger counts no clean finish for it.

    The rendezvous's store is the test's own TCPStore (``is_host=false`` on both): the
    store held by node-a's agent would go with it, and node-b would see a broken
    connection instead of a closed rendezvous."""
    from torch.distributed import TCPStore

    job = nodes(job_args=["--steps", "60"], nnodes="1:1", rdzv_conf="is_host=false")
    store = TCPStore("127.0.0.1", job.port, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=60))
    job.start("node-a")
    job.wait_for_a_worker("node-a", 120)
    job.start("node-b")
    codes = job.wait(200)
    outputs = job.kill()
    assert codes == {"node-a": 0, "node-b": 0}, outputs
    assert not _attempts(job.out, "node-b"), outputs  # it never ran a worker
    assert "eventbus: node node-b was left out: the rendezvous closed while it waited to " \
        "join" in outputs["node-b"], outputs["node-b"]
    assert "Traceback" not in outputs["node-b"], outputs["node-b"]
    (end,) = [e for e in job.events("node-b") if e["type"] == "AGENT_EXIT"]
    assert end["exit_code"] == 0 and end["reason"].startswith("left out"), end
    rows = [r for r in job.ledger_rows() if r.host == "node-b"]
    assert rows and not any(r.clean for r in rows), rows
    del store
    figure(46, "a node left waiting when the job ended: exit 0, 'left out' (torch: exit 1, "
               "AttributeError)")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_node_whose_rank_is_the_culprit_of_two_hangs_is_evicted(
        nodes: Callable[..., Nodes], figure: Callable[[int, str], None]) -> None:
    """Eviction while stall verdicts are under way: node-c's rank blocks in a sleep while
    the others wait in the collective, on every attempt. The judge (group rank 0, on
    another node) names it the culprit; the verdict reaches node-c through the notice log
    and counts against its host; after the second, node-c leaves with the bad-host code and
    the job finishes on node-a and node-b. Nothing hangs: every agent ends."""
    job = nodes(job_args=["--bad-host", "node-c", "--fault", "hang", "--steps", "60",
                          "--fault-at", "10"],
                agent_args=("--stall-timeout", "3"))
    started = time.monotonic()
    codes, outputs = job.run_three()
    assert codes == {"node-a": 0, "node-b": 0, "node-c": BAD_HOST_EXIT}, outputs
    assert (job.out / "step").read_text() == "60"
    stalls = [e for host in ("node-a", "node-b", "node-c") for e in job.events(host)
              if e["type"] == "WORKER_STALLED" and e.get("data", {}).get("host_fault")]
    assert stalls and {e["data"]["host_fault"] for e in stalls} == {"hang"}, stalls
    (evicted,) = [e for e in job.events("node-c") if e["type"] == "HOST_EVICTED"]
    assert evicted["host"] == "node-c" and evicted["faults"] == 2, evicted
    assert "eventbus: node-c evicted after 2 host faults (2 hang)" in outputs["node-c"], \
        outputs["node-c"]
    rows = job.ledger_rows()
    assert sum(r.faults.get("hang", 0) for r in rows if r.host == "node-c") == 2, rows
    figure(46, f"node-c the culprit of two hangs: evicted (exit {codes['node-c']}), "
               f"node-a/b rc 0, {time.monotonic() - started:.0f} s in all")
