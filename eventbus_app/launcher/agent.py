"""The event agent: torch's ``LocalElasticAgent`` that publishes the job's lifecycle on a bus
as it happens and lets reactors decide restarts.

The agent is the torch hooks and the wiring; each decision is taken in a torch-free object
of its own (docs/architecture.md, "Where each decision is taken"):

* :class:`~eventbus.app.launcher.judge.Judge`: which ranks are stalled and who holds them
  up, which are stragglers (over :mod:`~eventbus.app.launcher.watches`);
* :class:`~eventbus.app.launcher.decider.Decider`: the reactors, the restart budget, STOP
  (this node's and the job-wide one) and how the job ends;
* :class:`~eventbus.app.launcher.exits.ExitBook`: which worker failed first and which
  were stopped because of it, and which exits are already reported.

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
``waitid(WNOWAIT)`` (:func:`~eventbus.app.launcher.processes.peek_exit`), which reads a
child's exit status without reaping it (torch still reaps and reports it as usual).
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import Literal

from torch.distributed.elastic.agent.server.api import RunResult
from torch.distributed.elastic.agent.server.api import WorkerGroup
from torch.distributed.elastic.agent.server.api import WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from eventbus.app import plugins as plugin_api
from eventbus.app.launcher import console
from eventbus.app.launcher import options
from eventbus.app.launcher import probes
from eventbus.app.launcher import watches
from eventbus.app.launcher.decider import REACTOR_ANSWERS
from eventbus.app.launcher.decider import Decider
from eventbus.app.launcher.decider import Outcome
from eventbus.app.launcher.decider import Reactor
from eventbus.app.launcher.drain import Drain
from eventbus.app.launcher.exits import DYING_GRACE_S
from eventbus.app.launcher.exits import ExitBook
from eventbus.app.launcher.exits import Proc
from eventbus.app.launcher.judge import BEATS_STOPPED_S
from eventbus.app.launcher.judge import Judge
from eventbus.app.launcher.notices import NoticeBoard
from eventbus.app.launcher.processes import peek_exit
from eventbus.app.launcher.processes import stop_processes
from eventbus.app.launcher.recovery import Recovery
from eventbus.app.launcher.spares import SparePool
from eventbus.app.launcher.spares import serving
from eventbus.app.launcher.stop_signal import StopSignal
from eventbus.app.launcher.store_transport import StoreTransport
from eventbus.app.launcher.torch_records import TORCH_RECORDS_DESTINATION
from eventbus.app.launcher.torch_records import route_torch_records
from eventbus.app.launcher.torch_records import unroute_torch_records
from eventbus.app.plugins import AgentPlugin
from eventbus.app.plugins import RendezvousInfo
from eventbus.app.plugins import entry_point_plugins
from eventbus.app.protocol import agent_worker as protocol
from eventbus.app.sentences import sentence
from eventbus.app.worker import bootstrap_args
from eventbus.app.worker import run_attached
from eventbus.bus import ALL
from eventbus.bus import Bus
from eventbus.bus import Subscription
from eventbus.bus import get_default_bus
from eventbus.context import set_context
from eventbus.events import Cause
from eventbus.events import Event
from eventbus.events import EventType
from eventbus.events import Preempting
from eventbus.events import WorkerExit
from eventbus.events import WorkerRestart
from eventbus.events import WorkerSlow
from eventbus.events import WorkerStalled
from eventbus.events import signal_name

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
#: the warm spares start this long into an attempt at the latest (spares.py)
SPARES_AFTER_S = 30.0
#: what torch's ProcessFailure raises on an error file torn by a kill (JSONDecodeError is a
#: ValueError; a cut but valid JSON lacks "message": KeyError, TypeError)
_ERROR_FILE_ERRORS = (ValueError, KeyError, TypeError)

def _failure_message(failure: ProcessFailure) -> str | None:
    """The message of the worker's error file, when it wrote one."""
    if failure.error_file in ("<N/A>", os.devnull) or not failure.error_file_data:
        return None
    message: Any = failure.message
    if isinstance(message, dict):
        message = message.get("message", json.dumps(message, default=str))
    return str(message) if message else None


def _error_file(failure: ProcessFailure) -> str | None:
    path = failure.error_file
    return None if path in ("<N/A>", os.devnull) else str(path)


def _find_tcp_store(store: Any) -> Any:
    """The TCPStore under a chain of PrefixStores, or None."""
    seen = 0
    while store is not None and seen < 16:
        if hasattr(store, "port") and hasattr(store, "host"):
            return store
        store = getattr(store, "underlying_store", None)
        seen += 1
    return None


def default_plugins() -> list[AgentPlugin]:
    """The plugins an agent runs unless it is given a list: the store transport (worker and
    node events onto the agent's bus), the notice board (the agents' decisions onto every
    worker's bus, and the drain across nodes), then one per ``eventbus.agent_plugins``
    entry point."""
    return [StoreTransport(), NoticeBoard(), *entry_point_plugins()]


class _DrainEnded(Exception):
    """Raised out of torch's agent loop where it would start workers during a drain."""


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
    * ``drain_signals``, ``drain_grace_s``, ``drain_exit_code``: the drain, as
      ``--drain-signals``, ``--drain-grace`` and ``--drain-exit-code``
      (docs/preemption.md).
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
        warm_spares: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.bus = bus if bus is not None else get_default_bus()
        self.plugin_exit_timeout = plugin_exit_timeout
        self.stop_exit_code = int(stop_exit_code)
        self.stall_stop_grace_s = float(stall_stop_grace_s)
        self._attempt = 0
        self._heap_frozen = False
        if reliable_restarts and os.environ.setdefault(RELIABLE_RESTARTS_ENV, "1") != "1":
            logger.warning(
                "%s=%s is set: restarts share the rendezvous store with the dead "
                "attempt's process-group keys and may fail (pytorch/pytorch#135712)",
                RELIABLE_RESTARTS_ENV, os.environ[RELIABLE_RESTARTS_ENV])
        spec = self._worker_group.spec
        #: the entry point as the user gave it (AGENT_START names it)
        self.entrypoint_name: str = spec.get_entrypoint_name()  # type: ignore[no-untyped-call]
        _start_through_bootstrap(spec)
        #: whether torch's records of this agent go to the bus (see torch_records.py)
        self.routes_torch_records = bool(torch_records
                                         and spec.event_log_handler in (None, "null"))
        if self.routes_torch_records:
            spec.event_log_handler = route_torch_records(self.bus)
        self.plugins: list[AgentPlugin] = list(default_plugins() if plugins is None
                                               else plugins)
        #: the job-wide STOP key (several nodes only; see stop_signal.py)
        self._stop_signal: StopSignal | None = None
        #: the drain: its signals, deadline and console line (drain.py)
        self.drain = Drain(signals_=drain_signals, grace_s=drain_grace_s,
                           exit_code=drain_exit_code, kill_grace_s=self.stall_stop_grace_s,
                           on_begin=self._announce_drain)
        for plugin in self.plugins:
            if isinstance(plugin, NoticeBoard) and plugin.on_drain is None:
                plugin.on_drain = self._remote_drain
        #: the reactors, the restart budget, STOP and the ending (decider.py)
        self.decider = Decider(self.bus, max_restarts=spec.max_restarts,
                               stop_exit_code=self.stop_exit_code,
                               remote_stop=self._remote_stop, drain=self.drain)
        #: who failed first, who was stopped because of it, what is reported (exits.py)
        self.exits = ExitBook()
        #: the restart's anatomy (recovery.py): RECOVERED once a restart reached its step
        self.recovery = Recovery()
        #: one waiting worker per local rank for the next attempt (spares.py)
        self.spares = SparePool(enabled=warm_spares)
        self._launched: dict[int, tuple[str, tuple[str, ...], dict[str, str]]] = {}
        #: (attempt, rank) of the ranks whose first step is done (their marks came): the
        #: spares start once this node's workers all took theirs
        self._stepped: set[tuple[int, int]] = set()
        self._spares_for = -1
        self._started_at = time.monotonic()
        self._marks_sub = self.bus.subscribe(EventType.WORKER_PROGRESS,
                                             on_event=self._observe_marks)
        for reactor in reactors:
            self.add_reactor(reactor)
        self._subs: list[Subscription] = [
            # a straggler's console line (its event is this agent's: group rank 0 judges)
            self.bus.subscribe(EventType.WORKER_SLOW, on_event=_console_slow,
                               where=lambda event: event.context.pid == os.getpid())]
        self._init_health(stall_timeout=stall_timeout, slow_factor=slow_factor,
                          stall_auto_floor_s=stall_auto_floor_s, progress=progress)

    # -- job health (docs/run.md "Job health"; the rules: watches.py, judge.py) ------------
    def _init_health(self, *, stall_timeout: float | Literal["auto"] | None,
                     slow_factor: float | None, stall_auto_floor_s: float,
                     progress: str | None = None) -> None:
        stall_watch = straggler_watch = None
        self._stack_dir: str | None = None
        self._health_subs: list[Subscription] = []
        if stall_timeout is not None:
            stall_watch = watches.StallWatch(stall_timeout, auto_floor_s=stall_auto_floor_s)
            self._stack_dir = tempfile.mkdtemp(prefix="eventbus-stacks-")
            os.environ[protocol.ENV_STACK_DIR] = self._stack_dir  # the workers inherit it
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
        run_id = str(self._worker_group.spec.rdzv_handler.get_run_id())
        #: the workers' flight-recorder dumps, asked for at a stall (probes.py)
        self.fr_dumps = probes.FlightRecorderDumps(
            protocol.fr_dump_root(run_id)
            if stall_watch is not None and "collectives" in sources else None)
        self._observing_steps: bool | None = None
        self._observe_health(steps=True)

    @property
    def reactor_errors(self) -> int:
        """Reactors that raised or answered something other than a decision."""
        return self.decider.reactor_errors

    def _observe_health(self, *, steps: bool) -> None:
        """(Re)subscribe the health watches: every worker event is a heartbeat (``ALL``, one
        subscriber for both watches); step times only where they are judged, on group
        rank 0 (the others' agents would pay for a straggler watch nobody asks)."""
        steps = steps and self.judge.straggler is not None
        if steps == self._observing_steps:
            return
        self._observing_steps = steps
        observe = watches.observer(self.judge.stall,
                                   self.judge.straggler if steps else None)
        old, self._health_subs = self._health_subs, []
        if observe is not None:  # the new one first: no event falls between the two
            self._health_subs.append(self.bus.subscribe(ALL, on_event=observe))
        for sub in old:
            sub.cancel()

    # -- the workers' processes ----------------------------------------------------------
    @property
    def _process_context(self) -> Any:
        """Torch's process context of the current workers (None before the first start:
        torch sets ``_pcontext`` in ``_start_workers``)."""
        return getattr(self, "_pcontext", None)

    def _procs(self) -> list[tuple[int, int, int]]:
        """This node's workers as started: (global rank, local rank, pid), by local rank;
        empty before the first start."""
        pcontext = self._process_context
        if pcontext is None:
            return []
        workers = self._worker_group.workers
        return [(workers[local].global_rank, local, pid)
                for local, pid in sorted(pcontext.pids().items()) if isinstance(pid, int)]

    def _error_files(self) -> Mapping[int, str]:
        """local rank -> the worker's error file path, as torch's process context has it."""
        return getattr(self._process_context, "error_files", None) or {}

    def _live(self) -> dict[int, tuple[int, int]]:
        """This node's live workers: global rank -> (local rank, pid)."""
        return {rank: (local, pid) for rank, local, pid in self._procs()
                if peek_exit(pid) is None}

    def _stop_live_workers(self, live: Mapping[int, tuple[int, int]], *, cause: str,
                           why: str, data: Mapping[int, Mapping[str, Any]] | None = None,
                           signum: int = signal.SIGTERM, grace_s: float | None = None
                           ) -> RunResult:
        """Stop the workers ``live`` (rank -> (local rank, pid); one that already exited is
        reported with its exit code) at once: SIGTERM, SIGKILL after the stall grace (a
        worker blocked in a collective ignores SIGTERM until the collective's own timeout:
        30 min with gloo/NCCL). Each is reported as stopped by the agent (``WORKER_EXIT``
        with ``cause``, ``message`` "stopped by the agent: WHY", ``data[rank]`` added), and
        the FAILED result that torch's loop restarts or ends the job with is returned."""
        stop_processes({pid: rank for rank, (_, pid) in live.items()},
                       grace_s=self.stall_stop_grace_s if grace_s is None else grace_s,
                       alive=lambda pid: peek_exit(pid) is None, signum=signum)
        attempt = self.attempt
        failures: dict[int, ProcessFailure] = {}
        for rank, (local_rank, pid) in sorted(live.items()):
            code = peek_exit(pid)
            failures[rank] = failure = ProcessFailure(
                local_rank=local_rank, pid=pid, exitcode=code if code is not None else -9,
                error_file="<N/A>")
            if self.exits.report(attempt, rank):
                self.bus.publish(WorkerExit(
                    worker_id=rank, exit_code=int(failure.exitcode),
                    worker_local_rank=local_rank, worker_pid=pid,
                    signal=signal_name(int(failure.exitcode)),
                    message=f"stopped by the agent: {why}", cause=cause,
                    data={"attempt": attempt, "stopped_by_agent": True,
                          **((data or {}).get(rank) or {})}))
        return RunResult(state=WorkerState.FAILED, failures=failures)

    # -- the drain (drain.py decides the rules; the agent acts) ----------------------------
    def _announce_drain(self, drain: Drain) -> None:
        """A drain signal reached this agent (the drain thread): ``PREEMPTING`` on the bus,
        which the notice board tells every worker and every other agent."""
        self.bus.publish(Preempting(deadline_s=round(drain.seconds_left(), 3),
                                    reason=drain.reason(), signal=drain.signal,
                                    node=drain.origin, grace_s=drain.grace_s))

    def _remote_drain(self, event: Preempting, seq: int) -> None:
        """Another node's drain reached this one (the notice board's thread)."""
        self.drain.begin(event.signal or "SIGTERM", origin=event.node, local=False,
                         deadline_s=event.deadline_s)

    def _drain_tick(self, worker_group: WorkerGroup) -> RunResult:
        """The monitor during a drain: no restart, no stall verdict; the workers stop by
        themselves until the deadline, then get the signal (SIGKILL after the kill grace).
        Torch's own monitor is asked only once none is running: on a first non-zero exit it
        would stop the others, who may still be saving their checkpoint."""
        drain = self.drain
        self._remaining_restarts = 0
        live = self._live()
        if live and drain.due():
            drain.forwarded_at = drain.forwarded_at or drain.clock()
            drain.late_ranks.update(live)
            self._report_drained(worker_group, {
                rank: code for rank, _, pid in self._procs() if rank not in live
                and (code := peek_exit(pid)) is not None})  # those that stopped in time
            why = (f"did not stop within the drain's grace ({drain.grace_s:g} s): "
                   f"{drain.signal}, then SIGKILL")
            return self._stop_live_workers(live, cause=str(Cause.PREEMPTION), why=why,
                                           signum=drain.signum, grace_s=drain.kill_grace_s)
        if live:
            return RunResult(state=WorkerState.HEALTHY)
        drain.ended_at = drain.ended_at or drain.clock()
        try:
            result: RunResult = super()._monitor_workers(worker_group)
        except _ERROR_FILE_ERRORS as exc:
            result = self._result_without_torn_error_files(worker_group, exc)
        self._report_drained(worker_group, {
            worker.global_rank: int(f.exitcode) if (f := result.failures.get(
                worker.global_rank)) is not None else 0 for worker in worker_group.workers},
            result)
        return result

    def _report_drained(self, worker_group: WorkerGroup, codes: Mapping[int, int],
                        result: RunResult | None = None) -> None:
        """The exit of each worker of ``codes`` (rank -> exit code) during a drain,
        unreported so far: 0 (it stopped by itself), or its code with cause
        ``preemption``."""
        attempt = self.attempt
        for worker in worker_group.workers:
            rank = worker.global_rank
            if rank not in codes or not self.exits.report(attempt, rank):
                continue
            failure = result.failures.get(rank) if result is not None else None
            code = int(codes[rank])
            if code and rank not in self.drain.late_ranks:
                self.drain.failed_ranks[rank] = code
            pid = worker.id if isinstance(worker.id, int) else None
            self.bus.publish(WorkerExit(
                worker_id=rank, exit_code=code, worker_local_rank=worker.local_rank,
                worker_pid=pid, signal=signal_name(code) if code else None,
                message=_failure_message(failure) if failure is not None else None,
                cause=str(Cause.PREEMPTION) if code else None,
                data={"attempt": attempt, "drained": True}))

    def _drain_result(self) -> RunResult:
        """What torch's launcher gets after a drain: not a failure (it would print its
        failure table; the drain's line and ``AGENT_EXIT`` say what happened)."""
        return RunResult(state=WorkerState.SUCCEEDED)

    def _set_beat(self, worker_group: WorkerGroup) -> None:
        """The workers' heartbeat interval for this attempt's world size (a large job beats
        less often: protocol.beat_interval), and the judge's patience with it."""
        spec = worker_group.spec
        world = (worker_group.group_world_size or 1) * int(spec.local_world_size or 1)
        stall = self.judge.stall
        timeout = None if stall is None else (
            stall.auto_floor_s if stall.timeout == "auto" else float(stall.timeout))
        beat = protocol.beat_interval(world, timeout)
        os.environ[protocol.ENV_BEAT] = f"{beat:g}"
        self.judge.beats_stopped_s = BEATS_STOPPED_S * beat

    # -- STOP across nodes (stop_signal.py) ------------------------------------------------
    @property
    def stopped_by_reactor(self) -> bool:
        """Whether a reactor's STOP ended (or is ending) the job."""
        return self.decider.stopped

    def _remote_stop(self) -> str | None:
        return self._stop_signal.remote if self._stop_signal is not None else None

    def _watch_remote_stop(self, worker_group: WorkerGroup) -> None:
        if self._stop_signal is not None or (worker_group.group_world_size or 1) < 2:
            return
        try:
            info = self.rendezvous_info(worker_group)
            self._stop_signal = StopSignal(host=info.store_host, port=info.store_port,
                                           run_id=info.run_id, group_rank=info.group_rank,
                                           group_world_size=info.group_world_size)
            self._stop_signal.start()
        except Exception:
            logger.exception("eventbus: no job-wide STOP watch; a STOP on another node "
                             "ends this one only when its workers lose their peers")

    def _stop_for_remote(self) -> RunResult | None:
        """Another node's reactor stopped the job: stop ours, no restart."""
        if self._remote_stop() is None:
            return None
        line = self.decider.stop_for_remote()
        if line is not None:
            console.write(line)
        self._remaining_restarts = 0
        return self._stop_live_workers(
            {rank: (local, pid) for rank, local, pid in self._procs()},
            cause=str(Cause.REMOTE_STOP), why="STOP on another node")

    # -- stalls and stragglers (judge.py decides; the agent acts) -----------------------
    def _check_slow(self, worker_group: WorkerGroup) -> None:
        if worker_group.group_rank not in (0, None):
            return
        for event in self.judge.stragglers(self.attempt):
            self.bus.publish(event)

    def _check_stalls(self, worker_group: WorkerGroup) -> RunResult | None:
        """On a stall, publish WORKER_STALLED for its culprits alone, let the reactors
        decide, then stop the group and return a FAILED result, which torch's loop restarts
        (one of ``--max-restarts``) or ends the job with. None while no rank is stalled.

        Group rank 0 judges the whole job: it sees every node's heartbeats through the job
        view and stops its own workers; the other nodes follow through torch's rendezvous
        (rank 0's restart makes them restart: ``num_nodes_waiting``), or the job-wide STOP.
        The other agents only ask their workers for flight-recorder dumps, and act alone
        when group rank 0 did not within the judge's grace."""
        judge = self.judge
        if judge.stall is None or not self._procs():
            return None
        attempt = self.attempt
        live = self._live()
        is_judge = worker_group.group_rank in (0, None)
        ranks = judge.ranks_to_watch(attempt, live, is_judge=is_judge)
        if not judge.overdue(attempt, ranks):
            return None
        plugin_api.drain(self.plugins)  # what the worker sent just now counts as progress
        overdue = judge.overdue(attempt, ranks)
        if not is_judge and overdue:
            self.fr_dumps.request(attempt, live)
            overdue = judge.patient(overdue, live)  # group rank 0 judges, unless late
        verdict = judge.verdict(attempt, overdue, is_judge=is_judge, ranks=ranks)
        if verdict is None:
            return None
        if verdict.report_only:  # waiting for data: reported, restarted by a reactor only
            judge.reported(attempt, verdict)
            reports = judge.stalled_events(attempt, verdict, live=live, stacks={})
            if self._decide(reports, report_only=True).action == "continue":
                return None
            return self._stop_live_workers(
                live, cause=str(Cause.STALL), why="a reactor acted on a rank waiting for data",
                data={rank: {"stalled": rank in verdict.stalled} for rank in live})
        # Ask for the flight-recorder dumps now; they are written while the stacks are
        # taken and the event is published, and waited for before the workers are stopped.
        dump_dir, asked = self.fr_dumps.ask(attempt)
        judge.reported(attempt, verdict)
        stacks: dict[int, str] = {}
        if self._stack_dir:
            by_pid = probes.StackDumper(self._stack_dir).capture(
                pid for _, pid in live.values())
            stacks = {rank: by_pid.get(pid, "") for rank, (_, pid) in live.items()}
        events = judge.stalled_events(
            attempt, verdict, live=live, stacks=stacks, dump_dir=dump_dir,
            judged_by=None if is_judge else f"group rank {worker_group.group_rank} (alone)")
        self._decide(events)
        if dump_dir is not None:
            probes.wait_fr_dumps(dump_dir, live, asked)
        return self._stop_live_workers(
            live, cause=str(Cause.STALL), why="the group stalled",
            data={rank: {"stalled": rank in verdict.stalled} for rank in live})

    def _abort_diagnosis(self, rank: int) -> dict[str, Any]:
        """A worker ended by SIGABRT: the judge's diagnosis, with the survivors'
        flight-recorder dumps, which hold their side of that collective."""
        try:
            out = self.judge.abort_diagnosis(self.attempt, rank)
            if out:
                live = self._live()
                folder = self.fr_dumps.request(self.attempt, live) if live else None
                if folder is not None:
                    out["fr_dump_dir"] = folder
            return out
        except Exception:  # a diagnosis must never cost the failure's handling
            logger.exception("eventbus: no diagnosis for rank %d's SIGABRT", rank)
            return {}

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
        with several nodes, reaches the others; its console line goes out."""
        if not report_only:
            self.recovery.failed()
        # What the failed workers sent before they died goes first (see AgentPlugin).
        plugin_api.drain(self.plugins)
        for event in failures:
            if isinstance(event, WorkerExit):
                self.exits.decided(self.attempt, event.worker_id, event.data.get("error_file"))
        outcome = self.decider.decide(failures, restarts_left=self._remaining_restarts,
                                      next_attempt=self._next_attempt(),
                                      report_only=report_only)
        if outcome.action == "restart" and self._stop_signal is not None \
                and self._stop_signal.wait_remote() is not None:
            # another node's STOP, set while this node's workers lost their peers to it
            line = self.decider.stop_for_remote()
            outcome = Outcome("stop", str(Cause.REMOTE_STOP), line or outcome.line,
                              restart_by=outcome.restart_by, announce=False)
        if outcome.action == "restart":
            self.recovery.decided()
        if outcome.action == "stop":
            if outcome.announce and self._stop_signal is not None:
                self._stop_signal.announce(self.decider.stop_reason or "STOP")
            # torch's monitor loop stops and fails the group when no restart is left.
            self._remaining_restarts = 0
        self._console_decision(failures, outcome.line)
        return outcome

    def _console_decision(self, failures: Sequence[WorkerExit | WorkerStalled],
                          line: str) -> None:
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

    # -- attempt bookkeeping ---------------------------------------------------------------
    @property
    def attempt(self) -> int:
        """The attempt the current worker group belongs to (``TORCHELASTIC_RESTART_COUNT``
        of its workers). Set at each rendezvous: a STOP zeroes the restarts left, which
        must not renumber the attempt that failed."""
        return self._attempt

    def _next_attempt(self) -> int:
        spec = self._worker_group.spec
        return int(spec.max_restarts - self._remaining_restarts)

    @property
    def remaining_restarts(self) -> int:
        """Restarts still allowed (``--max-restarts`` less those used; 0 after a STOP)."""
        return int(self._remaining_restarts)

    def _set_context(self) -> None:
        wg = self._worker_group
        set_context(run_id=wg.spec.rdzv_handler.get_run_id(), restart_count=self.attempt,
                    group_rank=wg.group_rank, role=wg.spec.role,
                    world_size=wg.workers[0].world_size if wg.workers else None,
                    local_world_size=wg.spec.local_world_size)

    # -- the hooked internals --------------------------------------------------------------
    def run(self, role: str = "default") -> RunResult:
        spec = self._worker_group.spec
        set_context(run_id=spec.rdzv_handler.get_run_id(), restart_count=self.attempt,
                    role=spec.role, local_world_size=spec.local_world_size)
        self.bus.record(EventType.AGENT_START,
                        entrypoint=self.entrypoint_name,
                        max_restarts=spec.max_restarts, nproc_per_node=spec.local_world_size)
        result: RunResult | None = None
        error: BaseException | None = None
        self.drain.install()
        try:
            result = super().run(role)
            return self._drain_result() if self.drain.active else result
        except _DrainEnded:
            result = self._drain_result()
            return result
        except Exception as exc:
            if self.drain.active:  # e.g. the rendezvous closed under a drained node
                logger.info("eventbus: during the drain the agent's loop ended with %s: %s",
                            type(exc).__name__, exc)
                result = self._drain_result()
                return result
            error = exc
            raise
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._finish(result, error)
            self.drain.uninstall()

    def _finish(self, result: RunResult | None, error: BaseException | None) -> None:
        drain_data: dict[str, Any] = {}
        if self.drain.active:
            self.drain.ended_at = self.drain.ended_at or self.drain.clock()
            for plugin in self.plugins:
                if isinstance(plugin, NoticeBoard):
                    self.drain.stop_step = plugin.stop_step()
            drain_data = {"drain": self.drain.facts()}
        plugin_api.before_exit(self.plugins, timeout=self.plugin_exit_timeout)
        if result is not None:
            ending = self.decider.ending(succeeded=not result.is_failed(),
                                         state=str(result.state.value))
        else:
            ending = self.decider.ending(succeeded=None, error=error)
        if self._stop_signal is not None:
            if self._stop_signal.announced:
                self._stop_signal.wait_for_acks()  # our process may host the store
            self._stop_signal.close()
        self.bus.record(EventType.AGENT_EXIT, state=ending.state, exit_code=ending.exit_code,
                        reason=ending.reason, cause=ending.cause, data=drain_data)
        if self.drain.active:
            console.write(self.drain.summary_line())
        self.decider.close()
        self.spares.close()
        for sub in [*self._subs, *self._health_subs, self._marks_sub]:
            sub.cancel()
        if self._stack_dir is not None:
            shutil.rmtree(self._stack_dir, ignore_errors=True)

    def _observe_marks(self, event: Event) -> None:
        """A worker's start-up marks (a beat's ``data["marks"]``), for the anatomy."""
        found = event.data.get(protocol.MARKS_KEY)
        rank = getattr(event, "worker_id", None)
        attempt = event.context.restart_count if event.context is not None else None
        if found is not None and isinstance(rank, int) and isinstance(attempt, int):
            self._stepped.add((attempt, rank))
            self.recovery.observe(attempt, rank, found)

    def _fill_spares(self, worker_group: WorkerGroup) -> None:
        """Start the spares of the next attempt once this node's workers all took their
        first step (or 30 s into the attempt): their imports do not compete with the
        workers' way to it."""
        pool, attempt = self.spares, self.attempt
        if not pool.enabled or self._spares_for == attempt or not self._launched \
                or self.drain.active:  # a drain starts no new attempt: no spare for one
            return
        mine = {w.global_rank for w in worker_group.workers}
        if not mine <= {r for a, r in self._stepped if a == attempt} and \
                time.monotonic() - self._started_at < SPARES_AFTER_S:
            return
        self._spares_for = attempt
        pool.fill(self._launched)

    def _recovered(self) -> None:
        """Publish RECOVERED (and its console line) once the restart reached its step."""
        event = self.recovery.ready()
        if event is not None:
            self.bus.publish(event)
            console.write(sentence(event))

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        wall = time.time()
        started = time.perf_counter()
        name = worker_group.spec.rdzv_handler.get_backend()
        try:
            super()._rendezvous(worker_group)
        except Exception as exc:
            self.bus.record(EventType.RENDEZVOUS, state="FAILED", name=name,
                            duration_s=time.perf_counter() - started,
                            message=f"{type(exc).__name__}: {exc}")
            raise
        duration = time.perf_counter() - started
        self.recovery.rendezvous(wall, wall + duration)
        self._attempt = self._next_attempt()
        self._set_context()
        self.bus.record(
            EventType.RENDEZVOUS, state="SUCCEEDED", name=name, duration_s=duration,
            data={"group_rank": worker_group.group_rank,
                  "group_world_size": worker_group.group_world_size,
                  "master_addr": worker_group.master_addr,
                  "master_port": worker_group.master_port},
        )
        self._watch_remote_stop(worker_group)
        self._set_beat(worker_group)
        self._observe_health(steps=worker_group.group_rank in (0, None))
        self.fr_dumps.arm(self.attempt, os.environ)
        if self.plugins:
            self._after_rendezvous(worker_group)
        self._freeze_heap()
        self.drain.node = int(worker_group.group_rank or 0)
        if self.drain.active:  # checked after the plugins read the notices' head
            raise _DrainEnded

    def _freeze_heap(self) -> None:
        """Once, after the first rendezvous: move the agent's heap so far (torch, the
        rendezvous, the plugins: it lives as long as the agent) out of the collector's
        reach. Every full collection then scans only what came later; without it, the
        collections the workers' event stream triggers scan torch's heap each time
        (measured on the 4-worker flood of benchmarks/bench_store.py: about 1 s of
        collections, pauses up to 0.3 s, against 0.05 s and 9 ms)."""
        if self._heap_frozen:
            return
        self._heap_frozen = True
        gc.freeze()

    def rendezvous_info(self, worker_group: WorkerGroup | None = None) -> RendezvousInfo:
        """What plugins get after a rendezvous (see :class:`RendezvousInfo`)."""
        wg = worker_group or self._worker_group
        handler = wg.spec.rdzv_handler
        # The handler's own store is the long-lived one: the c10d backend's store at the
        # rendezvous endpoint, or the static backend's store; its port is the real one
        # even when the endpoint asked for port 0.
        tcp = _find_tcp_store(getattr(handler, "_store", None)) or _find_tcp_store(wg.store)
        if tcp is None:
            raise RuntimeError(
                f"the {handler.get_backend()} rendezvous has no TCPStore the agent can find; "
                "agent plugins need the c10d or static rendezvous backend")
        return RendezvousInfo(
            store_host=str(tcp.host), store_port=int(tcp.port),
            run_id=handler.get_run_id(), group_rank=int(wg.group_rank or 0),
            group_world_size=int(wg.group_world_size or 1), restart_count=self.attempt,
            local_world_size=int(wg.spec.local_world_size),
            world_size=int(wg.workers[0].world_size) if wg.workers else 0,
            global_ranks=tuple(w.global_rank for w in wg.workers), bus=self.bus,
            master_addr=wg.master_addr,
            master_port=int(wg.master_port) if wg.master_port is not None else None,
        )

    def _after_rendezvous(self, worker_group: WorkerGroup) -> None:
        try:
            info = self.rendezvous_info(worker_group)
        except Exception:
            logger.exception("agent plugins get no rendezvous info")
            return
        plugin_api.after_rendezvous(self.plugins, info, os.environ)  # the workers inherit it

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        self._launched = {}
        with serving(self.spares, self._launched):
            pids: dict[int, Any] = super()._start_workers(worker_group)
        self._started_at = time.monotonic()
        workers = worker_group.workers
        self.recovery.spawned(self.attempt, workers[0].world_size if workers else 0)
        self.drain.install()  # torch's process context took SIGTERM for itself
        for worker in worker_group.workers:
            pid = pids.get(worker.local_rank)
            self.bus.record(EventType.WORKER_START, worker_id=worker.global_rank,
                            worker_local_rank=worker.local_rank,
                            worker_pid=pid if isinstance(pid, int) else None)
        return pids

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        self._recovered()
        self._fill_spares(worker_group)
        # 0. A drain: the workers stop by themselves until the deadline (drain.py).
        if self.drain.active:
            return self._drain_tick(worker_group)
        # 0. Another node's STOP: stop ours, no restart.
        remote = self._stop_for_remote()
        if remote is not None:
            return remote
        # 1. Failures first, as they are: torch's wait() stops the survivors before it
        #    reports the failure.
        spontaneous = self._failures_in_order(worker_group)
        if spontaneous is None:  # the rank that failed first is still exiting: wait for it
            return RunResult(state=WorkerState.HEALTHY)
        if spontaneous:
            self._decide(spontaneous)
        else:
            # 2. Stalls: live workers silent for too long (job health).
            stalled = self._check_stalls(worker_group)
            if stalled is not None:
                return stalled
        self._check_slow(worker_group)
        try:
            result: RunResult = super()._monitor_workers(worker_group)
        except _ERROR_FILE_ERRORS as exc:
            result = self._result_without_torn_error_files(worker_group, exc)
        if result.state in _FAILED_STATES:
            self._report_late_failures(worker_group, result, decided_this_tick=bool(spontaneous))
        elif result.state == WorkerState.SUCCEEDED:
            attempt = self.attempt
            for worker in worker_group.workers:
                if self.exits.report(attempt, worker.global_rank):
                    self.bus.record(EventType.WORKER_EXIT, worker_id=worker.global_rank,
                                    exit_code=0, worker_local_rank=worker.local_rank,
                                    worker_pid=worker.id if isinstance(worker.id, int)
                                    else None, data={"attempt": attempt})
        return result

    def _report_late_failures(self, worker_group: WorkerGroup, result: RunResult, *,
                              decided_this_tick: bool) -> None:
        """Torch's result failed the group: publish the failures nobody reported yet. Those
        the agent (or torch, because of another rank) stopped are reported as such; the
        others are failures of their own, decided on in the order they happened."""
        attempt = self.attempt
        unseen = sorted((rank, f) for rank, f in result.failures.items()
                        if not self.exits.reported(attempt, rank))
        stopped = self.exits.stopped_by_agent(
            attempt, [Proc(rank, int(f.exitcode), _error_file(f)) for rank, f in unseen],
            decided_this_tick=decided_this_tick)
        late: list[WorkerExit] = []
        for rank, failure in unseen:
            event = self._exit_event(rank, failure, stopped_by_agent=stopped[rank])
            if stopped[rank]:
                self.exits.report(attempt, rank)
                self.bus.publish(event)
            else:
                late.append(event)
        if late:
            self._decide(self._in_failure_order(late))
        if not result.failures:
            self.decider.group_failed(result.state.name)

    def _failures_in_order(self, worker_group: WorkerGroup) -> list[WorkerExit] | None:
        """The failed workers the peek sees, with those that failed *before* them and are
        still exiting, in the order they failed: the first one caused it. None while such
        a worker is still exiting within the grace (see :mod:`exits`): the tick returns at
        once and torch's loop calls again; the monitor never blocks."""
        found = self._peek_failures(worker_group)
        if not found:
            return found
        error_files = self._error_files()
        workers = [Proc(rank, peek_exit(pid), error_files.get(local))
                   for rank, local, pid in self._procs()]
        wait = self.exits.wait_for_dying(
            self.attempt, [Proc(e.worker_id, e.exit_code, e.data.get("error_file"))
                           for e in found], workers)
        if wait == "wait":
            return None
        if wait == "look again":
            seen = {e.worker_id for e in found}
            found = [*found, *(e for e in self._peek_failures(worker_group)
                               if e.worker_id not in seen)]
        return self._in_failure_order(found)

    def _in_failure_order(self, events: Sequence[WorkerExit]) -> list[WorkerExit]:
        order = self.exits.in_failure_order([e.data.get("error_file") for e in events])
        return [events[i] for i in order]

    def _peek_failures(self, worker_group: WorkerGroup) -> list[WorkerExit]:
        """The workers that exited non-zero and are not reported yet, seen by the peek
        (not reaped: torch reports them as usual)."""
        attempt = self.attempt
        error_files = self._error_files()
        found = []
        for rank, local_rank, pid in self._procs():
            if self.exits.reported(attempt, rank):
                continue
            code = peek_exit(pid)
            if code is None or code == 0:
                continue
            try:
                failure = ProcessFailure(local_rank=local_rank, pid=pid, exitcode=code,
                                         error_file=error_files.get(local_rank, "<N/A>"))
            except Exception:  # an unreadable error file: report the exit without it
                failure = ProcessFailure(local_rank=local_rank, pid=pid, exitcode=code,
                                         error_file="<N/A>")
            found.append(self._exit_event(rank, failure, stopped_by_agent=False))
        return found

    def _result_without_torn_error_files(self, worker_group: WorkerGroup,
                                         exc: BaseException) -> RunResult:
        """Torch's ``wait()`` raised reading a worker's error file: build its result here.

        A worker that torch (or the agent) stops with SIGTERM while torch's
        ``record_exception`` writes its error file (``open("w")``, then ``json.dump``) dies
        with the file empty or cut; torch's ``ProcessFailure`` then raises
        ``JSONDecodeError`` out of its ``wait()``, after it stopped the group, and the agent's
        ``run()`` would end on that error (a STOP's reason lost, a restart not taken). The
        failures are rebuilt from the exit codes, an unreadable error file left out.
        """
        logger.warning("eventbus: a worker's error file is unreadable (%s: %s): it was "
                       "stopped while writing it; its failure is reported without it",
                       type(exc).__name__, exc)
        pcontext = self._process_context
        if pcontext is None:
            raise exc
        with contextlib.suppress(Exception):
            pcontext.close()  # what torch's wait() does on a failure (idempotent)
        handlers: Mapping[int, Any] = getattr(pcontext, "subprocess_handlers", {}) or {}
        error_files = self._error_files()
        failures: dict[int, ProcessFailure] = {}
        for rank, local_rank, pid in self._procs():
            proc = getattr(handlers.get(local_rank), "proc", None)
            code = proc.poll() if proc is not None else None
            if code is None:
                code = peek_exit(pid)
            if code == 0:
                continue
            code = -int(signal.SIGKILL) if code is None else int(code)
            try:
                failure = ProcessFailure(local_rank=local_rank, pid=pid, exitcode=code,
                                         error_file=error_files.get(local_rank, "<N/A>"))
            except Exception:  # the torn one: torchrun's own report must not read it again
                failure = ProcessFailure(local_rank=local_rank, pid=pid, exitcode=code,
                                         error_file="<N/A>")
            failures[rank] = failure
        return RunResult(state=WorkerState.FAILED, failures=failures)

    def _exit_event(self, global_rank: int, failure: ProcessFailure, *,
                    stopped_by_agent: bool) -> WorkerExit:
        """A failed worker's ``WORKER_EXIT``: its own failure, or one the agent (or torch,
        because of another rank) stopped; a SIGABRT of its own gets the judge's
        diagnosis."""
        data: dict[str, Any] = {"attempt": self.attempt}
        if stopped_by_agent:
            data["stopped_by_agent"] = True
        error_file = _error_file(failure)
        if error_file is not None:
            data["error_file"] = error_file
        if not stopped_by_agent and int(failure.exitcode) == -int(signal.SIGABRT):
            data.update(self._abort_diagnosis(global_rank))
        return WorkerExit(
            worker_id=global_rank, exit_code=int(failure.exitcode),
            worker_local_rank=int(failure.local_rank), worker_pid=int(failure.pid),
            signal=signal_name(int(failure.exitcode)), message=_failure_message(failure),
            # stopped or not, a failure caused it: a stall's and a STOP's exits are reported
            # by _stop_live_workers
            cause=str(Cause.FAILURE), data=data,
        )

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
        reason, cause, decided = self.decider.next_restart()
        # a membership change keeps the attempt's number: its grace and failures are done
        self.exits.new_attempt()
        attempt = self._next_attempt()
        self.judge.new_attempt(attempt)
        if self._observing_steps is not None:  # a fresh observer: its cache held the old
            steps, self._observing_steps = self._observing_steps, None
            self._observe_health(steps=steps)
        set_context(restart_count=attempt)
        restart = WorkerRestart(attempt=attempt, restarts_left=self.remaining_restarts,
                                reason=reason, cause=cause)
        self.bus.publish(restart)
        if not decided:  # torch's decision, not a failure's (that one had its line): say so
            console.write(sentence(restart))
        super()._restart_workers(worker_group)


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
