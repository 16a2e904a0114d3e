"""The drain of the job view's model: when a drain signal drains the job, from its
``PREEMPTING`` to the ``AGENT_EXIT`` of state ``PREEMPTED``: its signal, node and deadline,
the ranks that did not stop in time and how it ended (docs/preemption.md).

:class:`Drain` is written under :class:`~eventbus.app.ui.state.JobState`'s lock only (by
the job-wide handlers, :mod:`eventbus.app.ui.job`); a snapshot takes a :meth:`Drain.copy`
and builds ``/api/state``'s ``drain`` from it on the reader's thread
(:meth:`Drain.to_json`).
"""

from __future__ import annotations

from typing import Any

from eventbus.app.sentences import as_int
from eventbus.app.sentences import as_number
from eventbus.app.sentences import drain_banner
from eventbus.app.sentences import first_line
from eventbus.app.sentences import sentence
from eventbus.app.ui.record_event import as_str

__all__ = ["Drain"]


class Drain:
    """The job's drain: from its ``PREEMPTING`` (None when only its end was seen) to the
    ``AGENT_EXIT`` of state ``PREEMPTED``; written under the state's lock only."""

    __slots__ = ("deadline", "deadline_s", "ended", "event", "exit", "facts", "grace_s",
                 "late", "node", "reason", "signal", "started", "stopped")

    def __init__(self) -> None:
        self.event: Any = None
        self.started: float | None = None
        self.deadline: float | None = None
        self.deadline_s: float | None = None
        self.grace_s: float | None = None
        self.reason: str | None = None
        self.signal: str | None = None
        self.node: int | None = None
        self.ended: float | None = None
        self.exit: Any = None
        #: the job's AGENT_EXIT's data["drain"] (sentences.drain_facts)
        self.facts: dict[str, Any] | None = None
        #: ranks that did not stop in time (their WORKER_EXIT, every node's AGENT_EXIT)
        self.late: set[int] = set()
        #: ranks that stopped by themselves (exit code 0)
        self.stopped = 0

    def copy(self) -> Drain:
        """A copy a reader can build from with the lock released."""
        other = Drain.__new__(Drain)
        for name in Drain.__slots__:
            setattr(other, name, getattr(self, name))
        other.late = set(self.late)
        return other

    def preempting(self, ev: Any, arrived: float) -> bool:
        """Note a ``PREEMPTING``; True when it began the drain (a later one of the same
        drain only brings its deadline forward)."""
        deadline_s = as_number(getattr(ev, "deadline_s", None))
        deadline = None if deadline_s is None else arrived + max(0.0, deadline_s)
        if self.event is not None:
            # another PREEMPTING of the same drain: the earlier deadline holds
            if deadline is not None and (self.deadline is None or deadline < self.deadline):
                self.deadline, self.deadline_s = deadline, deadline_s
            return False
        self.event, self.started = ev, arrived
        self.deadline, self.deadline_s = deadline, deadline_s
        self.grace_s = as_number(getattr(ev, "grace_s", None))
        self.signal = as_str(getattr(ev, "signal", None))
        self.node = as_int(getattr(ev, "node", None))
        self.reason = first_line(as_str(getattr(ev, "reason", None))) or None
        return True

    def preempted(self, ev: Any, arrived: float, facts: dict[str, Any] | None) -> None:
        """The job ended preempted (its ``AGENT_EXIT``, whose ``data["drain"]`` is
        ``facts``): what its ``PREEMPTING`` did not say (lost, a file cut) comes from it."""
        self.ended, self.exit, self.facts = arrived, ev, facts
        if facts is not None:
            self.signal = self.signal or facts["signal"]
            if self.node is None:
                self.node = facts["node"]
            if self.grace_s is None:
                self.grace_s = facts["grace_s"]

    def to_json(self, reference: float) -> dict[str, Any]:
        """The drain as ``/api/state``'s ``drain`` (docs/seeing-the-job.md): the
        ``PREEMPTING``'s facts, the time left at ``reference`` while it drains, the
        ``AGENT_EXIT``'s ``data["drain"]`` once it ended, and the page's line about it
        (``text``)."""
        facts = self.facts or {}
        active = self.ended is None
        left = None
        if active and self.deadline is not None:
            left = round(max(0.0, self.deadline - reference), 3)
        late = sorted(self.late)
        banner = drain_banner(reason=self.reason, signal=self.signal, node=self.node,
                              left_s=left, facts=self.facts, ended=not active)
        said = self.exit if self.exit is not None else self.event
        detail = None
        if said is not None:
            try:
                detail = sentence(said)
            except Exception:  # a record this version cannot say must not break the page
                detail = None
        return {
            "active": active,
            "reason": self.reason,
            "signal": self.signal,
            "node": self.node,
            "grace_s": self.grace_s,
            "deadline_s": self.deadline_s,
            "started": self.started,
            "deadline": self.deadline,
            "left_s": left,
            "ended": self.ended,
            "used_s": facts.get("used_s"),
            "stop_step": facts.get("stop_step"),
            "late_ranks": late,
            "failed_ranks": {str(r): c for r, c in (facts.get("failed_ranks") or {}).items()},
            "escalated": facts.get("escalated") is True,
            "stopped_in_time": self.stopped,
            "exit_code": None if self.exit is None else as_int(getattr(self.exit, "exit_code",
                                                                       None)),
            "text": banner,
            "detail": detail,
        }
