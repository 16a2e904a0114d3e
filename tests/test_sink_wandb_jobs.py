"""``--sink wandb:PROJECT`` on real ``eventbus run`` jobs (2 gloo ranks on CPU), W&B in
offline mode, the offline runs read back (tests/wandb_helpers.py):

- a crash and a restart: one run, every rank's metrics, the failure's alert naming the
  rank's host and the restart, the events table, goodput in the summary, the run id in
  the workers' environment;
- a drained job started again with the same ``--rdzv-id``: both starts write the same run
  id with W&B's resume asked for; the first marks the run preempting;
- a W&B server that cannot be reached: the job succeeds, its events are counted as
  dropped, and the end waits no longer than the sinks' close budget.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eventbus.app.sinks import SINKS_CLOSE_TIMEOUT_S
from eventbus.app.sinks.wandb import wandb_run_id
from eventbus.subscribers.jsonl import read_jsonl
from tests.launcher_helpers import JOB_TIMEOUT_S
from tests.launcher_helpers import JOBS
from tests.launcher_helpers import job_env
from tests.launcher_helpers import run_command
from tests.sink_helpers import free_port
from tests.wandb_helpers import offline_runs

pytestmark = pytest.mark.slow
pytest.importorskip("wandb")

HOST = "node-17"


def wandb_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = job_env()
    env.update(WANDB_MODE="offline", WANDB_DIR=str(tmp_path), EVENTBUS_HOSTNAME=HOST)
    env.pop("WANDB_RUN_ID", None)
    env.update(extra)
    return env


def sinks_job(tmp_path: Path, *sink_args: str) -> list[str]:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    return [sys.executable, "-m", "eventbus", "run", "--events-jsonl",
            str(tmp_path / "events.jsonl"), *sink_args, "--standalone", "--nproc-per-node",
            "2", "--monitor-interval", "0.1", "--max-restarts", "1",
            str(JOBS / "sinks_job.py"), "--out", str(out)]


def test_a_crash_and_a_restart_make_one_run(tmp_path: Path) -> None:
    done = run_command(sinks_job(tmp_path, "--sink", "wandb:eventbus-test"), cwd=tmp_path,
                       env=wandb_env(tmp_path))
    ended = time.time()
    assert done.returncode == 0, done.stderr[-5000:]
    events = list(read_jsonl(tmp_path / "events.jsonl"))
    run_id = events[0]["context"]["run_id"]
    (run,) = offline_runs(tmp_path)
    assert run.run.run_id == wandb_run_id(run_id) and run.run.resume
    for rank in (0, 1):  # the script's own wandb.init could join: the id is exported
        assert (tmp_path / "out" / f"attempt1_rank{rank}.wandb_id").read_text() == \
            run.run.run_id
    # every rank's metrics of both attempts, the mean, the attempt
    for rank in (0, 1):
        assert sorted((s, round(v, 4)) for s, v in run.series(f"rank{rank}/loss")) == \
            [(s, round(rank + s / 10, 4)) for s in range(6)]
    assert sorted((s, round(v, 4)) for s, v in run.series("loss")) == \
        [(s, round(0.5 + s / 10, 4)) for s in range(6)]
    assert {r["eventbus/step"]: r["eventbus/attempt"] for r in run.history
            if "rank1/loss" in r} == {0: 0, 1: 0, 2: 0, 3: 1, 4: 1, 5: 1}
    # the failure's alert: the rank on its host, the exit, the restart; then the end
    texts = [a.text for a in run.alerts]
    assert texts[0].startswith(f"rank 1 on {HOST} failed (exit code 3"), texts
    assert "; the group restarts as attempt 1 (0 restarts left) [attempt 0, run " in texts[0]
    assert texts[-1].startswith("the job succeeded [attempt 1"), texts
    assert len(texts) == 2, texts  # rank 0, stopped by the agent, is no alert of its own
    # the events table, with the host of each event
    table = run.tables("eventbus/events")[0]
    kinds = [row[3] for row in table["data"]]
    assert kinds[0] == "AGENT_START" and kinds[-1] == "AGENT_EXIT", kinds
    assert kinds.count("WORKER_RESTART") == 1 and kinds.count("WORKER_START") == 4
    assert {row[2] for row in table["data"]} == {HOST}
    failed = next(row for row in table["data"] if row[3] == "WORKER_EXIT" and row[1] == 1)
    assert failed[4].startswith("rank 1 failed (exit code 3"), failed
    # goodput, live and at the end
    assert 0 < run.summary["eventbus/goodput_ratio"] <= 1
    assert run.summary["eventbus/goodput_s"] >= 0.3  # attempt 1's steps, 0.2 s apart
    assert "eventbus/badput_s/restart" in run.summary
    assert run.summary["eventbus/end"] == "the job succeeded" and run.exit_code == 0
    print(f"wandb offline: ended {ended - events[-1]['timestamp']:.1f} s after the last "
          f"event ({[e['type'] for e in events][-1]}), the close budget being "
          f"{SINKS_CLOSE_TIMEOUT_S:g} s")
    assert "dropped" not in done.stderr, done.stderr[-3000:]


def _drain_job(tmp_path: Path, name: str, port: int, **drain_env: str) -> subprocess.Popen[str]:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    env = wandb_env(tmp_path, DRAIN_OUT=str(out),
                    **{f"DRAIN_{k.upper()}": v for k, v in drain_env.items()})
    cmd = [sys.executable, "-m", "eventbus", "run", "--events-jsonl",
           str(tmp_path / f"{name}.jsonl"), "--sink", "wandb:eventbus-test",
           "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "wandb-requeue",
           "--monitor-interval", "0.1", str(JOBS / "drain_train.py")]
    return subprocess.Popen(cmd, cwd=tmp_path, env=env, text=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)


def _finish(proc: subprocess.Popen[str]) -> tuple[int, str]:
    try:
        _, stderr = proc.communicate(timeout=JOB_TIMEOUT_S)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
        raise
    return proc.returncode, stderr


@pytest.mark.timeout(400)
def test_a_drained_job_started_again_resumes_the_same_run(tmp_path: Path) -> None:
    first = _drain_job(tmp_path, "first", free_port())
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not all((tmp_path / "out" / f"ready_rank{r}").exists() for r in (0, 1)):
        assert first.poll() is None and time.monotonic() < deadline, _finish(first)[1][-4000:]
        time.sleep(0.05)
    os.kill(first.pid, signal.SIGTERM)  # the scheduler takes the node: a drain
    code, stderr = _finish(first)
    assert code == 75, stderr[-4000:]
    step = json.loads((tmp_path / "out" / "stopped_rank0.json").read_text())["step"]
    second = _drain_job(tmp_path, "second", free_port(), steps=str(step + 10),
                        ready_at="1000000")
    code, stderr = _finish(second)
    assert code == 0, stderr[-4000:]

    drained, resumed = offline_runs(tmp_path)
    # the same run, asked to resume (W&B joins them by id when they are synced)
    assert drained.run.run_id == resumed.run.run_id == "wandb-requeue"
    assert drained.run.resume and resumed.run.resume
    assert drained.preempting == 1 and resumed.preempting == 0
    levels = [(a.level, a.text.split(" [")[0]) for a in drained.alerts]
    assert levels[0][0] == "WARN" and levels[0][1].startswith("drain: SIGTERM on node 0 "
                                                              f"({HOST})"), levels
    assert levels[-1][0] == "WARN" and levels[-1][1].startswith("the job was preempted "
                                                                "by SIGTERM"), levels
    assert drained.exit_code == 75
    assert resumed.alerts[-1].text.startswith("the job succeeded") and resumed.exit_code == 0


def test_an_unreachable_server_costs_drops_never_the_job(tmp_path: Path) -> None:
    env = wandb_env(tmp_path, WANDB_MODE="online",
                    WANDB_BASE_URL=f"http://127.0.0.1:{free_port()}", WANDB_API_KEY="x" * 40)
    started = time.time()
    done = run_command(sinks_job(tmp_path, "--sink", "wandb:eventbus-test"), cwd=tmp_path,
                       env=env)
    ended = time.time()
    assert done.returncode == 0, done.stderr[-5000:]
    (agent_exit,) = [e for e in read_jsonl(tmp_path / "events.jsonl")
                     if e["type"] == "AGENT_EXIT"]
    after_exit = ended - agent_exit["timestamp"]
    print(f"wandb unreachable: the job took {ended - started:.1f} s, {after_exit:.1f} s of "
          f"it after AGENT_EXIT (sinks' close budget {SINKS_CLOSE_TIMEOUT_S:g} s)")
    lines = [line for line in done.stderr.splitlines()
             if line.startswith("eventbus: sink wandb:eventbus-test dropped")]
    assert len(lines) == 1, done.stderr[-5000:]
    print(lines[0])
    assert "W&B" in lines[0], lines
    # the close's budget, plus the interpreter's exit and a shared machine's slack
    assert after_exit < SINKS_CLOSE_TIMEOUT_S + 20, after_exit
