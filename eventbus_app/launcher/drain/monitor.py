"""The drain as the agent runs it: ``PREEMPTING`` announced, another node's drain heard,
and the monitor's tick during a drain (wait for the workers to stop by themselves, then
forward the signal at the deadline), each worker's exit reported with cause
``preemption``.

Why a module of its own: :mod:`~eventbus.app.launcher.drain.state` holds the rules (torch-free:
the signals, the deadline, the line); what the agent does with its workers meanwhile is
one path of its own, apart from the torch hooks, which call :meth:`DrainMonitor.tick`
instead of their monitor while a drain is active (docs/preemption.md).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult
from torch.distributed.elastic.agent.server.api import WorkerGroup
from torch.distributed.elastic.agent.server.api import WorkerState

from eventbus.app.launcher.decisions.failures import failure_message
from eventbus.app.launcher.drain.state import Drain
from eventbus.app.launcher.group.exits import ExitBook
from eventbus.app.launcher.group.workers import Workers
from eventbus.app.protocol.drain_signals import DEFAULT_SIGNAL_WINDOW_S
from eventbus.app.protocol.drain_signals import ENV_AGENT_PID
from eventbus.app.protocol.drain_signals import ENV_AGENT_STOP
from eventbus.app.protocol.drain_signals import ENV_DRAIN_SIGNALS
from eventbus.app.protocol.drain_signals import ENV_DRAIN_WINDOW
from eventbus.app.protocol.host_faults import HOST_FAULT_KEY
from eventbus.bus import Bus
from eventbus.events import Cause
from eventbus.events import Preempting
from eventbus.events import WorkerExit
from eventbus.events import signal_name

__all__ = ["DrainMonitor"]

#: (attempt, rank, exit code, message, stopped by the agent) -> the host fault or None
HostFault = Callable[[int, int, int, "str | None", bool], "str | None"]


class DrainMonitor:
    """This agent's drain (:attr:`drain`, built here with these settings) and what the
    agent does during one."""

    def __init__(self, bus: Bus, workers: Workers, exits: ExitBook, *,
                 attempt: Callable[[], int], signals_: Sequence[str], grace_s: float,
                 exit_code: int, kill_grace_s: float,
                 host_fault: HostFault | None = None,
                 window_s: float = DEFAULT_SIGNAL_WINDOW_S) -> None:
        self._bus = bus
        #: a worker that failed by itself during the drain may still point at its host
        #: (a SIGSEGV as it saves): the agent's host-fault count (eviction.py)
        self._host_fault = host_fault
        self._workers = workers
        self._exits = exits
        self._attempt = attempt
        #: the drain: its signals, deadline and console line (drain.py)
        self.drain = Drain(signals_=signals_, grace_s=grace_s, exit_code=exit_code,
                           kill_grace_s=kill_grace_s, on_begin=self.announce,
                           window_s=window_s)
        #: ``claim() -> bool``: whether this agent is the job's first to announce the
        #: drain (the notice board's key); None: it is
        self.claim: Callable[[], bool] | None = None
        #: this agent published the job's one PREEMPTING
        self.announced = False
        # the workers take the drain signals that the scheduler sends them too
        # (eventbus.app.worker.drain_signals), and ask this agent for a drain
        if signals_:
            os.environ[ENV_DRAIN_SIGNALS] = ",".join(signals_)
            os.environ[ENV_DRAIN_WINDOW] = repr(float(window_s))
            os.environ[ENV_AGENT_PID] = str(os.getpid())
            # the agent's own stops are marked here (protocol/drain_signals.py)
            os.environ[ENV_AGENT_STOP] = os.path.join(
                tempfile.gettempdir(), f"eventbus-agent-stop-{os.getpid()}")
        else:
            for name in (ENV_DRAIN_SIGNALS, ENV_DRAIN_WINDOW, ENV_AGENT_PID, ENV_AGENT_STOP):
                os.environ.pop(name, None)

    def announce(self, drain: Drain) -> None:
        """A drain signal reached this agent (the drain thread): ``PREEMPTING`` on the bus,
        which the notice board tells every worker and every other agent; unless another
        agent claimed the drain first (the scheduler signalled every node at once): its
        ``PREEMPTING`` is the job's one, and reaches this node's workers as well."""
        if self.claim is not None and not self.claim():
            return
        self.announced = True
        self._bus.publish(Preempting(deadline_s=round(drain.seconds_left(), 3),
                                     reason=drain.reason(), signal=drain.signal,
                                     node=drain.origin, grace_s=drain.grace_s))

    def remote(self, event: Preempting, seq: int) -> None:
        """Another node's drain reached this one (the notice board's thread)."""
        started = self.drain.begin(event.signal or "SIGTERM", origin=event.node,
                                   local=False, deadline_s=event.deadline_s)
        if not started and not self.announced:
            self.drain.origin = event.node  # the job's drain is the announcer's

    def tick(self, worker_group: WorkerGroup,
             monitor: Callable[[WorkerGroup], RunResult]) -> RunResult:
        """The monitor during a drain: no restart, no stall verdict; the workers stop by
        themselves until the deadline, then get the signal (SIGKILL after the kill grace).
        Torch's own ``monitor`` is asked only once none is running: on a first non-zero
        exit it would stop the others, who may still be saving their checkpoint."""
        drain, workers = self.drain, self._workers
        live = workers.live()
        if live and drain.due():
            drain.forwarded_at = drain.forwarded_at or drain.clock()
            drain.late_ranks.update(live)
            self._report(worker_group, {
                rank: code for rank, _, pid in workers.procs() if rank not in live
                and (code := workers.peek(pid)) is not None})  # those that stopped in time
            why = (f"did not stop within the drain's grace ({drain.grace_s:g} s): "
                   f"{drain.signal}, then SIGKILL")
            return workers.stop(live, cause=str(Cause.PREEMPTION), why=why,
                                signum=drain.signum, grace_s=drain.kill_grace_s)
        if live:
            return RunResult(state=WorkerState.HEALTHY)
        drain.ended_at = drain.ended_at or drain.clock()
        result = monitor(worker_group)
        self._report(worker_group, {
            worker.global_rank: int(f.exitcode) if (f := result.failures.get(
                worker.global_rank)) is not None else 0 for worker in worker_group.workers},
            result)
        return result

    def _report(self, worker_group: WorkerGroup, codes: Mapping[int, int],
                result: RunResult | None = None) -> None:
        """The exit of each worker of ``codes`` (rank -> exit code) during a drain,
        unreported so far: 0 (it stopped by itself), or its code with cause
        ``preemption``."""
        attempt = self._attempt()
        for worker in worker_group.workers:
            rank = worker.global_rank
            if rank not in codes or not self._exits.report(attempt, rank):
                continue
            failure = result.failures.get(rank) if result is not None else None
            code = int(codes[rank])
            if code and rank not in self.drain.late_ranks:
                self.drain.failed_ranks[rank] = code
            pid = worker.id if isinstance(worker.id, int) else None
            message = failure_message(failure) if failure is not None else None
            data: dict[str, Any] = {"attempt": attempt, "drained": True}
            if code and self._host_fault is not None:
                kind = self._host_fault(attempt, rank, code, message,
                                        rank in self.drain.late_ranks)
                if kind is not None:
                    data[HOST_FAULT_KEY] = kind
            self._bus.publish(WorkerExit(
                worker_id=rank, exit_code=code, worker_local_rank=worker.local_rank,
                worker_pid=pid, signal=signal_name(code) if code else None,
                message=message, cause=str(Cause.PREEMPTION) if code else None,
                data=data))

    @staticmethod
    def result() -> RunResult:
        """What torch's launcher gets after a drain: not a failure (it would print its
        failure table; the drain's line and ``AGENT_EXIT`` say what happened)."""
        return RunResult(state=WorkerState.SUCCEEDED)
