"""What each sender numbered, dropped and ended, against what arrived: the accounting of a
:class:`~eventbus.publishers.store_receiver.StoreReceiver` (:class:`SenderBook`).

A sender (one worker's forwarder, one node's agent) numbers every event it records and
counts every one it drops; its pushes carry the numbers and the counts so far. The book
keeps, per sender, the number expected next, the drops already reported, what was
delivered and whether its end marker arrived, and turns every difference into an
``EVENTS_LOST`` event on the bus: a gap in the numbers, a duplicate, a sender's drop, an
event rejected as malformed (aggregated, at most one report per ``report_interval``), and,
after a sender died, what its exit ledger or its record counter says it numbered and never
sent (:meth:`SenderBook.settle`, :meth:`SenderBook.settle_count`).

It talks to no store and decodes nothing: the receiver feeds it each decoded batch's
numbers. It takes no lock of its own; the receiver calls it under its own.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import attrs

from eventbus._reporting import RateLimiter
from eventbus.bus import Bus
from eventbus.events import EventsLost
from eventbus.exit_ledger import ExitLedger
from eventbus.exit_ledger import RecordCount
from eventbus.wire import WireError

__all__ = ["Sender", "SenderBook"]

logger = logging.getLogger("eventbus")


@attrs.define
class Sender:
    """One sender's account: its queue, the number expected next, the drops reported so
    far (by reason), whether its end marker arrived, the events delivered."""

    key: str
    expected: int = 0
    dropped: dict[str, int] = attrs.field(factory=dict)
    ended: bool = False
    delivered: int = 0


class SenderBook:
    """The accounts of every sender one receiver heard (see the module docstring).
    ``max_senders``: more senders than this are refused (their batches rejected)."""

    def __init__(self, bus: Bus, *, max_senders: int = 100_000,
                 report_interval: float = 1.0) -> None:
        self.bus = bus
        self.max_senders = max_senders
        self.report_interval = report_interval
        self.senders: dict[str, Sender] = {}
        #: events lost (gaps, duplicates, drops, left in the store...), per kind of reason
        self.lost: dict[str, int] = {}
        #: events (or values) rejected as malformed, per reason
        self.rejected: dict[str, int] = {}
        self._pending_rejects: dict[tuple[str, str], int] = {}
        self._reject_reports = RateLimiter()

    def arrived(self, sender: str, key: str, first: int, n: int,
                dropped: Mapping[str, int]) -> tuple[Sender, int]:
        """A batch of ``n`` events numbered from ``first`` came from ``sender`` through
        ``key``, with the sender's drop counts so far: a gap, the duplicates and the new
        drops are reported. Returns the sender's account and how many of the batch's first
        events arrived before (to skip). Raises ``WireError`` for a sender over
        ``max_senders``."""
        state = self.senders.get(sender)
        if state is None:
            if len(self.senders) >= self.max_senders:
                raise WireError("too many senders", max(n, 1))
            state = self.senders[sender] = Sender(key)
        skip = 0
        if first > state.expected:
            self.lose(sender, key, first - state.expected, "gap",
                      {"expected_seq": state.expected, "got_seq": first})
            state.expected = first
        elif first < state.expected:
            skip = min(n, state.expected - first)
            if skip:
                self.lose(sender, key, skip, "duplicate",
                          {"expected_seq": state.expected, "got_seq": first})
        state.expected = max(state.expected, first + n)
        self._new_drops(state, sender, key, dropped, {})
        return state, skip

    def _new_drops(self, state: Sender, sender: str, key: str, dropped: Mapping[str, int],
                   extra: Mapping[str, Any]) -> int:
        reported = 0
        for reason, count in sorted(dropped.items()):
            delta = count - state.dropped.get(reason, 0)
            if delta > 0:
                state.dropped[reason] = count
                self.lose(sender, key, delta, f"dropped by sender: {reason}", extra)
                reported += delta
        return reported

    def lose(self, sender: str, key: str, count: int, reason: str,
             extra: Mapping[str, Any]) -> None:
        """``count`` events of ``sender`` lost for ``reason``: counted, logged, published."""
        kind = reason.split(":", 1)[0]
        self.lost[kind] = self.lost.get(kind, 0) + count
        logger.warning("store receiver: %s: %d events %s", sender, count, reason)
        self.bus.publish(EventsLost(source=sender, count=count, reason=reason,
                                    data={"queue": key, **extra}))

    def reject(self, key: str, reason: str, count: int) -> None:
        """``count`` events (or values) from ``key`` rejected: counted now, reported by
        :meth:`flush_rejects`."""
        self.rejected[reason] = self.rejected.get(reason, 0) + count
        self._pending_rejects[(key, reason)] = self._pending_rejects.get((key, reason), 0) + count

    def flush_rejects(self, *, force: bool = False) -> None:
        """Report the rejects so far, aggregated per queue and reason, at most once per
        ``report_interval`` (garbage can arrive fast) unless ``force``."""
        if not self._pending_rejects:
            return
        if self._reject_reports.allow(self.report_interval, force=force) is None:
            return
        pending, self._pending_rejects = self._pending_rejects, {}
        for (key, reason), count in sorted(pending.items()):
            logger.warning("store receiver: rejected %d events from %s: %s", count, key, reason)
            self.bus.publish(EventsLost(source=key, count=count, reason=f"rejected: {reason}",
                                        data={"queue": key}))

    def _account(self, sender: str, key: str) -> Sender:
        state = self.senders.get(sender)
        if state is None:
            state = self.senders[sender] = Sender(key)
        return state

    def settle(self, ledger: ExitLedger, *, why: str) -> int:
        """Report what ``ledger``'s sender numbered or dropped that never arrived.

        For a sender whose end marker did not arrive: ``numbered`` less the next number
        expected (below it, every event was delivered or already reported) becomes one
        ``EVENTS_LOST`` ("not delivered: ``why``"), and each drop count above what its
        pushes carried one "dropped by sender"; the sender is then settled, so a second
        call reports nothing. Returns the events reported. A sender whose end marker
        arrived has told everything already: 0.
        """
        state = self._account(ledger.sender, ledger.key)
        if state.ended:
            return 0
        reported = 0
        missing = ledger.numbered - state.expected
        if missing > 0:
            self.lose(ledger.sender, ledger.key, missing, f"not delivered: {why}",
                      {"numbered": ledger.numbered, "next_seq": state.expected,
                       "from": "exit ledger"})
            state.expected = ledger.numbered
            reported += missing
        return reported + self._new_drops(state, ledger.sender, ledger.key, ledger.dropped,
                                          {"from": "exit ledger"})

    def settle_count(self, count: RecordCount, *, why: str) -> int:
        """Report what ``count``'s sender recorded that never arrived, from its record
        counter (:func:`eventbus.exit_ledger.read_counters`), read after the sender died.

        Every event the sender recorded got a number (delivered, or reported as a gap) or
        was counted as dropped (reported from its pushes or its exit ledger), or was still
        in its queue when it died. For a sender whose end marker did not arrive, the last
        kind is the count less the next number expected less the drops reported: one
        ``EVENTS_LOST`` ("not delivered: ``why``"). Call it after :meth:`settle` with the
        sender's exit ledger, if any. The sender is then settled: a second call reports
        nothing. Returns the events reported.
        """
        state = self._account(count.sender, count.key)
        if state.ended:
            return 0
        dropped = sum(state.dropped.values())
        missing = count.recorded - state.expected - dropped
        if missing <= 0:
            return 0
        self.lose(count.sender, count.key, missing, f"not delivered: {why}",
                  {"recorded": count.recorded, "next_seq": state.expected,
                   "dropped": dropped, "from": "record counter"})
        state.expected += missing
        return missing

    def unended(self) -> list[str]:
        """Senders seen without their end marker (killed, or still running)."""
        return [s for s, st in self.senders.items() if not st.ended]

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per sender: its queue, the number expected next, ended, delivered, drops."""
        return {s: {"key": st.key, "next_seq": st.expected, "ended": st.ended,
                    "delivered": st.delivered, "dropped": dict(st.dropped)}
                for s, st in self.senders.items()}
