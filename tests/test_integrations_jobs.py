"""The trainer integrations on real jobs: ``python -m eventbus run --standalone
--nproc-per-node 2`` running a Lightning DDP script (tests/jobs/lightning_train.py) and a
Hugging Face Trainer script (tests/jobs/hf_train.py), gloo on CPU; SIGTERM to the agent's
pid alone, as a scheduler's kill of the main process.

For each trainer: the job drains (exit code 75, AGENT_EXIT PREEMPTED with the stop step S);
both ranks end at global step S; the trainer's own checkpoint for step S is on disk and
complete; CHECKPOINT_SAVED (step S, duration_s) and METRIC events (the logged loss) reach
the agent's JSONL through the worker forwarder. Then the same job again, resumed from that
checkpoint with ``max_steps`` S + 10: it exits 0, both ranks start from step S (the global
step at the first step's start: S steps are done; the first optimizer step it takes makes
it S + 1) and end at S + 10.

Both trainers take the ranks from the torchelastic environment that ``eventbus run`` (as
torchrun) sets: the processes that train are the agent's two workers (WORKER_START's pids).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from eventbus.subscribers.jsonl import read_jsonl
from tests.launcher_helpers import JOBS
from tests.launcher_helpers import job_env

pytestmark = pytest.mark.slow

#: generous: two ranks import torch and the trainer on a loaded 2-core machine
WAIT_S = 150.0


class Job:
    """One ``eventbus run`` job of 2 ranks of ``script`` in its own session; its files
    under ``<tmp_path>/<name>`` (the script's OUT), its events in ``<name>.jsonl``."""

    def __init__(self, tmp_path: Path, script: str, name: str, **env: str) -> None:
        self.script = script
        self.out = tmp_path / name
        self.out.mkdir()
        self.events_path = tmp_path / f"{name}.jsonl"
        self.stderr_path = tmp_path / f"{name}.stderr"
        cmd = [sys.executable, "-m", "eventbus", "run", "--events-jsonl",
               str(self.events_path), "--standalone", "--nproc-per-node", "2",
               "--monitor-interval", "0.1", "--drain-grace", "60", str(JOBS / script)]
        job_environment = job_env()
        job_environment.update(OUT=str(self.out), HF_HUB_OFFLINE="1",
                               TRANSFORMERS_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"),
                               **env)
        with self.stderr_path.open("w") as stderr:  # a file: no pipe to fill while we wait
            self.proc = subprocess.Popen(cmd, cwd=tmp_path, env=job_environment,
                                         stdout=subprocess.DEVNULL, stderr=stderr,
                                         start_new_session=True)

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace") if self.stderr_path.exists() else ""

    def tail(self) -> str:
        lines = [line for line in self.stderr.splitlines()
                 if not line.startswith(("frame #", "<omitting"))]  # c10d's C++ stacks
        return "\n".join(lines[-60:])

    def wait_for(self, *names: str, timeout: float = WAIT_S) -> None:
        deadline = time.monotonic() + timeout
        while not all((self.out / n).exists() for n in names):
            if self.proc.poll() is not None:
                raise AssertionError(f"the job ended before {names}: rc "
                                     f"{self.proc.returncode}\n{self.tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {names} in {timeout} s\n{self.tail()}")
            time.sleep(0.05)

    def signal(self, signum: int = signal.SIGTERM) -> None:
        os.kill(self.proc.pid, signum)  # the agent alone, as a scheduler signals it

    def finish(self, timeout: float = WAIT_S) -> int:
        try:
            return int(self.proc.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the job did not end in {timeout} s\n{self.tail()}") from None

    def kill(self) -> None:
        """End whatever is left of the job: the agent's session, then each worker's (the
        workers are session leaders of their own: torch's subprocess handler)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        pids = {int(p.read_text()) for p in self.out.glob("pid_rank*")}
        pids |= {int(e["worker_pid"]) for e in self.events("WORKER_START")
                 if e.get("worker_pid")}
        for pid in pids:
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue  # gone
            if self.script.encode() in cmdline:  # ours, not a reused pid
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        found = list(read_jsonl(self.events_path)) if self.events_path.exists() else []
        return [e for e in found if kind is None or e["type"] == kind]

    def json(self, name: str) -> Any:
        return json.loads((self.out / name).read_text())

    def ends(self) -> list[dict[str, Any]]:
        return [self.json(f"end_rank{rank}.json") for rank in (0, 1)]


class Jobs:
    """Starts jobs and ends, at the test's end, whatever of them is still running."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.started: list[Job] = []

    def start(self, script: str, name: str, **env: str) -> Job:
        job = Job(self.tmp_path, script, name, **env)
        self.started.append(job)
        return job


@pytest.fixture
def jobs(tmp_path: Path) -> Iterator[Jobs]:
    started = Jobs(tmp_path)
    try:
        yield started
    finally:
        for job in started.started:
            job.kill()


def _drained(job: Job) -> int:
    """The checks every drained job passes; returns the stop step."""
    assert job.finish() == 75, job.tail()
    assert len(job.events("PREEMPTING")) == 1, job.tail()
    (agent_exit,) = job.events("AGENT_EXIT")
    assert agent_exit["state"] == "PREEMPTED" and agent_exit["exit_code"] == 75
    drain = agent_exit["data"]["drain"]
    assert drain["signal"] == "SIGTERM" and drain["late_ranks"] == [], drain
    assert job.events("WORKER_RESTART") == []
    assert {e["worker_id"]: e["exit_code"] for e in job.events("WORKER_EXIT")} == {0: 0, 1: 0}
    step = drain["stop_step"]
    assert isinstance(step, int) and step > 10, drain  # after the ready files' step 10
    return step


def _the_agents_workers_trained(job: Job, rank: str) -> None:
    """The trainer used the torchelastic ranks: the processes that trained and wrote the
    end files are the agent's two workers, worker i the trainer's rank i (nothing of the
    trainer's own spawning). ``rank``: the end files' key of the trainer's global rank."""
    workers = {e["worker_id"]: e["worker_pid"] for e in job.events("WORKER_START")}
    ends = job.ends()
    assert {end[rank]: end["pid"] for end in ends} == workers, (ends, workers)
    assert all(end["world_size"] == 2 for end in ends), ends


def _checkpoint_saved(job: Job, path: Path, step: int) -> None:
    """One CHECKPOINT_SAVED for the drain's save, from global rank 0 only."""
    saved = job.events("CHECKPOINT_SAVED")
    assert {e["context"]["rank"] for e in saved} == {0}, saved
    drains = [e for e in saved if e["data"].get("preempted")]
    assert [(e["path"], e["step"]) for e in drains] == [(str(path), step)], saved
    assert isinstance(drains[0]["duration_s"], float) and drains[0]["duration_s"] >= 0


def _metric_steps(job: Job, key: str) -> dict[int, set[int]]:
    """Each rank's steps of METRIC events that carry ``key`` (a float)."""
    steps: dict[int, set[int]] = {0: set(), 1: set()}
    for event in job.events("METRIC"):
        if key in event["data"]:
            assert type(event["data"][key]) is float, event
            steps[event["context"]["rank"]].add(event["step"])
    return steps


def _resumed(job: Job, step: int) -> None:
    """The resumed job: exit 0, each rank from step ``step`` to ``step + 10``."""
    assert job.finish() == 0, job.tail()
    (agent_exit,) = job.events("AGENT_EXIT")
    assert agent_exit["state"] == "SUCCEEDED", agent_exit
    for end in job.ends():
        # start_step: the global step when the first step began (``step`` steps were
        # done); first_end_step: after that first optimizer step
        assert (end["start_step"], end["first_end_step"], end["global_step"]) == (
            step, step + 1, step + 10), end


@pytest.mark.timeout(420)
def test_lightning_ddp_drains_at_one_step_with_its_checkpoint_and_resumes(
        jobs: Jobs) -> None:
    pytest.importorskip("lightning.pytorch")
    import torch

    first = jobs.start("lightning_train.py", "first")
    first.wait_for("ready_rank0", "ready_rank1")
    first.signal()
    step = _drained(first)
    ends = first.ends()
    assert [end["global_step"] for end in ends] == [step, step], ends
    assert [end["start_step"] for end in ends] == [0, 0], ends
    for end in ends:
        assert end["environment"] == "TorchElasticEnvironment", end
        assert end["local_rank"] == end["global_rank"], end
    _the_agents_workers_trained(first, "global_rank")

    path = first.out / "checkpoints" / f"preempted-step={step}.ckpt"
    checkpoint = torch.load(path, weights_only=False)  # complete, loadable
    assert checkpoint["global_step"] == step
    assert set(checkpoint["state_dict"]) == {"layer.weight", "layer.bias"}
    _checkpoint_saved(first, path, step)
    # log_every_n_steps=5, and the callback records at the stop step too; every rank
    steps = _metric_steps(first, "train_loss")
    for rank in (0, 1):
        assert {5, 10, step} <= steps[rank], steps

    second = jobs.start("lightning_train.py", "second", CKPT=str(path),
                        MAX_STEPS=str(step + 10))
    _resumed(second, step)


@pytest.mark.timeout(420)
def test_transformers_ddp_drains_at_one_step_with_its_checkpoint_and_resumes(
        jobs: Jobs) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")

    first = jobs.start("hf_train.py", "first")
    first.wait_for("ready_rank0", "ready_rank1")
    first.signal()
    step = _drained(first)
    ends = first.ends()
    assert [end["global_step"] for end in ends] == [step, step], ends
    assert [end["start_step"] for end in ends] == [0, 0], ends
    _the_agents_workers_trained(first, "process_index")

    path = first.out / "hf" / f"checkpoint-{step}"
    state = json.loads((path / "trainer_state.json").read_text())
    assert state["global_step"] == step
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state_0.pth",
                 "rng_state_1.pth"):  # the Trainer's whole checkpoint, each rank's RNG
        assert (path / name).is_file(), sorted(p.name for p in path.iterdir())
    assert not (first.out / "hf" / f"checkpoint-{step + 1}").exists()
    _checkpoint_saved(first, path, step)
    # logging_steps=5: the Trainer logs the loss (averaged over the ranks) on every rank
    steps = _metric_steps(first, "loss")
    for rank in (0, 1):
        assert {5, 10} <= steps[rank], steps

    second = jobs.start("hf_train.py", "second", RESUME=str(path), MAX_STEPS=str(step + 10))
    _resumed(second, step)
