"""Job health as the agent acts on it: the watches fed, the workers' heartbeat set, and,
on the judge's verdict, the stall path (stacks and flight-recorder dumps asked for,
``WORKER_STALLED`` published and decided on, the group stopped); the stragglers published;
a SIGABRT's diagnosis.

Why a module of its own: the judge (:mod:`~eventbus.app.health.judge`) decides who is
stalled; what the agent then does about it is one path with its own state (the stack
folder, the flight-recorder dumps, the watches' subscriptions), apart from the torch hooks
that call it once per monitor tick. Torch-free: the processes come through
:class:`~eventbus.app.launcher.group.workers.Workers` and the decision through the agent's
``decide`` (docs/run.md, "Job health").
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import Any
from typing import Literal

from eventbus.app import plugins as plugin_api
from eventbus.app.health import probes
from eventbus.app.health import watches
from eventbus.app.health.judge import BEATS_STOPPED_S
from eventbus.app.health.judge import Judge
from eventbus.app.launcher.cli import options
from eventbus.app.launcher.decisions.decider import Outcome
from eventbus.app.plugins import AgentPlugin
from eventbus.app.protocol import agent_worker as protocol
from eventbus.bus import ALL
from eventbus.bus import Bus
from eventbus.bus import Subscription
from eventbus.events import Cause
from eventbus.events import WorkerStalled

if TYPE_CHECKING:
    from torch.distributed.elastic.agent.server.api import RunResult

    from eventbus.app.launcher.group.workers import Workers

__all__ = ["Decide", "Health"]

logger = logging.getLogger("eventbus")

#: the agent's decision on failures: publish them, decide, apply (``EventAgent._decide``)
Decide = Callable[..., Outcome]


class Health:
    """The agent's side of job health: the watches, the judge, the stall path.

    Building it exports the workers' settings (``EVENTBUS_PROGRESS``, the stack folder,
    the flight recorder's ring) into ``os.environ``, which the workers inherit.
    """

    def __init__(self, bus: Bus, *, stall_timeout: float | Literal["auto"] | None,
                 slow_factor: float | None, stall_auto_floor_s: float,
                 progress: str | None, run_id: str, plugins: Sequence[AgentPlugin],
                 workers: Workers, attempt: Callable[[], int], decide: Decide,
                 mark_stalls: Callable[[int, Sequence[WorkerStalled]], list[WorkerStalled]]
                 | None = None) -> None:
        self._bus = bus
        #: the stall events with their host faults (eviction.py)
        self._mark_stalls = mark_stalls
        self._plugins = plugins
        self._workers = workers
        self._attempt = attempt
        self._decide = decide
        stall_watch = straggler_watch = None
        self.stack_dir: str | None = None
        self._subs: list[Subscription] = []
        if stall_timeout is not None:
            stall_watch = watches.StallWatch(stall_timeout, auto_floor_s=stall_auto_floor_s)
            self.stack_dir = tempfile.mkdtemp(prefix="eventbus-stacks-")
            os.environ[protocol.ENV_STACK_DIR] = self.stack_dir  # the workers inherit it
        if slow_factor is not None:
            straggler_watch = watches.StragglerWatch(slow_factor)
        #: stalls, culprits and stragglers over the watches (judge.py)
        self.judge = Judge(stall_watch, straggler_watch)
        #: the workers' progress watch (docs/run.md "Job health"): its sources, the flight
        #: recorder's ring for the workers, and the folder of flight-recorder dumps
        sources = protocol.parse_progress(progress if progress is not None
                                          else options.DEFAULT_PROGRESS)
        os.environ[protocol.ENV_PROGRESS] = protocol.format_progress(sources)
        if "collectives" in sources and not any(
                name in os.environ for name in protocol.FR_USER_SETTINGS):
            os.environ[protocol.ENV_FR_BUFFER] = str(protocol.FR_BUFFER_SIZE)
        #: the workers' flight-recorder dumps, asked for at a stall (probes.py)
        self.fr_dumps = probes.FlightRecorderDumps(
            protocol.fr_dump_root(run_id)
            if stall_watch is not None and "collectives" in sources else None)
        self._observing_steps: bool | None = None
        self.observe(steps=True)

    # -- what the watches see --------------------------------------------------------------
    def observe(self, *, steps: bool) -> None:
        """(Re)subscribe the health watches: every worker event is a heartbeat (``ALL``, one
        subscriber for both watches); step times only where they are judged, on group
        rank 0 (the others' agents would pay for a straggler watch nobody asks)."""
        steps = steps and self.judge.straggler is not None
        if steps == self._observing_steps:
            return
        self._observing_steps = steps
        observe = watches.observer(self.judge.stall,
                                   self.judge.straggler if steps else None)
        old, self._subs = self._subs, []
        if observe is not None:  # the new one first: no event falls between the two
            self._subs.append(self._bus.subscribe(ALL, on_event=observe))
        for sub in old:
            sub.cancel()

    def rendezvous(self, attempt: int, *, world_size: int, is_judge: bool) -> None:
        """A rendezvous formed ``attempt``: the workers' heartbeat interval for its world
        size (a large job beats less often: protocol.beat_interval) and the judge's
        patience with it, the watches, and the flight-recorder request armed."""
        stall = self.judge.stall
        timeout = None if stall is None else (
            stall.auto_floor_s if stall.timeout == "auto" else float(stall.timeout))
        beat = protocol.beat_interval(world_size, timeout)
        os.environ[protocol.ENV_BEAT] = f"{beat:g}"
        self.judge.beats_stopped_s = BEATS_STOPPED_S * beat
        self.observe(steps=is_judge)
        self.fr_dumps.arm(attempt, os.environ)

    def new_attempt(self, attempt: int) -> None:
        """The group restarts as ``attempt``: the judge forgets the old one, and the
        observer is a fresh one (its cache held the old attempt)."""
        self.judge.new_attempt(attempt)
        if self._observing_steps is not None:
            steps, self._observing_steps = self._observing_steps, None
            self.observe(steps=steps)

    # -- stragglers and stalls (judge.py decides; this acts) -------------------------------
    def check_slow(self, group_rank: int | None) -> None:
        """Publish the stragglers the judge finds (group rank 0 judges the job)."""
        if group_rank not in (0, None):
            return
        for event in self.judge.stragglers(self._attempt()):
            self._bus.publish(event)

    def check_stalls(self, group_rank: int | None) -> RunResult | None:
        """On a stall, publish WORKER_STALLED for its culprits alone, let the reactors
        decide, then stop the group and return a FAILED result, which torch's loop restarts
        (one of ``--max-restarts``) or ends the job with. None while no rank is stalled.

        Group rank 0 judges the whole job: it sees every node's heartbeats through the job
        view and stops its own workers; the other nodes follow through torch's rendezvous
        (rank 0's restart makes them restart: ``num_nodes_waiting``), or the job-wide STOP.
        The other agents only ask their workers for flight-recorder dumps, and act alone
        when group rank 0 did not within the judge's grace."""
        judge, workers = self.judge, self._workers
        if judge.stall is None or not workers.procs():
            return None
        attempt = self._attempt()
        live = workers.live()
        is_judge = group_rank in (0, None)
        ranks = judge.ranks_to_watch(attempt, live, is_judge=is_judge)
        if not judge.overdue(attempt, ranks):
            return None
        plugin_api.drain(self._plugins)  # what the worker sent just now counts as progress
        overdue = judge.overdue(attempt, ranks)
        if not is_judge and overdue:
            self.fr_dumps.request(attempt, live)
            overdue = judge.patient(overdue, live)  # group rank 0 judges, unless late
        verdict = judge.verdict(attempt, overdue, is_judge=is_judge, ranks=ranks)
        if verdict is None:
            return None
        stalled = {rank: {"stalled": rank in verdict.stalled} for rank in live}
        if verdict.report_only:  # waiting for data: reported, restarted by a reactor only
            judge.reported(attempt, verdict)
            reports = judge.stalled_events(attempt, verdict, live=live, stacks={})
            if self._decide(reports, report_only=True).action == "continue":
                return None
            return workers.stop(live, cause=str(Cause.STALL),
                                why="a reactor acted on a rank waiting for data", data=stalled)
        # Ask for the flight-recorder dumps now; they are written while the stacks are
        # taken and the event is published, and waited for before the workers are stopped.
        dump_dir, asked = self.fr_dumps.ask(attempt)
        judge.reported(attempt, verdict)
        stacks: dict[int, str] = {}
        if self.stack_dir:
            by_pid = probes.StackDumper(self.stack_dir).capture(
                pid for _, pid in live.values())
            stacks = {rank: by_pid.get(pid, "") for rank, (_, pid) in live.items()}
        events = judge.stalled_events(
            attempt, verdict, live=live, stacks=stacks, dump_dir=dump_dir,
            judged_by=None if is_judge else f"group rank {group_rank} (alone)")
        if self._mark_stalls is not None:
            events = self._mark_stalls(attempt, events)
        self._decide(events)
        if dump_dir is not None:
            probes.wait_fr_dumps(dump_dir, live, asked)
        return workers.stop(live, cause=str(Cause.STALL), why="the group stalled",
                            data=stalled)

    def abort_diagnosis(self, rank: int) -> dict[str, Any]:
        """A worker ended by SIGABRT: the judge's diagnosis, with the survivors'
        flight-recorder dumps, which hold their side of that collective."""
        try:
            attempt = self._attempt()
            out = self.judge.abort_diagnosis(attempt, rank)
            if out:
                live = self._workers.live()
                folder = self.fr_dumps.request(attempt, live) if live else None
                if folder is not None:
                    out["fr_dump_dir"] = folder
            return out
        except Exception:  # a diagnosis must never cost the failure's handling
            logger.exception("eventbus: no diagnosis for rank %d's SIGABRT", rank)
            return {}

    def close(self) -> None:
        """The agent's end: the watches unsubscribed, the stack folder removed, and the
        flight-recorder folders that hold no dump (a dump is kept: docs/run.md, "What a
        job leaves behind")."""
        for sub in self._subs:
            sub.cancel()
        if self.stack_dir is not None:
            shutil.rmtree(self.stack_dir, ignore_errors=True)
        self.fr_dumps.close()
