"""Goodput: where a job's wall time went, from its event stream alone.

``eventbus goodput FILE.jsonl [--json]``. The wall time, from the first agent's start to
the last agent's exit, is cut into intervals, each given to exactly one cause, so that
``goodput_s`` plus the badput add up to ``wall_s`` by construction
(docs/goodput.md has the definitions and a worked example):

* ``startup``: each attempt's start (the job's start, or the attempt's first worker) until
  its first progress (an optimizer step or a collective in the heartbeats, a ``METRIC``
  step, a checkpoint);
* ``checkpoint``: time inside checkpoint saves (``CHECKPOINT_SAVED.duration_s``, from a
  script or a trainer integration; the bootstrap's saves in the heartbeats);
* ``stall``: a stalled rank's last progress until the stall verdict (``WORKER_STALLED``:
  its time less ``silent_s``);
* ``restart``: a failure (its attempt's last progress) or a stall verdict until the next
  attempt starts;
* ``wasted``: progress made after the last completed checkpoint of an attempt that then
  failed or stalled: lost, and badput of that failure;
* ``drain``: a drain (``PREEMPTING``) until the job's end;
* ``other``: the end of the job after its last progress (the workers' and agents'
  teardown), or after a failure that no attempt followed.

What is left is ``goodput``: training progress that was kept. Where intervals overlap, the
cause earlier in the list of :data:`PRIORITY` takes the time (a drain over a restart, a
stall over the progress it wasted).

Torch-free, pure: :func:`goodput` takes records (:mod:`eventbus.app.readers.records`), so
the job view's live state and the console's last line use the same computation.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from collections.abc import Iterable
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from eventbus.app.readers.records import Problem
from eventbus.app.readers.records import Record
from eventbus.app.readers.records import read_records
from eventbus.app.sentences import as_int
from eventbus.app.sentences import as_number

__all__ = [
    "CAUSES",
    "PRIORITY",
    "Goodput",
    "GoodputError",
    "GoodputTracker",
    "goodput",
    "main",
    "render_text",
]

#: the badput causes, in the order they are listed
CAUSES = ("startup", "checkpoint", "stall", "restart", "wasted", "drain", "other")
#: who takes an instant claimed by several causes: earlier wins
PRIORITY = ("drain", "restart", "stall", "wasted", "checkpoint", "startup", "other")
#: how far a time read from the heartbeats can be off: a progressing rank beats at most
#: once a second, an idle one every 2 s
HEARTBEAT_S = 2.0


class GoodputError(ValueError):
    """The file holds no job whose time can be split (empty, no agent, several runs)."""


@attrs.frozen
class Goodput:
    """Where the wall time went: ``goodput_s`` plus ``badput_s``'s values is ``wall_s``."""

    wall_s: float
    goodput_s: float
    badput_s: dict[str, float]
    #: progress lost to failures, in optimizer steps, where the steps are known
    wasted_steps: int | None = None
    attempts: int = 1
    #: the job's run id, start and end (unix seconds), and whether it ended
    run_id: str | None = None
    start: float = 0.0
    end: float = 0.0
    ended: bool = True
    #: what the stream could not show, one sentence each
    notes: tuple[str, ...] = ()
    #: the most the figures can be off by, in seconds (heartbeat granularity, lost events)
    error_bound_s: float = 0.0
    #: per node (group rank) figures, when the file holds several nodes
    nodes: dict[int, Goodput] = attrs.field(factory=dict)
    #: the job's time in order: (start, end, cause or "goodput"), unix seconds
    spans: tuple[tuple[float, float, str], ...] = ()
    #: the restarts' time by phase, summed over their ``RECOVERED`` events (detect, stop,
    #: rendezvous, start, import, init, restore, first_step); empty without one
    restart_phases_s: dict[str, float] = attrs.field(factory=dict)

    @property
    def goodput_ratio(self) -> float:
        return self.goodput_s / self.wall_s if self.wall_s > 0 else 0.0

    def biggest(self) -> tuple[str, float] | None:
        """The badput cause that took the most time, if any took some."""
        cause, seconds = max(self.badput_s.items(), key=lambda kv: kv[1], default=("", 0.0))
        return (cause, seconds) if seconds > 0 else None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "wall_s": round(self.wall_s, 3), "goodput_s": round(self.goodput_s, 3),
            "goodput_ratio": round(self.goodput_ratio, 4),
            "badput_s": {k: round(v, 3) for k, v in self.badput_s.items()},
            "wasted_steps": self.wasted_steps, "attempts": self.attempts,
            "run_id": self.run_id, "ended": self.ended, "notes": list(self.notes),
            "error_bound_s": round(self.error_bound_s, 3),
        }
        if self.restart_phases_s:
            out["restart_phases_s"] = {k: round(v, 3) for k, v in self.restart_phases_s.items()}
        if self.nodes:
            out["nodes"] = {str(g): n.to_json() for g, n in sorted(self.nodes.items())}
        return out

    def sentence(self) -> str:
        """``goodput 87.5% of 2 min 10 s; the biggest loss: restart, 9.8 s``."""
        head = f"goodput {self.goodput_ratio:.1%} of {_duration(self.wall_s)}"
        biggest = self.biggest()
        if biggest is None:
            return head
        return f"{head}; the biggest loss: {biggest[0]}, {_duration(biggest[1])}"


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(seconds, 60)
    if minutes < 60:
        return f"{int(minutes)} min {rest:.0f} s"
    hours, minutes = divmod(minutes, 60)
    return f"{int(hours)} h {int(minutes)} min"


# -- the computation -----------------------------------------------------------------------

def _attempt(record: Record) -> int:
    value = as_int(record.context.get("restart_count"))
    return value if value is not None and value >= 0 else 0


def _progress_time(record: Record) -> float | None:
    """When ``record`` shows the rank made progress (None: it shows none): the rank's last
    progress before it."""
    return _progress_at(record.type, record.timestamp, record.fields)


def _progress_at(kind: str, timestamp: float, fields: Any) -> float | None:
    """:func:`_progress_time` from an event's type, time and fields (anything with
    ``.get``: a record's mapping, a typed event's attributes)."""
    if kind == "WORKER_PROGRESS":
        step = as_int(fields.get("step"))
        done = as_int(fields.get("collectives"))
        if not ((step or 0) > 0 or (done or 0) > 0):
            return None
        idle = as_number(fields.get("idle_s")) or 0.0
        return timestamp - max(0.0, idle)
    if kind == "METRIC" and as_int(fields.get("step")) is not None:
        return timestamp
    if kind in ("CHECKPOINT_SAVED", "EPOCH_END"):
        return timestamp
    return None


def _first_progress(mine: Sequence[Record]) -> float | None:
    """When the attempt's first rank began to progress. A heartbeat says when a rank last
    progressed, and a progressing rank beats at most once a second, so its first
    progressing beat comes up to a second after the first step: that beat's time less
    its steps times its step time (when the beat has them), and never before the rank's
    previous beat, or else halfway back to that beat."""
    found: list[float] = []
    previous: dict[Any, float] = {}
    seen: set[Any] = set()
    for r in mine:
        t = _progress_time(r)
        who = (r.rank, r.pid)
        if t is None:
            if r.type == "WORKER_PROGRESS":
                previous[who] = r.timestamp
            continue
        if who in seen:
            continue
        seen.add(who)
        before = previous.get(who)
        if r.type != "WORKER_PROGRESS" or before is None:
            found.append(t)
            continue
        step = as_int(r.fields.get("step")) or 0
        per_step = as_number(r.data.get("step_time_s"))
        if per_step is not None and per_step > 0 and step > 0:
            found.append(min(t, max(before, t - step * per_step)))
        else:
            found.append(max(before, (before + t) / 2))
    return min(found) if found else None


def _step_of(record: Record) -> int | None:
    if record.type in ("WORKER_PROGRESS", "METRIC", "CHECKPOINT_SAVED", "WORKER_SLOW"):
        return as_int(record.fields.get("step"))
    return None


def _own_failure(record: Record) -> bool:
    if record.type != "WORKER_EXIT":
        return False
    code = as_int(record.fields.get("exit_code"))
    cause = record.fields.get("cause")
    return code not in (0, None) and not record.stopped_by_agent and cause != "preemption"


def _saves(records: Sequence[Record]) -> list[tuple[float, float, int | None, int]]:
    """Each completed checkpoint save: (start, end, step, attempt)."""
    out = []
    for r in records:
        if r.type == "CHECKPOINT_SAVED":
            took = as_number(r.fields.get("duration_s"))
            took = took if took is not None and took >= 0 else 0.0
            out.append((r.timestamp - took, r.timestamp, as_int(r.fields.get("step")),
                        _attempt(r)))
        elif r.type == "WORKER_PROGRESS":
            for save in r.data.get("saves") or ():  # the bootstrap's (start, end) pairs
                if isinstance(save, dict):
                    start, end = as_number(save.get("start")), as_number(save.get("end"))
                    if start is not None and end is not None and end >= start:
                        # the step as the save ended (the bootstrap reads its step
                        # counter then), else the heartbeat's own, which went out later
                        step = as_int(save.get("step"))
                        out.append((start, end, step if step is not None else _step_of(r),
                                    _attempt(r)))
    return out


def goodput(records: Iterable[Record], *, problems: Sequence[Problem] = (),
            run_id: str | None = None, per_node: bool = True,
            span: tuple[float, float] | None = None) -> Goodput:
    """Split the wall time of the job in ``records`` (one run; ``run_id`` picks one of
    several) into goodput and badput by cause. Raises :class:`GoodputError` when there is
    no job to split. ``span``: the job's (start, end), for one node's share of a job."""
    rows = sorted(records, key=lambda r: r.timestamp)
    runs = sorted({str(r.context.get("run_id")) for r in rows
                   if r.context.get("run_id") not in (None, "")})
    if run_id is not None:
        rows = [r for r in rows if str(r.context.get("run_id")) in (run_id, "None")]
        if not rows:
            raise GoodputError(f"no event of run {run_id!r} (the file's runs: "
                               f"{', '.join(runs) or 'none named'})")
        runs = [run_id]
    elif len(runs) > 1:
        raise GoodputError(f"the file mixes {len(runs)} runs ({', '.join(runs[:5])}"
                           f"{', ...' if len(runs) > 5 else ''}); pick one with --run-id")
    if not rows:
        raise GoodputError("no events: nothing to split")
    notes: list[str] = []
    starts = [r for r in rows if r.type == "AGENT_START"]
    exits = [r for r in rows if r.type == "AGENT_EXIT"]
    begin = starts[0].timestamp if starts else rows[0].timestamp
    if not starts:
        notes.append("no AGENT_START: the job's start is taken as its first event")
    ended = bool(exits)
    finish = max(exits[-1].timestamp, rows[-1].timestamp) if exits else rows[-1].timestamp
    if not ended:
        notes.append("no AGENT_EXIT: the job had not ended (or the file was cut); counted "
                      "until its last event")
    if span is not None:
        begin, finish = span
    wall = max(0.0, finish - begin)
    claims: list[tuple[float, float, str]] = []

    def claim(start: float, end: float, cause: str) -> None:
        start, end = max(start, begin), min(end, finish)
        if end > start:
            claims.append((start, end, cause))

    # attempts: their start, their first and last progress, how they ended
    attempts = sorted({_attempt(r) for r in rows})
    first_start = {a: min((r.timestamp for r in rows if r.type == "WORKER_START"
                           and _attempt(r) == a), default=None) for a in attempts}
    restarts = {a if (a := as_int(r.fields.get("attempt"))) is not None else _attempt(r):
                r.timestamp for r in rows if r.type == "WORKER_RESTART"}
    saves = _saves(rows)
    for start, end, _, _ in saves:
        claim(start, end, "checkpoint")
    wasted_steps: int | None = None
    lost_any = False
    previous_end: float | None = None
    for index, attempt in enumerate(attempts):
        mine = [r for r in rows if _attempt(r) == attempt]
        at = begin if index == 0 else (restarts.get(attempt) or first_start.get(attempt)
                                       or mine[0].timestamp)
        if previous_end is not None:
            claim(previous_end, at, "restart")
        progress = [t for r in mine if (t := _progress_time(r)) is not None]
        first = _first_progress(mine)
        last = max(progress) if progress else None
        failures = [r.timestamp for r in mine if _own_failure(r)]
        # a rank reported waiting for data is no verdict: the attempt goes on
        stalls = [r for r in mine if r.type == "WORKER_STALLED"
                  and r.data.get("waiting_on") != "data"]
        verdict = min([*failures, *(s.timestamp for s in stalls)], default=None)
        later = index + 1 < len(attempts)
        if verdict is None and later:  # ended without a failure here (a membership change)
            verdict = at if first is None else last
        claim(at, first if first is not None else (verdict or finish), "startup")
        if verdict is None:
            previous_end = None
            if last is not None and ended:
                claim(last, finish, "other")  # the end: teardown after the last progress
            continue
        for stall in stalls:
            silent = as_number(stall.fields.get("silent_s")) or 0.0
            claim(stall.timestamp - silent, stall.timestamp, "stall")
        # the failure's moment, as well as it is known: the attempt's last progress (a
        # failed worker's last heartbeat says it), not the agent's notice of the exit,
        # which comes after the process's teardown
        # (a stall's silence is its own cause: there the verdict ends it)
        stalled_first = bool(stalls) and min(st.timestamp for st in stalls) <= verdict
        failed_at = verdict if stalled_first or last is None or last < at else min(verdict, last)
        if first is not None:
            kept = [end for _, end, _, a in saves if a == attempt and end <= verdict]
            from_ = max(kept) if kept else first
            claim(from_, failed_at, "wasted")
            steps_at_save = [s for _, end, s, a in saves
                             if a == attempt and end <= verdict and s is not None]
            steps = [s for r in mine if (s := _step_of(r)) is not None and r.timestamp
                     <= verdict]
            if steps:
                lost = max(steps) - (max(steps_at_save) if steps_at_save else 0)
                wasted_steps = (wasted_steps or 0) + max(0, lost)
                lost_any = True
        previous_end = failed_at
        if not later:
            claim(failed_at, finish, "other")  # no attempt followed: the job failed
    for r in rows:
        if r.type == "PREEMPTING":
            claim(r.timestamp, finish, "drain")
            break
    badput, spans = _sweep(claims, begin, finish)
    lost_events = sum(as_int(r.fields.get("count")) or 0 for r in rows
                      if r.type == "EVENTS_LOST")
    if lost_events:
        notes.append(f"{lost_events} events were lost on the way (EVENTS_LOST): a gap in "
                     "the heartbeats reads as progress or as its absence")
    for problem in problems:
        notes.append(f"{problem.count} {problem.kind} lines were skipped")
    beats = any(r.type == "WORKER_PROGRESS" for r in rows)
    if not beats:
        notes.append("no WORKER_PROGRESS heartbeats: progress is read from METRIC, "
                     "CHECKPOINT_SAVED and EPOCH_END alone")
    bound = HEARTBEAT_S * 2 * len(attempts) + (HEARTBEAT_S * 5 if lost_events else 0.0)
    good = max(0.0, wall - sum(badput.values()))
    nodes: dict[int, Goodput] = {}
    groups = sorted({g for r in rows if (g := r.group_rank) is not None})
    if per_node and len(groups) > 1:
        for group in groups:
            try:
                nodes[group] = goodput([r for r in rows if r.group_rank == group],
                                       per_node=False, span=(begin, finish))
            except GoodputError:
                continue
    phases: dict[str, float] = {}
    for record in rows:
        found = record.data.get("phases") if record.type == "RECOVERED" else None
        if isinstance(found, dict):
            for name, value in found.items():
                seconds = as_number(value)
                if seconds is not None and math.isfinite(seconds):
                    phases[str(name)] = phases.get(str(name), 0.0) + seconds
    return Goodput(wall_s=wall, goodput_s=good, badput_s=badput, restart_phases_s=phases,
                   wasted_steps=wasted_steps if lost_any else None,
                   attempts=len(attempts), run_id=runs[0] if runs else None, start=begin,
                   end=finish, ended=ended, notes=tuple(notes), error_bound_s=bound,
                   nodes=nodes, spans=spans)


def _sweep(claims: list[tuple[float, float, str]], begin: float,
           finish: float) -> tuple[dict[str, float], tuple[tuple[float, float, str], ...]]:
    """Each instant to the first cause of :data:`PRIORITY` that claims it ("goodput" where
    none does): the seconds per badput cause, and the job's spans in time order."""
    out = dict.fromkeys(CAUSES, 0.0)
    spans: list[tuple[float, float, str]] = []
    points = sorted({begin, finish, *(p for s, e, _ in claims for p in (s, e))})
    rank = {cause: i for i, cause in enumerate(PRIORITY)}
    for left, right in itertools.pairwise(points):
        if right <= left:
            continue
        mid = (left + right) / 2
        owners = [c for s, e, c in claims if s <= mid < e]
        cause = min(owners, key=rank.__getitem__) if owners else "goodput"
        if owners:
            out[cause] += right - left
        if spans and spans[-1][2] == cause and spans[-1][1] == left:
            spans[-1] = (spans[-1][0], right, cause)
        else:
            spans.append((left, right, cause))
    return out, tuple(spans)


# -- the command -----------------------------------------------------------------------------

def render_text(result: Goodput) -> str:
    """The table and one sentence on the biggest cause."""
    lines = [f"{'':<11}{'seconds':>10}{'share':>8}"]
    lines.append(f"{'goodput':<11}{result.goodput_s:>10.1f}{result.goodput_ratio:>8.1%}")
    for cause in CAUSES:
        seconds = result.badput_s.get(cause, 0.0)
        share = seconds / result.wall_s if result.wall_s > 0 else 0.0
        lines.append(f"{cause:<11}{seconds:>10.1f}{share:>8.1%}")
    lines.append(f"{'wall':<11}{result.wall_s:>10.1f}{1.0 if result.wall_s else 0:>8.1%}")
    lines.append("")
    lines.append(result.sentence() + (f" ({result.wasted_steps} steps wasted)"
                                      if result.wasted_steps else "") + ".")
    if result.restart_phases_s:
        lines.append("restarts by phase (RECOVERED): " + ", ".join(
            f"{name.replace('_', ' ')} {seconds:.2f} s"
            for name, seconds in result.restart_phases_s.items()))
    for note in result.notes:
        lines.append(f"note: {note}")
    if result.error_bound_s:
        lines.append(f"the figures can be off by up to {result.error_bound_s:.0f} s "
                     "(heartbeats are at most 2 s apart)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``eventbus goodput FILE.jsonl [--json] [--run-id ID]``."""
    parser = argparse.ArgumentParser(
        prog="eventbus goodput",
        description="Where a job's wall time went: goodput and badput by cause, from its "
                    "events JSONL file (docs/goodput.md).")
    parser.add_argument("file", help="the events JSONL file (--events-jsonl)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object: wall_s, goodput_s, goodput_ratio, "
                             "badput_s (cause -> seconds), notes, nodes")
    parser.add_argument("--run-id", default=None,
                        help="the run to split when the file holds several")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    path = Path(args.file)
    try:
        records, problems = read_records(path)
    except OSError as exc:
        print(f"eventbus goodput: {path}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    try:
        result = goodput(records, problems=problems, run_id=args.run_id)
    except GoodputError as exc:
        print(f"eventbus goodput: {path}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        print(render_text(result))
    return 0


# -- live: the same figure while the job runs ------------------------------------------------

#: the types kept whole by the tracker (rare: at most a few per rank and attempt)
_KEPT = frozenset({"AGENT_START", "AGENT_EXIT", "WORKER_START", "WORKER_RESTART",
                   "WORKER_EXIT", "WORKER_STALLED", "PREEMPTING", "CHECKPOINT_SAVED",
                   "EVENTS_LOST", "RECOVERED"})
#: the types that show progress (the tracker keeps a few per rank and attempt)
_PROGRESS = frozenset({"WORKER_PROGRESS", "METRIC", "EPOCH_END"})


class GoodputTracker:
    """The goodput of a job as its events arrive (the job view's ``/api/state``, the
    Prometheus sink, the agent's last line), computed by :func:`goodput` over what the
    figure needs and no more: the lifecycle, failures, stalls, drains and saves whole, and
    per rank and attempt its first progress (with the idle beat before it), its latest
    progress and its highest step. Memory grows with ranks x attempts, not with events.
    ``observe`` takes typed events or records; thread-safe."""

    def __init__(self) -> None:
        import threading

        self._lock = threading.Lock()
        self._kept: list[Any] = []
        self._first: dict[tuple[int, Any], Any] = {}
        self._idle: dict[tuple[int, Any], Any] = {}
        self._last: dict[tuple[int, Any], tuple[float, Any]] = {}
        self._top: dict[tuple[int, Any], tuple[int, Any]] = {}
        self.observed = 0

    def observe(self, event: Any) -> None:
        kind = str(event.type)
        if kind in _KEPT:
            with self._lock:
                self._kept.append(event)
                self.observed += 1
            return
        if kind not in _PROGRESS:
            return
        # read straight from a typed event or a record: a heartbeat is made a record
        # only if it is kept and the figure is asked for
        fields, context = _parts(event)
        attempt = as_int(context.get("restart_count"))
        key = (attempt if attempt is not None and attempt >= 0 else 0,
               (as_int(context.get("rank")), as_int(context.get("pid"))))
        step = as_int(fields.get("step"))
        at = _progress_at(kind, as_number(event.timestamp) or 0.0, fields)
        with self._lock:
            self.observed += 1
            if kind == "WORKER_PROGRESS" and event.data.get("saves"):
                self._kept.append(event)
            if at is None:
                if kind == "WORKER_PROGRESS" and key not in self._first:
                    self._idle[key] = event
            else:
                self._first.setdefault(key, event)
                if key not in self._last or at >= self._last[key][0]:
                    self._last[key] = (at, event)
            if step is not None and (key not in self._top or step > self._top[key][0]):
                self._top[key] = (step, event)

    def records(self) -> list[Record]:
        """What the figure is computed from, in time order."""
        with self._lock:
            picked = [*self._kept, *self._idle.values(), *self._first.values(),
                      *(r for _, r in self._last.values()), *(r for _, r in self._top.values())]
        out: dict[int, Record] = {}
        for item in picked:
            record = item if isinstance(item, Record) else _as_record(item)
            if record is not None:
                out[id(item)] = record
        return sorted(out.values(), key=lambda r: r.timestamp)

    def result(self, *, until: float | None = None) -> Goodput | None:
        """The figure so far (a running job's wall time ends at ``until``, default its
        last event); None before the job's first event."""
        records = self.records()
        if not records:
            return None
        span = None
        if until is not None and not any(r.type == "AGENT_EXIT" for r in records):
            starts = [r.timestamp for r in records if r.type == "AGENT_START"]
            span = (starts[0] if starts else records[0].timestamp, max(until,
                                                                       records[-1].timestamp))
        try:
            return goodput(records, per_node=False, span=span)
        except GoodputError:
            return None


def _parts(event: Any) -> tuple[Any, Any]:
    """(fields, context) of a record or a typed event, both read with ``.get``."""
    if isinstance(event, Record):
        return event.fields, event.context
    return _Attrs(event), _Attrs(event.context)


class _Attrs:
    """``.get(name)`` over an object's attributes."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def get(self, name: str) -> Any:
        return getattr(self.obj, name, None)


def _as_record(event: Any) -> Record | None:
    from eventbus.app.readers.records import record_from_dict

    try:
        return record_from_dict(event.to_dict())
    except Exception:
        return None
