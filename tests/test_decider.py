"""The decider (eventbus_app/launcher/decisions/decider.py) without torch or processes: reactors'
answers, the restart budget, STOP here and on another node, and how the job ends, each
with its cause as a field."""

from __future__ import annotations

import logging
from typing import Any

import pytest

import eventbus
from eventbus import Cause
from eventbus import Decision
from eventbus.app.launcher.decisions.decider import Decider


def _decider(*, max_restarts: int = 2, remote: list[str | None] | None = None) -> Decider:
    remote = remote if remote is not None else [None]
    return Decider(eventbus.Bus("decider-test"), max_restarts=max_restarts, stop_exit_code=7,
                   remote_stop=lambda: remote[0])


def _failure(rank: int = 1, code: int = 3, **kwargs: Any) -> eventbus.WorkerExit:
    return eventbus.WorkerExit(worker_id=rank, exit_code=code, data={"attempt": 0}, **kwargs)


def _stall(rank: int = 1) -> eventbus.WorkerStalled:
    return eventbus.WorkerStalled(worker_id=rank, silent_s=6.0, timeout_s=5.0,
                                  data={"attempt": 0})


def test_no_answer_restarts_while_restarts_are_left() -> None:
    """No reactor: torchrun's policy, a restart with one restart fewer, cause failure."""
    decider = _decider()
    outcome = decider.decide([_failure()], restarts_left=2, next_attempt=1)
    assert outcome.action == "restart" and outcome.cause == Cause.FAILURE
    assert outcome.line == ("rank 1 failed (exit code 3); restarting the group as attempt 1 "
                            "(1 restart left)")
    reason, cause, decided = decider.next_restart()
    assert (cause, decided) == ("failure", True) and reason.startswith("rank 1 failed")
    # consumed: the next restart with no failure is a membership change
    assert decider.next_restart()[1:] == ("membership", False)


def test_no_restart_left_fails_the_job_with_the_failures_cause() -> None:
    """With no restart left the outcome is "fail"; AGENT_EXIT ends FAILED with exit 1 and
    the failure's sentence and cause (a stall's cause is stall)."""
    decider = _decider()
    outcome = decider.decide([_stall()], restarts_left=0, next_attempt=3)
    assert outcome.action == "fail" and outcome.cause == Cause.STALL
    assert "no restart is left (--max-restarts 2): the job fails" in outcome.line
    ending = decider.ending(succeeded=False)
    assert (ending.state, ending.exit_code, ending.cause) == ("FAILED", 1, "stall")
    assert ending.reason is not None and ending.reason.startswith("rank 1 stalled")


def test_a_reactor_stop_stops_with_restarts_left_and_says_so_as_a_field() -> None:
    """STOP from a reactor: outcome "stop" (announced to other nodes), the stop exit code,
    AGENT_EXIT's cause "stop" and its reason naming the reactor."""
    decider = _decider()

    def stop_all(event: eventbus.Event) -> Decision:
        return Decision.STOP

    decider.add_reactor(stop_all)
    outcome = decider.decide([_failure()], restarts_left=2, next_attempt=1)
    assert outcome.action == "stop" and outcome.cause == Cause.STOP and outcome.announce
    assert outcome.stop_by == (f"{__name__}.test_a_reactor_stop_stops_with_restarts_left_and_"
                               "says_so_as_a_field.<locals>.stop_all",)
    assert decider.stopped
    ending = decider.ending(succeeded=False)
    assert (ending.exit_code, ending.cause) == (7, "stop")
    assert ending.reason is not None and "; STOP from " in ending.reason


def test_restart_answer_names_its_reactor_in_the_restart_reason() -> None:
    """RESTART is taken while restarts are left; the WORKER_RESTART reason names it."""
    decider = _decider()
    decider.add_reactor(lambda event: Decision.RESTART)
    outcome = decider.decide([_failure()], restarts_left=1, next_attempt=2)
    assert outcome.action == "restart" and len(outcome.restart_by) == 1
    assert "RESTART from" in decider.next_restart()[0]


def test_another_nodes_stop_is_a_remote_stop_cause() -> None:
    """A STOP announced by another node turns this node's decision into a STOP whose cause
    is remote_stop (and it is not announced again); the ending says so."""
    remote: list[str | None] = [None]
    decider = _decider(remote=remote)
    remote[0] = "rank 3 failed; STOP from x"
    assert decider.stop_for_remote() is not None
    assert decider.stop_for_remote() is None  # the console line once
    outcome = decider.decide([_failure()], restarts_left=2, next_attempt=1)
    assert outcome.action == "stop" and not outcome.announce
    ending = decider.ending(succeeded=False)
    assert (ending.exit_code, ending.cause) == (7, "remote_stop")


def test_an_agent_that_raised_ends_with_cause_error_unless_stopped() -> None:
    """The agent raised: cause error and the exception in the reason; after a STOP the
    STOP's reason and cause survive what torch raised on the way out."""
    decider = _decider()
    ending = decider.ending(succeeded=None, error=RuntimeError("rendezvous closed"))
    assert (ending.cause, ending.reason) == ("error", "RuntimeError: rendezvous closed")
    decider.add_reactor(lambda event: Decision.STOP)
    decider.decide([_failure()], restarts_left=2, next_attempt=1)
    ending = decider.ending(succeeded=None, error=RuntimeError("closed"))
    assert ending.cause == "stop" and ending.reason is not None
    assert ending.reason.endswith("(then the agent raised RuntimeError: closed)")


def test_success_has_no_cause() -> None:
    """A job that succeeded ends with exit 0, no reason and no cause."""
    ending = _decider().ending(succeeded=True, state="SUCCEEDED")
    assert (ending.state, ending.exit_code, ending.reason, ending.cause) == (
        "SUCCEEDED", 0, None, None)


def test_reactors_see_only_the_deciders_failures(caplog: pytest.LogCaptureFixture) -> None:
    """A failure published on the bus by someone else (a worker's own WORKER_EXIT relayed,
    say) consults no reactor: only what the decider publishes is decided on."""
    decider = _decider()
    seen: list[eventbus.Event] = []
    decider.add_reactor(seen.append)
    decider.bus.publish(_failure())
    assert seen == []
    decider.decide([_failure(rank=2)], restarts_left=1, next_attempt=1)
    assert [e.worker_id for e in seen] == [2]  # type: ignore[attr-defined]


def test_a_raising_reactor_counts_as_no_decision(caplog: pytest.LogCaptureFixture) -> None:
    """A reactor that raises is logged with its traceback and counted; the others decide."""
    decider = _decider()

    def broken(event: eventbus.Event) -> Decision:
        raise ValueError("bug")

    decider.add_reactor(broken)
    decider.add_reactor(lambda event: Decision.STOP)
    with caplog.at_level(logging.ERROR, logger="eventbus"):
        outcome = decider.decide([_failure()], restarts_left=2, next_attempt=1)
    assert outcome.action == "stop" and decider.reactor_errors == 1
    assert any(r.exc_info for r in caplog.records if "raised" in r.getMessage())


def test_close_unsubscribes_every_reactor() -> None:
    """After close() no reactor is consulted."""
    decider = _decider()
    calls: list[object] = []
    decider.add_reactor(calls.append)
    decider.close()
    decider.decide([_failure()], restarts_left=1, next_attempt=1)
    assert calls == []
