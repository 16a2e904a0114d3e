"""The job view's ``doing`` and ``doing_s`` rank keys (eventbus_app/ui/rank_book.py,
eventbus_app/ui/ranks.py): what a silent rank's latest heartbeat says its main thread is
doing (``WORKER_PROGRESS.data["activity"]``, read by eventbus.app.health.evidence.doing_of), in
``/api/state``'s full and compact rank entries, until it progresses, steps, exits or
restarts.

The phrases are doing_of's: the expected values are asked of it, save one literal check.
"""

from __future__ import annotations

from typing import Any

import pytest

from eventbus.app.health.evidence import doing_of
from eventbus.app.readers.records import Record
from eventbus.app.readers.records import decode_line
from eventbus.app.ui.ranks import COMPACT_ABOVE
from eventbus.app.ui.state import JobState
from eventbus.context import JobContext
from eventbus.events import Event
from eventbus.events import Metric
from eventbus.events import WorkerExit
from eventbus.events import WorkerProgress
from eventbus.events import WorkerStalled
from eventbus.events import WorkerStart

T0 = 1_764_600_000.0
AGENT = JobContext(group_rank=0, world_size=2, hostname="node-0", pid=900, restart_count=0)

#: a checkpoint save under way for 45 s, the issue's example
SAVING = {"activity": {"io": "save", "io_s": 45.0, "io_kind": "torch.save"}}
#: what a silent rank's heartbeat can say (eventbus_app/health/evidence.py's module docstring)
ACTIVITIES: dict[str, tuple[dict[str, Any], float]] = {
    "saving": (SAVING, 45.0),
    "data": ({"activity": {"data_s": 12.0, "still_s": 12.0, "still_cpu_s": 0.1}}, 12.0),
    "collective": ({"activity": {"still_s": 30.0, "still_cpu_s": 0.2},
                    "pgs": {"0": {"enqueued": 181, "completed": 180}},
                    "pending": {"0": {"op": "all_reduce"}}}, 30.0),
    "validating": ({"activity": {"still_s": 0.5, "still_cpu_s": 0.4,
                                 "label": "validating"}}, 20.0),
    "compiling": ({"activity": {"compiling_s": 5.0, "still_s": 5.0}}, 5.0),
    "blocked": ({"activity": {"still_s": 70.0, "still_cpu_s": 0.0}}, 70.0),
    "spinning": ({"activity": {"still_s": 70.0, "still_cpu_s": 69.0}}, 70.0),
    "busy": ({"activity": {"still_s": 0.5, "still_cpu_s": 0.5}}, 30.0),
}


def _context(rank: int, restart: int = 0) -> JobContext:
    return JobContext(rank=rank, group_rank=0, world_size=2, hostname="node-0",
                      pid=1000 + rank, restart_count=restart)


def _start(rank: int, t: float, restart: int = 0) -> WorkerStart:
    context = AGENT if restart == 0 else JobContext(
        group_rank=0, world_size=2, hostname="node-0", pid=900, restart_count=restart)
    return WorkerStart(worker_id=rank, worker_pid=1000 + rank, timestamp=t, data={},
                       context=context)


def _beat(rank: int, t: float, *, idle_s: float, data: dict[str, Any] | None = None,
          step: int = 7, restart: int = 0) -> WorkerProgress:
    return WorkerProgress(worker_id=rank, step=step, collectives=100, idle_s=idle_s,
                          timestamp=t, data={"where": "train.py:64", **(data or {})},
                          context=_context(rank, restart))


def _fed(*events: Event, now: float | None = None) -> JobState:
    """A file's state (timed by the events' own timestamps), its clock at ``now``."""
    at = events[-1].timestamp if now is None else now
    state = JobState(live=False, clock=lambda: at)
    for event in events:
        state(event)
    return state


def _rank(state: JobState, rank: int = 0, **options: Any) -> dict[str, Any]:
    entries: list[dict[str, Any]] = state.snapshot(**options)["ranks"]
    (entry,) = [r for r in entries if r["rank"] == rank]
    return entry


def _record(event: Event) -> Record:
    record = decode_line(event.to_json())
    assert isinstance(record, Record)
    return record


def test_a_silent_rank_saving_a_checkpoint_reads_saving() -> None:
    """A heartbeat of a rank idle 45 s inside a checkpoint save: ``doing`` starts with
    "saving", ``doing_s`` is doing_of's seconds; ``state`` stays "running"."""
    state = _fed(_start(0, T0), _beat(0, T0 + 50, idle_s=45.0, data=SAVING))
    entry = _rank(state)
    expected = doing_of(_beat(0, T0, idle_s=45.0, data=SAVING).data, idle_s=45.0)
    assert expected is not None
    assert entry["doing"].startswith("saving")
    assert (entry["doing"], entry["doing_s"]) == expected
    assert entry["state"] == "running" and entry["idle_s"] == 45.0


@pytest.mark.parametrize("kind", sorted(ACTIVITIES))
def test_each_activity_is_said_as_doing_of_says_it(kind: str) -> None:
    """Each kind of evidence a silent rank's heartbeat carries: the rank's ``doing`` and
    ``doing_s`` are doing_of's phrase and seconds, in the full and the compact entry."""
    data, idle = ACTIVITIES[kind]
    beat = _beat(0, T0 + 100, idle_s=idle, data=data)
    expected = doing_of(beat.data, idle_s=idle)
    assert expected is not None, kind
    state = _fed(_start(0, T0), beat)
    full = _rank(state, detail="full")
    compact = _rank(state, detail="compact")
    assert (full["doing"], full["doing_s"]) == expected
    assert (compact["doing"], compact["doing_s"]) == expected


def test_doing_s_ages_from_the_heartbeat_as_idle_s_does() -> None:
    """A live state: 10 s after the beat arrived, ``doing_s`` and ``idle_s`` are each the
    beat's figure plus 10 s."""
    now = [T0]
    state = JobState(clock=lambda: now[0])
    state(_start(0, T0))
    now[0] = T0 + 50
    beat = _beat(0, T0 + 50, idle_s=45.0, data=SAVING)
    state(beat)
    state.fold()  # it arrived at T0 + 50
    now[0] = T0 + 60
    expected = doing_of(beat.data, idle_s=45.0)
    assert expected is not None
    entry = _rank(state)
    assert entry["doing"] == expected[0]
    assert entry["doing_s"] == pytest.approx(expected[1] + 10.0)
    assert entry["idle_s"] == pytest.approx(55.0)


def test_a_file_and_a_live_job_say_the_same() -> None:
    """The same heartbeat read back from a JSONL file's record gives the same keys."""
    events = [_start(0, T0), _beat(0, T0 + 50, idle_s=45.0, data=SAVING)]
    from_file = JobState(live=False, clock=lambda: T0 + 50)
    from_file.add_records([_record(event) for event in events])
    live = _rank(_fed(*events))
    read = _rank(from_file)
    assert (read["doing"], read["doing_s"]) == (live["doing"], live["doing_s"])
    assert read["doing"] is not None


def test_without_evidence_there_is_no_doing() -> None:
    """A rank that progresses, or whose idle beat carries no ``activity``: ``doing`` and
    ``doing_s`` are null in the full entry and absent from the compact one."""
    for beat in (_beat(0, T0 + 5, idle_s=0.2, data=SAVING),
                 _beat(0, T0 + 50, idle_s=45.0)):
        state = _fed(_start(0, T0), beat)
        full = _rank(state, detail="full")
        assert full["doing"] is None and full["doing_s"] is None
        assert "doing" not in _rank(state, detail="compact")
        assert "doing_s" not in _rank(state, detail="compact")


@pytest.mark.parametrize("after", ["busy beat", "step", "exit", "new attempt"])
def test_progress_a_step_an_exit_or_a_new_attempt_clears_it(after: str) -> None:
    """What a silent beat said ends with the next beat that is not idle, a step of the
    rank's own, its exit, or its start in the next attempt."""
    events: list[Event] = [_start(0, T0), _beat(0, T0 + 50, idle_s=45.0, data=SAVING)]
    assert _rank(_fed(*events))["doing"] is not None
    t = T0 + 51
    if after == "busy beat":
        events.append(_beat(0, t, idle_s=0.1, step=8))
    elif after == "step":
        events.append(Metric(step=8, timestamp=t, data={"loss": 1.0},
                             context=_context(0)))
    elif after == "exit":
        events.append(WorkerExit(worker_id=0, exit_code=0, timestamp=t, data={},
                                 context=AGENT))
    else:
        events.append(_start(0, t, restart=1))
    state = _fed(*events)
    entry = _rank(state)
    assert entry["doing"] is None and entry["doing_s"] is None
    assert state._ranks.ranks[0].doing is None  # cleared, not only hidden by the state


def test_a_stalled_rank_keeps_its_doing_beside_its_state() -> None:
    """A stall verdict after a blocked beat: ``state`` reads "stalled" (its values are
    unchanged) and ``doing`` still says what the beat saw."""
    data, idle = ACTIVITIES["blocked"]
    beat = _beat(0, T0 + 80, idle_s=idle, data=data)
    stalled = WorkerStalled(worker_id=0, silent_s=75.0, timeout_s=60.0, timestamp=T0 + 81,
                            data={}, context=AGENT)
    entry = _rank(_fed(_start(0, T0), beat, stalled))
    expected = doing_of(beat.data, idle_s=idle)
    assert expected is not None
    assert entry["state"] == "stalled"
    assert entry["doing"] == expected[0]
    assert entry["doing_s"] == pytest.approx(expected[1] + 1.0)  # aged to the file's end


def test_a_large_jobs_compact_entries_carry_it_for_the_silent_rank_only() -> None:
    """Above COMPACT_ABOVE ranks the default entries are compact: the silent rank's has
    ``doing`` and ``doing_s``, the others have neither."""
    ranks = COMPACT_ABOVE + 4
    events: list[Event] = [_start(rank, T0) for rank in range(ranks)]
    events += [_beat(rank, T0 + 50, idle_s=0.1) for rank in range(ranks) if rank != 5]
    events.append(_beat(5, T0 + 50, idle_s=45.0, data=SAVING))
    snap = _fed(*events).snapshot()
    assert snap["ranks_detail"] == "compact"
    with_doing = [r for r in snap["ranks"] if "doing" in r or "doing_s" in r]
    assert [r["rank"] for r in with_doing] == [5]
    assert with_doing[0]["doing"].startswith("saving")


def test_a_rank_reported_waiting_for_data_is_a_warning_in_the_events_list() -> None:
    """WORKER_STALLED with waiting_on "data" is a report (warn), a verdict a failure."""
    from eventbus.app.ui.render import event_json

    waiting = WorkerStalled(worker_id=1, silent_s=4.0, data={"waiting_on": "data"})
    blocked = WorkerStalled(worker_id=1, silent_s=4.0, data={"waiting_on": "blocked"})
    assert event_json(1, "WORKER_STALLED", waiting)["level"] == "warn"
    assert event_json(2, "WORKER_STALLED", blocked)["level"] == "failure"
