"""The job-wide part of the job view's model: who the job is, how it goes and ends, its
latest failure or stall, its drain and the losses reported; and the handlers of the events
that change it, which also note those events on the ranks and the timeline.

:class:`JobSummary` is a part of :class:`~eventbus.app.ui.state.JobState`, written under
its lock only: the state dispatches the agent's events (``AGENT_START``, ``AGENT_EXIT``,
``PREEMPTING``), the workers' exits, stalls and straggler reports and ``EVENTS_LOST`` to
its handlers. The job's status is a fact of the events (their ``state`` and ``cause``
fields, :func:`eventbus.app.sentences.job_outcome`), never read from prose.
"""

from __future__ import annotations

from typing import Any

from eventbus.app.sentences import as_int
from eventbus.app.sentences import as_number
from eventbus.app.sentences import cause_of
from eventbus.app.sentences import drain_facts
from eventbus.app.sentences import job_outcome
from eventbus.app.sentences import sentence
from eventbus.app.sentences import stopped_by_agent
from eventbus.app.ui.attempts import Timeline
from eventbus.app.ui.drain import Drain
from eventbus.app.ui.rank_book import RankBook
from eventbus.app.ui.record_event import as_str
from eventbus.events import Cause

__all__ = ["MAX_LOSS_KEYS", "STATUSES", "JobIdentity", "JobSummary"]

#: what ``status`` can be: ``draining`` from a ``PREEMPTING`` to the job's end, which is
#: then ``preempted`` (:func:`eventbus.app.sentences.job_outcome`)
STATUSES = ("running", "draining", "succeeded", "failed", "stopped", "preempted")
#: distinct ``EVENTS_LOST`` (source, reason) pairs kept (more are summed as ``"(other)"``)
MAX_LOSS_KEYS = 256


class JobIdentity:
    """The job's run id and world size, from the first event that says each, and its
    ``--max-restarts``, from the agent's start."""

    def __init__(self) -> None:
        self.run_id: str | None = None
        self.world_size: int | None = None
        self.max_restarts: int | None = None

    def note(self, ev: Any) -> None:
        """Learn what ``ev``'s context says, if not known yet."""
        if self.run_id is None:
            self.run_id = as_str(getattr(ev, "run_id", None))
        if self.world_size is None:
            self.world_size = as_int(getattr(ev, "world_size", None))


class JobSummary:
    """The job's status, its end (``AGENT_EXIT``), the latest failure or stall, its drain
    and the ``EVENTS_LOST`` counts; written under the state's lock only. ``ranks``,
    ``timeline`` and ``identity``: the state's other parts, which its handlers also
    note events on."""

    def __init__(self, ranks: RankBook, timeline: Timeline, identity: JobIdentity) -> None:
        self._ranks = ranks
        self._timeline = timeline
        self._identity = identity
        self.status = "running"
        #: the job's AGENT_EXIT (group rank 0's)
        self.exit: Any = None
        self.ended_at: float | None = None
        self.started_at: float | None = None
        #: (seq, "failure" or "stall", the event) of the latest problem
        self.problem: tuple[int, str, Any] | None = None
        self.drain: Drain | None = None
        #: (source, reason) -> events lost
        self.lost: dict[tuple[str, str], int] = {}

    def _drain(self) -> Drain:
        if self.drain is None:
            self.drain = Drain()
        return self.drain

    def on_exit(self, ev: Any, name: str, arrived: float, seq: int) -> None:
        """``WORKER_EXIT``: the rank's exit; a failure of its own is the latest problem
        and a mark; one the agent stopped after another's failure is counted; a drain's
        exits (late, or ended by itself meanwhile) are the drain's."""
        rank = as_int(getattr(ev, "worker_id", None))
        code = as_int(getattr(ev, "exit_code", None))
        data = ev.data if isinstance(ev.data, dict) else {}
        # a collateral exit is a fact of the event (data["stopped_by_agent"], cause)
        stopped = stopped_by_agent(ev)
        # a drain's exits: a rank that did not stop within the grace (its agent stopped
        # it: "late"), or one that ended by itself meanwhile (data["drained"])
        drained = data.get("drained") is True
        late = not drained and stopped and cause_of(ev) == Cause.PREEMPTION.value
        self._ranks.exited(ev, name, arrived, rank, code=code, stopped=stopped,
                           drained=drained, late=late)
        timeline = self._timeline
        if drained or late:
            drain = self._drain()
            if late:
                if rank is not None:
                    drain.late.add(rank)
                timeline.mark(ev, "late", arrived, rank, sentence(ev))
                return
            if code == 0:
                drain.stopped += 1
                return
            # ended by itself during the drain, not 0: on the signal its bootstrap passed
            # on at once (a script that does not act on drains), or a failure meanwhile
            timeline.mark(ev, "drained", arrived, rank, sentence(ev))
            return
        if code == 0:
            return
        if stopped:
            timeline.collateral(ev, arrived)
            return
        self.problem = (seq, "failure", ev)
        timeline.mark(ev, "failure", arrived, rank, sentence(ev))

    def on_stalled(self, ev: Any, name: str, arrived: float, seq: int) -> None:
        """``WORKER_STALLED``: the rank is stalled; the latest problem and a mark."""
        rank = as_int(getattr(ev, "worker_id", None))
        self._ranks.stalled(name, arrived, rank)
        self.problem = (seq, "stall", ev)
        self._timeline.mark(ev, "stall", arrived, rank, sentence(ev))

    def on_slow(self, ev: Any, name: str, arrived: float, seq: int) -> None:
        """``WORKER_SLOW``: the rank is a straggler; a mark."""
        rank = as_int(getattr(ev, "worker_id", None))
        self._ranks.slow(ev, name, arrived, rank, as_number(getattr(ev, "factor", None)))
        self._timeline.mark(ev, "slow", arrived, rank, sentence(ev))

    def on_preempting(self, ev: Any, name: str, arrived: float, seq: int) -> None:
        """``PREEMPTING``: the job drains; a mark for the drain's first."""
        if not self._drain().preempting(ev, arrived):
            return
        if self.status == "running":
            self.status = "draining"
        self._timeline.mark(ev, "drain", arrived, None, sentence(ev))

    def on_agent_start(self, ev: Any, name: str, arrived: float, seq: int) -> None:
        """``AGENT_START``: when the job started, its ``--max-restarts``."""
        if self.started_at is None:
            self.started_at = arrived
        self._identity.max_restarts = as_int(getattr(ev, "max_restarts", None))
        self._identity.note(ev)

    def on_agent_exit(self, ev: Any, name: str, arrived: float, seq: int) -> None:
        """``AGENT_EXIT``: another node's agent ended (a mark), or the job did (group rank
        0's): its status, its attempt's outcome, its drain's end and facts."""
        facts = drain_facts(ev)
        if facts is not None:
            # every node's agent names the ranks it knows did not stop in time
            self._drain().late.update(facts["late_ranks"])
            self._ranks.late(facts["late_ranks"])
        timeline = self._timeline
        if ev.group_rank not in (0, None):
            timeline.mark(ev, "node", arrived, None,
                          f"node {ev.group_rank}'s agent ended {getattr(ev, 'state', '?')}")
            return
        # the job's status is a fact of the event (state, cause), never read from prose
        status = job_outcome(ev)
        if self.drain is not None and self.drain.ended is None:
            self.drain.ended, self.drain.exit = arrived, ev  # however the job ended
        if status == "preempted":
            self._drain().preempted(ev, arrived, facts)
        self.status, self.exit, self.ended_at = status, ev, arrived
        timeline.ended(ev, arrived, status)
        if status == "stopped":
            timeline.mark(ev, "stop", arrived, None, sentence(ev))
        elif status == "preempted":
            timeline.mark(ev, "preempted", arrived, None, sentence(ev))
        elif status == "failed":
            timeline.mark(ev, "end", arrived, None, sentence(ev))

    def on_lost(self, ev: Any, name: str, arrived: float, seq: int) -> None:
        """``EVENTS_LOST``: counted per source and reason; a worker's is also its event."""
        key = (as_str(getattr(ev, "source", None)) or "?",
               as_str(getattr(ev, "reason", None)) or "?")
        count = as_int(getattr(ev, "count", None)) or 0
        if key not in self.lost and len(self.lost) >= MAX_LOSS_KEYS:
            key = ("(other)", "(other)")
        self.lost[key] = self.lost.get(key, 0) + count
        self._ranks.on_other(ev, name, arrived, seq)
