"""Bring worker events (and other nodes' events) into the agent, from the job's c10d store.

:class:`StoreReceiver` drains queues of the wire format that
:mod:`subscribers.store_forwarder` pushes, with its own store client and non-blocking
``queue_pop`` calls only (a blocking pop would stall every other call on a shared client),
decodes them as JSON (never pickle), validates every event against its type, and
republishes them on a bus. Sequence gaps, duplicates and the sender's own drops become
``EVENTS_LOST`` events; malformed input is counted per reason and reported the same way,
and never stops the receiver.

:class:`StoreTransport` is the agent plugin that ``eventbus run`` loads: two-level fan-in.

* every agent drains the queues of its own workers (one per global rank and attempt) and
  republishes on its bus (its JSONL, logging handler and reactors see worker events);
* the agent of every other node forwards what ``job_events`` selects of its bus to one
  queue per node; the agent of group rank 0 drains those, one queue per node, so that its
  bus holds the job-wide view.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import attrs

from eventbus.bus import Bus
from eventbus.context import JobContext
from eventbus.context import context_from_dict
from eventbus.encoding import decode_json
from eventbus.events import Event
from eventbus.events import EventsLost
from eventbus.events import EventType
from eventbus.events import event_class
from eventbus.launcher import RendezvousInfo
from eventbus.launcher import register_agent_plugin
from subscribers.store_forwarder import ENV_PREFIX
from subscribers.store_forwarder import ENV_STORE
from subscribers.store_forwarder import WIRE_VERSION
from subscribers.store_forwarder import SenderKind
from subscribers.store_forwarder import StoreForwarder
from subscribers.store_forwarder import connect_store
from subscribers.store_forwarder import namespace
from subscribers.store_forwarder import node_key
from subscribers.store_forwarder import worker_key

__all__ = [
    "ENV_JOB_EVENTS",
    "MAX_VALUE_BYTES",
    "StoreReceiver",
    "StoreTransport",
    "ack_key",
    "job_event_filter",
]

logger = logging.getLogger("eventbus")

#: which event types the other nodes forward to group rank 0 (see :func:`job_event_filter`)
ENV_JOB_EVENTS = "EVENTBUS_JOB_EVENTS"
#: the largest value the receiver decodes; larger ones are rejected unread. (The forwarder
#: pushes at most 4 MiB; the store server itself refuses values over 8 MiB.)
MAX_VALUE_BYTES = 6 * 1024 * 1024
_MAX_SENDER_ID = 256
_MAX_CONTEXTS = 256
_MAX_DROP_REASONS = 32


def ack_key(key: str, sender: str) -> str:
    """Where the receiver acknowledges the end marker of ``sender`` on queue ``key``."""
    return f"{key}/ack/{sender}"


class _Reject(Exception):
    """Input refused, with the reason it is counted under."""

    def __init__(self, reason: str, count: int = 1) -> None:
        super().__init__(reason)
        self.reason = reason
        self.count = count


@attrs.define
class _Sender:
    key: str
    #: the sequence number expected next
    expected: int = 0
    dropped: dict[str, int] = attrs.field(factory=dict)
    ended: bool = False
    delivered: int = 0


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

    Call :meth:`watch` for each queue, then :meth:`start` (a background thread polling
    every ``poll_interval`` seconds while idle) or :meth:`drain_once` by hand.
    ``on_end(key, sender)`` runs when a sender's end marker arrives.
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
    ) -> None:
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
        self._senders: dict[str, _Sender] = {}
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._empty_error: type[BaseException] = _queue_empty_error()
        #: values popped, events delivered
        self.values = 0
        self.delivered = 0
        #: rejected events (or values) per reason
        self.rejected: dict[str, int] = {}
        #: gaps, duplicates and sender-side drops, per reason
        self.lost: dict[str, int] = {}
        self.store_errors = 0
        self._pending_rejects: dict[tuple[str, str], int] = {}
        self._last_flush_rejects = 0.0
        self._last_error_report = -60.0
        self._context_cache: dict[tuple[Any, ...], JobContext] = {}

    # -- queues -------------------------------------------------------------------------
    def watch(self, key: str, *, kind: SenderKind, rank: int) -> None:
        """Drain ``key``, whose senders must be of ``kind`` and ``rank`` (a worker's global
        rank, or a node's group rank). Watching it again cancels a pending retirement."""
        with self._lock:
            self._queues[key] = _Queue(key, kind, rank)

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
        apart; one that gave a value is polled again at once. Idle queues cost the store
        one pop per ``max_idle_interval`` each (see the README's scaling section).
        """
        popped = 0
        with self._lock:
            now = time.monotonic()
            client = self.client if self.client is not None else self._reconnect(now)
            if client is None:
                return 0
            for queue in list(self._queues.values()):
                if not every and now < queue.next_poll:
                    continue
                got = 0
                for _ in range(self.max_pops_per_queue):
                    try:
                        raw = client.queue_pop(queue.key, block=False)
                    except self._empty_error:
                        if queue.retire_at is not None and now >= queue.retire_at:
                            del self._queues[queue.key]
                        break
                    except Exception as exc:
                        self._store_error(exc)
                        return popped
                    got += 1
                    self.handle_value(queue.key, raw, kind=queue.kind, rank=queue.rank)
                if got:
                    queue.idle = 0.0
                    queue.next_poll = now
                else:
                    queue.idle = min(self.max_idle_interval,
                                     max(self.poll_interval, queue.idle * 2))
                    queue.next_poll = now + queue.idle
                popped += got
            self._flush_rejects()
        return popped

    def drain(self, *, timeout: float) -> bool:
        """Drain until every queue is empty or ``timeout`` passes; True if all were empty."""
        deadline = time.monotonic() + timeout
        while True:
            if self.drain_once(every=True) == 0:
                return True
            if time.monotonic() >= deadline:
                return False

    def start(self) -> None:
        """Drain on a background thread until :meth:`stop`."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="eventbus-store-receiver",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                popped = self.drain_once()
            except Exception:  # never let the agent lose its receiver
                logger.exception("store receiver: draining failed; retrying")
                popped = 0
            if not popped:
                self._stop.wait(self.poll_interval)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the background thread (queues are left as they are)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

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
        now = time.monotonic()
        if now - self._last_error_report >= 10.0:
            self._last_error_report = now
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
        except _Reject as rej:
            self._reject(key, rej.reason, rej.count)
        except Exception as exc:  # a bug, not bad input: count it as such, keep going
            self._reject(key, f"receiver error: {type(exc).__name__}", 1)
            logger.exception("store receiver: unexpected error on a value from %s", key)
        return 0

    def _handle(self, key: str, raw: object, kind: SenderKind, rank: int) -> int:
        if not isinstance(raw, (bytes, bytearray)):
            raise _Reject("not bytes")
        if len(raw) > self.max_value_bytes:
            raise _Reject("value too large")
        try:
            text = bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            raise _Reject("not UTF-8") from None
        try:
            if "$float" in text:  # non-finite floats are tagged: revive them
                batch = decode_json(text, max_chars=self.max_value_bytes)
            else:  # the common case: skip the per-object hook (about 40% of the decode)
                batch = json.loads(text, parse_constant=_no_constant)
        except (ValueError, TypeError, RecursionError):
            raise _Reject("not JSON") from None
        if type(batch) is not dict:
            raise _Reject("bad header: not an object")
        if batch.get("v") != WIRE_VERSION:
            raise _Reject("bad header: unknown wire version")
        sender = batch.get("src")
        if type(sender) is not str or not 0 < len(sender) <= _MAX_SENDER_ID:
            raise _Reject("bad header: src")
        first = batch.get("seq")
        if type(first) is not int or first < 0:
            raise _Reject("bad header: seq")
        entries = batch.get("ev")
        if type(entries) is not list:
            raise _Reject("bad header: ev")
        n = len(entries)
        if batch.get("kind") != kind or batch.get("rank") != rank:
            raise _Reject("spoofed sender", max(n, 1))
        end = batch.get("end", False)
        dropped = batch.get("drop", {})
        if type(end) is not bool:
            raise _Reject("bad header: end", max(n, 1))
        if (type(dropped) is not dict or len(dropped) > _MAX_DROP_REASONS
                or not all(type(v) is int and v >= 0 for v in dropped.values())):
            raise _Reject("bad header: drop", max(n, 1))
        contexts = self._contexts(batch.get("ctx"), kind, rank, n)

        state = self._senders.get(sender)
        if state is None:
            if len(self._senders) >= self.max_senders:
                raise _Reject("too many senders", max(n, 1))
            state = self._senders[sender] = _Sender(key)
        skip = 0
        if first > state.expected:
            self._lost(sender, key, first - state.expected, "gap",
                       {"expected_seq": state.expected, "got_seq": first})
            state.expected = first
        elif first < state.expected:
            skip = min(n, state.expected - first)
            if skip:
                self._lost(sender, key, skip, "duplicate",
                           {"expected_seq": state.expected, "got_seq": first})
        state.expected = max(state.expected, first + n)
        for reason, count in dropped.items():
            delta = count - state.dropped.get(reason, 0)
            if delta > 0:
                state.dropped[reason] = count
                self._lost(sender, key, delta, f"dropped by sender: {reason}", {})

        delivered = 0
        publish = self.bus.publish
        for entry in entries[skip:] if skip else entries:
            try:
                event = _decode_event(entry, contexts)
            except _Reject as rej:
                self._reject(key, rej.reason, 1)
                continue
            publish(event)
            delivered += 1
        state.delivered += delivered
        self.delivered += delivered
        if end and not state.ended:
            state.ended = True
            if self.on_end is not None:
                try:
                    self.on_end(key, sender)
                except Exception:
                    logger.exception("store receiver: on_end callback failed")
        return delivered

    def _contexts(self, raw: object, kind: SenderKind, rank: int,
                  n: int) -> list[JobContext | None]:
        if type(raw) is not list or len(raw) > _MAX_CONTEXTS:
            raise _Reject("bad header: ctx", max(n, 1))
        out: list[JobContext | None] = []
        for item in raw:
            try:
                cache_key = tuple(sorted(item.items())) if type(item) is dict else None
            except TypeError:
                cache_key = None
            ctx = self._context_cache.get(cache_key) if cache_key is not None else None
            if ctx is None:
                try:
                    ctx = context_from_dict(item)
                except (TypeError, ValueError):
                    raise _Reject("bad context", max(n, 1)) from None
                if cache_key is not None and len(self._context_cache) < 4096:
                    self._context_cache[cache_key] = ctx
            claimed = ctx.rank if kind == "w" else ctx.group_rank
            # An event must come from the rank whose queue carries it: None marks the
            # entry unusable and every event pointing at it is rejected as spoofed.
            out.append(ctx if claimed is None or claimed == rank else None)
        return out

    # -- reports ------------------------------------------------------------------------
    def _lost(self, sender: str, key: str, count: int, reason: str,
              extra: Mapping[str, Any]) -> None:
        kind = reason.split(":", 1)[0]
        self.lost[kind] = self.lost.get(kind, 0) + count
        logger.warning("store receiver: %s: %d events %s", sender, count, reason)
        self.bus.publish(EventsLost(source=sender, count=count, reason=reason,
                                    data={"queue": key, **extra}))

    def _reject(self, key: str, reason: str, count: int) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + count
        self._pending_rejects[(key, reason)] = self._pending_rejects.get((key, reason), 0) + count

    def _flush_rejects(self, *, force: bool = False) -> None:
        # Garbage can arrive fast: report it aggregated, at most once per report_interval.
        if not self._pending_rejects:
            return
        now = time.monotonic()
        if not force and now - self._last_flush_rejects < self.report_interval:
            return
        self._last_flush_rejects = now
        pending, self._pending_rejects = self._pending_rejects, {}
        for (key, reason), count in sorted(pending.items()):
            logger.warning("store receiver: rejected %d events from %s: %s", count, key, reason)
            self.bus.publish(EventsLost(source=key, count=count, reason=f"rejected: {reason}",
                                        data={"queue": key}))

    def stats(self) -> dict[str, Any]:
        """Values popped, events delivered, rejected and lost (per reason), senders."""
        with self._lock:
            return {
                "values": self.values,
                "delivered": self.delivered,
                "rejected": dict(self.rejected),
                "lost": dict(self.lost),
                "store_errors": self.store_errors,
                "queues": list(self._queues),
                "senders": {s: {"key": st.key, "next_seq": st.expected, "ended": st.ended,
                                "delivered": st.delivered, "dropped": dict(st.dropped)}
                            for s, st in self._senders.items()},
            }

    def report_leftovers(self) -> int:
        """Publish an ``EVENTS_LOST`` ("left in the store") for every watched queue that
        still holds values, e.g. when the exit budget ran out first; returns their total.

        The count is of pushes (values): each holds up to a few thousand events.
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
                if left:
                    total += left
                    self.lost["left in the store"] = self.lost.get("left in the store",
                                                                   0) + left
                    logger.warning("store receiver: %d pushes left undrained in %s", left, key)
                    self.bus.publish(EventsLost(
                        source=key, count=left,
                        reason="left in the store at exit (count of pushes, not events)",
                        data={"queue": key}))
        return total

    def unended(self) -> list[str]:
        """Senders seen without their end marker (killed, or still running)."""
        with self._lock:
            return [s for s, st in self._senders.items() if not st.ended]

    def close(self) -> None:
        """Stop draining and report what is still pending."""
        self.stop()
        with self._lock:
            self._flush_rejects(force=True)


def _no_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def _queue_empty_error() -> type[BaseException]:
    import torch.distributed as dist

    error: type[BaseException] = getattr(dist, "QueueEmptyError", RuntimeError)
    return error


def _decode_event(entry: object, contexts: list[JobContext | None]) -> Event:
    if type(entry) is not list or len(entry) != 2:
        raise _Reject("bad event: not [type, fields]")
    name, fields = entry
    if type(name) is not str or type(fields) is not dict:
        raise _Reject("bad event: not [type, fields]")
    try:
        cls = event_class(name)
    except ValueError:
        raise _Reject("unknown event type") from None
    index = fields.pop("context", None)
    if type(index) is not int or not 0 <= index < len(contexts):
        raise _Reject("bad event: context")
    context = contexts[index]
    if context is None:
        raise _Reject("spoofed rank")
    timestamp = fields.pop("timestamp", None)
    if type(timestamp) is int:
        timestamp = float(timestamp)
    if type(timestamp) is not float or not math.isfinite(timestamp):
        raise _Reject("bad event: timestamp")
    data = fields.pop("data", None)
    if data is not None and type(data) is not dict:
        raise _Reject("bad event: data")
    try:
        return cls(**fields, data=data, timestamp=timestamp, context=context)
    except (TypeError, ValueError):
        raise _Reject("bad event: fields") from None


# -- the agent plugin ---------------------------------------------------------------------


def _is_builtin(event: Event) -> bool:
    return type(type(event).type) is EventType


def job_event_filter(spec: str | None = None) -> Callable[[Event], bool]:
    """The predicate selecting what a node forwards to group rank 0.

    ``spec`` (default: ``$EVENTBUS_JOB_EVENTS``, else ``"builtin"``) is a comma-separated
    list: ``builtin`` (every built-in type), ``all`` (every type), type names to add, and
    ``-NAME`` to keep a type on its node. A spec of only exclusions starts from
    ``builtin``: ``EVENTBUS_JOB_EVENTS=-METRIC`` keeps per-step metrics local.
    """
    text = os.environ.get(ENV_JOB_EVENTS, "builtin") if spec is None else spec
    tokens = [t.strip() for t in text.split(",") if t.strip()]
    exclude = frozenset(t[1:] for t in tokens if t.startswith("-"))
    include = [t for t in tokens if not t.startswith("-")] or ["builtin"]
    every = "all" in include
    builtin = "builtin" in include
    names = frozenset(t for t in include if t not in ("all", "builtin"))
    for name in names | exclude:
        event_class(name)  # an unknown name is a typo: say so now (ValueError naming it)

    def select(event: Event) -> bool:
        name = str(type(event).type)
        if name in exclude:
            return False
        return every or name in names or (builtin and _is_builtin(event))

    return select


class StoreTransport:
    """The agent plugin: worker queues -> this agent's bus; other nodes -> group rank 0.

    ``job_events`` selects what a node other than group rank 0 forwards (see
    :func:`job_event_filter`). Queues of a finished attempt are drained until they have been
    empty for ``linger`` seconds.
    """

    def __init__(
        self,
        *,
        job_events: Callable[[Event], object] | str | None = None,
        poll_interval: float = 0.01,
        max_idle_interval: float = 0.5,
        job_poll_interval: float = 0.02,
        job_max_idle_interval: float = 1.0,
        linger: float = 30.0,
        connect_timeout: float = 30.0,
    ) -> None:
        if callable(job_events):
            self.job_filter: Callable[[Event], object] = job_events
        else:
            try:
                self.job_filter = job_event_filter(job_events)
            except ValueError as exc:
                # A typo must not cost the job its worker events: say so, keep the default.
                logger.error("%s: %s; forwarding every built-in type to group rank 0 instead",
                             ENV_JOB_EVENTS, exc)
                self.job_filter = job_event_filter("builtin")
        self.poll_interval = poll_interval
        self.job_poll_interval = job_poll_interval
        self.max_idle_interval = max_idle_interval
        self.job_max_idle_interval = job_max_idle_interval
        self.linger = linger
        self.connect_timeout = connect_timeout
        self.info: RendezvousInfo | None = None
        self.receiver: StoreReceiver | None = None
        self.job_receiver: StoreReceiver | None = None
        self.job_forwarder: StoreForwarder | None = None
        self._node_ends: set[str] = set()
        self._lock = threading.Lock()

    # -- AgentPlugin ----------------------------------------------------------------------
    def after_rendezvous(self, info: RendezvousInfo) -> Mapping[str, str]:
        """Watch this attempt's worker queues (and node queues on group rank 0); return the
        workers' environment that points their forwarders at the store."""
        with self._lock:
            previous, self.info = self.info, info
            prefix = namespace(info.run_id, info.restart_count)
            if self.receiver is None:
                self.receiver = StoreReceiver(bus=info.bus, host=info.store_host,
                                              port=info.store_port,
                                              connect_timeout=self.connect_timeout,
                                              poll_interval=self.poll_interval,
                                              max_idle_interval=self.max_idle_interval)
                self.receiver.start()
            receiver = self.receiver
            for key in receiver.queues():
                receiver.retire(key, after=self.linger)
            for rank in info.global_ranks:
                receiver.watch(worker_key(prefix, rank), kind="w", rank=rank)
            if info.group_rank == 0:
                self._close_job_forwarder(timeout=1.0)
                self._watch_nodes(info, prefix)
            else:
                self._forward_job_view(info, prefix, previous)
            return {ENV_STORE: f"{info.store_host}:{info.store_port}", ENV_PREFIX: prefix}

    def drain(self, *, timeout: float) -> None:
        """Pull in what the workers pushed before the monitor saw them fail (the launcher
        calls this before it publishes a failure), so reactors such as
        ``StopOnNonFiniteLoss`` judge a failure with the workers' last events on the bus."""
        receiver = self.receiver
        if receiver is not None:
            receiver.drain(timeout=timeout)

    def before_exit(self, *, timeout: float) -> None:
        """Drain the workers' queues; forward the rest of this node's view to group rank 0
        and wait for its acknowledgement (other nodes), or wait for every node's last push
        (group rank 0); all within ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._lock:
            info = self.info
            receiver = self.receiver
            if receiver is None or info is None:
                return
            receiver.stop()
            # Alone, the workers' queues get the whole budget; with other nodes, half of
            # it, the rest goes to the job-wide handshake.
            share = 1.0 if info.group_world_size == 1 else 0.5
            receiver.drain(timeout=max(0.0, (deadline - time.monotonic()) * share))
            receiver.report_leftovers()
            if info.group_rank != 0 and self.job_forwarder is not None:
                self._finish_job_view(deadline)
            job = self.job_receiver
            if job is not None:
                job.stop()
                self._wait_for_nodes(info, job, deadline)
                job.report_leftovers()
                job.close()
            receiver.close()
            for sender in receiver.unended():
                logger.warning("store receiver: %s never sent its end marker (killed, or "
                               "stopped by SIGKILL/os._exit): the events it queued last may "
                               "be lost", sender)

    # -- job-wide view ------------------------------------------------------------------
    def _watch_nodes(self, info: RendezvousInfo, prefix: str) -> None:
        if self.job_receiver is None:
            if info.group_world_size == 1:
                return  # a single node: no other node's view to receive
            self.job_receiver = StoreReceiver(bus=info.bus, host=info.store_host,
                                              port=info.store_port,
                                              connect_timeout=self.connect_timeout,
                                              poll_interval=self.job_poll_interval,
                                              max_idle_interval=self.job_max_idle_interval,
                                              on_end=self._on_node_end)
            self.job_receiver.start()
        job = self.job_receiver
        for key in job.queues():
            job.retire(key, after=self.linger)
        for group_rank in range(1, info.group_world_size):
            job.watch(node_key(prefix, group_rank), kind="n", rank=group_rank)
        self._node_ends.clear()

    def _on_node_end(self, key: str, sender: str) -> None:
        self._node_ends.add(key)
        job = self.job_receiver
        if job is not None:
            try:
                job.client.set(ack_key(key, sender), "1")
            except Exception as exc:
                logger.warning("store receiver: cannot acknowledge %s on %s: %s", sender, key,
                               exc)

    def _wait_for_nodes(self, info: RendezvousInfo, job: StoreReceiver,
                        deadline: float) -> None:
        prefix = namespace(info.run_id, info.restart_count)
        expected = {node_key(prefix, g) for g in range(1, info.group_world_size)}
        while True:
            popped = job.drain_once(every=True)
            if expected <= self._node_ends and popped == 0:
                return
            if time.monotonic() >= deadline:
                missing = sorted(expected - self._node_ends)
                if missing:
                    logger.warning("store receiver: no end marker from %s before the agent's "
                                   "exit deadline; their last events may be missing", missing)
                return
            if not popped:
                time.sleep(0.01)

    def _forward_job_view(self, info: RendezvousInfo, prefix: str,
                          previous: RendezvousInfo | None) -> None:
        key = node_key(prefix, info.group_rank)
        fwd = self.job_forwarder
        if fwd is not None and previous is not None and previous.group_rank == info.group_rank:
            with fwd._client_lock:
                fwd.key = key
            return
        self._close_job_forwarder(timeout=1.0)
        self.job_forwarder = StoreForwarder(
            host=info.store_host, port=info.store_port, key=key, rank=info.group_rank,
            kind="n", bus=info.bus, where=self.job_filter,
            connect_timeout=self.connect_timeout, flush_interval=0.05)

    def _close_job_forwarder(self, *, timeout: float) -> None:
        fwd, self.job_forwarder = self.job_forwarder, None
        if fwd is not None:
            fwd.close(timeout)

    def _finish_job_view(self, deadline: float) -> None:
        fwd = self.job_forwarder
        if fwd is None:
            return
        fwd.close(max(0.0, (deadline - time.monotonic()) / 2))
        acked = ack_key(fwd.key, fwd.sender)
        client = fwd._client
        while client is not None and time.monotonic() < deadline:
            try:
                if client.check([acked]):
                    return
            except Exception:
                break
            time.sleep(0.02)
        logger.warning("store transport: group rank 0 did not acknowledge this node's last "
                       "push (%s) in time; its last events may be missing from the job view",
                       fwd.key)

    def stats(self) -> dict[str, Any]:
        """The receivers' and the job forwarder's statistics."""
        return {
            "workers": self.receiver.stats() if self.receiver else None,
            "nodes": self.job_receiver.stats() if self.job_receiver else None,
            "job_forwarder": self.job_forwarder.stats() if self.job_forwarder else None,
        }


register_agent_plugin(StoreTransport)
