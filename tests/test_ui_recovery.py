"""The job view's restart anatomy (eventbus_app/ui/attempts.py): each ``RECOVERED`` the agent
publishes (``attempt``, ``total_s``, ``data["phases"]``, docs/run.md "The restart's
anatomy") is an entry of ``/api/state``'s ``recoveries``, oldest first and bounded like the
attempts, whether the state is fed live events or a file's records; and on the page a bar
per recovery, a segment per phase seen (slow: in headless Chromium).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import eventbus
from eventbus.app.readers.records import Record
from eventbus.app.readers.records import decode_line
from eventbus.app.ui.attempts import MAX_ATTEMPTS
from eventbus.app.ui.state import JobState
from eventbus.context import JobContext
from eventbus.events import Event
from tests.browser import Chromium
from tests.browser import chromium_or_skip
from tests.test_ui import _get
from tests.test_ui import _record
from tests.test_ui import _start_view
from tests.test_ui import _stop

T0 = 1_764_600_000.0

#: the agent's phases of a restart, in their order, as launcher/recovery/anatomy.py gives them
PHASES: dict[str, float | None] = {
    "detect": 0.01, "stop": 0.02, "rendezvous": 0.28, "start": 0.12, "import": 0.86,
    "init": 0.01, "restore": None, "first_step": 0.87}


def _agent(restart: int) -> JobContext:
    return JobContext(group_rank=0, world_size=2, hostname="node-0", pid=900,
                      restart_count=restart)


def _worker(rank: int, restart: int) -> JobContext:
    return JobContext(rank=rank, group_rank=0, world_size=2, hostname="node-0",
                      pid=1000 + 10 * restart + rank, restart_count=restart)


def _recovered(attempt: int, total_s: float, phases: dict[str, float | None],
               t: float) -> eventbus.Recovered:
    return eventbus.Recovered(attempt=attempt, total_s=total_s, data={"phases": phases},
                              timestamp=t, context=_agent(attempt))


def _job() -> list[Event]:
    """Two ranks; rank 1 fails twice, and each restart recovers (the second without the
    worker's marks: its worker phases not seen)."""
    second = dict.fromkeys(PHASES, None) | {"detect": 0.5, "stop": 1.5, "rendezvous": 2.0}
    out: list[Event] = [eventbus.AgentStart(entrypoint="train.py", max_restarts=2,
                                            nproc_per_node=2, timestamp=T0, data={},
                                            context=_agent(0))]
    for attempt in range(3):
        t = T0 + 10 * attempt
        if attempt:
            out.append(eventbus.WorkerRestart(attempt=attempt, restarts_left=2 - attempt,
                                              reason="rank 1 failed", cause="failure",
                                              timestamp=t, data={}, context=_agent(attempt)))
        out += [eventbus.WorkerStart(worker_id=rank, worker_pid=1000 + rank, timestamp=t + 1,
                                     data={}, context=_worker(rank, attempt))
                for rank in (0, 1)]
        if attempt == 1:
            out.append(_recovered(1, 2.17, PHASES, t + 3))
        elif attempt == 2:
            out.append(_recovered(2, 4.0, second, t + 3))
        if attempt < 2:
            out.append(eventbus.WorkerExit(worker_id=1, exit_code=3, message="ValueError",
                                           timestamp=t + 5, data={},
                                           context=_agent(attempt)))
    return out


EXPECTED = [
    {"attempt": 1, "total_s": 2.17, "phases": PHASES},
    {"attempt": 2, "total_s": 4.0, "phases": {
        "detect": 0.5, "stop": 1.5, "rendezvous": 2.0, "start": None, "import": None,
        "init": None, "restore": None, "first_step": None}},
]


def _recoveries(state: JobState) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = state.snapshot()["recoveries"]
    json.dumps(found, allow_nan=False)  # strict JSON: what a browser's JSON.parse reads
    return found


def test_each_recovered_event_is_a_recovery_with_its_phases_in_order() -> None:
    """Live events: one entry per RECOVERED, oldest first, its phases in the event's
    order (null: not seen); a job without one has an empty list."""
    state = JobState(live=False)
    events = _job()
    for event in events[:5]:
        state(event)
    assert _recoveries(state) == []
    for event in events[5:]:
        state(event)
    found = _recoveries(state)
    assert found == EXPECTED
    assert [list(r["phases"]) for r in found] == [list(PHASES)] * 2
    # the restarts' timeline is unchanged by them: a RECOVERED is no mark
    snap = state.snapshot()
    assert [a["outcome"] for a in snap["timeline"]] == ["restarted", "restarted", "running"]
    assert snap["types"]["RECOVERED"] == 2


@pytest.mark.parametrize("one_by_one", [True, False])
def test_a_files_records_give_the_same_recoveries(one_by_one: bool) -> None:
    """Records read back from a JSONL file (``eventbus view``: add_record, add_records)
    fold into the same recoveries as the live events."""
    state = JobState(live=False)
    records = [_record(event) for event in _job()]
    if one_by_one:
        for record in records:
            state.add_record(record)
    else:
        assert state.add_records(records) == len(records)
    assert _recoveries(state) == EXPECTED


def test_recoveries_are_bounded_like_the_attempts() -> None:
    """At most MAX_ATTEMPTS recoveries, the oldest go first."""
    state = JobState(live=False)
    for attempt in range(1, MAX_ATTEMPTS + 6):
        state(_recovered(attempt, 1.0, {"detect": 0.1}, T0 + attempt))
    found = _recoveries(state)
    assert len(found) == MAX_ATTEMPTS
    assert found[0]["attempt"] == 6 and found[-1]["attempt"] == MAX_ATTEMPTS + 5


def test_a_foreign_recovered_record_reads_what_it_can() -> None:
    """A record written by another writer: no attempt field (its context's restart count
    is the attempt), no total (null), phases that are not finite numbers read null, a
    phases value that is not a mapping reads no phase, a name longer than 64 characters is
    left out; the JSON stays strict."""
    lines = [
        {"type": "RECOVERED", "timestamp": T0, "data": {"phases": {
            "detect": 0.25, "stop": "soon", "rendezvous": True, "start": 7,
            "import": "INF", "": 1.0, "x" * 65: 1.0}},
         "context": {"group_rank": 0, "restart_count": 3}},
        {"type": "RECOVERED", "timestamp": T0 + 1, "attempt": 4, "total_s": 1.5,
         "data": {"phases": [["detect", 0.1]]}, "context": {"group_rank": 0}},
    ]
    state = JobState(live=False)
    for line in lines:
        # a number beyond a float: what the reader takes for infinity
        record = decode_line(json.dumps(line).replace('"INF"', "1e400"))
        assert isinstance(record, Record)
        state.add_record(record)
    # a live event may hold them too
    state(eventbus.Recovered(attempt=5, total_s=float("nan"), timestamp=T0 + 2,
                             data={"phases": {"detect": float("inf"), "stop": 0.5}},
                             context=_agent(5)))
    assert _recoveries(state) == [
        {"attempt": 3, "total_s": None, "phases": {
            "detect": 0.25, "stop": None, "rendezvous": None, "start": 7.0, "import": None,
            "": 1.0}},
        {"attempt": 4, "total_s": 1.5, "phases": {}},
        {"attempt": 5, "total_s": None, "phases": {"detect": None, "stop": 0.5}},
    ]


# -- in a real browser ------------------------------------------------------------------------

SEGMENTS_JS = ("JSON.stringify(Array.from(document.querySelectorAll("
               "'#recoveries .recovery[data-attempt=\"1\"] .rbar .ph'))"
               ".map(e => [e.dataset.phase, e.title, e.getBoundingClientRect().width]))")


@pytest.mark.slow
def test_browser_shows_a_bar_per_recovery(tmp_path: Path) -> None:
    """`eventbus view` of a job with two recoveries: in headless Chromium each is a bar
    labelled "attempt N recovered in X.X s", one segment per phase seen, in order, its
    name and seconds in its title and its width in proportion; the phases not seen are
    named. ``/api/state`` served the same recoveries."""
    browser_path = chromium_or_skip()
    path = tmp_path / "events.jsonl"
    path.write_text("".join(event.to_json() + "\n" for event in _job()))
    proc, url = _start_view(path)
    try:
        assert json.loads(_get(url + "api/state")[1])["recoveries"] == EXPECTED
        with Chromium(browser_path, width=1400, height=900) as browser:
            browser.goto(url)
            browser.wait_for("document.querySelectorAll('#recoveries .recovery').length === 2")
            assert browser.evaluate("document.getElementById('recoveries').hidden") is False
            heads = browser.evaluate("Array.from(document.querySelectorAll("
                                     "'#recoveries .recovery')).map(r => [r.dataset.attempt, "
                                     "r.querySelector('.rhead').textContent])")
            # newest first, like the attempts
            assert heads == [
                ["2", "attempt 2 recovered in 4.0 s"
                      "not seen: start, import, init, restore, first step"],
                ["1", "attempt 1 recovered in 2.2 snot seen: restore"]]
            segments = json.loads(browser.evaluate(SEGMENTS_JS))
            assert [(name, title) for name, title, _ in segments] == [
                ("detect", "detect 0.01 s"), ("stop", "stop 0.02 s"),
                ("rendezvous", "rendezvous 0.28 s"), ("start", "start 0.12 s"),
                ("import", "import 0.86 s"), ("init", "init 0.01 s"),
                ("first_step", "first step 0.87 s")]
            widths = {name: width for name, _, width in segments}
            # proportional: import 0.86 s and first step 0.87 s about 3x rendezvous 0.28 s
            assert 2.5 < widths["import"] / widths["rendezvous"] < 3.6
            assert abs(widths["import"] - widths["first_step"]) <= 2
            colors = browser.evaluate(
                "Array.from(new Set(Array.from(document.querySelectorAll("
                "'#recoveries .recovery[data-attempt=\"1\"] .ph'))"
                ".map(e => getComputedStyle(e).backgroundColor))).length")
            assert colors == len(segments)  # a colour per phase
            assert browser.evaluate("document.querySelectorAll("
                                    "'#recoveries .recovery[data-attempt=\"2\"] .ph').length"
                                    ) == 3
    finally:
        assert _stop(proc) == 0
