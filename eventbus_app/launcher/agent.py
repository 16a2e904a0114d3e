"""The event agent: torch's ``LocalElasticAgent`` that publishes the job's lifecycle on a bus
as it happens and lets reactors decide restarts.

The agent is the torch hooks and the wiring; each decision is taken in a torch-free object
of its own (docs/architecture.md, "Where each decision is taken"):

* :class:`~eventbus.app.health.judge.Judge`: which ranks are stalled and who holds them
  up, which are stragglers (over :mod:`~eventbus.app.health.watches`);
* :class:`~eventbus.app.launcher.decisions.decider.Decider`: the reactors, the restart budget, STOP
  (this node's and the job-wide one) and how the job ends;
* :class:`~eventbus.app.launcher.group.exits.ExitBook`: which worker failed first and which
  were stopped because of it, and which exits are already reported.

and each path the agent runs on its workers is an object of its own, which the hooks
below call:

* :class:`~eventbus.app.launcher.group.workers.Workers`: this node's processes, and the one
  way they are stopped and reported as stopped by the agent;
* :class:`~eventbus.app.launcher.decisions.failures.Failures`: the failed workers in the order they
  failed, each one's ``WORKER_EXIT``, torch's result rebuilt over a torn error file;
* :class:`~eventbus.app.launcher.job_health.Health`: the watches fed, the stall path, the
  stragglers, a SIGABRT's diagnosis;
* :class:`~eventbus.app.launcher.recovery.restarts.Restarts`: from a failure to the next attempt's
  first step: the recovery's phases, ``WORKER_RESTART``, the warm spares;
* :class:`~eventbus.app.launcher.drain.monitor.DrainMonitor`: the drain's acts;
* :class:`~eventbus.app.launcher.drain.remote_stop.RemoteStop`: the job-wide STOP;
* :class:`~eventbus.app.launcher.recovery.formation.Formation`: the attempt each rendezvous forms,
  the same on every node, and what plugins get after it.

What stays here: the torch overrides, where a failure is decided (:meth:`EventAgent._decide`)
and where the agent ends with its exit code (:meth:`EventAgent._finish`).

Imports torch. It hooks five methods of torch's private agent internals, pinned by
``tests/test_launcher_internals.py`` (CI tests torch 2.13; pyproject allows 2.8 to 2.15,
whose ends passed ``make test-compat``; the pins say what to check on another version):

* ``SimpleElasticAgent.run``: ``AGENT_START`` before, ``AGENT_EXIT`` after (plugins'
  ``before_exit`` first);
* ``_rendezvous(worker_group)``: ``RENDEZVOUS`` with its duration; plugins'
  ``after_rendezvous``; the context of the agent's events moves to the new attempt;
* ``_start_workers(worker_group) -> {local_rank: pid}``: ``WORKER_START`` per worker;
* ``_monitor_workers(worker_group) -> RunResult``: ``WORKER_EXIT`` per failed worker and
  the reactors' decision, before torch stops the rest of the group;
* ``_restart_workers(worker_group)``: ``WORKER_RESTART``.

Why the monitor peeks: torch's process context, on the first failed worker, terminates
the others (SIGTERM, and SIGKILL after the shutdown timeout: up to 30 s when a survivor is
stuck in a collective) *before* it returns the failure. To publish the failure the moment
the monitor sees it, the agent first looks at its workers itself with
``waitid(WNOWAIT)`` (:func:`~eventbus.app.launcher.group.processes.peek_exit`), which reads a
child's exit status without reaping it (torch still reaps and reports it as usual).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import time
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any
from typing import Literal

from torch.distributed.elastic.agent.server.api import RunResult
from torch.distributed.elastic.agent.server.api import WorkerGroup
from torch.distributed.elastic.agent.server.api import WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from eventbus.app import plugins as plugin_api
from eventbus.app.launcher.cli import console
from eventbus.app.launcher.cli import options
from eventbus.app.launcher.decisions.decider import REACTOR_ANSWERS
from eventbus.app.launcher.decisions.decider import Decider
from eventbus.app.launcher.decisions.decider import Ending
from eventbus.app.launcher.decisions.decider import Outcome
from eventbus.app.launcher.decisions.decider import Reactor
from eventbus.app.launcher.decisions.exit_codes import DEFAULT_BAD_HOST_EXIT_CODE
from eventbus.app.launcher.decisions.failures import ERROR_FILE_ERRORS as _ERROR_FILE_ERRORS
from eventbus.app.launcher.decisions.failures import Failures
from eventbus.app.launcher.decisions.failures import failure_message as _failure_message  # noqa: F401
from eventbus.app.launcher.drain.monitor import DrainMonitor
from eventbus.app.launcher.drain.notices import NoticeBoard
from eventbus.app.launcher.drain.remote_stop import RemoteStop
from eventbus.app.launcher.drain.slurm import SlurmDrain
from eventbus.app.launcher.group.exit_barrier import check_in_failed
from eventbus.app.launcher.group.exits import DYING_GRACE_S
from eventbus.app.launcher.group.exits import ExitBook
from eventbus.app.launcher.group.processes import peek_exit
from eventbus.app.launcher.group.workers import Workers
from eventbus.app.launcher.hosts.book import DEFAULT_EVICT_AFTER
from eventbus.app.launcher.hosts.eviction import Eviction
from eventbus.app.launcher.hosts.lost import LostNodes
from eventbus.app.launcher.job_health import Health
from eventbus.app.launcher.recovery import membership
from eventbus.app.launcher.recovery import restart_round
from eventbus.app.launcher.recovery.exit_watch import QuickWaits
from eventbus.app.launcher.recovery.formation import Formation
from eventbus.app.launcher.recovery.formation import rendezvous_info
from eventbus.app.launcher.recovery.restarts import Restarts
from eventbus.app.launcher.recovery.worker_store import WorkerStore
from eventbus.app.launcher.slurm.environment import requeued_run
from eventbus.app.launcher.transport.store import StoreTransport
from eventbus.app.launcher.transport.torch_records import TORCH_RECORDS_DESTINATION
from eventbus.app.launcher.transport.torch_records import route_torch_records
from eventbus.app.launcher.transport.torch_records import unroute_torch_records
from eventbus.app.plugins import AgentPlugin
from eventbus.app.plugins import RendezvousInfo
from eventbus.app.plugins import entry_point_plugins
from eventbus.app.protocol.drain_signals import DEFAULT_SIGNAL_WINDOW_S
from eventbus.app.protocol.drain_signals import agent_stopping
from eventbus.app.worker import bootstrap_args
from eventbus.app.worker import run_attached
from eventbus.bus import Bus
from eventbus.bus import Subscription
from eventbus.bus import get_default_bus
from eventbus.context import ATTEMPT_ENV
from eventbus.context import set_context
from eventbus.events import Cause
from eventbus.events import Event
from eventbus.events import EventType
from eventbus.events import WorkerExit
from eventbus.events import WorkerSlow
from eventbus.events import WorkerStalled

__all__ = [
    "DYING_GRACE_S",
    "REACTOR_ANSWERS",
    "RELIABLE_RESTARTS_ENV",
    "TORCH_RECORDS_DESTINATION",
    "EventAgent",
    "Reactor",
    "default_plugins",
    "event_agent",
]

logger = logging.getLogger("eventbus")

#: torch reads it at every rendezvous; "1" gives each attempt a fresh worker store
RELIABLE_RESTARTS_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"

_FAILED_STATES = (WorkerState.FAILED, WorkerState.UNHEALTHY)


def default_plugins() -> list[AgentPlugin]:
    """The plugins an agent runs unless it is given a list: the store transport (worker and
    node events onto the agent's bus), the notice board (the agents' decisions onto every
    worker's bus, and the drain across nodes), then one per ``eventbus.agent_plugins``
    entry point."""
    return [StoreTransport(), NoticeBoard(), *entry_point_plugins()]


class _DrainEnded(Exception):
    """Raised out of torch's agent loop where it would start workers during a drain."""



def _mark_closes(pcontext: Any, quick_waits: QuickWaits) -> None:
    """Torch's process context signals the workers from its ``close()``: on a failure
    (inside ``wait()``, the survivors), a restart, the agent's shutdown. Each call is
    marked as the agent's own stop, so no worker takes it for a scheduler's drain signal
    (protocol/drain_signals.py, ``agent_stopping``); and its wait for the workers' exit
    is ended by their exit (``quick_waits``: exit_watch.py), not by a poll."""
    quick_waits.install(pcontext)
    close = getattr(pcontext, "close", None)
    if close is None or getattr(close, "_eventbus_marked", False):
        return

    def marked(*args: Any, **kwargs: Any) -> Any:
        with agent_stopping():
            return close(*args, **kwargs)

    marked._eventbus_marked = True  # type: ignore[attr-defined]
    pcontext.close = marked

class EventAgent(LocalElasticAgent):
    """``LocalElasticAgent`` with the bus attached.

    Takes ``LocalElasticAgent``'s arguments plus, keyword-only:

    * ``bus``: where the lifecycle goes (default: the process's default bus, which is
      what ``eventbus.record``, the logging handler and the JSONL recorder use);
    * ``reactors``: callables ``(WorkerExit) -> Decision | None`` consulted on each
      failed worker (see :meth:`add_reactor`);
    * ``plugins``: :class:`eventbus.app.plugins.AgentPlugin` instances, exactly these;
      default: :func:`default_plugins` (the store transport and the entry points);
    * ``reliable_restarts``: give each attempt a fresh worker store (sets
      ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` unless the environment already sets it),
      so a restarted ``init_process_group`` never meets the dead attempt's keys;
    * ``torch_records``: route torch's own records of this agent (and the rendezvous
      records) to the bus through the torchelastic bridge, as ``TORCHELASTIC`` events
      (when the spec's ``event_log_handler`` is torchrun's default ``"null"``);
    * ``plugin_exit_timeout``: the budget of each plugin's ``before_exit``;
    * ``stall_timeout``, ``stall_auto_floor_s``, ``slow_factor``, ``stop_exit_code``,
      ``stall_stop_grace_s``, ``progress``: job health, as ``--stall-timeout``,
      ``--stall-auto-floor``, ``--slow-factor``, ``--stop-exit-code`` and ``--progress``
      (docs/run.md, "Job health");
    * ``drain_signals``, ``drain_grace_s``, ``drain_exit_code``,
      ``drain_signal_window_s``, ``requeue``: the drain, as ``--drain-signals``,
      ``--drain-grace``, ``--drain-exit-code``, ``--drain-signal-window`` and
      ``--requeue`` (docs/preemption.md);
    * ``warm_spares``: one waiting worker per local rank for the next attempt
      (docs/run.md);
    * ``evict_after``, ``host_ledger``: bad hosts, as ``--evict-after`` and
      ``--host-ledger`` (docs/hosts.md).
    """

    def __init__(
        self,
        *args: Any,
        bus: Bus | None = None,
        reactors: Sequence[Reactor] = (),
        plugins: Sequence[AgentPlugin] | None = None,
        reliable_restarts: bool = True,
        torch_records: bool = True,
        plugin_exit_timeout: float = 5.0,
        stall_timeout: float | Literal["auto"] | None = None,
        slow_factor: float | None = options.DEFAULT_SLOW_FACTOR,
        stop_exit_code: int = options.DEFAULT_STOP_EXIT_CODE,
        stall_stop_grace_s: float = options.STALL_STOP_GRACE_S,
        stall_auto_floor_s: float = options.AUTO_FLOOR_S,
        progress: str | None = None,
        drain_signals: Sequence[str] = options.DEFAULT_DRAIN_SIGNALS,
        drain_grace_s: float = options.DEFAULT_DRAIN_GRACE_S,
        drain_exit_code: int = options.DEFAULT_DRAIN_EXIT_CODE,
        drain_signal_window_s: float = DEFAULT_SIGNAL_WINDOW_S,
        requeue: str = "auto",
        warm_spares: bool | str = True,
        evict_after: int = DEFAULT_EVICT_AFTER,
        host_ledger: str | None = None,
        bad_host_exit_code: int = DEFAULT_BAD_HOST_EXIT_CODE,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        #: this node's exit code once its host was evicted (``--bad-host-exit-code``)
        self.bad_host_exit_code = int(bad_host_exit_code)
        self.bus = bus if bus is not None else get_default_bus()
        self.plugin_exit_timeout = plugin_exit_timeout
        self.stop_exit_code = int(stop_exit_code)
        self.stall_stop_grace_s = float(stall_stop_grace_s)
        #: the attempt each rendezvous forms, job-wide (formation.py)
        self.formation = Formation()
        #: the rendezvous closed while this node waited to join (see _left_out)
        self._was_left_out = False
        #: each attempt's workers' store, started here before its workers (worker_store.py)
        self.worker_store = WorkerStore(enabled=reliable_restarts)
        spec = self._worker_group.spec
        #: the entry point as the user gave it (AGENT_START names it)
        self.entrypoint_name: str = spec.get_entrypoint_name()  # type: ignore[no-untyped-call]
        _start_through_bootstrap(spec)
        # a node waiting while the round is full stays a spare (membership.py)
        membership.admit_only_with_room(spec.rdzv_handler)
        #: whether torch's records of this agent go to the bus (see torch_records.py)
        self.routes_torch_records = bool(torch_records
                                         and spec.event_log_handler in (None, "null"))
        if self.routes_torch_records:
            spec.event_log_handler = route_torch_records(self.bus)
        self.plugins: list[AgentPlugin] = list(default_plugins() if plugins is None
                                               else plugins)
        #: this node's host faults, the host ledger and the eviction (eviction.py)
        self.eviction = Eviction(
            self.bus, evict_after=evict_after, ledger=host_ledger,
            run_id=str(spec.rdzv_handler.get_run_id()),
            local=lambda: {w.global_rank for w in self._worker_group.workers})
        #: the nodes of the last round gone without a word (lost.py), and the hosts that
        #: said why they left (their HOST_EVICTED)
        self.lost = LostNodes(self.eviction.host)
        self._gone_by_word: set[str] = set()
        #: why the last failure was decided: "stall" (a verdict) or "failure"
        self.last_failure_cause: str | None = None
        #: the job-wide STOP key (several nodes only; remote_stop.py, stop_signal.py)
        self.remote_stop = RemoteStop()
        #: who failed first, who was stopped because of it, what is reported (exits.py)
        self.exits = ExitBook()
        #: this node's worker processes, and the one way they are stopped (workers.py)
        self.workers = Workers(self._worker_group, bus=self.bus, exits=self.exits,
                               context=lambda: getattr(self, "_pcontext", None),
                               peek=_peek, attempt=lambda: self.attempt,
                               grace_s=self.stall_stop_grace_s)
        #: the drain's acts (drain/monitor.py) and the drain itself (drain/state.py)
        self.draining = DrainMonitor(self.bus, self.workers, self.exits,
                                     attempt=lambda: self.attempt, signals_=drain_signals,
                                     grace_s=drain_grace_s, exit_code=drain_exit_code,
                                     kill_grace_s=self.stall_stop_grace_s,
                                     host_fault=self.eviction.exit_fault,
                                     window_s=drain_signal_window_s)
        self.drain = self.draining.drain
        #: under SLURM: the grace fitted, the time limit, the requeue (drain/slurm.py)
        self.slurm_drain = SlurmDrain(self.drain, requeue=requeue)
        for plugin in self.plugins:
            if isinstance(plugin, NoticeBoard) and plugin.on_drain is None:
                plugin.on_drain = self.draining.remote
                self.draining.claim = plugin.claim_drain
            if isinstance(plugin, NoticeBoard) and plugin.on_notice is None:
                plugin.on_notice = self.eviction.heard
        #: the reactors, the restart budget, STOP and the ending (decider.py)
        self.decider = Decider(self.bus, max_restarts=spec.max_restarts,
                               stop_exit_code=self.stop_exit_code,
                               remote_stop=self.remote_stop.remote, drain=self.drain)
        #: the restart path: its anatomy and the warm spares (restarts.py)
        self.restarts = Restarts(self.bus, warm_spares=warm_spares)
        self.recovery = self.restarts.recovery
        self.spares = self.restarts.spares
        for reactor in reactors:
            self.add_reactor(reactor)
        self._subs: list[Subscription] = [
            # a straggler's console line (its event is this agent's: group rank 0 judges)
            self.bus.subscribe(EventType.WORKER_SLOW, on_event=_console_slow,
                               where=lambda event: event.context.pid == os.getpid()),
            # a straggler this agent judged counts against its host when the rank is ours
            self.bus.subscribe(EventType.WORKER_SLOW, on_event=self.eviction.slow,
                               where=lambda event: event.context.pid == os.getpid()),
            # a node that said why it left is not lost (lost.py)
            self.bus.subscribe(EventType.HOST_EVICTED, on_event=lambda event:
                               self._gone_by_word.add(str(getattr(event, "host", ""))))]
        #: job health: the watches, the judge and the stall path (health.py)
        self.health = Health(self.bus, stall_timeout=stall_timeout, slow_factor=slow_factor,
                             stall_auto_floor_s=stall_auto_floor_s, progress=progress,
                             run_id=str(spec.rdzv_handler.get_run_id()),
                             plugins=self.plugins, workers=self.workers,
                             attempt=lambda: self.attempt, decide=self._decide,
                             mark_stalls=self.eviction.mark_stalls)
        self.judge = self.health.judge
        self.fr_dumps = self.health.fr_dumps
        #: the failed workers, in the order they failed (failures.py)
        self.failures = Failures(self.workers, self.exits, attempt=lambda: self.attempt,
                                 diagnose=self.health.abort_diagnosis,
                                 host_fault=self.eviction.exit_fault)

    # -- what the agent tells -------------------------------------------------------------
    @property
    def reactor_errors(self) -> int:
        """Reactors that raised or answered something other than a decision."""
        return self.decider.reactor_errors

    @property
    def stopped_by_reactor(self) -> bool:
        """Whether a reactor's STOP ended (or is ending) the job."""
        return self.decider.stopped

    @property
    def evicted(self) -> bool:
        """Whether this node left the job as a bad host (``HOST_EVICTED`` published)."""
        return self.eviction.announced

    @property
    def ended_by_hang(self) -> bool:
        """Whether the last failure this agent decided on was a stall verdict (the job's
        end, when no restart was left: ``--hang-exit-code``)."""
        return self.last_failure_cause == "stall"

    @property
    def attempt(self) -> int:
        """The attempt the current worker group belongs to, the same on every node (its
        workers' ``EVENTBUS_ATTEMPT``;
        :class:`~eventbus.app.launcher.recovery.formation.Formation`).
        Set at each rendezvous: a STOP zeroes the restarts left, which must not renumber
        the attempt that failed."""
        return self.formation.attempt

    @property
    def remaining_restarts(self) -> int:
        """Restarts still allowed (``--max-restarts`` less those used; 0 after a STOP)."""
        return int(self._remaining_restarts)

    def _next_attempt(self) -> int:
        """The attempt the group about to form will be (:meth:`Formation.next_attempt
        <eventbus.app.launcher.recovery.formation.Formation.next_attempt>`)."""
        return self.formation.next_attempt(
            max_restarts=self._worker_group.spec.max_restarts,
            remaining_restarts=self.remaining_restarts)

    # -- reactors and decisions (decider.py decides; the agent applies) ------------------
    def add_reactor(self, reactor: Reactor) -> Subscription:
        """Subscribe ``reactor`` to the failures this agent publishes (each failed worker's
        ``WORKER_EXIT`` and each ``WORKER_STALLED``), in the monitor thread, before the
        group is stopped. ``STOP`` from any reactor fails the job at once (restarts left
        or not); ``RESTART`` restarts the group using one of ``--max-restarts`` (none left:
        the job fails); ``None`` leaves torchrun's policy. Anything else counts as no
        decision and is reported (see :meth:`Decider.add_reactor`)."""
        return self.decider.add_reactor(reactor)

    def _decide(self, failures: Sequence[WorkerExit | WorkerStalled], *,
                report_only: bool = False) -> Outcome:
        """Publish each failure, let the decider collect the reactors' answers, and apply
        its outcome: a STOP uses up the restarts (torch's loop then fails the group) and,
        with several nodes, reaches the others; its console line goes out.

        The one place every failure is decided on: the worker failures of the monitor
        (:meth:`_monitor_workers`, :meth:`_report_late_failures`) and the stalls
        (:meth:`Health.check_stalls <eventbus.app.launcher.job_health.Health.check_stalls>`)."""
        if not report_only:
            self.restarts.failed()
        # What the failed workers sent before they died goes first (see AgentPlugin).
        plugin_api.drain(self.plugins)
        for event in failures:
            if isinstance(event, WorkerExit):
                self.exits.decided(self.attempt, event.worker_id, event.data.get("error_file"))
        outcome = self.decider.decide(failures, restarts_left=self._remaining_restarts,
                                      next_attempt=self.attempt + 1,
                                      report_only=report_only)
        self.eviction.reactors_ran(failures)
        if not report_only:
            self.last_failure_cause = "stall" if any(
                isinstance(event, WorkerStalled) for event in failures) else "failure"
        if outcome.action == "restart" and self.remote_stop.before_restart() is not None:
            # another node's STOP, set while this node's workers lost their peers to it
            line = self.decider.stop_for_remote()
            outcome = Outcome("stop", str(Cause.REMOTE_STOP), line or outcome.line,
                              restart_by=outcome.restart_by, announce=False)
        if outcome.action == "restart":
            self.restarts.decided()
        if outcome.action == "stop":
            if outcome.announce:
                self.remote_stop.announce(self.decider.stop_reason or "STOP")
            # torch's monitor loop stops and fails the group when no restart is left.
            self._remaining_restarts = 0
        _console_decision(failures, outcome.line)
        return outcome

    # -- the hooked internals --------------------------------------------------------------
    def run(self, role: str = "default") -> RunResult:
        spec = self._worker_group.spec
        set_context(run_id=spec.rdzv_handler.get_run_id(), restart_count=self.attempt,
                    role=spec.role, local_world_size=spec.local_world_size)
        self.bus.record(EventType.AGENT_START, entrypoint=self.entrypoint_name,
                        max_restarts=spec.max_restarts, nproc_per_node=spec.local_world_size,
                        **requeued_run(spec.rdzv_handler.get_run_id()))
        result: RunResult | None = None
        error: BaseException | None = None
        self.drain.install()
        self.slurm_drain.start()
        try:
            with self.restarts.exit_watch.ticking(spec):  # woken by an exit (exit_watch.py)
                result = super().run(role)
            if self.drain.active:
                self.eviction.announce()  # a host fault during the drain (when one came)
                return self.draining.result()
            if result is None:  # the rendezvous closed while this node waited to join
                result = self._left_out()
                return result
            if result.is_failed():  # the nodes whose ranks finished wait for none
                check_in_failed(self._store, self._worker_group.group_world_size)
            if result.is_failed() and self.eviction.evicted is not None:
                # no restart was left: leave without closing the rendezvous all the same
                raise self.eviction.evict(spec.rdzv_handler, self.attempt)
            return result
        except _DrainEnded:
            self.eviction.announce()
            result = self.draining.result()
            return result
        except Exception as exc:
            if self.drain.active:  # e.g. the rendezvous closed under a drained node
                logger.info("eventbus: during the drain the agent's loop ended with %s: %s",
                            type(exc).__name__, exc)
                self.eviction.announce()
                result = self.draining.result()
                return result
            error = exc
            raise
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._finish(result, error)
            self.drain.uninstall()

    def _left_out(self) -> RunResult:
        """torch's ``run()`` gives None (``RendezvousGracefulExitError``) to a spare, or a
        node that lost its place at a re-form, when the job ends without it; its
        ``launch_agent`` then fails on the None. Exit 0 instead, no clean finish counted."""
        self._was_left_out = True
        console.write(f"node {self.eviction.host} was left out: the rendezvous closed while "
                      f"it waited to join (the job went on without it and ended); exit 0")
        return RunResult(state=WorkerState.SUCCEEDED)

    def _finish(self, result: RunResult | None, error: BaseException | None) -> None:
        """The agent's end: plugins' ``before_exit``, then ``AGENT_EXIT`` with the job's
        state, exit code, reason and cause (:meth:`Decider.ending`), then every part
        closed. The one place the agent ends with an exit code."""
        drain_data: dict[str, Any] = {}
        if self.drain.active:
            self.drain.ended_at = self.drain.ended_at or self.drain.clock()
            for plugin in self.plugins:
                if isinstance(plugin, NoticeBoard):
                    self.drain.stop_step = plugin.stop_step()
            drain_data = {"drain": self.drain.facts()}
        self.eviction.attempt_ended(self.attempt, clean=result is not None and not (
            result.is_failed() or self.drain.active or self._was_left_out))
        plugin_api.before_exit(self.plugins, timeout=self.plugin_exit_timeout)
        self.eviction.close()
        if result is not None:
            ending = self.decider.ending(succeeded=not result.is_failed(),
                                         state=str(result.state.value))
        else:
            ending = self.decider.ending(succeeded=None, error=error)
        if self.eviction.announced:  # the bad-host code, after a drain too (eviction.py)
            ending = self.eviction.ending(ending, self.bad_host_exit_code)
        elif self._was_left_out and ending.exit_code == 0:
            ending = Ending(ending.state, 0, "left out: the rendezvous closed while this "
                            "node waited to join", None)
        self.remote_stop.close()
        self.slurm_drain.close()
        self.bus.record(EventType.AGENT_EXIT, state=ending.state, exit_code=ending.exit_code,
                        reason=ending.reason, cause=ending.cause, data=drain_data)
        if self.drain.active:
            console.write(self.drain.summary_line())
        self.decider.close()
        self.restarts.close()
        self.worker_store.close()
        for sub in self._subs:
            sub.cancel()
        self.health.close()

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        wall = time.time()
        started = time.perf_counter()
        name = worker_group.spec.rdzv_handler.get_backend()
        try:
            with restart_round.joining(worker_group.spec.rdzv_handler, self.formation) as round_:
                super()._rendezvous(worker_group)
        except Exception as exc:
            self.bus.record(EventType.RENDEZVOUS, state="FAILED", name=name,
                            duration_s=time.perf_counter() - started,
                            message=f"{type(exc).__name__}: {exc}")
            raise
        duration = time.perf_counter() - started
        self.restarts.rendezvous(wall, wall + duration)
        last_attempt = self.attempt
        if self.formation.formed_as(worker_group.spec.rdzv_handler,
                                    predicted=self._next_attempt()):
            self.health.new_attempt(self.attempt)  # rounds went by without this node
        os.environ[ATTEMPT_ENV] = str(self.attempt)  # the workers' (context.py)
        _set_context(worker_group, self.attempt)
        lost = self.lost.formed(worker_group.spec.rdzv_handler, worker_group.store,
                                gone_by_word=self._gone_by_word)
        self.bus.record(
            EventType.RENDEZVOUS, state="SUCCEEDED", name=name, duration_s=duration,
            data={"group_rank": worker_group.group_rank,
                  "group_world_size": worker_group.group_world_size,
                  "master_addr": worker_group.master_addr,
                  "master_port": worker_group.master_port,
                  **({"lost": lost} if lost else {}), **round_.data()},
        )
        if lost and worker_group.group_rank == 0:  # said and recorded once, by rank 0
            console.write(f"eventbus: {', '.join(lost)} lost: gone from the rendezvous "
                          f"without a word after attempt {last_attempt}; attempt "
                          f"{self.attempt} goes on with {worker_group.group_world_size} "
                          "nodes (a lost fault in the host ledger)")
            self.eviction.lost(lost, last_attempt)
        self.remote_stop.watch(lambda: self.rendezvous_info(worker_group),
                               worker_group.group_world_size or 1)
        self.health.rendezvous(
            self.attempt, is_judge=worker_group.group_rank in (0, None),
            world_size=(worker_group.group_world_size or 1)
            * int(worker_group.spec.local_world_size or 1))
        if self.plugins:
            self._after_rendezvous(worker_group)
        self.formation.freeze_heap()
        self.drain.node = int(worker_group.group_rank or 0)
        if self.drain.active:  # checked after the plugins read the notices' head
            raise _DrainEnded

    def rendezvous_info(self, worker_group: WorkerGroup | None = None) -> RendezvousInfo:
        """What plugins get after a rendezvous (see :class:`RendezvousInfo`)."""
        return rendezvous_info(worker_group or self._worker_group, attempt=self.attempt,
                               bus=self.bus)

    def _after_rendezvous(self, worker_group: WorkerGroup) -> None:
        try:
            info = self.rendezvous_info(worker_group)
        except Exception:
            logger.exception("agent plugins get no rendezvous info")
            return
        plugin_api.after_rendezvous(self.plugins, info, os.environ)  # the workers inherit it

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        with self.restarts.starting(), self.worker_store.hosting(worker_group):
            pids: dict[int, Any] = super()._start_workers(worker_group)
        _mark_closes(self._pcontext, self.restarts.quick_waits)
        self.restarts.started(self.attempt, _world_size(worker_group), pids)
        self.drain.install()  # torch's process context took SIGTERM for itself
        for worker in worker_group.workers:
            pid = pids.get(worker.local_rank)
            self.bus.record(EventType.WORKER_START, worker_id=worker.global_rank,
                            worker_local_rank=worker.local_rank,
                            worker_pid=pid if isinstance(pid, int) else None)
        return pids

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        self.restarts.tick()
        self.restarts.fill_spares(self.attempt, (w.global_rank for w in worker_group.workers),
                                  draining=self.drain.active,
                                  wanted=membership.another_attempt_can_start(
                                      worker_group, restarts_left=self.remaining_restarts))
        # 0. A drain: the workers stop by themselves until the deadline (drain/monitor.py).
        if self.drain.active:
            return self._drain_tick(worker_group)
        # 0. Another node's STOP: stop ours, no restart.
        if self.remote_stop.remote() is not None:
            self._remaining_restarts = 0
            return self.remote_stop.stop_workers(self.decider, self.workers)
        # 1. Failures first, as they are: torch's wait() stops the survivors before it
        #    reports the failure.
        spontaneous = self.failures.in_order()
        if spontaneous is None:  # the rank that failed first is still exiting: wait for it
            return RunResult(state=WorkerState.HEALTHY)
        if spontaneous:
            self._decide(spontaneous)
        else:
            # 2. Stalls: live workers silent for too long (job health).
            stalled = self.health.check_stalls(worker_group.group_rank)
            if stalled is not None:
                return stalled
        self.health.check_slow(worker_group.group_rank)
        result = self._torch_monitor(worker_group)
        if result.state in _FAILED_STATES:
            self._report_late_failures(result, decided_this_tick=bool(spontaneous))
        elif result.state == WorkerState.SUCCEEDED:
            self.workers.report_succeeded()
        return result

    def _torch_monitor(self, worker_group: WorkerGroup) -> RunResult:
        """Torch's own monitor; its result rebuilt when a worker's error file is torn."""
        try:
            result: RunResult = super()._monitor_workers(worker_group)
        except _ERROR_FILE_ERRORS as exc:
            result = self.failures.torn_result(exc)
        return result

    def _drain_tick(self, worker_group: WorkerGroup) -> RunResult:
        """The monitor during a drain (:meth:`DrainMonitor.tick
        <eventbus.app.launcher.drain.monitor.DrainMonitor.tick>`): no restart is left."""
        self._remaining_restarts = 0
        return self.draining.tick(worker_group, self._torch_monitor)

    def _report_late_failures(self, result: RunResult, *, decided_this_tick: bool) -> None:
        """Torch's result failed the group: publish the failures nobody reported yet. Those
        the agent (or torch, because of another rank) stopped are reported as such; the
        others are failures of their own, decided on in the order they happened."""
        stopped, own = self.failures.late(result, decided_this_tick=decided_this_tick)
        for event in stopped:
            self.exits.report(self.attempt, event.worker_id)
            self.bus.publish(event)
        if own:
            self._decide(own)
        if not result.failures:
            self.decider.group_failed(result.state.name)

    def _exit_barrier(self) -> None:
        # After a drain the other nodes end within their deadline and kill grace: torch's
        # 300 s default would hold this node long after a node that ended FAILED (killed
        # ranks), which never comes to the barrier.
        if self.drain.active:
            bound = self.drain.seconds_left() + self.drain.kill_grace_s + 5.0
            self._exit_barrier_timeout = min(self._exit_barrier_timeout, bound)
        super()._exit_barrier()  # type: ignore[no-untyped-call]

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        if self.drain.active:  # a drain starts no new attempt
            raise _DrainEnded
        if self.eviction.evicted is not None:  # this host leaves the job (eviction.py)
            self._stop_workers(worker_group)
            raise self.eviction.evict(worker_group.spec.rdzv_handler, self.attempt)
        self.eviction.attempt_ended(self.attempt, clean=False)
        reason, cause, decided = self.decider.next_restart()
        # a membership change keeps the attempt's number: its grace and failures are done
        self.exits.new_attempt()
        attempt = self._next_attempt()
        self.health.new_attempt(attempt)
        set_context(restart_count=attempt)
        self.restarts.restarting(attempt, restarts_left=self.remaining_restarts,
                                 reason=reason, cause=cause, decided=decided)
        super()._restart_workers(worker_group)


def _peek(pid: int) -> int | None:
    """:func:`~eventbus.app.launcher.group.processes.peek_exit`, looked up in this module at
    each call: a test without ``waitid`` replaces ``agent.peek_exit``."""
    return peek_exit(pid)


def _world_size(worker_group: WorkerGroup) -> int:
    """The attempt's ranks in all (0 before its workers are assigned)."""
    workers = worker_group.workers
    return int(workers[0].world_size) if workers else 0


def _set_context(worker_group: WorkerGroup, attempt: int) -> None:
    """The context of the agent's events: the group ``attempt`` belongs to."""
    spec = worker_group.spec
    set_context(run_id=spec.rdzv_handler.get_run_id(), restart_count=attempt,
                group_rank=worker_group.group_rank, role=spec.role,
                world_size=worker_group.workers[0].world_size if worker_group.workers
                else None, local_world_size=spec.local_world_size)


def _console_decision(failures: Sequence[WorkerExit | WorkerStalled], line: str) -> None:
    """The decision's ``eventbus:`` line on stderr (with or without --log-events), a
    stall's diagnosis and stack under it (docs/run.md, "On the console")."""
    try:
        details: list[str] = []
        seen: set[str] = set()
        for event in failures:
            if isinstance(event, WorkerStalled):
                details.extend(console.stall_detail_lines(event, seen))
        console.write(line + ("\n" + console.indented(details) if details else ""))
    except Exception:  # the console must never cost a decision
        logger.exception("eventbus: the console line of a decision failed")


def _start_through_bootstrap(spec: Any) -> None:
    """Start each worker through the worker bootstrap (:mod:`eventbus.app.worker`), which
    attaches the forwarder and the stack dump, then runs the script as ``__main__``.

    torchrun's workers are ``python -u SCRIPT ...`` or ``python -u -m MODULE ...``; a
    function entry point (``--run-path``, ``elastic_launch(config, fn)``) is wrapped in
    :func:`eventbus.app.worker.run_attached`. A ``--no-python`` program is left as it is
    (docs/run.md says what it needs)."""
    entrypoint = spec.entrypoint
    if entrypoint is run_attached:
        return  # already wrapped (another agent built on the same spec)
    if callable(entrypoint):
        spec.entrypoint = run_attached
        spec.args = (entrypoint, *spec.args)
    elif isinstance(entrypoint, str) and _is_python(entrypoint):
        spec.args = bootstrap_args(spec.args)
    else:
        logger.warning("eventbus: %s is not a Python interpreter (--no-python): its "
                       "workers start without the worker bootstrap; a Python program "
                       "started this way calls eventbus.app.worker.attach() to forward its "
                       "events (docs/run.md, \"The worker bootstrap\")", entrypoint)


def _is_python(entrypoint: str) -> bool:
    # torchrun's own interpreter, or one named like it after --no-python ("python3.11"),
    # not a program that merely starts with the word ("python-wrapper.sh")
    if entrypoint in (sys.executable, os.environ.get("PYTHON_EXEC")):
        return True
    return re.fullmatch(r"python[0-9.]*", os.path.basename(entrypoint)) is not None


def _console_slow(event: Event) -> None:
    if isinstance(event, WorkerSlow):
        console.write(console.slow_line(event))


@contextlib.contextmanager
def event_agent(**options: Any) -> Iterator[list[EventAgent]]:
    """While active, torch's launch path (``elastic_launch``, ``launch_agent``,
    ``torch.distributed.run.run``) builds an :class:`EventAgent` with ``options`` (see
    its docstring) instead of a ``LocalElasticAgent``. Yields the list of agents built.

    On the way out it uninstalls the torchelastic bridge its agents installed, so torch's
    event registry is as it was. The Python API for a launcher of your own::

        with event_agent(reactors=[NonRetriableExitCodes({3})]):
            elastic_launch(config, entrypoint)(*args)
    """
    from torch.distributed.launcher import api as launcher_api

    built: list[EventAgent] = []

    class _Agent(EventAgent):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs, **options)
            built.append(self)

    _Agent.__name__ = _Agent.__qualname__ = "EventAgent"
    # launch_agent() builds the agent by this module-level name.
    original = launcher_api.LocalElasticAgent  # type: ignore[attr-defined]
    launcher_api.LocalElasticAgent = _Agent  # type: ignore[attr-defined]
    try:
        yield built
    finally:
        launcher_api.LocalElasticAgent = original  # type: ignore[attr-defined]
        if any(agent.routes_torch_records for agent in built):
            unroute_torch_records()
