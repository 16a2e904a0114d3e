"""Ship a process's events to its agent through the job's c10d store.

In a worker started by ``eventbus run``, ``import eventbus`` attaches a
:class:`StoreForwarder` to the default bus (see :func:`attach_from_env`): every event goes
into a bounded :class:`~subscribers.queued.QueuedSink`, whose thread encodes batches and
``queue_push``-es them to a key of the long-lived rendezvous store namespaced by run id,
attempt and rank. The agent's :class:`publishers.store_receiver.StoreReceiver` pops them
and republishes them on its bus. The agents of the other nodes use the same forwarder
(``kind="n"``) to ship a filtered view of their bus to group rank 0.

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
  events plus one in-flight batch, is lost, and nothing follows it to reveal the gap; the
  agent logs that the sender never sent its end marker. (``os._exit`` in a worker flushes
  first, within :data:`OS_EXIT_FLUSH_TIMEOUT`.)

Exit ledger: given ``ledger_dir`` (a worker gets its agent's per-attempt directory from
``EVENTBUS_LEDGER_DIR``), :meth:`StoreForwarder.close` also leaves one small local file,
``<sender>.json`` (:class:`eventbus.wire.ExitLedger`: its queue, how many events it
numbered, its drops per reason), written once and atomically before it tries the end
marker. The agent reads it before it exits, so that a loss the store cannot report (the
store died) is still reported as ``EVENTS_LOST`` with its true count. ``record()`` never
pays for it.
"""

from __future__ import annotations

import atexit
import contextlib
import encodings.idna  # noqa: F401  (see _probe_port)
import logging
import os
import signal
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable
from collections.abc import Sequence
from types import FrameType
from typing import Any
from typing import NoReturn

from eventbus._reporting import RateLimiter
from eventbus.bus import ALL
from eventbus.bus import Bus
from eventbus.bus import Subscription
from eventbus.bus import get_default_bus
from eventbus.events import Event
from eventbus.wire import ENV_BELL
from eventbus.wire import ENV_LEDGER_DIR
from eventbus.wire import ENV_PREFIX
from eventbus.wire import ENV_STORE
from eventbus.wire import BatchEncoder
from eventbus.wire import ExitLedger
from eventbus.wire import SenderKind
from eventbus.wire import connect_store
from eventbus.wire import worker_key
from eventbus.wire import write_ledger
from subscribers.queued import QueuedSink
from subscribers.queued import QueueSettings

__all__ = [
    "END_CONNECT_WAIT",
    "FORWARDER_QUEUE",
    "OS_EXIT_FLUSH_TIMEOUT",
    "StoreForwarder",
    "attach_from_env",
    "install_exit_hooks",
]

logger = logging.getLogger("eventbus")

# -- the forwarder -----------------------------------------------------------------------


#: the longest close() waits for a reconnect to push the end marker after an outage
END_CONNECT_WAIT = 10.0

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
      ledger (default: none);
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

        Why: with the store down, the queue's thread used to sit in ``TCPStore(...)``
        (seconds per attempt, whatever its timeout) while up to ``max_events`` events piled
        up; those hundreds of thousands of live objects made each full garbage collection,
        run by whichever thread allocates (the caller of ``record()``), take 160-800 ms.
        """
        client = self._client
        if client is not None:
            return client
        connector = self._connector
        if connector is None and time.monotonic() >= self._next_connect:
            self._next_connect = time.monotonic() + self.reconnect_interval
            connector = self._connector = threading.Thread(
                target=self._connect_in_background, name=f"eventbus-connect:{self.key}",
                daemon=True)
            connector.start()
        if connector is not None and not self._connected_once and not self._waited:
            # Once: a server that accepts and never answers (not a store) keeps
            # TCPStore(...) hanging past its timeout; later batches must not wait on it.
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
            with self._client_lock:
                self._next_connect = 0.0
                self._connect()
                connector = self._connector
            if connector is not None:
                connector.join(max(0.0, deadline - time.monotonic()))
            if self._client is None:
                time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))

    def _connect_in_background(self) -> None:
        try:
            _probe_port(self.host, self.port, timeout=self.connect_timeout)
            client = connect_store(self.host, self.port, timeout=self.connect_timeout)
        except Exception as exc:
            self._connect_error = (f"cannot connect to the store at {self.host}:{self.port}: "
                                   f"{_first_line(exc)}")
        else:
            self._client = client
            self._connected_once = True
        finally:
            self._connector = None

    def _push_batch(self, events: Sequence[Event], *, end: bool = False,
                    connect: bool = True) -> None:
        with self._client_lock:
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

    def _note_loss(self, n: int, reason: str) -> None:
        if n:
            self.lost[reason] = self.lost.get(reason, 0) + n
        held = self._loss_report.allow(self.settings.report_interval, n)
        if held is None:
            return
        new, total = held + n, sum(self.lost.values())
        logger.warning("store forwarder %s -> %s: %s; %d events lost since the last report "
                       "(%d in all); the receiver reports the gap if the store comes back",
                       self.sender, self.key, reason, new, total)

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
            if self._client is None and self._connected_once:
                self._connect_for_end(min(END_CONNECT_WAIT, deadline - time.monotonic()))
            self._push_batch([], end=True, connect=False)
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


def _plain_key(prefix: str) -> bool:
    # A key prefix as the launcher writes it ("eventbus/<run id>/<attempt>"): printable,
    # bounded, no "..": an inherited value that is none of these is not ours.
    return 0 < len(prefix) <= 512 and prefix.isprintable() and ".." not in prefix.split("/")


def _plain_dir(path: str) -> bool:
    # The agent names an absolute, printable path it created (".../eventbus-ledgers-*/
    # attempt-<n>"); anything else is not ours, and a worker must not drop files there.
    if not (0 < len(path) <= 4096 and path.isprintable() and os.path.isabs(path)):
        return False
    head, name = os.path.split(os.path.normpath(path))
    return (name.startswith("attempt-") and os.path.basename(head).startswith(
        "eventbus-ledgers-") and os.path.isdir(path))


def _first_line(exc: BaseException) -> str:
    # c10d's errors carry a C++ backtrace of ~20 lines: one line is the reason (and a
    # stable key for StoreForwarder.lost)
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


#: how long the probe listens for a server that speaks first (a store never does)
_PROBE_LISTEN_S = 0.05


def _probe_port(host: str, port: int, *, timeout: float) -> None:
    """Raise ``OSError`` unless something accepts TCP connections at ``host:port``.

    A plain socket connect, which fails at once on a closed port; ``TCPStore(...)`` would
    retry for seconds, past its own timeout (measured with torch 2.13: 2-4 s for 1 s).
    """
    # create_connection() encodes the host with the "idna" codec, whose first lookup imports
    # encodings.idna: done in a connect thread while the main thread forks DataLoader
    # workers or imports, that lookup failed now and then ("unknown encoding: idna") and
    # the process never reached its store. The module imports it up front instead.
    with socket.create_connection((host, port), timeout=timeout) as sock:
        # A c10d store says nothing until the client speaks. A server that speaks first
        # or hangs up is not one, and TCPStore(...) on it retries in C++ past its timeout
        # and can abort the process at exit (seen with torch 2.13): refuse it here.
        sock.settimeout(_PROBE_LISTEN_S)
        try:
            first = sock.recv(1)
        except TimeoutError:
            return
        except OSError as exc:
            raise ConnectionError(f"not a c10d store: {exc}") from None
        raise ConnectionError("not a c10d store: it " + ("spoke first" if first else
                                                         "hung up at once"))


_forwarders: weakref.WeakSet[StoreForwarder] = weakref.WeakSet()
#: the forwarder attached by attach_from_env() in this process, if any
_worker_forwarder: StoreForwarder | None = None


def _after_fork_in_child() -> None:
    for fwd in list(_forwarders):
        fwd._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# -- exit hooks (workers) ----------------------------------------------------------------

_previous_sigterm: Any = None
_hooks_installed = False


def _close_worker_forwarder(timeout: float | None = None) -> None:
    fwd = _worker_forwarder
    if fwd is not None and fwd._pid == os.getpid():
        try:
            fwd.close(timeout)
        except Exception:
            logger.exception("closing the store forwarder failed")


def _lock_free(fwd: StoreForwarder) -> bool:
    # The SIGTERM handler runs in the main thread between two bytecodes, possibly inside
    # QueuedSink.__call__ with its lock held. The lock is re-entrant, so acquiring it here
    # would succeed, and a flush would then wait (releasing it) while the interrupted
    # enqueue is half done: never flush inline then. The queue's own thread holds the
    # lock only for a few pops, so a short wait tells the other case.
    lock = fwd.sink._cond
    if lock._is_owned():  # type: ignore[attr-defined]  # Condition's, for its RLock
        return False
    if lock.acquire(timeout=0.2):
        lock.release()
        return True
    return False


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    fwd = _worker_forwarder
    previous = _previous_sigterm
    chained = callable(previous)
    if fwd is not None and fwd._pid == os.getpid():
        if _lock_free(fwd):
            if chained:
                fwd.flush()
            else:
                _close_worker_forwarder()
        elif not chained:
            # Finish on a helper thread once the interrupted frame released the lock;
            # the helper ends the process the way SIGTERM would have.
            threading.Thread(target=_close_and_die, args=(signum, previous),
                             name="eventbus-sigterm", daemon=True).start()
            return
    if chained:
        previous(signum, frame)
        return
    _die(signum, previous)


def _close_and_die(signum: int, previous: Any) -> None:
    _close_worker_forwarder()
    _die(signum, previous)


def _die(signum: int, previous: Any) -> None:
    if previous == signal.SIG_IGN:
        return
    # The default action: end the process by the signal, as if no handler were installed.
    with contextlib.suppress(Exception):
        signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    time.sleep(1.0)
    _real_os_exit(128 + signum)


def _register_mp_finalizer(_: object = None) -> None:
    # multiprocessing children (DataLoader workers) leave through os._exit after running
    # multiprocessing's own finalizers, never through atexit. Their finalizer registry
    # is cleared at the child's start, then the after-fork callbacks run: register there.
    import multiprocessing.util

    multiprocessing.util.Finalize(None, _close_worker_forwarder, exitpriority=100)


_real_os_exit = os._exit
#: the budget of the flush in os._exit (the process asked to end at once)
OS_EXIT_FLUSH_TIMEOUT = 2.0


def _os_exit_flushing(status: int) -> NoReturn:
    """``os._exit`` that first pushes what the worker's forwarder still holds."""
    with contextlib.suppress(BaseException):
        _close_worker_forwarder(OS_EXIT_FLUSH_TIMEOUT)
    _real_os_exit(status)


def install_exit_hooks() -> None:
    """Flush and end the worker's forwarder on normal exit, ``sys.exit``, SIGTERM (chaining
    the handler installed before), ``os._exit`` (within :data:`OS_EXIT_FLUSH_TIMEOUT`) and
    the exit of a multiprocessing child. Idempotent."""
    global _hooks_installed, _previous_sigterm
    if _hooks_installed:
        return
    _hooks_installed = True
    atexit.register(_close_worker_forwarder)
    # Failing workers often leave by os._exit (to skip teardown that would hang); it
    # runs no atexit hook, so without this their last ~20 ms of events would be lost.
    os._exit = _os_exit_flushing
    if threading.current_thread() is threading.main_thread():
        try:
            _previous_sigterm = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, _on_sigterm)
        except (ValueError, OSError):  # not allowed here (embedded interpreter)
            logger.warning("eventbus: cannot install a SIGTERM handler; events queued when "
                           "the agent stops this worker may be lost")
    if "multiprocessing" in sys.modules:
        import multiprocessing.util

        multiprocessing.util.register_after_fork(_register_mp_finalizer,
                                                 _register_mp_finalizer)


def attach_from_env(environ: dict[str, str] | None = None) -> StoreForwarder | None:
    """Attach the worker forwarder described by the launcher's environment variables.

    ``EVENTBUS_AGENT_STORE=host:port`` and ``EVENTBUS_STORE_PREFIX`` (the attempt's key
    namespace), and ``EVENTBUS_STORE_BELL`` (the agent's doorbell, optional); the worker's
    rank comes from ``RANK``. Returns the forwarder, or None (with
    a warning) when the variables are unusable. Calling it again returns the same one.
    """
    global _worker_forwarder
    if _worker_forwarder is not None:
        return _worker_forwarder
    env = os.environ if environ is None else environ
    address = env.get(ENV_STORE, "")
    prefix = env.get(ENV_PREFIX, "")
    host, _, port_text = address.rpartition(":")
    try:
        port = int(port_text)
        rank = int(env.get("RANK", ""))
    except ValueError:
        port = rank = -1
    if not host or not 0 < port < 65_536 or not 0 <= rank < 2**31 or not _plain_key(prefix):
        logger.warning("eventbus: %s=%r, %s=%r, RANK=%r do not describe a store to forward "
                       "to (expected host:port, a key prefix and an int rank); this worker's "
                       "events stay in this process", ENV_STORE, address[:200], ENV_PREFIX,
                       prefix[:200], env.get("RANK", "")[:200])
        return None
    # Import torch now, in the importing thread: the queue's thread must not race the
    # training script's own `import torch`.
    import torch.distributed  # noqa: F401

    ledger_dir = env.get(ENV_LEDGER_DIR) or None
    if ledger_dir is not None and not _plain_dir(ledger_dir):
        logger.warning("eventbus: %s=%r is not an absolute directory; this worker leaves no "
                       "exit ledger", ENV_LEDGER_DIR, ledger_dir[:200])
        ledger_dir = None
    bell = env.get(ENV_BELL) or None
    if bell is not None and not _plain_key(bell):
        logger.warning("eventbus: %s=%r is not a store key; this worker's events reach the "
                       "agent at its next poll", ENV_BELL, bell[:200])
        bell = None
    _worker_forwarder = StoreForwarder(host=host, port=port, key=worker_key(prefix, rank),
                                       rank=rank, kind="w", ledger_dir=ledger_dir, bell=bell)
    install_exit_hooks()
    return _worker_forwarder
