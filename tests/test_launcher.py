"""End-to-end: real `python -m eventbus run --standalone` jobs on CPU with gloo.

The job (tests/jobs/gloo_fail_once.py): 2 workers, init_process_group("gloo"), an
all_reduce, then rank 1 exits with code 3 on attempt 0.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eventbus.subscribers.jsonl import read_jsonl
from tests.launcher_helpers import JOB_TIMEOUT_S
from tests.launcher_helpers import JOBS
from tests.launcher_helpers import JobRun
from tests.launcher_helpers import job_env
from tests.launcher_helpers import run_command
from tests.launcher_helpers import run_job

# Every test here starts a real `eventbus run` (torchrun and its workers, or at least the
# command and its torch import, ~2 s each on 2 cores): `make test-slow`. The fast loop
# has the in-process checks of the same rules (test_run_usage.py, test_launcher_internals.py).
pytestmark = pytest.mark.slow

REACTORS = "tests.jobs.reactors"


def _exit_time(run: JobRun, attempt: int, rank: int) -> float:
    return float((run.out / f"attempt{attempt}_rank{rank}.exit").read_text())


def _started(run: JobRun, attempt: int) -> set[int]:
    return {int(p.name.split("_rank")[1].split(".")[0])
            for p in run.out.glob(f"attempt{attempt}_rank*.started")}


def _assert_restart_succeeded(run: JobRun, *, restarts_left: int = 1) -> None:
    assert run.returncode == 0, run.describe()
    assert _started(run, 0) == {0, 1} and _started(run, 1) == {0, 1}, run.describe()
    exits = run.of("WORKER_EXIT", worker_id=1, exit_code=3)
    assert len(exits) == 1, run.describe()
    assert exits[0]["context"]["restart_count"] == 0
    restarts = run.of("WORKER_RESTART")
    assert [(r["attempt"], r["restarts_left"]) for r in restarts] == [(1, restarts_left)], \
        run.describe()
    for attempt in (0, 1):
        starts = run.of("WORKER_START", restart_count=attempt)
        assert sorted(s["worker_id"] for s in starts) == [0, 1], run.describe()
    assert [e["state"] for e in run.of("AGENT_EXIT")] == ["SUCCEEDED"]


def test_reactor_restart_recovers_the_job(tmp_path: Path) -> None:
    """RESTART from a reactor: the job exits 0, with the failure recorded within 1 s of the
    worker's exit, one WORKER_RESTART and WORKER_START for both ranks of both attempts."""
    run = run_job(tmp_path, eventbus_args=["--reactor", f"{REACTORS}:always_restart",
                                           "--log-events"],
                  torchrun_args=["--max-restarts", "2"])
    _assert_restart_succeeded(run)
    exit_event = run.of("WORKER_EXIT", worker_id=1, exit_code=3)[0]
    detected_after = exit_event["timestamp"] - _exit_time(run, 0, 1)
    print(f"WORKER_EXIT published {detected_after * 1000:.0f} ms after the worker's exit")
    assert 0 <= detected_after < 1.0, detected_after
    assert exit_event["worker_local_rank"] == 1 and exit_event["worker_pid"] > 0
    assert exit_event["signal"] is None
    # The reason names the failure and the reactor that decided.
    reason = run.of("WORKER_RESTART")[0]["reason"]
    assert "rank 1" in reason and "always_restart" in reason
    # Order on the bus: the failure, then the restart, then the new attempt's workers.
    kinds = [(e["type"], e["context"]["restart_count"]) for e in run.events
             if e["type"] in ("WORKER_EXIT", "WORKER_RESTART", "WORKER_START", "RENDEZVOUS",
                              "AGENT_START")]
    assert kinds[0] == ("AGENT_START", 0)
    first_exit = kinds.index(("WORKER_EXIT", 0))
    assert kinds.index(("WORKER_RESTART", 1)) > first_exit
    assert kinds.index(("WORKER_START", 1)) > kinds.index(("WORKER_RESTART", 1))
    assert len(run.of("RENDEZVOUS", state="SUCCEEDED")) == 2
    assert all(e["duration_s"] >= 0 for e in run.of("RENDEZVOUS"))
    # Torch's own records are kept, as TORCHELASTIC events, never as doubled typed ones.
    names = {e["name"] for e in run.of("TORCHELASTIC")}
    assert "torchelastic.worker.status.SUCCEEDED" in names
    assert len(run.of("WORKER_START")) == 4
    assert run.torn == 0 and run.foreign == 0
    # --log-events: the agent's console shows the failure as one line.
    assert "WORKER_EXIT worker_id=1 exit_code=3" in run.stderr


def test_non_retriable_exit_code_stops_at_once(tmp_path: Path) -> None:
    """STOP from a reactor fails the job with restarts left, and no second attempt runs."""
    run = run_job(tmp_path, eventbus_args=["--reactor", f"{REACTORS}:exit_3_is_fatal"],
                  torchrun_args=["--max-restarts", "2"])
    assert run.returncode == 3, run.describe()  # --stop-exit-code's default
    assert _started(run, 1) == set(), run.describe()
    assert run.of("WORKER_RESTART") == []
    assert len(run.of("WORKER_EXIT", worker_id=1, exit_code=3)) == 1
    assert {e["restart_count"] for e in
            (s["context"] for s in run.of("WORKER_START"))} == {0}
    agent_exit = run.of("AGENT_EXIT")
    assert [e["state"] for e in agent_exit] == ["FAILED"], run.describe()
    assert "STOP from NonRetriableExitCodes([3]" in agent_exit[0]["reason"]
    # The other worker was stopped by the agent, and says so.
    stopped = [e for e in run.of("WORKER_EXIT", worker_id=0) if e["exit_code"] != 0]
    assert all(e["data"].get("stopped_by_agent") for e in stopped)


def test_stop_reason_survives_a_torn_error_file_of_a_stopped_worker(tmp_path: Path) -> None:
    """A survivor killed by the agent's SIGTERM inside torch's record_exception leaves a torn
    error file; torch's reader raises JSONDecodeError on it, yet the STOP's exit code and
    reason reach AGENT_EXIT and no second attempt runs (the flake under CPU load)."""
    run = run_job(tmp_path, eventbus_args=["--reactor", f"{REACTORS}:exit_3_is_fatal"],
                  torchrun_args=["--max-restarts", "2"], job_args=["--torn-error-file"])
    assert run.returncode == 3, run.describe()
    assert run.of("WORKER_RESTART") == [], run.describe()
    (agent_exit,) = run.of("AGENT_EXIT")
    assert agent_exit["state"] == "FAILED", run.describe()
    assert "STOP from NonRetriableExitCodes([3]" in agent_exit["reason"], run.describe()
    assert "JSONDecodeError" not in agent_exit["reason"], run.describe()
    stopped = [e for e in run.of("WORKER_EXIT", worker_id=0) if e["exit_code"] != 0]
    assert stopped and all(e["data"].get("stopped_by_agent") for e in stopped), run.describe()


def test_a_torn_error_file_does_not_cost_the_restart(tmp_path: Path) -> None:
    """Without a reactor, a stopped survivor's torn error file is reported without its
    message and the group restarts as usual: attempt 1 finishes."""
    run = run_job(tmp_path, torchrun_args=["--max-restarts", "1"],
                  job_args=["--torn-error-file"])
    assert run.returncode == 0, run.describe()
    assert len(run.of("WORKER_RESTART")) == 1, run.describe()
    assert [e["state"] for e in run.of("AGENT_EXIT")] == ["SUCCEEDED"], run.describe()


def test_nan_loss_reported_by_a_worker_stops_the_job(tmp_path: Path) -> None:
    """A worker's METRIC with a NaN loss reaches the agent (over the store) before its failure
    is judged, so StopOnNonFiniteLoss stops the job with restarts left."""
    run = run_job(tmp_path, eventbus_args=["--reactor", f"{REACTORS}:stop_on_nan"],
                  torchrun_args=["--max-restarts", "2"], job_args=["--nan-loss"])
    assert run.returncode == 3, run.describe()  # --stop-exit-code's default
    assert run.of("WORKER_RESTART") == [], run.describe()
    nan = [e for e in run.of("METRIC", rank=1) if math.isnan(e["data"].get("loss", 0.0))]
    assert len(nan) == 1, run.describe()
    (failure,) = run.of("WORKER_EXIT", worker_id=1, exit_code=3)
    assert nan[0]["timestamp"] <= failure["timestamp"]
    assert run.events.index(nan[0]) < run.events.index(failure)
    (agent_exit,) = run.of("AGENT_EXIT")
    assert agent_exit["state"] == "FAILED"
    assert "STOP from StopOnNonFiniteLoss" in agent_exit["reason"], run.describe()


def test_no_reactor_and_no_restarts_fails_with_the_exit_code(tmp_path: Path) -> None:
    """Without reactors and with --max-restarts 0 the job fails, the failure recorded."""
    run = run_job(tmp_path, torchrun_args=["--max-restarts", "0"])
    assert run.returncode == 1, run.describe()
    exits = run.of("WORKER_EXIT", worker_id=1)
    assert [e["exit_code"] for e in exits] == [3], run.describe()
    assert run.of("WORKER_RESTART") == []
    assert [e["state"] for e in run.of("AGENT_EXIT")] == ["FAILED"]
    # torchrun's own failure table still reaches the console.
    assert "exitcode  : 3" in run.stderr


@pytest.mark.parametrize(("how", "exit_code", "signame", "message"), [
    ("raise", 1, None, "RuntimeError: bad config on rank 1: learning rate missing"),
    ("sigkill", -9, "SIGKILL", None),
])
def test_failure_details_signal_and_error_file_message(
        tmp_path: Path, how: str, exit_code: int, signame: str | None,
        message: str | None) -> None:
    """WORKER_EXIT names the signal that killed a worker, or carries the message of the
    error file torch's @record wrote for an uncaught exception."""
    run = run_job(tmp_path, torchrun_args=["--max-restarts", "0"],
                  job_args=["--fail-how", how])
    assert run.returncode == 1, run.describe()
    (event,) = [e for e in run.of("WORKER_EXIT", worker_id=1)]
    assert event["exit_code"] == exit_code and event["signal"] == signame, event
    if message is None:
        assert event["message"] is None
    else:
        assert message in event["message"], event
        assert event["data"]["error_file"].endswith("error.json")
    if how == "sigkill":  # (an exception exits after torch's teardown, at no known time)
        assert 0 <= event["timestamp"] - _exit_time(run, 0, 1) < 1.0


def test_raising_reactor_counts_as_no_decision(tmp_path: Path) -> None:
    """A reactor that raises is reported and leaves torchrun's policy (restart) in force."""
    run = run_job(tmp_path, eventbus_args=["--reactor", f"{REACTORS}:broken"],
                  torchrun_args=["--max-restarts", "1"])
    _assert_restart_succeeded(run, restarts_left=0)
    assert "reactor tests.jobs.reactors.broken raised" in run.stderr
    assert "RuntimeError: reactor bug" in run.stderr


@pytest.mark.parametrize("drain", [True, False], ids=["drain", "drain-signals-off"])
def test_sigterm_to_the_agent_stops_workers_and_records_agent_exit(
        tmp_path: Path, drain: bool) -> None:
    """SIGTERM to `eventbus run` (a preemption), to a script that acts on no drain: the
    workers are stopped (the signal at once), and the JSONL ends with AGENT_EXIT. By
    default that is a drain: state PREEMPTED, the drain's exit code 75
    (docs/preemption.md); with `--drain-signals off`, torchrun's behaviour: a non-zero
    exit and AGENT_EXIT FAILED naming the signal."""
    out = tmp_path / "out"
    out.mkdir()
    events_path = tmp_path / "events.jsonl"
    cmd = [sys.executable, "-m", "eventbus", "run", "--events-jsonl", str(events_path),
           *([] if drain else ["--drain-signals", "off"]),
           "--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.1",
           str(JOBS / "gloo_fail_once.py"), "--out", str(out), "--fail-on", "",
           "--hold", "120"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=job_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while len(list(out.glob("attempt0_rank*.started"))) < 2:
            assert time.monotonic() < deadline and proc.poll() is None, "job did not start"
            time.sleep(0.1)
        worker_pids = [int(p.read_text()) for p in out.glob("attempt0_rank*.started")]
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=JOB_TIMEOUT_S)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    for pid in worker_pids:  # the workers are gone, not orphaned
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    read = read_jsonl(events_path)
    events = list(read)
    assert read.torn == 0
    agent_exit = [e for e in events if e["type"] == "AGENT_EXIT"]
    assert len(agent_exit) == 1, stderr[-3000:]
    if drain:
        assert proc.returncode == 75, stderr[-3000:]
        assert agent_exit[0]["state"] == "PREEMPTED", stderr[-3000:]
        assert agent_exit[0]["reason"].startswith("SIGTERM on node 0: the job drained")
    else:
        assert proc.returncode != 0
        assert agent_exit[0]["state"] == "FAILED", stderr[-3000:]
        assert "signal" in agent_exit[0]["reason"].lower()


@pytest.mark.timeout(10 * 300)
def test_restart_is_reliable_ten_times_in_a_row(tmp_path: Path) -> None:
    """The restart case, 10 times in a row: 10 of 10 succeed (plain torchrun: ~1 in 6)."""
    results = []
    for i in range(10):
        run = run_job(tmp_path / f"run{i}", eventbus_args=[
            "--reactor", f"{REACTORS}:always_restart"], torchrun_args=["--max-restarts", "2"])
        results.append(run)
        _assert_restart_succeeded(run)
    print(f"restarts succeeded: {len(results)}/10")


def test_help_shows_torchrun_and_eventbus_options(tmp_path: Path) -> None:
    """`eventbus run --help` is torchrun's parser plus the eventbus options."""
    done = run_command([sys.executable, "-m", "eventbus", "run", "--help"], cwd=tmp_path,
                       timeout=120)
    assert done.returncode == 0, done.stderr
    for option in ("--events-jsonl", "--reactor", "--log-events", "--nproc-per-node",
                   "--max-restarts", "--rdzv-backend", "--standalone", "--monitor-interval"):
        assert option in done.stdout


def test_bad_reactor_is_a_clear_usage_error(tmp_path: Path) -> None:
    """--reactor that does not resolve fails before any worker starts, naming the option."""
    done = run_command([sys.executable, "-m", "eventbus", "run", "--reactor",
                        "tests.jobs.reactors:nope", "--standalone", "x.py"], cwd=tmp_path,
                       timeout=120)
    assert done.returncode == 2
    assert "--reactor 'tests.jobs.reactors:nope'" in done.stderr
    assert "has no attribute" in done.stderr
