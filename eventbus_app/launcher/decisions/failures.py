"""The failed workers as the agent reports them: seen by the peek, in the order they
failed, each one's ``WORKER_EXIT``, and torch's result rebuilt when an error file is torn.

Why a module of its own: what a failure *is* (its exit code, signal, error file and
message, a SIGABRT's diagnosis) and which came first is one concern, apart from what the
agent then decides (:mod:`~eventbus.app.launcher.decisions.decider`) and does. The rules of the
order are :class:`~eventbus.app.launcher.group.exits.ExitBook`'s (torch-free); this module gives
them torch's facts (``ProcessFailure``, ``RunResult``) and builds the events.

Why the monitor peeks: torch's process context, on the first failed worker, terminates
the others *before* it returns the failure; the peek (``waitid(WNOWAIT)``, through
:class:`~eventbus.app.launcher.group.workers.Workers`) sees the failure at once, without
reaping the process.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult
from torch.distributed.elastic.agent.server.api import WorkerState
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from eventbus.app.launcher.group.exits import ExitBook
from eventbus.app.launcher.group.exits import Proc
from eventbus.app.launcher.group.workers import Workers
from eventbus.app.protocol.host_faults import HOST_FAULT_KEY
from eventbus.events import Cause
from eventbus.events import WorkerExit
from eventbus.events import signal_name

__all__ = ["ERROR_FILE_ERRORS", "Failures", "error_file", "failure_message"]

logger = logging.getLogger("eventbus")

#: what torch's ProcessFailure raises on an error file torn by a kill (JSONDecodeError is a
#: ValueError; a cut but valid JSON lacks "message": KeyError, TypeError)
ERROR_FILE_ERRORS = (ValueError, KeyError, TypeError)


def failure_message(failure: ProcessFailure) -> str | None:
    """The message of the worker's error file, when it wrote one."""
    if failure.error_file in ("<N/A>", os.devnull) or not failure.error_file_data:
        return None
    message: Any = failure.message
    if isinstance(message, dict):
        message = message.get("message", json.dumps(message, default=str))
    return str(message) if message else None


def _error_text(failure: ProcessFailure) -> str | None:
    """The whole error file's message, traceback included (what the host-fault rule reads:
    a CUDA or NCCL error may be named only in the traceback's last lines)."""
    if failure.error_file in ("<N/A>", os.devnull) or not failure.error_file_data:
        return None
    message: Any = failure.message
    return json.dumps(message, default=str) if isinstance(message, dict) else str(message)


def error_file(failure: ProcessFailure) -> str | None:
    """The worker's error file path; None without one."""
    path = failure.error_file
    return None if path in ("<N/A>", os.devnull) else str(path)


def _failure(local_rank: int, pid: int, code: int, path: str) -> ProcessFailure:
    """Torch's ``ProcessFailure``; an unreadable error file (torn by a kill) left out, so
    that neither the agent nor torchrun's own report reads it again."""
    try:
        return ProcessFailure(local_rank=local_rank, pid=pid, exitcode=code, error_file=path)
    except Exception:
        return ProcessFailure(local_rank=local_rank, pid=pid, exitcode=code,
                              error_file="<N/A>")


class Failures:
    """The failures of this node's workers, for the agent's monitor.

    ``diagnose``: rank -> what a worker ended by its own SIGABRT was doing (the judge's
    diagnosis, :meth:`Health.abort_diagnosis
    <eventbus.app.launcher.job_health.Health.abort_diagnosis>`). ``host_fault``: (attempt,
    rank, exit code, message, stopped by the agent) -> the host fault the failure is, for
    ``data["host_fault"]`` (:meth:`Eviction.exit_fault
    <eventbus.app.launcher.hosts.eviction.Eviction.exit_fault>`).
    """

    def __init__(self, workers: Workers, exits: ExitBook, *, attempt: Callable[[], int],
                 diagnose: Callable[[int], dict[str, Any]],
                 host_fault: Callable[[int, int, int, str | None, bool], str | None]
                 | None = None) -> None:
        self._workers = workers
        self._exits = exits
        self._attempt = attempt
        self._diagnose = diagnose
        self._host_fault = host_fault

    def in_order(self) -> list[WorkerExit] | None:
        """The failed workers the peek sees, with those that failed *before* them and are
        still exiting, in the order they failed: the first one caused it. None while such
        a worker is still exiting within the grace (see :mod:`exits`): the tick returns at
        once and torch's loop calls again; the monitor never blocks."""
        found = self._peek()
        if not found:
            return found
        workers = self._workers
        error_files = workers.error_files()
        procs = [Proc(rank, workers.peek(pid), error_files.get(local))
                 for rank, local, pid in workers.procs()]
        wait = self._exits.wait_for_dying(
            self._attempt(), [Proc(e.worker_id, e.exit_code, e.data.get("error_file"))
                              for e in found], procs)
        if wait == "wait":
            return None
        if wait == "look again":
            seen = {e.worker_id for e in found}
            found = [*found, *(e for e in self._peek() if e.worker_id not in seen)]
        return self.order(found)

    def order(self, events: Sequence[WorkerExit]) -> list[WorkerExit]:
        """``events`` in the order the failures happened (by their error files' times)."""
        order = self._exits.in_failure_order([e.data.get("error_file") for e in events])
        return [events[i] for i in order]

    def _peek(self) -> list[WorkerExit]:
        """The workers that exited non-zero and are not reported yet, seen by the peek
        (not reaped: torch reports them as usual)."""
        attempt = self._attempt()
        workers = self._workers
        error_files = workers.error_files()
        found = []
        for rank, local_rank, pid in workers.procs():
            if self._exits.reported(attempt, rank):
                continue
            code = workers.peek(pid)
            if code is None or code == 0:
                continue
            failure = _failure(local_rank, pid, code, error_files.get(local_rank, "<N/A>"))
            found.append(self.exit_event(rank, failure, stopped_by_agent=False))
        return found

    def late(self, result: RunResult, *, decided_this_tick: bool
             ) -> tuple[list[WorkerExit], list[WorkerExit]]:
        """Torch's result failed the group: the failures nobody reported yet, as (those the
        agent, or torch because of another rank, stopped; by rank) and (failures of their
        own, in the order they happened)."""
        attempt = self._attempt()
        unseen = sorted((rank, f) for rank, f in result.failures.items()
                        if not self._exits.reported(attempt, rank))
        stopped = self._exits.stopped_by_agent(
            attempt, [Proc(rank, int(f.exitcode), error_file(f)) for rank, f in unseen],
            decided_this_tick=decided_this_tick)
        events = [self.exit_event(rank, failure, stopped_by_agent=stopped[rank])
                  for rank, failure in unseen]
        own = [e for e in events if not stopped[e.worker_id]]
        return [e for e in events if stopped[e.worker_id]], self.order(own) if own else []

    def torn_result(self, exc: BaseException) -> RunResult:
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
        workers = self._workers
        pcontext = workers.context
        if pcontext is None:
            raise exc
        with contextlib.suppress(Exception):
            pcontext.close()  # what torch's wait() does on a failure (idempotent)
        handlers: Mapping[int, Any] = getattr(pcontext, "subprocess_handlers", {}) or {}
        error_files = workers.error_files()
        failures: dict[int, ProcessFailure] = {}
        for rank, local_rank, pid in workers.procs():
            proc = getattr(handlers.get(local_rank), "proc", None)
            code = proc.poll() if proc is not None else None
            if code is None:
                code = workers.peek(pid)
            if code == 0:
                continue
            code = -int(signal.SIGKILL) if code is None else int(code)
            failures[rank] = _failure(local_rank, pid, code,
                                      error_files.get(local_rank, "<N/A>"))
        return RunResult(state=WorkerState.FAILED, failures=failures)

    def exit_event(self, global_rank: int, failure: ProcessFailure, *,
                   stopped_by_agent: bool) -> WorkerExit:
        """A failed worker's ``WORKER_EXIT``: its own failure, or one the agent (or torch,
        because of another rank) stopped; a SIGABRT of its own gets the judge's
        diagnosis."""
        data: dict[str, Any] = {"attempt": self._attempt()}
        if stopped_by_agent:
            data["stopped_by_agent"] = True
        path = error_file(failure)
        if path is not None:
            data["error_file"] = path
        if not stopped_by_agent and int(failure.exitcode) == -int(signal.SIGABRT):
            data.update(self._diagnose(global_rank))
        message = failure_message(failure)
        if self._host_fault is not None:
            kind = self._host_fault(data["attempt"], global_rank, int(failure.exitcode),
                                    _error_text(failure) or message, stopped_by_agent)
            if kind is not None:
                data[HOST_FAULT_KEY] = kind
        return WorkerExit(
            worker_id=global_rank, exit_code=int(failure.exitcode),
            worker_local_rank=int(failure.local_rank), worker_pid=int(failure.pid),
            signal=signal_name(int(failure.exitcode)), message=message,
            # stopped or not, a failure caused it: a stall's and a STOP's exits are reported
            # by Workers.stop
            cause=str(Cause.FAILURE), data=data,
        )
