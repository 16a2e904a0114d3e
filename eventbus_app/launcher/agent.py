"""The event agent: torch's ``LocalElasticAgent`` that publishes the job's lifecycle on a bus
as it happens and lets reactors decide restarts.

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
``waitid(WNOWAIT)``, which reads a child's exit status without reaping it (torch still
reaps and reports it as usual).
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
import threading
import time
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import Literal

import attrs
from torch.distributed.elastic.agent.server.api import RunResult
from torch.distributed.elastic.agent.server.api import WorkerGroup
from torch.distributed.elastic.agent.server.api import WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from eventbus.app.launcher import console
from eventbus.app.launcher import culprit
from eventbus.app.launcher import health
from eventbus.app.launcher.stop_signal import StopSignal
from eventbus.app.launcher.store_transport import StoreTransport
from eventbus.app.plugins import FAILURE_DRAIN_TIMEOUT_S
from eventbus.app.plugins import AgentPlugin
from eventbus.app.plugins import RendezvousInfo
from eventbus.app.plugins import entry_point_plugins
from eventbus.app.worker import bootstrap_args
from eventbus.app.worker import run_attached
from eventbus.app.worker.process_groups import DESTROY_TIMEOUT_S
from eventbus.app.worker.stack_dump import ENV_STACK_DIR
from eventbus.bus import ALL
from eventbus.bus import Bus
from eventbus.bus import Subscription
from eventbus.bus import get_default_bus
from eventbus.context import set_context
from eventbus.events import AgentExit
from eventbus.events import Decision
from eventbus.events import Event
from eventbus.events import EventType
from eventbus.events import Rendezvous
from eventbus.events import TorchelasticRecord
from eventbus.events import WorkerExit
from eventbus.events import WorkerSlow
from eventbus.events import WorkerStalled
from eventbus.events import WorkerStart
from eventbus.events import signal_name
from eventbus.publishers.torchelastic import install_torchelastic_bridge
from eventbus.publishers.torchelastic import uninstall_torchelastic_bridge

__all__ = [
    "RELIABLE_RESTARTS_ENV",
    "TORCH_RECORDS_DESTINATION",
    "EventAgent",
    "Reactor",
    "default_plugins",
    "event_agent",
]

logger = logging.getLogger("eventbus")

#: a reactor: called with each failed worker's ``WORKER_EXIT`` and each ``WORKER_STALLED``
#: (``Any``: a reactor typed ``(WorkerExit) -> ...`` is accepted); ``None`` = no decision
Reactor = Callable[[Any], "Decision | None"]

#: torch reads it at every rendezvous; "1" gives each attempt a fresh worker store
RELIABLE_RESTARTS_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"

#: the torchelastic events destination the agent's own torch records go to
TORCH_RECORDS_DESTINATION = "eventbus-agent"

_FAILED_STATES = (WorkerState.FAILED, WorkerState.UNHEALTHY)
#: what torch's ProcessFailure raises on an error file torn by a kill (JSONDecodeError is a
#: ValueError; a cut but valid JSON lacks "message": KeyError, TypeError)
_ERROR_FILE_ERRORS = (ValueError, KeyError, TypeError)


#: what a reactor may return, as the reactor-error report says it
REACTOR_ANSWERS = "eventbus.Decision.STOP, eventbus.Decision.RESTART or None"


def _decision_of(value: object) -> Decision | _NotADecision | None:
    """A reactor's answer: a ``Decision`` or ``None``, the only two; anything else (the
    string ``"stop"``, ``True``) is a :class:`_NotADecision`, which counts as none."""
    if value is None or isinstance(value, Decision):
        return value
    return _NotADecision(value)


class _NotADecision:
    """What a reactor returned that is not an answer (see :func:`_decision_of`)."""

    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value

    def describe(self) -> str:
        try:
            shown = repr(self.value)
        except Exception:
            shown = f"<{type(self.value).__name__} with a failing __repr__>"
        if len(shown) > 80:
            shown = shown[:77] + "..."
        hint = ""
        if isinstance(self.value, str) and self.value.strip().upper() in Decision.__members__:
            hint = f" (did you mean eventbus.Decision.{self.value.strip().upper()}?)"
        return f"{shown} ({type(self.value).__name__}){hint}"


def _name_of(fn: object) -> str:
    """module.qualname for functions and classes, the repr for other callables."""
    name = getattr(fn, "__qualname__", None)
    if name is None:
        try:
            return repr(fn)[:200]
        except Exception:
            name = type(fn).__qualname__
    module = getattr(fn, "__module__", None) or type(fn).__module__
    return f"{module}.{name}"


def _peek_exit(pid: int) -> int | None:
    """The exit code of child ``pid`` if it has exited (``-signum`` if a signal ended it),
    without reaping it; ``None`` while it runs or when that cannot be known."""
    waitid = getattr(os, "waitid", None)
    if waitid is None:
        return None
    try:
        info = waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except (ChildProcessError, OSError):
        return None
    if info is None or info.si_pid == 0:
        return None
    if info.si_code == os.CLD_EXITED:
        return int(info.si_status)
    return -int(info.si_status)


def _failure_message(failure: ProcessFailure) -> str | None:
    """The message of the worker's error file, when it wrote one."""
    if failure.error_file in ("<N/A>", os.devnull) or not failure.error_file_data:
        return None
    message: Any = failure.message
    if isinstance(message, dict):
        message = message.get("message", json.dumps(message, default=str))
    return str(message) if message else None


#: how long the monitor waits for a worker that failed first (its error file written)
#: but is still in its interpreter's teardown to exit by itself (see
#: EventAgent._with_earlier_failures): the bootstrap's exit-time destroy of the process
#: groups alone may take DESTROY_TIMEOUT_S. The monitor does not block meanwhile: its
#: ticks return "healthy" until the worker exits or the grace ends (once per attempt).
DYING_GRACE_S = DESTROY_TIMEOUT_S + 2.0


def _error_time(path: object) -> int | None:
    """When an error file was written (ns), None without one (or an empty one)."""
    if not isinstance(path, str) or path in ("<N/A>", os.devnull):
        return None
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_mtime_ns if stat.st_size > 0 else None


def _find_tcp_store(store: Any) -> Any:
    """The TCPStore under a chain of PrefixStores, or None."""
    seen = 0
    while store is not None and seen < 16:
        if hasattr(store, "port") and hasattr(store, "host"):
            return store
        store = getattr(store, "underlying_store", None)
        seen += 1
    return None


class _TorchRecordsRelay:
    """Torch's own records of this agent, bridged, -> the agent's bus, never doubling it.

    ``eventbus.publishers.install_torchelastic_bridge`` turns torch's records into typed events on a
    private bus; this relay republishes them on the agent's bus. The agent publishes the
    typed lifecycle itself, as it happens, so torch's records of the same moments
    (``torchelastic.worker.status.START``, the end-of-run ``SUCCEEDED``/``FAILED``/
    ``TERMINATED`` per worker, the ``RENDEZVOUS`` duration, the agent's ``FAILED``) become
    ``TORCHELASTIC`` events named as torch names them, with the bridge's typed reading in
    ``data``: nothing of torch's is lost and nothing is published twice as a typed event.
    """

    def __init__(self) -> None:
        self.target: Bus | None = None
        self.relayed = 0

    def __call__(self, event: Event) -> None:
        target = self.target
        if target is None:
            return
        if isinstance(event, _AGENT_OWNED):
            data = dict(event.data)
            name = str(data.pop("torchelastic_name", None) or event.type)
            data["bridged_as"] = str(event.type)
            for key, value in event.fields().items():
                if value is not None:
                    data.setdefault(key, value)
            event = TorchelasticRecord(name=name, source=str(data.get("source", "torchelastic")),
                                       data=data, timestamp=event.timestamp,
                                       context=event.context)
        self.relayed += 1
        target.publish(event)


_AGENT_OWNED = (WorkerStart, WorkerExit, Rendezvous, AgentExit)
_relay = _TorchRecordsRelay()
_relay_bus = Bus("torchelastic-records")
_relay_bus.subscribe(ALL, on_event=_relay)


def _route_torch_records(bus: Bus) -> str:
    """Install the torchelastic bridge for the agent's records; returns its destination."""
    install_torchelastic_bridge(TORCH_RECORDS_DESTINATION, bus=_relay_bus)
    _relay.target = bus
    return TORCH_RECORDS_DESTINATION


def default_plugins() -> list[AgentPlugin]:
    """The plugins an agent runs unless it is given a list: the store transport (worker and
    node events onto the agent's bus), then one per ``eventbus.agent_plugins`` entry point."""
    return [StoreTransport(), *entry_point_plugins()]


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
      ``stall_stop_grace_s``: job health, as ``--stall-timeout``, ``--stall-auto-floor``,
      ``--slow-factor`` and ``--stop-exit-code`` (docs/run.md, "Job health").
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
        slow_factor: float | None = health.DEFAULT_SLOW_FACTOR,
        stop_exit_code: int = health.DEFAULT_STOP_EXIT_CODE,
        stall_stop_grace_s: float = health.STALL_STOP_GRACE_S,
        stall_auto_floor_s: float = health.AUTO_FLOOR_S,
        progress: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.bus = bus if bus is not None else get_default_bus()
        self.plugin_exit_timeout = plugin_exit_timeout
        self._reactor_subs: list[Subscription] = []
        self._collecting: threading.local = threading.local()
        self._reported: set[tuple[int, int]] = set()  # (attempt, global rank)
        #: attempt -> when the grace for a worker that failed first and is still exiting
        #: ends (monotonic; set once per attempt, see _with_earlier_failures)
        self._dying_until: dict[int, float] = {}
        #: attempt -> the earliest error file time (ns) of the failures decided on
        self._first_error_ns: dict[int, int] = {}
        self._stop_reason: str | None = None
        self._restart_reason: str | None = None
        self._failure_summary: str | None = None
        self.reactor_errors = 0
        #: the reactors reported for a wrong answer, by id of their WORKER_EXIT subscription
        #: (two instances of one class are two reactors)
        self._reactors_misanswered: set[int] = set()
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
        #: whether torch's records of this agent go to the bus (see _TorchRecordsRelay)
        self.routes_torch_records = bool(torch_records
                                         and spec.event_log_handler in (None, "null"))
        if self.routes_torch_records:
            spec.event_log_handler = _route_torch_records(self.bus)
        self.plugins: list[AgentPlugin] = list(default_plugins() if plugins is None
                                               else plugins)
        for reactor in reactors:
            self.add_reactor(reactor)
        # a straggler's console line (its event is this agent's: group rank 0 judges)
        self._reactor_subs.append(self.bus.subscribe(
            EventType.WORKER_SLOW, on_event=_console_slow,
            where=lambda event: event.context.pid == os.getpid()))
        self._init_health(stall_timeout=stall_timeout, slow_factor=slow_factor,
                          stop_exit_code=stop_exit_code,
                          stall_stop_grace_s=stall_stop_grace_s,
                          stall_auto_floor_s=stall_auto_floor_s, progress=progress)

    # -- job health (docs/run.md "Job health"; the rules live in launcher/health.py) ---------
    def _init_health(self, *, stall_timeout: float | Literal["auto"] | None,
                     slow_factor: float | None, stop_exit_code: int,
                     stall_stop_grace_s: float, stall_auto_floor_s: float,
                     progress: str | None = None) -> None:
        self.stop_exit_code = int(stop_exit_code)
        self.stall_stop_grace_s = float(stall_stop_grace_s)
        self.stalls = 0
        self.stall_watch: health.StallWatch | None = None
        self.straggler_watch: health.StragglerWatch | None = None
        self._stack_dir: str | None = None
        self._health_subs: list[Subscription] = []
        self._next_slow_check = 0.0
        #: the job-wide STOP key (several nodes only; see stop_signal.py)
        self._stop_signal: StopSignal | None = None
        if stall_timeout is not None:
            self.stall_watch = health.StallWatch(stall_timeout,
                                                 auto_floor_s=stall_auto_floor_s)
            self._stack_dir = tempfile.mkdtemp(prefix="eventbus-stacks-")
            os.environ[ENV_STACK_DIR] = self._stack_dir  # the workers inherit it
        if slow_factor is not None:
            self.straggler_watch = health.StragglerWatch(slow_factor)
        #: the workers' progress watch (docs/run.md "Job health"): its sources, the flight
        #: recorder's ring for the workers, and the folder of flight-recorder dumps
        sources = health.parse_progress(progress if progress is not None
                                        else health.DEFAULT_PROGRESS)
        os.environ[health.ENV_PROGRESS] = ",".join(sources) or "off"
        if "collectives" in sources and not any(
                name in os.environ for name in health.FR_USER_SETTINGS):
            os.environ[health.ENV_FR_BUFFER] = str(health.FR_BUFFER_SIZE)
        run_id = str(self._worker_group.spec.rdzv_handler.get_run_id())
        self.fr_dump_root: str | None = None
        if self.stall_watch is not None and "collectives" in sources:
            self.fr_dump_root = health.fr_dump_root(run_id)
        self._fr_dumped: dict[int, str] = {}  # attempt -> its dump folder
        self._observing_steps: bool | None = None
        self._observe_health(steps=True)

    def _observe_health(self, *, steps: bool) -> None:
        """(Re)subscribe the health watches: every worker event is a heartbeat (``ALL``, one
        subscriber for both watches); step times only where they are judged, on group
        rank 0 (the others' agents would pay for a straggler watch nobody asks)."""
        steps = steps and self.straggler_watch is not None
        if steps == self._observing_steps:
            return
        self._observing_steps = steps
        observe = health.observer(self.stall_watch,
                                  self.straggler_watch if steps else None)
        old, self._health_subs = self._health_subs, []
        if observe is not None:  # the new one first: no event falls between the two
            self._health_subs.append(self.bus.subscribe(ALL, on_event=observe))
        for sub in old:
            sub.cancel()

    def _arm_fr_dumps(self) -> None:
        """Point this attempt's workers at its dump folder (``EVENTBUS_FR_DUMP_DIR``)."""
        if self.fr_dump_root is None:
            return
        folder = os.path.join(self.fr_dump_root, f"attempt{self.attempt}")
        try:
            os.makedirs(folder, exist_ok=True)
            for name in os.listdir(folder):  # a former run's of the same run id
                if name.startswith(health.FR_DUMP_PREFIX):
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(folder, name))
        except OSError as exc:
            logger.warning("eventbus: no flight-recorder dumps (%s: %s)", folder, exc)
            os.environ.pop(health.ENV_FR_DUMP_DIR, None)
            return
        os.environ[health.ENV_FR_DUMP_DIR] = folder  # the workers inherit it

    @property
    def stopped_by_reactor(self) -> bool:
        """Whether a reactor's STOP ended (or is ending) the job."""
        return self._stop_reason is not None or self._remote_stop() is not None

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

    def _stop_for_remote(self, worker_group: WorkerGroup) -> RunResult | None:
        """Another node's reactor stopped the job: stop ours, no restart."""
        remote = self._remote_stop()
        if remote is None:
            return None
        if self._stop_reason is None:
            self._stop_reason = f"STOP on another node: {remote}"
            console.write(f"{self._stop_reason}: stopping this node's workers (exit code "
                          f"{self.stop_exit_code})")
        self._remaining_restarts = 0
        pcontext = getattr(self, "_pcontext", None)
        failures: dict[int, ProcessFailure] = {}
        if pcontext is not None:
            pids = {pid: local for local, pid in pcontext.pids().items()
                    if isinstance(pid, int)}
            health.stop_processes(pids, grace_s=self.stall_stop_grace_s,
                                  alive=lambda pid: _peek_exit(pid) is None)
            for pid, local_rank in pids.items():
                code = _peek_exit(pid)
                rank = worker_group.workers[local_rank].global_rank
                failures[rank] = failure = ProcessFailure(
                    local_rank=local_rank, pid=pid, exitcode=code if code is not None else -9,
                    error_file="<N/A>")
                if (self.attempt, rank) not in self._reported:
                    self._reported.add((self.attempt, rank))
                    self.bus.publish(WorkerExit(
                        worker_id=rank, exit_code=int(failure.exitcode),
                        worker_local_rank=local_rank, worker_pid=pid,
                        signal=signal_name(int(failure.exitcode)),
                        message="stopped by the agent: STOP on another node",
                        data={"attempt": self.attempt, "stopped_by_agent": True}))
        return RunResult(state=WorkerState.FAILED, failures=failures)

    def _check_slow(self, worker_group: WorkerGroup) -> None:
        watch = self.straggler_watch
        if watch is None or worker_group.group_rank not in (0, None):
            return
        now = time.monotonic()
        if now < self._next_slow_check:
            return
        self._next_slow_check = now + 1.0
        for slow in watch.check(self.attempt):
            data: dict[str, Any] = {"attempt": self.attempt, "slow_factor": watch.factor,
                                    "basis": slow.basis}
            if slow.basis == "compute_s":  # lock-step: the time outside collectives
                data.update(compute_s=slow.step_time_s,
                            median_compute_s=slow.median_step_time_s)
            self.bus.publish(WorkerSlow(
                worker_id=slow.rank, factor=round(slow.factor, 3),
                step_time_s=slow.step_time_s, median_step_time_s=slow.median_step_time_s,
                step=slow.step, data=data))

    def _check_stalls(self, worker_group: WorkerGroup) -> RunResult | None:
        """On a stall, name its culprits and publish WORKER_STALLED for them alone; let the
        reactors decide; then stop the group and return a FAILED result, which torch's loop
        restarts (one of ``--max-restarts``) or ends the job with. None while no rank is
        stalled.

        Group rank 0 judges the whole job: it sees every node's heartbeats through the job
        view, runs the culprit analysis (launcher/culprit.py) over them, and stops its
        own workers; the other nodes follow through torch's rendezvous (rank 0's restart
        makes them restart: ``num_nodes_waiting``), or the job-wide STOP (stop_signal.py).
        The other agents only ask their workers for flight-recorder dumps, and act alone
        only when group rank 0 did not within :data:`health.JUDGE_GRACE_S` more."""
        watch = self.stall_watch
        pcontext = getattr(self, "_pcontext", None)
        if watch is None or pcontext is None:
            return None
        attempt = self.attempt
        live: dict[int, tuple[int, int]] = {}  # global rank -> (local rank, pid)
        for local_rank, pid in sorted(pcontext.pids().items()):
            if isinstance(pid, int) and _peek_exit(pid) is None:
                live[worker_group.workers[local_rank].global_rank] = (local_rank, pid)
        judge = worker_group.group_rank in (0, None)
        ranks = set(live)
        if judge:  # the other nodes' ranks too (the job view)
            ranks.update(watch.ranks(attempt))
        if not watch.overdue(attempt, ranks):
            return None
        self._drain_plugins()  # what the worker sent just now counts as progress
        overdue = watch.overdue(attempt, ranks)
        if not overdue:
            return None
        if not judge:
            self._dump_flight_recorders(attempt, live)
            grace = health.JUDGE_GRACE_S + max(s.timeout_s for s in overdue)
            overdue = [s for s in overdue if s.silent_s > grace and s.rank in live]
            if not overdue:
                return None  # group rank 0 judges (and its restart reaches us)
        found = self._analyze_stall(attempt, overdue, local_only=not judge)
        if found is None:
            return None  # a slow start: the ranks held up wait for one not yet started
        # Ask for the flight-recorder dumps now; they are written while the stacks are
        # taken and the event is published, and waited for before the workers are stopped.
        dump_dir, asked = self._ask_flight_recorders(attempt)
        analysis, stalled = found
        watch.mark_reported(attempt, ranks)
        self.stalls += len(stalled)
        beats = watch.beats(attempt)
        stacks = (health.StackDumper(self._stack_dir).capture(pid for _, pid in live.values())
                  if self._stack_dir else {})

        def stack_of(rank: int) -> str:
            if rank in live:
                return stacks.get(live[rank][1], "")
            beat = beats.get(rank)
            text = beat[0].data.get("stack") if beat is not None and beat[0].data else None
            return text if isinstance(text, str) else (
                "(no stack: the rank runs on another node and its heartbeats carry none)")

        every = sorted(set(ranks) | set(beats))
        events = []
        for rank in stalled:
            local_rank, pid = live.get(rank, (None, None))
            silent = watch.silent_s(attempt, rank)
            beat = beats.get(rank)
            data: dict[str, Any] = {
                "attempt": attempt, "culprit_ranks": list(analysis.culprit_ranks or stalled),
                "waiting_ranks": list(analysis.waiting_ranks),
                "collective": (analysis.collective.as_data()
                               if analysis.collective is not None else None),
                "diagnosis": analysis.diagnosis, "mismatch": analysis.mismatch,
                "matcher": analysis.matcher, "stack": stack_of(rank),
                "peer_stacks": {str(r): stack_of(r) for r in every if r != rank}}
            where = beat[0].data.get("where") if beat is not None and beat[0].data else None
            if isinstance(where, str):
                data["where"] = where
            if dump_dir is not None:
                data["fr_dump_dir"] = dump_dir
            if not judge:
                data["judged_by"] = f"group rank {worker_group.group_rank} (alone)"
            events.append(WorkerStalled(
                worker_id=rank, silent_s=round(silent if silent is not None else 0.0, 3),
                timeout_s=watch.timeout_for(attempt, rank), worker_local_rank=local_rank,
                worker_pid=pid, data=data))
        self._decide(events)
        if dump_dir is not None:
            health.wait_fr_dumps(dump_dir, live, asked)
        # Stop the whole group now, with a short grace: a worker blocked in a collective
        # ignores SIGTERM until the collective's own timeout (30 min with gloo/NCCL).
        health.stop_processes({pid: rank for rank, (_, pid) in live.items()},
                              grace_s=self.stall_stop_grace_s,
                              alive=lambda pid: _peek_exit(pid) is None)
        failures: dict[int, ProcessFailure] = {}
        for rank, (local_rank, pid) in sorted(live.items()):
            code = _peek_exit(pid)
            failure = ProcessFailure(local_rank=local_rank, pid=pid,
                                     exitcode=code if code is not None else -9,
                                     error_file="<N/A>")
            failures[rank] = failure
            if (attempt, rank) not in self._reported:
                self._reported.add((attempt, rank))
                self.bus.publish(WorkerExit(
                    worker_id=rank, exit_code=int(failure.exitcode),
                    worker_local_rank=local_rank, worker_pid=pid,
                    signal=signal_name(int(failure.exitcode)),
                    message="stopped by the agent: the group stalled",
                    data={"attempt": attempt, "stopped_by_agent": True,
                          "stalled": rank in stalled}))
        return RunResult(state=WorkerState.FAILED, failures=failures)

    def _analyze_stall(self, attempt: int, overdue: Sequence[health.Stall], *,
                       local_only: bool) -> tuple[culprit.Analysis, list[int]] | None:
        """The analysis and the ranks to report stalled: its culprits (when the heartbeats
        name them), else the overdue ranks that wait in no collective, else every overdue
        rank (the collective itself makes no progress). None when every culprit has not
        started yet (a slow start: never a stall, as before the first event)."""
        watch = self.stall_watch
        assert watch is not None
        progress = [p for rank, (beat, age) in watch.beats(attempt).items()
                    for p in [culprit.progress_of(beat, age_s=age)] if p is not None]
        try:
            analysis = culprit.analyze(progress)
        except Exception:  # the analysis must never cost the stall
            logger.exception("eventbus: the culprit analysis failed; reporting the silent "
                             "ranks")
            analysis = culprit.Analysis((), (), None, False,
                                        "the culprit analysis failed (see the agent's log)")
        started = set(watch.ranks(attempt))
        # A rank whose heartbeats stopped (its progress thread ends when the script does;
        # the interpreter's exit may take seconds) is likelier ending than hung: not judged
        # on a view that old until JUDGE_GRACE_S past the timeout (a rank hung in C code
        # that holds the GIL sends no heartbeats either).
        beats = watch.beats(attempt)
        grace = health.JUDGE_GRACE_S + max(s.timeout_s for s in overdue)
        patient = max(s.silent_s for s in overdue) < grace
        gone = {r for r, (_, age) in beats.items() if age > health.BEATS_STOPPED_S}
        if patient and gone:
            return None
        def late(rank: int) -> bool:
            silent = watch.silent_s(attempt, rank)
            return silent is not None and silent > watch.timeout_for(attempt, rank)

        if analysis.culprit_ranks and not local_only:
            named = [r for r in analysis.culprit_ranks if r in started]
            # a culprit still progressing is a view older than its next heartbeat
            return (analysis, named) if named and any(late(r) for r in named) else None
        waiting = {p.rank for p in progress
                   if any(st.completed < st.enqueued for st in p.pgs.values())}
        silent = [s.rank for s in overdue]
        stalled = [r for r in silent if r not in waiting and r not in analysis.waiting_ranks]
        if local_only:
            return (analysis, stalled) if stalled else None  # never a waiting rank
        if not stalled:
            if watch.ended(attempt):
                return None  # they wait for a rank whose script ended: the job's end
            if any(not late(r) for r in set(beats) | started):
                return None  # another rank progresses: the waiting rank's view is stale
            stalled = silent
            if analysis.collective is None and waiting:
                analysis = attrs.evolve(analysis, diagnosis=(
                    f"{culprit.format_ranks(silent)} made no progress for "
                    f"{max(s.silent_s for s in overdue):.1f} s, each waiting in a "
                    "collective that no other rank's heartbeat shows missing (the collective "
                    "itself, or a rank that sends no heartbeats)"))
        elif analysis.collective is None:
            where = {p.rank: p.where for p in progress if p.where}
            places = "; ".join(f"rank {r} is at {where[r]}" for r in stalled if r in where)
            analysis = attrs.evolve(analysis, diagnosis=(
                f"{culprit.format_ranks(stalled)} made no progress for "
                f"{max(s.silent_s for s in overdue):.1f} s ({analysis.diagnosis})"
                + (f"; {places}" if places else "")))
        return analysis, stalled

    def _abort_diagnosis(self, rank: int) -> dict[str, Any]:
        """A worker ended by SIGABRT: where its heartbeats last saw it, what its peers wait
        in, and gloo's way of ending a size mismatch; with the survivors' flight-recorder
        dumps, which hold their side of that collective (docs/run.md, "Job health")."""
        watch = self.stall_watch
        if watch is None:
            return {}
        try:
            beats = watch.beats(self.attempt)
            progress = {p.rank: p for b, age in beats.values()
                        for p in [culprit.progress_of(b, age_s=age)] if p is not None}
            dead = progress.get(rank)
            if dead is None or not dead.pgs:
                return {}
            analysis = culprit.analyze(progress.values())
            pg, state = min(dead.pgs.items(), key=lambda kv: culprit.pg_order(kv[0]))
            text = (f"rank {rank} ended by SIGABRT after collective #{state.completed} of "
                    f"process group {pg} (its last heartbeat)")
            if analysis.collective is not None:
                text += f"; {analysis.diagnosis}"
            text += ("; on gloo a collective whose sizes differ between ranks aborts the "
                     "receiving rank this way (\"Received data size doesn't match expected "
                     "size\"): compare the ranks' next collective in the flight-recorder "
                     "dumps")
            out: dict[str, Any] = {"diagnosis": text}
            if analysis.collective is not None:
                out["collective"] = analysis.collective.as_data()
            pcontext = getattr(self, "_pcontext", None)
            if pcontext is not None:
                live = {self._worker_group.workers[local].global_rank: (local, pid)
                        for local, pid in pcontext.pids().items()
                        if isinstance(pid, int) and _peek_exit(pid) is None}
                folder = self._dump_flight_recorders(self.attempt, live) if live else None
                if folder is not None:
                    out["fr_dump_dir"] = folder
            return out
        except Exception:  # a diagnosis must never cost the failure's handling
            logger.exception("eventbus: no diagnosis for rank %d's SIGABRT", rank)
            return {}

    def _ask_flight_recorders(self, attempt: int) -> tuple[str | None, int]:
        """Ask this attempt's workers for their flight-recorder traces (once per attempt):
        (the folder, or None without dumps; when it asked, for :func:`wait_fr_dumps`)."""
        if self.fr_dump_root is None or attempt in self._fr_dumped:
            return None, 0
        folder = os.path.join(self.fr_dump_root, f"attempt{attempt}")
        try:
            asked = health.ask_fr_dumps(folder, f"stall-attempt{attempt}-{time.time():.3f}")
        except OSError as exc:
            logger.warning("eventbus: no flight-recorder dumps: %s", exc)
            self._fr_dumped[attempt] = ""
            return None, 0
        self._fr_dumped[attempt] = folder
        return folder, asked

    def _dump_flight_recorders(self, attempt: int,
                               live: Mapping[int, tuple[int, int]]) -> str | None:
        """Ask this node's live workers for their flight-recorder traces (once per attempt)
        and wait for them briefly; the folder, or None without dumps (opted out)."""
        if self.fr_dump_root is None:
            return None
        if attempt in self._fr_dumped:
            return self._fr_dumped[attempt] or None
        try:
            folder = health.request_fr_dumps(
                os.path.join(self.fr_dump_root, f"attempt{attempt}"),
                f"stall-attempt{attempt}-{time.time():.3f}", live)
        except OSError as exc:
            logger.warning("eventbus: no flight-recorder dumps: %s", exc)
            self._fr_dumped[attempt] = ""
            return None
        self._fr_dumped[attempt] = folder or ""
        return folder

    # -- reactors ---------------------------------------------------------------------------
    def add_reactor(self, reactor: Reactor) -> Subscription:
        """Subscribe ``reactor`` to ``WORKER_EXIT`` on the agent's bus.

        It is called with each *failed* worker's ``WORKER_EXIT`` that this agent
        publishes, in the monitor thread, before the group is stopped. ``STOP`` from any
        reactor fails the job at once (restarts left or not); ``RESTART`` restarts the
        group using one of ``--max-restarts`` (none left: the job fails); ``None``
        leaves torchrun's policy. Those three are the only answers: a reactor that returns
        anything else (the string ``"stop"``, ``True``) counts as no decision and is
        reported once, as a reactor error naming what it returned and what is accepted; a
        reactor that raises counts as no decision and is logged with its traceback. Both
        count in :attr:`reactor_errors`.
        """
        if not callable(reactor):
            raise TypeError(f"a reactor must be callable (event) -> Decision | None, got "
                            f"{type(reactor).__name__}")
        attach = getattr(reactor, "attach", None)
        if callable(attach):
            attach(self.bus)  # reactors that watch other events (e.g. the loss) subscribe
        name = _name_of(reactor)
        key: list[int] = []  # id of this reactor's subscription, set below

        def consult(event: Event) -> None:
            decisions = getattr(self._collecting, "decisions", None)
            if decisions is None:  # not one of this agent's failure reports
                return
            try:
                decision = _decision_of(reactor(event))
            except Exception:
                self.reactor_errors += 1
                logger.exception("eventbus: reactor %s raised on %s; counted as no decision",
                                 name, _describe(event))
                return
            if isinstance(decision, _NotADecision):
                self.reactor_errors += 1
                if key[0] not in self._reactors_misanswered:  # once per reactor
                    self._reactors_misanswered.add(key[0])
                    logger.error(
                        "eventbus: reactor error: %s returned %s on %s; a reactor returns "
                        "%s: counted as no decision (reported once per reactor; "
                        "EventAgent.reactor_errors counts them all)",
                        name, decision.describe(), _describe(event), REACTOR_ANSWERS)
                return
            if decision is not None:
                decisions.append((decision, name))

        sub = self.bus.subscribe(EventType.WORKER_EXIT, on_event=consult,
                                 where=_is_failure)
        key.append(id(sub))
        self._reactor_subs.append(sub)
        # the same reactor decides on stalls (docs/run.md "Job health")
        self._reactor_subs.append(self.bus.subscribe(EventType.WORKER_STALLED,
                                                     on_event=consult))
        return sub

    def _publish_failure(self, event: Event) -> list[tuple[Decision, str]]:
        decisions: list[tuple[Decision, str]] = []
        self._collecting.decisions = decisions
        try:
            self.bus.publish(event)
        finally:
            self._collecting.decisions = None
        return decisions

    # -- attempt bookkeeping ----------------------------------------------------------------
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

    # -- the hooked internals ---------------------------------------------------------------
    def run(self, role: str = "default") -> RunResult:
        spec = self._worker_group.spec
        set_context(run_id=spec.rdzv_handler.get_run_id(), restart_count=self.attempt,
                    role=spec.role, local_world_size=spec.local_world_size)
        self.bus.record(EventType.AGENT_START,
                        entrypoint=self.entrypoint_name,
                        max_restarts=spec.max_restarts, nproc_per_node=spec.local_world_size)
        result: RunResult | None = None
        error: BaseException | None = None
        try:
            result = super().run(role)
            return result
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._finish(result, error)

    def _finish(self, result: RunResult | None, error: BaseException | None) -> None:
        for plugin in self.plugins:
            try:
                plugin.before_exit(timeout=self.plugin_exit_timeout)
            except Exception:
                logger.exception("agent plugin %s raised in before_exit", _name_of(plugin))
        if result is not None and not result.is_failed():
            state, code, reason = str(result.state.value), 0, None
        elif result is not None:
            state, code = "FAILED", self.stop_exit_code if self.stopped_by_reactor else 1
            reason = self._stop_reason or self._failure_summary or "worker group failed"
        else:
            state, code = "FAILED", self.stop_exit_code if self.stopped_by_reactor else 1
            reason = f"{type(error).__name__}: {error}" if error is not None else None
            if self._stop_reason is not None:
                # a STOP's reason survives whatever torch raised on the way out
                reason = f"{self._stop_reason} (then the agent raised {reason})"
            elif self._remote_stop() is not None:
                reason = f"STOP on another node: {self._remote_stop()} ({reason})"
        if self._stop_signal is not None:
            if self._stop_signal.announced:
                self._stop_signal.wait_for_acks()  # our process may host the store
            self._stop_signal.close()
        self.bus.record(EventType.AGENT_EXIT, state=state, exit_code=code, reason=reason)
        for sub in [*self._reactor_subs, *self._health_subs]:
            sub.cancel()
        if self._stack_dir is not None:
            shutil.rmtree(self._stack_dir, ignore_errors=True)

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
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
        self._observe_health(steps=worker_group.group_rank in (0, None))
        self._arm_fr_dumps()
        if self.plugins:
            self._after_rendezvous(worker_group)
        self._freeze_heap()

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
        for plugin in self.plugins:
            try:
                env = plugin.after_rendezvous(info)
                for key, value in (env or {}).items():
                    if not isinstance(key, str) or not isinstance(value, str):
                        raise TypeError(f"after_rendezvous() must return str -> str env "
                                        f"vars, got {key!r}: {value!r}")
                    os.environ[key] = value  # workers inherit the agent's environment
            except Exception:
                logger.exception("agent plugin %s raised in after_rendezvous",
                                 _name_of(plugin))

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        pids: dict[int, Any] = super()._start_workers(worker_group)
        for worker in worker_group.workers:
            pid = pids.get(worker.local_rank)
            self.bus.record(EventType.WORKER_START, worker_id=worker.global_rank,
                            worker_local_rank=worker.local_rank,
                            worker_pid=pid if isinstance(pid, int) else None)
        return pids

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        # 1. Failures first, as they are: torch's wait() stops the survivors before it
        #    reports the failure.
        remote = self._stop_for_remote(worker_group)
        if remote is not None:
            return remote
        spontaneous = self._with_earlier_failures(worker_group,
                                                  self._peek_failures(worker_group))
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
        attempt = self.attempt
        if result.state in _FAILED_STATES:
            late: list[WorkerExit] = []
            unseen = sorted((rank, f) for rank, f in result.failures.items()
                            if (attempt, rank) not in self._reported)
            # Without a peek (no waitid here, or an exit in between) torch's result mixes
            # the workers that failed with those it stopped (SIGTERM) because of them.
            own = [rank for rank, f in unseen if f.exitcode != -int(signal.SIGTERM)]
            first_seen = self._first_error_ns.get(attempt)
            for global_rank, failure in unseen:
                # a worker whose error file predates the first failure decided on failed
                # first (the grace ended during its teardown): its own failure, never
                # "stopped by the agent", and the reactors see it
                written = _error_time(failure.error_file)
                earlier = written is not None and first_seen is not None and \
                    written < first_seen
                stopped = not earlier and (
                    bool(spontaneous) or (bool(own) and global_rank not in own))
                event = self._exit_event(worker_group, global_rank, failure,
                                         stopped_by_agent=stopped)
                if stopped:
                    self._reported.add((attempt, global_rank))
                    self.bus.publish(event)
                else:
                    late.append(event)
            if late:
                # in the order they failed (a failure without an error file goes last)
                late.sort(key=lambda e: _error_time(e.data.get("error_file")) or sys.maxsize)
                self._decide(late)
            if not result.failures and self._restart_reason is None:
                self._restart_reason = f"worker group {result.state.name}"
        elif result.state == WorkerState.SUCCEEDED:
            for worker in worker_group.workers:
                if (attempt, worker.global_rank) not in self._reported:
                    self._reported.add((attempt, worker.global_rank))
                    self.bus.record(EventType.WORKER_EXIT, worker_id=worker.global_rank,
                                    exit_code=0, worker_local_rank=worker.local_rank,
                                    worker_pid=worker.id if isinstance(worker.id, int)
                                    else None, data={"attempt": attempt})
        return result

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
        pcontext = getattr(self, "_pcontext", None)
        if pcontext is None:
            raise exc
        with contextlib.suppress(Exception):
            pcontext.close()  # what torch's wait() does on a failure (idempotent)
        handlers: Mapping[int, Any] = getattr(pcontext, "subprocess_handlers", {}) or {}
        error_files: Mapping[int, str] = getattr(pcontext, "error_files", {}) or {}
        failures: dict[int, ProcessFailure] = {}
        for local_rank, pid in sorted(pcontext.pids().items()):
            proc = getattr(handlers.get(local_rank), "proc", None)
            code = proc.poll() if proc is not None else None
            if code is None and isinstance(pid, int):
                code = _peek_exit(pid)
            if code == 0:
                continue
            code = -int(signal.SIGKILL) if code is None else int(code)
            rank = worker_group.workers[local_rank].global_rank
            try:
                failure = ProcessFailure(local_rank=local_rank, pid=int(pid), exitcode=code,
                                         error_file=error_files.get(local_rank, "<N/A>"))
            except Exception:  # the torn one: torchrun's own report must not read it again
                failure = ProcessFailure(local_rank=local_rank, pid=int(pid), exitcode=code,
                                         error_file="<N/A>")
            failures[rank] = failure
        return RunResult(state=WorkerState.FAILED, failures=failures)

    def _peek_failures(self, worker_group: WorkerGroup) -> list[WorkerExit]:
        pcontext = getattr(self, "_pcontext", None)
        if pcontext is None:
            return []
        attempt = self.attempt
        found = []
        error_files: Mapping[int, str] = getattr(pcontext, "error_files", {}) or {}
        for local_rank, pid in sorted(pcontext.pids().items()):
            worker = worker_group.workers[local_rank]
            if (attempt, worker.global_rank) in self._reported or not isinstance(pid, int):
                continue
            code = _peek_exit(pid)
            if code is None or code == 0:
                continue
            try:
                failure = ProcessFailure(local_rank=local_rank, pid=pid, exitcode=code,
                                         error_file=error_files.get(local_rank, "<N/A>"))
            except Exception:  # an unreadable error file: report the exit without it
                failure = ProcessFailure(local_rank=local_rank, pid=pid, exitcode=code,
                                         error_file="<N/A>")
            found.append(self._exit_event(worker_group, worker.global_rank, failure,
                                          stopped_by_agent=False))
        return found

    def _with_earlier_failures(self, worker_group: WorkerGroup,
                               found: list[WorkerExit]) -> list[WorkerExit] | None:
        """``found`` (failed workers the peek saw), with the workers that failed *before*
        them and are still exiting, in the order they failed: the first one caused it.

        A worker whose script raised writes its error file at once (the bootstrap, or
        torch's ``@record``) and then spends seconds in the interpreter's teardown; its
        peers meanwhile fail on the lost connection ("Connection closed by peer") and can
        exit first. Judged by exits alone, a peer would be blamed and the worker that
        raised first counted as stopped by the agent. So when every failure seen has an
        error file, a live worker whose error file is older than all of theirs is given
        up to :data:`DYING_GRACE_S` to exit by itself, and the failures are ordered by
        their error files' times. A failure without an error file (a signal, ``os._exit``)
        leaves the order as seen: nothing says when it happened.

        None while that worker is still exiting within the grace: the monitor's tick
        returns at once (torch's loop calls again), it does not block. The grace starts
        once per attempt; when it ends with the worker alive, the failures seen are
        decided on, and the worker's own failure comes through the late path (its error
        file older than theirs: not "stopped by the agent")."""
        pcontext = getattr(self, "_pcontext", None)
        if not found or pcontext is None:
            return found
        times = [_error_time(e.data.get("error_file")) for e in found]
        if any(t is None for t in times):
            return found
        first = min(t for t in times if t is not None)
        seen = {e.worker_id for e in found}
        error_files: Mapping[int, str] = getattr(pcontext, "error_files", {}) or {}
        dying = []
        for local_rank, pid in sorted(pcontext.pids().items()):
            rank = worker_group.workers[local_rank].global_rank
            if rank in seen or (self.attempt, rank) in self._reported or \
                    not isinstance(pid, int):
                continue
            written = _error_time(error_files.get(local_rank))
            if written is not None and written < first and _peek_exit(pid) is None:
                dying.append(pid)
        if dying:
            deadline = self._dying_until.setdefault(self.attempt,
                                                    time.monotonic() + DYING_GRACE_S)
            if time.monotonic() < deadline:
                return None  # still exiting, within the grace: the next tick looks again
            found = [*found, *(e for e in self._peek_failures(worker_group)
                               if e.worker_id not in seen)]
        # stable: a failure without an error file (a signal after the wait) goes last
        return sorted(found, key=lambda e: _error_time(e.data.get("error_file")) or sys.maxsize)

    def _exit_event(self, worker_group: WorkerGroup, global_rank: int,
                    failure: ProcessFailure, *, stopped_by_agent: bool) -> WorkerExit:
        data: dict[str, Any] = {"attempt": self.attempt}
        if stopped_by_agent:
            data["stopped_by_agent"] = True
        if failure.error_file not in ("<N/A>", os.devnull):
            data["error_file"] = failure.error_file
        if not stopped_by_agent and int(failure.exitcode) == -int(signal.SIGABRT):
            data.update(self._abort_diagnosis(global_rank))
        return WorkerExit(
            worker_id=global_rank, exit_code=int(failure.exitcode),
            worker_local_rank=int(failure.local_rank), worker_pid=int(failure.pid),
            signal=signal_name(int(failure.exitcode)), message=_failure_message(failure),
            data=data,
        )

    def _drain_plugins(self) -> None:
        for plugin in self.plugins:
            drain = getattr(plugin, "drain", None)
            if not callable(drain):
                continue
            try:
                drain(timeout=FAILURE_DRAIN_TIMEOUT_S)
            except Exception:
                logger.exception("agent plugin %s raised in drain", _name_of(plugin))

    def _decide(self, failures: Sequence[WorkerExit | WorkerStalled]) -> None:
        """Publish each failure, collect the reactors' decisions, and apply them."""
        # What the failed workers sent before they died goes first (see AgentPlugin).
        self._drain_plugins()
        decisions: list[tuple[Decision, str]] = []
        for event in failures:
            if isinstance(event, WorkerExit):
                self._reported.add((self.attempt, event.worker_id))
                written = _error_time(event.data.get("error_file"))
                if written is not None:
                    first = self._first_error_ns.get(self.attempt)
                    self._first_error_ns[self.attempt] = \
                        written if first is None else min(first, written)
            decisions.extend(self._publish_failure(event))
        summary = _describe(failures[0])
        self._failure_summary = summary
        stops = [name for decision, name in decisions if decision is Decision.STOP]
        restarts = [name for decision, name in decisions if decision is Decision.RESTART]
        if not stops and self._remote_stop() is not None:
            stops = [f"another node ({self._remote_stop()})"]
        left = self._remaining_restarts
        if stops:
            self._stop_reason = f"{summary}; STOP from {', '.join(stops)}"
            if self._stop_signal is not None and self._remote_stop() is None:
                self._stop_signal.announce(self._stop_reason)
            outcome = (f"STOP from {', '.join(stops)}: stopping the job (exit code "
                       f"{self.stop_exit_code}; {console.restarts_text(left)} unused)")
            # torch's monitor loop stops and fails the group when no restart is left.
            self._remaining_restarts = 0
        elif left <= 0:
            if not restarts:
                self._restart_reason = summary
            outcome = (f"RESTART from {', '.join(restarts)}, but no" if restarts else "no") + \
                (f" restart is left (--max-restarts {self._worker_group.spec.max_restarts}): "
                 "the job fails")
        else:
            by = f"RESTART from {', '.join(restarts)}: " if restarts else ""
            self._restart_reason = f"{summary}; RESTART from {', '.join(restarts)}" \
                if restarts else summary
            # what torch's loop does next: one restart less, the next attempt
            outcome = (f"{by}restarting the group as attempt {self._next_attempt() + 1} "
                       f"({console.restarts_text(left - 1)})")
        self._console_decision(failures, outcome)

    def _console_decision(self, failures: Sequence[WorkerExit | WorkerStalled],
                          outcome: str) -> None:
        """The decision's ``eventbus:`` line on stderr (with or without --log-events), a
        stall's diagnosis and stack under it (docs/run.md, "On the console")."""
        try:
            text = f"{console.culprits_text(failures)}; {outcome}"
            details: list[str] = []
            seen: set[str] = set()
            for event in failures:
                if isinstance(event, WorkerStalled):
                    details.extend(console.stall_detail_lines(event, seen))
            if details:
                text += "\n" + console.indented(details)
            console.write(text)
        except Exception:  # the console must never cost a decision
            logger.exception("eventbus: the console line of a decision failed")

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        reason = self._restart_reason or \
            "membership change: the group re-forms through the rendezvous"
        if self._restart_reason is None:  # torch's decision, not a failure's: its line here
            console.write("the group re-forms through the rendezvous (another node "
                          "restarted it, or nodes joined; this uses no restart; "
                          f"{console.restarts_text(self.remaining_restarts)})")
        self._restart_reason = None
        # a membership change keeps the attempt's number: its grace and failures are done
        self._dying_until.clear()
        self._first_error_ns.clear()
        attempt = self._next_attempt()
        # up to the new attempt's number included: a membership change keeps the number,
        # and the stopped workers' state must not stall the new ones
        for watch in (self.stall_watch, self.straggler_watch):
            if watch is not None:
                watch.forget_before(attempt + 1)
        if self._observing_steps is not None:  # a fresh observer: its cache held the old
            steps, self._observing_steps = self._observing_steps, None
            self._observe_health(steps=steps)
        set_context(restart_count=attempt)
        self.bus.record(EventType.WORKER_RESTART, attempt=attempt,
                        restarts_left=self.remaining_restarts, reason=reason)
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


def _is_failure(event: Event) -> bool:
    return isinstance(event, WorkerExit) and event.exit_code != 0


def _describe(event: Event) -> str:
    if isinstance(event, WorkerStalled):
        return (f"rank {event.worker_id} stalled (no event for {event.silent_s:.1f} s, "
                f"timeout {event.timeout_s or 0:g} s)")
    if isinstance(event, WorkerExit):
        how = f"signal {event.signal}" if event.signal else f"exit code {event.exit_code}"
        text = f"rank {event.worker_id} failed ({how})"
        if event.message:
            text += f": {event.message.splitlines()[0][:200]}"
        return text
    return str(event.type)


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
            # Give torch its event registry back (launch_agent's last records included).
            uninstall_torchelastic_bridge(TORCH_RECORDS_DESTINATION)
            _relay.target = None
