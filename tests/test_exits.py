"""The exit-order bookkeeping (eventbus_app/launcher/group/exits.py) without processes: who failed
first by the error files' times, the grace for a worker still exiting, and which late
failures were only stopped because of another."""

from __future__ import annotations

import signal

from eventbus.app.launcher.group.exits import ExitBook
from eventbus.app.launcher.group.exits import Proc


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


#: error file -> when it was written (ns), as the book reads it
WRITTEN = {"a": 10, "b": 20, "c": 30}


def _book(clock: Clock | None = None) -> ExitBook:
    return ExitBook(grace_s=12.0, clock=clock or Clock(),
                    error_time=lambda path: WRITTEN.get(path) if isinstance(path, str) else None)


def test_an_exit_is_reported_once() -> None:
    """report() says True the first time only; decided() reports it too."""
    book = _book()
    assert book.report(0, 1) and not book.report(0, 1)
    assert not book.reported(0, 2)
    book.decided(0, 2, "b")
    assert book.reported(0, 2) and not book.report(0, 2)
    assert not book.reported(1, 1)  # per attempt


def test_a_worker_that_failed_first_and_is_still_exiting_is_waited_for() -> None:
    """A live worker whose error file is older than every failure seen: "wait" within the
    grace (set once per attempt), then "look again"; none such: "go"."""
    clock = Clock()
    book = _book(clock)
    found = [Proc(1, 1, "b")]
    dying = [Proc(0, None, "a"), Proc(1, 1, "b")]
    assert book.wait_for_dying(0, found, dying) == "wait"
    clock.now += 11.9
    assert book.wait_for_dying(0, found, dying) == "wait"
    clock.now += 0.2
    assert book.wait_for_dying(0, found, dying) == "look again"
    # a younger error file, an exited worker, or a failure without error file: go
    assert book.wait_for_dying(1, found, [Proc(0, None, "c")]) == "go"
    assert book.wait_for_dying(1, found, [Proc(0, 1, "a")]) == "go"
    assert book.wait_for_dying(1, [Proc(1, -9, None)], dying) == "go"
    assert book.wait_for_dying(1, [], dying) == "go"


def test_the_grace_starts_afresh_with_a_new_attempt() -> None:
    """new_attempt() forgets the grace: a later failure gets its own."""
    clock = Clock()
    book = _book(clock)
    found, dying = [Proc(1, 1, "b")], [Proc(0, None, "a")]
    book.wait_for_dying(0, found, dying)
    clock.now += 20
    assert book.wait_for_dying(0, found, dying) == "look again"
    book.new_attempt()
    assert book.wait_for_dying(0, found, dying) == "wait"


def test_failures_are_ordered_by_their_error_files() -> None:
    """The failure order follows the error files' times; one without goes last, stably."""
    book = _book()
    assert book.in_failure_order(["c", None, "a", "b"]) == [2, 3, 0, 1]


def test_late_failures_stopped_because_of_another_are_told_apart() -> None:
    """Torch's result mixes the worker that failed with those it stopped (SIGTERM): the
    SIGTERMed are "stopped by the agent", the other is its own failure; after a decision
    in the same tick every late one is stopped, except a worker whose error file predates
    the first failure decided on (it failed first)."""
    book = _book()
    sigterm = -int(signal.SIGTERM)
    unseen = [Proc(0, sigterm, None), Proc(1, 3, "b")]
    assert book.stopped_by_agent(0, unseen, decided_this_tick=False) == {0: True, 1: False}
    book.decided(0, 2, "b")
    late = [Proc(0, 1, "a"), Proc(1, sigterm, None), Proc(3, 1, "c")]
    assert book.stopped_by_agent(0, late, decided_this_tick=True) == {
        0: False, 1: True, 3: True}
