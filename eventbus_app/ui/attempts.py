"""The attempts of the job view's model: the job's timeline, one entry per attempt (its
start, end, outcome and the reason it began) with its marks: failures, stalls,
stragglers, the restart, a reactor's STOP, a drain and its end; and each restart's
anatomy, one per ``RECOVERED`` (its attempt, total and seconds per phase).

:class:`Timeline` is a part of :class:`~eventbus.app.ui.state.JobState`, written under its
lock only: the state dispatches ``WORKER_RESTART``, ``RENDEZVOUS`` and ``RECOVERED`` to it,
and the other parts mark their events on it. :func:`timeline_json` is ``/api/state``'s
``timeline``, :func:`recoveries_json` its ``recoveries``, built on the reader's thread from
:meth:`Timeline.rows` and :meth:`Timeline.recovery_rows`.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import Any

from eventbus.app.sentences import as_int
from eventbus.app.sentences import as_number
from eventbus.app.sentences import sentence
from eventbus.app.ui.record_event import as_str
from eventbus.app.ui.render import clip

__all__ = ["MAX_ATTEMPTS", "MAX_MARKS", "MAX_PHASES", "Attempt", "Recovery", "Timeline",
           "recoveries_json", "timeline_json"]

#: attempts kept on the timeline (the oldest go first)
MAX_ATTEMPTS = 200
#: marks kept per attempt (more are counted)
MAX_MARKS = 64
#: phases kept per recovery, and the longest phase name (a foreign record's others are
#: left out)
MAX_PHASES = 16
MAX_PHASE_NAME = 64

#: one restart's anatomy: (attempt, total_s or None, ((phase, seconds or None), ...)), the
#: phases in the event's order; immutable, so a snapshot copies the list only
Recovery = tuple[int, float | None, tuple[tuple[str, float | None], ...]]


class Attempt:
    """One attempt of the job: from its first event or its ``WORKER_RESTART`` to the next
    attempt or the job's end."""

    __slots__ = ("attempt", "end", "marks", "more", "outcome", "reason", "start", "stopped")

    def __init__(self, attempt: int, start: float, reason: str | None) -> None:
        self.attempt = attempt
        self.start = start
        self.end: float | None = None
        self.outcome = "running"
        self.reason = reason
        self.marks: list[dict[str, Any]] = []
        self.more = 0
        #: ranks the agent stopped after another's failure (one count, not a mark each)
        self.stopped = 0


class Timeline:
    """The last :data:`MAX_ATTEMPTS` attempts, each with :data:`MAX_MARKS` marks at most;
    written under the state's lock only."""

    def __init__(self) -> None:
        self.attempts: collections.OrderedDict[int, Attempt] = collections.OrderedDict()
        #: the latest attempt seen (``/api/state``'s ``attempt`` and ``restarts``)
        self.current = 0
        #: the last MAX_ATTEMPTS restarts' anatomies, oldest first (``RECOVERED``)
        self.recoveries: collections.deque[Recovery] = collections.deque(maxlen=MAX_ATTEMPTS)

    def attempt_of(self, ev: Any) -> int:
        """The attempt ``ev`` belongs to: its context's restart count, else the latest."""
        count = ev.restart_count
        return count if type(count) is int and count >= 0 else self.current

    def open(self, attempt: int, at: float, reason: str | None) -> Attempt:
        """Attempt ``attempt``, begun ``at`` (it ends the earlier ones still running)."""
        found = self.attempts.get(attempt)
        if found is not None:
            if reason and not found.reason:
                found.reason = reason
            return found
        for previous in self.attempts.values():
            if previous.end is None and previous.attempt < attempt:
                previous.end = at
                if previous.outcome == "running":
                    previous.outcome = "restarted"
        found = self.attempts[attempt] = Attempt(attempt, at, reason)
        while len(self.attempts) > MAX_ATTEMPTS:
            self.attempts.popitem(last=False)
        self.current = max(self.current, attempt)
        return found

    def _of(self, ev: Any, arrived: float, attempt: int | None = None) -> Attempt:
        number = self.attempt_of(ev) if attempt is None else attempt
        return self.attempts.get(number) or self.open(number, arrived, None)

    def mark(self, ev: Any, kind: str, arrived: float, rank: int | None, text: str,
             attempt: int | None = None) -> None:
        """Mark ``ev`` (said as ``text``) on its attempt, or on ``attempt``."""
        target = self._of(ev, arrived, attempt)
        if len(target.marks) < MAX_MARKS:
            target.marks.append({"t": ev.timestamp, "kind": kind, "rank": rank, "text": text})
        else:
            target.more += 1

    def collateral(self, ev: Any, arrived: float) -> None:
        """Count a rank the agent stopped after another's failure (no mark of its own)."""
        self._of(ev, arrived).stopped += 1

    def ended(self, ev: Any, arrived: float, outcome: str) -> None:
        """The job ended (its ``AGENT_EXIT``) with ``outcome``: so did ``ev``'s attempt."""
        attempt = self.attempts.get(self.attempt_of(ev))
        if attempt is not None:
            if attempt.end is None:
                attempt.end = arrived
            attempt.outcome = outcome

    def on_restart(self, ev: Any, name: str, arrived: float, seq: int) -> None:
        """``WORKER_RESTART``: the attempt before ends restarted, the new one opens; one
        mark per restart, however many nodes' agents report it."""
        attempt = as_int(getattr(ev, "attempt", None))
        if attempt is None:
            attempt = self.current + 1
        reason = as_str(getattr(ev, "reason", None))
        current = self.attempts.get(attempt - 1)
        if current is not None and current.end is None:
            current.end = arrived
            if current.outcome in ("running", "failed"):
                current.outcome = "restarted"
        self.open(attempt, arrived, reason)
        target = attempt - 1 if attempt - 1 in self.attempts else attempt
        if any(m["kind"] == "restart" for m in self.attempts[target].marks):
            return  # every node's agent reports the same restart: one mark
        self.mark(ev, "restart", arrived, None, sentence(ev), attempt=target)

    def on_rendezvous(self, ev: Any, name: str, arrived: float, seq: int) -> None:
        """``RENDEZVOUS``: a failed one is a failure mark."""
        if getattr(ev, "state", None) == "FAILED":
            self.mark(ev, "failure", arrived, None, sentence(ev))

    def on_recovered(self, ev: Any, name: str, arrived: float, seq: int) -> None:
        """``RECOVERED``: a restart's anatomy, its phases in their order (a phase that is
        not a finite number reads None: not seen)."""
        data = ev.data
        found = data.get("phases") if isinstance(data, Mapping) else None
        phases: list[tuple[str, float | None]] = []
        if isinstance(found, Mapping):
            for phase, value in found.items():
                if len(phases) >= MAX_PHASES:
                    break
                if isinstance(phase, str) and len(phase) <= MAX_PHASE_NAME:
                    phases.append((phase, as_number(value)))
        attempt = as_int(getattr(ev, "attempt", None))
        self.recoveries.append((self.attempt_of(ev) if attempt is None else attempt,
                                as_number(getattr(ev, "total_s", None)), tuple(phases)))

    def recovery_rows(self) -> list[Recovery]:
        """The recoveries, oldest first (under the state's lock)."""
        return list(self.recoveries)

    def rows(self) -> list[tuple[Any, ...]]:
        """The attempts as tuples, their marks copied (under the state's lock)."""
        return [(a.attempt, a.start, a.end, a.outcome, a.reason, list(a.marks), a.more,
                 a.stopped) for a in self.attempts.values()]


def timeline_json(rows: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
    """``/api/state``'s ``timeline`` from :meth:`Timeline.rows`."""
    return [{"attempt": a, "start": start, "end": end, "outcome": outcome,
             "reason": clip(reason, 500), "marks": marks, "more_marks": more,
             "stopped_by_agent": stopped}
            for a, start, end, outcome, reason, marks, more, stopped in rows]


def recoveries_json(rows: list[Recovery]) -> list[dict[str, Any]]:
    """``/api/state``'s ``recoveries`` from :meth:`Timeline.recovery_rows`."""
    return [{"attempt": attempt, "total_s": total, "phases": dict(phases)}
            for attempt, total, phases in rows]
