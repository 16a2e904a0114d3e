"""Job-wide notices: what the agents decide, told to every worker on every node.

One log per job in the job's long-lived c10d store (the rendezvous store every agent and
worker already reaches): a counter ``<root>/n`` and one key per notice, ``<root>/<seq>``
(seq from 1), holding the event's ``to_json()``. An agent appends with :func:`append`
(``add`` on the counter, then ``set`` of the entry: one round trip each); every reader
blocks in the store's own ``wait`` on the next entry's key, so a reader costs no CPU and
no wake-up while nothing is told, and hears a notice within a round trip of its ``set``.

* which events are notices: :func:`is_notice` (``PREEMPTING``; a worker's own failure,
  ``WORKER_STALLED`` and ``WORKER_SLOW``), each appended by the agent that decided it;
* where a reader starts: the agent reads the counter at each rendezvous, before it starts
  the attempt's workers, and gives them that position (:data:`ENV_NOTICE_FROM`): a worker
  hears each notice told after its attempt began exactly once, and none told before it;
  a notice about an earlier attempt (a late report of its failures) is not delivered
  (:func:`stale`);
* the drain's agreement on a stop step (:func:`drain_keys`), under the ``PREEMPTING``
  notice's own seq: each rank's promise, a counter of promises, the stop step.

Both ends import this module; it imports no torch (the store client is made by the
caller, with :func:`eventbus.store_client.connect_store`).
"""

from __future__ import annotations

import contextlib
import datetime
import socket
from collections.abc import Callable
from typing import Any

from eventbus.events import Event
from eventbus.events import EventType
from eventbus.events import WorkerExit

__all__ = [
    "ENV_NOTICES",
    "ENV_NOTICE_FROM",
    "LEFT",
    "SKIP",
    "WAIT_S",
    "WaitingClient",
    "append",
    "counter_key",
    "drain_keys",
    "entry_key",
    "head",
    "is_notice",
    "notice_root",
    "read_entry",
    "stale",
]

#: the log's root key (``eventbus/notices/<run id>``), set by the agent for its workers
ENV_NOTICES = "EVENTBUS_NOTICES"
#: the last seq a worker of this attempt must not hear (the counter when it began)
ENV_NOTICE_FROM = "EVENTBUS_NOTICE_FROM"

#: how long a reader blocks in one ``wait`` before it looks for a gap (an agent that died
#: between its ``add`` and its ``set``): one wake-up every ten minutes at most
WAIT_S = 600.0

#: the types an agent tells every worker (WORKER_EXIT: only a failure of its own)
NOTICE_TYPES = frozenset({EventType.PREEMPTING, EventType.WORKER_EXIT,
                          EventType.WORKER_STALLED, EventType.WORKER_SLOW,
                          EventType.HOST_EVICTED})


def notice_root(run_id: str) -> str:
    return f"eventbus/notices/{run_id}"


def counter_key(root: str) -> str:
    return f"{root}/n"


def entry_key(root: str, seq: int) -> str:
    return f"{root}/{seq}"


def drain_keys(root: str, seq: int, world_size: int) -> dict[str, Any]:
    """The agreement's keys for the drain told as notice ``seq``."""
    base = f"{root}/drain/{seq}"
    return {"count": f"{base}/count", "stop": f"{base}/stop",
            "promises": [f"{base}/promise/{rank}" for rank in range(world_size)]}


def is_notice(event: Event) -> bool:
    """Whether an agent tells ``event`` to every worker: ``PREEMPTING``, a worker's failure
    of its own (not one the agent stopped), ``WORKER_STALLED``, ``WORKER_SLOW``,
    ``HOST_EVICTED``."""
    kind = type(event).type
    if kind not in NOTICE_TYPES:
        return False
    if isinstance(event, WorkerExit):
        return event.exit_code != 0 and not event.data.get("stopped_by_agent")
    return True


def stale(event: Event, attempt: int | None) -> bool:
    """A notice about an earlier attempt than the reader's (``PREEMPTING`` never is)."""
    if type(event).type == EventType.PREEMPTING or attempt is None:
        return False
    told = event.context.restart_count
    return told is not None and told < attempt


def head(client: Any, root: str) -> int:
    """The seq of the last notice appended so far (0: none)."""
    return int(client.add(counter_key(root), 0))


#: an entry that a leaving reader put where it waited (:meth:`WaitingClient.wake`): not a
#: notice; readers skip it, and a writer whose seq it took appends at the next one
LEFT = b"-"


def append(client: Any, root: str, event: Event) -> int:
    """Append ``event`` to the log; returns its seq. The entry is inserted only where none
    is (``compare_set`` with an empty expected value): a seq that a leaving reader claimed
    with :data:`LEFT` is passed over."""
    payload = event.to_json().encode("utf-8")
    for _ in range(1000):
        seq = int(client.add(counter_key(root), 1))
        if bytes(client.compare_set(entry_key(root, seq), b"", payload)) == payload:
            return seq
    raise RuntimeError("no free seq in the notice log after 1,000 tries")


def read_entry(client: Any, root: str, seq: int, *,
               timeout: float = WAIT_S) -> Event | _Skip | None:
    """Block until notice ``seq`` exists (at most ``timeout``) and return it; None when
    the wait timed out, :data:`SKIP` for a seq that holds no notice. Raises what the
    store raises when it is gone, and ``ValueError`` or ``TypeError`` for an entry that is
    not an event."""
    key = entry_key(root, seq)
    try:
        client.wait([key], datetime.timedelta(seconds=timeout))
    except Exception as exc:
        if "timeout" in str(exc).lower() and not client.check([key]):
            return None
        if not client.check([key]):
            raise
    raw = bytes(client.get(key))
    if raw == LEFT:
        return SKIP
    return Event.from_json(raw.decode("utf-8"))


class _Skip:
    """A seq with no notice (a leaving reader's :data:`LEFT`): go on to the next."""


#: what :func:`read_entry` returns for a seq that holds no notice
SKIP = _Skip()


class WaitingClient:
    """A store client for a thread that blocks in ``wait``, and the way to end that wait
    cleanly from another thread. A thread still in a c10d call when the interpreter
    finalizes is ended by ``pthread_exit`` inside it, and the process aborts ("terminate
    called without an active exception"), as an agent's did when the store's host exited
    first. :meth:`wake` puts :data:`LEFT` where the thread waits (a second, short-lived
    client; the wait returns as for a notice, and c10d prints nothing); :meth:`shut`, the
    fallback when the store cannot be reached, shuts the waiting socket down (the wait
    fails at once, c10d prints its warnings). ``connect()`` makes a client; ``port``
    finds the waiting client's socket."""

    def __init__(self, connect: Callable[[], Any], port: int) -> None:
        from eventbus.subscribers.store_forwarder import _new_sockets_to
        from eventbus.subscribers.store_forwarder import _socket_fds

        self._connect = connect
        before = _socket_fds()
        self.client = connect()
        self.fds = _new_sockets_to(before, port)
        self.shut_down = False

    def wake(self, key: str) -> bool:
        """End a wait on ``key``: insert :data:`LEFT` there unless a notice is there
        already (either ends the wait). False when the store could not be reached."""
        try:
            other = self._connect()
            other.compare_set(key, b"", LEFT)
        except Exception:
            return False
        return True

    def shut(self) -> None:
        """End any call in progress on this client, now and from now on."""
        self.shut_down = True
        for fd in self.fds:
            try:
                sock = socket.socket(fileno=fd)
            except OSError:
                continue
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.detach()
