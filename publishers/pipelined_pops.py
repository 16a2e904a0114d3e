"""One round of pipelined pops: how :class:`eventbus.publishers.store_receiver.StoreReceiver`
empties many queues with few store round trips (``pipelined=True``).

:class:`PipelinedPops` owns the receiver's :class:`eventbus.store_client.QueueClient`
(made at the first round, made again after a failure at most once per
``reconnect_interval``). :meth:`PipelinedPops.round` asks the length of every due queue in
one write (:data:`MAX_PIPELINED_LENGTHS` at a time), reads the answers as a stream, then
sends exactly as many pops as each queue holds values, in batches of one write each
(:data:`MAX_PIPELINED_POPS`, or :data:`MAX_HELD_POPS` when a ``hold`` is asked before each
batch). Each pop's answer says how many values its queue still holds, so a queue pushed
to meanwhile gets more pops in the same round. An idle queue costs one length in a shared
write (about a microsecond of the receiver's CPU) instead of a pop's round trip.

The round decodes nothing and schedules nothing: it hands each value to ``handle`` and
returns what the receiver needs to schedule the next (:class:`Round`). It runs under the
receiver's lock.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from collections.abc import Sequence
from typing import Protocol
from typing import TypeVar

import attrs

from eventbus.store_client import QueueClient

__all__ = ["MAX_HELD_POPS", "MAX_PIPELINED_LENGTHS", "MAX_PIPELINED_POPS", "PipelinedPops",
           "Round"]

#: a round asks at most this many queues' lengths in one write, and sends at most this
#: many pops in one write ...
MAX_PIPELINED_LENGTHS = 4096
MAX_PIPELINED_POPS = 256
#: ... or this many with a ``hold``, asked again before each batch: a node's push holds up
#: to 4,000 events, the agent's JSONL queue is held from half of its 100,000 on
MAX_HELD_POPS = 8


class Keyed(Protocol):
    """A queue as the round sees it: its key (the receiver's own record of it goes back
    to ``handle`` as it came)."""

    key: str


Q = TypeVar("Q", bound=Keyed)


@attrs.define
class Round:
    """What one round did: values popped; per queue key reached, the values it gave
    (``got``) and what its last answer said is left (``left``); the keys still wanting
    pops when it ended (``queued``: the round's time was up, or ``hold`` held);
    ``holds`` (0 or 1) and ``held``; ``error``: the store failure that ended it (the
    values popped and not read yet are gone from the store: their senders' numbering
    reports them as a gap)."""

    popped: int = 0
    got: dict[str, int] = attrs.Factory(dict)
    left: dict[str, int] = attrs.Factory(dict)
    queued: set[str] = attrs.Factory(set)
    held: bool = False
    error: Exception | None = None


class PipelinedPops:
    """The pipelined client of one receiver, and its rounds (see the module's docstring)."""

    def __init__(self, host: str, port: int, *, connect_timeout: float,
                 reconnect_interval: float) -> None:
        self.host = host
        self.port = port
        self.connect_timeout = connect_timeout
        self.reconnect_interval = reconnect_interval
        #: the connection, None until the first round and after a failure
        self.client: QueueClient | None = None
        self._next_connect = 0.0

    def _connected(self, now: float) -> QueueClient | None:
        """The client, made now if it is time to (raises what connecting raised)."""
        if self.client is None:
            if now < self._next_connect:
                return None
            self._next_connect = now + self.reconnect_interval
            self.client = QueueClient(self.host, self.port, timeout=self.connect_timeout)
        return self.client

    def round(self, due: Sequence[Q], *, limit: int, hold: Callable[[], object] | None,
              ends: float, now: float, handle: Callable[[Q, bytes], object]) -> Round:
        """Pop every queue of ``due`` until it is emptied, has given ``limit`` values,
        ``hold`` holds, or ``ends`` (monotonic) passed once something was popped; each
        value goes to ``handle(queue, value)``. A failure closes the client and ends the
        round with ``error`` set (never raised)."""
        result = Round()
        try:
            popper = self._connected(now)
        except Exception as exc:
            result.error = exc
            return result
        if popper is None:
            return result
        limit = max(1, limit)
        step = MAX_PIPELINED_POPS if hold is None else MAX_HELD_POPS
        got, left, queued = result.got, result.left, result.queued
        #: queues with pops to make: (queue, how many)
        wanted: collections.deque[tuple[Q, int]] = collections.deque()
        try:
            for first in range(0, len(due), MAX_PIPELINED_LENGTHS):
                part = due[first:first + MAX_PIPELINED_LENGTHS]
                for queue, n in zip(part, popper.lengths([q.key for q in part]), strict=True):
                    left[queue.key] = n
                    if n > 0:
                        wanted.append((queue, min(n, limit)))
                        queued.add(queue.key)
            while wanted:
                if result.popped and time.monotonic() >= ends:
                    break  # the round's time is up: what is left is due again at once
                if hold is not None and hold():
                    result.held = True  # a sink downstream is behind: the rest waits
                    break
                batch: list[tuple[Q, int]] = []
                pops = 0
                while wanted and pops < step:
                    queue, n = wanted.popleft()
                    take = min(n, step - pops)
                    batch.append((queue, take))
                    pops += take
                    if take < n:
                        wanted.appendleft((queue, n - take))
                    else:
                        queued.discard(queue.key)
                answers = popper.pop_many([queue.key for queue, n in batch for _ in range(n)])
                for queue, n in batch:
                    key = queue.key
                    for _ in range(n):
                        length, raw = next(answers)
                        if raw is None:
                            left[key] = 0
                            continue
                        left[key] = length - 1
                        got[key] = got.get(key, 0) + 1
                        result.popped += 1
                        handle(queue, raw)
                    more = min(left[key], limit - got.get(key, 0))
                    if more > 0 and key not in queued:  # pushed to since its length
                        wanted.append((queue, more))
                        queued.add(key)
        except Exception as exc:
            self.close()
            result.error = exc
        return result

    def close(self) -> None:
        """Drop the connection (the next round makes a new one)."""
        client, self.client = self.client, None
        if client is not None:
            client.close()
