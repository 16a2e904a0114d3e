"""What a silent rank is doing, from the evidence its heartbeats carry.

A rank that made no progress for its stall timeout is not stalled on silence alone: the
verdict needs evidence that it waits. Each idle heartbeat (``WORKER_PROGRESS``) carries
``data["activity"]`` (:data:`eventbus.app.protocol.agent_worker.ACTIVITY_KEY`), sampled
by the worker's progress watch from the main thread (eventbus_app/worker/activity.py):

* ``still_s``: how long the main thread's Python stack (every frame's code and line) has
  stayed the same, ``still_cpu_s``, the CPU time that thread used meanwhile, and
  ``still_fair_cpu_s``, the CPU a thread runnable all along would have had meanwhile on
  this machine (less than ``still_s`` while every core is busy; absent where unknown);
* ``io`` (``"save"`` or ``"load"``), ``io_s``, ``io_kind``: a checkpoint save or load
  under way (``torch.save``/``torch.load``, ``torch.distributed.checkpoint``,
  safetensors);
* ``data_s``: how long the main thread has been inside a ``DataLoader`` fetch;
* ``compiling_s``: how long it has been inside ``torch.compile``'s compiler;
* ``label``: ``"validating"``, ``"evaluating"``, ``"testing"`` or ``"predicting"`` when a
  frame of the stack says so (Lightning's and transformers' loops, a script's
  ``validate()``).

:func:`classify` turns one rank's latest evidence into an :class:`Evidence`, in this order
(the first that holds):

1. ``saving``/``loading``: a checkpoint save or load is under way: **never a stall**;
2. ``compiling``: ``torch.compile`` compiles: never a stall;
3. ``data``: inside a ``DataLoader`` fetch for the whole window: **reported, not a
   restart** unless a reactor asks for one;
4. ``busy``: the stack moved within the window (the rank computes: a validation pass, an
   evaluation on rank 0 alone): never a stall;
5. ``collective``: the stack stood still in a collective that is pending (the flight
   recorder's ``pgs``): a stall;
6. ``spinning`` (the still stack's thread used at least :data:`SPIN_CPU_SHARE` of the CPU
   a runnable thread would have had: a core on an idle machine, its share of the cores on
   a busy one) or ``blocked`` (a lock, a sleep, a queue): a stall.

The window is the timeout (or the silence as of the beat, if shorter), less
:data:`STILL_SLACK_S` for the samples' rhythm (at least half of it); the evidence is read as
of its beat, never extrapolated. Without heartbeats (a script whose progress watch never armed) the
evidence is ``silent``: silence alone, as the timeout was before; a rank whose heartbeats
stopped (a process frozen, or C code that holds the GIL) is ``unresponsive``, unless its
last beat showed a save, a load or a compile.

Torch-free and pure: the judge (eventbus_app/health/judge.py) and the job view
(eventbus_app/ui) read the same evidence with it; tests/test_evidence.py drives it with
recorded samples.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs

from eventbus.app.protocol.agent_worker import ACTIVITY_KEY

__all__ = [
    "NEVER_STALLED",
    "REPORTED_ONLY",
    "SILENT_AFTER_S",
    "SPIN_CPU_SHARE",
    "STALLING",
    "STILL_SLACK_S",
    "Evidence",
    "classify",
    "doing_of",
    "pending_collective",
]

#: the samples' rhythm: a stack that stood still since the window's start less this much
#: counts as still for the whole window (the watch samples every tick and beats every
#: few seconds; the silence starts at the last progress, a tick before the first still
#: sample)
STILL_SLACK_S = 2.5
#: a still stack whose thread used at least this share of the CPU it could have had (one
#: core, or its share of the cores while they are all busy) is spinning, not blocked
SPIN_CPU_SHARE = 0.5
#: a rank idle for less than this is not "doing" anything the page shows
SILENT_AFTER_S = 1.0

#: ``waiting_on`` values that stop a job (a verdict: restart, or the reactors' say)
STALLING = frozenset({"collective", "blocked", "spinning", "unresponsive", "silent"})
#: reported (an event, a console line), not restarted unless a reactor asks
REPORTED_ONLY = frozenset({"data"})
#: never a stall, whatever the timeout
NEVER_STALLED = frozenset({"busy", "saving", "loading", "compiling"})


@attrs.frozen
class Evidence:
    """One rank's evidence: ``waiting_on`` (a value of :data:`STALLING`,
    :data:`REPORTED_ONLY` or :data:`NEVER_STALLED`), the facts it rests on (for
    ``WORKER_STALLED.data["evidence"]``) and a short phrase for people (``doing``)."""

    waiting_on: str
    facts: Mapping[str, Any]
    doing: str

    @property
    def stalls(self) -> bool:
        """Whether this evidence can stop the job."""
        return self.waiting_on in STALLING

    @property
    def reported(self) -> bool:
        """Whether it is reported without a restart (waiting for data)."""
        return self.waiting_on in REPORTED_ONLY


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    number = float(value)
    return number if math.isfinite(number) and number >= 0 else None


def pending_collective(data: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The collective a heartbeat shows the rank inside of: ``{"pg", "seq"}`` plus ``op``
    (and ``sizes``) when the beat's ``pending`` names it; None when no group's enqueued
    count is above its completed one."""
    if not data:
        return None
    pgs = data.get("pgs")
    if not isinstance(pgs, Mapping):
        return None
    pending = data.get("pending")
    for pg, info in sorted(pgs.items(), key=lambda kv: str(kv[0])):
        if not isinstance(info, Mapping):
            continue
        enqueued, completed = info.get("enqueued"), info.get("completed")
        if isinstance(enqueued, int) and isinstance(completed, int) and enqueued > completed:
            out: dict[str, Any] = {"pg": str(pg), "seq": enqueued}
            entry = pending.get(pg) if isinstance(pending, Mapping) else None
            if isinstance(entry, Mapping):
                if isinstance(entry.get("op"), str):
                    out["op"] = entry["op"]
                if entry.get("sizes") is not None:
                    out["sizes"] = entry["sizes"]
            return out
    return None


def _collective_text(pending: Mapping[str, Any]) -> str:
    op = pending.get("op")
    name = op if isinstance(op, str) and op else "a collective"
    return f"in {name} #{pending.get('seq')}"


def classify(data: Mapping[str, Any] | None, *, silent_s: float, timeout_s: float,
             beat_age_s: float | None, beats_stopped_s: float) -> Evidence:
    """The evidence of one rank silent for ``silent_s`` (its timeout ``timeout_s``), from
    its latest heartbeat's ``data`` received ``beat_age_s`` ago (None: no heartbeat in
    this attempt). ``beats_stopped_s``: a beat older than this means the beats stopped."""
    if beat_age_s is None:
        return Evidence("silent", {"heartbeats": False}, "silent")
    activity = data.get(ACTIVITY_KEY) if data else None
    if not isinstance(activity, Mapping):
        activity = {}
    age = max(0.0, beat_age_s)
    # judged as of the beat, never extrapolated: the silence then, up to the timeout
    span = max(0.0, min(silent_s - age, timeout_s))
    window = max(span - STILL_SLACK_S, span / 2)
    facts: dict[str, Any] = {"beat_age_s": round(age, 3)}
    label = activity.get("label")
    if isinstance(label, str) and label:
        facts["label"] = label[:40]

    io = activity.get("io")
    if io in ("save", "load"):
        seconds = (_num(activity.get("io_s")) or 0.0) + age
        facts.update(io=io, io_s=round(seconds, 3))
        kind = activity.get("io_kind")
        if isinstance(kind, str):
            facts["io_kind"] = kind[:40]
        what = "saving" if io == "save" else "loading"
        return Evidence(what, facts, f"{what} checkpoint")
    compiling = _num(activity.get("compiling_s"))
    if compiling is not None:
        facts["compiling_s"] = round(compiling + age, 3)
        return Evidence("compiling", facts, "compiling")
    if age > beats_stopped_s:
        facts["heartbeats_stopped_s"] = round(age, 3)
        return Evidence("unresponsive", facts, "unresponsive")
    fetch = _num(activity.get("data_s"))
    if fetch is not None and fetch >= window:
        facts["data_s"] = round(fetch, 3)
        return Evidence("data", facts, "waiting for data")
    still = _num(activity.get("still_s"))
    if still is None:  # a beat without the sampler's evidence: silence alone
        return Evidence("silent", facts, "silent")
    facts["still_s"] = round(still, 3)
    if still < window:
        phrase = facts.get("label", "busy")
        return Evidence("busy", facts, str(phrase))
    cpu = _num(activity.get("still_cpu_s")) or 0.0
    share = cpu / still if still > 0 else 0.0
    facts["cpu_share"] = round(share, 3)
    # spinning is judged against the CPU the thread could have had, where the beat says
    fair = _num(activity.get("still_fair_cpu_s"))
    if fair:
        share = cpu / fair
        facts["runnable_share"] = round(share, 3)
    pending = pending_collective(data)
    if pending is not None:
        facts["collective"] = pending
        return Evidence("collective", facts, _collective_text(pending))
    if share >= SPIN_CPU_SHARE:
        return Evidence("spinning", facts, "spinning")
    return Evidence("blocked", facts, "blocked")


def doing_of(data: Mapping[str, Any] | None, *, idle_s: float | None) -> tuple[str, float] | None:
    """What a rank idle for ``idle_s`` (a heartbeat's field) is doing, by its heartbeat's
    ``data``, for the page and ``/api/state``: ``("saving checkpoint", 45.0)``, ``("waiting
    for data", 12.0)``, ``("in all_reduce #181", 30.0)``, ``("validating", 20.0)``,
    ``("blocked", 70.0)``... None while the rank progresses or the beat says nothing."""
    idle = _num(idle_s)
    if idle is None or idle < SILENT_AFTER_S or not data:
        return None
    activity = data.get(ACTIVITY_KEY)
    if not isinstance(activity, Mapping):
        return None
    evidence = classify(data, silent_s=idle, timeout_s=idle, beat_age_s=0.0,
                        beats_stopped_s=math.inf)
    if evidence.waiting_on == "silent":
        return None
    seconds = idle
    for key in ("io_s", "compiling_s", "data_s"):
        value = evidence.facts.get(key)
        if isinstance(value, float):
            seconds = value
            break
    return evidence.doing, round(seconds, 3)
