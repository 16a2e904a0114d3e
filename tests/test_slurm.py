"""``eventbus run`` under SLURM (docs/slurm.md, "Zero configuration under srun"): what is
derived from hand-made SLURM environments, what wins over it, the usage error of several
tasks on a node, the ledger's host and job key; and one real two-agent job started with
nothing but SLURM's variables."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sqlite3
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from eventbus.app.launcher.hosts.book import HostBook
from eventbus.app.launcher.slurm import environment as slurm
from tests.launcher_helpers import job_env

JOB_ID = "4242"
PORT = slurm.PORT_BASE + 4242


def _step_env(nodes: str = "n[1-3]", count: int = 3, node: str = "n2",
              **extra: str) -> dict[str, str]:
    """What SLURM sets in a task of ``srun --ntasks-per-node=1`` on ``count`` nodes."""
    env = {"SLURM_JOB_ID": JOB_ID, "SLURM_JOBID": JOB_ID, "SLURM_STEP_ID": "0",
           "SLURM_STEPID": "0", "SLURM_JOB_NODELIST": nodes, "SLURM_NODELIST": nodes,
           "SLURM_STEP_NODELIST": nodes, "SLURM_JOB_NUM_NODES": str(count),
           "SLURM_NNODES": str(count), "SLURM_STEP_NUM_NODES": str(count),
           "SLURM_NTASKS": str(count), "SLURM_STEP_NUM_TASKS": str(count),
           "SLURM_TASKS_PER_NODE": f"1(x{count})", "SLURM_STEP_TASKS_PER_NODE": f"1(x{count})",
           "SLURMD_NODENAME": node, "SLURM_PROCID": "1", "SLURM_NODEID": "1",
           "SLURM_LOCALID": "0"}
    env.update(extra)
    return env


def _scontrol(addrs: dict[str, str]) -> tuple[list[str], object]:
    """A stand-in for ``scontrol show node -o NAME``: the names asked, and the runner."""
    asked: list[str] = []

    def run(node: str) -> str | None:
        asked.append(node)
        if node not in addrs:
            return None
        return (f"NodeName={node} Arch=x86_64 CoresPerSocket=1 CPUAlloc=0 "
                f"NodeAddr={addrs[node]} NodeHostName={node} Version=23.11.4 OS=Linux")
    return asked, run


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    from eventbus.app.launcher.command import build_parser

    return build_parser()


def _fill(parser: argparse.ArgumentParser, argv: list[str], env: dict[str, str],
          addrs: dict[str, str] | None = None) -> tuple[argparse.Namespace, str | None,
                                                        list[str]]:
    args = parser.parse_args([*argv, "train.py"], namespace=slurm.unset_namespace())
    asked, run = _scontrol({"n1": "10.1.0.1", "n2": "10.1.0.2"} if addrs is None else addrs)
    line = slurm.fill_args(parser, args, env, scontrol=run)  # type: ignore[arg-type]
    return args, line, asked


def _rdzv(args: argparse.Namespace) -> tuple[str, str, str, str]:
    return args.nnodes, args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id


# -- what is derived -------------------------------------------------------------------------

def test_an_srun_task_derives_nnodes_the_rendezvous_at_the_first_node_and_its_id(
        parser: argparse.ArgumentParser) -> None:
    args, line, asked = _fill(parser, ["--nproc-per-node", "2"], _step_env())
    assert _rdzv(args) == ("3", "c10d", f"10.1.0.1:{PORT}", JOB_ID)
    # the first node of n[1-3], expanded by the project's hostlist; then this node
    assert asked == ["n1", "n2"]
    assert line == (f"SLURM job {JOB_ID} step 0 (3 nodes n[1-3], this one n2): derived "
                    f"--nnodes 3 --rdzv-backend c10d --rdzv-endpoint 10.1.0.1:{PORT} "
                    f"--rdzv-id {JOB_ID} --local-addr 10.1.0.2 (n1's NodeAddr); an option "
                    "given on the command line wins")
    assert args.local_addr == "10.1.0.2"  # what this node advertises: its own NodeAddr
    assert args.nproc_per_node == "2"
    assert args.rdzv_conf == "is_host=0"  # n1 hosts the store, by SLURM's word


def test_the_first_node_hosts_the_rendezvous_store(parser: argparse.ArgumentParser) -> None:
    """torch would guess from the machine's names and addresses; SLURM's name decides."""
    args, line, _ = _fill(parser, [], _step_env(node="n1"))
    assert args.rdzv_conf == "is_host=1"
    assert line is not None and "(n1's NodeAddr; this node hosts the rendezvous)" in line
    args, _, _ = _fill(parser, ["--rdzv-conf", "read_timeout=120"], _step_env(node="n1"))
    assert args.rdzv_conf == "read_timeout=120,is_host=1"
    args, _, _ = _fill(parser, ["--rdzv-conf", "is_host=0"], _step_env(node="n1"))
    assert args.rdzv_conf == "is_host=0"  # the user's word wins
    # an endpoint given: no is_host; no SLURMD_NODENAME: torch's guess
    args, _, _ = _fill(parser, ["--rdzv-endpoint", "h:1", "--rdzv-backend", "c10d"],
                       _step_env(node="n1"))
    assert args.rdzv_conf == ""
    env = {k: v for k, v in _step_env().items() if k != "SLURMD_NODENAME"}
    args, line, _ = _fill(parser, [], env)
    assert args.rdzv_conf == "" and line is not None and "this one" not in line
    args, _, _ = _fill(parser, [], _step_env(node="login1"))  # not a node of the step
    assert args.rdzv_conf == ""


def test_this_node_advertises_its_own_node_addr(parser: argparse.ArgumentParser) -> None:
    """--local-addr is this node's NodeAddr (the first node's is asked once); given, or
    not known to scontrol, or not a node of the step: torch's default (the hostname)."""
    args, _, asked = _fill(parser, [], _step_env(node="n1"))
    assert args.local_addr == "10.1.0.1" and asked == ["n1"]
    args, line, asked = _fill(parser, ["--local-addr", "mine"], _step_env())
    assert args.local_addr == "mine" and asked == ["n1"]
    assert line is not None and "--local-addr" not in line.split(";")[0]
    args, line, _ = _fill(parser, [], _step_env(node="n3"))
    assert args.local_addr is None and line is not None and "--local-addr" not in line
    args, _, asked = _fill(parser, [], _step_env(node="login1"))
    assert args.local_addr is None and asked == ["n1"]
    # the rendezvous given by hand: this node's address is still derived
    argv = ["--nnodes", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1",
            "--rdzv-id", "x"]
    args, line, asked = _fill(parser, argv, _step_env())
    assert args.local_addr == "10.1.0.2" and asked == ["n2"]
    assert line is not None and "derived --local-addr 10.1.0.2;" in line


def test_the_step_not_the_job_gives_the_nodes(parser: argparse.ArgumentParser) -> None:
    """srun on two of the job's four nodes: the step's count and its first node."""
    env = _step_env("gpu[07-10]", 4, SLURM_STEP_NODELIST="gpu[09-10]",
                    SLURM_STEP_NUM_NODES="2", SLURM_NNODES="2", SLURM_NODELIST="gpu[09-10]",
                    SLURM_STEP_NUM_TASKS="2", SLURM_STEP_TASKS_PER_NODE="1(x2)")
    args, _, asked = _fill(parser, [], env, {"gpu09": "10.2.0.9"})
    assert asked == ["gpu09"] and _rdzv(args)[:3] == ("2", "c10d", f"10.2.0.9:{PORT}")


def test_a_node_without_a_node_addr_is_reached_by_its_name(
        parser: argparse.ArgumentParser) -> None:
    """scontrol missing or silent (no NodeAddr=): the name, and the line says so."""
    args, line, _ = _fill(parser, [], _step_env(), addrs={})
    assert args.rdzv_endpoint == f"n1:{PORT}"
    assert line is not None and "(n1: scontrol gave no NodeAddr, so its name)" in line


def test_node_addr_reads_scontrol_and_survives_its_failures() -> None:
    assert slurm.node_addr("a", lambda n: "NodeName=a NodeAddr=a-ib0 State=IDLE") == "a-ib0"
    assert slurm.node_addr("a", lambda n: "NodeName=a NodeHostName=a") is None
    assert slurm.node_addr("a", lambda n: None) is None

    def broken(node: str) -> str | None:
        raise OSError("no scontrol")

    assert slurm.node_addr("a", broken) is None
    # the real runner without scontrol on PATH: None, no exception
    old = os.environ.get("PATH", "")
    try:
        os.environ["PATH"] = "/nonexistent"
        assert slurm.run_scontrol("n1") is None
    finally:
        os.environ["PATH"] = old


def test_an_ipv6_node_addr_is_bracketed(parser: argparse.ArgumentParser) -> None:
    args, _, _ = _fill(parser, [], _step_env(), {"n1": "fd00::1"})
    assert args.rdzv_endpoint == f"[fd00::1]:{PORT}"


def test_every_node_computes_the_same_port_from_the_job_id() -> None:
    assert slurm.rendezvous_port("4242") == 19242
    assert slurm.rendezvous_port("1234567") == slurm.PORT_BASE + 4567
    assert slurm.rendezvous_port("10000") == slurm.PORT_BASE
    assert all(slurm.PORT_BASE <= slurm.rendezvous_port(str(j)) < slurm.PORT_BASE
               + slurm.PORT_SPAN for j in (0, 9999, 123456789))


def test_a_task_of_an_array_job_is_its_own_rendezvous(parser: argparse.ArgumentParser) -> None:
    """Array tasks share SLURM_ARRAY_JOB_ID: the id is ARRAYJOB_TASK; the port comes from
    the task's own job id."""
    env = _step_env(SLURM_JOB_ID="5008", SLURM_ARRAY_JOB_ID="5000", SLURM_ARRAY_TASK_ID="7")
    args, line, _ = _fill(parser, [], env)
    assert args.rdzv_id == "5000_7"
    assert args.rdzv_endpoint == f"10.1.0.1:{slurm.PORT_BASE + 5008}"
    assert line is not None and line.startswith("SLURM job 5000_7 step 0")


# -- what wins over it ---------------------------------------------------------------------

def test_options_given_win_one_by_one(parser: argparse.ArgumentParser) -> None:
    args, line, _ = _fill(parser, ["--nnodes", "2:3", "--rdzv-id", "mine"], _step_env())
    assert _rdzv(args) == ("2:3", "c10d", f"10.1.0.1:{PORT}", "mine")
    assert line is not None and "derived --rdzv-backend c10d --rdzv-endpoint" in line
    assert "given: --nnodes, --rdzv-id" in line
    args, _, asked = _fill(parser, ["--rdzv-endpoint", "head:29400"], _step_env())
    # an endpoint given keeps torchrun's backend: the rendezvous is the user's
    assert _rdzv(args) == ("3", "static", "head:29400", JOB_ID) and asked == ["n2"]
    args, _, _ = _fill(parser, ["--rdzv-backend", "c10d"], _step_env())
    assert args.rdzv_endpoint == f"10.1.0.1:{PORT}"
    args, _, asked = _fill(parser, ["--rdzv-backend", "etcd-v2"], _step_env())
    assert (args.rdzv_backend, args.rdzv_endpoint, asked) == ("etcd-v2", "", ["n2"])


def test_all_given_derives_nothing_and_says_nothing(parser: argparse.ArgumentParser) -> None:
    argv = ["--nnodes", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1",
            "--rdzv-id", "x", "--local-addr", "a"]
    args, line, asked = _fill(parser, argv, _step_env())
    assert _rdzv(args) == ("3", "c10d", "h:1", "x") and line is None and asked == []
    # this node unknown to scontrol: nothing derived, nothing said
    args, line, _ = _fill(parser, argv[:-2], _step_env(), {})
    assert args.local_addr is None and line is None


def test_torchruns_environment_options_count_as_given(parser: argparse.ArgumentParser,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``PET_NNODES`` is torchrun's --nnodes: read when the parser is built."""
    monkeypatch.setenv("PET_NNODES", "1:3")
    from eventbus.app.launcher.command import build_parser

    args, _, _ = _fill(build_parser(), [], {**_step_env(), "PET_NNODES": "1:3"})
    assert args.nnodes == "1:3" and args.rdzv_backend == "c10d"


def test_standalone_wins(parser: argparse.ArgumentParser) -> None:
    args, line, asked = _fill(parser, ["--standalone"], _step_env())
    assert line is None and asked == []
    assert _rdzv(args) == ("1:1", "static", "", "none")  # torchrun's, which --standalone sets


def test_not_under_slurm_nothing_changes(parser: argparse.ArgumentParser) -> None:
    args, line, asked = _fill(parser, [], {"HOME": "/root"})
    plain = parser.parse_args(["train.py"])
    assert _rdzv(args) == _rdzv(plain) == ("1:1", "static", "", "none")
    assert line is None and asked == []


def test_an_allocation_without_srun_derives_nothing(parser: argparse.ArgumentParser) -> None:
    """An salloc shell or a batch script: a job id, no step. Nothing is derived; with
    several nodes one line says to start it under srun; on one node nothing is said."""
    env = {k: v for k, v in _step_env().items()
           if k not in ("SLURM_STEP_ID", "SLURM_STEPID")}
    args, line, asked = _fill(parser, [], env)
    assert _rdzv(args) == ("1:1", "static", "", "none") and asked == []
    assert line is not None and line.startswith(
        f"SLURM job {JOB_ID} has 3 nodes but this agent is not an srun task")
    assert "srun --ntasks-per-node=1" in line
    one = {**env, "SLURM_JOB_NUM_NODES": "1", "SLURM_NNODES": "1"}
    assert _fill(parser, [], one)[1] is None
    assert _fill(parser, ["--nnodes", "3"], env)[1] is None  # the user set it up
    # SLURM's own steps (batch 0xfffffffb, interactive 0xfffffffa) are not srun steps
    batch = {**env, "SLURM_STEP_ID": str(0xFFFFFFFB)}
    assert _rdzv(_fill(parser, [], batch)[0])[0] == "1:1"


# -- several tasks on a node ----------------------------------------------------------------

@pytest.mark.parametrize("extra", [
    {"SLURM_NTASKS_PER_NODE": "2"},
    {"SLURM_STEP_TASKS_PER_NODE": "2,1,1", "SLURM_STEP_NUM_TASKS": "4"},
    {"SLURM_STEP_NUM_TASKS": "6", "SLURM_STEP_TASKS_PER_NODE": ""},
], ids=["ntasks-per-node", "tasks-per-node", "ntasks"])
def test_more_than_one_task_on_a_node_is_a_usage_error(
        parser: argparse.ArgumentParser, extra: dict[str, str]) -> None:
    with pytest.raises(slurm.SlurmUsageError) as caught:
        _fill(parser, [], _step_env(**extra))
    text = str(caught.value)
    assert text.startswith("SLURM started ") and f"(job {JOB_ID}, step 0)" in text
    assert "srun --ntasks-per-node=1 python -m eventbus run" in text
    assert "#SBATCH --ntasks-per-node=1" in text


def test_the_usage_error_exits_2_with_the_fix(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    from eventbus.app.launcher.command import main

    for key, value in _step_env(SLURM_NTASKS_PER_NODE="4").items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as caught:
        main(["--nproc-per-node", "1", "train.py"])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert "eventbus run: error: SLURM started 4 tasks on a node" in err
    assert "--ntasks-per-node=1" in err


def test_malformed_slurm_values_name_the_variable() -> None:
    with pytest.raises(slurm.SlurmUsageError, match=r"\$SLURM_STEP_NODELIST"):
        slurm.read_step(_step_env(SLURM_STEP_NODELIST="n[1-"))
    with pytest.raises(slurm.SlurmUsageError, match=r"\$SLURM_STEP_NUM_NODES='x'"):
        slurm.read_step(_step_env(SLURM_STEP_NUM_NODES="x"))
    with pytest.raises(slurm.SlurmUsageError, match="names 3 nodes but the step has 2"):
        slurm.read_step(_step_env(SLURM_STEP_NUM_NODES="2"))


# -- the ledger's host and job ---------------------------------------------------------------

def test_the_ledger_host_is_the_slurm_node_name_unless_eventbus_hostname_says(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EVENTBUS_HOSTNAME", raising=False)
    monkeypatch.setenv("SLURMD_NODENAME", "gpu17")
    assert HostBook.for_this_host().host == "gpu17"
    monkeypatch.setenv("EVENTBUS_HOSTNAME", "mine")
    assert HostBook.for_this_host().host == "mine"
    monkeypatch.delenv("EVENTBUS_HOSTNAME")
    monkeypatch.delenv("SLURMD_NODENAME")
    assert HostBook.for_this_host().host == os.uname().nodename


def test_the_node_name_is_exported_for_the_events_and_the_workers() -> None:
    env = {"SLURMD_NODENAME": "gpu17"}
    assert slurm.export_node_name(env) == "gpu17" and env["EVENTBUS_HOSTNAME"] == "gpu17"
    env = {"SLURMD_NODENAME": "gpu17", "EVENTBUS_HOSTNAME": "mine"}
    assert slurm.export_node_name(env) is None and env["EVENTBUS_HOSTNAME"] == "mine"
    assert slurm.export_node_name({}) is None


def test_a_requeued_run_has_its_own_ledger_job() -> None:
    assert slurm.ledger_job("4242", {}) == "4242"
    assert slurm.ledger_job("4242", {"SLURM_RESTART_COUNT": "0"}) == "4242"
    assert slurm.ledger_job("4242", {"SLURM_RESTART_COUNT": "2"}) == "4242+requeue2"
    assert slurm.ledger_job("5000_7", {"SLURM_RESTART_COUNT": "1"}) == "5000_7+requeue1"


def test_a_requeued_runs_agent_start_names_its_ledger_job() -> None:
    """``AGENT_START``'s extra fields: the run's ledger key in a requeued run only, as a
    real event carries them (``eventbus hosts --from`` reads it back)."""
    from eventbus.bus import Bus
    from eventbus.events import EventType

    assert slurm.requeued_run("4242", {}) == {}
    fields = slurm.requeued_run("4242", {"SLURM_RESTART_COUNT": "2"})
    assert fields == {"data": {slurm.LEDGER_JOB_KEY: "4242+requeue2"}}
    bus, seen = Bus("test"), []
    bus.subscribe(EventType.AGENT_START, on_event=seen.append)
    bus.record(EventType.AGENT_START, entrypoint="train.py", **fields)
    assert seen[0].data == {"ledger_job": "4242+requeue2"}


# -- a real job ------------------------------------------------------------------------------

WORKER = """\
import json, os, sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
total = torch.ones(1)
dist.all_reduce(total)
rank = dist.get_rank()
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump({"world": dist.get_world_size(), "sum": total.item(),
               "host": os.environ.get("EVENTBUS_HOSTNAME"),
               "run_id": os.environ.get("TORCHELASTIC_RUN_ID")}, f)
dist.destroy_process_group()
"""

SCONTROL = """\
#!/bin/sh
# scontrol show node -o NAME: every node is this machine
echo "NodeName=$4 Arch=x86_64 NodeAddr=127.0.0.1 NodeHostName=$4 State=ALLOCATED"
"""


def _free_slurm_job_id() -> str:
    """A job id whose derived rendezvous port is free here now."""
    for offset in range(7, slurm.PORT_SPAN, 97):
        with contextlib.closing(socket.socket()) as sock:
            try:
                sock.bind(("127.0.0.1", slurm.PORT_BASE + offset))
            except OSError:
                continue
        return str(880000 + offset)
    raise AssertionError("no free port in the rendezvous range")


@contextlib.contextmanager
def _agents(cmds: list[tuple[list[str], dict[str, str]]], cwd: Path
            ) -> Iterator[list[subprocess.Popen[str]]]:
    procs = [subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
             for cmd, env in cmds]
    try:
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, 9)
                proc.wait(timeout=30)


def _run_two_agents(tmp_path: Path, job_id: str, restart: int) -> dict[int, dict[str, object]]:
    """``srun -N2 --ntasks-per-node=1 python -m eventbus run --nproc-per-node 1 job.py``
    as SLURM would start it on n1 and n2 (run ``restart`` of the job: 0, or a requeue);
    each agent's derived line checked; the ranks' reports."""
    bin_dir, script, ledger = tmp_path / "bin", tmp_path / "job.py", tmp_path / "hosts.sqlite"
    if not bin_dir.exists():
        bin_dir.mkdir()
        fake = bin_dir / "scontrol"
        fake.write_text(SCONTROL)
        fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
        script.write_text(WORKER)
    out = tmp_path / f"out{restart}"
    out.mkdir()
    cmds = []
    for index, node in enumerate(("n1", "n2")):
        env = job_env()
        env.pop("EVENTBUS_HOSTNAME", None)
        env.update(_step_env("n[1-2]", 2, node, SLURM_JOB_ID=job_id, SLURM_JOBID=job_id,
                             SLURM_PROCID=str(index), SLURM_NODEID=str(index)))
        if restart:
            env["SLURM_RESTART_COUNT"] = str(restart)
        env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
        env["XDG_STATE_HOME"] = str(tmp_path / f"state-{node}")
        cmds.append(([sys.executable, "-m", "eventbus", "run", "--nproc-per-node", "1",
                      "--host-ledger", str(ledger), "--monitor-interval", "0.1",
                      str(script), str(out)], env))
    with _agents(cmds, tmp_path) as procs:
        results = [proc.communicate(timeout=240) for proc in procs]
    port = slurm.rendezvous_port(job_id)
    for proc, (_, err), node in zip(procs, results, ("n1", "n2"), strict=True):
        assert proc.returncode == 0, err[-4000:]
        derived = [line for line in err.splitlines() if line.startswith("eventbus: SLURM job")]
        hosts = "; this node hosts the rendezvous" if node == "n1" else ""
        assert derived == [
            f"eventbus: SLURM job {job_id} step 0 (2 nodes n[1-2], this one {node}): "
            f"derived --nnodes 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:{port} "
            f"--rdzv-id {job_id} --local-addr 127.0.0.1 (n1's NodeAddr{hosts}); an option "
            "given on the command line wins"], err[-4000:]
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}


@pytest.mark.slow
def test_a_zero_config_srun_job_forms_one_two_node_job(tmp_path: Path) -> None:
    """Two agents started as SLURM's srun would start them on nodes n1 and n2 (the SLURM_*
    variables set by hand), with no rendezvous option at all, form one job of two nodes;
    the job requeued (SLURM_RESTART_COUNT 1) forms again and its ledger rows are its own.

    Every node is this machine: a fake ``scontrol`` on PATH gives every NodeAddr as
    127.0.0.1. The same job under a real slurmctld and slurmd, each node at its own
    address, is tests/test_slurm_cluster.py's ``test_eventbus_run_over_two_nodes``."""
    job_id = _free_slurm_job_id()
    for restart in (0, 1):
        ranks = _run_two_agents(tmp_path, job_id, restart)
        assert sorted(ranks) == [0, 1], restart
        assert all(r["world"] == 2 and r["sum"] == 2.0 and r["run_id"] == job_id
                   for r in ranks.values())
        # the workers name their node as SLURM does
        assert sorted(str(r["host"]) for r in ranks.values()) == ["n1", "n2"]
    db = sqlite3.connect(tmp_path / "hosts.sqlite")
    try:
        rows = sorted(db.execute("SELECT host, job, attempt, clean FROM "
                                 "eventbus_host_outcomes").fetchall())
    finally:
        db.close()
    requeued = f"{job_id}+requeue1"
    assert rows == [("n1", job_id, 0, 1), ("n1", requeued, 0, 1),
                    ("n2", job_id, 0, 1), ("n2", requeued, 0, 1)]


def test_the_docs_show_the_template_verbatim() -> None:
    """docs/slurm.md's template is examples/slurm/train.sbatch, byte for byte."""
    root = Path(__file__).resolve().parents[1]
    template = (root / "examples" / "slurm" / "train.sbatch").read_text()
    page = (root / "docs" / "slurm.md").read_text()
    assert f"```bash\n{template}```\n" in page
