"""The restart's anatomy: the agent's torch-free Recovery on a fake clock, the worker's
start-up marks (eventbus_app/worker/marks.py) on real modules, the RECOVERED event and its
sentence, and a real restart under ``eventbus run`` that publishes it."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

import eventbus
from eventbus.app.launcher.recovery.anatomy import PHASES
from eventbus.app.launcher.recovery.anatomy import Recovery
from eventbus.app.sentences import sentence
from eventbus.app.worker.marks import SEND_BEATS
from eventbus.app.worker.marks import Marks
from tests.launcher_helpers import ROOT
from tests.launcher_helpers import job_env
from tests.launcher_helpers import run_command


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _restart(clock: Clock, recovery: Recovery) -> None:
    """A failure seen at 1000, decided at 1000.05, the survivors gone and the rendezvous
    from 1000.25 to 1000.45, the workers started at 1000.5."""
    recovery.failed()
    clock.now += 0.05
    recovery.decided()
    recovery.rendezvous(1000.25, 1000.45)
    clock.now = 1000.5
    recovery.spawned(1, 2)


def _marks(script: float, torch: float, init: float, step: float,
           restore: float = 0.1) -> dict[str, float]:
    return {"bootstrap": script - 0.05, "script": script, "torch": torch,
            "init_called": init - 0.01, "init": init, "step": step, "restore_s": restore}


def test_recovered_comes_once_every_rank_reached_its_first_step() -> None:
    """RECOVERED waits for every rank's marks, then gives each phase of the critical rank
    (the last first step) and the total from the failure seen; once per restart."""
    clock = Clock()
    recovery = Recovery(clock)
    _restart(clock, recovery)
    recovery.observe(1, 0, _marks(1000.7, 1001.9, 1002.0, 1002.3))
    assert recovery.ready() is None  # rank 1 not yet
    recovery.observe(0, 1, _marks(1000.7, 1001.9, 1002.0, 1009.0))  # an older attempt's
    assert recovery.ready() is None
    recovery.observe(1, 1, _marks(1000.8, 1002.0, 1002.2, 1002.6))
    event = recovery.ready()
    assert isinstance(event, eventbus.Recovered) and event.attempt == 1
    assert list(event.phases) == list(PHASES)
    assert event.phases == {"detect": 0.05, "stop": 0.2, "rendezvous": 0.2, "start": 0.35,
                            "import": 1.2, "init": 0.2, "restore": 0.1,
                            "first_step": 0.3}
    assert event.total_s == pytest.approx(2.6)
    assert recovery.ready() is None and recovery.recovered == 1


def test_a_phase_not_seen_is_none_never_guessed() -> None:
    """A rank whose marks lack torch's import: import and init are None, the rest stand."""
    clock = Clock()
    recovery = Recovery(clock)
    _restart(clock, recovery)
    recovery.spawned(1, 1)
    recovery.observe(1, 0, {"script": 1000.7, "init": 1001.5, "step": 1001.9})
    event = recovery.ready()
    assert event is not None
    assert event.phases["import"] is None and event.phases["restore"] is None
    assert event.phases["start"] == 0.25 and event.phases["first_step"] == 0.4


def test_a_membership_change_is_no_recovery() -> None:
    """Without a failure seen, a new attempt gives no RECOVERED."""
    clock = Clock()
    recovery = Recovery(clock)
    recovery.rendezvous(1000.0, 1000.1)
    recovery.spawned(1, 1)
    recovery.observe(1, 0, _marks(1000.7, 1001.9, 1002.0, 1002.3))
    assert recovery.ready() is None


def test_recovered_says_its_phases_in_one_line() -> None:
    """The console line: the attempt, the total, each phase (a dash where not seen)."""
    event = eventbus.Recovered(attempt=1, total_s=0.93, data={"phases": {
        "detect": 0.01, "stop": 0.1, "rendezvous": 0.2, "restore": None}})
    assert sentence(event) == ("attempt 1 recovered in 0.9 s (detect 0.01, stop 0.10, "
                               "rendezvous 0.20, restore -)")
    assert sentence(event, short=True) == "recovered in 0.9 s"


# -- the worker's marks --------------------------------------------------------------------

def test_marks_wrap_init_process_group_and_load_as_their_modules_execute(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The finder runs its hooks after the named module executed: init_process_group is
    wrapped (called and returned marked), a load is timed into restore_s, the wrappers keep
    the originals' names; the finder leaves once every hook ran."""
    package = tmp_path / "fake_pkgs"
    (package / "fakec10d").mkdir(parents=True)
    (package / "fakec10d" / "__init__.py").write_text(
        "def init_process_group(backend=None):\n    '''doc'''\n    return backend\n")
    monkeypatch.syspath_prepend(str(package))
    now = [10.0]
    marks = Marks(clock=lambda: now[0])
    from eventbus.app.worker.marks import _AfterImport

    finder = _AfterImport({"fakec10d": marks._wrap_init})
    sys.meta_path.insert(0, finder)
    try:
        import fakec10d  # type: ignore[import-not-found]

        assert finder not in sys.meta_path
        assert fakec10d.init_process_group.__name__ == "init_process_group"
        assert fakec10d.init_process_group.__doc__ == "doc"
        now[0] = 11.0
        assert fakec10d.init_process_group("gloo") == "gloo"
        assert marks.at["init_called"] == 11.0 and marks.at["init"] == 11.0
    finally:
        finder.remove()
        sys.modules.pop("fakec10d", None)
    import time

    holder = types.SimpleNamespace(load=lambda path: time.sleep(0.05) or path)
    marks._wrap_load(holder, "load")
    assert holder.load("x") == "x" and marks.restore_s >= 0.05
    marks.note("step")
    holder.load("y")  # after the first step a load is no restore
    assert marks.restore_s < 0.1
    assert getattr(holder.load, "_eventbus_marks", False)


def test_marks_go_out_after_the_first_step_a_few_times() -> None:
    """as_data: None before the first step; then the marks and restore_s, SEND_BEATS
    times; the first of each mark is kept."""
    marks = Marks(clock=lambda: 5.0)
    marks.note("script")
    assert marks.as_data() is None
    marks.note("step", 7.0)
    marks.note("step", 9.0)
    sent = [marks.as_data() for _ in range(SEND_BEATS + 1)]
    assert sent[0] == {"script": 5.0, "step": 7.0, "restore_s": 0.0}
    assert sent[-1] is None and all(s is not None for s in sent[:-1])


def test_the_first_metric_step_is_the_first_step_of_a_script_without_torch_optim() -> None:
    """A script that updates its weights by hand (the demo's) takes no optimizer step: its
    first METRIC with a step marks the first step. A METRIC without a step does not; the
    subscription ends at the one that does; an optimizer step that came first is kept."""
    now = [20.0]
    marks = Marks(clock=lambda: now[0])
    bus = eventbus.Bus("marks")
    sub = marks.watch_metric_steps(bus)
    bus.record(eventbus.EventType.METRIC, data={"loss": 1.0})
    assert "step" not in marks.at and marks.as_data() is None
    now[0] = 21.5
    bus.record(eventbus.EventType.METRIC, step=3, data={"loss": 0.9})
    assert marks.at["step"] == 21.5 and not sub.active
    assert bus.subscriptions() == []
    assert (marks.as_data() or {})["step"] == 21.5

    stepped = Marks(clock=lambda: now[0])
    stepped.note("step", 20.5)  # torch's optimizer hook, before the first METRIC
    stepped.watch_metric_steps(bus)
    bus.record(eventbus.EventType.METRIC, step=4)
    assert stepped.at["step"] == 20.5


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_real_restart_publishes_recovered_with_every_phase(tmp_path: Path) -> None:
    """Rank 1 of benchmarks/recovery_job.py dies at step 40: the group restarts, and once
    both ranks of attempt 1 stepped, one RECOVERED with every phase measured and a total
    that matches the script's own clock; its console line."""
    events = tmp_path / "events.jsonl"
    cmd = [sys.executable, "-m", "eventbus", "run", "--events-jsonl", str(events),
           "--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.1",
           "--max-restarts", "1", str(ROOT / "benchmarks" / "recovery_job.py")]
    env = {**job_env(), "RECOVERY_OUT": str(tmp_path)}
    env.pop("EVENTBUS_WARM_SPARES", None)  # the default (on): the restart runs on spares
    done = run_command(cmd, cwd=tmp_path, timeout=200, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    found = [json.loads(line) for line in events.read_text().splitlines()]
    (recovered,) = [e for e in found if e["type"] == "RECOVERED"]
    assert recovered["attempt"] == 1
    phases = recovered["data"]["phases"]
    assert list(phases) == list(PHASES)
    assert all(isinstance(v, float) for v in phases.values()), phases
    marks = [json.loads(line) for line in (tmp_path / "marks.jsonl").read_text().splitlines()]
    crash = next(m["t"] for m in marks if m["mark"] == "crash")
    stepped = max(m["t"] for m in marks if m["mark"] == "step" and m["attempt"] == 1)
    # the agent's total starts when it saw the crash (one monitor interval, plus the exit)
    assert 0 <= (stepped - crash) - recovered["total_s"] < 1.0
    assert sum(phases.values()) == pytest.approx(recovered["total_s"], abs=0.3)
    assert "eventbus: attempt 1 recovered in" in done.stderr
