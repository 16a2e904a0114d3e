"""``/api/state`` from the job view's model (docs/seeing-the-job.md has every key): what a
snapshot copies of :class:`~eventbus.app.ui.state.JobState` under its lock
(:class:`Copied`), and the JSON built from that copy with the lock released, on the
reader's thread (:func:`state_json`).

The parts build their own keys: the ranks' entries :mod:`eventbus.app.ui.ranks`, the
timeline :func:`~eventbus.app.ui.attempts.timeline_json` and the restarts' anatomies
:func:`~eventbus.app.ui.attempts.recoveries_json`, the drain
:meth:`~eventbus.app.ui.drain.Drain.to_json`, the problem and the recent events
:mod:`eventbus.app.ui.render`, the goodput figure :mod:`eventbus.app.ui.goodput`.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from collections.abc import Collection
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

from eventbus.app.sentences import as_int
from eventbus.app.sentences import cause_of
from eventbus.app.ui.attempts import Recovery
from eventbus.app.ui.attempts import recoveries_json
from eventbus.app.ui.attempts import timeline_json
from eventbus.app.ui.drain import Drain
from eventbus.app.ui.ranks import BY_RANK
from eventbus.app.ui.ranks import LAST
from eventbus.app.ui.ranks import RANK_STATES
from eventbus.app.ui.ranks import SLOW_HOLD_S
from eventbus.app.ui.ranks import rank_page
from eventbus.app.ui.ranks import shown_states
from eventbus.app.ui.record_event import as_str
from eventbus.app.ui.render import clip
from eventbus.app.ui.render import problem_json

__all__ = ["Copied", "state_json"]


class Copied(NamedTuple):
    """What a snapshot reads of the state, copied under its lock: the ranks as rows
    (:meth:`~eventbus.app.ui.rank_book.RankBook.rows`), the attempts as rows
    (:meth:`~eventbus.app.ui.attempts.Timeline.rows`), the restarts' anatomies
    (:meth:`~eventbus.app.ui.attempts.Timeline.recovery_rows`), a copy of the drain, and
    the job-wide facts and counts as they were."""

    rows: list[tuple[Any, ...]]
    attempts: list[tuple[Any, ...]]
    attempt: int
    status: str
    exit: Any
    problem: tuple[int, str, Any] | None
    drain: Drain | None
    first_at: float | None
    started_at: float | None
    ended_at: float | None
    #: the latest arrival: a straggler report is held SLOW_HOLD_S of the job's time
    last_at: float
    run_id: str | None
    world_size: int | None
    max_restarts: int | None
    types: dict[str, int]
    lost: dict[tuple[str, str], int]
    seq: int
    version: int
    refused: int
    unreadable: int
    overflowed: int
    fold_failed: int
    recoveries: list[Recovery]


def state_json(c: Copied, *, now: float, live: bool, source: str,
               goodput: dict[str, Any] | None,
               counters: Callable[[], Mapping[str, Any]] | None,
               ranks: Sequence[tuple[int, int]] | None, states: Collection[str] | None,
               offset: int, limit: int | None, detail: str | None) -> dict[str, Any]:
    """``/api/state`` (without ``recent``) from ``c``, at the state's clock's ``now``;
    ``live``: the state is timed by arrivals (else a file's own timestamps); ``goodput``:
    the figure; ``counters``: the live drop counters, called here; the rank selection as
    :meth:`JobState.snapshot <eventbus.app.ui.state.JobState.snapshot>` describes it."""
    rows = c.rows
    ended_at = c.ended_at
    if not live:
        # a file: ages up to its end (a finished run) or up to now (a growing one)
        last = max((row[LAST] for row in rows if row[LAST] is not None), default=None)
        reference = ended_at if ended_at is not None else max(
            now, last if last is not None else now)
    else:
        reference = ended_at if ended_at is not None else now
    rows.sort(key=BY_RANK)
    # the state each rank shows: a straggler report holds SLOW_HOLD_S of the job's time
    shown = shown_states(rows, c.last_at - SLOW_HOLD_S)
    counts = collections.Counter(shown)
    page = rank_page(rows, shown, reference, ranks=ranks, states=states, offset=offset,
                     limit=limit, detail=detail)
    exit_event = c.exit
    return {
        "status": c.status,
        "attempt": c.attempt,
        "restarts": c.attempt,
        "events": c.seq,
        "ranks": page.entries,
        "ranks_total": len(rows),
        "ranks_matched": page.matched,
        "ranks_detail": page.detail,
        "next_offset": page.next_offset,
        "version": c.version,
        "now": now,
        "source": source,
        "run_id": c.run_id,
        "world_size": c.world_size,
        "max_restarts": c.max_restarts,
        "started": c.started_at if c.started_at is not None else c.first_at,
        "ended": ended_at,
        "exit": None if exit_event is None else {
            "state": as_str(getattr(exit_event, "state", None)),
            "exit_code": as_int(getattr(exit_event, "exit_code", None)),
            "cause": cause_of(exit_event),
            "reason": clip(as_str(getattr(exit_event, "reason", None)), 2000)},
        "states": {s: counts.get(s, 0) for s in RANK_STATES},
        "timeline": timeline_json(c.attempts),
        "recoveries": recoveries_json(c.recoveries),
        "problem": None if c.problem is None else problem_json(*c.problem),
        "drain": None if c.drain is None else c.drain.to_json(reference),
        "goodput": goodput,
        "types": dict(sorted(c.types.items(), key=lambda kv: (-kv[1], kv[0]))),
        "drops": _drops(c, counters),
    }


def _drops(c: Copied, counters: Callable[[], Mapping[str, Any]] | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "lost": [{"source": s, "reason": r, "count": n}
                 for (s, r), n in sorted(c.lost.items())],
        "lost_total": sum(c.lost.values()),
    }
    if c.refused:
        out["ranks_not_shown"] = c.refused
    if c.unreadable:
        out["unreadable_lines"] = c.unreadable
    if c.overflowed:
        out["view_overflowed"] = c.overflowed
    if c.fold_failed:
        out["view_failed"] = c.fold_failed
    if counters is not None:
        try:
            out.update(counters())
        except Exception as exc:  # a counter source must never break the page
            out["counters_error"] = f"{type(exc).__name__}: {exc}"
    return out
