"""The agent's view of this node's worker processes, and the one way it stops them.

Why a module of its own: the failure ordering (:mod:`~eventbus.app.launcher.decisions.failures`),
the stall path (:mod:`~eventbus.app.launcher.job_health`), the drain's monitor
(:mod:`~eventbus.app.launcher.drain.monitor`) and a STOP on another node all read the same
processes (global rank, local rank, pid, error file, alive or not) and stop them the same
way, each reported once as stopped by the agent with its ``cause``. The processes are read
from torch's process context without reaping them (``peek``, injected:
:func:`~eventbus.app.launcher.group.processes.peek_exit`), so torch still reaps and reports
them as usual.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult
from torch.distributed.elastic.agent.server.api import WorkerGroup
from torch.distributed.elastic.agent.server.api import WorkerState
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from eventbus.app.launcher.group.exits import ExitBook
from eventbus.app.launcher.group.processes import stop_processes
from eventbus.app.protocol.drain_signals import agent_stopping
from eventbus.bus import Bus
from eventbus.events import EventType
from eventbus.events import WorkerExit
from eventbus.events import signal_name

__all__ = ["Live", "Workers"]

#: this node's live workers: global rank -> (local rank, pid)
Live = Mapping[int, tuple[int, int]]


class Workers:
    """This node's workers as torch started them, for the agent's current attempt.

    ``context``: torch's process context of the current workers (None before the first
    start); ``peek``: a child's exit code read without reaping it (None while it runs);
    ``attempt``: the attempt the exits belong to; ``grace_s``: SIGTERM to SIGKILL.
    """

    def __init__(self, worker_group: WorkerGroup, *, bus: Bus, exits: ExitBook,
                 context: Callable[[], Any], peek: Callable[[int], int | None],
                 attempt: Callable[[], int], grace_s: float) -> None:
        self._group = worker_group
        self._bus = bus
        self._exits = exits
        self._context = context
        self.peek = peek
        self._attempt = attempt
        self.grace_s = float(grace_s)

    @property
    def context(self) -> Any:
        """Torch's process context of the current workers (None before the first start:
        torch sets ``_pcontext`` in ``_start_workers``)."""
        return self._context()

    def procs(self) -> list[tuple[int, int, int]]:
        """This node's workers as started: (global rank, local rank, pid), by local rank;
        empty before the first start."""
        pcontext = self.context
        if pcontext is None:
            return []
        workers = self._group.workers
        return [(workers[local].global_rank, local, pid)
                for local, pid in sorted(pcontext.pids().items()) if isinstance(pid, int)]

    def error_files(self) -> Mapping[int, str]:
        """local rank -> the worker's error file path, as torch's process context has it."""
        return getattr(self.context, "error_files", None) or {}

    def live(self) -> dict[int, tuple[int, int]]:
        """This node's live workers: global rank -> (local rank, pid)."""
        return {rank: (local, pid) for rank, local, pid in self.procs()
                if self.peek(pid) is None}

    def stop(self, live: Live, *, cause: str, why: str,
             data: Mapping[int, Mapping[str, Any]] | None = None,
             signum: int = signal.SIGTERM, grace_s: float | None = None) -> RunResult:
        """Stop the workers ``live`` (rank -> (local rank, pid); one that already exited is
        reported with its exit code) at once: SIGTERM, SIGKILL after the stall grace (a
        worker blocked in a collective ignores SIGTERM until the collective's own timeout:
        30 min with gloo/NCCL). Each is reported as stopped by the agent (``WORKER_EXIT``
        with ``cause``, ``message`` "stopped by the agent: WHY", ``data[rank]`` added), and
        the FAILED result that torch's loop restarts or ends the job with is returned."""
        with agent_stopping():  # the signal is this agent's, not a scheduler's
            stop_processes({pid: rank for rank, (_, pid) in live.items()},
                           grace_s=self.grace_s if grace_s is None else grace_s,
                           alive=lambda pid: self.peek(pid) is None, signum=signum)
        attempt = self._attempt()
        failures: dict[int, ProcessFailure] = {}
        for rank, (local_rank, pid) in sorted(live.items()):
            code = self.peek(pid)
            failures[rank] = failure = ProcessFailure(
                local_rank=local_rank, pid=pid, exitcode=code if code is not None else -9,
                error_file="<N/A>")
            if self._exits.report(attempt, rank):
                self._bus.publish(WorkerExit(
                    worker_id=rank, exit_code=int(failure.exitcode),
                    worker_local_rank=local_rank, worker_pid=pid,
                    signal=signal_name(int(failure.exitcode)),
                    message=f"stopped by the agent: {why}", cause=cause,
                    data={"attempt": attempt, "stopped_by_agent": True,
                          **((data or {}).get(rank) or {})}))
        return RunResult(state=WorkerState.FAILED, failures=failures)

    def report_succeeded(self) -> None:
        """The group succeeded: exit code 0 for each worker not reported yet."""
        attempt = self._attempt()
        for worker in self._group.workers:
            if self._exits.report(attempt, worker.global_rank):
                self._bus.record(EventType.WORKER_EXIT, worker_id=worker.global_rank,
                                 exit_code=0, worker_local_rank=worker.local_rank,
                                 worker_pid=worker.id if isinstance(worker.id, int)
                                 else None, data={"attempt": attempt})
