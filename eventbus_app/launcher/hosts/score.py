"""A host's score: how strongly its recent outcomes say it is bad.

One number per host, so a scheduler can draw a line: each host fault in the ledger adds its
kind's weight (:data:`WEIGHTS`), decayed by its age with a half-life of
:data:`HALF_LIFE_S` (7 days): a fault of today counts whole, one of last week half, one
of a month ago a twentieth. A host is bad when its score is over the threshold
(:data:`DEFAULT_BAD_HOST_THRESHOLD`, 1.0, the default of ``eventbus run
--bad-host-threshold`` and ``eventbus hosts --threshold``): two faults of weight 1 within
a few days, or one ECC error within a week.

Clean finishes never erase a fault: a machine whose GPU fails one attempt in ten also
finishes the other nine. They are counted and shown beside the score, not in it. The
culprit and straggler counts are shown too; what of them is a host fault is already in
``faults`` (``hang``, ``straggler``), so they are not counted twice.

Pure: every function takes the time ``now``; docs/hosts.md has the table.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from collections.abc import Mapping
from typing import Any
from typing import Protocol

import attrs

__all__ = [
    "DEFAULT_BAD_HOST_THRESHOLD",
    "DEFAULT_WEIGHT",
    "HALF_LIFE_S",
    "WEIGHTS",
    "HostSummary",
    "Scored",
    "decay",
    "outcome_weight",
    "score",
    "summarize",
]

#: the age at which a fault counts half
HALF_LIFE_S = 7 * 86400.0

#: what one host fault of each kind adds to the score, before decay: hardware evidence
#: whole or more, what a peer or the script may share in less
WEIGHTS: Mapping[str, float] = {
    "ecc": 2.0,
    "signal": 1.0,
    "cuda": 1.0,
    "reactor": 1.0,
    "oom": 0.5,
    "nccl": 0.5,
    "hang": 0.5,
    "straggler": 0.25,
    "lost": 1.0,
}

#: the weight of a kind this version does not know (written by a newer eventbus)
DEFAULT_WEIGHT = 1.0

#: a host whose score is over this is bad (``--bad-host-threshold``, ``--threshold``)
DEFAULT_BAD_HOST_THRESHOLD = 1.0


class Scored(Protocol):
    """What the score reads of one outcome (``HostOutcome`` is one)."""

    @property
    def host(self) -> str: ...
    @property
    def job(self) -> str: ...
    @property
    def time(self) -> float: ...
    @property
    def faults(self) -> Mapping[str, int]: ...
    @property
    def culprit(self) -> int: ...
    @property
    def straggler(self) -> int: ...
    @property
    def clean(self) -> bool: ...


def decay(age_s: float, half_life_s: float = HALF_LIFE_S) -> float:
    """``0.5 ** (age / half-life)``; an age below zero (a clock ahead) counts as zero."""
    if half_life_s <= 0:
        return 1.0
    return math.pow(0.5, max(0.0, age_s) / half_life_s)


def outcome_weight(faults: Mapping[str, int]) -> float:
    """What one outcome's faults weigh before decay."""
    return sum(WEIGHTS.get(kind, DEFAULT_WEIGHT) * max(0, count)
               for kind, count in faults.items())


def score(outcomes: Iterable[Scored], now: float, *,
          half_life_s: float = HALF_LIFE_S) -> float:
    """The decayed sum of the outcomes' fault weights at ``now``."""
    return sum(outcome_weight(o.faults) * decay(now - o.time, half_life_s) for o in outcomes)


@attrs.frozen
class HostSummary:
    """One host as ``eventbus hosts`` shows it."""

    host: str
    score: float
    #: host faults by kind, over the outcomes read
    faults: dict[str, int]
    #: distinct jobs in which the host had a host fault, and distinct jobs seen at all
    jobs_hurt: int
    jobs: int
    #: outcomes (one per job and attempt) read
    attempts: int
    #: attempts that finished cleanly on the host
    clean: int
    culprit: int
    straggler: int
    #: the latest outcome's time, and the latest with a fault (unix seconds)
    last_seen: float
    last_fault: float | None

    @property
    def total_faults(self) -> int:
        return sum(self.faults.values())

    def to_json(self) -> dict[str, Any]:
        return {"host": self.host, "score": round(self.score, 4), "faults": self.faults,
                "jobs_hurt": self.jobs_hurt, "jobs": self.jobs, "attempts": self.attempts,
                "clean": self.clean, "culprit": self.culprit, "straggler": self.straggler,
                "last_seen": self.last_seen, "last_fault": self.last_fault}


def summarize(outcomes: Iterable[Scored], now: float, *,
              half_life_s: float = HALF_LIFE_S) -> list[HostSummary]:
    """One summary per host, the highest score first (then by name)."""
    by_host: dict[str, list[Scored]] = {}
    for outcome in outcomes:
        by_host.setdefault(outcome.host, []).append(outcome)
    summaries = [_summary(host, rows, now, half_life_s) for host, rows in by_host.items()]
    return sorted(summaries, key=lambda s: (-s.score, s.host))


def _summary(host: str, rows: list[Scored], now: float, half_life_s: float) -> HostSummary:
    faults: dict[str, int] = {}
    for row in rows:
        for kind, count in row.faults.items():
            if count > 0:
                faults[kind] = faults.get(kind, 0) + count
    hurt = [row for row in rows if any(count > 0 for count in row.faults.values())]
    return HostSummary(
        host=host, score=score(rows, now, half_life_s=half_life_s),
        faults=dict(sorted(faults.items(), key=lambda kv: (-kv[1], kv[0]))),
        jobs_hurt=len({row.job for row in hurt}), jobs=len({row.job for row in rows}),
        attempts=len(rows), clean=sum(1 for row in rows if row.clean),
        culprit=sum(row.culprit for row in rows),
        straggler=sum(row.straggler for row in rows),
        last_seen=max(row.time for row in rows),
        last_fault=max((row.time for row in hurt), default=None))
