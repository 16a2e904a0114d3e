"""The store wire format: what a sender pushes to a c10d store queue and how a receiver
reads it back. Both ends live here, side by side, so that they cannot drift apart:
:mod:`eventbus.subscribers.store_forwarder` encodes with :class:`BatchEncoder`,
:mod:`eventbus.publishers.store_receiver` decodes with :class:`BatchDecoder`.

One ``queue_push`` value is UTF-8 JSON (never pickle)::

    {"v": 1, "src": "<sender id>", "kind": "w" | "n", "rank": <rank or group rank>,
     "seq": <sequence number of the first event>, "drop": {"<reason>": <count>, ...},
     "ctx": [<JobContext dict>, ...],
     "ev": [["<type>", {<typed fields>, "timestamp": t, "data": {...}, "context": <ctx index>}],
            ...],
     "end": true | false}

Every sender (one process, or one agent for the job-wide view) numbers its events 0, 1, 2,
... in the order it pushes them; ``drop`` carries the sender's cumulative counts of events
it dropped before they got a number (full queue, closed forwarder). The receiver turns a
jump in the numbers into an ``EVENTS_LOST`` "gap", a step back into "duplicate", and a
growing ``drop`` count into "dropped by sender", so that for every sender
``recorded = delivered + reported lost``. ``end`` marks the sender's last push.

Keys: a job's queues are namespaced by run id and attempt (:func:`namespace`), because the
store keeps queues across restarts of the worker group and they cannot be deleted. Worker
``r`` pushes to :func:`worker_key`, the agent of group rank ``g`` > 0 pushes its job-wide
view to :func:`node_key`, and group rank 0 acknowledges a node's end marker at
:func:`ack_key`.

A sender's exit ledger, the local file it leaves for when the store is gone, is
:mod:`eventbus.exit_ledger`'s.

The store's clients (torch's, and the torch-free :class:`~eventbus.store_client.QueueClient`
that moves these values) are :mod:`eventbus.store_client`'s. Importing this module does not
import torch.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import Literal
from typing import NoReturn

import attrs

from eventbus.context import JobContext
from eventbus.context import context_from_dict
from eventbus.encoding import LIMITS
from eventbus.encoding import decode_json
from eventbus.encoding import reject_constant
from eventbus.encoding import sanitize
from eventbus.events import _REGISTRY
from eventbus.events import Event

__all__ = [
    "ENV_BELL",
    "ENV_PREFIX",
    "ENV_STORE",
    "MAX_PUSH_BYTES",
    "MAX_VALUE_BYTES",
    "WIRE_VERSION",
    "Batch",
    "BatchDecoder",
    "BatchEncoder",
    "SenderKind",
    "WireError",
    "ack_key",
    "bell_key",
    "namespace",
    "new_sender_id",
    "node_key",
    "worker_key",
]

#: ``host:port`` of the long-lived c10d store; the launcher sets it for its workers
ENV_STORE = "EVENTBUS_AGENT_STORE"
#: key namespace of the attempt the worker belongs to (see :func:`namespace`)
ENV_PREFIX = "EVENTBUS_STORE_PREFIX"
#: the receiver's doorbell queue: after each push a worker pushes its queue's key there,
#: so that its agent pops at once instead of at its next poll (see :func:`bell_key`)
ENV_BELL = "EVENTBUS_STORE_BELL"
#: version of the wire format above
WIRE_VERSION = 1
#: a push carries at most this many bytes (the store accepts 8 MiB values; stay well below)
MAX_PUSH_BYTES = 4 * 1024 * 1024
#: the largest value a receiver decodes; larger ones are rejected unread. (Senders push at
#: most :data:`MAX_PUSH_BYTES`; the store server itself refuses values over 8 MiB.)
MAX_VALUE_BYTES = 6 * 1024 * 1024
_MAX_SENDER_ID = 256
_MAX_CONTEXTS = 256
_MAX_DROP_REASONS = 32
#: decoded contexts a decoder keeps (one per sending process: group rank 0's job receiver
#: sees every rank of the job); when full it starts again, so that a restart's new
#: contexts replace the dead attempt's instead of never being cached
_MAX_CACHED_CONTEXTS = 16_384

#: ``"w"``: a worker process, numbered by global rank; ``"n"``: a node's agent, by group rank
SenderKind = Literal["w", "n"]


# -- keys -------------------------------------------------------------------------------


def namespace(run_id: str, attempt: int) -> str:
    """The key prefix of one attempt of one job: the store keeps queues across attempts."""
    return f"eventbus/{run_id}/{attempt}"


def worker_key(prefix: str, rank: int) -> str:
    """The queue a worker of global rank ``rank`` pushes to (its node's agent pops it)."""
    return f"{prefix}/w{rank}"


def node_key(prefix: str, group_rank: int) -> str:
    """The queue the agent of ``group_rank`` pushes its job-wide view to (group rank 0 pops)."""
    return f"{prefix}/n{group_rank}"


def bell_key(run_id: str, owner: str) -> str:
    """The doorbell queue of one receiver (``owner``: an id unique to it, e.g. from
    :func:`new_sender_id`). Senders push the key of the queue they just pushed to; the
    receiver blocks on it and pops that queue at once. A hint only: a ring that is lost
    delays a batch until the receiver's next poll, nothing more."""
    return f"eventbus/{run_id}/bell/{owner}"


def ack_key(key: str, sender: str) -> str:
    """Where the receiver acknowledges the end marker of ``sender`` on queue ``key``."""
    return f"{key}/ack/{sender}"


def new_sender_id(kind: SenderKind, rank: int) -> str:
    """A sender id unique across processes, hosts, attempts and pid reuse."""
    # Imported here: ``import eventbus`` loads this module in every process (the worker
    # hook reads ENV_STORE); only senders need these.
    import secrets
    import socket

    return f"{kind}{rank}:{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


# -- encoding ---------------------------------------------------------------------------


_DUMPS = json.JSONEncoder(allow_nan=False, separators=(",", ":"), check_circular=False).encode

#: orjson, a C-speed codec for the common batch (json stays the fallback and the judge):
#: False until a :class:`BatchEncoder` is made or the first batch is decoded (``import
#: eventbus`` does not pay for it), None where it is not installed or not usable
_orjson: Any = False
#: what the codec needs of orjson: a module missing one is not usable (see :func:`_codec`)
_ORJSON_NAMES = ("dumps", "loads", "JSONEncodeError", "JSONDecodeError")


def _codec() -> Any:
    """orjson, or None where it is not installed (a dependency, but not a required one) or
    only half imported.

    Half imported: a process forked while another of its parent's threads was importing
    orjson inherits the module as that thread left it, without ``dumps`` or its errors,
    and no thread of the child will ever finish it (a DataLoader worker forked while the
    forwarder's thread imported it lost every event it recorded, 1 run in about 10 under
    load). Such a process uses json. :class:`BatchEncoder` imports the codec on the
    thread that makes it (the main thread, in a worker), before the script can fork.
    """
    global _orjson
    if _orjson is False:
        try:
            import orjson
        except ImportError:  # pragma: no cover
            _orjson = None
        else:
            usable = all(hasattr(orjson, name) for name in _ORJSON_NAMES)
            _orjson = orjson if usable else None
    return _orjson


_PLAIN_JSON = frozenset({str, int, float, bool, type(None)})


def _fast_entries(entries: list[Any]) -> bytes | None:
    """The ``ev`` array of a batch as JSON bytes by orjson, or None where only json may
    write it exactly as promised.

    orjson writes a non-finite float as ``null`` where json must raise (the entry is then
    sanitized into a ``{"$float": ...}`` tag): an output without any ``null`` cannot hold
    one. Anything orjson refuses (ints past 64 bits, non-string keys, tensors, ...) goes to
    json as well, so the wire carries the same values either way.
    """
    orjson = _codec()
    if orjson is None:
        return None
    # orjson writes enums, UUIDs, datetimes and dataclasses natively where json (through
    # sanitize) writes a summary: it only gets data of plain JSON scalars (the typed
    # fields already are; containers take the json path).
    plain = _PLAIN_JSON
    for _, fields in entries:
        data = fields.get("data")
        if data:
            for value in data.values():
                if type(value) not in plain:
                    return None
    try:
        out: bytes = orjson.dumps(entries)
    except (TypeError, ValueError, orjson.JSONEncodeError):
        return None
    return None if b"null" in out else out


def _entry(event: Event, contexts: dict[int, int], ctx_list: list[JobContext]) -> list[Any]:
    d = event.__dict__.copy()
    ctx = d["context"]
    index = contexts.get(id(ctx))
    if index is None:
        index = contexts[id(ctx)] = len(ctx_list)
        ctx_list.append(ctx)
    d["context"] = index
    return [str(type(event).type), d]


def _safe_entry_text(entry: list[Any]) -> str:
    """One event entry as JSON within the per-event limit, whatever its payload holds."""
    try:
        text = _DUMPS(entry)
    except (ValueError, TypeError, RecursionError, OverflowError):
        text = _DUMPS(sanitize(entry))
    if len(text) > LIMITS.max_line_bytes:
        name, d = entry
        d = dict(d)
        d["data"] = {"$truncated": "data over the event size limit"}
        text = _DUMPS(sanitize([name, d]))
    return text


class BatchEncoder:
    """Numbers one sender's events and encodes them into pushes of the wire format.

    Not thread-safe: one encoder belongs to one sending thread.
    """

    def __init__(self, *, kind: SenderKind, rank: int, sender: str | None = None,
                 max_push_bytes: int = MAX_PUSH_BYTES) -> None:
        self.kind = kind
        self.rank = rank
        self.sender = sender or new_sender_id(kind, rank)
        self.max_push_bytes = max_push_bytes
        #: sequence number of the next event
        self.seq = 0
        # Here, on the thread that makes the encoder, not on the first batch's (a queue's
        # thread): a fork while that thread imports would leave the child half a module.
        _codec()

    def encode(self, events: Sequence[Event], *, dropped: dict[str, int] | None = None,
               end: bool = False) -> list[tuple[bytes, int]]:
        """The pushes (value, number of events) that carry ``events``, numbered in order."""
        contexts: dict[int, int] = {}
        ctx_list: list[JobContext] = []
        entries = [_entry(e, contexts, ctx_list) for e in events]
        head = {
            "v": WIRE_VERSION, "src": self.sender, "kind": self.kind, "rank": self.rank,
            "seq": self.seq, "drop": dropped or {},
            "ctx": [c.to_dict() for c in ctx_list], "end": end, "ev": entries,
        }
        limit = min(self.max_push_bytes, LIMITS.max_line_bytes)
        fast = _fast_entries(entries)
        if fast is not None and len(fast) <= limit - 4096:
            # The header by json (small, once per batch), the events spliced in.
            head["ev"] = []
            prefix = _DUMPS(head)
            head["ev"] = entries
            self.seq += len(entries)
            return [(prefix[:-3].encode("utf-8") + fast + b"}", len(entries))]
        text: str | None
        try:
            text = _DUMPS(head)
        except (ValueError, TypeError, RecursionError, OverflowError):
            text = None
        if text is not None and len(text) <= limit:
            self.seq += len(entries)
            return [(text.encode("utf-8"), len(entries))]
        # Slow path: something is not plain JSON, or the batch is large. Encode event by
        # event (sanitizing and truncating what needs it) and split into pushes.
        parts = [_safe_entry_text(entry) for entry in entries]
        pushes: list[tuple[bytes, int]] = []
        start = 0
        while True:
            size = 0
            stop = start
            while stop < len(parts) and (stop == start or
                                         size + len(parts[stop]) + 1 < self.max_push_bytes - 4096):
                size += len(parts[stop]) + 1
                stop += 1
            last = stop >= len(parts)
            head["seq"] = self.seq
            head["end"] = end and last
            head["ev"] = []
            prefix = _DUMPS(head)
            assert prefix.endswith("[]}")
            value = prefix[:-3] + "[" + ",".join(parts[start:stop]) + "]}"
            pushes.append((value.encode("utf-8"), stop - start))
            self.seq += stop - start
            start = stop
            if last:
                return pushes


# -- decoding ---------------------------------------------------------------------------


def _loads(text: str) -> Any:
    """``json.loads(text, parse_constant=reject_constant)``, by orjson where it can.

    orjson accepts only strict JSON, and what it accepts it reads as json does; whatever it
    refuses (a NaN literal, a lone surrogate escape, an int past 64 bits, deep nesting) is
    handed to json, which accepts or rejects it exactly as before.
    """
    orjson = _codec()
    if orjson is not None:
        try:
            return orjson.loads(text)
        except orjson.JSONDecodeError:
            pass
    return json.loads(text, parse_constant=reject_constant)


class WireError(ValueError):
    """Input a receiver refuses, with the reason it is counted under and how many events
    the refusal costs (a whole batch for a bad header, one for a bad event)."""

    def __init__(self, reason: str, count: int = 1) -> None:
        super().__init__(reason)
        self.reason = reason
        self.count = count


@attrs.frozen(kw_only=True)
class Batch:
    """The checked header of one push; its events are decoded one by one with
    :meth:`BatchDecoder.event`, so that one bad event costs only itself."""

    #: the sender id
    sender: str
    #: the sequence number of the first entry
    first: int
    #: the undecoded ``[type, fields]`` entries
    entries: list[Any]
    #: whether this is the sender's last push
    end: bool
    #: the sender's cumulative drops, per reason
    dropped: dict[str, int]
    #: the batch's contexts; None where a context claims another rank (spoofed)
    contexts: list[JobContext | None]


class BatchDecoder:
    """Reads pushes of the wire format from one queue owner, hostile input included.

    Everything wrong raises :class:`WireError` with a reason; nothing else escapes for bad
    input, nothing is ever unpickled, and nesting cannot raise ``RecursionError``.
    Not thread-safe (it caches decoded contexts).
    """

    def __init__(self, *, max_value_bytes: int = MAX_VALUE_BYTES) -> None:
        self.max_value_bytes = max_value_bytes
        self._context_cache: dict[tuple[Any, ...], JobContext] = {}

    def batch(self, raw: object, *, kind: SenderKind, rank: int) -> Batch:
        """The header of ``raw`` (one popped value) from the queue of ``kind`` ``rank``."""
        if not isinstance(raw, (bytes, bytearray)):
            raise WireError("not bytes")
        if len(raw) > self.max_value_bytes:
            raise WireError("value too large")
        try:
            text = bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            raise WireError("not UTF-8") from None
        try:
            if "$float" in text:  # non-finite floats are tagged: revive them
                batch = decode_json(text, max_chars=self.max_value_bytes)
            else:  # the common case: skip the per-object hook (about 40% of the decode)
                batch = _loads(text)
        except (ValueError, TypeError, RecursionError):
            raise WireError("not JSON") from None
        if type(batch) is not dict:
            raise WireError("bad header: not an object")
        if batch.get("v") != WIRE_VERSION:
            raise WireError("bad header: unknown wire version")
        sender = batch.get("src")
        if type(sender) is not str or not 0 < len(sender) <= _MAX_SENDER_ID:
            raise WireError("bad header: src")
        first = batch.get("seq")
        if type(first) is not int or first < 0:
            raise WireError("bad header: seq")
        entries = batch.get("ev")
        if type(entries) is not list:
            raise WireError("bad header: ev")
        n = max(len(entries), 1)
        if batch.get("kind") != kind or batch.get("rank") != rank:
            raise WireError("spoofed sender", n)
        end = batch.get("end", False)
        dropped = batch.get("drop", {})
        if type(end) is not bool:
            raise WireError("bad header: end", n)
        if (type(dropped) is not dict or len(dropped) > _MAX_DROP_REASONS
                or not all(type(v) is int and v >= 0 for v in dropped.values())):
            raise WireError("bad header: drop", n)
        contexts = self._contexts(batch.get("ctx"), kind, rank, n)
        return Batch(sender=sender, first=first, entries=entries, end=end, dropped=dropped,
                     contexts=contexts)

    def _contexts(self, raw: object, kind: SenderKind, rank: int,
                  n: int) -> list[JobContext | None]:
        if type(raw) is not list or len(raw) > _MAX_CONTEXTS:
            raise WireError("bad header: ctx", n)
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
                    raise WireError("bad context", n) from None
                if cache_key is not None:
                    if len(self._context_cache) >= _MAX_CACHED_CONTEXTS:
                        self._context_cache.clear()
                    self._context_cache[cache_key] = ctx
            claimed = ctx.rank if kind == "w" else ctx.group_rank
            # An event must come from the rank whose queue carries it: None marks the
            # entry unusable and every event pointing at it is rejected as spoofed.
            out.append(ctx if claimed is None or claimed == rank else None)
        return out

    @staticmethod
    def event(entry: object, contexts: list[JobContext | None]) -> Event:
        """One ``[type, fields]`` entry of a batch as its typed, validated event."""
        out: list[Event] = []
        BatchDecoder.publish_all([entry], contexts, out.append, _raise_reject)
        return out[0]

    @staticmethod
    def publish_all(entries: list[Any], contexts: list[JobContext | None],
                    publish: Callable[[Event], object],
                    reject: Callable[[str], object]) -> int:
        """Decode every ``[type, fields]`` entry of a batch and hand each valid event to
        ``publish``, in order; each invalid one costs ``reject(reason)`` and only itself.
        Returns the events published.

        One loop for the whole batch (the receiver's hot path): the per-event checks are
        written out here, with everything they look up bound once per batch.
        """
        registry = _REGISTRY
        isfinite = math.isfinite
        n_contexts = len(contexts)
        published = 0
        for entry in entries:
            if type(entry) is not list or len(entry) != 2:
                reject("bad event: not [type, fields]")
                continue
            name, fields = entry
            if type(name) is not str or type(fields) is not dict:
                reject("bad event: not [type, fields]")
                continue
            cls = registry.get(name)  # event_class() without its error message's cost
            if cls is None:
                reject("unknown event type")
                continue
            index = fields.pop("context", None)
            if type(index) is not int or not 0 <= index < n_contexts:
                reject("bad event: context")
                continue
            context = contexts[index]
            if context is None:
                reject("spoofed rank")
                continue
            timestamp = fields.pop("timestamp", None)
            if type(timestamp) is not float:
                if type(timestamp) is not int or not -_MAX_INT_TIMESTAMP < timestamp < \
                        _MAX_INT_TIMESTAMP:
                    reject("bad event: timestamp")
                    continue
                timestamp = float(timestamp)
            if not isfinite(timestamp):
                reject("bad event: timestamp")
                continue
            data = fields.get("data")
            if data is not None and type(data) is not dict:
                reject("bad event: data")
                continue
            try:
                # record()'s builder with the sender's timestamp and context: it validates
                # ``fields`` in place, snapshots data and makes ``fields`` the event's own
                # __dict__ (no keyword binding, no copy).
                spec = cls.__dict__.get("_spec")  # its own, never a base class's
                event = None if spec is None else spec.decode(fields, timestamp, context)
                if event is None:  # not compiled, or anything but the common case
                    event = cls._decode(fields, timestamp, context)
            except (TypeError, ValueError):
                reject("bad event: fields")
                continue
            publish(event)
            published += 1
        return published


#: an int timestamp beyond this is refused (a float cannot even hold it)
_MAX_INT_TIMESTAMP = 2**1000


def _raise_reject(reason: str) -> NoReturn:
    raise WireError(reason)
