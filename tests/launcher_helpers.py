"""Running real `python -m eventbus run` jobs from tests (shared by tests/test_launcher*.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

from eventbus.subscribers.jsonl import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
JOBS = ROOT / "tests" / "jobs"

#: generous: the machine is shared and a job with a restart takes ~10 s when idle
JOB_TIMEOUT_S = 240.0


@dataclass
class JobRun:
    returncode: int
    stdout: str
    stderr: str
    out: Path
    events: list[dict[str, Any]] = field(default_factory=list)
    torn: int = 0
    foreign: int = 0

    def of(self, event_type: str, **match: Any) -> list[dict[str, Any]]:
        """Events of a type whose fields (or context fields) equal ``match``."""
        found = []
        for event in self.events:
            if event["type"] != event_type:
                continue
            ctx = event["context"]
            if all(event.get(k, ctx.get(k)) == v for k, v in match.items()):
                found.append(event)
        return found

    def describe(self) -> str:
        return (f"rc={self.returncode}\n--- stderr (tail) ---\n{self.stderr[-6000:]}\n"
                f"--- events ---\n" + "\n".join(
                    f"{e['type']} {e.get('worker_id', '')} {e.get('exit_code', '')} "
                    f"attempt={e['context'].get('restart_count')}" for e in self.events))


def job_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    env["OMP_NUM_THREADS"] = "1"
    # Warm spares (on by default) import torch beside the workers after their first step:
    # their own tests (tests/test_spares.py, test_recovery.py) run them; elsewhere they
    # would only add CPU load to timing-sensitive jobs on 2 cores
    env.setdefault("EVENTBUS_WARM_SPARES", "off")
    env["LOGLEVEL"] = "INFO"
    return env


def run_command(cmd: list[str], *, cwd: Path, timeout: float = JOB_TIMEOUT_S,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` in its own session; on timeout kill the whole process group."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env or job_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=30)
        raise AssertionError(f"{cmd} timed out after {timeout}s\n{stderr[-6000:]}") from None
    except BaseException:  # pytest-timeout, Ctrl-C: leave no job behind
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def run_job(tmp_path: Path, *, eventbus_args: list[str] = (),  # type: ignore[assignment]
            torchrun_args: list[str] = (),  # type: ignore[assignment]
            job: str = "gloo_fail_once.py", job_args: list[str] = (),  # type: ignore[assignment]
            timeout: float = JOB_TIMEOUT_S) -> JobRun:
    """``python -m eventbus run --events-jsonl ... --standalone --nproc-per-node 2 ...``."""
    out = tmp_path / "out"
    out.mkdir(parents=True, exist_ok=True)
    events_path = tmp_path / "events.jsonl"
    cmd = [sys.executable, "-m", "eventbus", "run", "--events-jsonl", str(events_path),
           *eventbus_args, "--standalone", "--nproc-per-node", "2",
           "--monitor-interval", "0.1", *torchrun_args,
           str(JOBS / job), "--out", str(out), *job_args]
    done = run_command(cmd, cwd=tmp_path, timeout=timeout)
    result = JobRun(done.returncode, done.stdout, done.stderr, out)
    if events_path.exists():
        read = read_jsonl(events_path)
        result.events = list(read)
        result.torn, result.foreign = read.torn, read.foreign
    return result
