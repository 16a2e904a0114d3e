"""A bounded queue and a background thread between the bus and a slow sink.

Files, the c10d store and anything else that may block sit behind a :class:`QueuedSink`:
``record()`` only appends to a deque (bounded by count and by an estimate of bytes), and a
daemon thread hands batches to the sink. When the queue is full the sink drops, by policy,
the newest or the oldest event, and counts it per reason: nothing is lost silently.

Fork: a forked child (a DataLoader worker, say) inherits the parent's queue but not its
thread. The child starts with an empty queue (the parent still owns those events and will
deliver them) and a fresh lock; its thread starts on the first event.

Exit: every live sink is flushed by an ``atexit`` hook within its ``close_timeout``;
:func:`flush_all` does the same on demand (the worker's SIGTERM handler calls it).

Wake-ups: the thread sleeps, with no timeout, while its queue is empty and no drop report
is due: an idle sink costs no CPU and takes the GIL from no one. The enqueue that finds
the queue empty wakes it, through a descriptor (an ``eventfd``, or a pipe where there is
none) that the thread polls: one ``write`` system call, made before the event is appended,
so that a signal handler raising inside the enqueue either loses the wake-up with the
event or leaves a spare wake-up, never an event queued with its wake-up lost
(:mod:`~eventbus.subscribers.doorbell`). Batches go
at most one per ``flush_interval``: a first event after a quiet spell is handed over at
once, and within ``flush_interval`` of the last batch the next one grows until then (cut
short by a full batch, ``flush`` or ``close``).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any
from typing import Final
from typing import Literal

import attrs

from eventbus._compiled import speedups as _speedups
from eventbus._reporting import RateLimiter
from eventbus.events import Event
from eventbus.subscribers.doorbell import Doorbell

__all__ = ["BASE_BYTES", "CONTAINER_ITEM_BYTES", "FREE_VALUE_TYPES", "Overflow",
           "PER_KEY_BYTES", "QueueSettings", "QueuedSink", "backlogged", "estimate_size",
           "flush_all"]

logger = logging.getLogger("eventbus")

Overflow = Literal["drop-newest", "drop-oldest"]

def _at_least(low: float, what: str) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    def check(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < low:
            raise ValueError(f"QueueSettings.{attribute.name} must be {what}, got {value!r}")
    return check


def _overflow(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value not in ("drop-newest", "drop-oldest"):
        raise ValueError(f"QueueSettings.overflow must be 'drop-newest' or 'drop-oldest', "
                         f"got {value!r}")


@attrs.frozen(kw_only=True)
class QueueSettings:
    """The bounds and timeouts of one bounded queue, in one place.

    Every queue of the project takes one: :class:`QueuedSink` and what sits behind it (the
    JSONL recorder, the store forwarder, the agent's sinks). Derive a variant with
    ``attrs.evolve(settings, max_events=...)``; a nonsense value raises ``ValueError``
    naming the field.
    """

    #: events held at most; more are dropped by ``overflow``
    max_events: int = attrs.field(default=100_000, validator=_at_least(1, "an int >= 1"))
    #: estimated bytes held at most (see :func:`estimate_size`)
    max_bytes: int = attrs.field(default=64 * 1024 * 1024,
                                 validator=_at_least(1, "an int >= 1"))
    #: which event a full queue drops: the one arriving, or the oldest held
    overflow: Overflow = attrs.field(default="drop-newest", validator=_overflow)
    #: events handed to the sink at once, at most
    max_batch: int = attrs.field(default=1_000, validator=_at_least(1, "an int >= 1"))
    #: how long the thread waits for more events before it hands over a partial batch
    flush_interval: float = attrs.field(default=0.05,
                                        validator=_at_least(0, "a number of seconds >= 0"))
    #: the default budget of ``flush()``/``close()`` and of the flush at interpreter exit
    close_timeout: float = attrs.field(default=5.0,
                                       validator=_at_least(0, "a number of seconds >= 0"))
    #: at most one drop report per this many seconds (every drop is counted)
    report_interval: float = attrs.field(default=10.0,
                                         validator=_at_least(0, "a number of seconds >= 0"))
    #: ask a receiver upstream to wait (see :func:`backlogged`) while this queue is at
    #: least half full and its sink is still making progress, rather than drop: for a
    #: record that must be complete (the JSONL file), at the price of the receiver's pace
    flow_control: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))

    def with_options(self, options: dict[str, Any]) -> QueueSettings:
        """These settings with ``options`` (field name -> value) replaced; an unknown name
        raises ``TypeError`` naming it and the fields there are."""
        unknown = sorted(set(options) - {a.name for a in attrs.fields(QueueSettings)})
        if unknown:
            names = ", ".join(a.name for a in attrs.fields(QueueSettings))
            raise TypeError(f"unknown queue option {unknown[0]!r}; the options are {names}")
        return attrs.evolve(self, **options) if options else self


#: live sinks, for flush_all() and the fork/exit hooks
_sinks: weakref.WeakSet[QueuedSink] = weakref.WeakSet()

#: a flow-controlled sink whose thread handed over no batch for this long is not waited
#: for: a hung sink drops (and counts) as any other, it never stalls what feeds it
FLOW_STALL_S = 2.0


def backlogged() -> bool:
    """Whether a live sink of this process with ``flow_control`` is at least half full
    (events or bytes) and still draining: a receiver feeding this process's bus (the
    agent's store receiver) then leaves what it would pop where it is, in the store, until
    the sink catches up, instead of making it drop."""
    now = time.monotonic()
    for sink in list(_sinks):
        if sink._flow and not sink._closed and now - sink._progress < FLOW_STALL_S and (
                len(sink._queue) * 2 >= sink._max_events
                or sink.queued_bytes * 2 >= sink._max_bytes):
            return True
    return False


# The size estimate's rules, each written once. The compiled enqueue
# (eventbus/_speedups.c) is handed these constants and _value_size when a sink is made,
# and walks ``data`` as estimate_size() does; tests/test_compiled.py compares the two.

#: the estimate for an event with an empty ``data`` (its fields, context and framing)
BASE_BYTES: Final = 320
#: what each key of ``data`` adds, besides its value's own size
PER_KEY_BYTES: Final = 48
#: what each item of a container value (dict, list, tuple, set) adds
CONTAINER_ITEM_BYTES: Final = 32
#: the exact classes of the values that add nothing beyond their key's allowance
FREE_VALUE_TYPES: Final = (float, int, bool, type(None))


def estimate_size(event: Event) -> int:
    """A cheap estimate of an event's encoded size, in bytes.

    Never serialises: it looks at the top level of ``data`` only (strings and bytes by
    length, containers by item count, arrays and tensors by ``nbytes``: an event holds its
    own copy of each, see eventbus/snapshot.py), which is what a bounded queue needs to
    stay bounded when one payload is huge: :data:`BASE_BYTES`, plus
    :data:`PER_KEY_BYTES` per key of ``data``, plus each value's own size. Numbers and
    ``None`` (:data:`FREE_VALUE_TYPES`) cost nothing beyond the per-key allowance.
    """
    data = event.data
    size = BASE_BYTES
    if data:
        size += PER_KEY_BYTES * len(data)
        for value in data.values():
            # type(), not __class__ (which an object may fake): the compiled enqueue's
            # test is the value's real type too
            if type(value) not in FREE_VALUE_TYPES:
                size += _value_size(value)
    return size


def _value_size(value: Any) -> int:
    """The part of :func:`estimate_size` beyond the per-key allowance for one value whose
    class is not in :data:`FREE_VALUE_TYPES` (the compiled enqueue calls this too)."""
    if value.__class__ is str or isinstance(value, (str, bytes, bytearray)):
        return len(value)
    if isinstance(value, (dict, list, tuple, set, frozenset)):
        return CONTAINER_ITEM_BYTES * len(value)
    try:  # a numpy array or a torch tensor (a sparse one raises)
        nbytes = getattr(value, "nbytes", None)
    except Exception:
        nbytes = None
    return nbytes if type(nbytes) is int else 0


class QueuedSink:
    """Subscriber wrapper: ``bus.subscribe(ALL, on_event=QueuedSink(write_batch))``.

    ``handle_batch(events)`` runs on the sink's own thread with up to ``max_batch`` events
    at a time. If it raises, the batch counts as failed (``failed``), the error is reported
    on the ``eventbus`` logger (rate-limited), and the sink goes on with the next batch.

    Bounds and timeouts come from ``settings`` (a :class:`QueueSettings`); keyword options
    named like its fields override them for this sink: ``QueuedSink(write, max_events=10)``.
    """

    def __init__(
        self,
        handle_batch: Callable[[Sequence[Event]], object],
        *,
        name: str | None = None,
        settings: QueueSettings | None = None,
        size_of: Callable[[Event], int] = estimate_size,
        **options: Any,
    ) -> None:
        #: the queue's bounds and timeouts: ``settings`` (default :class:`QueueSettings`)
        #: with any ``options`` (``max_events=``, ``overflow=``, ...) replaced
        self.settings = (settings or QueueSettings()).with_options(options)
        self.handle_batch = handle_batch
        self.name = name or getattr(handle_batch, "__qualname__", repr(handle_batch))
        self.size_of = size_of
        self._default_size = size_of is estimate_size
        # Read on every enqueue: plain attributes, one lookup each.
        self._max_events = self.settings.max_events
        self._max_bytes = self.settings.max_bytes
        self._max_batch = self.settings.max_batch
        #: count_into()'s counter: 8 shared bytes as one unsigned int, or None
        self._counter: memoryview | None = None
        self._init_state()
        #: the compiled enqueue (eventbus/_speedups.c), made once, before anyone can
        #: enqueue: where it is built, for a sink whose ``__call__`` and size estimate are
        #: QueuedSink's own
        self._direct: Any = None
        if _speedups is not None and type(self).__call__ is QueuedSink.__call__ and \
                self._default_size:
            # What the sink's methods do, handed over as callables (the compiled code
            # looks up no private name): kick() starts or wakes the thread, overflow()
            # takes the unusual case, both with the lock held, as from __call__.
            self._direct = _speedups.Enqueuer(
                self, QueuedSink.__call__, _value_size, BASE_BYTES, PER_KEY_BYTES,
                FREE_VALUE_TYPES, self._kick, self._enqueue_slow)
            self._sync_direct()
        _sinks.add(self)

    def _init_state(self) -> None:
        # Two deques side by side, not one of (event, size) tuples: a tuple per event is
        # one more allocation on record()'s path and one more object for every young
        # garbage collection to traverse while it is queued (the queue holds thousands).
        self._queue: collections.deque[Event] = collections.deque()
        self._sizes: collections.deque[int] = collections.deque()
        #: the estimated bytes queued now (the sum of the sizes queued): the sink's own
        #: counter, public because the compiled enqueue reads and adds to it; read it,
        #: never write it
        self.queued_bytes = 0
        # The producers take the lock; the sink thread waits on a Condition over the same
        # lock. Re-entrant, for a signal handler that records (see __call__).
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._closed = False
        #: flush() calls waiting now: the thread hands over what it has without waiting
        #: for the batch to grow
        self._flushing = 0
        #: the thread's wake-up (doorbell.py): its descriptors are made with the thread
        self._bell = Doorbell(self._cond, fallback_s=self.settings.flush_interval,
                              needed=lambda: bool(self._flushing or self._closed))
        #: the count the fast path admits below: max_events, or 0 once closed (one test
        #: per event covers both)
        self._limit = self._max_events
        #: the fast path calls _kick when the queue is empty (start or wake the thread) and
        #: when the event makes a full batch of this length (cut its wait short)
        self._kick_at = self._max_batch
        self._in_flight = 0
        self._pid = os.getpid()
        #: events that left the queue (handed over, evicted, or cleared by close):
        #: ``enqueued`` is this plus what is queued, so the fast path counts nothing
        self._removed = 0
        #: flow control (see backlogged): on, and when the thread last took a batch
        self._flow = self.settings.flow_control
        self._progress = time.monotonic()
        #: when the thread last took a batch (0.0: never)
        self._handed_at = 0.0
        self.handled = 0
        self.failed = 0
        self.dropped: dict[str, int] = {}
        #: drops already handed to the rate limiter (the rest are new since the last check)
        self._noted_drops = 0
        self._drop_reports = RateLimiter()
        self._sync_direct()

    @property
    def wakeups(self) -> int:
        """Times the thread came back from a wait (a wake-up or a timeout): what an idle
        sink must not add to."""
        return self._bell.wakeups

    @property
    def enqueued(self) -> int:
        """Events accepted into the queue so far (delivered, failed, evicted or queued)."""
        return self._removed + len(self._queue)

    # -- the subscriber side (caller's thread) ------------------------------------------
    def __call__(self, event: Event) -> None:
        """Enqueue ``event``; never blocks on the sink."""
        # The hot path: a size estimate, the lock, two appends, one counter. Nothing in
        # the locked part allocates an object the garbage collector tracks (deque blocks
        # and ints are not), so no collection, and no finalizer that might record()
        # again, runs while the lock is held.
        # Everything unusual (closed, full, too large) is _enqueue_slow's.
        # estimate_size() is called, not written out here: on 3.11 the call is within the
        # noise of this method's ~1.1 us (pure-Python path), and where eventbus/_speedups.c
        # is built a plain sink enqueues through it instead.
        size = self.size_of(event)
        # The lock stays: under the GIL each step below is atomic, but the length test,
        # the byte sum and the appends together are not (another producer thread may run
        # between them), and free-threaded builds have no GIL at all.
        # Signal handlers run in the main thread after any call returns, so they may run
        # in here. Taken by ``with``: one that raises right after a bare acquire(), before
        # a try, would leave the lock held for good. Re-entrant (an RLock): one that
        # records an event (a script's SIGTERM handler, chained by the worker's) enqueues
        # it instead of deadlocking; so the steps are ordered for an enqueue nested at any
        # call: the length is read once, the byte sum is one statement, and the kick
        # depends on this enqueue's own length, so nested enqueues neither skip it nor
        # lose bytes (they may only swap two events' sizes, or order the nested event
        # first). The kick comes before the appends: a handler that raises in it loses
        # this event with its wake-up (record() raises), never strands a queued event with
        # no wake-up on its way (the thread may sleep with no timeout).
        with self._lock:
            queue = self._queue
            n = len(queue)
            if n < self._limit and self.queued_bytes + size <= self._max_bytes:
                if n == 0 or n + 1 == self._kick_at:
                    self._kick()
                self.queued_bytes += size
                queue.append(event)
                self._sizes.append(size)
                counter = self._counter
                if counter is not None:  # queued: counted before record() returns
                    counter[0] += 1
            else:
                self._enqueue_slow(event, size)

    def _eventbus_direct(self) -> Callable[[Event], object]:
        """What a bus calls per event for this sink (eventbus.bus._direct_callable): the
        compiled enqueue (eventbus/_speedups.c: the steps of ``__call__`` in C, with
        anything unusual handed to ``__call__`` itself), or ``__call__`` where it is not
        built or a subclass overrides ``__call__``. One per sink, whichever buses it is
        subscribed to."""
        direct: Callable[[Event], object] | None = self.__dict__.get("_direct")
        return self.__call__ if direct is None else direct

    def _sync_direct(self) -> None:
        # The compiled enqueue keeps what changes rarely: hand it over wherever one of
        # these changes (the state's reset, the thread's start, close), with the lock held.
        direct = self.__dict__.get("_direct")
        if direct is not None:
            direct.sync(self._queue, self._sizes, self._lock, self._limit, self._max_bytes,
                        self._kick_at)

    def count_into(self, counter: memoryview | None) -> None:
        """Count every event this sink is given (queued or dropped) into ``counter``: 8
        writable bytes, aligned to 8, as one native unsigned integer, added to with the
        lock held, before the enqueue returns. ``None`` stops counting.

        For a counter another process reads after this one died (a shared ``mmap``: the
        store forwarder's record counter, :mod:`eventbus.exit_ledger`): at any moment it equals
        what the sink was given, so the events queued and lost with the process are its
        value less what the sink handed on or counted as dropped. The compiled enqueue
        adds one integer increment per event; the pure-Python one a memoryview update.
        A forked child stops counting into its parent's counter.
        """
        view = None if counter is None else memoryview(counter).cast("B")
        if view is not None and (view.nbytes < 8 or not view.contiguous):
            raise ValueError("count_into: the counter must be 8 contiguous bytes")
        with self._lock:
            direct = self.__dict__.get("_direct")
            if direct is not None:
                direct.count_into(view)
            self._counter = None if view is None else view[:8].cast("Q")

    def _kick(self) -> None:
        # Called with the lock held, before an event is appended to an empty queue or one
        # that it fills to a batch.
        if self._thread is None:
            self._start()
        else:
            self._bell.ring()

    def _enqueue_slow(self, event: Event, size: int) -> None:
        # Called with the lock held. Every event it gets is queued or dropped: counted.
        counter = self._counter
        if counter is not None:
            counter[0] += 1
        if self._closed:
            self._drop("closed", 1)
            return
        if size > self._max_bytes:
            self._drop("too large", 1)
            self._wake_for_report()
            return
        if self.settings.overflow == "drop-newest":
            self._drop("queue full", 1)
            self._wake_for_report()
            return
        queue = self._queue
        sizes = self._sizes
        while queue and (len(queue) >= self._max_events
                         or self.queued_bytes + size > self._max_bytes):
            queue.popleft()
            # Not in the -= below: its read of queued_bytes would come before the call, and
            # an enqueue nested there would be lost.
            freed = sizes.popleft()
            self.queued_bytes -= freed
            self._removed += 1
            self._drop("queue full", 1)
        queue.append(event)
        sizes.append(size)
        self.queued_bytes += size
        if self._thread is None:
            self._start()

    def _wake_for_report(self) -> None:
        # A drop into an idle queue (an event over max_bytes, say) is reported by the
        # thread, which sleeps with no timeout while the queue is empty: wake it.
        if self._thread is not None and not self._queue:
            self._bell.ring()

    def _drop(self, reason: str, n: int) -> None:
        # One statement with no call in it once the reason is known: a drop nested in
        # here by a signal handler (see __call__) is not lost to a stale read.
        dropped = self.dropped
        if reason in dropped:
            dropped[reason] += n
        else:
            dropped[reason] = n

    # -- the sink side (own thread) -----------------------------------------------------
    def _start(self) -> None:
        # A signal handler that raises (a script's SIGTERM handler, say) must not cut the
        # start short: an exception between the bookkeeping below and the new thread's
        # spawn leaves a thread that never runs, and the queue never drains (flush fails,
        # close cannot join it: seen with a handler raising every 0.2 ms, inside
        # Thread.start() and, rarer, between setting _thread and starting it). Signals are
        # held for the microseconds of the whole start and handled right after it; the
        # sink's thread keeps them blocked, as only the main thread runs Python's handlers.
        with _signals_held():
            thread = threading.Thread(target=self._run, name=f"eventbus-sink:{self.name}",
                                      daemon=True)
            self._bell.open()
            self._thread = thread
            thread.start()

    def _take(self) -> list[Event]:
        # Called with the lock held: up to max_batch events off the queue, in order.
        queue = self._queue
        sizes = self._sizes
        n = len(queue)
        if len(sizes) != n:
            self._resync()
        if n <= self._max_batch:
            batch = list(queue)
            queue.clear()
            self.queued_bytes -= sum(sizes)
            sizes.clear()
        else:
            n = self._max_batch
            popleft = queue.popleft
            pop_size = sizes.popleft
            batch = [popleft() for _ in range(n)]
            self.queued_bytes -= sum(pop_size() for _ in range(n))
        self._removed += n
        return batch

    def _resync(self) -> None:
        # Called with the lock held, when the queue and its sizes differ in length: a
        # signal handler raised between an enqueue's two appends (the pure-Python path:
        # the compiled one runs no Python code there), or an eviction's two pops. Each
        # size is estimated again (the estimate of an event is the same every time), and
        # the byte count with them: left as it was, the partial take below would pop an
        # empty deque (and end the thread), and the count would drift until the queue
        # refused everything as over max_bytes.
        sizes = self._sizes
        sizes.clear()
        for event in self._queue:
            try:
                sizes.append(self.size_of(event))
            except Exception:
                sizes.append(BASE_BYTES)
        self.queued_bytes = sum(sizes)

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            with self._cond:
                self._bell.close()

    def _loop(self) -> None:
        interval = self.settings.flush_interval
        while True:
            with self._cond:
                idle = not self._queue
                if idle and self._closed:
                    self._cond.notify_all()
                    return
                # idle, it sleeps with no limit unless a drop report is held back
                timeout = self.settings.report_interval if self._drop_reports.held else None
            if idle:
                self._bell.wait(timeout)
                self._maybe_report()
                continue
            # Events queued. Batches go at most one per flush_interval: within that time of
            # the last one the batch grows until then, unless a flush or the close waits,
            # or it is full; a first event after a quiet spell (a heartbeat) goes at once.
            # Spare wake-ups are drained first, the state read after: a wake-up written
            # since is not missed.
            self._bell.drain()
            with self._cond:
                wait = interval - (time.monotonic() - self._handed_at)
                grow = wait > 0 and not self._flushing and not self._closed and \
                    0 < len(self._queue) < self._max_batch
            if grow:
                self._bell.wait(wait)
            with self._cond:
                if not self._queue:
                    continue
                batch = self._take()
                self._in_flight = len(batch)
                self._progress = self._handed_at = time.monotonic()
            try:
                self.handle_batch(batch)
            except Exception:
                with self._cond:
                    self.failed += len(batch)
                logger.exception("sink %s failed on a batch of %d events; they are lost",
                                 self.name, len(batch))
            else:
                with self._cond:
                    self.handled += len(batch)
            with self._cond:
                self._in_flight = 0
                self._cond.notify_all()
            self._maybe_report()

    def _maybe_report(self, *, force: bool = False) -> None:
        # Polled (after each batch, when idle, on close), not called per drop: the drops
        # since the last poll are one occurrence for the rate limiter.
        total = sum(self.dropped.values())
        n, self._noted_drops = total - self._noted_drops, total
        if not n and not self._drop_reports.held:
            return  # nothing new since the last report
        held = self._drop_reports.allow(self.settings.report_interval, n, force=force)
        if held is None:
            return
        new = held + n
        logger.warning("sink %s dropped %d events (%s so far: %s)", self.name, new, total,
                       ", ".join(f"{k}: {v}" for k, v in sorted(self.dropped.items())))

    # -- control ------------------------------------------------------------------------
    def can_wait_here(self, timeout: float) -> bool:
        """Whether this thread may wait for the queue now (flush, close): it is not inside
        this sink's enqueue (a signal handler that interrupted one is: the lock is
        re-entrant, so a flush would wait with that enqueue half done), and no other
        thread holds the lock for longer than ``timeout`` seconds (the queue's thread
        holds it only for a few pops)."""
        if self._cond._is_owned():  # type: ignore[attr-defined]  # Condition's, for its RLock
            return False
        if self._lock.acquire(timeout=timeout):
            self._lock.release()
            return True
        return False

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything enqueued so far is handled. False if ``timeout`` ran out."""
        budget = self.settings.close_timeout if timeout is None else timeout
        deadline = time.monotonic() + budget
        with self._cond:
            if self._thread is None and self._queue:
                self._start()
            self._flushing += 1
            try:
                self._bell.ring()
                while self._queue or self._in_flight:
                    left = deadline - time.monotonic()
                    if left <= 0 or self._thread is None or not self._thread.is_alive():
                        return not (self._queue or self._in_flight)
                    self._cond.wait(min(left, 0.05))
                return True
            finally:
                self._flushing -= 1

    def close(self, timeout: float | None = None) -> bool:
        """Flush within ``timeout`` (default ``close_timeout``), then stop the thread.

        Events still queued when the deadline passes are counted as dropped
        ("closed before delivery"); events arriving after close are dropped ("closed").
        Returns True when everything was delivered.
        """
        budget = self.settings.close_timeout if timeout is None else timeout
        deadline = time.monotonic() + budget
        done = self.flush(timeout)
        with self._cond:
            self._closed = True
            self._limit = 0  # the fast path admits nothing: _enqueue_slow drops it
            self._sync_direct()
            if self._queue:
                self._drop("closed before delivery", len(self._queue))
                self._removed += len(self._queue)
                self._queue.clear()
                self._sizes.clear()
                self.queued_bytes = 0
            self._cond.notify_all()
            self._bell.ring()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread() \
                and thread.is_alive():
            # within the caller's budget: a hung sink's thread is a daemon, leave it
            thread.join(max(0.0, min(0.5, deadline - time.monotonic())))
        self._maybe_report(force=True)
        return done

    @property
    def pending(self) -> int:
        """Events queued and not yet handed to the sink."""
        return len(self._queue) + self._in_flight

    def stats(self) -> dict[str, Any]:
        """Enqueued, handled, failed, pending and dropped (per reason) counts."""
        with self._cond:
            return {
                "name": self.name,
                "enqueued": self.enqueued,
                "handled": self.handled,
                "failed": self.failed,
                "pending": len(self._queue) + self._in_flight,
                "dropped": dict(self.dropped),
                "queued_bytes": self.queued_bytes,
            }

    def _after_fork_in_child(self) -> None:
        # The parent keeps (and delivers) what was queued; the child starts empty, and
        # counts into no counter of its parent's. The wake-up descriptors it inherited are
        # the parent thread's: closed here (the parent's stay open), new ones come with
        # the child's own thread.
        inherited = self._bell
        self._init_state()
        inherited.close()
        if self._counter is not None:
            self.count_into(None)

    def __repr__(self) -> str:
        return f"<QueuedSink {self.name} pending={self.pending}>"


def flush_all(timeout: float = 5.0) -> bool:
    """Flush every open sink, sharing one deadline. True when all were flushed."""
    deadline = time.monotonic() + timeout
    ok = True
    for sink in list(_sinks):
        if sink._closed:
            continue
        ok = sink.flush(max(0.0, deadline - time.monotonic())) and ok
    return ok


#: the signals a fault raises in the thread that caused it: never blocked (a crash must
#: still reach faulthandler; a blocked fault signal just kills the process)
_FAULTS = frozenset(getattr(signal, name) for name in
                    ("SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT", "SIGTRAP", "SIGSYS")
                    if hasattr(signal, name))


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Block the asynchronous signals in this thread while the body runs (where the
    platform can); what arrives meanwhile is delivered when the mask is restored. A thread
    started in the body keeps them blocked for its life."""
    mask = getattr(signal, "pthread_sigmask", None)
    if mask is None:
        yield
        return
    old = mask(signal.SIG_BLOCK, signal.valid_signals() - _FAULTS)
    try:
        yield
    finally:
        mask(signal.SIG_SETMASK, old)


def _close_all_at_exit() -> None:
    for sink in list(_sinks):
        if sink._pid == os.getpid() and not sink._closed:
            try:
                sink.close()
            except Exception:
                logger.exception("closing sink %s at exit failed", sink.name)


def _after_fork_in_child() -> None:
    for sink in list(_sinks):
        sink._after_fork_in_child()


atexit.register(_close_all_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
