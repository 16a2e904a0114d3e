"""The one sentence of each event (eventbus.app.sentences): the words the console, the
page, the sinks and the plot say, the same for a typed event and for its line read back
from a JSONL file; the one truncation rule; the facts read from fields, never prose."""

from __future__ import annotations

from typing import Any

import pytest

import eventbus
from eventbus.app.readers.records import Record
from eventbus.app.readers.records import decode_line
from eventbus.app.sentences import cause_of
from eventbus.app.sentences import drain_banner
from eventbus.app.sentences import drain_facts
from eventbus.app.sentences import drain_result
from eventbus.app.sentences import first_line
from eventbus.app.sentences import job_outcome
from eventbus.app.sentences import restarts_text
from eventbus.app.sentences import sentence
from eventbus.app.sentences import stopped_by_agent

TRACEBACK = ("Traceback (most recent call last):\n  File \"train.py\", line 3, in <module>\n"
             "    main()\nRuntimeError: bad   config\n\n")


def _record(event: eventbus.Event) -> Record:
    record = decode_line(event.to_json())
    assert isinstance(record, Record)
    return record


def _says(event: eventbus.Event, **options: Any) -> str:
    """The event's sentence, checked to be the same read back from its JSONL line."""
    typed = sentence(event, **options)
    assert sentence(_record(event), **options) == typed
    return typed


# -- the truncation rule -------------------------------------------------------------------


def test_first_line_is_a_tracebacks_exception_line() -> None:
    """A traceback says its last line (the exception), whitespace collapsed."""
    assert first_line(TRACEBACK) == "RuntimeError: bad config"


def test_first_line_is_else_the_first_line_that_is_not_blank() -> None:
    """Any other message says its first line that is not blank."""
    assert first_line("\n\n  CUDA out of memory.  Tried\nmore") == "CUDA out of memory. Tried"
    assert first_line(None) == first_line("") == first_line(" \n ") == ""


def test_first_line_is_cut_with_an_ellipsis_within_the_limit() -> None:
    """Past the limit (200 by default) the line is cut to the limit, ending in '...'."""
    assert first_line("x" * 200) == "x" * 200
    cut = first_line("x" * 201)
    assert len(cut) == 200 and cut.endswith("...")
    assert first_line("abcdefghij", limit=8) == "abcde..."


# -- the sentences ---------------------------------------------------------------------------


def test_a_workers_own_failure() -> None:
    """WORKER_EXIT, non-zero: the rank, its exit code or signal and its message's line."""
    failed = eventbus.WorkerExit(worker_id=1, exit_code=3, message=TRACEBACK, cause="failure")
    assert _says(failed) == "rank 1 failed (exit code 3: RuntimeError: bad config)"
    assert _says(failed, short=True) == "failed (exit code 3)"
    killed = eventbus.WorkerExit(worker_id=2, exit_code=-9, signal="SIGKILL")
    assert _says(killed) == "rank 2 failed (signal SIGKILL)"


def test_a_worker_stopped_by_the_agent_says_why_from_its_cause() -> None:
    """WORKER_EXIT of a worker the agent stopped: "was stopped by the agent", and why, from
    its cause field (a file without it: "another rank failed or stalled")."""
    def stopped(**fields: Any) -> eventbus.WorkerExit:
        data = {"stopped_by_agent": True, **fields.pop("data", {})}
        return eventbus.WorkerExit(worker_id=0, exit_code=-15, signal="SIGTERM", data=data,
                                   **fields)

    head = "rank 0 was stopped by the agent (SIGTERM) because"
    assert _says(stopped(cause="failure")) == f"{head} another rank failed"
    assert _says(stopped(cause="stall")) == f"{head} a rank stalled"
    assert _says(stopped(cause="stall", data={"stalled": True})) == f"{head} it stalled"
    assert _says(stopped(cause="remote_stop")) == f"{head} another node stopped the job"
    assert _says(stopped()) == f"{head} another rank failed or stalled"
    assert _says(stopped(), short=True) == "stopped by the agent (SIGTERM)"


def test_a_worker_that_finished() -> None:
    """WORKER_EXIT with exit code 0."""
    assert _says(eventbus.WorkerExit(worker_id=0, exit_code=0)) == "rank 0 finished (exit code 0)"


def test_a_stall_says_where_from_data_or_the_stack() -> None:
    """WORKER_STALLED: the rank, how long it was silent, and where: data["where"], else the
    script's frame of its stack."""
    where = eventbus.WorkerStalled(worker_id=3, silent_s=61.0,
                                   data={"where": "model.py:7 in forward"})
    assert _says(where) == "rank 3 stalled for 61.0 s (model.py:7 in forward)"
    stack = ("Current thread 0x00007f0000000001 (most recent call first):\n"
             '  File "/venv/lib/python3.11/site-packages/torch/c10d.py", line 9 in all_reduce\n'
             '  File "/job/train.py", line 18 in main\n')
    stalled = eventbus.WorkerStalled(worker_id=1, silent_s=5.23, data={"stack": stack})
    assert _says(stalled) == "rank 1 stalled for 5.2 s (train.py:18)"
    assert _says(stalled, short=True) == "stalled for 5.2 s"


def test_a_stall_says_what_the_evidence_shows_and_data_is_a_wait() -> None:
    """WORKER_STALLED with evidence: what the rank waits on after the silence; a rank
    waiting for data reads as such, not as stalled."""
    blocked = eventbus.WorkerStalled(worker_id=1, silent_s=61.0, data={
        "where": "train.py:18 in main", "waiting_on": "blocked", "doing": "blocked"})
    assert _says(blocked) == "rank 1 stalled for 61.0 s, blocked (train.py:18 in main)"
    collective = eventbus.WorkerStalled(worker_id=0, silent_s=61.0, data={
        "waiting_on": "collective", "doing": "in barrier #16"})
    assert _says(collective, short=True) == "stalled for 61.0 s, in barrier #16"
    data = eventbus.WorkerStalled(worker_id=1, silent_s=4.04, data={
        "where": "train.py:30 in main", "waiting_on": "data", "doing": "waiting for data"})
    assert _says(data) == "rank 1 waiting for data for 4.0 s (train.py:30 in main)"


def test_a_straggler() -> None:
    """WORKER_SLOW: the rank, its step and how far behind its peers' median it is."""
    slow = eventbus.WorkerSlow(worker_id=2, factor=2.6, step_time_s=0.41,
                               median_step_time_s=0.16, step=120)
    assert _says(slow) == ("rank 2 is slow at step 120: step time 0.41 s, 2.6 x its peers' "
                           "median 0.16 s")
    lock_step = eventbus.WorkerSlow(worker_id=1, factor=3.1, step_time_s=0.62,
                                    median_step_time_s=0.2, data={"basis": "compute_s"})
    assert _says(lock_step) == ("rank 1 is slow: compute time between collectives 0.62 s, "
                                "3.1 x its peers' median 0.2 s")
    assert _says(eventbus.WorkerSlow(worker_id=4, factor=2.0)) == "rank 4 is slow: 2 x its peers"


def test_a_restart_and_a_rendezvous_re_forming() -> None:
    """WORKER_RESTART: the new attempt, the restarts left and its reason; a membership
    change (cause) says the group re-forms and uses no restart."""
    restart = eventbus.WorkerRestart(attempt=1, restarts_left=1, cause="failure",
                                     reason="rank 1 failed (exit code 3)")
    assert _says(restart) == ("the group restarts as attempt 1 (1 restart left): rank 1 "
                              "failed (exit code 3)")
    assert _says(restart, short=True) == "the group restarts as attempt 1 (1 restart left)"
    membership = eventbus.WorkerRestart(attempt=2, restarts_left=2, cause="membership",
                                        reason="membership change")
    assert _says(membership) == ("the group re-forms through the rendezvous as attempt 2 "
                                 "(another node restarted it, or nodes joined; this uses no "
                                 "restart; 2 restarts left)")
    assert restarts_text(1) == "1 restart left" and restarts_text(0) == "0 restarts left"


def test_the_end_of_the_job_reads_its_cause() -> None:
    """AGENT_EXIT: succeeded; stopped (cause stop, remote_stop); failed (any other, a file
    without cause included); the agent failed (cause error); with its reason."""
    reason = "rank 1 failed (exit code 3); STOP from fatal"
    stop = eventbus.AgentExit(state="FAILED", exit_code=3, reason=reason, cause="stop")
    assert _says(stop) == f"the job was stopped (exit code 3): {reason}"
    assert _says(stop, short=True) == "the job was stopped (exit code 3)"
    remote = eventbus.AgentExit(state="FAILED", exit_code=3, cause="remote_stop")
    assert _says(remote) == "the job was stopped (exit code 3)"
    old = eventbus.AgentExit(state="FAILED", exit_code=3, reason=reason)
    assert _says(old) == f"the job failed (exit code 3): {reason}"
    error = eventbus.AgentExit(state="FAILED", exit_code=1, cause="error")
    assert _says(error) == "the agent failed (exit code 1)"
    assert _says(eventbus.AgentExit(state="SUCCEEDED", exit_code=0)) == "the job succeeded"


def test_a_drain_says_what_drains_the_job_and_the_time_to_stop() -> None:
    """PREEMPTING: "drain: " the reason, and the seconds to stop (of the whole grace when
    less is left: another node's drain that took time to arrive); without a reason, the
    signal and the node."""
    drain = eventbus.Preempting(deadline_s=20.0, reason="SIGTERM on node 1", signal="SIGTERM",
                                node=1, grace_s=20.0)
    assert _says(drain) == "drain: SIGTERM on node 1, 20 s to stop"
    assert _says(drain, short=True) == "drain (20 s to stop)"
    late = eventbus.Preempting(deadline_s=12.4, reason="SIGUSR1 on node 3", grace_s=20.0)
    assert _says(late) == "drain: SIGUSR1 on node 3, 12 s of the 20 s grace left"
    bare = eventbus.Preempting(deadline_s=2.5, reason="", signal="SIGTERM", node=0)
    assert _says(bare) == "drain: SIGTERM on node 0, 2.5 s to stop"


def _preempted(drain: dict[str, Any] | None, **fields: Any) -> eventbus.AgentExit:
    return eventbus.AgentExit(state="PREEMPTED", exit_code=75, cause="preemption",
                              data={} if drain is None else {"drain": drain}, **fields)


def test_a_preempted_end_says_how_the_ranks_stopped_from_the_drains_facts() -> None:
    """AGENT_EXIT PREEMPTED: "the job was preempted by" the signal and node, its exit code,
    then how the ranks stopped (the stop step, who did not stop in time, who ended
    otherwise) and the grace used, from data["drain"]; the short form only the first
    part; without data["drain"], the agent's reason."""
    facts = {"signal": "SIGTERM", "node": 1, "grace_s": 20.0, "used_s": 1.4,
             "stop_step": 42, "late_ranks": [], "failed_ranks": {}, "escalated": False}
    clean = _preempted(facts)
    assert _says(clean) == ("the job was preempted by SIGTERM on node 1 (exit code 75): "
                            "every rank stopped at step 42; 1.4 s of the 20 s grace used")
    assert _says(clean, short=True) == "the job was preempted (exit code 75)"
    late = _preempted({**facts, "late_ranks": [3, 1], "used_s": 20.02, "escalated": True,
                       "failed_ranks": {"2": -15, "5": 1, "6": -15}})
    assert _says(late) == (
        "the job was preempted by SIGTERM on node 1 (exit code 75): the other ranks "
        "stopped at step 42; ranks 1, 3 did not stop in time; ranks 2, 6 ended on "
        "SIGTERM; rank 5 ended with exit code 1; 20 s of the 20 s grace used, cut short "
        "by a second signal")
    none_agreed = _preempted({**facts, "stop_step": None, "used_s": None})
    assert _says(none_agreed) == ("the job was preempted by SIGTERM on node 1 (exit code "
                                  "75): no stop step was agreed")
    reason = "SIGTERM on node 0: the job drained (every rank stopped at step 7); exit code 75"
    assert _says(_preempted(None, reason=reason)) == (
        f"the job was preempted (exit code 75): {reason}")
    many = _preempted({**facts, "late_ranks": list(range(20))})
    assert "ranks 0, 1, 2, 3, 4, 5, 6, 7 and 12 more did not stop in time" in _says(many)


def test_a_drains_worker_exits() -> None:
    """WORKER_EXIT in a drain: a rank that stopped by itself (data["drained"], code 0), one
    its agent stopped at the deadline (cause "preemption", data["stopped_by_agent"]: it did
    not stop in time), one that ended otherwise meanwhile (drained, not 0)."""
    stopped = eventbus.WorkerExit(worker_id=0, exit_code=0, data={"drained": True})
    assert _says(stopped) == "rank 0 stopped for the drain (exit code 0)"
    assert _says(stopped, short=True) == "stopped for the drain (exit code 0)"
    late = eventbus.WorkerExit(worker_id=1, exit_code=-15, signal="SIGTERM",
                               cause="preemption", data={"stopped_by_agent": True})
    assert _says(late) == ("rank 1 was stopped by the agent (SIGTERM) because it did not "
                           "stop within the drain's grace")
    assert _says(late, short=True) == "did not stop in time (SIGTERM)"
    assert stopped_by_agent(late) and stopped_by_agent(_record(late))
    ended = eventbus.WorkerExit(worker_id=2, exit_code=-15, signal="SIGTERM",
                                cause="preemption", data={"drained": True})
    assert _says(ended) == "rank 2 ended during the drain (signal SIGTERM)"


def test_the_drains_banner_and_facts() -> None:
    """drain_banner: "draining: ..., N s left" while it drains, "preempted: ..." at its
    end; drain_facts reads data["drain"] as types, whatever a file holds."""
    assert drain_banner(reason="SIGTERM on node 1", left_s=12.3) == (
        "draining: SIGTERM on node 1, 12 s left")
    assert drain_banner(signal="SIGUSR1", node=2, left_s=-1.0) == (
        "draining: SIGUSR1 on node 2, 0 s left")
    facts = drain_facts(_preempted({"stop_step": 42, "late_ranks": [2, "x", True],
                                    "failed_ranks": {"1": 3, "x": 1, "4": "no"},
                                    "grace_s": "20", "escalated": "yes"}))
    assert facts == {"signal": None, "node": None, "grace_s": None, "used_s": None,
                     "stop_step": 42, "late_ranks": [2], "failed_ranks": {1: 3},
                     "escalated": False}
    assert drain_banner(facts=facts, ended=True) == (
        "preempted: the other ranks stopped at step 42; rank 2 did not stop in time; rank 1 "
        "ended with exit code 3")
    assert drain_banner(ended=True) == "preempted: the job drained"
    assert drain_result({"stop_step": 9}) == "every rank stopped at step 9"
    assert drain_facts(eventbus.AgentExit(state="PREEMPTED")) is None
    assert drain_facts(_preempted(None)) is None


def test_a_failed_rendezvous() -> None:
    """RENDEZVOUS FAILED: its message's line; a successful one: how long it took."""
    failed = eventbus.Rendezvous(state="FAILED", message="timed out\nafter 900 s")
    assert _says(failed) == "the rendezvous failed: timed out"
    assert _says(eventbus.Rendezvous(duration_s=1.25)) == "the rendezvous succeeded in 1.2 s"


def test_any_other_event_is_its_type_and_rank() -> None:
    """Any other type: its name and the rank it comes from (an agent's: its name)."""
    context = eventbus.JobContext(rank=3)
    assert _says(eventbus.EpochStart(epoch=2, context=context)) == "EPOCH_START from rank 3"
    assert _says(eventbus.EpochStart(epoch=2, context=eventbus.JobContext())) == "EPOCH_START"


# -- the facts -------------------------------------------------------------------------------


def test_the_facts_are_read_from_fields_with_a_fallback_for_old_files() -> None:
    """cause_of, stopped_by_agent and job_outcome read the fields; a file without cause
    falls back to the exit code, data["stopped_by_agent"] and "failed"."""
    own = eventbus.WorkerExit(worker_id=1, exit_code=3)
    stalled = eventbus.WorkerExit(worker_id=1, exit_code=-15, cause="stall")
    marked = eventbus.WorkerExit(worker_id=0, exit_code=-15, data={"stopped_by_agent": True})
    for event in (own, _record(own)):
        assert cause_of(event) == "failure" and not stopped_by_agent(event)
    for event in (stalled, _record(stalled), marked, _record(marked)):
        assert stopped_by_agent(event)
    assert cause_of(eventbus.WorkerExit(worker_id=0, exit_code=0)) is None
    newer = eventbus.AgentExit(state="FAILED", cause="some_future_cause")
    assert cause_of(newer) == "failure" and job_outcome(newer) == "failed"
    for cause, outcome in (("stop", "stopped"), ("remote_stop", "stopped"),
                           ("failure", "failed"), (None, "failed")):
        end = eventbus.AgentExit(state="FAILED", cause=cause, reason="STOP from fatal")
        assert job_outcome(end) == job_outcome(_record(end)) == outcome
    assert job_outcome(eventbus.AgentExit(state="SUCCEEDED")) == "succeeded"


def test_a_preempted_job_is_its_own_outcome() -> None:
    """AGENT_EXIT PREEMPTED / cause "preemption": "preempted", neither failed nor
    succeeded; a file without the cause field reads the state."""
    for end in (eventbus.AgentExit(state="PREEMPTED", exit_code=75, cause="preemption"),
                eventbus.AgentExit(state="PREEMPTED", exit_code=75)):
        for event in (end, _record(end)):
            assert job_outcome(event) == "preempted"
            assert cause_of(event) == "preemption"


@pytest.mark.parametrize("kind", ["WORKER_EXIT", "WORKER_STALLED", "AGENT_EXIT"])
def test_a_record_of_a_type_this_process_never_declared_still_reads(kind: str) -> None:
    """A record missing its typed fields (a torn or foreign writer) gets a sentence, never
    an exception."""
    record = decode_line(f'{{"type": "{kind}", "timestamp": 1.0}}')
    assert isinstance(record, Record)
    assert sentence(record) and sentence(record, short=True)
