"""The job view (eventbus_app/ui/): the state model, ``/api/state``, the token rule, 50 slow
clients, ``eventbus view`` over a file, and a real 2-rank job that fails once and restarts
seen in headless Chromium (slow).

docs/seeing-the-job.md ("The job view in a browser") describes what is checked here.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from eventbus.app.readers.records import Record
from eventbus.app.readers.records import decode_line
from eventbus.app.ui import UIServer
from eventbus.app.ui import is_loopback
from eventbus.app.ui import parse_address
from eventbus.app.ui import resolve_token
from eventbus.app.ui.ranks import RANK_STATES
from eventbus.app.ui.state import JobState
from eventbus.bus import ALL
from eventbus.bus import Bus
from eventbus.events import Event
from tests.browser import Chromium
from tests.browser import chromium_or_skip
from tests.conftest import ROOT
from tests.conftest import subprocess_env
from tests.test_jobview import drained_job_lines
from tests.ui_fixture import write_64_rank_job

FIXTURE = ROOT / "tests" / "fixtures" / "job_node0.jsonl"
ADDRESS = re.compile(r"eventbus: job view at (http://\S+)")


def _event(kind: str, t: float, *, rank: int | None = None, restart: int = 0,
           data: dict[str, Any] | None = None, **fields: Any) -> Event:
    return Event.from_dict({"type": kind, "timestamp": t, **fields, "data": data or {},
                            "context": {"rank": rank, "restart_count": restart,
                                        "group_rank": 0, "world_size": 2,
                                        "hostname": "h", "pid": 1, "run_id": "r"}})


def _job_events() -> list[Event]:
    """A 2-rank job: rank 1 fails on attempt 0, the group restarts, rank 0 becomes slow,
    rank 1 stalls, a reactor STOP ends it."""
    t = 1000.0
    return [
        _event("AGENT_START", t, max_restarts=2, nproc_per_node=2),
        _event("WORKER_START", t + 1, worker_id=0, worker_pid=10),
        _event("WORKER_START", t + 1, worker_id=1, worker_pid=11),
        _event("METRIC", t + 2, rank=0, step=5, data={"loss": 1.0}),
        _event("METRIC", t + 2, rank=1, step=5, data={"loss": 1.0}),
        _event("WORKER_EXIT", t + 3, worker_id=1, exit_code=3,
               message="Traceback (most recent call last):\n  File \"x\"\nValueError: bad"),
        _event("WORKER_EXIT", t + 3.1, worker_id=0, exit_code=-15, signal="SIGTERM",
               cause="failure", data={"stopped_by_agent": True}),
        _event("WORKER_RESTART", t + 4, restart=1, attempt=1, restarts_left=1,
               reason="rank 1 failed", cause="failure"),
        _event("WORKER_START", t + 5, restart=1, worker_id=0),
        _event("WORKER_START", t + 5, restart=1, worker_id=1),
        _event("METRIC", t + 6, rank=0, restart=1, step=7),
        _event("WORKER_SLOW", t + 7, restart=1, worker_id=0, factor=2.5, step=8),
        _event("WORKER_PROGRESS", t + 7.5, rank=1, restart=1, worker_id=1, step=9,
               idle_s=0.5),
        _event("WORKER_STALLED", t + 8, restart=1, worker_id=1, silent_s=12.5,
               timeout_s=10.0, data={"stack": "Thread 1 (main):\n  File \"train.py\", "
                                              "line 3 in step", "diagnosis": "Rank 1 is stuck."}),
        _event("EVENTS_LOST", t + 8.5, source="worker:1", count=4, reason="queue full"),
        _event("AGENT_EXIT", t + 9, restart=1, state="FAILED", exit_code=3, cause="stop",
               reason="rank 1 stalled; STOP from stop_on_stall"),
    ]


def _record(event: Event) -> Record:
    """``event`` as a file's line read back."""
    record = decode_line(event.to_json())
    assert isinstance(record, Record)
    return record


def _fed(events: list[Event], **options: Any) -> JobState:
    state = JobState(live=False, **options)
    for event in events:
        state(event)
    return state


# -- the state model ----------------------------------------------------------------------------


def test_state_follows_a_job_through_failure_restart_slow_stall_and_stop() -> None:
    """Each rank's state, step and restarts, the attempts with their marks, the latest
    problem with its diagnosis and stack, and the job's status, from the events alone."""
    state = JobState(live=False)
    events = _job_events()
    for event in events[:6]:
        state(event)
    snap = state.snapshot()
    assert snap["status"] == "running"
    assert [(r["rank"], r["state"], r["step"]) for r in snap["ranks"]] == [
        (0, "running", 5), (1, "failed", 5)]
    assert snap["problem"]["kind"] == "failure"
    assert snap["problem"]["exit_code"] == 3
    assert "ValueError: bad" in snap["problem"]["message"]
    assert "ValueError: bad" in snap["timeline"][0]["marks"][0]["text"]  # the exception line
    state(events[6])
    assert state.snapshot()["ranks"][0]["stopped_by_agent"] is True
    for event in events[7:12]:
        state(event)
    snap = state.snapshot()
    assert snap["attempt"] == snap["restarts"] == 1
    assert [(r["state"], r["restarts"]) for r in snap["ranks"]] == [("slow", 1), ("running", 1)]
    assert snap["ranks"][0]["step"] == 8
    assert [a["outcome"] for a in snap["timeline"]] == ["restarted", "running"]
    assert snap["timeline"][0]["stopped_by_agent"] == 1
    kinds = [m["kind"] for a in snap["timeline"] for m in a["marks"]]
    assert kinds == ["failure", "restart", "slow"]
    for event in events[12:]:
        state(event)
    snap = state.snapshot()
    assert snap["status"] == "stopped"
    assert snap["ranks"][1]["state"] == "stalled"
    assert snap["ranks"][1]["step"] == 9  # from the heartbeat
    problem = snap["problem"]
    assert problem["kind"] == "stall" and problem["rank"] == 1
    assert problem["diagnosis"] == "Rank 1 is stuck."
    assert "train.py" in problem["stack"] and "\n" in problem["stack"]
    assert snap["drops"]["lost"] == [{"source": "worker:1", "reason": "queue full",
                                      "count": 4}]
    assert [m["kind"] for m in snap["timeline"][-1]["marks"]][-1] == "stop"
    assert snap["events"] == len(events)
    assert all(r["state"] in RANK_STATES for r in snap["ranks"])


def test_state_statuses_and_exits() -> None:
    """SUCCEEDED -> succeeded with exited ranks; FAILED without a stop cause -> failed;
    another node's AGENT_EXIT does not end the job."""
    ok = _fed([_event("WORKER_START", 1, worker_id=0),
               _event("WORKER_EXIT", 2, worker_id=0, exit_code=0),
               _event("AGENT_EXIT", 3, state="SUCCEEDED", exit_code=0)])
    snap = ok.snapshot()
    assert snap["status"] == "succeeded"
    assert snap["ranks"][0]["state"] == "exited"
    failed = _fed([_event("AGENT_EXIT", 3, state="FAILED", exit_code=1, reason="rank 0 "
                          "exited with code 1")])
    assert failed.snapshot()["status"] == "failed"
    other = Event.from_dict({"type": "AGENT_EXIT", "timestamp": 1, "state": "FAILED",
                             "data": {}, "context": {"group_rank": 1}})
    assert _fed([other]).snapshot()["status"] == "running"


def test_the_stopped_status_comes_from_the_cause_field() -> None:
    """AGENT_EXIT.cause "stop" or "remote_stop" -> stopped, with the end's sentence as
    its mark; a file without the field is "failed", whatever its reason's words."""
    for cause in ("stop", "remote_stop"):
        state = _fed([_event("AGENT_EXIT", 3, state="FAILED", exit_code=3, cause=cause,
                             reason="rank 1 failed (exit code 3); STOP from fatal")])
        snap = state.snapshot()
        assert snap["status"] == "stopped" and snap["exit"]["cause"] == cause
        (mark,) = snap["timeline"][0]["marks"]
        assert mark["kind"] == "stop"
        assert mark["text"] == ("the job was stopped (exit code 3): rank 1 failed (exit "
                                "code 3); STOP from fatal")
    old = _fed([_event("AGENT_EXIT", 3, state="FAILED", exit_code=3,
                       reason="rank 1 failed (exit code 3); STOP from fatal")])
    assert old.snapshot()["status"] == "failed"
    assert old.snapshot()["exit"]["cause"] == "failure"


def test_a_collateral_exit_is_read_from_its_fields() -> None:
    """A worker the agent stopped (data["stopped_by_agent"], or a cause other than its
    own failure) is counted as collateral, not marked as a failure nor the problem."""
    for fields in ({"data": {"stopped_by_agent": True}}, {"cause": "stall"}):
        state = _fed([_event("WORKER_START", 1, worker_id=0),
                      _event("WORKER_EXIT", 2, worker_id=0, exit_code=-15, signal="SIGTERM",
                             **fields)])
        snap = state.snapshot()
        assert snap["ranks"][0]["stopped_by_agent"] is True
        assert snap["timeline"][0]["stopped_by_agent"] == 1
        assert snap["timeline"][0]["marks"] == [] and snap["problem"] is None


def _drained_events(**options: Any) -> list[Event]:
    """tests/test_jobview.py's drained job (SIGTERM on node 0, rank 1 late) as events."""
    return [Event.from_dict(json.loads(line)) for line in drained_job_lines(**options)]


def test_a_drain_shows_as_draining_then_preempted() -> None:
    """PREEMPTING: the job is "draining", /api/state's drain says the signal, the node and
    the time left; the end (AGENT_EXIT PREEMPTED): "preempted", neither failed nor
    succeeded, with the drain's facts; the rank that did not stop in time is "late", the
    one that stopped by itself exited "drained"; the marks are the events' sentences; no
    problem; the same from a file's records."""
    events = _drained_events()
    preempting = next(i for i, e in enumerate(events) if e.type == "PREEMPTING")
    draining = _fed(events[:preempting + 1], clock=lambda: 1_764_410_007.5)
    snap = draining.snapshot()
    assert snap["status"] == "draining"
    drain = snap["drain"]
    assert drain["active"] is True and drain["ended"] is None
    assert (drain["signal"], drain["node"], drain["grace_s"], drain["deadline_s"]) == (
        "SIGTERM", 0, 3.0, 3.0)
    assert drain["reason"] == "SIGTERM on node 0"
    assert drain["started"] == 1_764_410_006.0 and drain["deadline"] == 1_764_410_009.0
    assert drain["left_s"] == 1.5
    assert drain["text"] == "draining: SIGTERM on node 0, 1.5 s left"
    assert drain["detail"] == "drain: SIGTERM on node 0, 3 s to stop"
    assert [r["state"] for r in snap["ranks"]] == ["running", "running"]
    from_file = JobState(live=False, clock=lambda: 1_764_410_100.0)
    for event in events:
        from_file.add_record(_record(event))
    for state in (_fed(events), from_file):
        snap = state.snapshot(recent=100)
        assert snap["status"] == "preempted"
        assert snap["exit"]["cause"] == "preemption" and snap["exit"]["exit_code"] == 75
        drain = snap["drain"]
        assert drain["active"] is False and drain["left_s"] is None
        assert drain["ended"] == 1_764_410_009.05
        assert drain["text"] == ("preempted: the other ranks stopped at step 34; rank 1 did "
                                 "not stop in time")
        assert drain["detail"] == (
            "the job was preempted by SIGTERM on node 0 (exit code 75): the other ranks "
            "stopped at step 34; rank 1 did not stop in time; 3 s of the 3 s grace used")
        assert (drain["stop_step"], drain["used_s"], drain["late_ranks"],
                drain["failed_ranks"], drain["escalated"]) == (34, 3.027, [1], {}, False)
        assert drain["stopped_in_time"] == 1 and drain["exit_code"] == 75
        assert [(r["rank"], r["state"], r["drained"]) for r in snap["ranks"]] == [
            (0, "exited", True), (1, "late", False)]
        assert snap["states"]["late"] == 1
        (attempt,) = snap["timeline"]
        assert attempt["outcome"] == "preempted" and attempt["stopped_by_agent"] == 0
        assert [(m["kind"], m["rank"], m["text"]) for m in attempt["marks"]] == [
            ("drain", None, "drain: SIGTERM on node 0, 3 s to stop"),
            ("late", 1, "rank 1 was stopped by the agent (SIGTERM) because it did not stop "
                        "within the drain's grace"),
            ("preempted", None, drain["detail"])]
        assert snap["problem"] is None
        levels = {e["type"] + (f" {e['rank']}" if e["type"] == "WORKER_EXIT" else ""):
                  e["level"] for e in snap["recent"]}
        assert levels["PREEMPTING"] == levels["AGENT_EXIT"] == "warn"
        assert levels["WORKER_EXIT 1"] == "warn" and levels["WORKER_EXIT 0"] == "info"


def test_a_job_without_a_drain_has_none_and_a_preempted_end_alone_still_reads() -> None:
    """/api/state's drain is null without one; an AGENT_EXIT PREEMPTED whose PREEMPTING
    was not seen (lost, a file cut) still ends the job "preempted" with its facts."""
    assert _fed(_job_events()).snapshot()["drain"] is None
    end = _drained_events()[-1]
    snap = _fed([end]).snapshot()
    assert snap["status"] == "preempted"
    assert snap["drain"]["started"] is None and snap["drain"]["late_ranks"] == [1]
    assert snap["drain"]["text"].startswith("preempted: the other ranks stopped at step 34")
    assert (snap["drain"]["signal"], snap["drain"]["node"]) == ("SIGTERM", 0)


def test_a_live_drain_counts_down() -> None:
    """A live state: the time left is the deadline less the state's clock, in /api/state
    (over HTTP) as in the snapshot."""
    now = [2000.0]
    state = JobState(clock=lambda: now[0])
    now[0] = 2001.0
    state(_event("WORKER_START", 2000.5, worker_id=0))
    state(_event("PREEMPTING", 2000.8, deadline_s=20.0, reason="SIGTERM on node 1",
                 signal="SIGTERM", node=1, grace_s=20.0))
    assert state.snapshot()["drain"]["left_s"] == pytest.approx(19.8)
    now[0] = 2012.8
    server = UIServer(state, "127.0.0.1", 0).start()
    try:
        snap = json.loads(_get(f"http://127.0.0.1:{server.port}/api/state")[1])
    finally:
        server.close(timeout=1.0)
    assert snap["status"] == "draining"
    assert snap["drain"]["left_s"] == pytest.approx(8.0)
    assert snap["drain"]["text"] == "draining: SIGTERM on node 1, 8 s left"


def test_marks_and_the_problem_are_the_events_sentences() -> None:
    """The timeline's marks and the problem panel's diagnosis say each event with
    eventbus.app.sentences.sentence, from a live event and from a file's record alike."""
    events = _job_events()
    live = _fed(events)
    from_file = JobState(live=False)
    for event in events:
        from_file.add_record(_record(event))
    for state in (live, from_file):
        snap = state.snapshot()
        texts = [m["text"] for a in snap["timeline"] for m in a["marks"]]
        assert texts == [
            "rank 1 failed (exit code 3: ValueError: bad)",
            "the group restarts as attempt 1 (1 restart left): rank 1 failed",
            "rank 0 is slow at step 8: 2.5 x its peers",
            "rank 1 stalled for 12.5 s",
            "the job was stopped (exit code 3): rank 1 stalled; STOP from stop_on_stall"]
        assert snap["ranks"][1]["message"] is None  # restarted since
    failure = _fed(events[:6]).snapshot()["problem"]
    assert failure["diagnosis"] == "rank 1 failed (exit code 3: ValueError: bad)"
    record = JobState(live=False)
    for event in events[:6]:
        record.add_record(_record(event))
    assert record.snapshot()["problem"]["diagnosis"] == failure["diagnosis"]


def test_every_nodes_restart_is_one_mark() -> None:
    """Each node's agent reports the same restart (forwarded to group rank 0): the
    timeline shows it once, and the restarts count once."""
    node1 = Event.from_dict({"type": "WORKER_RESTART", "timestamp": 4.1, "attempt": 1,
                             "data": {}, "context": {"group_rank": 1, "restart_count": 1}})
    state = _fed([_event("AGENT_START", 1), _event("WORKER_START", 2, worker_id=0),
                  _event("WORKER_RESTART", 4, restart=1, attempt=1), node1])
    snap = state.snapshot()
    assert snap["restarts"] == 1
    assert [m["kind"] for a in snap["timeline"] for m in a["marks"]] == ["restart"]


def test_state_is_bounded() -> None:
    """Recent events, types and ranks stay within their bounds whatever arrives."""
    state = JobState(live=False, max_events=50, max_ranks=10)
    for i in range(2000):
        state(_event("METRIC", float(i), rank=i % 40, step=i))
    snap = state.snapshot(recent=1000)
    assert snap["events"] == 2000
    assert len(snap["recent"]) == 50
    assert snap["recent"][-1]["seq"] == 2000
    assert len(snap["ranks"]) == 10
    assert snap["drops"]["ranks_not_shown"] > 0
    events, gap, newest = state.events_since(0, 20)
    assert newest == 2000 and len(events) == 20 and gap == 1980


def test_the_bus_only_appends_and_a_reader_folds() -> None:
    """The publishing thread only appends: nothing is folded until a reader asks (or the
    folder thread runs), and a reader then sees every event published before it asked."""
    bus = Bus("ui-append-only")
    state = JobState(live=False)
    sub = bus.subscribe(ALL, on_event=state)
    try:
        for event in _job_events():
            bus.publish(event)
        assert state.pending == len(_job_events())
        assert state._seq == 0 and not state._ranks.ranks  # nothing folded on the bus's thread
        snap = state.snapshot()
        assert state.pending == 0
        assert snap["events"] == len(_job_events()) and snap["status"] == "stopped"
        assert snap == _fed(_job_events()).snapshot() | {"now": snap["now"]}
    finally:
        sub.cancel()


def test_the_folder_thread_folds_without_readers() -> None:
    """state.start(): pending events are folded every interval with nobody reading;
    stop() ends the thread and folds the rest."""
    state = JobState(live=False).start(interval=0.01)
    try:
        for event in _job_events():
            state(event)
        deadline = time.monotonic() + 30
        while state.pending and time.monotonic() < deadline:
            time.sleep(0.01)
        assert state.pending == 0
        assert state._seq == len(_job_events())
    finally:
        state.stop()
    assert state._folder is None
    state(_event("METRIC", 1010.0, rank=0, step=11))
    state.stop()  # no thread: folds what is pending
    assert state.pending == 0 and state._ranks.ranks[0].step == 11


def test_a_backlog_beyond_max_pending_keeps_the_lifecycle_and_counts_the_rest() -> None:
    """More pending than max_pending: the oldest are folded light (no row, no step) but a
    failure among them still counts; the light ones are the view's drops; the stream's
    events_since reports them as a gap, never as a repeated row."""
    state = JobState(live=False, max_pending=5)
    state(_event("WORKER_START", 1.0, worker_id=1))
    state(_event("WORKER_EXIT", 2.0, worker_id=1, exit_code=3, message="boom"))
    for step in range(20):
        state(_event("METRIC", 3.0 + step, rank=0, step=step))
    assert state.events_since(0, 100)[2] == 22
    snap = state.snapshot(recent=100)
    assert snap["events"] == 22
    assert snap["drops"]["view_overflowed"] == 17
    assert [(r["rank"], r["state"]) for r in snap["ranks"]] == [(0, "running"), (1, "failed")]
    assert snap["ranks"][0]["step"] == 19
    assert [e["seq"] for e in snap["recent"]] == [18, 19, 20, 21, 22]
    assert snap["problem"]["rank"] == 1
    events, gap, newest = state.events_since(10, 100)
    assert [e["seq"] for e in events] == [18, 19, 20, 21, 22] and gap == 7 and newest == 22
    assert state.events_since(20, 100)[0][0]["seq"] == 21


def test_a_live_event_is_timed_within_the_window_it_arrived_in() -> None:
    """A live event's arrival is its own timestamp held between the previous fold and
    this one: a worker clock far behind or ahead moves it by one fold interval at most."""
    now = [1000.0]
    state = JobState(clock=lambda: now[0])
    now[0] = 1010.0
    state(_event("METRIC", 1004.0, rank=0, step=1))  # the clocks agree
    state(_event("METRIC", 5.0, rank=1, step=1))  # a clock far behind
    state(_event("METRIC", 9e9, rank=2, step=1))  # a clock far ahead
    ages = {r["rank"]: r["last_event_age_s"] for r in state.snapshot()["ranks"]}
    assert ages == {0: 6.0, 1: 10.0, 2: 0.0}
    now[0] = 1020.0
    state(_event("METRIC", 5.0, rank=1, step=2))
    assert state.snapshot()["ranks"][1]["last_event_age_s"] == 10.0  # held at 1010


def test_a_reader_folds_what_another_thread_has_popped_but_not_counted() -> None:
    """fold() while the folder thread is mid-chunk (events popped, not yet counted)
    returns only once every event pending when it was called is folded: close() and the
    final snapshot cannot miss AGENT_EXIT."""
    events = _job_events()
    state = _fed(events)
    popped = threading.Event()
    fold_many = state._fold_many

    def slow_fold_many(n: int, low: float, now: float, full: bool) -> None:
        fold_many(n, low, now, full)
        if threading.current_thread().name == "folder":
            popped.set()
            time.sleep(0.3)  # the window a reader used to read a short target in

    state._fold_many = slow_fold_many  # type: ignore[method-assign]
    folder = threading.Thread(target=state.fold, name="folder", daemon=True)
    folder.start()
    assert popped.wait(10.0)
    state.fold()
    assert not state._pending and state._popped == len(events)
    assert state.snapshot()["events"] == len(events)
    folder.join(10.0)


def test_address_and_token_rules() -> None:
    """[HOST:]PORT parsing; loopback needs no token, another host gets a generated one."""
    assert parse_address("8265") == ("127.0.0.1", 8265)
    assert parse_address("0.0.0.0:0") == ("0.0.0.0", 0)
    assert parse_address("[::1]:80") == ("::1", 80)
    for bad in ("x", "70000", "::1:80", "host:"):
        with pytest.raises(ValueError, match="--ui"):
            parse_address(bad)
    assert is_loopback("localhost") and is_loopback("127.0.0.2") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("node-a")
    assert resolve_token("127.0.0.1", None) == (None, False)
    token, generated = resolve_token("0.0.0.0", None)
    assert generated and token and len(token) >= 20
    assert resolve_token("127.0.0.1", "abc") == ("abc", False)
    with pytest.raises(ValueError, match="--ui-token"):
        resolve_token("0.0.0.0", "a b")


# -- the server -----------------------------------------------------------------------------------


def _read_until(answer: http.client.HTTPResponse, needle: bytes,
                timeout: float = 30.0) -> bytes:
    """What a stream sent until ``needle`` (each read bounded by the connection's own
    timeout); fails on the stream's end or after ``timeout`` seconds."""
    seen = b""
    deadline = time.monotonic() + timeout
    while needle not in seen:
        assert time.monotonic() < deadline, f"{needle!r} never came: {seen[-500:]!r}"
        chunk = answer.read1(65536)
        assert chunk, f"the stream ended before {needle!r}: {seen[-500:]!r}"
        seen += chunk
    return seen


def _readline_within(stream: Any, timeout: float = 60.0) -> str:
    """One line of a child's pipe, or "" when none came within ``timeout`` (the reading
    thread ends when the child is killed and the pipe closes)."""
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    return got[0] if got else ""


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes, Any]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, answer.read(), answer.headers
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), exc.headers


@pytest.fixture
def served() -> Any:
    state = _fed(_job_events())
    server = UIServer(state, "127.0.0.1", 0).start()
    try:
        yield server
    finally:
        server.close(timeout=1.0)


def test_api_state_answers_the_contract(served: UIServer) -> None:
    """GET /api/state: status, attempt, restarts, events, ranks in rank order with rank,
    state, step, last_event_age_s; the page and its assets come from the package."""
    base = f"http://127.0.0.1:{served.port}"
    status, body, headers = _get(base + "/api/state")
    assert status == 200 and headers["Content-Type"] == "application/json"
    snap = json.loads(body)
    assert snap["status"] == "stopped"
    assert isinstance(snap["attempt"], int) and snap["restarts"] == 1
    assert snap["events"] == len(_job_events())
    assert [r["rank"] for r in snap["ranks"]] == [0, 1]
    for rank in snap["ranks"]:
        assert rank["state"] in RANK_STATES
        assert rank["step"] is None or isinstance(rank["step"], int)
        assert isinstance(rank["last_event_age_s"], float)
    recent = json.loads(_get(base + "/api/state?recent=200")[1])["recent"]
    assert len(recent) == len(_job_events())
    status, page, _ = _get(base + "/")
    assert status == 200 and b'src="static/app.js"' in page and b"http" not in page.lower()
    for name in ("app.js", "app.css"):
        status, asset, _ = _get(f"{base}/static/{name}")
        assert status == 200 and len(asset) > 1000
    assert _get(base + "/nothing")[0] == 404
    status, body, _ = _get(base + "/api/events?since=10&limit=3")
    found = json.loads(body)
    assert [e["seq"] for e in found["events"]] == [14, 15, 16] and found["gap"] == 3


def test_polling_api_state_shares_one_snapshot_and_misses_no_event() -> None:
    """GET /api/state without parameters serves the streams' shared snapshot: repeated
    polls of an unchanged state build it once; an event published before a poll is in
    its answer."""
    state = _fed(_job_events()[:3])
    built = []
    snapshot = state.snapshot

    def counting(**kwargs: Any) -> dict[str, Any]:
        built.append(kwargs)
        return snapshot(**kwargs)

    state.snapshot = counting  # type: ignore[method-assign]
    server = UIServer(state, "127.0.0.1", 0, keepalive_s=600.0).start()
    try:
        url = f"http://127.0.0.1:{server.port}/api/state"
        for _ in range(20):
            assert json.loads(_get(url)[1])["events"] == 3
        assert len(built) == 1
        for n, event in enumerate(_job_events()[3:6], start=4):
            state(event)
            assert json.loads(_get(url)[1])["events"] == n
        assert len(built) == 4
        assert json.loads(_get(url + "?recent=2")[1])["recent"][-1]["seq"] == 6
    finally:
        server.close()


def test_stream_pushes_new_events_and_the_final_state() -> None:
    """/api/stream: the events after ``since``, then the state; on close, the final
    state and an ``end`` message."""
    state = JobState()
    server = UIServer(state, "127.0.0.1", 0, poll_interval=0.05).start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.request("GET", "/api/stream?since=0")
        answer = conn.getresponse()
        assert answer.status == 200
        assert answer.headers["Content-Type"].startswith("text/event-stream")
        for event in _job_events():
            state(event)
        seen = _read_until(answer, b'"status":"stopped"')
        assert b"event: events" in seen and b"WORKER_STALLED" in seen
        server.close(timeout=2.0)
        rest = answer.read()
        assert b"event: end" in rest
        conn.close()
    finally:
        server.close()


def test_close_sends_the_events_the_folder_has_not_folded_yet() -> None:
    """Events published just before close() (AGENT_EXIT, then the plugin closes) reach
    the open pages' final state even though the folder thread has not run since."""
    state = JobState().start(interval=600.0)  # the folder never gets to them
    server = UIServer(state, "127.0.0.1", 0, poll_interval=0.05).start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.request("GET", "/api/stream?since=0")
        answer = conn.getresponse()
        _read_until(answer, b"event: state")
        for event in _job_events():
            state(event)
        server.close(timeout=5.0)
        rest = answer.read()
        assert b'"status":"stopped"' in rest and b"event: end" in rest
        conn.close()
    finally:
        server.close()


def test_token_rule() -> None:
    """With a token every route answers 401 without it; ?token= (which sets the page's
    cookie), the cookie and the header are accepted; a wrong one is refused."""
    server = UIServer(_fed(_job_events()), "127.0.0.1", 0, token="s3cret-token").start()
    base = f"http://127.0.0.1:{server.port}"
    try:
        for path in ("/", "/api/state", "/static/app.js", "/api/stream"):
            status, body, _ = _get(base + path)
            assert status == 401, path
            assert b"token" in body and b"s3cret" not in body
        assert _get(base + "/api/state?token=wrong")[0] == 401
        assert _get(base + "/api/state", {"X-Eventbus-Token": "nope"})[0] == 401
        status, _, headers = _get(base + "/?token=s3cret-token")
        assert status == 200
        cookie = headers["Set-Cookie"].split(";")[0]
        assert cookie == f"eventbus_ui_{server.port}=s3cret-token"
        assert "HttpOnly" in headers["Set-Cookie"]
        assert _get(base + "/api/state", {"Cookie": cookie})[0] == 200
        assert _get(base + "/api/state", {"X-Eventbus-Token": "s3cret-token"})[0] == 200
        assert _get(base + "/api/state", {"Authorization": "Bearer s3cret-token"})[0] == 200
    finally:
        server.close()


def test_the_request_log_never_holds_the_token(caplog: pytest.LogCaptureFixture) -> None:
    """The DEBUG request line drops the query (?token=...)."""
    caplog.set_level(logging.DEBUG, logger="eventbus")
    server = UIServer(_fed(_job_events()), "127.0.0.1", 0, token="s3cret-token").start()
    try:
        base = f"http://127.0.0.1:{server.port}"
        assert _get(base + "/api/state?token=s3cret-token")[0] == 200
        assert _get(base + "/api/state?token=s3cret-wrong")[0] == 401
    finally:
        server.close()
    lines = [rec.getMessage() for rec in caplog.records if "job view:" in rec.getMessage()]
    assert any("GET /api/state HTTP" in line for line in lines), lines
    assert not any("s3cret" in line for line in lines), lines


def test_loopback_without_token_answers_only_loopback_names(served: UIServer) -> None:
    """A page elsewhere cannot read the job through a name that resolves to 127.0.0.1."""
    base = f"http://127.0.0.1:{served.port}/api/state"
    assert _get(base, {"Host": f"localhost:{served.port}"})[0] == 200
    assert _get(base, {"Host": f"evil.example:{served.port}"})[0] == 403
    # DNS rebinding through names that merely start like a loopback address
    assert _get(base, {"Host": f"127.0.0.1.evil.example:{served.port}"})[0] == 403
    assert _get(base, {"Host": "127.attacker.com"})[0] == 403
    assert _get(base, {"Host": f"127.0.0.2:{served.port}"})[0] == 200
    assert _get(base, {"Host": f"[::1]:{served.port}"})[0] == 200


def test_non_loopback_host_without_token_is_refused() -> None:
    """Binding a host reachable from elsewhere with no token is a usage error, not an open
    job view."""
    with pytest.raises(ValueError, match="requires a token"):
        UIServer(JobState(), "0.0.0.0", 0)


@pytest.mark.slow  # 50 sockets and 20,000 events: ~8 s on 2 cores
def test_fifty_clients_that_read_nothing_cost_the_publisher_nothing() -> None:
    """50 open streams that never read, while a publisher records 20,000 events through
    a bus the state listens to: every event is counted, the subscriber never fails, the
    publisher finishes, and the server still answers."""
    bus = Bus("ui-slow-clients")
    state = JobState()
    sub = bus.subscribe(ALL, on_event=state)
    server = UIServer(state, "127.0.0.1", 0, poll_interval=0.02, io_timeout=2.0).start()
    clients = []
    try:
        for _ in range(50):
            client = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            client.sendall(b"GET /api/stream?since=0 HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
            clients.append(client)
        deadline = time.monotonic() + 30
        while server.streams < 50 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.streams == 50
        n = 20_000
        errors: list[BaseException] = []

        def publish() -> None:
            try:
                for i in range(n):
                    bus.record("METRIC", step=i, data={"loss": 1.0, "pad": "x" * 200})
            except BaseException as exc:
                errors.append(exc)

        publisher = threading.Thread(target=publish)
        publisher.start()
        publisher.join(timeout=120)
        assert not publisher.is_alive(), "the publisher did not finish"
        assert not errors
        assert state.events == n
        stats = sub.stats()
        assert stats["delivered"] == n and stats["failed"] == 0
        assert server.pushes > 0  # the streams were being written to
        status, body, _ = _get(f"http://127.0.0.1:{server.port}/api/state")
        assert status == 200 and json.loads(body)["events"] == n
    finally:
        for client in clients:
            client.close()
        server.close(timeout=1.0)
        sub.cancel()


# -- the agent plugin -----------------------------------------------------------------------------


def _info(bus: Bus, group_rank: int) -> Any:
    from eventbus.app.plugins import RendezvousInfo

    return RendezvousInfo(store_host="127.0.0.1", store_port=1, run_id="r",
                          group_rank=group_rank, group_world_size=2, restart_count=0,
                          local_world_size=1, world_size=2, global_ranks=(group_rank,),
                          bus=bus)


def test_plugin_serves_on_group_rank_0_only() -> None:
    """Group rank 0 serves and prints its address once (a user's token stays out of the
    line); another node's agent serves nothing and stops listening to its bus."""
    import io

    from eventbus.app.ui import UIPlugin

    bus = Bus("ui-plugin-0")
    out = io.StringIO()
    plugin = UIPlugin(bus, parse_address("127.0.0.1:0"), "users-own-token", show_token=False,
                      stream=out)
    bus.record("AGENT_START", nproc_per_node=1)
    try:
        plugin.after_rendezvous(_info(bus, 0))
        plugin.after_rendezvous(_info(bus, 0))  # a restart: nothing new
        assert plugin.server is not None
        lines = out.getvalue().splitlines()
        assert len(lines) == 1 and lines[0].startswith(
            f"eventbus: job view at http://127.0.0.1:{plugin.server.port}/")
        assert "users-own-token" not in lines[0]
        bus.record("WORKER_START", worker_id=0)
        status, body, _ = _get(f"http://127.0.0.1:{plugin.server.port}/api/state",
                               {"X-Eventbus-Token": "users-own-token"})
        assert status == 200 and json.loads(body)["events"] == 2
    finally:
        plugin.close()
    other_bus = Bus("ui-plugin-1")
    out = io.StringIO()
    other = UIPlugin(other_bus, parse_address("127.0.0.1:0"), None, stream=out)
    other.after_rendezvous(_info(other_bus, 1))
    other_bus.record("AGENT_START", nproc_per_node=1)
    assert other.server is None and out.getvalue() == ""
    assert other.state.events == 0
    other.close()


def test_plugin_counts_the_sinks_and_the_transports_drops() -> None:
    """The live drop counters: a sink whose backend is stuck drops (its queue holds 5),
    and the store transport's receivers are read (none started here)."""
    from eventbus.app.launcher.transport.store import StoreTransport
    from eventbus.app.ui import UIPlugin
    from eventbus.subscribers.queued import QueuedSink
    from eventbus.subscribers.queued import QueueSettings

    release = threading.Event()
    bus = Bus("ui-plugin-drops")
    sink = QueuedSink(lambda batch: release.wait(10), name="stuck-sink",
                      settings=QueueSettings(max_events=5, max_batch=1))
    sub = bus.subscribe(ALL, on_event=sink)
    plugin = UIPlugin(bus, parse_address("0"), None, plugins=[StoreTransport()])
    try:
        for i in range(50):
            bus.record("METRIC", step=i)
        drops = plugin.state.snapshot()["drops"]
        (row,) = [s for s in drops["sinks"] if s["name"] == "stuck-sink"]
        assert sum(row["dropped"].values()) >= 40
        assert drops["transport"] == {}
        assert "counters_error" not in drops
    finally:
        release.set()
        sub.cancel()
        sink.close(timeout=5)
        plugin.close()


def test_plugin_on_a_taken_port_costs_the_page_not_the_job() -> None:
    """A port in use: one line says so; after_rendezvous returns as usual."""
    import io

    from eventbus.app.ui import UIPlugin

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        bus = Bus("ui-plugin-taken")
        out = io.StringIO()
        plugin = UIPlugin(bus, parse_address(f"127.0.0.1:{port}"), None, stream=out)
        assert plugin.after_rendezvous(_info(bus, 0)) == {}
        assert plugin.server is None
        assert "cannot serve the job view" in out.getvalue()
        assert "the job runs without it" in out.getvalue()
        plugin.close()


# -- eventbus view ------------------------------------------------------------------------------


def _start_view(path: Path, *extra: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "eventbus", "view", str(path), "--ui", "127.0.0.1:0",
         "--interval", "0.05", *extra],
        env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    line = _readline_within(proc.stderr)
    found = ADDRESS.search(line)
    if found is None:
        proc.kill()
        proc.wait()
        raise AssertionError(f"no address printed: {line!r} {proc.stderr.read()!r}")
    return proc, found[1]


def _stop(proc: subprocess.Popen[str]) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_view_serves_a_file_and_follows_it_while_it_grows(tmp_path: Path) -> None:
    """`eventbus view` over the first half of a job's JSONL says running, and the
    finished job once the rest is appended (no restart of the command)."""
    lines = FIXTURE.read_text().splitlines(keepends=True)
    path = tmp_path / "events.jsonl"
    path.write_text("".join(lines[:12]))
    proc, url = _start_view(path)
    try:
        snap = json.loads(_get(url + "api/state")[1])
        assert snap["status"] == "running" and snap["events"] == 12
        with path.open("a") as f:
            f.write("".join(lines[12:]))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            snap = json.loads(_get(url + "api/state")[1])
            if snap["status"] != "running":
                break
            time.sleep(0.1)
        assert snap["status"] == "succeeded"
        # the fixture's last line is torn (no newline): held back, as `tail -f` does
        assert snap["events"] == sum(line.endswith("\n") for line in lines)
        assert snap["attempt"] == snap["restarts"] == 1
        assert [(r["rank"], r["state"], r["restarts"]) for r in snap["ranks"]] == [
            (0, "exited", 1), (1, "exited", 1)]
        assert snap["problem"]["rank"] == 1 and snap["problem"]["exit_code"] == 3
    finally:
        assert _stop(proc) == 0


def test_view_on_another_host_requires_the_printed_token(tmp_path: Path) -> None:
    """`eventbus view --ui 0.0.0.0:0`: a token is generated and printed; without it 401."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "eventbus", "view", str(FIXTURE), "--ui", "0.0.0.0:0"],
        env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        line = _readline_within(proc.stderr)
        found = re.search(r":(\d+)/\?token=([\w-]+)", line)
        assert found, line
        base = f"http://127.0.0.1:{found[1]}"
        assert _get(base + "/api/state")[0] == 401
        assert _get(f"{base}/api/state?token={found[2]}")[0] == 200
    finally:
        assert _stop(proc) == 0


def test_view_usage_errors(tmp_path: Path) -> None:
    """A bad --ui and a directory are usage errors naming the fix."""
    for args, words in ((["x.jsonl", "--ui", "abc"], "--ui 'abc'"),
                        ([str(tmp_path)], "a directory")):
        done = subprocess.run([sys.executable, "-m", "eventbus", "view", *args], check=False,
                              env=subprocess_env(), capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and words in done.stderr, done.stderr


# -- in a real browser ------------------------------------------------------------------------

RANKS_JS = ("JSON.stringify(Array.from(document.querySelectorAll('[data-rank]'))"
            ".map(e => [e.dataset.rank, e.dataset.state]))")


def _wait_state(url: str, check: Any, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    snap: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            snap = json.loads(_get(url + "api/state")[1])
        except (OSError, ValueError):
            snap = {}
        if snap and check(snap):
            return snap
        time.sleep(0.2)
    raise AssertionError(f"the state never got there: {snap}")


@pytest.mark.slow
def test_browser_shows_a_real_job_that_fails_once_and_restarts(tmp_path: Path) -> None:
    """`eventbus run --ui 0` with 2 ranks, rank 1 failing on attempt 0: in headless
    Chromium, after the page's scripts ran, both rank elements are running on attempt 1,
    the restart shows on the timeline, and when the job ends the open page shows it
    succeeded with both ranks exited (pushed over the stream). One screenshot is written
    (also to $EVENTBUS_UI_SCREENSHOT when set)."""
    browser_path = chromium_or_skip()
    out = tmp_path / "out"
    out.mkdir()
    # attempt 0 fails at once; attempt 1 runs until the page was checked (no fixed hold)
    release = tmp_path / "release"
    cmd = [sys.executable, "-m", "eventbus", "run", "--ui", "0", "--standalone",
           "--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.1",
           str(ROOT / "tests" / "jobs" / "gloo_fail_once.py"), "--out", str(out),
           "--fail-on", "0", "--hold-until", str(release)]
    job = subprocess.Popen(cmd, cwd=tmp_path, env=subprocess_env(), stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines: list[str] = []
    url: list[str] = []
    got_url = threading.Event()

    def read_stderr() -> None:
        assert job.stderr is not None
        for line in job.stderr:
            lines.append(line)
            found = ADDRESS.search(line)
            if found and not url:
                url.append(found[1])
                got_url.set()

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    try:
        # the browser starts while the job does
        with Chromium(browser_path, width=1400, height=900) as browser:
            assert got_url.wait(60), "".join(lines)
            base = url[0]
            _wait_state(base, lambda s: s["attempt"] == 1 and [
                r["state"] for r in s["ranks"]] == ["running", "running"], timeout=60)
            browser.goto(base)
            browser.wait_for("document.getElementById('conn').dataset.conn === 'live'")
            assert json.loads(browser.evaluate(RANKS_JS)) == [["0", "running"],
                                                              ["1", "running"]]
            assert browser.evaluate("document.getElementById('restarts').textContent"
                                    ).startswith("1")
            assert browser.evaluate(
                "document.querySelector('.attempt[data-attempt=\"0\"]').dataset.outcome"
            ) == "restarted"
            marks = browser.evaluate("Array.from(document.querySelectorAll('.mark'))"
                                     ".map(m => m.dataset.kind + ':' + m.textContent)")
            assert any(m.startswith("restart:") for m in marks), marks
            assert any(m.startswith("failure:") and "rank 1" in m for m in marks), marks
            shot = tmp_path / "ui.png"
            browser.screenshot(shot)
            assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            if os.environ.get("EVENTBUS_UI_SCREENSHOT"):
                shutil.copy(shot, os.environ["EVENTBUS_UI_SCREENSHOT"])
            # the job ends while the page is open: the last state reaches it
            release.touch()
            assert job.wait(timeout=60) == 0, "".join(lines)
            browser.wait_for("document.body.dataset.status === 'succeeded'", timeout=10)
            assert json.loads(browser.evaluate(RANKS_JS)) == [["0", "exited"],
                                                              ["1", "exited"]]
        assert sum(1 for line in lines if ADDRESS.search(line)) == 1
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGTERM)
            try:
                job.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()


@pytest.mark.slow
def test_browser_shows_64_ranks_from_a_file(tmp_path: Path) -> None:
    """`eventbus view` of a 64-rank job (synthetic, tests/ui_fixture.py): 64 rank
    elements, the stalled and the slow rank marked as such, the stall's diagnosis and
    stack in the panel. The docs' screenshot is this page ($EVENTBUS_UI_DOCS_SCREENSHOT)."""
    browser_path = chromium_or_skip()
    path = tmp_path / "job64.jsonl"
    write_64_rank_job(path, time.time())
    proc, url = _start_view(path)
    try:
        with Chromium(browser_path, width=1600, height=1000) as browser:
            browser.goto(url)
            browser.wait_for("document.querySelectorAll('[data-rank]').length === 64")
            states = dict(json.loads(browser.evaluate(RANKS_JS)))
            assert states["50"] == "stalled" and states["12"] == "slow"
            assert sum(s == "running" for s in states.values()) == 62
            assert "culprit" in browser.evaluate(
                "document.querySelector('#problem .diag').textContent")
            assert "sync_grads" in browser.evaluate(
                "document.querySelector('#problem pre.stack').textContent")
            assert browser.evaluate("document.querySelectorAll('#events-body tr').length") > 0
            browser.evaluate("document.getElementById('filter').value = 'WORKER_STALLED';"
                             "document.getElementById('filter').dispatchEvent("
                             "new Event('input'))")
            assert browser.evaluate("document.querySelectorAll('#events-body tr').length") == 1
            browser.evaluate("document.getElementById('filter').value = '';"
                             "document.getElementById('filter').dispatchEvent("
                             "new Event('input'))")
            target = os.environ.get("EVENTBUS_UI_DOCS_SCREENSHOT")
            if target:
                browser.screenshot(Path(target))
    finally:
        assert _stop(proc) == 0


@pytest.mark.slow
def test_browser_shows_a_drain_then_the_preempted_job(tmp_path: Path) -> None:
    """`eventbus view` of a job's file while it drains: in headless Chromium the banner
    says "draining: SIGTERM on node 0, N s left" and the status "draining"; once the rest
    of the file (the late rank's exit, AGENT_EXIT PREEMPTED) is appended, the banner says
    how it ended, the rank that did not stop in time is marked "late", and the PREEMPTING
    event is in the events list."""
    browser_path = chromium_or_skip()
    path = tmp_path / "events.jsonl"
    t0 = time.time() - 6.5  # the PREEMPTING half a second ago
    lines = drained_job_lines(t0, deadline_s=90.0)
    head = drained_job_lines(t0, deadline_s=90.0, ended=False)
    path.write_text("".join(lines[:len(head)]))
    proc, url = _start_view(path)
    try:
        with Chromium(browser_path, width=1400, height=900) as browser:
            browser.goto(url)
            browser.wait_for("document.body.dataset.status === 'draining'")
            assert browser.evaluate("document.getElementById('drain').hidden") is False
            text = browser.evaluate("document.getElementById('drain-text').textContent")
            assert re.fullmatch(r"draining: SIGTERM on node 0, \d+ s left", text), text
            assert 60 <= int(text.split(", ")[1].split()[0]) <= 90
            assert browser.evaluate("document.getElementById('status').textContent") == (
                "draining")
            with path.open("a") as f:
                f.write("".join(lines[len(head):]))
            browser.wait_for("document.body.dataset.status === 'preempted'", timeout=20)
            assert browser.evaluate("document.getElementById('drain-text').textContent") == (
                "preempted: the other ranks stopped at step 34; rank 1 did not stop in time")
            assert browser.evaluate("document.getElementById('drain').dataset.phase") == (
                "preempted")
            assert json.loads(browser.evaluate(RANKS_JS)) == [["0", "exited"], ["1", "late"]]
            assert browser.evaluate(
                "document.querySelector('[data-rank=\"1\"] .st').textContent") == "late SIGTERM"
            assert browser.evaluate("document.getElementById('exit-reason').hidden") is True
            browser.wait_for("document.querySelectorAll("
                             "'#events-body tr[data-type=\"PREEMPTING\"]').length === 1")
            marks = browser.evaluate("Array.from(document.querySelectorAll('.mark'))"
                                     ".map(m => m.dataset.kind)")
            assert marks == ["drain", "late", "preempted"], marks
            # the header's goodput line: the job's figure, its biggest loss the drain's
            goodput = browser.evaluate("document.getElementById('goodput').textContent")
            assert re.fullmatch(r"goodput \d+\.\d% of .+; the biggest loss: \w+, .+", goodput), \
                goodput
            target = os.environ.get("EVENTBUS_UI_DRAIN_SCREENSHOT")
            if target:
                browser.screenshot(Path(target))
    finally:
        assert _stop(proc) == 0


@pytest.mark.serial
def test_ui_benchmark_measures_each_case() -> None:
    """benchmarks/bench_ui.py: a figure per case, the 50 pages connected and written to."""
    from benchmarks import bench_ui
    from benchmarks.report import render

    result = bench_ui.run(quick=True)
    cases = [row["case"] for row in result["rows"]]
    assert cases == ["--ui off", "--ui on", "--ui on, 50 open pages",
                     "one --sink (queue enqueue)"]
    assert all(row["ns/event"] > 0 for row in result["rows"])
    assert result["streams open"] == 50 and result["pushes to the pages"] > 0
    text = render({"ui": result}, machine={}, versions={}, when="now", quick=True,
                  seconds={"ui": 1.0})
    assert "The job view" in text
