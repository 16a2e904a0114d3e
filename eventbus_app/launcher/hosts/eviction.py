"""The agent's bad-host path: host faults marked on the events that report them,
counted against this node's host (:class:`~eventbus.app.launcher.hosts.book.HostBook`),
recorded in the host ledger once per attempt, and the node's eviction when they reach
``--evict-after``.

Who counts what: a worker's failure is counted by its own agent, which sees it. A stall or
a straggler is judged by group rank 0 for the whole job; it marks the events
(``data["host_fault"]``) and counts those of its own ranks, and each other agent counts
those of its ranks when it hears them in the job's notice log (:meth:`heard`). So every
fault is counted once, by the node it points at.

The eviction itself (:meth:`evict`): ``HOST_EVICTED`` on the bus (the notice log carries it
to every worker and every other agent), one console line, and this node leaves torch's
rendezvous without closing it: :func:`leave_rendezvous` runs torch's own exit operation,
the one a node runs before it joins a new round, instead of ``shutdown()``, which would
close the rendezvous for every node. The agent then raises :class:`HostEvictedError`, a
``SignalException`` to torch's launcher, which therefore does not shut the rendezvous
down either, and ``eventbus run`` exits with the bad-host code.

One node holds the rendezvous's store: the first agent whose host matched the endpoint
started it, and every other agent's rendezvous goes through it. If that node is the bad
one, its exit would end the job everywhere (every agent's next round fails to reach the
store). So an evicted agent that serves the store (a listening socket of its own on the
store's port, read from ``/proc``) stays up, with no worker, until the job ends: the last
agent's shutdown closes the rendezvous, or no node has beaten for
:data:`STORE_IDLE_S` (:func:`keep_serving`). It says so in one line.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from collections.abc import Collection
from collections.abc import Sequence
from datetime import datetime
from datetime import timezone
from pathlib import Path
from typing import Any

from eventbus.app.launcher.cli import console
from eventbus.app.launcher.decisions.decider import Ending
from eventbus.app.launcher.hosts.book import HostBook
from eventbus.app.launcher.hosts.faults import LOST
from eventbus.app.launcher.hosts.faults import Failure
from eventbus.app.launcher.hosts.faults import host_fault
from eventbus.app.launcher.hosts.faults import take_mark
from eventbus.app.launcher.slurm.environment import ledger_job
from eventbus.app.protocol.host_faults import HOST_FAULT_KEY
from eventbus.bus import Bus
from eventbus.events import Cause
from eventbus.events import Event
from eventbus.events import HostEvicted
from eventbus.events import WorkerSlow
from eventbus.events import WorkerStalled

__all__ = [
    "LEAVE_TIMEOUT_S",
    "STORE_IDLE_S",
    "Eviction",
    "keep_serving",
    "leave_rendezvous",
    "serves_port",
    "store_port",
]

logger = logging.getLogger("eventbus")

#: the bound of leaving torch's rendezvous (its store may be gone with the job)
LEAVE_TIMEOUT_S = 10.0

#: an evicted node that serves the rendezvous's store ends once no node beat this long
STORE_IDLE_S = 120.0


def _listening_inodes(port: int) -> set[str]:
    """The socket inodes listening on TCP ``port`` in this network namespace."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) > 9 and parts[3] == "0A" and \
                    int(parts[1].rsplit(":", 1)[1], 16) == port:
                found.add(parts[9])
    return found


def serves_port(port: int) -> bool:
    """Whether this process listens on TCP ``port`` (a store it started)."""
    inodes = _listening_inodes(port)
    if not inodes:
        return False
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:[") and target[8:-1] in inodes:
                return True
    return False


def store_port(handler: Any) -> int | None:
    """The port of the TCPStore under ``handler`` (torch's c10d rendezvous), or None."""
    store = getattr(handler, "_store", None)
    for _ in range(16):
        if store is None:
            return None
        if hasattr(store, "port") and hasattr(store, "host"):
            return int(store.port)
        store = getattr(store, "underlying_store", None)
    return None


def keep_serving(handler: Any, *, poll_s: float = 1.0, idle_s: float = STORE_IDLE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
    """Return once the job no longer needs this process's store: the rendezvous closed
    (every other agent ended), or no node beat for ``idle_s``, or the state unreadable."""
    holder = getattr(handler, "_state_holder", None)
    if holder is None:
        return
    seen = clock()
    while True:
        try:
            holder.sync()
            state = holder.state
            if state.closed:
                return
            now = datetime.now(timezone.utc)
            if any((now - beat).total_seconds() < idle_s
                   for beat in state.last_heartbeats.values()):
                seen = clock()
        except Exception:
            return
        if clock() - seen > idle_s:
            return
        time.sleep(poll_s)


def _host_evicted_error() -> type[Exception]:
    from torch.distributed.elastic.multiprocessing.api import SignalException

    class HostEvictedError(SignalException):
        """This node's host was evicted: the agent leaves the job (see the module)."""

    return HostEvictedError


def leave_rendezvous(handler: Any, timeout: float = LEAVE_TIMEOUT_S) -> bool:
    """Take this node out of torch's dynamic rendezvous ``handler`` without closing it:
    its heartbeats stop and torch's own exit operation removes it from the participants.
    False where the handler is not torch's dynamic one, or the store did not answer."""
    executor = getattr(handler, "_op_executor", None)
    stop_heartbeats = getattr(handler, "_stop_heartbeats", None)
    if executor is None or stop_heartbeats is None:
        return False
    try:
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousExitOp

        stop_heartbeats()
        executor.run(_RendezvousExitOp(), time.monotonic() + timeout)
        return True
    except Exception as exc:
        logger.warning("eventbus: this node could not leave the rendezvous (%s: %s); the "
                       "others will drop it when its heartbeats stop", type(exc).__name__, exc)
        return False


class Eviction:
    """This agent's host faults, ledger rows and eviction (see the module docstring).

    ``local``: the global ranks of this node's workers now; ``run_id``: the job's;
    ``ledger``: ``--host-ledger`` (None: the default; ``off``: none); ``book`` and
    ``writer``: injected by tests."""

    def __init__(self, bus: Bus, *, evict_after: int, ledger: str | None, run_id: str,
                 local: Callable[[], Collection[int]], book: HostBook | None = None,
                 writer: Any = None) -> None:
        self.bus = bus
        self.book = book if book is not None else HostBook.for_this_host(
            evict_after=evict_after)
        self.run_id = run_id
        self._local = local
        if writer is None and str(ledger).lower() != "off":
            from eventbus.app.launcher.hosts.host_ledger import LedgerWriter

            writer = LedgerWriter(ledger, warn=console.write)
        self.writer = writer
        self._counted: set[tuple[int, int, str]] = set()
        self._recorded: set[int] = set()
        self.announced = False

    @property
    def host(self) -> str:
        return self.book.host

    @property
    def evicted(self) -> str | None:
        """Why this node is evicted (the job's faults), or None."""
        return self.book.evicted

    # -- marking and counting ----------------------------------------------------------------
    def exit_fault(self, attempt: int, rank: int, exit_code: int, message: str | None,
                   stopped_by_agent: bool) -> str | None:
        """A failed worker's ``WORKER_EXIT`` is being built: its host fault (counted once
        per attempt and rank), for ``data["host_fault"]``."""
        key = (attempt, rank, "exit")
        if key in self._counted:
            return host_fault(Failure(exit_code=exit_code, message=message or "",
                                      by_agent=stopped_by_agent, first=False))
        self._counted.add(key)
        return self.book.worker_failed(exit_code=exit_code, message=message or "",
                                       by_agent=stopped_by_agent)

    def mark_stalls(self, attempt: int, events: Sequence[WorkerStalled]) -> list[WorkerStalled]:
        """The judge's ``WORKER_STALLED`` (culprits only), each with its host fault in
        ``data``; this node's ranks counted now, the others by their own nodes."""
        local = set(self._local())
        marked = []
        for event in events:
            waiting_on = event.data.get("waiting_on")
            waiting = waiting_on if isinstance(waiting_on, str) else None
            key = (attempt, event.worker_id, "stall")
            if event.worker_id in local and key not in self._counted:
                self._counted.add(key)
                kind = self.book.worker_stalled(waiting_on=waiting, culprit=True)
            else:
                kind = host_fault(Failure(stalled=True, culprit=True, waiting_on=waiting))
            marked.append(_with_fault(event, kind) if kind else event)
        return marked

    def slow(self, event: Event) -> None:
        """A ``WORKER_SLOW`` this agent judged, or heard: counted when the rank is ours."""
        if isinstance(event, WorkerSlow) and event.worker_id in set(self._local()):
            self.book.worker_slow(event.worker_id)

    def reactors_ran(self, failures: Sequence[Event]) -> None:
        """The reactors were consulted on ``failures``: count the ones they marked
        (:func:`eventbus.app.launcher.hosts.faults.mark_host_fault`) against this host, when
        ours."""
        local = set(self._local())
        for event in failures:
            kind = take_mark(event)
            worker = getattr(event, "worker_id", None)
            if kind is not None and worker in local:
                self.book.marked(kind)

    def heard(self, event: Event) -> None:
        """Another node's notice (the job's notice log): a stall of one of our ranks that
        its judge marked, a straggler of ours, or another node's eviction (published here
        too, so that this node's events file, sinks and page have it)."""
        if isinstance(event, HostEvicted):
            if event.host != self.host:
                self.bus.publish(event)
            return
        if isinstance(event, WorkerSlow):
            self.slow(event)
            return
        if isinstance(event, WorkerStalled) and event.worker_id in set(self._local()):
            kind = event.data.get(HOST_FAULT_KEY)
            attempt = event.context.restart_count or 0
            key = (attempt, event.worker_id, "stall")
            if isinstance(kind, str) and key not in self._counted:
                self._counted.add(key)
                waiting_on = event.data.get("waiting_on")
                self.book.worker_stalled(
                    waiting_on=waiting_on if isinstance(waiting_on, str) else None,
                    culprit=True)

    # -- the ledger ----------------------------------------------------------------------------
    def attempt_ended(self, attempt: int, *, clean: bool) -> None:
        """Record this host's outcome of ``attempt`` in the ledger (once), then start the
        next attempt's counts."""
        if attempt not in self._recorded and self.writer is not None:
            self._recorded.add(attempt)
            from eventbus.app.launcher.hosts.host_ledger import HostOutcome

            book = self.book
            try:
                self.writer.record(HostOutcome(
                    host=book.host, job=ledger_job(self.run_id), attempt=attempt,
                    time=time.time(),
                    faults=dict(book.attempt_faults), culprit=book.culprits,
                    straggler=book.stragglers, clean=clean))
            except Exception:  # the ledger never fails the job
                logger.exception("eventbus: the host ledger's row could not be queued")
        self.book.new_attempt()

    def lost(self, hosts: Sequence[str], attempt: int) -> None:
        """Record other nodes lost after ``attempt`` (lost.py): a row of that attempt for
        each, with a ``lost`` fault; they could not write their own."""
        if self.writer is None:
            return
        from eventbus.app.launcher.hosts.host_ledger import HostOutcome

        for host in hosts:
            try:
                self.writer.record(HostOutcome(
                    host=host, job=ledger_job(self.run_id), attempt=attempt,
                    time=time.time(), faults={LOST: 1}, clean=False))
            except Exception:  # the ledger never fails the job
                logger.exception("eventbus: the host ledger's row could not be queued")

    # -- the eviction --------------------------------------------------------------------------
    def announce(self) -> None:
        """``HOST_EVICTED`` and its console line, once."""
        if self.announced or self.evicted is None:
            return
        self.announced = True
        event = HostEvicted(host=self.host, faults=self.book.total, reason=self.evicted)
        self.bus.publish(event)
        from eventbus.app.sentences import sentence

        console.write(f"{sentence(event)}: this node leaves the job; the others go on "
                      "without it (--nnodes MIN:MAX) or with a waiting node")

    def evict(self, rdzv_handler: Any, attempt: int) -> Exception:
        """Announce, record, leave the rendezvous (and serve its store while the others
        need it); the exception the agent raises. Its workers are stopped already."""
        self.announce()
        self.attempt_ended(attempt, clean=False)
        leave_rendezvous(rdzv_handler)
        port = store_port(rdzv_handler)
        if port is not None and serves_port(port):
            console.write(f"{self.host} serves the rendezvous's store (port {port}): it "
                          "stays up, with no worker, until the other nodes end")
            keep_serving(rdzv_handler)
        error = _host_evicted_error()(f"host {self.host} evicted: {self.evicted}",
                                      signal.SIGTERM)
        return error

    def ending(self, ending: Ending, exit_code: int) -> Ending:
        """``AGENT_EXIT`` of an evicted node: the bad-host ``exit_code`` (requeue elsewhere),
        which wins over a drain's (requeue: elsewhere is the more the scheduler can know);
        a drain keeps its state and cause, and its reason says the host left too."""
        said = f"host {self.host} evicted: {self.evicted}"
        if ending.state == "PREEMPTED":
            return Ending(ending.state, exit_code, f"{ending.reason}; {said}", ending.cause)
        return Ending("FAILED", exit_code, said, str(Cause.FAILURE))

    def close(self, timeout: float = 2.0) -> None:
        if self.writer is not None:
            with contextlib.suppress(Exception):
                self.writer.close(timeout)


def _with_fault(event: WorkerStalled, kind: str) -> WorkerStalled:
    """``event`` with ``data["host_fault"]``: the same event otherwise (its time and
    context)."""
    return type(event)(**event.fields(), data={**event.data, HOST_FAULT_KEY: kind},
                       timestamp=event.timestamp, context=event.context)

