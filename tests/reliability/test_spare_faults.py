"""Row 43: faults around a restart on warm spares. Real ``python -m eventbus run``
jobs of tests/jobs/spare_probe.py (2 gloo ranks; rank 1 dies once the test has seen the
spares start, at most PROBE_WAIT_S after attempt 0's first step): a spare killed before
it is used is never used (that rank starts fresh), and a script changed on disk between
the attempts runs as changed on the spares. Each rank runs once per attempt and the
restart completes."""

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


#: the longest attempt 0 waits for the spares before rank 1 fails (spare_probe.py); it
#: fails sooner once the test saw both spares started (_spares_started)
PROBE_WAIT_S = 12.0


def _spares_started(agent: int, tmp_path: Path, *, deadline: float,
                    seen: set[int]) -> None:
    """Wait until two spares of ``agent`` were seen (a spare imports torch before it reads
    its assignment: one started is used warm), or two spares wrote their ``spare_<pid>``
    file (_SPARE_FAULTS), or ``deadline``; then a little more, for the pool to file
    them. ``seen``: spares already seen (killed since, say)."""
    while time.monotonic() < deadline:
        seen.update(_spares(agent))
        if len(seen) >= 2 or len(list(tmp_path.glob("spare_*"))) >= 2:
            time.sleep(0.5)
            return
        time.sleep(0.1)


def _job(tmp_path: Path, script: Path, during: Any, *, max_restarts: int = 1,
         pythonpath: str | None = None, seen: list[int] | None = None,
         ) -> tuple[Any, dict[str, Any]]:
    """Run the probe job in the background, call ``during(agent pid)`` once attempt 0's
    ranks wrote their facts (the spares are then starting), let rank 1 fail once both
    spares were seen started (or after PROBE_WAIT_S), wait for the job.
    ``pythonpath``: a folder put first on the job's ``PYTHONPATH``; ``seen``: the spares
    ``during`` saw (it kills them, say)."""
    import subprocess

    events = tmp_path / "events.jsonl"
    cmd = [sys.executable, "-m", "eventbus", "run", "--events-jsonl", str(events),
           "--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.1",
           "--max-restarts", str(max_restarts), str(script)]
    go = tmp_path / "go"
    env = {**job_env(), "PROBE_OUT": str(tmp_path), "PROBE_WAIT_S": str(PROBE_WAIT_S),
           "PROBE_GO": str(go)}
    env.pop("EVENTBUS_WARM_SPARES", None)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([pythonpath, env["PYTHONPATH"]])
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not all((tmp_path / f"probe_attempt0_rank{r}.json").exists() for r in (0, 1)):
            assert time.monotonic() < deadline and proc.poll() is None, "attempt 0 never ran"
            time.sleep(0.2)
        during(proc.pid)
        _spares_started(proc.pid, tmp_path, deadline=time.monotonic() + PROBE_WAIT_S,
                        seen=set(seen or ()))
        go.write_text("1")  # rank 1 of attempt 0 may fail now
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

    (rc, err), facts = _job(tmp_path, JOBS / "spare_probe.py", kill_spares, seen=killed)
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


#: written at the probe's first line (before the failure and before its facts): which
#: process each rank of each attempt is, and whether it was a spare (torch imported)
_EARLY = '''
import json as _json, os as _os, sys as _sys
_attempt, _rank = _os.environ["TORCHELASTIC_RESTART_COUNT"], _os.environ["RANK"]
with open(_os.path.join(_os.environ["PROBE_OUT"],
                        f"early_attempt{_attempt}_rank{_rank}.json"), "w") as _f:
    _json.dump({"warm": "torch" in _sys.modules, "pid": _os.getpid()}, _f)
if (_attempt, _rank) == ("1", "1"):
    _os._exit(7)
'''


def _starts(events: Path) -> list[tuple[int, int, int]]:
    """(attempt, rank, pid) of each WORKER_START of the job."""
    out = []
    for line in events.read_text().splitlines():
        event = json.loads(line)
        if event["type"] == "WORKER_START":
            context = event.get("context") or {}
            out.append((context.get("restart_count"), event["worker_id"], event["worker_pid"]))
    return out


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_second_failure_while_the_spares_are_activated_restarts_on_fresh_workers(
        tmp_path: Path, figure: Any) -> None:
    """Attempt 1 runs on the warm spares and rank 1 dies at its first line, while rank 0's
    spare is becoming its worker: the second failure is decided like the first, attempt 2
    starts fresh workers (no spare was warmed for it, a used one is never used again),
    completes, and each rank of each attempt was one process of its own. (Three attempts,
    each two workers importing torch, and the spares of two: 45-85 s on 2 loaded cores;
    the failure needs the spares started and activated, so none of it can go.)"""
    script = tmp_path / "probe.py"
    text = (JOBS / "spare_probe.py").read_text()
    script.write_text(text.replace("\nimport json", _EARLY + "\nimport json", 1))

    (rc, err), facts = _job(tmp_path, script, lambda agent: None, max_restarts=2)
    assert rc == 0, err[-4000:]
    early = {p.stem.removeprefix("early_"): json.loads(p.read_text())
             for p in tmp_path.glob("early_attempt*_rank*.json")}
    assert early["attempt1_rank0"]["warm"] and early["attempt1_rank1"]["warm"]
    assert not early["attempt2_rank0"]["warm"] and not early["attempt2_rank1"]["warm"]
    assert sorted(facts) == ["attempt0_rank0", "attempt0_rank1", "attempt2_rank0",
                             "attempt2_rank1"]
    starts = _starts(tmp_path / "events.jsonl")
    assert sorted((a, r) for a, r, _ in starts) == [(a, r) for a in (0, 1, 2) for r in (0, 1)]
    assert len({pid for _, _, pid in starts}) == 6, starts
    assert "rank 1 failed (exit code 7)" in err
    assert "eventbus: attempt 2 recovered in" in err
    figure(43, "a second failure while the spares were activated: attempt 2 ran on fresh "
               "workers, each rank once per attempt, rc 0")


#: a spare's or the spare template's start (PYTHONPATH's sitecustomize): the first one dies
#: at once, every other one lives on without its pipe or socket, so it looks alive but can
#: never take its worker or fork a spare
_SPARE_FAULTS = '''
import os, time
fd = os.environ.get("EVENTBUS_SPARE_FD", os.environ.get("EVENTBUS_SPARE_TEMPLATE_FD"))
if fd is not None:
    out = os.environ["PROBE_OUT"]
    with open(os.path.join(out, f"spare_{os.getpid()}"), "w") as f:
        f.write("started")
    try:
        os.close(os.open(os.path.join(out, "first_spare"), os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        os.close(int(fd))
        time.sleep(3600)
    os._exit(3)
'''


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_spares_that_cannot_start_are_never_used(tmp_path: Path, figure: Any) -> None:
    """Every spare fails: the template (or a spare) dies at its start, the next lives on
    without its socket or pipe (it can never fork a spare or take its worker). The
    restart starts fresh workers for both ranks, completes, each rank ran once per
    attempt, and no spare outlives the job."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_SPARE_FAULTS)
    agents: list[int] = []

    # two restarts allowed: after the one it takes, a restart is still left, so the
    # agent starts the second template (or spare) too (with none left it keeps none)
    (rc, err), facts = _job(tmp_path, JOBS / "spare_probe.py", agents.append,
                            pythonpath=str(site), max_restarts=2)
    assert rc == 0, err[-4000:]
    assert len(list(tmp_path.glob("spare_*"))) >= 2, "no spare was started"
    assert not facts["attempt1_rank0"]["warm"] and not facts["attempt1_rank1"]["warm"]
    assert sorted(facts) == ["attempt0_rank0", "attempt0_rank1", "attempt1_rank0",
                             "attempt1_rank1"]
    starts = _starts(tmp_path / "events.jsonl")
    assert sorted((a, r) for a, r, _ in starts) == [(a, r) for a in (0, 1) for r in (0, 1)]
    assert len({pid for _, _, pid in starts}) == 4, starts
    assert "eventbus: attempt 1 recovered in" in err
    assert not _spares(agents[0]), "a spare outlived its job"
    figure(43, "spares that could not start: the restart ran on fresh workers, rc 0")


def test_a_spare_that_cannot_read_its_assignment_is_ended_not_used() -> None:
    """A spare alive but with its end of the pipe closed: the assignment raises OSError
    (the agent then starts its worker fresh), the pipe is closed once, and the pool counts
    it thrown away, not used, and ends it."""
    import subprocess

    from eventbus.app.launcher.recovery.spares import Spare
    from eventbus.app.launcher.recovery.spares import SparePool

    read, write = os.pipe()
    os.close(read)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            start_new_session=True)
    spare = Spare(proc, write, base={}, executable=sys.executable, cwd=os.getcwd(),
                  started=0.0)
    pool = SparePool(discard_timeout=0.2)  # it never exits by itself: killed after 0.2 s
    pool.used = 1  # what take() counted
    try:
        with pytest.raises(OSError):
            spare.assign({}, ["job.py"], os.getcwd())
        assert spare.pipe == -1
        pool.unusable(0, spare, BrokenPipeError(32, "Broken pipe"))
        assert proc.poll() is not None
        assert pool.used == 0
        assert pool.discarded == ["local rank 0: it could not take its worker ([Errno 32] "
                                  "Broken pipe)"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
