"""Goodput (eventbus_app/readers/goodput.py): one synthetic stream per cause, whose truth
is known to the second, and the rule that goodput plus badput is the wall time; bad input
(empty, cut, mixed runs) gives one clear line or a result that says what it missed."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from eventbus.app.readers.goodput import CAUSES
from eventbus.app.readers.goodput import GoodputError
from eventbus.app.readers.goodput import GoodputTracker
from eventbus.app.readers.goodput import goodput
from eventbus.app.readers.goodput import main
from eventbus.app.readers.records import Record
from eventbus.app.readers.records import record_from_dict

T0 = 1_800_000_000.0


def _rec(kind: str, t: float, *, rank: int | None = None, attempt: int = 0,
         group: int | None = 0, run: str = "run-1", data: dict[str, Any] | None = None,
         **fields: Any) -> Record:
    raw = {"type": kind, "timestamp": T0 + t, "data": data or {}, **fields,
           "context": {"rank": rank, "restart_count": attempt, "group_rank": group,
                       "run_id": run, "pid": 100 + (rank if rank is not None else 50)}}
    record = record_from_dict(raw)
    assert record is not None
    return record


def _beat(t: float, rank: int, step: int, *, idle: float = 0.0, attempt: int = 0,
          step_time: float | None = None) -> Record:
    data = {"step_time_s": step_time} if step_time is not None else {}
    return _rec("WORKER_PROGRESS", t, rank=rank, attempt=attempt, worker_id=rank,
                step=step, collectives=step, idle_s=idle, data=data)


def _job(*middle: Record, end: float = 100.0, state: str = "SUCCEEDED") -> list[Record]:
    return [_rec("AGENT_START", 0.0, entrypoint="train.py", max_restarts=1,
                 nproc_per_node=1),
            _rec("WORKER_START", 1.0, worker_id=0),
            *middle,
            _rec("AGENT_EXIT", end, state=state, exit_code=0 if state == "SUCCEEDED" else 1)]


def _adds_up(result: Any) -> None:
    assert sum(result.badput_s.values()) + result.goodput_s == pytest.approx(result.wall_s)
    assert set(result.badput_s) == set(CAUSES)


def test_a_healthy_job_is_startup_then_goodput_then_teardown() -> None:
    """Start at 0, first step at 10 (the beat at 11 says 10 steps of 0.1 s), steps until
    90, the end at 100: startup 10, goodput 80, other (teardown) 10."""
    result = goodput(_job(_beat(5.0, 0, 0, idle=4.0), _beat(11.0, 0, 10, step_time=0.1),
                          _beat(50.0, 0, 400), _beat(90.0, 0, 800)))
    _adds_up(result)
    assert result.wall_s == pytest.approx(100.0)
    assert result.badput_s["startup"] == pytest.approx(10.0)
    assert result.badput_s["other"] == pytest.approx(10.0)
    assert result.goodput_s == pytest.approx(80.0)
    assert result.goodput_ratio == pytest.approx(0.8)
    assert result.sentence() == "goodput 80.0% of 1 min 40 s; the biggest loss: startup, 10.0 s"


def test_checkpoint_time_is_badput_and_ends_the_waste_of_a_later_failure() -> None:
    """First step at 5; a 4 s save ending at 40; rank 0's last step at 49, its failure
    noticed at 50; attempt 1 starts at 60, steps from 62 to the end at 100. Checkpoint 4,
    wasted 9 (40 to the last step at 49, 200 steps), restart 11 (49 to 60), startup
    5 + 2."""
    records = _job(
        _rec("METRIC", 5.0, rank=0, step=1),
        _rec("CHECKPOINT_SAVED", 40.0, rank=0, path="c.pt", step=300, duration_s=4.0),
        _beat(49.0, 0, 500),
        _rec("WORKER_EXIT", 50.0, worker_id=0, exit_code=1, cause="failure"),
        _rec("WORKER_RESTART", 60.0, attempt=1, restarts_left=0, reason="x"),
        _rec("WORKER_START", 60.5, worker_id=0, attempt=1),
        _rec("METRIC", 62.0, rank=0, attempt=1, step=301),
        _rec("METRIC", 100.0, rank=0, attempt=1, step=900))
    result = goodput(records)
    _adds_up(result)
    bad = result.badput_s
    assert bad["checkpoint"] == pytest.approx(4.0)
    assert bad["wasted"] == pytest.approx(9.0)
    assert bad["restart"] == pytest.approx(11.0)
    assert bad["startup"] == pytest.approx(5.0 + 2.0)
    assert result.wasted_steps == 200
    assert result.attempts == 2
    assert result.goodput_s == pytest.approx(100 - 4 - 9 - 11 - 7)


def test_a_stall_is_its_silence_and_the_progress_before_it_is_wasted() -> None:
    """Progress from 5; the rank's last progress at 30; the verdict at 42 (silent 12 s);
    no checkpoint: stall 12, wasted 25 (5 to 30); the job then fails (no restart): other
    from 42 to the end at 50."""
    records = _job(
        _rec("METRIC", 5.0, rank=0, step=1),
        _beat(30.0, 0, 250),
        _rec("WORKER_STALLED", 42.0, worker_id=0, silent_s=12.0),
        end=50.0, state="FAILED")
    result = goodput(records)
    _adds_up(result)
    assert result.badput_s["stall"] == pytest.approx(12.0)
    assert result.badput_s["wasted"] == pytest.approx(25.0)
    assert result.badput_s["other"] == pytest.approx(8.0)
    assert result.goodput_s == pytest.approx(0.0)


def test_a_drain_is_badput_from_preempting_to_the_end() -> None:
    records = _job(_rec("METRIC", 5.0, rank=0, step=1), _beat(70.0, 0, 650),
                   _rec("PREEMPTING", 70.0, deadline_s=20.0, reason="SIGTERM on node 0"),
                   _rec("METRIC", 71.0, rank=0, step=660), end=80.0, state="PREEMPTED")
    result = goodput(records)
    _adds_up(result)
    assert result.badput_s["drain"] == pytest.approx(10.0)
    assert result.goodput_s == pytest.approx(65.0)


def test_per_node_figures_beside_the_job_wide_one() -> None:
    records = _job(_rec("METRIC", 5.0, rank=0, step=1, group=0),
                   _rec("METRIC", 8.0, rank=1, step=1, group=1),
                   _rec("METRIC", 90.0, rank=0, step=800, group=0),
                   _rec("METRIC", 90.0, rank=1, step=800, group=1))
    result = goodput(records)
    assert set(result.nodes) == {0, 1}
    assert result.nodes[1].badput_s["startup"] > result.nodes[0].badput_s["startup"]
    assert json.loads(json.dumps(result.to_json()))["nodes"]["1"]["wall_s"] > 0


def test_bad_input_says_what_it_is() -> None:
    with pytest.raises(GoodputError, match="no events"):
        goodput([])
    mixed = [*_job(), *(_rec(r.type, 200 + r.timestamp - T0, run="run-2", **r.fields)
                        for r in _job())]
    with pytest.raises(GoodputError, match=r"mixes 2 runs .*--run-id"):
        goodput(mixed)
    assert goodput(mixed, run_id="run-2").run_id == "run-2"
    cut = goodput(_job(_rec("METRIC", 5.0, rank=0, step=1))[:-1])  # no AGENT_EXIT
    assert not cut.ended and any("had not ended" in note for note in cut.notes)
    lost = goodput(_job(_rec("EVENTS_LOST", 3.0, source="w1", count=7, reason="gap")))
    assert any("7 events were lost" in note for note in lost.notes)
    assert lost.error_bound_s > goodput(_job()).error_bound_s


def test_the_command_prints_the_table_or_json_and_one_line_errors(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "events.jsonl"
    lines = [json.dumps({"type": r.type, "timestamp": r.timestamp, "data": r.data,
                         "context": r.context, **r.fields})
             for r in _job(_rec("METRIC", 5.0, rank=0, step=1),
                           _rec("METRIC", 90.0, rank=0, step=9))]
    path.write_text("\n".join(lines) + "\n{\"type\": \"WORKER_EX")  # a torn last line
    assert main([str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["wall_s"] == pytest.approx(100.0) and out["goodput_ratio"] == pytest.approx(0.85)
    assert any("torn" in note for note in out["notes"])
    assert main([str(path)]) == 0
    text = capsys.readouterr().out
    assert "goodput 85.0% of 1 min 40 s; the biggest loss: other, 10.0 s." in text
    assert text.splitlines()[1].split()[0] == "goodput" and "wall" in text
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main([str(empty)]) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"eventbus goodput: {empty}: no events: nothing to split"
    assert main([str(tmp_path / "missing.jsonl")]) == 1
    assert "No such file" in capsys.readouterr().err


def _jobs() -> list[list[Record]]:
    return [
        _job(_beat(5.0, 0, 0, idle=4.0), _beat(11.0, 0, 10, step_time=0.1),
             _beat(50.0, 0, 400), _beat(90.0, 0, 800)),
        _job(_rec("METRIC", 5.0, rank=0, step=1),
             _rec("CHECKPOINT_SAVED", 40.0, rank=0, path="c.pt", step=300, duration_s=4.0),
             _beat(49.0, 0, 500), _rec("WORKER_EXIT", 50.0, worker_id=0, exit_code=1),
             _rec("WORKER_RESTART", 60.0, attempt=1, restarts_left=0, reason="x"),
             *(_rec("METRIC", float(t), rank=0, attempt=1, step=t) for t in range(62, 100))),
        _job(_rec("METRIC", 5.0, rank=0, step=1), _beat(30.0, 0, 250),
             _rec("WORKER_STALLED", 42.0, worker_id=0, silent_s=12.0), end=50.0,
             state="FAILED"),
    ]


@pytest.mark.parametrize("index", range(3))
def test_the_live_tracker_gives_the_files_figure_from_a_few_records(index: int) -> None:
    """The tracker keeps the lifecycle and a few progress records per rank and attempt,
    yet its figure is the file's, to the millisecond."""
    records = _jobs()[index]
    tracker = GoodputTracker()
    for record in records:
        tracker.observe(record)
    assert len(tracker.records()) <= 12
    live, offline = tracker.result(), goodput(records)
    assert live is not None
    assert live.goodput_s == pytest.approx(offline.goodput_s, abs=1e-3)
    for cause, seconds in offline.badput_s.items():
        assert live.badput_s[cause] == pytest.approx(seconds, abs=1e-3), cause


def test_the_live_tracker_takes_typed_events_and_counts_until_now() -> None:
    import eventbus

    tracker = GoodputTracker()
    assert tracker.result() is None
    bus = eventbus.Bus("live")
    bus.subscribe(eventbus.ALL, on_event=tracker.observe)
    bus.record("AGENT_START", entrypoint="t.py", max_restarts=0, nproc_per_node=1)
    bus.record("METRIC", step=1)
    result = tracker.result(until=time.time() + 10)
    assert result is not None and not result.ended and result.wall_s >= 10
    assert result.goodput_s >= 9.9  # progressing since the first step, as far as it knows


def test_the_job_view_carries_the_figure() -> None:
    """/api/state's "goodput" is the command's object (and its sentence), from a file."""
    from eventbus.app.ui.state import JobState

    records = _jobs()[1]
    state = JobState(live=False)
    for record in records:
        state.add_record(record)
    figure = state.snapshot()["goodput"]
    offline = goodput(records)
    assert figure["goodput_s"] == pytest.approx(offline.goodput_s, abs=1e-3)
    assert figure["badput_s"]["restart"] == pytest.approx(11.0, abs=1e-3)
    assert figure["sentence"] == offline.sentence()


def test_restarts_are_split_by_phase_from_their_recovered_events() -> None:
    """Each RECOVERED's phases add up per phase (a phase not seen adds nothing), in the
    JSON and in one line of the text; a job without restarts has none."""
    from eventbus.app.readers.goodput import render_text

    phases = {"detect": 0.01, "stop": 0.02, "rendezvous": 0.2, "start": 0.05,
              "import": None, "init": 0.01, "restore": 0.1, "first_step": 0.01}
    result = goodput(_job(_beat(5.0, 0, 1), _beat(10.0, 0, 5),
                          _rec("RECOVERED", 12.0, attempt=1, total_s=0.4,
                               data={"phases": phases}),
                          _rec("RECOVERED", 30.0, attempt=2, total_s=0.4,
                               data={"phases": {**phases, "import": 1.5}})))
    assert result.restart_phases_s["rendezvous"] == pytest.approx(0.4)
    assert result.restart_phases_s["import"] == pytest.approx(1.5)
    assert result.to_json()["restart_phases_s"]["restore"] == pytest.approx(0.2)
    assert "restarts by phase (RECOVERED): detect 0.02 s, stop 0.04 s" in render_text(result)
    assert goodput(_job(_beat(5.0, 0, 1))).restart_phases_s == {}


def test_a_phase_that_is_not_a_finite_number_adds_nothing() -> None:
    """An infinite or non-number phase (a file written by hand) is left out: the JSON stays
    strict (the page parses it)."""
    result = goodput(_job(_beat(5.0, 0, 1), _rec(
        "RECOVERED", 12.0, attempt=1, total_s=1.0,
        data={"phases": {"stop": float("inf"), "detect": "soon", "init": 0.5}})))
    assert result.restart_phases_s == {"init": 0.5}
    json.dumps(result.to_json(), allow_nan=False)
