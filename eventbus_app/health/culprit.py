"""Who holds a stalled job up: the culprit analysis over each rank's latest progress.

A pure function (:func:`analyze`) of what the ranks' ``WORKER_PROGRESS`` heartbeats said
last (:class:`RankProgress`, built by :func:`progress_of`): per process group, the
collective the others wait in is the highest sequence number any member enqueued; its
**culprits** are the members that have not enqueued it, its **waiting** ranks those that
enqueued it and have not completed it. Two waiting ranks in the same sequence number with
a different op, size or dtype are a **mismatch**; the ranks that differ from the
majority (from the lowest rank on a tie) are its culprits.

Across groups (nested or sub-groups), a rank that waits in one group while it holds up
another is not the root cause: the culprits are the ranks that hold a group up and wait in
none, unless every culprit also waits somewhere (a mismatch, a cycle).

Where torch ships its flight-recorder analyzer (``torch.distributed.flight_recorder``,
in the wheel since torch 2.7), its ``Op.match`` decides whether two ranks' entries of
the same sequence number match (type, sizes, dtypes, with its per-op rules); without it
(an older torch, or an entry it refuses), the same three fields are compared as they are
(:data:`MATCHER` says which ran). Torch-free to import; torch's module is imported on the
first mismatch check.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import attrs

from eventbus.events import Event

__all__ = ["Analysis", "Collective", "PgState", "Pending", "RankProgress", "analyze",
           "format_ranks", "matcher", "pg_order", "progress_of"]


@attrs.frozen
class PgState:
    """A rank's counters in one process group (from ``data["pgs"]``).

    ``ranks``: the group's members as the heartbeat listed them, kept as they came (the
    event's read-only list) and not checked one by one: a heartbeat of an 8,192-rank job
    lists 8,192 ranks, and the analysis only looks a few ranks up in them (see
    :func:`_listed`)."""

    enqueued: int
    completed: int
    ranks: Sequence[int] = ()
    name: str = ""


@attrs.frozen
class Pending:
    """The collective a rank entered and has not completed (from ``data["pending"]``)."""

    seq: int
    op: str
    sizes: Any = None
    dtypes: Any = None
    state: str = ""
    out_sizes: Any = None
    out_dtypes: Any = None

    def signature(self) -> tuple[str, str, str]:
        return (self.op, repr(self.sizes), repr(self.dtypes))

    def describe(self) -> str:
        what = self.op
        if self.sizes is not None:
            what += f" (sizes {_compact(self.sizes)}"
            what += f", {', '.join(map(str, self.dtypes))})" if self.dtypes else ")"
        return what


@attrs.frozen
class RankProgress:
    """What a rank's latest heartbeat said, and how long it has been silent since its
    last progress (its ``idle_s`` plus the heartbeat's age on the agent's clock)."""

    rank: int
    silent_s: float = 0.0
    pgs: Mapping[str, PgState] = attrs.field(factory=dict)
    pending: Mapping[str, Pending] = attrs.field(factory=dict)
    where: str | None = None
    stack: str | None = None
    #: the heartbeat's ``collectives``: 0 = the flight recorder is on and the rank has
    #: entered no collective yet; None = unknown (recorder off, or the groups destroyed)
    collectives: int | None = None


@attrs.frozen
class Collective:
    """The collective a stall is about."""

    pg: str
    seq: int
    op: str | None = None
    sizes: Any = None
    dtypes: Any = None

    def as_data(self) -> dict[str, Any]:
        return {"pg": self.pg, "op": self.op, "seq": self.seq, "sizes": self.sizes,
                "dtypes": self.dtypes}

    def describe(self) -> str:
        return f"{self.op or 'collective'} #{self.seq} of process group {self.pg}"


@attrs.frozen
class Analysis:
    """The answer: culprits, waiting ranks, the collective, whether it is a mismatch, and
    the sentence a person reads first. ``culprit_ranks`` is empty when the heartbeats
    name nobody (no collective pending anywhere: the caller falls back to silence)."""

    culprit_ranks: tuple[int, ...]
    waiting_ranks: tuple[int, ...]
    collective: Collective | None
    mismatch: bool
    diagnosis: str
    #: "torch" when torch's flight-recorder analyzer decided the match, else "builtin"
    matcher: str = "builtin"


# -- from events ---------------------------------------------------------------------------


def _int(value: Any, default: int = -1) -> int:
    if type(value) is int:  # the common case first: the agent reads one per rank and group
        return value
    if isinstance(value, bool):
        return default
    if isinstance(value, int):
        return value
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def _is_map(value: Any) -> bool:
    # a heartbeat's data is read-only dicts: dict's (C) check comes first, the ABC's after
    return isinstance(value, (dict, Mapping))


def progress_of(event: Event, *, age_s: float = 0.0,
                members: Mapping[str, Any] | None = None) -> RankProgress | None:
    """A ``WORKER_PROGRESS`` heartbeat as a :class:`RankProgress`; ``age_s``: seconds since
    it arrived (the agent's clock); ``members``: each process group's members as an earlier
    heartbeat of the rank sent them, for a group whose entry here has none (a heartbeat
    carries them when they change, and now and then). None for another event or one
    without a rank.

    The agent's judge calls it for every rank's latest heartbeat at each stall check
    (8,192 calls at 8,192 ranks): each step reads a field once."""
    rank = getattr(event, "worker_id", None)
    if not isinstance(rank, int):
        return None
    data = event.data or {}
    idle = getattr(event, "idle_s", 0.0)
    silent = (float(idle) if isinstance(idle, (int, float)) else 0.0) + max(0.0, age_s)
    pgs: dict[str, PgState] = {}
    raw_pgs = data.get("pgs")
    if raw_pgs and _is_map(raw_pgs):
        for pg, info in raw_pgs.items():
            if not _is_map(info):
                continue
            ranks = info.get("ranks")
            if ranks is None and members:
                ranks = members.get(pg)
            name = info.get("name", "")
            pgs[pg if type(pg) is str else str(pg)] = PgState(
                _int(info.get("enqueued")), _int(info.get("completed")),
                ranks if isinstance(ranks, (list, tuple)) else (),
                name if type(name) is str else str(name))
    pending: dict[str, Pending] = {}
    raw_pending = data.get("pending")
    if raw_pending and _is_map(raw_pending):
        for pg, info in raw_pending.items():
            if not _is_map(info) or "seq" not in info:
                continue
            op = str(info.get("op") or "collective").rpartition(":")[2]
            state = info.get("state", "")
            pending[pg if type(pg) is str else str(pg)] = Pending(
                _int(info.get("seq")), op.partition(" ")[0], info.get("sizes"),
                info.get("dtypes"), state if type(state) is str else str(state),
                info.get("out_sizes"), info.get("out_dtypes"))
    where = data.get("where")
    stack = data.get("stack")
    collectives = getattr(event, "collectives", None)
    return RankProgress(rank, silent, pgs, pending,
                        where if isinstance(where, str) else None,
                        stack if isinstance(stack, str) else None,
                        collectives if isinstance(collectives, int) else None)


# -- the match rule ------------------------------------------------------------------------

#: ops whose output sizes/dtypes equal the input's, so torch's rules can be given them
#: when the heartbeat carries only the input side
_SAME_SHAPE_OPS = frozenset({"all_reduce", "broadcast", "reduce", "barrier",
                             "all_reduce_barrier", "allreduce_coalesced"})

_torch_op: Any = None  # torch's Op class, None before the first try, False if missing


def matcher() -> str:
    """``"torch"`` when torch's flight-recorder ``Op.match`` is importable, else
    ``"builtin"``."""
    return "torch" if _load_torch_op() else "builtin"


def _load_torch_op() -> Any:
    global _torch_op
    if _torch_op is None:
        try:
            from torch.distributed.flight_recorder.components.types import MatchState
            from torch.distributed.flight_recorder.components.types import Op
            _torch_op = (Op, MatchState)
        except Exception:
            _torch_op = False
    return _torch_op


def _torch_entry(p: Pending, pg: str, backend: str = "gloo") -> dict[str, Any]:
    out_sizes = p.out_sizes if p.out_sizes is not None else p.sizes
    out_dtypes = p.out_dtypes if p.out_dtypes is not None else p.dtypes
    return {"profiling_name": f"{backend}:{p.op}", "state": "scheduled",
            "process_group": (pg, ""), "input_sizes": p.sizes or [[]],
            "output_sizes": out_sizes or [[]], "collective_seq_id": p.seq, "p2p_seq_id": -1,
            "input_dtypes": p.dtypes or [], "output_dtypes": out_dtypes or [],
            "time_created_ns": 0}


def _same(a: Pending, b: Pending, pg: str, members: int, use_torch: bool
          ) -> tuple[bool, str | None, bool]:
    """Whether ``a`` and ``b`` (same sequence number) match: (match, torch's reason, torch
    decided)."""
    loaded: Any = _load_torch_op() if use_torch else False
    if {a.op, b.op} & {"send", "recv"}:
        loaded = False  # a p2p pair never shares an op: not what is compared here
    if loaded and (a.out_sizes is not None or a.op in _SAME_SHAPE_OPS or a.op != b.op):
        op_class, state = loaded
        try:
            memberships = {pg: set(range(max(members, 1)))}
            ours = op_class(_torch_entry(a, pg), memberships, pg)
            theirs = op_class(_torch_entry(b, pg), memberships, pg)
            info = ours.match(theirs)
        except Exception:
            pass  # an op or entry torch's analyzer refuses: compare the fields ourselves
        else:
            matched = info.state in (state.FULLY_MATCHED, state.UNDECIDED)
            return matched, None if matched else str(info), True
    return a.signature() == b.signature(), None, False


# -- the analysis --------------------------------------------------------------------------


@attrs.frozen
class _GroupFinding:
    pg: str
    collective: Collective
    culprits: tuple[int, ...]
    waiting: tuple[int, ...]
    waited_s: float
    mismatch: bool
    details: str | None
    torch_decided: bool


def _listed(wanted: set[int], lists: Iterable[Sequence[Any]]) -> set[int]:
    """The ranks of ``wanted`` that any of ``lists`` (member lists as heartbeats sent them,
    unchecked) holds. Stops at the first list that completes the set: a group's members
    all list the same ranks, so one list usually answers, where reading every member's
    list would cost ranks x ranks (64 M entries at 8,192 ranks)."""
    found: set[int] = set()
    for members in lists:
        try:
            found.update(wanted.intersection(members))
        except TypeError:  # an unhashable entry in a malformed list: compare one by one
            found.update(r for r in wanted if r in members)
        if len(found) == len(wanted):
            break
    return found


def _analyze_group(pg: str, seen: Mapping[int, RankProgress], use_torch: bool
                   ) -> _GroupFinding | None:
    # the members: the ranks that report the group, and the ranks that have entered no
    # collective at all (they report no group) that a reporting rank lists as members;
    # one whose heartbeat does not say (recorder off, groups destroyed at its end) is
    # unknown
    members = {prog.rank for prog in seen.values() if pg in prog.pgs}
    quiet = {r for r, prog in seen.items()
             if prog.collectives == 0 and not prog.pgs and r not in members}
    if quiet:
        members |= _listed(quiet, (prog.pgs[pg].ranks for prog in seen.values()
                                   if pg in prog.pgs))
    enq = {r: (seen[r].pgs[pg].enqueued if pg in seen[r].pgs else 0)
           for r in members if r in seen
           and (pg in seen[r].pgs or (seen[r].collectives == 0 and not seen[r].pgs))}
    if not enq:
        return None
    seq = max(enq.values())
    if seq < 0:
        return None
    waiting = sorted(r for r, e in enq.items()
                     if e == seq and seen[r].pgs.get(pg) is not None
                     and seen[r].pgs[pg].completed < seq)
    if not waiting:
        return None
    culprits = sorted(r for r, e in enq.items() if e < seq)
    # the collective, as the waiting ranks entered it
    entered = {r: seen[r].pending[pg] for r in waiting
               if pg in seen[r].pending and seen[r].pending[pg].seq == seq}
    mismatch = False
    details: str | None = None
    torch_decided = False
    if len(entered) >= 2:
        # each rank's signature once: thousands of waiting ranks at scale
        signatures = {r: p.signature() for r, p in entered.items()}
        counts = Counter(signatures.values())
        lowest = min(entered)
        top = max(counts.values())
        majority = (signatures[lowest] if counts[signatures[lowest]] == top
                    else next(sig for sig, n in counts.items() if n == top))
        in_order = sorted(entered)
        reference = next(entered[r] for r in in_order if signatures[r] == majority)
        odd = []
        for r in in_order:
            if signatures[r] == majority:
                continue
            matched, why, by_torch = _same(reference, entered[r], pg, len(members), use_torch)
            torch_decided = torch_decided or by_torch
            if not matched:
                odd.append(r)
                details = details or why
        if odd:
            mismatch = True
            culprits = sorted(set(culprits) | set(odd))
            odd_set = set(odd)
            waiting = [r for r in waiting if r not in odd_set]
    ref = next((entered[r] for r in sorted(entered) if r in waiting), None)
    if ref is None and entered:
        ref = entered[min(entered)]
    collective = Collective(pg=pg, seq=seq, op=ref.op if ref else None,
                            sizes=ref.sizes if ref else None,
                            dtypes=ref.dtypes if ref else None)
    if not culprits:
        return None
    waited = max((seen[r].silent_s for r in waiting), default=0.0)
    if mismatch and not waiting:
        waited = max(seen[r].silent_s for r in entered)
    return _GroupFinding(pg, collective, tuple(culprits), tuple(waiting), waited, mismatch,
                         details, torch_decided)


def analyze(progress: Iterable[RankProgress] | Mapping[int, RankProgress], *,
            use_torch: bool = True) -> Analysis:
    """The culprits of a stall, from each rank's latest :class:`RankProgress`.

    ``use_torch=False`` skips torch's analyzer (the built-in comparison, as where torch
    lacks it). Cost: linear in ranks x process groups; no I/O, no torch import unless a
    mismatch is to be decided.
    """
    seen = dict(progress) if isinstance(progress, Mapping) else {p.rank: p for p in progress}
    groups = sorted({pg for p in seen.values() for pg in p.pgs}, key=pg_order)
    findings = [f for f in (_analyze_group(pg, seen, use_torch) for pg in groups)
                if f is not None]
    used = "torch" if any(f.torch_decided for f in findings) else "builtin"
    if not findings:
        return Analysis((), (), None, False, _nothing_pending(seen), used)
    waiting_anywhere = {r for f in findings for r in f.waiting}
    held = {r for f in findings for r in f.culprits}
    roots = held - waiting_anywhere or held
    # the finding to tell: a mismatch first, then the one whose culprits are roots and whose
    # waiters waited longest
    main = max(findings, key=lambda f: (f.mismatch, set(f.culprits) <= roots,
                                        bool(set(f.culprits) & roots), f.waited_s))
    culprits = tuple(sorted(roots))
    waiting = tuple(sorted(waiting_anywhere - roots))
    return Analysis(culprits, waiting, main.collective, main.mismatch,
                    _sentence(main, roots, seen), used)


def pg_order(pg: str) -> tuple[int, str]:
    """Process groups in their ids' order (``"0"``, ``"1"``, ..., then names)."""
    return (_int(pg, 1 << 30), pg)


def _nothing_pending(seen: Mapping[int, RankProgress]) -> str:
    if not seen:
        return "no rank sent a progress heartbeat: the culprit cannot be named"
    if not any(p.pgs for p in seen.values()):
        return ("the heartbeats carry no collectives (flight recorder off or "
                "--progress without collectives): the culprit cannot be named")
    return "no rank waits in a collective: every rank is outside the job's collectives"


def _sentence(f: _GroupFinding, roots: set[int], seen: Mapping[int, RankProgress]) -> str:
    coll = f.collective
    if f.mismatch:
        entered = {r: seen[r].pending[f.pg] for r in sorted(seen)
                   if f.pg in seen[r].pending and seen[r].pending[f.pg].seq == coll.seq}
        by_sig: dict[tuple[str, str, str], list[int]] = {}
        for r, p in entered.items():
            by_sig.setdefault(p.signature(), []).append(r)
        parts = [f"{format_ranks(rs)} {'is' if len(rs) == 1 else 'are'} in "
                 f"{entered[rs[0]].describe()}" for rs in by_sig.values()]
        text = (f"collective mismatch at #{coll.seq} of process group {f.pg}: "
                f"{'; '.join(parts)}")
        if f.details:
            text += f" (torch's flight-recorder analyzer: {f.details})"
        text += f"; waiting for {f.waited_s:.1f} s"
    else:
        culprits = [r for r in f.culprits if r in roots] or list(f.culprits)
        verb = "has" if len(culprits) == 1 else "have"
        waiters = list(f.waiting)
        text = (f"{format_ranks(culprits)} {verb} not entered {coll.describe()}, which "
                f"{format_ranks(waiters)} {'has' if len(waiters) == 1 else 'have'} waited "
                f"in for {'up to ' if len(waiters) > 1 else ''}{f.waited_s:.1f} s")
        if not set(f.culprits) & roots and roots:
            text += f" (held up by {format_ranks(sorted(roots))})"
    places = []
    for r in sorted(roots)[:4]:
        where = seen[r].where if r in seen else None
        places.append(f"rank {r} is at {where}" if where
                      else f"rank {r}'s place is unknown (no 'where' in its heartbeat)")
    if len(roots) > 4:
        places.append(f"{len(roots) - 4} more")
    return text + "; " + "; ".join(places)


def format_ranks(ranks: Iterable[int]) -> str:
    """``rank 1``, ``ranks 0, 2``, ``ranks 0-31, 33-63``."""
    rs = sorted(set(ranks))
    if not rs:
        return "no rank"
    if len(rs) == 1:
        return f"rank {rs[0]}"
    spans: list[str] = []
    start = prev = rs[0]
    for r in [*rs[1:], math.inf]:
        if r == prev + 1:
            prev = int(r)
            continue
        spans.append(str(start) if start == prev else
                     f"{start}, {prev}" if prev == start + 1 else f"{start}-{prev}")
        if r != math.inf:
            start = prev = int(r)
    return "ranks " + ", ".join(spans)


def _compact(sizes: Any) -> str:
    text = repr(sizes)
    return text if len(text) <= 60 else text[:57] + "..."
