"""Goodput on real ``eventbus run`` jobs whose truth is known (2 gloo ranks on CPU,
tests/jobs/drain_train.py): a crash a known time after a checkpoint is ``wasted`` within
max(0.5 s, 25%); a drained job's figures add up to its wall time with ``drain`` in them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.launcher_helpers import JOBS
from tests.launcher_helpers import job_env
from tests.launcher_helpers import run_command

pytestmark = pytest.mark.slow

SCRIPT = JOBS / "drain_train.py"


def _cmd(tmp_path: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "eventbus", "run", "--events-jsonl",
            str(tmp_path / "events.jsonl"), *args, "--standalone", "--nproc-per-node", "2",
            "--monitor-interval", "0.1", str(SCRIPT)]


def _env(out: Path, **drain: str) -> dict[str, str]:
    env = job_env()
    env["DRAIN_OUT"] = str(out)
    env.update({f"DRAIN_{k.upper()}": v for k, v in drain.items()})
    return env


def _goodput(tmp_path: Path) -> dict[str, Any]:
    done = run_command([sys.executable, "-m", "eventbus", "goodput", "--json",
                        str(tmp_path / "events.jsonl")], cwd=tmp_path, timeout=60)
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    assert sum(result["badput_s"].values()) + result["goodput_s"] == pytest.approx(
        result["wall_s"], abs=0.01)
    return result


@pytest.mark.timeout(180)
def test_a_crash_after_a_checkpoint_wastes_the_time_since_it(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    done = run_command(_cmd(tmp_path, "--max-restarts", "0"), cwd=tmp_path, timeout=150,
                       env=_env(out, mode="ckpt_crash", ckpt_at="30", crash_after="150"))
    assert done.returncode == 1, done.stderr[-3000:]
    truth = float((out / "crash_rank1").read_text()) - float((out / "ckpt_done").read_text())
    result = _goodput(tmp_path)
    wasted = result["badput_s"]["wasted"]
    assert abs(wasted - truth) <= max(0.5, 0.25 * truth), (wasted, truth, result)
    assert 140 <= result["wasted_steps"] <= 150  # as far as the last heartbeat saw
    assert result["badput_s"]["checkpoint"] > 0.25  # the 0.3 s save
    assert result["badput_s"]["startup"] > 0


@pytest.mark.timeout(180)
def test_a_drained_job_adds_up_with_its_drain(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.Popen(_cmd(tmp_path, "--drain-grace", "30"), cwd=tmp_path,
                            env=_env(out), text=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not all((out / f"ready_rank{r}").exists() for r in (0, 1)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.returncode
            time.sleep(0.05)
        time.sleep(1.0)  # a second of training
        os.kill(proc.pid, signal.SIGTERM)
        proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)
    assert proc.returncode == 75
    result = _goodput(tmp_path)
    assert result["badput_s"]["drain"] > 0 and result["goodput_s"] > 0.5, result
    assert result["ended"] and not result["badput_s"]["wasted"]


@pytest.mark.timeout(180)
def test_a_plain_scripts_torch_save_is_noticed_and_counted(tmp_path: Path) -> None:
    """tests/jobs/plain_train.py never imports eventbus; at step 20 rank 0 saves with
    torch.save. Its heartbeat carries the save (start, end, bytes), and the goodput counts
    its time as checkpoint."""
    out = tmp_path / "out"
    out.mkdir()
    env = job_env()
    env.update({"PLAIN_OUT": str(out), "PLAIN_SAVE_AT": "20", "PLAIN_STEPS": "60"})
    cmd = [sys.executable, "-m", "eventbus", "run", "--events-jsonl",
           str(tmp_path / "events.jsonl"), "--standalone", "--nproc-per-node", "2",
           "--monitor-interval", "0.1", str(JOBS / "plain_train.py")]
    done = run_command(cmd, cwd=tmp_path, timeout=150, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    truth = json.loads((out / "save.json").read_text())
    from eventbus.subscribers.jsonl import read_jsonl

    saves = [s for e in read_jsonl(tmp_path / "events.jsonl")
             if e["type"] == "WORKER_PROGRESS" for s in e["data"].get("saves", [])]
    assert len(saves) == 1, saves
    (save,) = saves
    assert save["kind"] == "torch.save" and save["ok"] and save["bytes"] > 32 * 2**20
    assert save["path"].endswith("ckpt.pt")
    assert abs(save["start"] - truth["start"]) < 0.05 and abs(save["end"] - truth["end"]) < 0.05
    result = _goodput(tmp_path)
    assert result["badput_s"]["checkpoint"] == pytest.approx(save["end"] - save["start"],
                                                            abs=0.01)


@pytest.mark.timeout(240)
def test_a_stall_and_its_restart_are_counted(tmp_path: Path) -> None:
    """tests/jobs/plain_train.py, rank 1 hangs in Python at step 25 of attempt 0 under
    --stall-timeout 4: the stall (its silence until the verdict) and the restart are
    badput, attempt 1 trains to the end, and the parts add up to the wall time."""
    out = tmp_path / "out"
    out.mkdir()
    env = job_env()
    env.update({"PLAIN_OUT": str(out), "PLAIN_MODE": "hang", "PLAIN_STEPS": "60"})
    cmd = [sys.executable, "-m", "eventbus", "run", "--events-jsonl",
           str(tmp_path / "events.jsonl"), "--stall-timeout", "4", "--standalone",
           "--nproc-per-node", "2", "--monitor-interval", "0.1", "--max-restarts", "1",
           str(JOBS / "plain_train.py")]
    done = run_command(cmd, cwd=tmp_path, timeout=200, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = _goodput(tmp_path)
    bad = result["badput_s"]
    assert 3.5 <= bad["stall"] <= 4 + 3, result  # the silence: the timeout, give or take
    assert bad["restart"] > 0 and bad["wasted"] > 0, result
    assert result["attempts"] == 2 and result["goodput_s"] > 0


@pytest.mark.timeout(240)
def test_two_nodes_one_job_wide_figure_with_each_nodes_share(tmp_path: Path) -> None:
    """Two agents on this machine (two nodes, one rank each): group rank 0's file gives
    the job-wide figure, and per node its share (its agent's events and its worker's)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    out = tmp_path / "out"
    out.mkdir()
    env = job_env()
    env.update({"PLAIN_OUT": str(out), "PLAIN_STEPS": "80"})
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "eventbus", "run", "--events-jsonl",
               str(tmp_path / f"node{node}.jsonl"), "--nnodes", "2", "--node-rank",
               str(node), "--nproc-per-node", "1", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"goodput-{port}",
               "--monitor-interval", "0.1", str(JOBS / "plain_train.py")]
        procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=env, text=True,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      start_new_session=True))
    try:
        for proc in procs:
            proc.communicate(timeout=200)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate(timeout=30)
    assert [p.returncode for p in procs] == [0, 0]
    done = run_command([sys.executable, "-m", "eventbus", "goodput", "--json",
                        str(tmp_path / "node0.jsonl")], cwd=tmp_path, timeout=60)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert set(result["nodes"]) == {"0", "1"}, result
    for node in result["nodes"].values():
        assert node["wall_s"] == pytest.approx(result["wall_s"], abs=0.01)
        assert sum(node["badput_s"].values()) + node["goodput_s"] == pytest.approx(
            node["wall_s"], abs=0.01)
        assert node["goodput_s"] > 0
    assert result["goodput_s"] > 0 and result["ended"]
