"""The store receiver's accounting (publishers/sender_book.py), fed numbers by hand: no store,
no wire. Every difference between what a sender numbered or dropped and what arrived is one
EVENTS_LOST on the bus, reported once."""

from __future__ import annotations

from typing import Any

import pytest

from eventbus.bus import Bus
from eventbus.events import EventType
from eventbus.exit_ledger import ExitLedger
from eventbus.exit_ledger import RecordCount
from eventbus.publishers.sender_book import SenderBook
from eventbus.wire import WireError


@pytest.fixture
def lost() -> tuple[SenderBook, list[Any]]:
    bus = Bus()
    seen: list[Any] = []
    bus.subscribe(EventType.EVENTS_LOST, on_event=seen.append)
    return SenderBook(bus, max_senders=2, report_interval=0.0), seen


def test_gaps_duplicates_and_new_drops_are_reported_once(
        lost: tuple[SenderBook, list[Any]]) -> None:
    book, seen = lost
    state, skip = book.arrived("w0", "q0", 0, 5, {})
    assert (skip, state.expected, seen) == (0, 5, [])
    _, skip = book.arrived("w0", "q0", 8, 2, {"queue full": 3})  # 5-7 never came
    assert skip == 0
    assert [(e.reason, e.count) for e in seen] == [("gap", 3),
                                                   ("dropped by sender: queue full", 3)]
    _, skip = book.arrived("w0", "q0", 9, 3, {"queue full": 3})  # 9 came already
    assert skip == 1 and seen[-1].reason == "duplicate" and seen[-1].count == 1
    assert book.senders["w0"].expected == 12
    assert book.lost == {"gap": 3, "dropped by sender": 3, "duplicate": 1}


def test_a_sender_over_the_limit_is_refused(lost: tuple[SenderBook, list[Any]]) -> None:
    book, _ = lost
    book.arrived("a", "q", 0, 1, {})
    book.arrived("b", "q", 0, 1, {})
    with pytest.raises(WireError, match="too many senders"):
        book.arrived("c", "q", 0, 4, {})


def test_a_dead_senders_ledger_and_counter_settle_what_never_came(
        lost: tuple[SenderBook, list[Any]]) -> None:
    book, seen = lost
    book.arrived("w1", "q1", 0, 10, {})
    ledger = ExitLedger(sender="w1", key="q1", numbered=14, dropped={"closed": 2})
    assert book.settle(ledger, why="the worker died") == 6
    assert [(e.reason, e.count) for e in seen] == [
        ("not delivered: the worker died", 4), ("dropped by sender: closed", 2)]
    assert book.settle(ledger, why="again") == 0  # settled: nothing twice
    # its record counter says 20 were recorded: 14 numbered + 2 dropped + 4 still queued
    assert book.settle_count(RecordCount(sender="w1", key="q1", pid=1, recorded=20),
                             why="the worker died") == 4
    assert book.unended() == ["w1"]
    book.senders["w1"].ended = True
    assert book.settle(ExitLedger(sender="w1", key="q1", numbered=99, dropped={}),
                       why="x") == 0


def test_rejects_are_counted_at_once_and_reported_aggregated(
        lost: tuple[SenderBook, list[Any]]) -> None:
    book, seen = lost
    for _ in range(3):
        book.reject("q2", "bad json", 1)
    assert book.rejected == {"bad json": 3} and not seen
    book.flush_rejects()
    assert [(e.reason, e.count, e.source) for e in seen] == [("rejected: bad json", 3, "q2")]
    book.flush_rejects(force=True)
    assert len(seen) == 1
