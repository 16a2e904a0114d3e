"""The ranks of ``/api/state``: one rank as a row, its full and compact entries, the state
each shows, and the page of them a request asks for (docs/seeing-the-job.md has every key).

:class:`~eventbus.app.ui.state.JobState` copies each rank's summary
(:class:`~eventbus.app.ui.rank_book.Rank`) under its lock as one tuple (:data:`ROW`, a C
call per rank) and builds the snapshot from those rows with the lock released
(:mod:`eventbus.app.ui.snapshot`): this module is that build's rank part, on the reader's
thread. A job of more than :data:`COMPACT_ABOVE` ranks gets compact entries unless the
request selects ranks.
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Collection
from collections.abc import Sequence
from typing import Any

import attrs

__all__ = ["BY_RANK", "COMPACT_ABOVE", "COMPACT_KEYS", "LAST", "RANK_STATES", "ROW",
           "ROW_FIELDS", "SLOW_HOLD_S", "RankPage", "rank_compact", "rank_json", "rank_page",
           "select", "shown_states"]

#: what ``ranks[i]["state"]`` can be (docs/seeing-the-job.md); ``late``: it did not stop
#: within a drain's grace (its agent sent it the signal, then SIGKILL)
RANK_STATES = ("running", "stalled", "slow", "exited", "failed", "late")
#: a rank reported slow (``WORKER_SLOW``) shows as slow this long; the agent reports a
#: straggler again every 60 s while it stays one
SLOW_HOLD_S = 90.0

#: a job of more ranks than this gets compact rank entries in the default ``/api/state``
#: (and the page draws its ranks as a scrolled grid; docs/seeing-the-job.md)
COMPACT_ABOVE = 256

#: the fields of a rank the snapshot copies under the lock, as one tuple per rank (the
#: attributes of :class:`~eventbus.app.ui.rank_book.Rank`)
ROW_FIELDS = ("rank", "state", "step", "last", "starts", "attempt", "exit_code", "signal",
               "stopped", "drained", "message", "host", "pid", "epoch", "last_type",
               "slow_at", "slow_factor", "idle_s", "idle_at", "where", "doing")
ROW = operator.attrgetter(*ROW_FIELDS)
(_RANK, _STATE, _STEP, LAST, _STARTS, _ATTEMPT, _EXIT_CODE, _SIGNAL, _STOPPED, _DRAINED,
 _MESSAGE, _HOST, _PID, _EPOCH, _LAST_TYPE, _SLOW_AT, _SLOW_FACTOR, _IDLE_S, _IDLE_AT,
 _WHERE, _DOING) = range(len(ROW_FIELDS))
BY_RANK = operator.itemgetter(_RANK)
_IDLE_STATES = frozenset({"running", "slow", "stalled"})


def _since_beat(seconds: float | None, row: tuple[Any, ...], state: str,
                reference: float) -> float | None:
    """``seconds`` as its latest heartbeat said them, aged to ``reference``; None for a
    rank that no longer beats (exited, failed, late)."""
    idle_at = row[_IDLE_AT]
    if seconds is None or idle_at is None or state not in _IDLE_STATES:
        return None
    aged: float = seconds + max(0.0, reference - idle_at)
    return round(aged, 3)


def _doing(doing: tuple[str, float], row: tuple[Any, ...], state: str,
           reference: float) -> tuple[str, float] | None:
    """What the rank's latest heartbeat said it was doing (``doing``: the phrase and its
    seconds then), and for how long at ``reference``."""
    seconds = _since_beat(doing[1], row, state, reference)
    return None if seconds is None else (doing[0], seconds)


def _age(row: tuple[Any, ...], reference: float) -> float | None:
    last = row[LAST]
    return None if last is None else round(max(0.0, reference - last), 3)


def rank_json(row: tuple[Any, ...], state: str, reference: float) -> dict[str, Any]:
    """One rank as ``/api/state`` lists it in full (docs/seeing-the-job.md)."""
    doing = row[_DOING]
    if doing is not None:
        doing = _doing(doing, row, state, reference)
    return {
        "rank": row[_RANK],
        "state": state,
        "step": row[_STEP],
        "last_event_age_s": _age(row, reference),
        "restarts": max(0, row[_STARTS] - 1),
        "attempt": row[_ATTEMPT],
        "exit_code": row[_EXIT_CODE],
        "signal": row[_SIGNAL],
        "stopped_by_agent": row[_STOPPED],
        "drained": row[_DRAINED],
        "message": row[_MESSAGE],
        "host": row[_HOST],
        "pid": row[_PID],
        "epoch": row[_EPOCH],
        "last_type": row[_LAST_TYPE],
        "slow_factor": row[_SLOW_FACTOR],
        "idle_s": _since_beat(row[_IDLE_S], row, state, reference),
        "where": row[_WHERE],
        "doing": None if doing is None else doing[0],
        "doing_s": None if doing is None else doing[1],
    }


#: what a compact rank entry may hold beyond the contract's four keys (each only when it
#: differs from its default: 0, false or null; ``doing`` and ``doing_s`` together); the
#: rest (attempt, message, pid, last_type, where) are in the full entry (``?ranks=N``)
COMPACT_KEYS = ("restarts", "exit_code", "signal", "stopped_by_agent", "drained",
                "slow_factor", "epoch", "idle_s", "doing", "doing_s", "host")


def rank_compact(row: tuple[Any, ...], state: str, reference: float) -> dict[str, Any]:
    """One rank as ``/api/state`` lists it compact: what the page's grid draws."""
    out: dict[str, Any] = {"rank": row[_RANK], "state": state, "step": row[_STEP],
                           "last_event_age_s": _age(row, reference)}
    if row[_STARTS] > 1:
        out["restarts"] = row[_STARTS] - 1
    if row[_EXIT_CODE] is not None:
        out["exit_code"] = row[_EXIT_CODE]
    if row[_SIGNAL] is not None:
        out["signal"] = row[_SIGNAL]
    if row[_STOPPED]:
        out["stopped_by_agent"] = True
    if row[_DRAINED]:
        out["drained"] = True
    if row[_SLOW_FACTOR] is not None:
        out["slow_factor"] = row[_SLOW_FACTOR]
    if row[_EPOCH] is not None:
        out["epoch"] = row[_EPOCH]
    idle = _since_beat(row[_IDLE_S], row, state, reference)
    if idle is not None:
        out["idle_s"] = idle
    doing = row[_DOING]
    if doing is not None:
        doing = _doing(doing, row, state, reference)
        if doing is not None:
            out["doing"], out["doing_s"] = doing
    if row[_HOST] is not None:
        out["host"] = row[_HOST]
    return out


def select(rows: list[tuple[Any, ...]], shown: list[str],
            ranks: Sequence[tuple[int, int]] | None,
            states: Collection[str] | None) -> list[int]:
    """The indices (into ``rows``, sorted by rank) of the ranks in one of the inclusive
    ``ranks`` ranges and one of ``states`` (None: any), in rank order."""
    if ranks is None:
        picked: list[int] = list(range(len(rows)))
    else:
        numbers = [row[_RANK] for row in rows]
        found: set[int] = set()
        for first, last in ranks:
            if first <= last:
                found.update(range(bisect.bisect_left(numbers, first),
                                   bisect.bisect_right(numbers, last)))
        picked = sorted(found)
    if states is not None:
        wanted = frozenset(states)
        picked = [i for i in picked if shown[i] in wanted]
    return picked


def shown_states(rows: Sequence[tuple[Any, ...]], hold: float) -> list[str]:
    """The state each rank shows: its own, except that a straggler report older than
    ``hold`` (the job's time) shows as ``running`` again."""
    return [row[_STATE] if row[_STATE] != "slow" or row[_SLOW_AT] is None
            or row[_SLOW_AT] >= hold else "running" for row in rows]


@attrs.frozen
class RankPage:
    """The ranks one request gets: their entries, how many matched, the detail they have
    and where the next page starts (None: this was the last)."""

    entries: list[dict[str, Any]]
    matched: int
    detail: str
    next_offset: int | None


def rank_page(rows: list[tuple[Any, ...]], shown: list[str], reference: float, *,
              ranks: Sequence[tuple[int, int]] | None, states: Collection[str] | None,
              offset: int, limit: int | None, detail: str | None) -> RankPage:
    """The page of ``rows`` (sorted by rank; ``shown`` their states) that ``ranks``,
    ``states``, ``offset`` and ``limit`` ask for, as :meth:`JobState.snapshot
    <eventbus.app.ui.state.JobState.snapshot>` describes them; ages measured at
    ``reference``. ``detail`` None picks full for a selection or a job of at most
    :data:`COMPACT_ABOVE` ranks, compact otherwise."""
    selected = ranks is not None or states is not None or offset > 0 or limit is not None
    picked: Sequence[int] = (select(rows, shown, ranks, states) if selected
                             else range(len(rows)))
    matched = len(picked)
    start = max(0, offset)
    end = matched if limit is None else min(matched, start + max(0, limit))
    if detail is None:
        detail = "full" if selected or len(rows) <= COMPACT_ABOVE else "compact"
    build = rank_json if detail == "full" else rank_compact
    return RankPage([build(rows[i], shown[i], reference) for i in picked[start:end]],
                    matched, detail, end if end < matched else None)
