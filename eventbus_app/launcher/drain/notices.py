"""The agent half of the job-wide notices: what this agent decides reaches every worker.

An agent plugin (:class:`NoticeBoard`, one of :func:`~eventbus.app.launcher.agent.default_plugins`):

* it appends to the job's notice log (:mod:`eventbus.app.protocol.notices`) each event of
  its own that :func:`~eventbus.app.protocol.notices.is_notice` selects: its
  ``PREEMPTING``, its workers' failures, and (group rank 0) the stalls and stragglers it
  judged; from a thread of its own, so that a slow store never holds the monitor;
* at each rendezvous it reads the log's head and gives the attempt's workers the root and
  that position (their bootstrap's ear starts there: nothing earlier is heard);
* with several nodes it also hears the log itself, for another node's ``PREEMPTING``
  (``on_drain``): that is how a drain signal at one node drains them all; and for the
  other agents' stalls, stragglers and evictions (``on_notice``), which count against
  this node's host when they name its ranks (eviction.py);
* at the end it waits (within the exit budget) for what it still has to append, and reads
  the drain's agreed stop step for the console line;
* under SLURM each drained node adds 1 to the store's :data:`DRAIN_ENDED` key as its
  ``eventbus run`` ends, and the agent that requeues the job waits (bounded) until every
  node has (drain/slurm.py): SLURM's requeue kills every process of the job.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

from eventbus.app.plugins import RendezvousInfo
from eventbus.app.protocol import notices as log
from eventbus.bus import ALL
from eventbus.bus import Subscription
from eventbus.context import current_context
from eventbus.events import Event
from eventbus.events import Preempting
from eventbus.subscribers.queued import _signals_held

__all__ = ["DRAIN_ENDED", "NoticeBoard"]

logger = logging.getLogger("eventbus")

#: the store key (under the notice root) each node adds 1 to when its drain ended
DRAIN_ENDED = "drain-ended"

class NoticeBoard:
    """The agent plugin (see the module's docstring). ``on_drain(event, seq)``: another
    node's ``PREEMPTING`` arrived; ``connect(host, port)``: a store client (tests)."""

    def __init__(self, *, on_drain: Callable[[Preempting, int], object] | None = None,
                 connect: Callable[[str, int], Any] | None = None,
                 connect_timeout: float = 30.0) -> None:
        self.on_drain = on_drain
        #: another agent's notice that is not a drain (a stall, a straggler, an eviction)
        self.on_notice: Callable[[Event], object] | None = None
        self._connect = connect
        self.connect_timeout = connect_timeout
        self.info: RendezvousInfo | None = None
        self.root: str | None = None
        self._client: Any = None
        self._client_lock = threading.Lock()
        self._queue: queue.SimpleQueue[Event | None] = queue.SimpleQueue()
        self._pending = 0
        self._pending_lock = threading.Condition()
        self._writer: threading.Thread | None = None
        self._listener: threading.Thread | None = None
        self._sub: Subscription | None = None
        self._closed = False
        #: notices appended, failed, heard from other nodes
        self.stats = {"told": 0, "failed": 0, "heard": 0}
        #: the seq of the drain's PREEMPTING (this node's or another's), once known
        self.drain_seq: int | None = None
        self._warned = False
        self._ear: log.WaitingClient | None = None
        self._listen_seq = 1

    def _new_client(self, info: RendezvousInfo) -> Any:
        if self._connect is not None:
            return self._connect(info.store_host, info.store_port)
        from eventbus.store_client import connect_store

        return connect_store(info.store_host, info.store_port, timeout=self.connect_timeout)

    # -- AgentPlugin -----------------------------------------------------------------------
    def after_rendezvous(self, info: RendezvousInfo) -> Mapping[str, str]:
        first = self.info is None
        self.info = info
        self.root = root = log.notice_root(info.run_id)
        with self._client_lock:
            if self._client is None:
                self._client = self._new_client(info)
            start = log.head(self._client, root)
        if first:
            self._sub = info.bus.subscribe(ALL, on_event=self._tell, where=_own_notice)
            with _signals_held():
                self._writer = threading.Thread(target=self._write, daemon=True,
                                                name="eventbus-notice-writer")
                self._writer.start()
        if info.group_world_size > 1 and self._listener is None:
            with _signals_held():
                self._listener = threading.Thread(target=self._listen, args=(info, start),
                                                  daemon=True, name="eventbus-notice-ear")
                self._listener.start()
        return {log.ENV_NOTICES: root, log.ENV_NOTICE_FROM: str(start)}

    def before_exit(self, *, timeout: float) -> None:
        self.flush(timeout)
        self._closed = True
        if self._sub is not None:
            self._sub.cancel()
        self._queue.put(None)
        # the ear must leave its store call before the interpreter finalizes
        ear, listener = self._ear, self._listener
        if ear is None or listener is None or not listener.is_alive():
            return
        if self.root is not None and ear.wake(log.entry_key(self.root, self._listen_seq)):
            listener.join(1.0)
        if listener.is_alive():
            ear.shut()  # the store cannot be reached: end the wait the hard way
            listener.join(1.0)

    # -- telling ---------------------------------------------------------------------------
    def _tell(self, event: Event) -> None:
        if self._closed:
            return
        with self._pending_lock:
            self._pending += 1
        self._queue.put(event)

    def _write(self) -> None:
        while True:
            event = self._queue.get()
            if event is None:
                return
            try:
                root = self.root
                with self._client_lock:
                    if root is None or self._client is None:
                        raise RuntimeError("no store yet")
                    seq = log.append(self._client, root, event)
                if isinstance(event, Preempting) and self.drain_seq is None:
                    self.drain_seq = seq
                self.stats["told"] += 1
            except Exception as exc:
                self.stats["failed"] += 1
                if not self._warned:
                    self._warned = True
                    logger.warning("eventbus: cannot tell the workers %s (%s: %s); the job "
                                   "goes on without job-wide notices", type(event).type,
                                   type(exc).__name__, exc)
            finally:
                with self._pending_lock:
                    self._pending -= 1
                    self._pending_lock.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait until every notice so far is appended (or failed); False on timeout."""
        deadline = time.monotonic() + timeout
        with self._pending_lock:
            while self._pending > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._pending_lock.wait(left)
        return True

    # -- hearing other nodes -----------------------------------------------------------------
    def _listen(self, info: RendezvousInfo, start: int) -> None:
        try:
            self._ear = log.WaitingClient(lambda: self._new_client(info), info.store_port)
            client = self._ear.client
        except Exception as exc:
            logger.warning("eventbus: this agent hears no other node's drain (%s)", exc)
            return
        if self._closed:
            self._ear.shut()
            return
        root, seq = log.notice_root(info.run_id), start + 1
        while not self._closed:
            self._listen_seq = seq
            try:
                event = log.read_entry(client, root, seq)
            except (ValueError, TypeError):
                seq += 1
                continue
            except Exception:
                return  # the store is gone: the job is ending
            if event is None:
                continue
            seq += 1
            if self._closed:
                return
            if not isinstance(event, Preempting):  # another notice, or a reader's mark
                if isinstance(event, Event):
                    self._heard(event)
                continue
            current = self.info.group_rank if self.info is not None else info.group_rank
            if event.node == current:
                continue  # our own
            self.stats["heard"] += 1
            if self.drain_seq is None:
                self.drain_seq = seq - 1
            if self.on_drain is not None:
                try:
                    self.on_drain(event, seq - 1)
                except Exception:
                    logger.exception("eventbus: another node's drain could not start here")

    def _heard(self, event: Event) -> None:
        """Another agent's notice, to ``on_notice`` (never this agent's own)."""
        if self.on_notice is None or event.context.pid == os.getpid():
            return
        try:
            self.on_notice(event)
        except Exception:
            logger.exception("eventbus: another node's %s could not be taken in",
                             type(event).type)

    def claim_drain(self) -> bool:
        """Whether this agent is the first of the job to announce its drain (the job's one
        ``PREEMPTING``): the first to add to the drain's key in the store. True where the
        store cannot say (this node drains alone rather than not at all)."""
        root = self.root
        if root is None:
            return True
        try:
            with self._client_lock:
                if self._client is None:
                    return True
                return int(self._client.add(f"{root}/drain-claim", 1)) == 1
        except Exception as exc:
            logger.debug("eventbus: the drain's claim: %s", exc)
            return True

    def stop_step(self, timeout: float = 1.0) -> int | None:
        """The drain's agreed stop step, if the workers agreed on one; None when it is not
        known within ``timeout`` (the store gone or cut off: the agent's exit must not
        wait for a store call's own timeout)."""
        info, seq, root = self.info, self.drain_seq, self.root
        if info is None or seq is None or root is None:
            return None
        key = log.drain_keys(root, seq, 0)["stop"]

        def read(client: Any) -> int | None:
            return int(bytes(client.get(key)).decode()) if client.check([key]) else None

        found = self._bounded(read, timeout)
        return found if found is not None and found >= 0 else None

    def drain_ended(self, timeout: float = 1.0) -> bool:
        """Record in the store that this node's drain ended (its workers gone, its agent
        done); False where the store could not be told within ``timeout``."""
        root = self.root
        if root is None:
            return False
        return self._bounded(lambda client: int(client.add(f"{root}/{DRAIN_ENDED}", 1)),
                             timeout) is not None

    def drains_ended(self, timeout: float = 1.0) -> int | None:
        """How many nodes recorded their drain's end; None where the store cannot say
        within ``timeout`` (gone: the agent that hosted it ended)."""
        root = self.root
        if root is None:
            return None
        found = self._bounded(lambda client: int(client.add(f"{root}/{DRAIN_ENDED}", 0)),
                              timeout)
        return found if isinstance(found, int) else None

    def _bounded(self, call: Callable[[Any], Any], timeout: float) -> Any:
        """``call(store client)``'s answer, on a thread of its own; None where it failed
        or took longer than ``timeout``."""
        found: list[Any] = []

        def run() -> None:
            with contextlib.suppress(Exception), self._client_lock:
                if self._client is not None:
                    found.append(call(self._client))

        with _signals_held():
            worker = threading.Thread(target=run, daemon=True, name="eventbus-drain-store")
            worker.start()
        worker.join(timeout)
        return found[0] if found else None


def _own_notice(event: Event) -> bool:
    """This agent's own decisions (not a worker's event, nor another node's)."""
    context = event.context
    return (context.pid == os.getpid() and context.hostname in (
        None, current_context().hostname) and log.is_notice(event))
