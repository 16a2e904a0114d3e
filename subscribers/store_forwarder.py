"""Ship a process's events to its agent through the job's c10d store.

In a worker started by ``eventbus run``, the worker bootstrap (:mod:`eventbus.app.worker`)
attaches a :class:`StoreForwarder` to the default bus (:func:`attach_worker_forwarder`):
every event goes into a bounded :class:`~eventbus.subscribers.queued.QueuedSink`, whose
thread encodes batches and ``queue_push``-es them to a key of the long-lived rendezvous
store namespaced by run id, attempt and rank. The agent's
:class:`eventbus.publishers.store_receiver.StoreReceiver` pops them and republishes them on
its bus. The agents of the other nodes use the same forwarder (``kind="n"``) to ship a
filtered view of their bus to group rank 0.

The wire format, the keys and the numbering live in :mod:`eventbus.wire`.

What can be lost, and how it shows:

* the store is down or unreachable: pushes fail (the first push after the server died even
  returns OK); each batch is counted lost at once (not held for a reconnect: a queue that
  grows during an outage makes every full garbage collection, and so ``record()``, slow),
  logged (rate-limited) on the ``eventbus`` logger, and a background thread reconnects at
  most every ``reconnect_interval`` seconds; :meth:`StoreForwarder.close` tries for at most
  :data:`END_CONNECT_WAIT` to push the end marker. If anything arrives later, the receiver
  reports the gap, which counts the silently lost push too;
* the process is SIGKILLed: what is still queued, at most the last ``flush_interval`` of
  events plus one in-flight batch, is lost. Given ``ledger_dir``, the loss is still counted
  exactly: the forwarder's queue counts every event it is given into the sender's record
  counter, a small file of ``ledger_dir`` mapped shared (:func:`eventbus.exit_ledger.open_counter`),
  which the agent reads after the worker died and compares with the numbers that reached
  it (see :meth:`eventbus.publishers.store_receiver.StoreReceiver.settle_count`). Without
  ``ledger_dir`` nothing follows the loss to reveal it; the agent logs that the sender
  never sent its end marker. (``os._exit`` in a worker flushes first, within
  :data:`eventbus.subscribers.worker_exit.OS_EXIT_FLUSH_TIMEOUT`: see
  :mod:`eventbus.subscribers.worker_exit`.)

Exit ledger: given ``ledger_dir`` (a worker gets its agent's per-attempt directory from
``EVENTBUS_LEDGER_DIR``), :meth:`StoreForwarder.close` also leaves one small local file,
``<sender>.json`` (:class:`eventbus.exit_ledger.ExitLedger`: its queue, how many events it
numbered, its drops per reason), written once and atomically before it tries the end
marker. The agent reads it before it exits, so that a loss the store cannot report (the
store died) is still reported as ``EVENTS_LOST`` with its true count. ``record()`` never
pays for it; for the record counter it pays one pointer test and one integer increment
in the compiled enqueue (a memoryview update on the pure-Python path).
"""

from __future__ import annotations

import contextlib
import encodings.idna  # noqa: F401  (see the note above attach_worker_forwarder)
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

from eventbus._reporting import RateLimiter
from eventbus.bus import ALL
from eventbus.bus import Bus
from eventbus.bus import Subscription
from eventbus.bus import get_default_bus
from eventbus.events import Event
from eventbus.exit_ledger import ExitLedger
from eventbus.exit_ledger import RecordCounter
from eventbus.exit_ledger import open_counter
from eventbus.exit_ledger import write_ledger
from eventbus.store_client import QueueClient
from eventbus.subscribers.queued import QueuedSink
from eventbus.subscribers.queued import QueueSettings
from eventbus.wire import BatchEncoder
from eventbus.wire import SenderKind
from eventbus.wire import worker_key

__all__ = [
    "END_CONNECT_WAIT",
    "END_MARKER_LOCK_WAIT",
    "FORWARDER_QUEUE",
    "StoreForwarder",
    "attach_worker_forwarder",
    "worker_forwarder",
]

logger = logging.getLogger("eventbus")

# -- the forwarder -----------------------------------------------------------------------


#: the longest close() waits for a reconnect to push the end marker after an outage
END_CONNECT_WAIT = 10.0
#: the least ``close()`` waits for the queue's thread to leave a store call before it
#: gives up pushing the end marker (more when the close budget has more left)
END_MARKER_LOCK_WAIT = 1.0

#: the forwarder's queue: larger batches and a shorter idle wait than a file sink (one push
#: carries thousands of events; a worker's events should reach the agent within ~20 ms)
FORWARDER_QUEUE = QueueSettings(max_events=200_000, max_batch=4_000, flush_interval=0.02,
                                close_timeout=10.0)


class StoreForwarder:
    """Subscriber that ships every event of ``bus`` (or those ``where`` selects) to a queue
    of a c10d store, in numbered batches, from a background thread.

    ``record()`` only appends to the bounded queue; connecting, encoding and pushing happen
    on the queue's thread. A forked child starts empty, with a new sender id and numbering,
    and opens its own store client on its first push.

    * ``host``, ``port``: the TCPStore; ``key``: the queue to push to (see
      :mod:`eventbus.wire` for the keys); ``rank`` and ``kind``: who sends (``"w"``: a
      worker by global rank, ``"n"``: a node's agent by group rank), which the receiver
      checks against the queue it pops;
    * ``bus``: whose events to ship (default: the default bus); ``where``: a predicate
      selecting them (default: all);
    * ``connect_timeout``: the budget of one connect (and of each store operation);
      ``reconnect_interval``: after a failure, connect again at most this often;
    * ``settings``: the queue (default :data:`FORWARDER_QUEUE`), and any of its fields as
      keyword options to override them; ``close_timeout`` is also the default budget of
      :meth:`flush` and :meth:`close`, ``report_interval`` the rate of loss reports;
    * ``ledger_dir``: a local directory where :meth:`close` leaves this sender's exit
      ledger, and where its record counter lives from the start (default: none);
    * ``bell``: the receiver's doorbell queue (:func:`eventbus.wire.bell_key`): after each
      push, ``key`` is pushed there too, so that the receiver pops it at once instead of at
      its next poll (default: none, the receiver polls).
    """

    def __init__(
        self,
        *,
        host: str,
        port: int,
        key: str,
        rank: int,
        kind: SenderKind = "w",
        bus: Bus | None = None,
        where: Callable[[Event], object] | None = None,
        connect_timeout: float = 10.0,
        reconnect_interval: float = 2.0,
        settings: QueueSettings = FORWARDER_QUEUE,
        ledger_dir: str | None = None,
        bell: str | None = None,
        **options: Any,
    ) -> None:
        self.host = host
        self.bell = bell
        self._ring = key.encode("utf-8")
        self.ledger_dir = ledger_dir
        self.port = port
        self.key = key
        self.rank = rank
        self.kind: SenderKind = kind
        self.bus = bus if bus is not None else get_default_bus()
        self.connect_timeout = connect_timeout
        self.reconnect_interval = reconnect_interval
        self.sink = QueuedSink(self._push_batch, name=f"store-forwarder:{key}",
                               settings=settings, **options)
        #: the queue's settings (``self.sink.settings``)
        self.settings = self.sink.settings
        self._reset()
        self.subscription: Subscription | None = self.bus.subscribe(
            ALL, on_event=self.sink, where=where)
        _forwarders.add(self)

    def _reset(self) -> None:
        # Called at construction and in a forked child: a new sender with its own numbering
        # and its own store client (the parent's socket is not ours to use).
        self.encoder = BatchEncoder(kind=self.kind, rank=self.rank)
        self._client: Any = None
        #: the client's socket descriptors (Linux; empty where unknown): see _end_stuck_push
        self._client_fds: frozenset[int] = frozenset()
        #: close() gave up on a push stuck in the store client (see _end_stuck_push)
        self._gave_up = False
        self._client_lock = threading.Lock()
        self._next_connect = 0.0
        #: the background connect in progress, if any (see _connect)
        self._connector: threading.Thread | None = None
        self._connected_once = False
        self._waited = False
        self._connect_error = ""
        self._pid = os.getpid()
        self._ended = False
        #: the path of the exit ledger once written
        self.ledger: str | None = None
        self._pushed_events = 0
        self._pushes = 0
        self.lost: dict[str, int] = {}
        self._loss_report = RateLimiter()
        #: the record counter (given ledger_dir): every event the queue is given
        self.counter: RecordCounter | None = None
        self.sink.count_into(None)
        if self.ledger_dir is not None:
            try:
                self.counter = open_counter(self.ledger_dir, self.sender, self.key)
            except (OSError, ValueError) as exc:
                logger.warning("store forwarder %s: cannot make its record counter in %s: "
                               "%s; events lost to a SIGKILL will not be counted",
                               self.sender, self.ledger_dir[:200], exc)
            else:
                self.sink.count_into(self.counter.view)

    @property
    def in_this_process(self) -> bool:
        """Whether this process made it (a forked child inherits a copy it must not close
        on the parent's behalf: the child's own is made anew, see ``_reset``)."""
        return self._pid == os.getpid()

    @property
    def sender(self) -> str:
        """This process's sender id (it changes in a forked child)."""
        return self.encoder.sender

    # -- the queue's thread -------------------------------------------------------------
    def _connect(self) -> Any:
        """The live client, or None; never blocks the queue's thread for long.

        Connecting runs on its own daemon thread, at most every ``reconnect_interval``
        seconds. Before the first connection the queue's thread waits for it (bounded by
        ``connect_timeout``: a worker's first events should not be lost to a connect that
        takes milliseconds); once the store was reached and went away, the queue's thread
        never waits: batches are counted lost at once and the queue stays short.

        Why: with the store down, a queue's thread that sat in each connect attempt (up to
        its timeout) let up to ``max_events`` events pile up; those hundreds of thousands
        of live objects made each full garbage collection, run by whichever thread
        allocates (the caller of ``record()``), take 160-800 ms.
        """
        client = self._client
        if client is not None:
            return client
        if self._gave_up:
            # close() ended a stuck push: a connect now (into a store that accepts and
            # does not answer) would only hold the exiting process longer
            return None
        connector = self._connector
        if connector is None and time.monotonic() >= self._next_connect:
            self._next_connect = time.monotonic() + self.reconnect_interval
            connector = self._connector = threading.Thread(
                target=self._connect_in_background, name=f"eventbus-connect:{self.key}",
                daemon=True)
            connector.start()
        if connector is not None and not self._connected_once and not self._waited:
            # Once: a server that accepts and never answers (not a store) holds the
            # connect for its whole timeout; later batches must not wait on it.
            self._waited = True
            connector.join(self.connect_timeout)
            if self._client is None and not self._connect_error:
                self._connect_error = (f"the store at {self.host}:{self.port} did not "
                                       f"answer within {self.connect_timeout:g} s")
        if self._client is None and self._connect_error:
            error, self._connect_error = self._connect_error, ""
            self._note_loss(0, error)
        return self._client

    def _connect_for_end(self, wait: float) -> None:
        # Attempts every 0.2 s (a closed port fails at once) until one connects or
        # ``wait`` runs out; the queue's thread is stopped by now.
        deadline = time.monotonic() + wait
        while self._client is None and time.monotonic() < deadline:
            if not self._client_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                return  # the queue's thread is still in a store call: no connect for it
            try:
                self._next_connect = 0.0
                self._connect()
                connector = self._connector
            finally:
                self._client_lock.release()
            if connector is not None:
                connector.join(max(0.0, deadline - time.monotonic()))
            if self._client is None:
                time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))

    def _connect_in_background(self) -> None:
        try:
            client = QueueClient(self.host, self.port, timeout=self.connect_timeout)
        except Exception as exc:
            self._connect_error = (f"cannot connect to the store at {self.host}:{self.port}: "
                                   f"{_first_line(exc)}")
        else:
            # the client's own socket, so that close() can end a push stuck in it
            self._client_fds = frozenset({client.fileno()})
            self._client = client
            self._connected_once = True
        finally:
            self._connector = None

    def _push_batch(self, events: Sequence[Event], *, end: bool = False,
                    connect: bool = True, lock_timeout: float | None = None) -> bool:
        """Push ``events`` (the queue's thread), or the end marker (``close``). The client
        lock is waited for ``lock_timeout`` seconds at most when given (``close``: the
        queue's thread may sit in a store call that has not returned), else as long as it
        takes. False when the lock was not had in time (nothing pushed)."""
        if not self._client_lock.acquire(timeout=-1 if lock_timeout is None
                                         else max(0.0, lock_timeout)):
            return False
        try:
            self._push_locked(events, end=end, connect=connect)
        finally:
            self._client_lock.release()
        return True

    def _end_stuck_push(self, waited: float) -> None:
        """The queue's thread has been in a store call for the whole close: a push into a
        socket the store no longer reads (bounded only by ``connect_timeout``, longer than
        what is left of the close). Shut that socket down, so the call fails now and the
        thread is out of it before the interpreter finalizes. The end marker is given up
        either way (the ledger says so), and no connection is made after this one."""
        self._gave_up = True
        shut = 0
        for fd in self._client_fds:
            try:
                sock = socket.socket(fileno=fd)
            except OSError:
                continue
            try:
                sock.shutdown(socket.SHUT_RDWR)
                shut += 1
            except OSError:
                pass
            finally:
                sock.detach()  # the descriptor stays the client's to close
        left = shut > 0 and self._client_lock.acquire(timeout=END_MARKER_LOCK_WAIT)
        if left:
            self._client_lock.release()
        self._note_loss(0, f"the store client was still busy with a push {waited:.1f} s into "
                        "the close; the end marker was not pushed" + (
                            "" if left else " (the push was left in flight: this process "
                            "may abort if the store answers while it exits)"), force=True)

    def _push_locked(self, events: Sequence[Event], *, end: bool, connect: bool) -> None:
        """:meth:`_push_batch`'s work, with the client lock held."""
        if self._ended:
            self._note_loss(len(events), "forwarder already ended")
            return
        dropped = dict(self.sink.dropped)
        if connect and events and self._connect() is None:
            # The store is away: number the batch (the receiver sees the gap if the
            # store comes back) without encoding it, and let it go at once.
            self.encoder.seq += len(events)
            self._note_loss(len(events), "store unreachable")
            return
        try:
            pushes = self.encoder.encode(events, dropped=dropped, end=end)
        except Exception as exc:  # never expected; do not let the thread die
            self.encoder.seq += len(events)
            self._note_loss(len(events), f"encoding failed: {exc!r}")
            return
        for value, n in pushes:
            client = self._connect() if connect else self._client
            if client is None:
                self._note_loss(n, "store unreachable")
                continue
            try:
                client.queue_push(self.key, value)
            except Exception as exc:
                self._client = None
                self._client_fds = frozenset()  # closed with it: the numbers get reused
                self._next_connect = 0.0  # the first reconnect at once, then paced
                self._note_loss(n, f"queue_push failed: {_first_line(exc)}")
            else:
                self._pushes += 1
                self._pushed_events += n
                if self.bell is not None:
                    # a hint: if it is lost, the receiver's next poll finds the push
                    with contextlib.suppress(Exception):
                        client.queue_push(self.bell, self._ring)
        if end:
            self._ended = True

    def _note_loss(self, n: int, reason: str, *, force: bool = False) -> None:
        """Count ``n`` events lost for ``reason`` and report it, at most once per
        ``report_interval`` unless ``force`` (a note at close: no later one would carry
        it)."""
        if n:
            self.lost[reason] = self.lost.get(reason, 0) + n
        held = self._loss_report.allow(self.settings.report_interval, n, force=force)
        if held is None:
            return
        new, total = held + n, sum(self.lost.values())
        counted = f"; {new} events lost since the last report ({total} in all)" if total else ""
        logger.warning("store forwarder %s -> %s: %s%s; the receiver reports the gap if the "
                       "store comes back", self.sender, self.key, reason, counted)

    # -- control ------------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        """Push everything queued so far; False if ``timeout`` ran out first."""
        return self.sink.flush(self.settings.close_timeout if timeout is None else timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Flush, stop the queue's thread, push the end marker. Idempotent.

        Returns True when everything recorded before the call was pushed.
        """
        budget = self.settings.close_timeout if timeout is None else timeout
        deadline = time.monotonic() + budget
        if self.subscription is not None:
            self.subscription.cancel()
            self.subscription = None
        done = self.sink.close(max(0.0, deadline - time.monotonic()))
        if self.counter is not None and self._pid == os.getpid():
            # the queue has stopped: nothing counts into the mapping any more
            self.sink.count_into(None)
            self.counter.close()
        # A process that never sent anything (a forked child that recorded nothing) has
        # nothing to end: no connection just for the marker.
        sent = self.encoder.seq > 0 or any(self.sink.dropped.values())
        if sent and self._pid == os.getpid():
            # Before the end marker: its reconnect may outlast a SIGKILL deadline.
            self._write_ledger()
        if not self._ended and self._pid == os.getpid() and sent:
            # The end marker carries the numbering, so the receiver can count what the
            # outage cost: one more connect for it, within what is left of the budget
            # (at most END_CONNECT_WAIT: a dead store must not hold an exiting process).
            if self._client is None and self._connected_once and not self._gave_up:
                self._connect_for_end(min(END_CONNECT_WAIT, deadline - time.monotonic()))
            # Bounded: the queue's thread, stopped by now or left behind by the close
            # above, may still sit in a store call (a store that stopped answering)
            # holding the client; the ledger already says whether the marker went out.
            if not self._push_batch([], end=True, connect=False, lock_timeout=max(
                    END_MARKER_LOCK_WAIT, deadline - time.monotonic())):
                self._end_stuck_push(time.monotonic() - (deadline - budget))
        return done and not self.lost

    def _write_ledger(self) -> None:
        """Leave the exit ledger (once; never raises: exiting must not fail on it)."""
        directory = self.ledger_dir
        if directory is None or self.ledger is not None:
            return
        ledger = ExitLedger(sender=self.sender, key=self.key, numbered=self.encoder.seq,
                            dropped={k: v for k, v in self.sink.dropped.items() if v},
                            end_pushed=self._ended, pid=os.getpid())
        try:
            self.ledger = write_ledger(directory, ledger)
        except Exception as exc:
            logger.warning("store forwarder %s: cannot write its exit ledger in %s: %s; a "
                           "loss the store cannot report will not be reported",
                           self.sender, directory[:200], exc)

    def stats(self) -> dict[str, Any]:
        """The queue's counts plus pushes, pushed events, lost events (per reason)."""
        out = self.sink.stats()
        out.update(sender=self.sender, key=self.key, pushes=self._pushes,
                   pushed=self._pushed_events, lost=dict(self.lost), next_seq=self.encoder.seq)
        return out

    def _after_fork_in_child(self) -> None:
        self._reset()

    def __repr__(self) -> str:
        return f"<StoreForwarder {self.sender} -> {self.host}:{self.port} {self.key}>"


def _first_line(exc: BaseException) -> str:
    # one line is the reason (and a stable key for StoreForwarder.lost); c10d's errors
    # carry a C++ backtrace of ~20 lines
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _socket_fds() -> frozenset[int]:
    """This process's socket descriptors (Linux's /proc/self/fd; empty elsewhere)."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return frozenset()
    fds = set()
    for name in names:
        with contextlib.suppress(OSError, ValueError):
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                fds.add(int(name))
    return frozenset(fds)


def _new_sockets_to(before: frozenset[int], port: int) -> frozenset[int]:
    """The sockets opened since ``before`` whose peer's port is ``port``: a store client's
    connection, made in between (another thread connecting to the same port at that very
    moment would be counted too; it is shut down only by a close that gave up)."""
    found = set()
    for fd in _socket_fds() - before:
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            peer = sock.getpeername()
        except OSError:
            continue
        finally:
            sock.detach()
        if isinstance(peer, tuple) and len(peer) >= 2 and peer[1] == port:
            found.add(fd)
    return frozenset(found)


_forwarders: weakref.WeakSet[StoreForwarder] = weakref.WeakSet()
#: the forwarder attach_worker_forwarder() attached in this process, if any
_worker_forwarder: StoreForwarder | None = None


def _after_fork_in_child() -> None:
    for fwd in list(_forwarders):
        fwd._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def attach_worker_forwarder(*, host: str, port: int, prefix: str, rank: int,
                            ledger_dir: str | None = None,
                            bell: str | None = None) -> StoreForwarder:
    """Attach this process's worker forwarder: every event of the default bus goes to the
    queue of ``rank`` under the attempt's key ``prefix`` of the store at ``host:port``.

    The worker bootstrap (:mod:`eventbus.app.worker`) calls it with what the launcher's
    environment says, checked there; the exit hooks
    (:mod:`eventbus.subscribers.worker_exit`) flush it. Calling it again returns the same
    forwarder.
    """
    global _worker_forwarder
    if _worker_forwarder is not None:
        return _worker_forwarder
    # No torch here, in record() or on the queue's thread: the client is the socket-level
    # QueueClient (eventbus.store_client), so the first record() of a script that has not imported
    # torch yet returns at once and its events leave while the script imports it.
    # create_connection() encodes the host with the "idna" codec, whose first lookup imports
    # encodings.idna: done on the connect thread while the main thread forks DataLoader
    # workers or imports, that lookup failed now and then ("unknown encoding: idna") and the
    # process never reached its store; this module imports it up front instead.
    _worker_forwarder = StoreForwarder(host=host, port=port, key=worker_key(prefix, rank),
                                       rank=rank, kind="w", ledger_dir=ledger_dir, bell=bell)
    return _worker_forwarder


def worker_forwarder() -> StoreForwarder | None:
    """The forwarder :func:`attach_worker_forwarder` attached in this process, if any."""
    return _worker_forwarder
