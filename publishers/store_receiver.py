"""Bring worker events (and other nodes' events) into a process, from the job's c10d store.

:class:`StoreReceiver` drains queues of the wire format (:mod:`eventbus.wire`) that
:class:`eventbus.subscribers.store_forwarder.StoreForwarder` pushes, with its own store client and
non-blocking ``queue_pop`` calls only (a blocking pop would stall every other call on a
shared client), decodes them as JSON (never pickle), validates every event against its
type, and republishes them on a bus. Sequence gaps, duplicates and the sender's own drops
become ``EVENTS_LOST`` events; malformed input is counted per reason and reported the same
way, and never stops the receiver.

Given a doorbell (``bell=``, see :func:`eventbus.wire.bell_key`), a second thread with its
own client blocks on the doorbell queue, where senders push the key of the queue they just
pushed to: that queue is popped at once, so a batch waits for no poll interval. Without a
ring (an old sender, a lost ring) queues are still polled, backing off while idle.

Given ``pipelined=True`` (with ``host`` and ``port``), a round goes through a client of
the receiver's own (:mod:`eventbus.publishers.pipelined_pops`): the length of every due
queue in one write, answers read as a stream, then exactly as many pops as each queue
holds values, in batches of one write each (each pop's answer carries what is left). A
poll of an idle queue then costs about a microsecond of the receiver's CPU instead of a
store round trip (~30 us), and emptying a queue costs no pop that finds it empty: what
lets group rank 0 poll a thousand node queues often (docs/scale.md).

The agent of ``eventbus run`` runs receivers through its store transport plugin
(:mod:`eventbus.app.launcher.transport.store`).
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import logging
import threading
import time
from collections.abc import Callable
from collections.abc import Collection
from typing import Any

import attrs

from eventbus._reporting import RateLimiter
from eventbus.bus import Bus
from eventbus.events import EventsLost
from eventbus.exit_ledger import ExitLedger
from eventbus.exit_ledger import RecordCount
from eventbus.publishers.pipelined_pops import PipelinedPops
from eventbus.publishers.sender_book import SenderBook
from eventbus.store_client import connect_store
from eventbus.store_client import queue_empty_error
from eventbus.wire import MAX_VALUE_BYTES
from eventbus.wire import BatchDecoder
from eventbus.wire import SenderKind
from eventbus.wire import WireError

__all__ = ["StoreReceiver"]

logger = logging.getLogger("eventbus")

#: at most one "the store failed" warning per this many seconds (each error is counted)
STORE_ERROR_REPORT_INTERVAL_S = 10.0

#: a doorbell token longer than this is not a queue key: ignored
_MAX_BELL_TOKEN = 1024

#: how long one blocking pop of the doorbell waits before it is simply made again. Long:
#: c10d logs two warning lines at every timed-out wait, and stop() wakes the pop itself.
BELL_WAIT_S = 3600.0

#: a round of drain_once that has popped something ends once it has run this long (the
#: next round resumes at the next queue), so that the lock it holds is let go of: with a
#: backlog of large values in a thousand queues a whole round took a minute
MAX_ROUND_S = 0.25

#: the shortest sleep of an idle receiver's thread (a queue due now is polled in the
#: next round; this only keeps a clock step from spinning it)
_MIN_WAIT_S = 0.001


@attrs.define
class _Queue:
    key: str
    kind: SenderKind
    rank: int
    #: monotonic time after which the queue is dropped once it is found empty
    retire_at: float | None = None
    #: when to pop it next, and the current idle back-off
    next_poll: float = 0.0
    idle: float = 0.0


class StoreReceiver:
    """Drains queues of a c10d store and republishes their events on ``bus``.

    Call :meth:`watch` for each queue, then :meth:`start` (a background thread that polls
    each queue when it is due: ``poll_interval`` after it gave values, backing off to
    ``max_idle_interval`` while it is empty, at once when it rings) or :meth:`drain_once`
    by hand.
    ``on_end(key, sender)`` runs when a sender's end marker arrives. ``bell``: this
    receiver's doorbell queue (needs ``host`` and ``port``): :meth:`start` also starts a
    thread blocking on it, and a queue whose key rings is popped at once. ``hold``: asked
    before every pop; while it returns true nothing is popped (what the senders push waits
    in the store): the agent passes :func:`eventbus.subscribers.queued.backlogged`, so that a
    flood does not overflow the JSONL file's queue. ``max_round_s``: how long one round of
    :meth:`drain_once` may run once it has popped something (see :data:`MAX_ROUND_S`).
    """

    def __init__(
        self,
        *,
        bus: Bus,
        host: str | None = None,
        port: int | None = None,
        client: Any = None,
        connect_timeout: float = 30.0,
        poll_interval: float = 0.01,
        max_idle_interval: float = 0.5,
        max_value_bytes: int = MAX_VALUE_BYTES,
        max_senders: int = 100_000,
        max_pops_per_queue: int = 64,
        report_interval: float = 1.0,
        reconnect_interval: float = 1.0,
        reconnect_timeout: float = 2.0,
        on_end: Callable[[str, str], object] | None = None,
        bell: str | None = None,
        hold: Callable[[], object] | None = None,
        max_round_s: float = MAX_ROUND_S,
        pipelined: bool = False,
    ) -> None:
        if pipelined and (host is None or port is None):
            raise TypeError("StoreReceiver(pipelined=True) needs host= and port= of the store")
        if client is None:
            if host is None or port is None:
                raise TypeError("StoreReceiver needs host= and port= of the store (or client=)")
            client = connect_store(host, port, timeout=connect_timeout)
        self.client: Any = client
        self.host = host
        self.port = port
        #: after a store failure, reconnect at most this often (needs host and port)
        self.reconnect_interval = reconnect_interval
        self.reconnect_timeout = reconnect_timeout
        self._next_connect = 0.0
        self.bus = bus
        self.poll_interval = poll_interval
        self.max_idle_interval = max(poll_interval, max_idle_interval)
        self.max_value_bytes = max_value_bytes
        self.max_senders = max_senders
        self.max_pops_per_queue = max_pops_per_queue
        self.report_interval = report_interval
        self.on_end = on_end
        self._queues: dict[str, _Queue] = {}
        #: what each sender numbered, dropped and ended, against what arrived
        #: (sender_book.py); called under this receiver's lock
        self.book = SenderBook(bus, max_senders=max_senders, report_interval=report_interval)
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._empty_error: type[BaseException] = queue_empty_error()
        #: values popped, events delivered
        self.values = 0
        self.delivered = 0
        #: rejected events (or values) per reason; gaps, duplicates and sender-side drops,
        #: per reason (the book's counts)
        self.rejected = self.book.rejected
        self.lost = self.book.lost
        self.store_errors = 0
        #: queues found holding values at exit (see report_leftovers), by key
        self.leftovers: dict[str, int] = {}
        self._error_reports = RateLimiter()
        self._decoder = BatchDecoder(max_value_bytes=max_value_bytes)
        #: the doorbell queue, the keys rung since the last drain, and the wake-up
        self.bell = bell if host is not None and port is not None else None
        self.rings = 0
        self._rung: collections.deque[bytes] = collections.deque()
        self._wake = threading.Event()
        self._bell_thread: threading.Thread | None = None
        self.hold = hold
        #: pops deferred because ``hold`` said so, and whether the last drain was held
        self.holds = 0
        #: rounds the background thread ran (its wake-ups: a ring, a due queue, a watch)
        self.wakeups = 0
        self._held = False
        self.max_round_s = max_round_s
        #: where the next round starts (see drain_once)
        self._next_queue = 0
        #: pipelined pops (see the module's docstring): made at the first round
        self.pipelined = pipelined
        self._pops: PipelinedPops | None = None
        self._connect_timeout = connect_timeout

    # -- queues -------------------------------------------------------------------------
    def watch(self, key: str, *, kind: SenderKind, rank: int) -> None:
        """Drain ``key``, whose senders must be of ``kind`` and ``rank`` (a worker's global
        rank, or a node's group rank). Watching it again cancels a pending retirement."""
        with self._lock:
            self._queues[key] = _Queue(key, kind, rank)
        self._wake.set()  # due at once: the thread may be sleeping until another is due

    def retire(self, key: str, *, after: float) -> None:
        """Stop draining ``key`` once it is found empty ``after`` seconds from now."""
        with self._lock:
            queue = self._queues.get(key)
            if queue is not None and queue.retire_at is None:
                queue.retire_at = time.monotonic() + after

    def queues(self) -> list[str]:
        """The queues drained now."""
        with self._lock:
            return list(self._queues)

    # -- draining -----------------------------------------------------------------------
    def drain_once(self, *, every: bool = False) -> int:
        """Pop (without blocking) up to ``max_pops_per_queue`` values of every queue that
        is due (``every``: of every queue) and handle them. Returns the values popped.

        A queue found empty is polled less and less often, up to ``max_idle_interval``
        apart. One that gave values until it was found empty starts that back-off at
        ``poll_interval`` (its sender pushes at most once per flush interval: polling it
        again at once would find it empty, one store round trip per push for nothing),
        or, with a doorbell, at ``max_idle_interval`` (its sender rings at its next push);
        one that still held values (``max_pops_per_queue`` reached, or held) is polled
        again at once. Idle queues cost the store one pop per ``max_idle_interval`` each
        (see docs/across-processes.md, Scaling; docs/scale.md).

        A round holds the receiver's lock, so it is bounded: once it has popped something
        and run ``max_round_s``, it ends, and the next round resumes at the next queue
        (:meth:`stats`, :meth:`watch` and :meth:`stop` wait for one round at most). A
        round that returns 0 has visited every due queue.
        """
        popped = 0
        hold = self.hold
        self._held = False
        with self._lock:
            now = time.monotonic()
            client = self.client if self.client is not None else self._reconnect(now)
            if client is None:
                return 0
            rung = self._rung
            while rung:
                try:
                    token = rung.popleft().decode("utf-8", "replace")
                except IndexError:
                    break
                due = self._queues.get(token)
                if due is not None:  # anything else rang: not a queue of ours, ignored
                    due.next_poll = 0.0
            queues = list(self._queues.values())
            # each round starts at the next queue: none waits behind a flooding one while
            # others are held; a round cut short resumes where it stopped
            start = self._next_queue % len(queues) if queues else 0
            queues = queues[start:] + queues[:start]
            ends = now + self.max_round_s
            self._next_queue = start + 1
            if self.pipelined:
                popped = self._pipelined_round(queues, every=every, now=now, ends=ends)
                self.book.flush_rejects()
                return popped
            visited = 0
            cut = False
            for queue in queues:
                if popped and time.monotonic() >= ends:
                    cut = True
                    break
                visited += 1
                if not every and now < queue.next_poll:
                    continue
                got = 0
                drained = False
                for _ in range(self.max_pops_per_queue):
                    if got and time.monotonic() >= ends:
                        break  # the round's time is up: due again at once
                    if hold is not None and hold():
                        # a sink downstream is behind: the rest stays in the store
                        self.holds += 1
                        self._held = True
                        break
                    try:
                        raw = client.queue_pop(queue.key, block=False)
                    except self._empty_error:
                        drained = True
                        if queue.retire_at is not None and now >= queue.retire_at:
                            del self._queues[queue.key]
                        break
                    except Exception as exc:
                        self._store_error(exc)
                        return popped
                    got += 1
                    self.handle_value(queue.key, raw, kind=queue.kind, rank=queue.rank)
                popped += got
                self._reschedule(queue, now, values_left=self._held or not drained, got=got)
                if self._held:
                    break
            if cut:
                self._next_queue = start + visited
            self.book.flush_rejects()
        return popped

    def _reschedule(self, queue: _Queue, now: float, *, values_left: bool, got: int) -> None:
        """When to pop ``queue`` next, after a round that popped ``got`` of its values."""
        if values_left:  # due again at once
            queue.idle = 0.0
            queue.next_poll = now
        elif got and self.bell is None:  # emptied: its sender's next push is a flush
            queue.idle = self.poll_interval  # interval away
            queue.next_poll = now + queue.idle
        elif got:  # emptied, and its sender rings at its next push: polled only in case
            queue.idle = self.max_idle_interval  # a ring is lost
            queue.next_poll = now + queue.idle
        else:
            queue.idle = min(self.max_idle_interval, max(self.poll_interval, queue.idle * 2))
            queue.next_poll = now + queue.idle

    def _pipelined_round(self, queues: list[_Queue], *, every: bool, now: float,
                         ends: float) -> int:
        """drain_once's round with pipelined calls (the lock held): see
        :meth:`PipelinedPops.round <eventbus.publishers.pipelined_pops.PipelinedPops.round>`;
        then each queue reached is scheduled, and dropped if retired and emptied."""
        if self._pops is None:
            assert self.host is not None and self.port is not None
            self._pops = PipelinedPops(self.host, self.port,
                                       connect_timeout=self._connect_timeout,
                                       reconnect_interval=self.reconnect_interval)
        due = [queue for queue in queues if every or now >= queue.next_poll]
        done = self._pops.round(
            due, limit=self.max_pops_per_queue, hold=self.hold, ends=ends, now=now,
            handle=lambda queue, raw: self.handle_value(queue.key, raw, kind=queue.kind,
                                                        rank=queue.rank))
        if done.held:
            self.holds += 1
            self._held = True
        if done.error is not None:
            self._store_error(done.error)
            return done.popped
        left, queued = done.left, done.queued
        for queue in due:
            key = queue.key
            if key not in left:
                continue  # not reached (the round's time was up): still due
            self._reschedule(queue, now, values_left=left[key] > 0 or key in queued,
                             got=done.got.get(key, 0))
            if left[key] <= 0 and key not in queued and queue.retire_at is not None \
                    and now >= queue.retire_at:
                del self._queues[key]
        return done.popped

    def drain(self, *, timeout: float) -> bool:
        """Drain until every queue is empty or ``timeout`` passes; True if all were empty.
        While ``hold`` holds, it waits for the sinks within the same budget."""
        deadline = time.monotonic() + timeout
        while True:
            popped = self.drain_once(every=True)
            if popped == 0 and not self._held:
                return True
            if time.monotonic() >= deadline:
                return False
            if popped == 0:
                time.sleep(0.005)

    def start(self) -> None:
        """Drain on a background thread until :meth:`stop`."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="eventbus-store-receiver",
                                        daemon=True)
        self._thread.start()
        if self.bell is not None and self._bell_thread is None:
            self._bell_thread = threading.Thread(target=self._listen, args=(self.bell,),
                                                 name="eventbus-store-bell", daemon=True)
            self._bell_thread.start()

    def _run(self) -> None:
        wake = self._wake
        while not self._stop.is_set():
            wake.clear()  # a ring from here on ends the wait below at once
            self.wakeups += 1
            try:
                popped = self.drain_once()
            except Exception:  # never let the agent lose its receiver
                logger.exception("store receiver: draining failed; retrying")
                popped = 0
            if not popped:
                wake.wait(self._idle_wait())
            else:
                # a thread waiting for the lock (stats(), watch()) gets it now: a lock let
                # go of and taken again in one breath starves its waiters
                time.sleep(0)

    def _idle_wait(self) -> float:
        """How long the thread sleeps after a round that popped nothing: until the soonest
        queue is due (each backs off while idle, up to ``max_idle_interval``), so that an
        idle receiver wakes a few times a second, not every ``poll_interval``; a ring, a
        :meth:`watch` and :meth:`stop` end the wait at once. ``poll_interval`` while held
        (the sinks may catch up any moment) or while the store is gone."""
        if self._held or self.client is None:
            return self.poll_interval
        with self._lock:
            soonest = min((queue.next_poll for queue in self._queues.values()), default=None)
        if soonest is None:
            return self.max_idle_interval
        return min(self.max_idle_interval, max(_MIN_WAIT_S, soonest - time.monotonic()))

    def _listen(self, bell: str) -> None:
        """The doorbell thread: block on ``bell`` with a client of its own (a blocking pop
        would stall every other call on a shared one), note each key that rings, wake the
        receiver. A store failure costs only the rings: the queues are still polled."""
        client: Any = None
        while not self._stop.is_set():
            try:
                if client is None:
                    assert self.host is not None and self.port is not None
                    client = connect_store(self.host, self.port,
                                           timeout=self.reconnect_timeout)
                    client.set_timeout(datetime.timedelta(seconds=BELL_WAIT_S))
                token = client.queue_pop(bell, block=True)
            except Exception:
                client = None
                self._stop.wait(self.reconnect_interval)
                continue
            if type(token) is bytes and 0 < len(token) <= _MAX_BELL_TOKEN:
                self.rings += 1
                self._rung.append(token)
                self._wake.set()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the background threads (queues are left as they are)."""
        self._stop.set()
        self._wake.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        bell_thread, self._bell_thread = self._bell_thread, None
        if bell_thread is not None and self.bell is not None:
            # Wake the blocked pop with an empty ring, then drop the doorbell queue (it
            # may hold rings that came after the last drain: a key nobody pops).
            with self._lock, contextlib.suppress(Exception):
                if self.client is not None:
                    self.client.queue_push(self.bell, b"")
            bell_thread.join(timeout)
            with self._lock, contextlib.suppress(Exception):
                if self.client is not None:
                    self.client.delete_key(self.bell)

    def _reconnect(self, now: float) -> Any:
        if self.host is None or self.port is None or now < self._next_connect:
            return None
        self._next_connect = now + self.reconnect_interval
        try:
            self.client = connect_store(self.host, self.port, timeout=self.reconnect_timeout)
        except Exception as exc:
            self._store_error(exc)
            return None
        logger.warning("store receiver: reconnected to %s:%s", self.host, self.port)
        return self.client

    def _store_error(self, exc: Exception) -> None:
        self.store_errors += 1
        if self.host is not None and self.port is not None:
            # libuv clients never reconnect by themselves: make a new one later.
            self.client = None
            if self._pops is not None:
                self._pops.close()
        if self._error_reports.allow(STORE_ERROR_REPORT_INTERVAL_S) is not None:
            logger.warning("store receiver: the store failed (%s); %d errors so far, retrying",
                           exc, self.store_errors)

    # -- decoding -----------------------------------------------------------------------
    def handle_value(self, key: str, raw: object, *, kind: SenderKind, rank: int) -> int:
        """Decode one popped value and publish its valid events; returns how many.

        Whatever is wrong with the value is counted and reported; nothing raises.
        """
        self.values += 1
        try:
            return self._handle(key, raw, kind, rank)
        except WireError as rej:
            self.book.reject(key, rej.reason, rej.count)
        except Exception as exc:  # a bug, not bad input: count it as such, keep going
            self.book.reject(key, f"receiver error: {type(exc).__name__}", 1)
            logger.exception("store receiver: unexpected error on a value from %s", key)
        return 0

    def _handle(self, key: str, raw: object, kind: SenderKind, rank: int) -> int:
        batch = self._decoder.batch(raw, kind=kind, rank=rank)
        entries = batch.entries
        state, skip = self.book.arrived(batch.sender, key, batch.first, len(entries),
                                        batch.dropped)
        delivered = self._decoder.publish_all(
            entries[skip:] if skip else entries, batch.contexts, self.bus.publish,
            lambda reason: self.book.reject(key, reason, 1))
        state.delivered += delivered
        self.delivered += delivered
        if batch.end and not state.ended:
            state.ended = True
            if self.on_end is not None:
                try:
                    self.on_end(key, batch.sender)
                except Exception:
                    logger.exception("store receiver: on_end callback failed")
        return delivered

    def stats(self) -> dict[str, Any]:
        """Values popped, events delivered, rejected and lost (per reason), senders."""
        with self._lock:
            return {
                "values": self.values,
                "delivered": self.delivered,
                "wakeups": self.wakeups,
                "rejected": dict(self.rejected),
                "lost": dict(self.lost),
                "store_errors": self.store_errors,
                "holds": self.holds,
                "queues": list(self._queues),
                "senders": self.book.stats(),
            }

    def report_leftovers(self, *, counted_elsewhere: Collection[str] = ()) -> int:
        """Publish an ``EVENTS_LOST`` ("left in the store") for every watched queue that
        still holds values, e.g. when the exit budget ran out first; returns their total.

        The count is of pushes (values): each holds up to a few thousand events. A queue
        in ``counted_elsewhere`` (its sender left an exit ledger, which counts in events
        what never arrived, these pushes included) is only logged.
        """
        total = 0
        with self._lock:
            client = self.client
            if client is None:
                return 0
            for key in list(self._queues):
                try:
                    left = int(client.queue_len(key))
                except Exception:
                    continue
                if left and key in counted_elsewhere:
                    logger.warning("store receiver: %d pushes left undrained in %s; its "
                                   "sender's exit ledger counts their events", left, key)
                elif left:
                    total += left
                    self.leftovers[key] = left
                    self.lost["left in the store"] = self.lost.get("left in the store",
                                                                   0) + left
                    logger.warning("store receiver: %d pushes left undrained in %s", left, key)
                    self.bus.publish(EventsLost(
                        source=key, count=left,
                        reason="left in the store at exit (count of pushes, not events)",
                        data={"queue": key}))
        return total

    def settle(self, ledger: ExitLedger, *, why: str) -> int:
        """:meth:`SenderBook.settle <eventbus.publishers.sender_book.SenderBook.settle>`,
        under the receiver's lock: what ``ledger``'s sender numbered or dropped that never
        arrived, reported; returns the events reported."""
        with self._lock:
            return self.book.settle(ledger, why=why)

    def settle_count(self, count: RecordCount, *, why: str) -> int:
        """:meth:`SenderBook.settle_count
        <eventbus.publishers.sender_book.SenderBook.settle_count>`, under the receiver's
        lock: what ``count``'s sender recorded that never arrived, reported."""
        with self._lock:
            return self.book.settle_count(count, why=why)

    def unended(self) -> list[str]:
        """Senders seen without their end marker (killed, or still running)."""
        with self._lock:
            return self.book.unended()

    def close(self) -> None:
        """Stop draining and report what is still pending."""
        self.stop()
        with self._lock:
            self.book.flush_rejects(force=True)
            if self._pops is not None:
                self._pops.close()
