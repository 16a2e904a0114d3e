"""Row 43: faults around a restart on warm spares (#42). Real ``python -m eventbus run``
jobs of tests/jobs/spare_probe.py (2 gloo ranks; rank 1 dies 8 s after attempt 0's first
step, when the spares are warm): a spare killed before it is used is never used (that
rank starts fresh), and a script changed on disk between the attempts runs as changed on
the spares. Each rank runs once per attempt and the restart completes."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.launcher_helpers import JOBS
from tests.launcher_helpers import job_env

SPARE = "eventbus.app.worker.spare"


def _spares(agent: int | None = None) -> list[int]:
    """The pids of the spare processes (their command line names the spare module) whose
    parent is ``agent`` (the job's agent; None: any, on this machine)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if SPARE.encode() in cmdline and (agent is None or parent == agent):
            found.append(int(entry))
    return found


def _job(tmp_path: Path, script: Path, during: Any) -> tuple[Any, dict[str, Any]]:
    """Run the probe job in the background, call ``during(agent pid)`` once attempt 0's
    ranks wrote their facts (the spares are then starting), wait for the job."""
    import subprocess

    events = tmp_path / "events.jsonl"
    cmd = [sys.executable, "-m", "eventbus", "run", "--events-jsonl", str(events),
           "--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.1",
           "--max-restarts", "1", str(script)]
    env = {**job_env(), "PROBE_OUT": str(tmp_path), "PROBE_WAIT_S": "12"}
    env.pop("EVENTBUS_WARM_SPARES", None)
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not all((tmp_path / f"probe_attempt0_rank{r}.json").exists() for r in (0, 1)):
            assert time.monotonic() < deadline and proc.poll() is None, "attempt 0 never ran"
            time.sleep(0.2)
        during(proc.pid)
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)
    facts = {p.stem.removeprefix("probe_"): json.loads(p.read_text())
             for p in tmp_path.glob("probe_attempt*_rank*.json")}
    return (proc.returncode, err), facts


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_spare_killed_before_it_is_used_is_replaced_by_a_fresh_worker(
        tmp_path: Path, figure: Any) -> None:
    """The spares are killed while they wait: the restart starts fresh workers (torch not
    imported at their first line), completes, and each rank ran once per attempt."""
    killed: list[int] = []

    agents: list[int] = []

    def kill_spares(agent: int) -> None:
        agents.append(agent)
        deadline = time.monotonic() + 30
        while len(_spares(agent)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in _spares(agent):
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    (rc, err), facts = _job(tmp_path, JOBS / "spare_probe.py", kill_spares)
    assert rc == 0, err[-4000:]
    assert len(killed) >= 2, "the spares never started"
    assert not facts["attempt1_rank0"]["warm"] and not facts["attempt1_rank1"]["warm"]
    assert sorted(facts) == ["attempt0_rank0", "attempt0_rank1", "attempt1_rank0",
                             "attempt1_rank1"]
    assert "eventbus: attempt 1 recovered in" in err
    assert not _spares(agents[0]), "a spare outlived its job"
    figure(43, "spares killed before use: the restart ran on fresh workers, rc 0")


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_script_changed_between_attempts_runs_as_changed_on_the_spares(
        tmp_path: Path, figure: Any) -> None:
    """The script is edited while attempt 0 runs: attempt 1, on the warm spares, runs the
    new text (the spare reads the script when it becomes the worker)."""
    script = tmp_path / "probe.py"
    script.write_text((JOBS / "spare_probe.py").read_text())

    def edit(agent: int) -> None:
        text = script.read_text().replace('"pid": os.getpid()}', '"pid": os.getpid(), '
                                          '"edited": True}')
        script.write_text(text)

    (rc, err), facts = _job(tmp_path, script, edit)
    assert rc == 0, err[-4000:]
    assert facts["attempt1_rank0"]["warm"] and facts["attempt1_rank1"]["warm"]
    assert facts["attempt1_rank0"].get("edited") is True
    assert "edited" not in facts["attempt0_rank0"]
    figure(43, "script edited between attempts: the spares ran the new text, rc 0")
