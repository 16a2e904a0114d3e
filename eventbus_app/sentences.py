"""One sentence per event, for people: the agent's console, the job view's page, the
webhook and TensorBoard's text, and the timeline plot all say an event with
:func:`sentence`, so a failure reads the same wherever it is read::

    rank 1 failed (exit code 3: RuntimeError: bad config)
    rank 0 was stopped by the agent (SIGTERM) because another rank failed
    rank 1 stalled for 5.2 s (train.py:18)
    rank 2 is slow at step 120: step time 0.41 s, 2.6 x its peers' median 0.16 s
    the group restarts as attempt 1 (1 restart left): rank 1 failed (exit code 3)
    the job was stopped (exit code 3): rank 1 failed (exit code 3); STOP from fatal
    drain: SIGTERM on node 1, 20 s to stop
    the job was preempted by SIGTERM on node 1 (exit code 75): every rank stopped at step
    42; 1.4 s of the 20 s grace used
    no rank made a step for 612 s (the last at step 1234; --alert-after 600 s): rank 3 on
    node-2 at data.py:10 (step 1234); ranks 0, 1, 2 on node-1 at train.py:42 (step 1234)

The alerting sinks (the webhook, W&B) name each rank with its host, ``rank 1 on node-17
failed (exit code 3: ...)``: ``sentence(event, host=True)``.

Facts travel as fields, prose is made here, once: what a reader decides on (a stop, a
collateral exit, the job's outcome) is read from the events' fields (``cause``,
``data["stopped_by_agent"]``, ``state``, ``data["drain"]``) by :func:`cause_of`,
:func:`stopped_by_agent`, :func:`job_outcome` and :func:`drain_facts`, never from a sentence.
A long message is cut by one rule, :func:`first_line`.

An event is anything shaped like one (:class:`EventLike`): a typed :class:`eventbus.Event`,
a :class:`~eventbus.app.readers.records.Record` read back from a file (typed fields in its
``fields`` mapping, the context in its ``context`` mapping), or an adapter that shows a
record's fields as attributes. A file written before a field existed is read with a
fallback, never with a pattern over prose.

A base module of the application: torch-free, it imports only the core and
:mod:`eventbus.app.health.stacks`.
"""

from __future__ import annotations

import math
import signal as signals
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any
from typing import Protocol

from eventbus.app.health.stacks import where_of
from eventbus.events import Cause

__all__ = [
    "MESSAGE_CHARS",
    "REASON_CHARS",
    "EventLike",
    "as_int",
    "as_number",
    "cause_of",
    "drain_banner",
    "drain_facts",
    "drain_result",
    "first_line",
    "job_outcome",
    "restarts_text",
    "sentence",
    "stopped_by_agent",
]

#: characters of a failure's message in its sentence (a traceback's exception line)
MESSAGE_CHARS = 200
#: characters of a restart's or an end's ``reason`` in its sentence (the reason holds a
#: failure's sentence and the decision, so it is allowed more)
REASON_CHARS = 400

_CAUSES = frozenset(c.value for c in Cause)
#: the state of a drained job's ``AGENT_EXIT`` (the agent's drain, not torch's states)
PREEMPTED = "PREEMPTED"


class EventLike(Protocol):
    """What :func:`sentence` reads: ``type`` (an :class:`~eventbus.EventType` or its name)
    and ``data``; the typed fields as attributes or in a ``fields`` mapping; the context
    (``rank``, ``restart_count``, ...) in a ``context`` mapping or object, or as
    attributes."""

    @property
    def type(self) -> str: ...

    @property
    def data(self) -> Mapping[str, Any]: ...


# -- reading an event, typed or read back ------------------------------------------------


def _type_name(event: EventLike) -> str:
    return str(event.type)


def _field(event: EventLike, name: str) -> Any:
    """A typed field: from a record's ``fields`` mapping, else the attribute (None when the
    event has no such field)."""
    fields = getattr(event, "fields", None)
    if isinstance(fields, Mapping):
        return fields.get(name)
    return getattr(event, name, None)


def _context(event: EventLike, name: str) -> Any:
    context = getattr(event, "context", None)
    if isinstance(context, Mapping):
        return context.get(name)
    if context is not None:
        return getattr(context, name, None)
    return getattr(event, name, None)


def _data(event: EventLike) -> Mapping[str, Any]:
    data = getattr(event, "data", None)
    return data if isinstance(data, Mapping) else {}


def as_int(value: object) -> int | None:
    """``value`` if it is an int (not a bool), else None: a field read back may be anything."""
    return value if type(value) is int else None


def as_number(value: object) -> float | None:
    """``value`` as a float if it is a finite int or float (not a bool), else None."""
    if type(value) in (int, float) and math.isfinite(value):  # type: ignore[arg-type]
        return float(value)  # type: ignore[arg-type]
    return None


def _str(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def _rank(event: EventLike) -> int | None:
    """The worker an event is about: ``worker_id`` for the agent's worker events, the
    recording process's rank otherwise."""
    worker = as_int(_field(event, "worker_id"))
    return worker if worker is not None else as_int(_context(event, "rank"))


def _who(event: EventLike) -> str:
    rank = _rank(event)
    return f"rank {rank}" if rank is not None else "a worker"


# -- the facts ---------------------------------------------------------------------------


def first_line(message: str | None, *, limit: int = MESSAGE_CHARS) -> str:
    """The line of a message that says the most, in at most ``limit`` characters: a
    traceback's last line (the exception), else the first line that is not blank; its
    whitespace collapsed, cut with ``...``. ``""`` for no message."""
    if not message:
        return ""
    lines = [line for line in message.splitlines() if line.strip()]
    if not lines:
        return ""
    line = lines[-1] if lines[0].lstrip().startswith("Traceback") else lines[0]
    text = " ".join(line.split())
    return text if len(text) <= limit else text[:max(0, limit - 3)] + "..."


def cause_of(event: EventLike) -> str | None:
    """Why a worker exited, the group restarted or the job ended: the event's ``cause``
    field (a :class:`~eventbus.Cause` value; one this version does not know reads as
    ``"failure"``). A file written before the field: ``"failure"`` for a non-zero
    ``WORKER_EXIT`` and an unsuccessful ``AGENT_EXIT`` (``"preemption"`` for its state
    ``PREEMPTED``), ``"stall"`` for ``WORKER_STALLED``; None for a success and for what
    says no cause."""
    kind = _type_name(event)
    cause = _str(_field(event, "cause"))
    if cause is not None:
        return cause if cause in _CAUSES else Cause.FAILURE.value
    if kind == "WORKER_EXIT":
        return Cause.FAILURE.value if _field(event, "exit_code") not in (0, None) else None
    if kind == "AGENT_EXIT":
        state = _field(event, "state")
        if state == PREEMPTED:
            return Cause.PREEMPTION.value
        return Cause.FAILURE.value if state not in ("SUCCEEDED", None) else None
    if kind == "WORKER_STALLED":
        return Cause.STALL.value
    return None


def stopped_by_agent(event: EventLike) -> bool:
    """A ``WORKER_EXIT`` of a worker its agent stopped (a collateral exit: another rank
    failed or stalled, a STOP, the group re-formed), not a failure of its own: the agent
    marks it ``data["stopped_by_agent"]``, and its ``cause`` is then what made the agent
    stop the group; a worker's own failure has the cause ``"failure"`` and no mark."""
    if _type_name(event) != "WORKER_EXIT":
        return False
    if _data(event).get("stopped_by_agent") is True:
        return True
    cause = _str(_field(event, "cause"))
    return cause is not None and cause != Cause.FAILURE.value


def job_outcome(event: EventLike) -> str:
    """How a job ended, from its ``AGENT_EXIT``: ``"succeeded"``, ``"stopped"`` (a
    reactor's STOP here or on another node: ``cause`` ``"stop"`` or ``"remote_stop"``),
    ``"preempted"`` (a drain signal drained it: state ``PREEMPTED``, ``cause``
    ``"preemption"``; neither a failure nor a success) or ``"failed"`` (anything else, a
    file without ``cause`` included) - the words of ``/api/state``'s ``status``, and of
    ``eventbus plot``'s heading."""
    if _field(event, "state") == "SUCCEEDED":
        return "succeeded"
    cause = cause_of(event)
    if cause in (Cause.STOP.value, Cause.REMOTE_STOP.value):
        return "stopped"
    if cause == Cause.PREEMPTION.value:
        return "preempted"
    return "failed"


def drain_facts(event: EventLike) -> dict[str, Any] | None:
    """The drain of a preempted job's ``AGENT_EXIT`` (``data["drain"]``), each value read
    as its type or None (a file may hold anything): ``signal``, ``node``, ``grace_s``,
    ``used_s``, ``stop_step``, ``late_ranks`` (sorted ints), ``failed_ranks`` (rank ->
    exit code, ints) and ``escalated``. None when the event holds no drain."""
    drain = _data(event).get("drain")
    if not isinstance(drain, Mapping):
        return None
    late = drain.get("late_ranks")
    failed = drain.get("failed_ranks")
    failed_ranks: dict[int, int] = {}
    if isinstance(failed, Mapping):
        for key, code in failed.items():
            rank, value = _rank_key(key), as_int(code)
            if rank is not None and value is not None:
                failed_ranks[rank] = value
    return {
        "signal": _str(drain.get("signal")),
        "node": as_int(drain.get("node")),
        "grace_s": as_number(drain.get("grace_s")),
        "used_s": as_number(drain.get("used_s")),
        "stop_step": as_int(drain.get("stop_step")),
        "late_ranks": sorted({r for r in late if as_int(r) is not None})
        if isinstance(late, list) else [],
        "failed_ranks": dict(sorted(failed_ranks.items())),
        "escalated": drain.get("escalated") is True,
    }


def _rank_key(key: object) -> int | None:
    """A rank written as a JSON object's key (``"3"``), or as an int."""
    if as_int(key) is not None:
        return as_int(key)
    if isinstance(key, str) and key.isdigit():
        return int(key)
    return None


def restarts_text(left: int) -> str:
    """``1 restart left``, ``2 restarts left``."""
    return f"{left} restart{'' if left == 1 else 's'} left"


def _seconds(value: float) -> str:
    """``20 s``, ``1.8 s``, ``3 s``: a drain's times, as a person reads them."""
    text = f"{value:.0f}" if abs(value) >= 10 else f"{value:.1f}".removesuffix(".0")
    return f"{text} s"


#: ranks named one by one in a sentence at most (more: "and N more")
_RANKS_NAMED = 8


def _ranks_text(ranks: list[int]) -> str:
    """``rank 1``, ``ranks 1, 3``, ``ranks 0, 1, ... and 56 more``."""
    named = ", ".join(map(str, ranks[:_RANKS_NAMED]))
    if len(ranks) > _RANKS_NAMED:
        named += f" and {len(ranks) - _RANKS_NAMED} more"
    return f"rank{'' if len(ranks) == 1 else 's'} {named}"


def _ended_how(code: int) -> str:
    if code < 0:
        try:
            return f"ended on {signals.Signals(-code).name}"
        except ValueError:
            return f"ended on signal {-code}"
    return f"ended with exit code {code}"


def drain_result(facts: Mapping[str, Any] | None) -> str:
    """How a drain went, from :func:`drain_facts`: ``every rank stopped at step 42``;
    ``the other ranks stopped at step 34; rank 1 did not stop in time``; ``no stop step
    was agreed; ranks 0, 1 ended on SIGTERM``. ``the job drained`` without facts."""
    if not facts:
        return "the job drained"
    stop = as_int(facts.get("stop_step"))
    late = [r for r in facts.get("late_ranks") or () if as_int(r) is not None]
    failed = facts.get("failed_ranks")
    failed = failed if isinstance(failed, Mapping) else {}
    if stop is None:
        parts = ["no stop step was agreed"]
    elif late or failed:
        parts = [f"the other ranks stopped at step {stop}"]
    else:
        parts = [f"every rank stopped at step {stop}"]
    if late:
        parts.append(f"{_ranks_text(late)} did not stop in time")
    how: dict[str, list[int]] = {}
    for rank, code in failed.items():
        if as_int(rank) is not None and as_int(code) is not None:
            how.setdefault(_ended_how(code), []).append(rank)
    parts += [f"{_ranks_text(sorted(ranks))} {ended}" for ended, ranks in how.items()]
    return "; ".join(parts)


def _drain_origin(signal: str | None, node: int | None) -> str:
    """``SIGTERM on node 1``: what started a drain."""
    what = signal or "a drain signal"
    return f"{what} on node {node}" if node is not None else what


def drain_banner(*, reason: str | None = None, signal: str | None = None,
                 node: int | None = None, left_s: float | None = None,
                 facts: Mapping[str, Any] | None = None, ended: bool = False) -> str:
    """The job view's line about a drain: ``draining: SIGTERM on node 1, 12 s left``
    while the job drains (``reason``: the ``PREEMPTING``'s, else its ``signal`` and
    ``node``; ``left_s``: the time left), ``preempted: every rank stopped at step 42``
    once it ended (``facts``: the ``AGENT_EXIT``'s :func:`drain_facts`)."""
    if ended:
        return f"preempted: {drain_result(facts)}"
    text = f"draining: {reason or _drain_origin(signal, node)}"
    return text + (f", {_seconds(max(0.0, left_s))} left" if left_s is not None else "")


# -- the sentences -----------------------------------------------------------------------

#: why the agent stopped a worker, by the cause it stopped the group for
_STOPPED_BECAUSE = {
    Cause.FAILURE.value: "because another rank failed",
    Cause.STALL.value: "because a rank stalled",
    Cause.STOP.value: "because a reactor stopped the job",
    Cause.REMOTE_STOP.value: "because another node stopped the job",
    Cause.MEMBERSHIP.value: "because the group re-forms through the rendezvous",
    Cause.ERROR.value: "because the agent failed",
    Cause.PREEMPTION.value: "because it did not stop within the drain's grace",
}


def _worker_exit(event: EventLike, short: bool) -> str:
    code = _field(event, "exit_code")
    signal = _str(_field(event, "signal"))
    how = f"signal {signal}" if signal else f"exit code {code}"
    data = _data(event)
    if data.get("drained") is True and data.get("stopped_by_agent") is not True:
        # it ended by itself during a drain: it stopped as asked, or (not 0) on the
        # signal its own bootstrap forwarded at once, or it failed meanwhile
        text = ("stopped for the drain" if code == 0 else "ended during the drain") + \
            f" ({how})"
        if short:
            return text
        message = "" if code == 0 else first_line(_str(_field(event, "message")))
        return f"{_who(event)} {text}" + (f": {message}" if message else "")
    if stopped_by_agent(event):
        if short and _str(_field(event, "cause")) == Cause.PREEMPTION.value:
            return f"did not stop in time ({signal or how})"
        text = f"stopped by the agent ({signal or how})"
        if short:
            return text
        if _data(event).get("stalled") is True:
            why = "because it stalled"
        else:
            # a file from before the cause field cannot tell which
            cause = _str(_field(event, "cause"))
            why = _STOPPED_BECAUSE.get(cause or "", "because another rank failed or stalled")
        return f"{_who(event)} was {text} {why}"
    if code == 0:
        text = f"finished ({how})"
        return text if short else f"{_who(event)} {text}"
    if short:
        return f"failed ({how})"
    message = first_line(_str(_field(event, "message")))
    return f"{_who(event)} failed ({how}{': ' + message if message else ''})"


def _worker_stalled(event: EventLike, short: bool) -> str:
    silent = as_number(_field(event, "silent_s"))
    data = _data(event)
    # what the evidence says it waits on: "blocked", "in barrier #16"...; a rank
    # waiting for data is reported, not stalled
    doing = _str(data.get("doing"))
    waiting = "waiting for data" if data.get("waiting_on") == "data" else None
    text = (waiting or "stalled") + (f" for {silent:.1f} s" if silent is not None else "")
    if doing and not waiting and data.get("waiting_on") not in (None, "silent"):
        text += f", {first_line(doing, limit=60)}"
    if short:
        return text
    where = _str(data.get("where"))
    if where is None:
        stack = _str(data.get("stack"))
        where = where_of(stack) if stack else None
    return f"{_who(event)} {text}" + (f" ({first_line(where)})" if where else "")


def _worker_slow(event: EventLike, short: bool) -> str:
    factor = as_number(_field(event, "factor"))
    if short:
        return "slow" + (f" ({factor:.2g} x its peers)" if factor is not None else "")
    step = as_int(_field(event, "step"))
    text = f"{_who(event)} is slow" + (f" at step {step}" if step is not None else "")
    took = as_number(_field(event, "step_time_s"))
    median = as_number(_field(event, "median_step_time_s"))
    # lock-step training compares the compute time between collectives, not step times
    # (data["basis"], set by the agent's straggler watch)
    what = ("compute time between collectives" if _data(event).get("basis") == "compute_s"
            else "step time")
    if took is not None and median is not None and factor is not None:
        return (f"{text}: {what} {took:.3g} s, {factor:.2g} x its peers' median "
                f"{median:.3g} s")
    return text + (f": {factor:.2g} x its peers" if factor is not None else "")


def _worker_start(event: EventLike, short: bool) -> str:
    return "started" if short else f"{_who(event)} started"


def _worker_restart(event: EventLike, short: bool) -> str:
    attempt = as_int(_field(event, "attempt"))
    number = f" as attempt {attempt}" if attempt is not None else ""
    left = as_int(_field(event, "restarts_left"))
    if _str(_field(event, "cause")) == Cause.MEMBERSHIP.value:
        # torch's decision, not a failure's: which of the two it was is not known here
        return (f"the group re-forms through the rendezvous{number} (another node "
                "restarted it, or nodes joined; this uses no restart"
                + (f"; {restarts_text(left)})" if left is not None else ")"))
    text = f"the group restarts{number}" + (f" ({restarts_text(left)})"
                                              if left is not None else "")
    reason = first_line(_str(_field(event, "reason")), limit=REASON_CHARS)
    return text if short or not reason else f"{text}: {reason}"


def _agent_exit(event: EventLike, short: bool) -> str:
    state = _str(_field(event, "state")) or "?"
    outcome = job_outcome(event)
    if outcome == "succeeded":
        return "the job succeeded"
    if outcome == "preempted":
        return _preempted(event, short)
    cause = cause_of(event)
    if outcome == "stopped":
        text = "the job was stopped"
    elif cause == Cause.ERROR.value:
        text = "the agent failed"
    elif state == "FAILED" or _str(_field(event, "cause")) is not None:
        text = "the job failed"
    else:
        text = f"the job ended {state}"  # a state of torch's this version does not name
    code = as_int(_field(event, "exit_code"))
    if code is not None:
        text += f" (exit code {code})"
    reason = first_line(_str(_field(event, "reason")), limit=REASON_CHARS)
    return text if short or not reason else f"{text}: {reason}"


def _preempted(event: EventLike, short: bool) -> str:
    """A drained job's end: what drained it and how the ranks stopped, from
    ``data["drain"]`` (the ``reason``, the agent's own line, only without it)."""
    facts = drain_facts(event)
    code = as_int(_field(event, "exit_code"))
    exit_text = f" (exit code {code})" if code is not None else ""
    if short:
        return f"the job was preempted{exit_text}"
    if facts is None:
        reason = first_line(_str(_field(event, "reason")), limit=REASON_CHARS)
        return f"the job was preempted{exit_text}" + (f": {reason}" if reason else "")
    text = (f"the job was preempted by {_drain_origin(facts['signal'], facts['node'])}"
            f"{exit_text}: {drain_result(facts)}")
    used, grace = facts["used_s"], facts["grace_s"]
    if used is not None and grace is not None:
        text += f"; {_seconds(used)} of the {_seconds(grace)} grace used"
    if facts["escalated"]:
        text += ", cut short by a second signal"
    return text


def _preempting(event: EventLike, short: bool, host: str | None = None) -> str:
    deadline = as_number(_field(event, "deadline_s"))
    grace = as_number(_field(event, "grace_s"))
    if deadline is None:
        left = ""
    elif grace is not None and grace - deadline > 0.5:
        left = f"{_seconds(deadline)} of the {_seconds(grace)} grace left"
    else:
        left = f"{_seconds(deadline)} to stop"
    if short:
        return "drain" + (f" ({left})" if left else "")
    reason = first_line(_str(_field(event, "reason"))) or _drain_origin(
        _str(_field(event, "signal")), as_int(_field(event, "node")))
    if host:  # the host of the agent that got the signal
        reason += f" ({host})"
    return f"drain: {reason}" + (f", {left}" if left else "")


def _rendezvous(event: EventLike, short: bool) -> str:
    state = _str(_field(event, "state")) or "SUCCEEDED"
    if state == "FAILED":
        message = "" if short else first_line(_str(_field(event, "message")))
        return "the rendezvous failed" + (f": {message}" if message else "")
    duration = as_number(_field(event, "duration_s"))
    text = "the rendezvous succeeded" if state == "SUCCEEDED" else \
        f"the rendezvous ended {state}"
    return text + (f" in {duration:.1f} s" if duration is not None and not short else "")


def _events_lost(event: EventLike, short: bool) -> str:
    count = as_int(_field(event, "count"))
    text = f"{count if count is not None else 'some'} events lost"
    if short:
        return text
    source = _str(_field(event, "source")) or "?"
    reason = first_line(_str(_field(event, "reason")))
    return f"{text} ({source}{': ' + reason if reason else ''})"


def _recovered(event: EventLike, short: bool) -> str:
    total = as_number(_field(event, "total_s"))
    text = "recovered" + (f" in {total:.1f} s" if total is not None else "")
    phases = _data(event).get("phases")
    if short or not isinstance(phases, dict):
        return text
    parts = [f"{name.replace('_', ' ')} {value:.2f}" if isinstance(value, (int, float))
             and not isinstance(value, bool) else f"{name.replace('_', ' ')} -"
             for name, value in phases.items()]
    attempt = as_int(_field(event, "attempt"))
    who = f"attempt {attempt} " if attempt is not None else ""
    return f"{who}{text} ({', '.join(parts)})" if parts else f"{who}{text}"


def _host_evicted(event: EventLike, short: bool) -> str:
    host = _field(event, "host")
    faults = as_int(_field(event, "faults"))
    text = f"{host or 'a host'} evicted"
    if short:
        return text
    reason = _field(event, "reason")
    counted = f" after {faults} host fault{'s' if faults != 1 else ''}" if faults else ""
    return f"{text}{counted}" + (f" ({reason})" if reason else "")


#: places of a stuck job named one by one at most (more: "and N more places")
_PLACES_NAMED = 4


def _place_text(place: Mapping[str, Any]) -> str | None:
    """``ranks 0, 1 on node-1 at train.py:42 (step 120)``: one group of ``JOB_STUCK``'s
    ``data["places"]``."""
    ranks = sorted({r for r in place.get("ranks") or () if as_int(r) is not None})
    if not ranks:
        return None
    hosts = [h for h in place.get("hosts") or () if _str(h)]
    text = _ranks_text(ranks)
    if len(hosts) == 1:
        text += f" on {hosts[0]}"
    elif hosts:
        named = ", ".join(hosts[:3]) + (", ..." if len(hosts) > 3 else "")
        text += f" on {len(hosts)} hosts ({named})"
    where = _str(place.get("where"))
    text += f" at {first_line(where, limit=120)}" if where else ", place unknown"
    step = as_int(place.get("step"))
    return text + (f" (step {step})" if step is not None else "")


def _job_stuck(event: EventLike, short: bool) -> str:
    silent = as_number(_field(event, "silent_s"))
    text = "no rank made a step" + (f" for {_seconds(silent)}" if silent is not None else "")
    if short:
        return f"stuck: no step for {_seconds(silent)}" if silent is not None else "stuck"
    step = as_int(_field(event, "step"))
    after = as_number(_field(event, "after_s"))
    notes = []
    if step is not None:
        notes.append(f"the last at step {step}")
    if after is not None:
        notes.append(f"--alert-after {_seconds(after)}")
    if notes:
        text += f" ({'; '.join(notes)})"
    places = _data(event).get("places")
    said = [p for p in (_place_text(place) for place in places[:_PLACES_NAMED]
                        if isinstance(place, Mapping)) if p] \
        if isinstance(places, list) else []
    if not said:
        return text
    more = len(places) - _PLACES_NAMED if isinstance(places, list) else 0
    return f"{text}: {'; '.join(said)}" + (f"; and {more} more places" if more > 0 else "")


def _job_unstuck(event: EventLike, short: bool) -> str:
    if short:
        return "progress resumed"
    stuck = as_number(_field(event, "stuck_s"))
    step = as_int(_field(event, "step"))
    rank = as_int(_field(event, "worker_id"))
    text = "progress resumed"
    if rank is not None:
        host = _str(_data(event).get("host"))
        text += f": rank {rank}" + (f" on {host}" if host else "") + " made " + \
            (f"step {step}" if step is not None else "a step")
    return text + (f" after {_seconds(stuck)} without one" if stuck is not None else "")


_SENTENCES: dict[str, Callable[[EventLike, bool], str]] = {
    "WORKER_START": _worker_start,
    "WORKER_EXIT": _worker_exit,
    "WORKER_STALLED": _worker_stalled,
    "WORKER_SLOW": _worker_slow,
    "RECOVERED": _recovered,
    "HOST_EVICTED": _host_evicted,
    "WORKER_RESTART": _worker_restart,
    "AGENT_EXIT": _agent_exit,
    "RENDEZVOUS": _rendezvous,
    "EVENTS_LOST": _events_lost,
    "PREEMPTING": _preempting,
    "JOB_STUCK": _job_stuck,
    "JOB_UNSTUCK": _job_unstuck,
}


def sentence(event: EventLike, *, short: bool = False, host: bool = False) -> str:
    """The event said for people, in one line with no final period: see the module
    docstring for examples. ``short``: the form a mark next to the rank's row reads (the
    plot): without the rank, the message, the place and the reason, e.g. ``failed (exit
    code 3)``, ``stalled for 5.2 s``, ``the group restarts as attempt 1 (1 restart
    left)``. Any other type: its name, and the rank it comes from.

    ``host``: the rank is named with its host, ``rank 5 on node-17 failed (...)``, and a
    drain with the host that got the signal (the event's ``context.hostname``, which
    ``EVENTBUS_HOSTNAME`` sets): the form of the alerts (the webhook, W&B), read away from
    the job. The console and the page leave it out (their rows already say the host)."""
    kind = _type_name(event)
    say = _SENTENCES.get(kind)
    name = _str(_context(event, "hostname")) if host and not short else None
    if kind == "PREEMPTING":
        return _preempting(event, short, name)
    if say is not None:
        text = say(event, short)
    else:
        rank = _rank(event)
        text = kind if short or rank is None else f"{kind} from rank {rank}"
    if name is None:
        return text
    who = _who(event)
    if text.startswith(f"{who} ") and _rank(event) is not None:
        return f"{who} on {name}{text[len(who):]}"
    if text.endswith(f" from {who}") and _rank(event) is not None:
        return f"{text} on {name}"
    return text
