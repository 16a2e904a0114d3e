"""The job model the trace, the plot and tail share (readers/jobview.py), pinned on the
hand-made 2-node recording in tests/fixtures (see make_fixtures.py for the story)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import eventbus
from eventbus.app.readers.jobview import AGENT
from eventbus.app.readers.jobview import JobView
from eventbus.app.readers.records import Problem
from eventbus.app.readers.records import Record
from eventbus.app.readers.records import decode_line
from eventbus.app.readers.records import read_records

FIXTURES = Path(__file__).resolve().parent / "fixtures"
NODE0 = FIXTURES / "job_node0.jsonl"
NODE1 = FIXTURES / "job_node1.jsonl"


@pytest.fixture(scope="module")
def view() -> JobView:
    return JobView.from_files([NODE0, NODE1])


def test_reader_keeps_events_and_counts_torn_and_foreign_lines() -> None:
    """Every event line is read; the torn last line and the foreign line are counted as
    problems of their file, not exceptions."""
    records0, problems0 = read_records(NODE0)
    records1, problems1 = read_records(NODE1)
    assert len(records0) == 42 and len(records1) == 37
    assert [(p.kind, p.count) for p in problems0] == [("torn", 1)]
    assert [(p.kind, p.count) for p in problems1] == [("foreign", 1)]
    assert problems1[0].describe().endswith("job_node1.jsonl: 1 foreign line(s) skipped "
                                            "(not events)")


def test_decode_line_tells_torn_from_foreign() -> None:
    """Per line (what tail shows): an unfinished last line is torn; a complete line that
    starts like an event but does not parse is torn too (a crashed writer's line ended by
    the next writer); anything else that does not parse is foreign."""
    cut = '{"type":"EPOCH_END","timest'
    unfinished = decode_line(cut, line=9, complete=False)
    ended_by_next_writer = decode_line(cut, line=9)
    other = decode_line("Traceback (most recent call last):", line=9)
    assert isinstance(unfinished, Problem) and unfinished.kind == "torn"
    assert isinstance(ended_by_next_writer, Problem) and ended_by_next_writer.kind == "torn"
    assert isinstance(other, Problem) and other.kind == "foreign"
    assert other.describe() == ("line 9: foreign line (not JSON: Expecting value: line 1 "
                                "column 1 (char 0)): 'Traceback (most recent call last):'")


def test_decode_line_revives_nan_and_keeps_unknown_types() -> None:
    """A user-declared type this process never declared is a Record; NaN tags revive."""
    line = json.dumps({"type": "MY_TYPE", "timestamp": 1.5, "shard": 3,
                       "data": {"loss": {"$float": "NaN"}}, "context": {"rank": 2}})
    record = decode_line(line)
    assert isinstance(record, Record)
    assert (record.type, record.fields, record.rank) == ("MY_TYPE", {"shard": 3}, 2)
    assert math.isnan(record.data["loss"])


@pytest.mark.parametrize("text, reason", [
    ("[1, 2]", "a JSON list"),
    ('{"timestamp": 1.0}', "no string 'type'"),
    ('{"type": "X", "timestamp": "soon"}', "no finite numeric 'timestamp'"),
    ('{"type": "X", "timestamp": 1, "data": [1]}', "'data' is not an object"),
    ('{"type": "X", "timestamp": 1, "context": 3}', "'context' is not an object"),
    ('{"type": "X", "timestamp": {"$float": "NaN"}}', "no finite numeric 'timestamp'"),
    ("NaN", "not JSON"),
])
def test_decode_line_names_what_is_wrong(text: str, reason: str) -> None:
    """Lines that are JSON but not events say why they were skipped."""
    problem = decode_line(text, line=7)
    assert isinstance(problem, Problem) and problem.kind == "foreign"
    assert reason in problem.reason


def test_nodes_come_from_workers_even_when_the_agent_never_says(view: JobView) -> None:
    """node-b's agent records no group rank; it is tied to node 1 through its workers'
    pids, so its events and ranks 2 and 3 land on node 1."""
    assert [(n.label, n.hostname, n.ranks) for n in view.nodes] == [
        ("node 0", "node-a", [0, 1]), ("node 1", "node-b", [2, 3])]
    agent_b = [m for m in view.markers if m.record.hostname == "node-b" and m.track == AGENT]
    assert agent_b and {m.node for m in agent_b} == {"node 1"}


def test_attempts_are_cut_by_each_nodes_restarts(view: JobView) -> None:
    """Two attempts per node, split at that node's WORKER_RESTART; attempt 0 of the node
    with the failure is 'failed', the other node's 'restarted'."""
    got = [(a.node, a.index, a.outcome) for a in view.attempts]
    assert got == [("node 0", 0, "failed"), ("node 0", 1, "succeeded"),
                   ("node 1", 0, "restarted"), ("node 1", 1, "succeeded")]
    restart = next(a for a in view.attempts if a.node == "node 0" and a.index == 1)
    assert restart.restart is not None and restart.start == restart.restart.timestamp
    assert view.attempt_count() == 2 and view.outcome() == "SUCCEEDED"


def test_worker_runs_are_processes_with_their_exits(view: JobView) -> None:
    """One run per worker process; rank 1's first run ends at its exit 3; the runs the
    agent stopped for the restart end with their attempt; node-b's second runs are
    attempt 1 although their TORCHELASTIC_RESTART_COUNT still says 0."""
    runs = {(w.rank, w.attempt): w for w in view.runs}
    assert sorted(runs) == [(r, a) for r in range(4) for a in range(2)]
    failed = runs[(1, 0)]
    assert (failed.exit_code, failed.ended_by, failed.failed) == (3, "exit", True)
    assert failed.message == "RuntimeError: injected failure on attempt 0 (rank 1)"
    assert runs[(0, 0)].ended_by == "attempt end" and runs[(0, 0)].exit_code is None
    assert all(runs[(r, 1)].exit_code == 0 for r in range(4))
    assert runs[(2, 1)].pid == 5111 and runs[(2, 1)].node == "node 1"


def test_epochs_pair_up_and_unfinished_ones_are_cut_at_the_run_end(view: JobView) -> None:
    """Epoch 1 of attempt 0 never ended (the crash): it ends with its worker's run."""
    unfinished = [e for e in view.epochs if not e.finished]
    assert sorted(e.rank for e in unfinished) == [0, 1, 2, 3]
    assert all(e.epoch == 1 and e.attempt == 0 for e in unfinished)
    rank1 = next(e for e in unfinished if e.rank == 1)
    run = next(w for w in view.runs if w.rank == 1 and w.attempt == 0)
    assert rank1.end == run.end
    assert sum(e.finished for e in view.epochs) == 4 + 12


def test_every_record_is_a_span_part_or_a_marker(view: JobView) -> None:
    """Nothing is dropped: each record either became part of a span or is a marker."""
    assert view.consumed + len(view.markers) == len(view.records) == 79
    kinds = {m.record.type for m in view.markers}
    assert {"DATA_SHARD_LOADED", "WORKER_RESTART", "CHECKPOINT_SAVED", "METRIC"} <= kinds


def test_merging_a_job_wide_file_with_per_node_files_keeps_each_event_once(
        tmp_path: Path) -> None:
    """The agent of group rank 0 holds every node's events: merged with a per-node file,
    each event is still counted once."""
    job_wide = tmp_path / "job.jsonl"
    job_wide.write_text(NODE0.read_text() + "\n" + NODE1.read_text())
    merged = JobView.from_files([job_wide, NODE1, NODE0])
    assert len(merged.records) == 79
    assert len(merged.runs) == 8


def test_without_any_group_rank_workers_join_the_agent_that_started_them() -> None:
    """When no event says its group rank (an older launcher, a hand-written file), the
    workers are tied to their agent through WORKER_START.worker_pid, under its host."""
    records = []
    for r in read_records(NODE1)[0]:
        context = {**r.context, "group_rank": None}
        item = decode_line(json.dumps({**r.to_dict(), "context": context}))
        assert isinstance(item, Record)
        records.append(item)
    view = JobView.from_records(records)
    assert [(n.label, n.ranks) for n in view.nodes] == [("node-b", [2, 3])]
    assert {w.node for w in view.runs} == {"node-b"} and len(view.runs) == 4


def _job(*events: eventbus.Event) -> JobView:
    """The view of ``events`` as a file's lines read back."""
    records = []
    for event in events:
        record = decode_line(event.to_json())
        assert isinstance(record, Record)
        records.append(record)
    return JobView.from_records(records)


def _agent(*, restart_count: int | None = None) -> eventbus.JobContext:
    """node-a's agent (group rank 0) in attempt ``restart_count``."""
    return eventbus.JobContext(group_rank=0, hostname="node-a", pid=1,
                               restart_count=restart_count)


def test_the_outcome_reads_the_cause_as_the_page_does() -> None:
    """AGENT_EXIT.cause "stop" makes the job STOPPED and its last attempt "stopped" (the
    page's words); without the field it is FAILED, whatever the reason says."""
    def job(**fields: object) -> JobView:
        return _job(
            eventbus.WorkerStart(worker_id=0, timestamp=1.0, context=_agent()),
            eventbus.AgentExit(state="FAILED", exit_code=3, timestamp=2.0, context=_agent(),
                               reason="rank 0 failed; STOP from fatal", **fields))

    stopped = job(cause="stop")
    assert stopped.outcome() == "STOPPED"
    assert [a.outcome for a in stopped.attempts] == ["stopped"]
    old = job()
    assert old.outcome() == "FAILED" and [a.outcome for a in old.attempts] == ["failed"]


def test_an_attempt_ended_for_a_stall_failed_and_a_stopped_worker_is_collateral() -> None:
    """A restart whose cause is "stall" ends a failed attempt though no worker failed by
    itself (the stalled ones were stopped); a WORKER_EXIT with a cause other than its own
    failure is a worker the agent stopped."""
    view = _job(
        eventbus.WorkerStart(worker_id=0, worker_pid=10, timestamp=1.0, context=_agent()),
        eventbus.WorkerExit(worker_id=0, exit_code=-15, signal="SIGTERM", worker_pid=10,
                            cause="stall", timestamp=2.0, context=_agent()),
        eventbus.WorkerRestart(attempt=1, restarts_left=0, cause="stall", timestamp=3.0,
                               context=_agent()),
        eventbus.AgentExit(state="SUCCEEDED", exit_code=0, timestamp=4.0,
                           context=_agent(restart_count=1)))
    assert [a.outcome for a in view.attempts] == ["failed", "succeeded"]
    (run,) = view.runs
    assert run.stopped_by_agent and run.failed


# -- a drain (preemption) ----------------------------------------------------------------------

#: the drain's facts the agent puts in the preempted job's AGENT_EXIT (launcher/drain/state.py)
DRAIN_FACTS = {"signal": "SIGTERM", "node": 0, "grace_s": 3.0, "used_s": 3.027,
               "stop_step": 34, "late_ranks": [1], "failed_ranks": {}, "escalated": False}


def drained_job_lines(t0: float = 1_764_410_000.0, *, deadline_s: float = 3.0,
                      ended: bool = True) -> list[str]:
    """A 2-rank job on one node drained by SIGTERM to its agent, as the JSONL lines
    `eventbus run --events-jsonl` writes (the shape of a real run of
    tests/jobs/drain_train.py with DRAIN_MODE=ignore): PREEMPTING at t0+6, rank 0 stops by
    itself at step 34 (WORKER_EXIT 0, data["drained"]), rank 1 does not stop within the
    grace (its agent's SIGTERM: WORKER_EXIT cause "preemption", data["stopped_by_agent"]),
    the job ends PREEMPTED with exit code 75. ``ended`` False: the lines up to the
    PREEMPTING only (the job still drains)."""
    def line(type_: str, t: float, rank: int | None = None,
             data: dict[str, object] | None = None, **fields: object) -> str:
        context = {"rank": rank, "local_rank": rank, "group_rank": 0, "world_size": 2,
                   "local_world_size": 2, "role": "default", "run_id": "drained",
                   "restart_count": 0, "hostname": "node-a",
                   "pid": 100 if rank is None else 200 + rank}
        return json.dumps({"type": type_, "timestamp": t0 + t, **fields,
                           "data": data or {}, "context": context}) + "\n"

    lines = [line("AGENT_START", 0.0, entrypoint="python", max_restarts=0, nproc_per_node=2),
             line("RENDEZVOUS", 0.3, state="SUCCEEDED", name="c10d", duration_s=0.3)]
    lines += [line("WORKER_START", 0.5, worker_id=r, worker_local_rank=r, worker_pid=200 + r)
              for r in (0, 1)]
    lines += [line("METRIC", 1.0 + s, r, step=8 * s, data={"loss": 1.0 / (1 + s)})
              for s in range(5) for r in (0, 1)]
    lines += [line("PREEMPTING", 6.0, deadline_s=deadline_s, reason="SIGTERM on node 0",
                   signal="SIGTERM", node=0, grace_s=deadline_s)]
    if not ended:
        return lines
    lines += [
        line("CHECKPOINT_SAVED", 6.8, 0, path="ckpt_rank0.pt", step=34, duration_s=0.3),
        line("WORKER_EXIT", 7.0, worker_id=0, exit_code=0, worker_local_rank=0,
             worker_pid=200, data={"attempt": 0, "drained": True}),
        line("WORKER_EXIT", 9.0, worker_id=1, exit_code=-15, worker_local_rank=1,
             worker_pid=201, signal="SIGTERM", cause="preemption",
             message="stopped by the agent: did not stop within the drain's grace (3 s): "
                     "SIGTERM, then SIGKILL",
             data={"attempt": 0, "stopped_by_agent": True}),
        line("AGENT_EXIT", 9.05, state="PREEMPTED", exit_code=75, cause="preemption",
             reason="SIGTERM on node 0: the job drained (the other ranks stopped at step 34; "
                    "3.0 s of the 3 s grace used); rank 1 did not stop in time (SIGTERM, "
                    "then SIGKILL); exit code 75",
             data={"drain": DRAIN_FACTS}),
    ]
    return lines


def drained_job(*, ended: bool = True) -> list[Record]:
    """:func:`drained_job_lines` read back."""
    records = []
    for text in drained_job_lines(ended=ended):
        record = decode_line(text.rstrip("\n"))
        assert isinstance(record, Record)
        records.append(record)
    return records


def test_a_drain_is_a_span_from_preempting_to_the_jobs_end() -> None:
    """PREEMPTING to the job's AGENT_EXIT is the job's drain, with the end's facts; the
    job and its last attempt are "preempted" (neither failed nor succeeded); without the
    end yet the drain runs to the last event and the job is still running."""
    view = JobView.from_records(drained_job())
    (drain,) = view.drains
    assert drain.start == 1_764_410_006.0 and drain.end == 1_764_410_009.05
    assert drain.preempting.type == "PREEMPTING"
    assert drain.exit is not None and drain.exit.type == "AGENT_EXIT"
    assert drain.facts is not None and drain.facts["late_ranks"] == [1]
    assert drain.facts["stop_step"] == 34 and drain.facts["failed_ranks"] == {}
    assert view.outcome() == "PREEMPTED"
    assert [a.outcome for a in view.attempts] == ["preempted"]
    late = next(w for w in view.runs if w.rank == 1)
    assert late.stopped_by_agent and late.exit_code == -15
    drained = next(w for w in view.runs if w.rank == 0)
    assert drained.exit_code == 0 and not drained.failed
    draining = JobView.from_records(drained_job(ended=False))
    (open_drain,) = draining.drains
    assert open_drain.exit is None and open_drain.facts is None
    assert open_drain.end == open_drain.start == draining.t1
    assert draining.outcome() == "unknown"
    assert [a.outcome for a in draining.attempts] == ["running"]
    assert JobView.from_files([NODE0, NODE1]).drains == []
