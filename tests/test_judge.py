"""The judge (eventbus_app/health/judge.py) without torch or processes: heartbeats on a
fake clock decide who is stalled (the culprit, never the ranks waiting on it), when a
verdict waits, what WORKER_STALLED carries, stragglers, and a SIGABRT's diagnosis."""

from __future__ import annotations

from typing import Any

import eventbus
from eventbus import JobContext
from eventbus.app.health.judge import Judge
from eventbus.app.health.watches import StallWatch
from eventbus.app.health.watches import StragglerWatch


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _beat(rank: int, *, enq: int, comp: int, idle_s: float = 0.0,
          pending: dict[str, Any] | None = None, **data: Any) -> eventbus.WorkerProgress:
    payload: dict[str, Any] = {"pgs": {"0": {"enqueued": enq, "completed": comp,
                                             "ranks": [0, 1], "name": "0"}}, **data}
    if pending is not None:
        payload["pending"] = {"0": pending}
    return eventbus.WorkerProgress(worker_id=rank, collectives=comp, idle_s=idle_s,
                                   data=payload, context=JobContext(rank=rank, restart_count=0))


PENDING = {"seq": 26, "op": "all_reduce", "sizes": [[337]], "dtypes": ["Float"],
           "state": "scheduled"}


def _hung_rank_1(clock: Clock) -> tuple[Judge, StallWatch]:
    """Rank 0 waits in all_reduce #26 that rank 1 never entered; 6 s later, timeout 5 s."""
    watch = StallWatch(5.0, clock=clock)
    judge = Judge(watch, None, clock=clock)
    watch.observe(_beat(0, enq=25, comp=25))
    watch.observe(_beat(1, enq=25, comp=25))
    clock.now += 6.0
    watch.observe(_beat(0, enq=26, comp=25, idle_s=6.0, pending=PENDING))
    watch.observe(_beat(1, enq=25, comp=25, idle_s=6.0, where="train.py:18 in spin",
                        stack="Thread 0x1 (most recent call first):\n  File ..."))
    return judge, watch


def test_the_culprit_is_judged_stalled_not_the_rank_waiting_on_it() -> None:
    """Group rank 0's verdict names rank 1 (not entered) and not rank 0 (waiting)."""
    clock = Clock()
    judge, _ = _hung_rank_1(clock)
    ranks = judge.ranks_to_watch(0, [0, 1], is_judge=True)
    overdue = judge.overdue(0, ranks)
    assert {s.rank for s in overdue} == {0, 1}
    verdict = judge.verdict(0, overdue, is_judge=True, ranks=ranks)
    assert verdict is not None
    assert verdict.stalled == (1,) and verdict.analysis.waiting_ranks == (0,)
    assert "rank 1 has not entered all_reduce #26" in verdict.analysis.diagnosis


def test_a_reported_verdict_is_not_judged_again_in_the_attempt() -> None:
    """Once reported, the verdict's ranks are not overdue again; the stall is counted."""
    clock = Clock()
    judge, _ = _hung_rank_1(clock)
    ranks = judge.ranks_to_watch(0, [0, 1], is_judge=True)
    verdict = judge.verdict(0, judge.overdue(0, ranks), is_judge=True, ranks=ranks)
    assert verdict is not None
    judge.reported(0, verdict)
    assert judge.stalls == 1
    clock.now += 60
    assert judge.overdue(0, ranks) == []


def test_the_stalled_event_carries_the_facts_and_the_stacks() -> None:
    """WORKER_STALLED: culprits, waiting ranks, the collective, the diagnosis, the rank's
    own stack first (this node's, by the stack dump) and its peers' after, where."""
    clock = Clock()
    judge, _ = _hung_rank_1(clock)
    ranks = judge.ranks_to_watch(0, [0, 1], is_judge=True)
    verdict = judge.verdict(0, judge.overdue(0, ranks), is_judge=True, ranks=ranks)
    assert verdict is not None
    (event,) = judge.stalled_events(0, verdict, live={0: (0, 100), 1: (1, 101)},
                                    stacks={0: "stack of 0", 1: "stack of 1"},
                                    dump_dir="/tmp/fr")
    assert event.worker_id == 1 and event.worker_pid == 101 and event.timeout_s == 5.0
    assert event.silent_s >= 6.0
    data = event.data
    assert data["culprit_ranks"] == [1] and data["waiting_ranks"] == [0]
    assert data["collective"]["op"] == "all_reduce" and data["collective"]["seq"] == 26
    assert data["stack"] == "stack of 1" and data["peer_stacks"] == {"0": "stack of 0"}
    assert data["where"] == "train.py:18 in spin" and data["fr_dump_dir"] == "/tmp/fr"
    assert "judged_by" not in data


def test_the_stalled_event_reports_the_silence_the_verdict_rests_on() -> None:
    """A heartbeat that arrives between the verdict and the event (while the stacks are
    taken) dates the rank's last progress by its arrival, later than it was: the event
    still reports the silence and timeout it was judged on, never one under the timeout
    (a CI run saw ``silent_s`` 2.911 with a 3 s timeout)."""
    clock = Clock()
    judge, watch = _hung_rank_1(clock)
    ranks = judge.ranks_to_watch(0, [0, 1], is_judge=True)
    verdict = judge.verdict(0, judge.overdue(0, ranks), is_judge=True, ranks=ranks)
    assert verdict is not None
    clock.now += 0.4
    watch.observe(_beat(1, enq=25, comp=25, idle_s=2.0, where="train.py:18 in spin"))
    assert (watch.silent_s(0, 1) or 0.0) < 5.0  # read again, the silence looks shorter
    (event,) = judge.stalled_events(0, verdict, live={1: (1, 101)}, stacks={1: "s1"})
    assert event.silent_s == 6.0 and event.timeout_s == 5.0


def test_a_rank_on_another_node_has_its_heartbeats_stack() -> None:
    """A stalled rank this node does not run gets the stack its last heartbeat carried."""
    clock = Clock()
    judge, _ = _hung_rank_1(clock)
    ranks = judge.ranks_to_watch(0, [0], is_judge=True)
    verdict = judge.verdict(0, judge.overdue(0, ranks), is_judge=True, ranks=ranks)
    assert verdict is not None
    (event,) = judge.stalled_events(0, verdict, live={0: (0, 100)}, stacks={0: "s0"})
    assert event.data["stack"].startswith("Thread 0x1") and event.worker_pid is None


def test_an_agent_that_does_not_judge_waits_for_group_rank_0() -> None:
    """Another node's agent acts only on its own ranks past the timeout plus the judge's
    grace, and never names a rank that waits in a collective."""
    clock = Clock()
    judge, _ = _hung_rank_1(clock)
    overdue = judge.overdue(0, [1])
    assert judge.patient(overdue, [1]) == []  # 6 s: within 5 s + the 15 s grace
    clock.now += 20
    assert [s.rank for s in judge.patient(judge.overdue(0, [1]), [1])] == [1]
    # its own waiting rank is never its verdict
    waiting = judge.patient(judge.overdue(0, [0]), [0])
    assert judge.verdict(0, waiting, is_judge=False, ranks=[0]) is None


def test_a_rank_whose_heartbeats_stopped_is_not_judged_within_the_grace() -> None:
    """A rank whose heartbeats stopped is likelier ending than hung: no verdict until the
    timeout plus the grace has passed."""
    clock = Clock()
    watch = StallWatch(5.0, clock=clock)
    judge = Judge(watch, None, clock=clock)
    watch.observe(_beat(0, enq=3, comp=3))
    watch.observe(_beat(1, enq=3, comp=3))
    clock.now += 6.0  # no heartbeat since: both are 6 s old (> 3.5 s: stopped)
    overdue = judge.overdue(0, [0, 1])
    assert judge.verdict(0, overdue, is_judge=True, ranks=[0, 1]) is None
    clock.now += 20.0
    overdue = judge.overdue(0, [0, 1])
    verdict = judge.verdict(0, overdue, is_judge=True, ranks=[0, 1])
    assert verdict is not None and set(verdict.stalled) == {0, 1}


def test_a_new_attempt_forgets_the_old_ones_progress() -> None:
    """new_attempt(a) drops attempt a and older: a restarted rank is not stalled by what the
    stopped one left."""
    clock = Clock()
    judge, watch = _hung_rank_1(clock)
    judge.new_attempt(0)
    assert watch.ranks(0) == [] and judge.overdue(0, [0, 1]) == []


def test_stragglers_are_looked_for_at_most_once_a_second() -> None:
    """WORKER_SLOW for the rank 3x slower than its peers, with its basis in data; a second
    look within the second finds nothing (the check is rate-limited)."""
    clock = Clock()
    straggler = StragglerWatch(2.0, clock=clock)
    judge = Judge(None, straggler, clock=clock)
    for rank, step_time in ((0, 0.1), (1, 0.1), (2, 0.3)):
        for step in range(10):
            straggler.observe(eventbus.Metric(
                step=step, data={"step_time_s": step_time},
                context=JobContext(rank=rank, restart_count=0)))
    (slow,) = judge.stragglers(0)
    assert slow.worker_id == 2 and slow.factor == 3.0 and slow.data["basis"] == "step_time"
    assert judge.stragglers(0) == []


def test_a_sigabrt_is_diagnosed_from_the_last_heartbeats() -> None:
    """A rank ended by SIGABRT: where its last heartbeat was and gloo's size mismatch hint;
    nothing without heartbeats or a stall watch."""
    clock = Clock()
    judge, _ = _hung_rank_1(clock)
    out = judge.abort_diagnosis(0, 1)
    assert out["diagnosis"].startswith("rank 1 ended by SIGABRT after collective #25")
    assert "Received data size" in out["diagnosis"]
    assert judge.abort_diagnosis(0, 7) == {}
    assert Judge(None, None).abort_diagnosis(0, 1) == {}
