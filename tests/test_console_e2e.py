"""End-to-end: what a person at the terminal of a real `eventbus run` job sees on stderr,
without --log-events: one `eventbus:` line per decision, naming the rank that caused it
(never a collateral one), and the run's goodput as its last line; and an ordinary
script's uncaught exception reaching
WORKER_EXIT.message and a reactor, with no @record in the script."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.launcher_helpers import JobRun
from tests.launcher_helpers import run_job

REACTORS = "tests.jobs.reactors"


#: the run's last line, after the decisions: its goodput (docs/goodput.md)
GOODPUT_LINE = re.compile(r"eventbus: goodput \d+\.\d% of .+ \(eventbus goodput FILE for "
                          r"the table\)")


def _console(run: JobRun) -> list[str]:
    """The decisions' ``eventbus:`` lines; the run's last line, its goodput, is checked
    and left out."""
    lines = [line for line in run.stderr.splitlines() if line.startswith("eventbus: ")]
    assert lines and GOODPUT_LINE.fullmatch(lines[-1]), lines[-3:]
    return lines[:-1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_restart_prints_its_line_without_log_events(tmp_path: Path) -> None:
    """Rank 1 exits 3 on attempt 0, no reactor: one line says so and what happens next;
    rank 0, stopped with the group, is never named."""
    run = run_job(tmp_path, torchrun_args=["--max-restarts", "1"])
    assert run.returncode == 0, run.describe()
    lines = _console(run)
    assert lines == ["eventbus: rank 1 failed (exit code 3); restarting the group as "
                     "attempt 1 (0 restarts left)"], run.stderr[-4000:]
    assert "WORKER_EXIT worker_id" not in run.stderr  # no --log-events: no event lines


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_unchanged_scripts_oom_reaches_the_readme_reactor(tmp_path: Path) -> None:
    """A plain script (no @record, no eventbus import) raises torch.OutOfMemoryError on
    rank 1: the bootstrap writes torch's error file, WORKER_EXIT.message carries it, the
    README's oom_is_fatal STOPs the job with restarts left (exit 3), and the STOP's line
    names rank 1 and its error first. The worker's own traceback still reaches stderr."""
    run = run_job(tmp_path, job="plain_oom.py",
                  eventbus_args=["--reactor", f"{REACTORS}:oom_is_fatal"],
                  torchrun_args=["--max-restarts", "2"])
    assert run.returncode == 3, run.describe()
    (failure,) = [e for e in run.of("WORKER_EXIT", worker_id=1) if e["exit_code"] == 1]
    assert failure["message"].startswith("OutOfMemoryError: CUDA out of memory."), failure
    assert failure["data"]["error_file"].endswith("error.json")
    assert run.of("WORKER_RESTART") == []
    (agent_exit,) = run.of("AGENT_EXIT")
    assert "STOP from tests.jobs.reactors.oom_is_fatal" in agent_exit["reason"]
    lines = _console(run)
    assert len(lines) == 1, run.stderr[-4000:]
    assert lines[0].startswith("eventbus: rank 1 failed (exit code 1: OutOfMemoryError: "
                               "CUDA out of memory."), lines
    assert "STOP from tests.jobs.reactors.oom_is_fatal: stopping the job (exit code 3; " \
        in lines[0], lines
    # rank 0 may fail on its own too, on the lost connection (its own line then names
    # it second); it is never named first, and never as stopped by the agent
    assert "rank 0" not in lines[0].split("; STOP from")[0].split("); ")[0]
    assert "in allocate_activations" in run.stderr  # python's traceback, as without eventbus


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_reactor_answering_a_string_is_one_error_and_no_stop(tmp_path: Path) -> None:
    """A reactor that returns "stop" does not stop the job: one reactor-error line naming
    what it returned and what is accepted, no traceback; the group restarts."""
    run = run_job(tmp_path, eventbus_args=["--reactor", f"{REACTORS}:answers_stop_as_text"],
                  torchrun_args=["--max-restarts", "1"])
    assert run.returncode == 0, run.describe()
    assert len(run.of("WORKER_RESTART")) == 1
    errors = [line for line in _console(run) if "reactor error" in line]
    assert len(errors) == 1, run.stderr[-4000:]
    assert "answers_stop_as_text returned 'stop' (str)" in errors[0]
    assert "eventbus.Decision.STOP, eventbus.Decision.RESTART or None" in errors[0]
    # the agent's lines after it: a survivor's own traceback ("[rank0]: ...", gloo's
    # connection closed by its failed peer) may come before the agent's SIGTERM reaches it
    after = run.stderr.split("reactor error")[1].split("\n\n")[0]
    assert not [line for line in after.splitlines()
                if "Traceback" in line and not line.startswith("[rank")], after
    assert " raised " not in run.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_stall_prints_its_line_and_the_stack(tmp_path: Path) -> None:
    """Rank 1 spins in spin_forever(): one line names it, how long and where, then its
    stack on several lines with spin_forever near the top; the group restarts."""
    run = run_job(tmp_path, job="health_job.py", job_args=["--hang", "loop"],
                  eventbus_args=["--stall-timeout", "3"],
                  torchrun_args=["--max-restarts", "1"], timeout=180)
    lines = run.stderr.splitlines()
    stalls = [i for i, line in enumerate(lines) if line.startswith("eventbus: rank 1 "
                                                                    "stalled for ")]
    assert stalls, run.describe()
    index = stalls[0]
    line = lines[index]
    assert "(health_job.py:" in line, line
    assert line.endswith("restarting the group as attempt 1 (0 restarts left)"), line
    block = lines[index + 1:index + 30]
    assert any("in spin_forever" in frame for frame in block[:8]), "\n".join(block)
    main = next(b for b in block if "(most recent call first)" in b)
    assert "[eventbus's own thread]" not in main  # the main thread comes first
    assert "_run_path" not in "\n".join(block)  # the bootstrap's frames are left out
    assert all(b.startswith("    ") or not b for b in block[:5]), "\n".join(block)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_rank_that_failed_first_is_named_though_it_exits_last(tmp_path: Path) -> None:
    """Rank 1 raises first but exits ~3 s later (a slow teardown); rank 0 fails because of
    it and exits first. The decision names rank 1, whose WORKER_EXIT is its own failure
    (not "stopped by the agent"), and the restart's reason names it too."""
    run = run_job(tmp_path, job="first_error.py", torchrun_args=["--max-restarts", "1"])
    assert run.returncode == 0, run.describe()
    lines = _console(run)
    assert len(lines) == 1, run.stderr[-4000:]
    assert lines[0].startswith("eventbus: rank 1 failed (exit code 1: RuntimeError: "
                               "injected failure: rank 1 lost its data loader); rank 0 "
                               "failed (exit code 1: RuntimeError: rank 0 lost its peer"), lines
    (own,) = [e for e in run.of("WORKER_EXIT", worker_id=1) if e["exit_code"] != 0]
    assert own["exit_code"] == 1 and not own["data"].get("stopped_by_agent"), own
    (restart,) = run.of("WORKER_RESTART")
    assert restart["reason"].startswith("rank 1 failed"), restart


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_rank_that_failed_first_is_its_own_failure_past_the_grace(
        tmp_path: Path) -> None:
    """As above, but rank 1's teardown outlasts the agent's grace (DYING_GRACE_S), so torch
    stops it with the group: its WORKER_EXIT is still its own failure (its error file
    predates rank 0's), decided on (a console line naming it, the restart's reason), never
    "stopped by the agent" published past the reactors."""
    from eventbus.app.launcher.agent import DYING_GRACE_S

    run = run_job(tmp_path, job="first_error.py", torchrun_args=["--max-restarts", "1"],
                  job_args=["--teardown-s", str(DYING_GRACE_S + 20)])
    assert run.returncode == 0, run.describe()
    lines = _console(run)
    mine = [line for line in lines if line.startswith(
        "eventbus: rank 1 failed (") and "injected failure: rank 1 lost its data loader" in line]
    assert mine, run.stderr[-4000:]
    (own,) = [e for e in run.of("WORKER_EXIT", worker_id=1) if e["exit_code"] != 0]
    assert not own["data"].get("stopped_by_agent"), own
    assert "injected failure" in (own.get("message") or ""), own
    (restart,) = run.of("WORKER_RESTART")
    assert restart["reason"].startswith("rank 1 failed"), restart
