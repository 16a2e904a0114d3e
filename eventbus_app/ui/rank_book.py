"""The ranks of the job view's model: one summary per rank (state, step, last event,
restarts seen, exit, heartbeat), folded from the workers' events.

:class:`RankBook` is a part of :class:`~eventbus.app.ui.state.JobState`, written under its
lock only. The state dispatches a worker's own events to its handlers (``METRIC`` and the
other events of the script, ``EPOCH_*``, the ``WORKER_PROGRESS`` heartbeats,
``WORKER_START``: the hot path); the job-wide handlers (:mod:`eventbus.app.ui.job`) note
exits, stalls, straggler reports and a drain's late ranks on it. A snapshot copies each
summary as one row (:data:`eventbus.app.ui.ranks.ROW`), which :mod:`eventbus.app.ui.ranks`
turns into ``/api/state``'s rank entries.

A heartbeat of a silent rank says what its main thread is doing (``data["activity"]``,
read by :func:`eventbus.app.health.evidence.doing_of`, the judge's reading too): the rank's
``doing``, kept until a heartbeat that is not idle, a step, its exit or its next attempt.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from collections.abc import Iterable
from typing import Any

from eventbus.app.health.evidence import doing_of
from eventbus.app.protocol.agent_worker import ACTIVITY_KEY
from eventbus.app.sentences import as_int
from eventbus.app.sentences import as_number
from eventbus.app.sentences import first_line
from eventbus.app.ui.ranks import ROW
from eventbus.app.ui.record_event import RecordEvent
from eventbus.app.ui.record_event import as_str

__all__ = ["Rank", "RankBook"]

_finite = math.isfinite


class Rank:
    """One rank's summary; written under the state's lock only."""

    __slots__ = ("attempt", "doing", "drained", "epoch", "exit_code", "host", "idle_at",
                 "idle_s", "last", "last_type", "message", "pid", "progress", "rank",
                 "signal", "slow_at", "slow_factor", "starts", "state", "step", "stopped",
                 "where")

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.state = "running"
        self.step: int | None = None
        #: when its last event arrived (the state's clock)
        self.last: float | None = None
        self.last_type: str | None = None
        self.starts = 0
        self.attempt: int | None = None
        self.exit_code: int | None = None
        self.signal: str | None = None
        self.message: str | None = None
        self.stopped = False
        #: it stopped by itself during a drain (exit code 0)
        self.drained = False
        self.host: str | None = None
        self.pid: int | None = None
        self.epoch: int | None = None
        self.slow_at: float | None = None
        self.slow_factor: float | None = None
        self.idle_s: float | None = None
        self.idle_at: float | None = None
        self.where: str | None = None
        #: what its latest heartbeat says a silent rank is doing, and for how long then
        #: (eventbus.app.health.evidence.doing_of; aged from idle_at like idle_s): None once it
        #: progresses, steps, exits or restarts
        self.doing: tuple[str, float] | None = None
        #: (step, collectives) of its latest progress heartbeat
        self.progress: tuple[object, object] | None = None


class RankBook:
    """Every rank's summary, :attr:`max_ranks` at most (beyond: counted in
    :attr:`refused`). ``attempt_of``: the attempt an event belongs to (the timeline's);
    ``note``: called with a rank's first event, and its first heartbeat, for the job's
    identity (run id, world size)."""

    def __init__(self, *, max_ranks: int, attempt_of: Callable[[Any], int],
                 note: Callable[[Any], None]) -> None:
        self.ranks: dict[int, Rank] = {}
        self.max_ranks = max_ranks
        #: events naming a rank beyond max_ranks (or below 0): counted only
        self.refused = 0
        self._attempt_of = attempt_of
        self._note = note

    def get(self, rank: int) -> Rank | None:
        """Rank ``rank``'s summary, made when it is new; None when refused."""
        found = self.ranks.get(rank)
        if found is None:
            if len(self.ranks) >= self.max_ranks or rank < 0:
                self.refused += 1
                return None
            found = self.ranks[rank] = Rank(rank)
        return found

    def _touch(self, name: str, arrived: float, rank: int | None) -> Rank | None:
        if rank is None:
            return None
        r = self.get(rank)
        if r is not None:
            r.last = arrived
            r.last_type = name
        return r

    def rows(self) -> list[tuple[Any, ...]]:
        """Every summary as one tuple (:data:`~eventbus.app.ui.ranks.ROW`: one C call per
        rank, no copy of its object), under the state's lock."""
        return list(map(ROW, self.ranks.values()))

    # -- the handlers the state dispatches to -----------------------------------------------
    def on_other(self, ev: Any, name: str, arrived: float, seq: int) -> None:
        """A worker's own event: it is alive; a step, if it says one (the hot path:
        ``METRIC``)."""
        rank = ev.rank
        if rank is None:
            return
        r = self.ranks.get(rank)
        if r is None:
            r = self.get(rank)
            if r is None:
                return
            r.host = ev.hostname or None
            r.pid = ev.pid
            self._note(ev)
        r.last = arrived
        r.last_type = name
        if r.state == "stalled":
            r.state = "running"
        step = getattr(ev, "step", None)
        if step.__class__ is int:
            r.step = step
            r.doing = None  # it stepped: whatever its last heartbeat saw is over

    def on_epoch(self, ev: Any, name: str, arrived: float, seq: int) -> None:
        """``EPOCH_START``/``EPOCH_END``: a worker's event that also says its epoch."""
        self.on_other(ev, name, arrived, seq)
        r = self.ranks.get(ev.rank) if ev.rank is not None else None
        if r is not None:
            r.epoch = as_int(getattr(ev, "epoch", None))

    def on_start(self, ev: Any, name: str, arrived: float, seq: int) -> None:
        """``WORKER_START``: the rank begins an attempt, with none of the last one's
        facts."""
        r = self._touch(name, arrived, as_int(getattr(ev, "worker_id", None)))
        if r is None:
            return
        r.state = "running"
        r.starts += 1
        r.attempt = self._attempt_of(ev)
        r.exit_code = r.signal = r.message = None
        r.stopped = r.drained = False
        r.step = r.epoch = r.slow_at = r.slow_factor = None
        r.idle_s = r.idle_at = None
        r.where = r.doing = None
        r.progress = None
        r.pid = as_int(getattr(ev, "worker_pid", None))
        r.host = ev.hostname or None

    def on_progress(self, ev: Any, name: str, arrived: float, seq: int) -> None:
        """``WORKER_PROGRESS``: the heartbeat, every rank's, every second (8,192 a second
        at 1,024 nodes x 8), so its fields are read once each, a file's record straight
        from its mapping."""
        if ev.__class__ is RecordEvent:
            fields = ev._record.fields
            worker, step, collectives, idle = (fields.get("worker_id"), fields.get("step"),
                                               fields.get("collectives"), fields.get("idle_s"))
        else:
            worker = getattr(ev, "worker_id", None)
            step = getattr(ev, "step", None)
            collectives = getattr(ev, "collectives", None)
            idle = getattr(ev, "idle_s", None)
        rank = worker if worker.__class__ is int else ev.rank
        r = self.ranks.get(rank)
        if r is None:
            if rank is None:
                return
            r = self.get(rank)
            if r is None:
                return
        r.last = arrived
        r.last_type = name
        if step.__class__ is not int:
            step = None
        key = (step, collectives)
        if r.state == "stalled" and r.progress is not None and key != r.progress:
            r.state = "running"  # it moved again
        r.progress = key
        if step is not None:
            r.step = step
        if idle.__class__ is not float or not _finite(idle):
            idle = as_number(idle)
        r.idle_s = idle
        r.idle_at = arrived
        data = ev.data
        if isinstance(data, dict):  # a typed event's is a dict subclass (eventbus.snapshot)
            where = data.get("where")
            if where.__class__ is str:
                r.where = where[:200]
            # only an idle beat carries the evidence (a few microseconds to read): the
            # others, most beats, skip the call; None clears what the last beat said
            doing = doing_of(data, idle_s=idle) if ACTIVITY_KEY in data else None
            r.doing = None if doing is None else (doing[0][:200], doing[1])
        else:
            r.doing = None
        if r.host is None:
            r.host = ev.hostname or None
            self._note(ev)

    # -- what the job-wide handlers note on a rank -------------------------------------------
    def exited(self, ev: Any, name: str, arrived: float, rank: int | None, *,
               code: int | None, stopped: bool, drained: bool, late: bool) -> None:
        """``WORKER_EXIT`` of ``rank`` with exit code ``code``: ``stopped`` by the agent,
        ``drained`` (it ended by itself during a drain), ``late`` (it did not stop within
        a drain's grace)."""
        r = self._touch(name, arrived, rank)
        if r is None:
            return
        data = ev.data if isinstance(ev.data, dict) else {}
        # a rank the agent stopped because it stalled stays "stalled" until it restarts
        if late:
            r.state = "late"
        elif not (stopped and data.get("stalled") is True and r.state == "stalled"):
            r.state = "exited" if code == 0 else "failed"
        r.exit_code, r.signal, r.stopped = code, as_str(getattr(ev, "signal", None)), stopped
        r.drained = drained and code == 0
        r.message = first_line(as_str(getattr(ev, "message", None))) or None
        r.doing = None

    def stalled(self, name: str, arrived: float, rank: int | None) -> None:
        """``WORKER_STALLED`` of ``rank``: stalled until it moves again or restarts."""
        r = self._touch(name, arrived, rank)
        if r is not None:
            r.state = "stalled"
            r.progress = None

    def slow(self, ev: Any, name: str, arrived: float, rank: int | None,
             factor: float | None) -> None:
        """``WORKER_SLOW`` of ``rank``, ``factor`` times slower than its peers."""
        r = self._touch(name, arrived, rank)
        if r is not None:
            if r.state == "running":
                r.state = "slow"
            r.slow_at, r.slow_factor = arrived, factor
            step = as_int(getattr(ev, "step", None))
            if step is not None:
                r.step = step

    def late(self, ranks: Iterable[int]) -> None:
        """A drain's ranks that did not stop in time (an agent's ``AGENT_EXIT`` names
        them): late, unless they exited by themselves."""
        for rank in ranks:
            r = self.ranks.get(rank)
            if r is not None and r.state not in ("exited", "late"):
                r.state = "late"
