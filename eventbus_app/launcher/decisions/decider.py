"""The decider: what the agent does about a failure or a stall, and how the job ends.

It publishes each failure (``WORKER_EXIT``, ``WORKER_STALLED``) on the agent's bus, where
the reactors are subscribers, collects their answers, and applies the rules of
docs/run.md ("Reactors"): ``STOP`` from any reactor (or from another node) fails the job
at once, restarts left or not; ``RESTART`` restarts the group using one of
``--max-restarts``; no decision leaves torchrun's policy (restart while restarts are left).
At the end it says the job's state, exit code, cause and reason.

Torch-free: the agent gives it the bus, the restarts left and the next attempt's number,
and applies the :class:`Outcome` (its torch loop restarts or fails the group); a unit test
drives it with a bus and events alone (tests/test_decider.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import Literal
from typing import Protocol

import attrs

from eventbus.app.launcher.cli import console
from eventbus.app.sentences import restarts_text
from eventbus.app.sentences import sentence
from eventbus.bus import Bus
from eventbus.bus import Subscription
from eventbus.events import Cause
from eventbus.events import Decision
from eventbus.events import Event
from eventbus.events import EventType
from eventbus.events import WorkerExit
from eventbus.events import WorkerStalled

__all__ = [
    "REACTOR_ANSWERS",
    "Decider",
    "Ending",
    "Outcome",
    "Reactor",
]

logger = logging.getLogger("eventbus")

#: a reactor: called with each failed worker's ``WORKER_EXIT`` and each ``WORKER_STALLED``
#: (``Any``: a reactor typed ``(WorkerExit) -> ...`` is accepted); ``None`` = no decision
Reactor = Callable[[Any], "Decision | None"]

#: what a reactor may return, as the reactor-error report says it
REACTOR_ANSWERS = "eventbus.Decision.STOP, eventbus.Decision.RESTART or None"


class Drain(Protocol):
    """What the decider reads of the job's drain
    (:class:`~eventbus.app.launcher.drain.state.Drain`): once it started, no restart, and the
    job ends with the drain's exit code and line."""

    @property
    def active(self) -> bool: ...

    @property
    def exit_code(self) -> int: ...

    def reason(self) -> str: ...

    def summary_line(self) -> str: ...


@attrs.frozen
class Outcome:
    """What the decider decided about one round of failures.

    ``action``: ``"stop"`` (a STOP: no restart, the stop exit code), ``"restart"`` (the
    group restarts, one restart used), ``"fail"`` (no restart is left) or ``"continue"``
    (a report that no reactor acted on: the group runs on). ``cause``: the
    :class:`~eventbus.events.Cause` of what happens next. ``line``: the console line (the
    culprits, then the outcome). ``announce``: a STOP of this node that the other nodes
    must hear (the job-wide STOP key)."""

    action: Literal["stop", "restart", "fail", "continue"]
    cause: str
    line: str
    stop_by: tuple[str, ...] = ()
    restart_by: tuple[str, ...] = ()
    announce: bool = False


@attrs.frozen
class Ending:
    """How the job ends: ``AGENT_EXIT``'s state, exit code, reason and cause."""

    state: str
    exit_code: int
    reason: str | None
    cause: str | None


class Decider:
    """Reactors, restart budget, STOP (local and job-wide) and the job's ending.

    ``remote_stop``: a callable that returns the reason of a STOP another node announced,
    or None (the agent's job-wide STOP watch; none with one node).
    """

    def __init__(self, bus: Bus, *, max_restarts: int, stop_exit_code: int,
                 remote_stop: Callable[[], str | None] = lambda: None,
                 drain: Drain | None = None) -> None:
        self.bus = bus
        #: the job's drain (drain/state.py): once it started, the job ends PREEMPTED
        self.drain = drain
        self.max_restarts = int(max_restarts)
        self.stop_exit_code = int(stop_exit_code)
        self.remote_stop = remote_stop
        #: reactors that raised or returned something other than an answer
        self.reactor_errors = 0
        self._subs: list[Subscription] = []
        self._collecting = threading.local()
        #: the reactors reported for a wrong answer, by id of their WORKER_EXIT subscription
        #: (two instances of one class are two reactors)
        self._misanswered: set[int] = set()
        #: the job's STOP: its reason and cause (stop, remote_stop), once decided
        self.stop_reason: str | None = None
        self.stop_cause: str | None = None
        #: the sentence and cause of the latest failure decided on (AGENT_EXIT's reason)
        self.failure_summary: str | None = None
        self.failure_cause: str | None = None
        #: what the next WORKER_RESTART says; None: a membership change (torch's decision)
        self._restart: tuple[str, str] | None = None

    # -- reactors --------------------------------------------------------------------------
    def add_reactor(self, reactor: Reactor) -> Subscription:
        """Subscribe ``reactor`` to the failures this decider publishes: each failed
        worker's ``WORKER_EXIT`` and each ``WORKER_STALLED``, in the monitor thread, before
        the group is stopped. A reactor with an ``attach(bus)`` method is attached first
        (reactors that watch other events, e.g. the loss, subscribe there).

        ``STOP``, ``RESTART`` and ``None`` are the only answers: a reactor that returns
        anything else (the string ``"stop"``, ``True``) counts as no decision and is
        reported once, naming what it returned and what is accepted; a reactor that raises
        counts as no decision and is logged with its traceback. Both count in
        :attr:`reactor_errors`."""
        if not callable(reactor):
            raise TypeError(f"a reactor must be callable (event) -> Decision | None, got "
                            f"{type(reactor).__name__}")
        attach = getattr(reactor, "attach", None)
        if callable(attach):
            attach(self.bus)
        name = name_of(reactor)
        key: list[int] = []  # id of this reactor's subscription, set below

        def consult(event: Event) -> None:
            decisions = getattr(self._collecting, "decisions", None)
            if decisions is None:  # not one of this decider's failure reports
                return
            try:
                answer = reactor(event)
            except Exception:
                self.reactor_errors += 1
                logger.exception("eventbus: reactor %s raised on %s; counted as no decision",
                                 name, summary_of(event))
                return
            if answer is None:
                return
            if not isinstance(answer, Decision):
                self.reactor_errors += 1
                if key[0] not in self._misanswered:  # once per reactor
                    self._misanswered.add(key[0])
                    logger.error(
                        "eventbus: reactor error: %s returned %s on %s; a reactor returns "
                        "%s: counted as no decision (reported once per reactor; "
                        "EventAgent.reactor_errors counts them all)",
                        name, describe_answer(answer), summary_of(event), REACTOR_ANSWERS)
                return
            decisions.append((answer, name))

        sub = self.bus.subscribe(EventType.WORKER_EXIT, on_event=consult, where=_is_failure)
        key.append(id(sub))
        self._subs.append(sub)
        self._subs.append(self.bus.subscribe(EventType.WORKER_STALLED, on_event=consult))
        return sub

    def publish(self, event: Event) -> list[tuple[Decision, str]]:
        """Publish one failure on the bus and return the reactors' answers to it."""
        decisions: list[tuple[Decision, str]] = []
        self._collecting.decisions = decisions
        try:
            self.bus.publish(event)
        finally:
            self._collecting.decisions = None
        return decisions

    # -- decisions -------------------------------------------------------------------------
    @property
    def stopped(self) -> bool:
        """Whether a STOP (this node's reactors, or another node's) ends the job."""
        return self.stop_reason is not None or self.remote_stop() is not None

    def decide(self, failures: Sequence[WorkerExit | WorkerStalled], *, restarts_left: int,
               next_attempt: int, report_only: bool = False) -> Outcome:
        """Publish each failure (the first is the cause), collect the answers and decide.

        ``restarts_left``: restarts still allowed; ``next_attempt``: the number the group
        would restart as. ``report_only``: the failures are reports (ranks waiting for
        data): with no STOP or RESTART from a reactor the group runs on."""
        decisions: list[tuple[Decision, str]] = []
        for event in failures:
            decisions.extend(self.publish(event))
        if report_only and not any(d in (Decision.STOP, Decision.RESTART)
                                   for d, _ in decisions) and self.remote_stop() is None:
            return Outcome("continue", str(Cause.STALL),
                           f"{console.culprits_text(failures)}: reported; no restart (a "
                           "reactor may return RESTART or STOP for it)")
        first = failures[0]
        summary = summary_of(first)
        cause = str(Cause.STALL if isinstance(first, WorkerStalled) else Cause.FAILURE)
        self.failure_summary, self.failure_cause = summary, cause
        stops = tuple(name for decision, name in decisions if decision is Decision.STOP)
        restarts = tuple(name for decision, name in decisions if decision is Decision.RESTART)
        remote = self.remote_stop()
        stop_cause = str(Cause.STOP)
        if not stops and remote is not None:
            stops, stop_cause = (f"another node ({remote})",), str(Cause.REMOTE_STOP)
        culprits = console.culprits_text(failures)
        drain = self.drain
        if drain is not None and drain.active:
            line = f"{culprits}; the job is draining ({drain.reason()}): no restart"
            return Outcome("fail", cause, line, restart_by=restarts)
        if stops:
            self.stop_reason = f"{summary}; STOP from {', '.join(stops)}"
            self.stop_cause = stop_cause
            line = (f"{culprits}; STOP from {', '.join(stops)}: stopping the job (exit code "
                    f"{self.stop_exit_code}; {restarts_text(restarts_left)} unused)")
            return Outcome("stop", stop_cause, line, stop_by=stops, restart_by=restarts,
                           announce=remote is None)
        if restarts_left <= 0:
            if not restarts:
                self._restart = (summary, cause)
            line = culprits + "; " + (
                f"RESTART from {', '.join(restarts)}, but no" if restarts else "no") + (
                f" restart is left (--max-restarts {self.max_restarts}): the job fails")
            return Outcome("fail", cause, line, restart_by=restarts)
        by = f"RESTART from {', '.join(restarts)}: " if restarts else ""
        reason = f"{summary}; RESTART from {', '.join(restarts)}" if restarts else summary
        self._restart = (reason, cause)
        line = (f"{culprits}; {by}restarting the group as attempt {next_attempt} "
                f"({restarts_text(restarts_left - 1)})")
        return Outcome("restart", cause, line, restart_by=restarts)

    def stop_for_remote(self) -> str | None:
        """Another node's STOP reached this one: the console line the first time (the
        agent stops its workers and uses no restart), None after, or without one."""
        remote = self.remote_stop()
        if remote is None or self.stop_reason is not None:
            return None
        self.stop_reason = f"STOP on another node: {remote}"
        self.stop_cause = str(Cause.REMOTE_STOP)
        return (f"{self.stop_reason}: stopping this node's workers (exit code "
                f"{self.stop_exit_code})")

    def group_failed(self, state_name: str) -> None:
        """Torch's result failed the group with no failure to name (``UNHEALTHY``, say): the
        restart, if one follows, says so."""
        if self._restart is None:
            self._restart = (f"worker group {state_name}", str(Cause.FAILURE))

    def next_restart(self) -> tuple[str, str, bool]:
        """The reason and cause of the restart now under way, and whether a failure decided
        it (False: a membership change, torch's own decision through the rendezvous);
        consumed: the next restart starts afresh."""
        restart, self._restart = self._restart, None
        if restart is None:
            return ("membership change: the group re-forms through the rendezvous",
                    str(Cause.MEMBERSHIP), False)
        return (*restart, True)

    def ending(self, *, succeeded: bool | None, state: str | None = None,
               error: BaseException | None = None) -> Ending:
        """``AGENT_EXIT``: ``succeeded`` True (``state`` is torch's, e.g. SUCCEEDED), False
        (the group failed) or None (the agent raised ``error``). A drain that started
        decides the ending whatever the group did: ``PREEMPTED``, the drain's code."""
        drain = self.drain
        if drain is not None and drain.active:
            return Ending("PREEMPTED", drain.exit_code, drain.summary_line(),
                          str(Cause.PREEMPTION))
        if succeeded:
            return Ending(state or "SUCCEEDED", 0, None, None)
        remote = self.remote_stop()
        code = self.stop_exit_code if self.stopped else 1
        if succeeded is False:
            if self.stop_reason is not None:
                return Ending("FAILED", code, self.stop_reason, self.stop_cause)
            if remote is not None:
                return Ending("FAILED", code, f"STOP on another node: {remote}",
                              str(Cause.REMOTE_STOP))
            return Ending("FAILED", code, self.failure_summary or "worker group failed",
                          self.failure_cause or str(Cause.FAILURE))
        raised = f"{type(error).__name__}: {error}" if error is not None else None
        if self.stop_reason is not None:
            # a STOP's reason survives whatever torch raised on the way out
            return Ending("FAILED", code, f"{self.stop_reason} (then the agent raised "
                          f"{raised})", self.stop_cause)
        if remote is not None:
            return Ending("FAILED", code, f"STOP on another node: {remote} ({raised})",
                          str(Cause.REMOTE_STOP))
        return Ending("FAILED", code, raised, str(Cause.ERROR))

    def close(self) -> None:
        """Unsubscribe every reactor."""
        for sub in self._subs:
            sub.cancel()
        self._subs.clear()


def name_of(fn: object) -> str:
    """module.qualname for functions and classes, the repr for other callables."""
    name = getattr(fn, "__qualname__", None)
    if name is None:
        try:
            return repr(fn)[:200]
        except Exception:
            name = type(fn).__qualname__
    module = getattr(fn, "__module__", None) or type(fn).__module__
    return f"{module}.{name}"


def describe_answer(value: object) -> str:
    """What a reactor returned that is not an answer, for the reactor-error report."""
    try:
        shown = repr(value)
    except Exception:
        shown = f"<{type(value).__name__} with a failing __repr__>"
    if len(shown) > 80:
        shown = shown[:77] + "..."
    hint = ""
    if isinstance(value, str) and value.strip().upper() in Decision.__members__:
        hint = f" (did you mean eventbus.Decision.{value.strip().upper()}?)"
    return f"{shown} ({type(value).__name__}){hint}"


def summary_of(event: Event) -> str:
    """The short sentence of a failure that reasons carry (``WORKER_RESTART.reason``,
    ``AGENT_EXIT.reason``, the STOP key)."""
    return sentence(event)


def _is_failure(event: Event) -> bool:
    return isinstance(event, WorkerExit) and event.exit_code != 0
