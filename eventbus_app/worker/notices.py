"""The worker's ear: job-wide notices from the agents, delivered on the worker's default bus.

One thread per worker blocks in the store's ``wait`` on the next notice of the job's log
(:mod:`eventbus.app.protocol.notices`): no CPU and no wake-up while nothing is told. For
each notice, in order:

1. a ``PREEMPTING`` starts the drain of :mod:`eventbus.preemption` first, so that
   ``should_stop()`` never waits on a subscriber;
2. the notice is handed to each subscriber of its type on the default bus, each on a
   thread of its own (made on its first notice): a subscriber that blocks delays only its
   own later notices, one that raises is reported as the bus reports it. Never on the
   training thread, never inside the script's collectives. The process's own sinks (its
   forwarder, a JSONL recorder) and progress watch are left out: a notice is not this
   rank's event, nor its progress;
3. for ``PREEMPTING``: a rank whose script acts on drains (it called ``should_stop()`` or
   subscribed to ``PREEMPTING``) promises a step and joins the agreement on the stop step;
   any other script gets the drain signal at once, as torchrun would send it (its own
   handler, or the default action), and counts as having promised nothing.

The thread starts once ``torch.distributed`` is imported (the store client is torch's,
and the bootstrap never imports torch before the script does): at :func:`start` if it is,
else at the progress watch's next tick after the script imported it, or at the first
event the script records after that, whichever is first. Nothing of eventbus imports
torch in a worker (see :func:`start`).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import queue
import signal as signals
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from eventbus import preemption
from eventbus.app.protocol import notices as log
from eventbus.app.worker import drain_signals
from eventbus.bus import ALL
from eventbus.bus import Bus
from eventbus.bus import Subscription
from eventbus.bus import get_default_bus
from eventbus.events import Event
from eventbus.events import EventType
from eventbus.events import Preempting
from eventbus.subscribers.queued import QueuedSink
from eventbus.subscribers.queued import _signals_held

__all__ = ["NoticeReader", "local_only", "reader", "start", "start_if_ready", "waiting"]

logger = logging.getLogger("eventbus")

#: the attribute that keeps a subscriber's callable out of the notices' delivery
_LOCAL_ONLY = "_eventbus_local_only"


def local_only(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Mark a subscriber as this process's own (a forwarder, a progress counter): job-wide
    notices are not delivered to it. Returns ``fn``, or a marked wrapper of it when ``fn``
    takes no attribute (a bound builtin such as ``list.append``)."""
    try:
        setattr(fn, _LOCAL_ONLY, True)
    except (AttributeError, TypeError):
        def own(event: Any) -> Any:
            return fn(event)
        setattr(own, _LOCAL_ONLY, True)
        return own
    return fn


def _is_local_only(sub: Any) -> bool:
    """The process's own sinks (the forwarder, a JSONL recorder: queued sinks of this
    process's events) and what :func:`local_only` marked."""
    target = sub.on_event if isinstance(sub, Subscription) else sub
    if isinstance(target, QueuedSink):
        return True
    return bool(getattr(target, _LOCAL_ONLY, False)) or bool(
        getattr(getattr(target, "__self__", None), _LOCAL_ONLY, False))


class _Deliverer:
    """Each subscriber's own thread and queue, made on its first notice."""

    def __init__(self) -> None:
        self._queues: dict[int, queue.SimpleQueue[Callable[[], None]]] = {}
        self._keep: dict[int, Any] = {}

    def deliver(self, bus: Bus, event: Event) -> int:
        handed = 0
        for sub, call in bus.deliveries(event):
            if _is_local_only(sub):
                continue
            key = id(sub)
            q = self._queues.get(key)
            if q is None:
                q = self._queues[key] = queue.SimpleQueue()
                self._keep[key] = sub  # the id stays this subscriber's
                name = getattr(sub, "name", type(sub).__name__)
                with _signals_held():
                    threading.Thread(target=_serve, args=(q,), daemon=True,
                                     name=f"eventbus-notice:{str(name)[:40]}").start()
            q.put(call)
            handed += 1
        return handed


def _serve(q: queue.SimpleQueue[Callable[[], None]]) -> None:
    while True:
        q.get()()


class NoticeReader:
    """The thread that hears the job's notices (see the module's docstring)."""

    def __init__(self, *, host: str, port: int, root: str, start_after: int, rank: int | None,
                 world_size: int | None, attempt: int | None, bus: Bus | None = None,
                 connect: Callable[[], Any] | None = None) -> None:
        self.host, self.port, self.root = host, port, root
        self.next_seq = start_after + 1
        self.rank, self.world_size, self.attempt = rank, world_size, attempt
        self.bus = bus if bus is not None else get_default_bus()
        self._connect = connect
        self._deliverer = _Deliverer()
        #: notices heard, delivered, skipped as stale, refused as malformed
        self.stats = {"heard": 0, "delivered": 0, "stale": 0, "refused": 0, "gaps": 0}
        #: the drain's agreement, once it ran: what this rank promised, the stop step
        self.agreement: dict[str, Any] = {}
        self.error: str | None = None
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self._ear: log.WaitingClient | None = None
        self._closed = False

    def start(self) -> None:
        if self._thread is None:
            with _signals_held():
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="eventbus-notices")
                self._thread.start()
            atexit.register(self.close)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _client(self) -> Any:
        if self._connect is not None:
            return self._connect()
        from eventbus.store_client import connect_store

        return connect_store(self.host, self.port, timeout=30.0)

    def close(self, timeout: float = 1.0) -> None:
        """End the thread (at exit: it must not be inside a store call when the
        interpreter finalizes; see :class:`~eventbus.app.protocol.notices.WaitingClient`)."""
        self._closed = True
        ear, thread = self._ear, self._thread
        if thread is None or thread is threading.current_thread() \
                or os.getpid() != self._pid or not thread.is_alive():
            return
        if ear is not None and ear.wake(log.entry_key(self.root, self.next_seq)):
            thread.join(timeout)
        if thread.is_alive() and ear is not None:
            ear.shut()  # the store cannot be reached: end the wait the hard way
            thread.join(timeout)

    def _run(self) -> None:
        try:
            self._ear = log.WaitingClient(self._client, self.port)
            client = self._ear.client
        except Exception as exc:
            self.error = f"cannot reach the store: {type(exc).__name__}: {exc}"
            logger.warning("eventbus: this worker hears no job-wide notices (%s)", self.error)
            return
        if self._closed:
            return
        while os.getpid() == self._pid and not self._closed:
            try:
                event = log.read_entry(client, self.root, self.next_seq)
            except (ValueError, TypeError) as exc:
                self.stats["refused"] += 1
                logger.warning("eventbus: job-wide notice %d is not an event (%s); skipped",
                               self.next_seq, exc)
                self.next_seq += 1
                continue
            except Exception as exc:  # the store is gone (the job is ending), or closed
                if self._closed:
                    return
                self.error = f"{type(exc).__name__}: {exc}"
                logger.debug("eventbus: notices: %s", self.error)
                return
            if event is None:
                self._skip_gap(client)
                continue
            seq, self.next_seq = self.next_seq, self.next_seq + 1
            if self._closed:
                return
            if not isinstance(event, Event):  # a leaving reader's mark: no notice
                continue
            try:
                self.hear(event, seq, client)
            except Exception:  # one notice must not end the ear
                logger.exception("eventbus: handling job-wide notice %d failed", seq)

    def _skip_gap(self, client: Any) -> None:
        # A long wait ended with nothing: an agent that died between its add and its set
        # leaves a seq that never comes; a later one existing proves it.
        with contextlib.suppress(Exception):
            if log.head(client, self.root) > self.next_seq and not client.check(
                    [log.entry_key(self.root, self.next_seq)]):
                self.stats["gaps"] += 1
                self.next_seq += 1

    def hear(self, event: Event, seq: int, client: Any) -> None:
        """Handle one notice (its seq in the log; ``client`` for the agreement)."""
        self.stats["heard"] += 1
        if log.stale(event, self.attempt):
            self.stats["stale"] += 1
            return
        if isinstance(event, Preempting):
            self._preempting(event, seq, client)
            return
        self.stats["delivered"] += 1
        self._deliverer.deliver(self.bus, event)

    # -- the drain ---------------------------------------------------------------------
    def _preempting(self, event: Preempting, seq: int, client: Any) -> None:
        aware = preemption.called() or self._subscribed_to_preempting()
        drain = preemption.begin(deadline_s=event.deadline_s, reason=event.reason,
                                 signal=event.signal)
        self.stats["delivered"] += 1
        self._deliverer.deliver(self.bus, event)
        if not aware:
            self._agree(client, seq, None, drain)
            self._signal_now(event)
            return
        # a script that only subscribed handles the drain itself: it promises no step
        promise = drain.make_promise(preemption.position(), preemption.lead()) \
            if preemption.called() else None
        self._agree(client, seq, promise, drain)

    def _subscribed_to_preempting(self) -> bool:
        return any(sub.event_type == EventType.PREEMPTING and sub.event_type is not ALL
                   and not _is_local_only(sub) for sub in self.bus.subscriptions())

    def _agree(self, client: Any, seq: int, promise: int | None,
               drain: preemption.Drain) -> None:
        """Write this rank's promise (-1: none), count it; the last rank to count sets the
        stop step (the largest promise); every promising rank waits for it, bounded."""
        self.agreement = {"promise": promise}
        if self.rank is None or not self.world_size:
            drain.settle(None, failed="this worker knows no rank or world size")
            return
        keys = log.drain_keys(self.root, seq, self.world_size)
        budget = min(preemption.AGREE_TIMEOUT_S, max(0.5, drain.seconds_left() / 2))
        try:
            client.set(keys["promises"][self.rank], str(-1 if promise is None else promise))
            if int(client.add(keys["count"], 1)) >= self.world_size:
                values = _multi_get(client, keys["promises"])
                stop = max(int(v) for v in values)
                client.set(keys["stop"], str(stop))
            if promise is None:
                return
            started = time.monotonic()
            client.wait([keys["stop"]], _seconds(budget))
            stop_at = int(bytes(client.get(keys["stop"])).decode())
            self.agreement.update(stop=stop_at, waited_s=round(time.monotonic() - started, 4))
            if stop_at < 0:  # nobody promised a step: stop where each is
                drain.settle(None, failed="no rank promised a step")
            else:
                drain.settle(stop_at)
        except Exception as exc:
            why = f"the agreement on a stop step failed ({type(exc).__name__}: {exc})"
            self.agreement["error"] = why
            if promise is not None:
                logger.warning("eventbus: %s; this rank stops where it is", why)
                drain.settle(None, failed=why)

    def _signal_now(self, event: Preempting) -> None:
        """A script that does not act on drains gets the signal at once, as torchrun
        would forward it."""
        signum = getattr(signals, event.signal or "SIGTERM", None)
        if not isinstance(signum, int):
            signum = signals.SIGTERM
        self.agreement["signalled"] = int(signum)
        if signum in drain_signals.installed():  # the bootstrap took it: its default now
            drain_signals.default_action(signum)
        else:
            os.kill(os.getpid(), signum)


def _multi_get(client: Any, keys: list[str]) -> list[Any]:
    get_many = getattr(client, "multi_get", None)
    if callable(get_many):
        return list(get_many(keys))
    return [client.get(k) for k in keys]


def _seconds(value: float) -> Any:
    import datetime

    return datetime.timedelta(seconds=value)


# -- the one reader of this process -------------------------------------------------------

_reader: NoticeReader | None = None
_pending: dict[str, Any] | None = None
_trigger: Subscription | None = None
_start_lock = threading.Lock()


def reader() -> NoticeReader | None:
    """This process's reader, once started."""
    return _reader


def start(*, host: str, port: int, root: str, start_after: int, rank: int | None,
          world_size: int | None, attempt: int | None) -> None:
    """Start this process's reader now if the script imported ``torch.distributed``, else
    once it has: at the progress watch's next tick, or at the first event recorded after
    the import. Once per process. Nothing here imports torch: an import on another thread
    than the script's could deadlock with the script's own (see
    :class:`eventbus.store_client.QueueClient`), and on the recording thread it would make that
    ``record()`` wait seconds."""
    global _pending, _trigger
    if _reader is not None or _pending is not None:
        return
    _pending = {"host": host, "port": port, "root": root, "start_after": start_after,
                "rank": rank, "world_size": world_size, "attempt": attempt}
    if _torch_ready():
        _start_pending()
        return
    _trigger = get_default_bus().subscribe(ALL, on_event=local_only(_on_event))


def waiting() -> bool:
    """Whether a reader waits for the script to import torch."""
    return _pending is not None and _reader is None


def start_if_ready() -> None:
    """Start the waiting reader if the script imported ``torch.distributed`` (the progress
    watch's tick asks: a script that records nothing still hears the job)."""
    if waiting() and _torch_ready():
        _start_pending()


def _torch_ready() -> bool:
    module = sys.modules.get("torch.distributed")
    spec = getattr(module, "__spec__", None)
    return module is not None and not getattr(spec, "_initializing", False)


def _on_event(_: Event) -> None:
    # until the reader starts: one sys.modules lookup per event recorded
    if _torch_ready():
        _start_pending()


def _start_pending() -> None:
    global _reader, _pending
    with _start_lock:  # the progress watch's thread and a recording thread may race here
        if _pending is None or _reader is not None:
            return
        settings, _pending = _pending, None
        _reader = NoticeReader(**settings)
        trigger = _trigger
    if trigger is not None:
        trigger.cancel()
    _reader.start()


def _after_fork_in_child() -> None:
    global _reader, _pending, _trigger, _start_lock
    _reader = _pending = _trigger = None
    _start_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
