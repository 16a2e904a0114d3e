"""The compiled path and the pure-Python one, driven by the same random scripts, agree.

DESIGN.md, "One source for each rule": where a rule runs on two paths, a property-based
test drives both with the same random inputs and compares everything they produce.
Hypothesis writes a script (declared event types with typed fields, subscribers that
collect, raise, cancel others, subscribe more or record again, with ``once=`` and
``where=``; queued sinks with small bounds; records, publishes and store-receiver decodes
with valid, wrongly typed and unknown fields and hostile data). This process runs it on
the compiled path (eventbus/_speedups.c); a child started with ``EVENTBUS_PURE_PYTHON=1``
runs the same script on the pure-Python path; the two transcripts must be equal: each
call's result or error (type and message), every delivery (which subscriber got which
event, in order), every event (``to_dict()``, ``to_json()``, its ``__dict__``'s keys, its
data's types, which values are shared with the caller's and which copied), ``bus.stats()``
and each sink's queue (what it handed over, in which batches, its stats and drops).

The scripts are plain data (tuples of numbers and strings) so that both processes build the
same objects from them; only the moments (timestamps) and the process (context) differ, and
the script fixes the context. ``EVENTBUS_DIFF_EXAMPLES`` sets the number of scripts
(default below, ~11 s on 2 cores: the test is in ``make test-slow``; the fast loop compares
the two paths call by call in test_compiled.py); they are the same on every run unless
``EVENTBUS_DIFF_RANDOM=1``.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import math
import os
import pickle
import re
import struct
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Mapping
from pathlib import Path
from typing import IO
from typing import Any

import pytest
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import eventbus
from eventbus import ALL
from eventbus import Bus
from eventbus import Event
from eventbus import EventType
from eventbus._compiled import speedups
from eventbus.context import JobContext
from eventbus.context import current_context
from eventbus.context import set_context
from eventbus.events import event_class
from eventbus.events import event_type
from eventbus.events import event_types
from eventbus.subscribers.queued import QueuedSink
from eventbus.wire import BatchDecoder

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = int(os.environ.get("EVENTBUS_DIFF_EXAMPLES", "150"))
RANDOM = os.environ.get("EVENTBUS_DIFF_RANDOM", "") not in ("", "0")

#: the context every event of a script carries, on both paths
CONTEXT = {"rank": 3, "local_rank": 1, "group_rank": 0, "world_size": 8,
           "local_world_size": 4, "role": "trainer", "run_id": "diff\u2028run",
           "restart_count": 2, "hostname": "diff-host", "pid": 4242}
BUILTIN = [t.value for t in EventType]


# -- hostile and odd objects (module level: both processes name them alike) ------------------

class Hostile(Exception):
    """What the hostile objects raise."""


class _Armed:
    """Whether the objects that turn hostile after they are built have turned (the script
    builds its containers first, then arms them)."""

    on = False


class EqRaises:
    """Hashes like the int 7, compares by raising."""

    def __hash__(self) -> int:
        return 7

    def __eq__(self, other: object) -> bool:
        raise Hostile("__eq__")

    def __repr__(self) -> str:
        return "EqRaises()"


class HashRaises:
    """Hashes until armed, then raises."""

    def __hash__(self) -> int:
        if _Armed.on:
            raise Hostile("__hash__")
        return 11

    def __eq__(self, other: object) -> bool:
        return self is other

    def __repr__(self) -> str:
        return "HashRaises()"


class LenRaises(list):  # type: ignore[type-arg]
    """A list whose len() raises."""

    def __len__(self) -> int:
        raise Hostile("__len__")


class StrLenRaises(str):
    """A str whose len() raises (a sink's size estimate takes len() of strings)."""

    __slots__ = ()

    def __len__(self) -> int:
        raise Hostile("str.__len__")


class ReprRaises:
    def __repr__(self) -> str:
        raise Hostile("__repr__")


class IndexLike:
    """An int stand-in (``__index__``)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value

    def __repr__(self) -> str:
        return f"IndexLike({self.value})"


class IndexRaises:
    def __index__(self) -> int:
        raise Hostile("__index__")

    def __repr__(self) -> str:
        return "IndexRaises()"


class FloatLike:
    def __float__(self) -> float:
        return 2.5

    def __repr__(self) -> str:
        return "FloatLike()"


class FloatRaises:
    def __float__(self) -> float:
        raise Hostile("__float__")

    def __repr__(self) -> str:
        return "FloatRaises()"


class BoolRaises:
    """A ``where=`` result whose truth raises."""

    def __bool__(self) -> bool:
        raise Hostile("__bool__")

    def __repr__(self) -> str:
        return "BoolRaises()"


class PathLike:
    def __init__(self, path: str | bytes) -> None:
        self.path = path

    def __fspath__(self) -> str | bytes:
        return self.path

    def __repr__(self) -> str:
        return f"PathLike({self.path!r})"


class StrSub(str):
    """A str subclass, equal to and hashing like its text."""

    __slots__ = ()


class IntSub(int):
    pass


class FloatSub(float):
    pass


class EvilKey(str):
    """A str that hashes like its text and compares by raising: as a keyword name it
    collides with the real one."""

    __slots__ = ()

    def __hash__(self) -> int:
        return str.__hash__(self)

    def __eq__(self, other: object) -> bool:
        raise Hostile("EvilKey.__eq__")

    def __ne__(self, other: object) -> bool:
        raise Hostile("EvilKey.__ne__")


class ItemsRaises(Mapping):  # type: ignore[type-arg]
    """A mapping whose items() raises (the rest works)."""

    def __init__(self, data: dict[Any, Any]) -> None:
        self._data = data

    def __getitem__(self, key: Any) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def items(self) -> Any:
        raise Hostile("items()")

    def __repr__(self) -> str:
        return f"ItemsRaises({self._data!r})"


class DictIterLies(dict):  # type: ignore[type-arg]
    """A dict subclass whose iteration and items() say something else than its storage."""

    def __iter__(self) -> Iterator[Any]:
        return iter(["lie"])

    def keys(self) -> Any:
        return ["lie"]

    def __getitem__(self, key: Any) -> Any:
        return "lie" if key == "lie" else dict.__getitem__(self, key)

    def items(self) -> Any:
        return [("lie", "lie")]


class ClassLiesInt:
    """An object whose ``__class__`` says int (as unittest.mock's specs do)."""

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        return int

    nbytes = 4096

    def __index__(self) -> int:
        return 5

    def __repr__(self) -> str:
        return "ClassLiesInt()"


Pair = collections.namedtuple("Pair", ["left", "right"])


# -- the script: plain data, built into objects the same way in both processes ---------------

class _Built:
    """Objects of one script: what is labelled (the caller's containers, arrays, odd
    objects), so that an event can say which of its values it shares with the caller."""

    def __init__(self) -> None:
        self.labels: dict[int, str] = {}
        self.keep: list[Any] = []  # alive, so that an id is never reused
        self.count = 0

    def label(self, value: Any) -> Any:
        self.labels[id(value)] = f"#{self.count}"
        self.count += 1
        self.keep.append(value)
        return value


def _hostile(kind: str) -> Any:
    return {
        "eq": EqRaises, "hash": HashRaises, "repr": ReprRaises,
        "index": lambda: IndexLike(5), "index_raises": IndexRaises, "float": FloatLike,
        "float_raises": FloatRaises, "bool_raises": BoolRaises,
        "path": lambda: PathLike("/tmp/p"), "path_bytes": lambda: PathLike(b"/tmp/p"),
        "str_len": lambda: StrLenRaises("len"), "str_sub": lambda: StrSub("sub"),
        "int_sub": lambda: IntSub(9), "float_sub": lambda: FloatSub(0.5),
        "liar": ClassLiesInt, "enum": lambda: EventType.METRIC,
        "pathlib": lambda: Path("/tmp/x"),
    }[kind]()


def _build(spec: Any, built: _Built) -> Any:
    """The object a value spec describes (see the strategies below)."""
    kind = spec[0]
    if kind in ("int", "float", "str", "bytes", "bool"):
        return spec[1]
    if kind == "none":
        return None
    if kind == "complex":
        return complex(spec[1], spec[2])
    if kind == "bytearray":
        return built.label(bytearray(spec[1]))
    if kind == "hostile":
        value = _hostile(spec[1])
        return value if type(value) in (int, float, str) else built.label(value)
    if kind == "np":
        import numpy as np

        with np.errstate(over="ignore"):  # a float16 that overflows is inf, on purpose
            return built.label(np.array(spec[2], dtype=spec[1]).reshape(spec[3]))
    if kind == "np_scalar":
        import numpy as np

        with np.errstate(over="ignore"):
            return np.dtype(spec[1]).type(spec[2])
    if kind == "np_big":
        import numpy as np

        return built.label(np.arange(140_000, dtype="float64"))
    if kind == "tensor":
        import torch

        value = torch.tensor(spec[2], dtype=getattr(torch, spec[1]))
        if spec[3]:
            value.requires_grad_(True)
        return built.label(value)
    if kind == "tensor_0d":
        import torch

        return built.label(torch.tensor(spec[1]))
    if kind == "tensor_big":
        import torch

        return built.label(torch.zeros(300_000, dtype=torch.float32))
    if kind == "list":
        return built.label([_build(s, built) for s in spec[1]])
    if kind == "len_raises":
        return built.label(LenRaises(_build(s, built) for s in spec[1]))
    if kind == "tuple":
        return built.label(tuple(_build(s, built) for s in spec[1]))
    if kind == "pair":
        return built.label(Pair(_build(spec[1], built), _build(spec[2], built)))
    if kind in ("set", "frozenset"):
        items = [_build(s, built) for s in spec[1]]
        out: Any = set()
        for item in items:
            with contextlib.suppress(Hostile):
                out.add(item)
        return built.label(out if kind == "set" else frozenset(out))
    if kind in ("dict", "ordered", "items_raises", "dict_lies"):
        out = {}
        for key_spec, value_spec in spec[1]:
            key, value = _build(key_spec, built), _build(value_spec, built)
            with contextlib.suppress(Hostile):
                out[key] = value
        if kind == "ordered":
            out = collections.OrderedDict(out)
        elif kind == "items_raises":
            out = ItemsRaises(out)
        elif kind == "dict_lies":
            out = DictIterLies(out)
        return built.label(out)
    if kind == "proxy":
        return built.label(types.MappingProxyType(_build(spec[1], built)))
    if kind == "rec_list":
        rec: list[Any] = [1]
        rec.append(rec)
        return built.label(rec)
    if kind == "rec_dict":
        recd: dict[str, Any] = {"a": 1}
        recd["self"] = recd
        return built.label(recd)
    if kind == "deep":
        deep: Any = "bottom"
        for _ in range(spec[1]):
            deep = [deep]
        return built.label(deep)
    raise AssertionError(f"unknown value spec {spec!r}")


def _key(spec: Any) -> Any:
    """A keyword name: the text, a str subclass equal to it, or one that raises on ==."""
    kind, text = spec
    return {"plain": str, "sub": StrSub, "evil": EvilKey}[kind](text)


def _fields(items: list[Any], built: _Built) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for key_spec, value_spec in items:
        key = _key(key_spec)
        try:
            value = _build(value_spec, built)
        except Hostile:
            value = "<build failed>"
        with contextlib.suppress(Hostile):
            out[key] = value
    return out


def _declare(name: str, schema: tuple[tuple[str, str, str], ...]) -> None:
    """Declare a user event type (once per process; the name is its schema's hash)."""
    if name in event_types():
        return
    annotations: dict[str, str] = {}
    namespace: dict[str, Any] = {"__module__": __name__, "__qualname__": name}
    for field, kind, default in schema:
        if default == "required":
            annotations[field] = kind
        elif default == "none":
            annotations[field] = f"{kind} | None"
            namespace[field] = None
        else:
            annotations[field] = kind
            namespace[field] = {"int": 7, "float": 1.5, "str": "d", "bool": True}[kind]
    namespace["__annotations__"] = annotations
    event_type(name)(type(name, (Event,), namespace))


def _type_arg(spec: Any, built: _Built) -> Any:
    kind, value = spec
    if kind == "member":
        return EventType(value)
    if kind == "name":
        return value
    if kind == "sub":
        return StrSub(value)
    if kind == "class":
        return event_class(value)
    return _build(value, built)  # anything at all


# -- describing what came out ----------------------------------------------------------------

_NOW_S = 3600.0


def _name_of(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _describe(value: Any, built: _Built, depth: int = 0,
              active: frozenset[int] = frozenset()) -> Any:
    """``value`` as plain data, deterministic across processes: its type, its contents,
    and whether it is the caller's own object (shared) or a copy."""
    if depth > 40:
        return ("deep",)
    if id(value) in active:
        return ("cycle",)
    label = built.labels.get(id(value))
    cls = type(value)
    name = _name_of(cls)
    if cls is float:
        return ("float", repr(value))
    if cls in (int, str, bytes, bool, type(None), complex):
        return (name, repr(value) if cls is complex else value)
    active = active | {id(value)}
    sub = depth + 1
    try:
        if isinstance(value, Mapping):
            return ("map", name, label, [(_describe(k, built, sub, active),
                                          _describe(v, built, sub, active))
                                         for k, v in dict.items(value)]
                    if isinstance(value, dict) else repr(value))
        if isinstance(value, (list, tuple)):
            return ("seq", name, label, [_describe(v, built, sub, active)
                                         for v in list.__iter__(value)]
                    if isinstance(value, list) else
                    [_describe(v, built, sub, active) for v in tuple.__iter__(value)])
        if isinstance(value, (set, frozenset)):
            return ("set", name, label, sorted(repr(_describe(v, built, sub, active))
                                               for v in value))
        module = cls.__module__
        if module.startswith("numpy") and hasattr(value, "flags"):
            return ("ndarray", name, label, str(value.dtype), value.shape,
                    bool(value.flags.writeable), _describe(value.tolist(), built, sub, active))
        if module.startswith("torch") and hasattr(value, "detach"):
            return ("tensor", name, label, str(value.dtype), tuple(value.shape),
                    bool(value.requires_grad),
                    _describe(value.detach().tolist(), built, sub, active))
        if module.startswith("numpy"):
            return ("np_scalar", name, repr(value))
        return ("obj", name, label, _safe_repr(value))
    except Hostile as exc:
        return ("describe raised", name, label, str(exc))


def _safe_repr(value: Any) -> str:
    try:
        return repr(value)
    except Exception as exc:
        return f"<repr raised {type(exc).__name__}>"


def _error(exc: BaseException) -> tuple[Any, ...]:
    """An exception as plain data: its class and message (the registry's list of types in
    an unknown-type message is this process's, so it is checked, then left out)."""
    message = str(exc)
    known = ", ".join(sorted(event_types()))
    if f"({known})" in message:
        message = message.replace(f"({known})", "(<every declared type>)")
    extra = tuple(_safe_repr(getattr(exc, a)) for a in ("event_type", "field")
                  if hasattr(exc, a))
    return ("raised", _name_of(type(exc)), message, extra)


def _mask_timestamp(text: str, timestamp: Any) -> str:
    if type(timestamp) is float and math.isfinite(timestamp) and \
            abs(timestamp - time.time()) < _NOW_S:
        return text.replace(repr(timestamp), "<now>", 1)
    return text


def _describe_event(event: Any, built: _Built) -> Any:
    if not isinstance(event, Event):
        return ("not an event", _describe(event, built))
    timestamp = event.__dict__.get("timestamp")
    now = type(timestamp) is float and math.isfinite(timestamp) and \
        abs(timestamp - time.time()) < _NOW_S
    try:
        as_dict = event.to_dict()
        as_dict["timestamp"] = "<now>" if now else as_dict["timestamp"]
        to_dict = _describe(as_dict, built)
    except Exception as exc:
        to_dict = _error(exc)
    try:
        line = event.to_json()
        to_json = re.sub(r'"timestamp": ?[-+0-9.eE]+', '"timestamp":<now>', line, count=1) \
            if now else line
    except Exception as exc:
        to_json = _error(exc)
    try:
        text = _mask_timestamp(repr(event), timestamp)
    except Exception as exc:
        text = repr(_error(exc))
    return (_name_of(type(event)), str(event.type), list(event.__dict__), to_dict, to_json,
            _describe(event.fields(), built), _describe(event.data, built),
            "<now>" if now else _describe(timestamp, built),
            event.context == current_context() or event.context.to_dict(),
            event.is_failure, text)


# -- running a script -----------------------------------------------------------------------

class _Interrupt(KeyboardInterrupt):
    """A subscriber's KeyboardInterrupt (a subclass: the runner catches only its own)."""


class _Run:
    """One script on this process's path: its bus, subscriptions, sinks and transcript."""

    def __init__(self, script: dict[str, Any]) -> None:
        self.script = script
        self.built = _Built()
        self.out: list[Any] = []
        self.bus = Bus(f"diff-{script['seed']}", strict=script["strict"])
        self.subs: list[eventbus.Subscription] = []
        self.events: dict[int, int] = {}
        self.event_objects: list[Any] = []
        self.depth = 0
        self.sinks: list[tuple[QueuedSink, list[list[int]], threading.Event]] = []

    # events get numbers in the order they are first seen
    def _index(self, event: Any) -> int:
        index = self.events.get(id(event))
        if index is None:
            index = self.events[id(event)] = len(self.event_objects)
            self.event_objects.append(event)
        return index

    def _handler(self, number: int, spec: Any) -> Callable[[Any], object]:
        kind = spec[0]
        out, subs, bus = self.out, self.subs, self.bus

        if kind == "collect":
            def collect(event: Any) -> None:
                out.append(("delivered", number, self._index(event)))
            return collect
        if kind == "raise":
            def raises(event: Any) -> None:
                out.append(("delivered", number, self._index(event)))
                raise Hostile(f"subscriber {number}")
            return raises
        if kind == "interrupt":
            def interrupt(event: Any) -> None:
                out.append(("delivered", number, self._index(event)))
                raise _Interrupt(f"subscriber {number}")
            return interrupt
        if kind == "cancel":
            def cancel(event: Any) -> None:
                out.append(("delivered", number, self._index(event)))
                if spec[1] < len(subs):
                    subs[spec[1]].cancel()
            return cancel
        if kind == "subscribe":
            left = [2]

            def subscribe(event: Any) -> None:
                out.append(("delivered", number, self._index(event)))
                if left[0]:
                    left[0] -= 1
                    self._subscribe(("all",) if spec[1] is None else ("type", spec[1]),
                                    ("collect",), False, None)
            return subscribe
        if kind == "reenter":
            def reenter(event: Any) -> None:
                out.append(("delivered", number, self._index(event)))
                if self.depth < 2:
                    self.depth += 1
                    try:
                        bus.record(spec[1], **_fields(spec[2], self.built))
                    except Exception as exc:
                        out.append(("nested", number, _error(exc)))
                    finally:
                        self.depth -= 1
            return reenter
        raise AssertionError(spec)

    def _where(self, spec: Any) -> Callable[[Any], object] | None:
        if spec is None:
            return None
        kind = spec[0]
        if kind == "data":
            return lambda event: len(event.data) % 2 == spec[1]
        if kind == "raise":
            def where_raises(event: Any) -> bool:
                raise Hostile("where")
            return where_raises
        if kind == "bool_raises":
            return lambda event: BoolRaises()
        return lambda event: spec[1]

    def _subscribe(self, target: Any, handler: Any, once: bool, where: Any) -> None:
        number = len(self.subs)
        on_event: Callable[[Any], object]
        if handler[0] == "sink" and self.sinks:
            on_event = self.sinks[handler[1] % len(self.sinks)][0]
        else:
            on_event = self._handler(number, handler if handler[0] != "sink" else ("collect",))
        event_type_arg = ALL if target[0] == "all" else target[1]
        sub = self.bus.subscribe(event_type_arg, on_event=on_event, once=once,
                                 where=self._where(where))
        self.subs.append(sub)

    def _sink(self, spec: Any, number: int) -> None:
        max_events, max_bytes, overflow, max_batch, failing = spec
        batches: list[list[int]] = []
        entered, release = threading.Event(), threading.Event()
        plug = event_class(EventType.METRIC)(step=-1)

        def handle(batch: Any) -> None:
            if batch and batch[0] is plug:  # the first batch: hold the thread
                entered.set()
                release.wait(60)
                return
            batches.append([self._index(e) for e in batch])
            if len(batches) - 1 in failing:
                raise Hostile(f"sink {number} batch {len(batches) - 1}")

        sink = QueuedSink(handle, name=f"sink{number}", max_events=max_events,
                          max_bytes=max_bytes, overflow=overflow, max_batch=max_batch,
                          flush_interval=0.01, report_interval=3600)
        # The sink's thread takes the plug and waits: what the script enqueues stays queued
        # (or is dropped) exactly as the bounds say, whatever the threads' timing.
        sink(plug)
        if not entered.wait(30):
            raise RuntimeError("a sink's thread did not start")
        self.sinks.append((sink, batches, release))

    def step(self, step: Any) -> None:
        kind = step[0]
        built = self.built
        try:
            if kind == "sub":
                self._subscribe(*step[1:])
                result: Any = ("ok", len(self.subs) - 1)
            elif kind == "cancel":
                if self.subs:
                    self.subs[step[1] % len(self.subs)].cancel()
                result = ("ok",)
            elif kind == "record":
                type_arg = _type_arg(step[1], built)
                fields = _fields(step[2], built)
                _Armed.on = True
                try:
                    result = ("ok", self.bus.record(type_arg, **fields))
                finally:
                    _Armed.on = False
            elif kind == "publish":
                try:
                    event = event_class(step[1])(**_fields(step[2], built))
                except Exception as exc:
                    result = ("not built", _error(exc))
                else:
                    self._index(event)
                    result = ("ok", self.bus.publish(event))
            elif kind == "publish_obj":
                result = ("ok", self.bus.publish(_build(step[1], built)))
            elif kind == "decode":
                contexts: list[JobContext | None] = [current_context(), None]
                rejects: list[str] = []
                entries = [[_type_arg(name, built) if name[0] == "obj" else name[1],
                            _fields(fields, built)] for name, fields in step[1]]
                published = BatchDecoder.publish_all(entries, contexts, self.bus.publish,
                                                     rejects.append)
                result = ("ok", published, rejects)
            else:
                raise AssertionError(step)
        except (Exception, _Interrupt) as exc:
            result = _error(exc)
        self.out.append((kind, result))

    def run(self) -> dict[str, Any]:
        for name, schema in self.script["declared"]:
            _declare(name, schema)
        if self.script["warm"]:
            for cls in event_types().values():
                cls._source  # noqa: B018 (generates the class's code now)
        for number, spec in enumerate(self.script["sinks"]):
            self._sink(spec, number)
        for step in self.script["steps"]:
            self.step(step)
        stats = self.bus.stats()
        queued = []
        for sink, batches, release in self.sinks:
            before = sink.stats()
            release.set()
            flushed = sink.flush(30)
            queued.append((before, flushed, batches, sink.stats()))
        for sink, _, _ in self.sinks:
            sink.close(5)
        with contextlib.suppress(Exception, _Interrupt):  # into closed sinks
            self.bus.record(EventType.METRIC, step=-2)
        closed = [sink.stats() for sink, _, _ in self.sinks]
        events = [_describe_event(e, self.built) for e in self.event_objects]
        return {"steps": self.out, "stats": stats, "sinks": queued, "closed": closed,
                "final stats": self.bus.stats(), "events": events}


def run_script(script: dict[str, Any]) -> dict[str, Any]:
    """A script's transcript on this process's path (compiled or pure Python)."""
    saved = current_context()
    set_context(**CONTEXT)
    try:
        return _Run(script).run()
    finally:
        set_context(**{k: getattr(saved, k) for k in CONTEXT})


# -- the pure-Python side: a child process that runs scripts it reads from its stdin --------

def _send(stream: IO[bytes], obj: Any) -> None:
    data = pickle.dumps(obj)
    stream.write(struct.pack("!Q", len(data)) + data)
    stream.flush()


def _receive(stream: IO[bytes]) -> Any:
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError
    (size,) = struct.unpack("!Q", head)
    return pickle.loads(stream.read(size))


def serve() -> None:
    """The child's loop: a script in, its transcript out, until stdin closes."""
    requests, replies = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # anything printed must not mix with the replies
    while True:
        try:
            script = _receive(requests)
        except EOFError:
            return
        try:
            reply: Any = ("ok", run_script(script))
        except BaseException as exc:  # the runner itself failed: say so, go on
            import traceback

            reply = ("runner failed", "".join(traceback.format_exception(exc)))
        _send(replies, reply)


# Loaded in the child under this module's own name, so that the subscribers' and event
# classes' qualified names (in stats() and reprs) read the same on both paths.
_CHILD = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location(sys.argv[1], sys.argv[2])
module = importlib.util.module_from_spec(spec)
sys.modules[sys.argv[1]] = module
spec.loader.exec_module(module)
module.serve()
"""


class _PurePython:
    def __init__(self) -> None:
        from tests.conftest import subprocess_env

        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (closed by close())
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, __name__, __file__], cwd=ROOT,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
            env=subprocess_env(EVENTBUS_PURE_PYTHON="1"))

    def run(self, script: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            _send(self.proc.stdin, script)
            status, reply = _receive(self.proc.stdout)
        except (EOFError, BrokenPipeError):
            self.log.seek(0)
            raise AssertionError("the pure-Python child died:\n" +
                                 self.log.read()[-4000:].decode(errors="replace")) from None
        assert status == "ok", reply
        return reply  # type: ignore[no-any-return]

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@pytest.fixture(scope="module")
def pure_python() -> Iterator[_PurePython]:
    child = _PurePython()
    yield child
    child.close()


# -- the strategies ------------------------------------------------------------------------

_odd_text = st.text(st.one_of(
    st.sampled_from(["\x00", "\x1f", "\x7f", "\n", "\u2028", "\u2029", "\ud800", "\udfff",
                     "\ufeff", '"', "\\", "é", "\U0001f600", "$", "{"]),
    st.characters()), max_size=10)
_floats = st.one_of(st.floats(), st.sampled_from([math.nan, math.inf, -math.inf, -0.0,
                                                 5e-324, 1.7976931348623157e308]))
_ints = st.one_of(st.integers(-300, 300), st.integers(),
                  st.sampled_from([2**63, -(2**63) - 1, 2**64, 10**400, -(2**4000)]))
_small_ints = st.lists(st.integers(-100, 100), max_size=5)
_hostile_kinds = ["eq", "hash", "repr", "index", "index_raises", "float", "float_raises",
                  "bool_raises", "path", "path_bytes", "str_len", "str_sub", "int_sub",
                  "float_sub", "liar", "enum", "pathlib"]

#: values whose hash is the same in every process (set elements: their order is written)
_hashable = st.one_of(
    st.tuples(st.just("int"), _ints), st.tuples(st.just("bool"), st.booleans()),
    st.tuples(st.just("float"), st.floats(allow_nan=False)),
    st.tuples(st.just("hostile"), st.sampled_from(["eq", "hash", "int_sub"])),
    st.tuples(st.just("tuple"), st.lists(st.tuples(st.just("int"), _ints), max_size=2)))


@st.composite
def _arrays(draw: st.DrawFn) -> Any:
    dtype = draw(st.sampled_from(["float64", "float32", "int64", "int8", "uint8", "bool"]))
    values = draw(st.lists(_floats if dtype.startswith("float") else st.integers(0, 100),
                           max_size=6))
    shape = (len(values),) if len(values) != 4 or draw(st.booleans()) else (2, 2)
    return ("np", dtype, values, shape)


@st.composite
def _tensors(draw: st.DrawFn) -> Any:
    dtype = draw(st.sampled_from(["float32", "float64", "int64", "bool"]))
    if dtype.startswith("float"):
        values: list[Any] = draw(st.lists(st.floats(width=32), max_size=5))
        grad = draw(st.booleans())
    else:
        values = draw(st.lists(st.integers(0, 1) if dtype == "bool" else
                               st.integers(-1000, 1000), max_size=5))
        grad = False
    return ("tensor", dtype, values, grad)


_leaf = st.one_of(
    st.tuples(st.just("int"), _ints), st.tuples(st.just("float"), _floats),
    st.tuples(st.just("str"), _odd_text), st.tuples(st.just("bytes"), st.binary(max_size=6)),
    st.tuples(st.just("bool"), st.booleans()), st.just(("none",)),
    st.tuples(st.just("complex"), _floats, _floats),
    st.tuples(st.just("bytearray"), st.binary(max_size=6)),
    st.tuples(st.just("hostile"), st.sampled_from(_hostile_kinds)),
    _arrays(),
    st.tuples(st.just("np_scalar"), st.sampled_from(["int64", "int32", "uint8"]),
              st.integers(0, 100)),
    st.tuples(st.just("np_scalar"), st.sampled_from(["float64", "float32"]), _floats),
    _tensors(), st.tuples(st.just("tensor_0d"), st.integers(-5, 5)),
    st.sampled_from([("rec_list",), ("rec_dict",), ("np_big",), ("tensor_big",)]),
    st.tuples(st.just("deep"), st.integers(25, 40)),
)
_data_key = st.one_of(st.tuples(st.just("str"), _odd_text),
                      st.tuples(st.just("str"), st.sampled_from(["loss", "step", "$tensor"])),
                      _hashable, st.just(("none",)),
                      st.tuples(st.just("hostile"), st.sampled_from(["eq", "str_sub"])))
_value = st.recursive(_leaf, lambda inner: st.one_of(
    st.tuples(st.sampled_from(["list", "tuple", "len_raises"]), st.lists(inner, max_size=4)),
    st.tuples(st.just("pair"), inner, inner),
    st.tuples(st.sampled_from(["set", "frozenset"]), st.lists(_hashable, max_size=4)),
    st.tuples(st.sampled_from(["dict", "ordered", "items_raises", "dict_lies"]),
              st.lists(st.tuples(_data_key, inner), max_size=4)),
    st.tuples(st.just("proxy"), st.tuples(st.just("dict"),
                                          st.lists(st.tuples(_data_key, inner), max_size=3))),
), max_leaves=10)

#: a plain dict of str keys (what data usually is), or anything else
_data = st.one_of(
    st.tuples(st.just("dict"), st.lists(st.tuples(
        st.tuples(st.just("str"), st.sampled_from(["loss", "lr", "name", "x\u2028"])),
        st.one_of(st.tuples(st.just("float"), _floats), st.tuples(st.just("int"), _ints),
                  st.tuples(st.just("str"), _odd_text), _value)), max_size=4)),
    st.tuples(st.just("dict"), st.just([])), st.just(("none",)), _value)

_VALID = {"int": st.integers(-(2**40), 2**40), "float": st.floats(), "str": st.text(max_size=8),
          "bool": st.booleans()}
_KIND_VALUES = {
    "int": st.one_of(*[st.tuples(st.just("int"), st.integers(-(2**40), 2**40))] * 6,
                     st.tuples(st.just("int"), _ints),
                     st.sampled_from([("hostile", "index"), ("hostile", "index_raises"),
                                      ("hostile", "int_sub"), ("hostile", "liar"),
                                      ("np_scalar", "int64", 3), ("tensor_0d", 2),
                                      ("bool", True)])),
    "float": st.one_of(*[st.tuples(st.just("float"), st.floats())] * 6,
                       st.tuples(st.just("float"), _floats),
                       st.tuples(st.just("int"), st.integers(-5, 5)),
                       st.sampled_from([("hostile", "float"), ("hostile", "float_raises"),
                                        ("hostile", "float_sub"), ("int", 2**2000),
                                        ("np_scalar", "float32", 0.5), ("bool", False)])),
    "str": st.one_of(*[st.tuples(st.just("str"), st.text(max_size=8))] * 6,
                     st.tuples(st.just("str"), _odd_text),
                     st.sampled_from([("hostile", "path"), ("hostile", "path_bytes"),
                                      ("hostile", "pathlib"), ("hostile", "str_sub"),
                                      ("hostile", "str_len"), ("hostile", "enum"),
                                      ("bytes", b"x")])),
    "bool": st.one_of(*[st.tuples(st.just("bool"), st.booleans())] * 6,
                      st.sampled_from([("np_scalar", "bool", 1), ("int", 1)])),
}

_FIELD_NAMES = ["alpha", "beta", "gamma", "n", "label"]


@st.composite
def _schemas(draw: st.DrawFn) -> tuple[str, tuple[tuple[str, str, str], ...]]:
    names = draw(st.lists(st.sampled_from(_FIELD_NAMES), unique=True, max_size=4))
    fields = [(n, draw(st.sampled_from(["int", "float", "str", "bool"])),
               draw(st.sampled_from(["required", "none", "default"]))) for n in names]
    fields.sort(key=lambda f: f[2] != "required")  # no required field after a default
    schema = tuple(fields)
    digest = hashlib.sha1(repr(schema).encode()).hexdigest()[:10]
    return f"DIFF_{digest}", schema


#: the typed fields of the built-in types, for the scripts to give
_BUILTIN_FIELDS = {
    name: {f: kind.__name__ for f, (kind, _) in event_class(name)._fields.items()}
    for name in BUILTIN}


def _fields_of(name: str, declared: dict[str, Any]) -> dict[str, str]:
    if name in declared:
        return {f: kind for f, kind, _ in declared[name]}
    return _BUILTIN_FIELDS.get(name, {})


@st.composite
def _field_items(draw: st.DrawFn, name: str, declared: dict[str, Any]) -> list[Any]:
    """The keyword arguments of a call for type ``name``: half the time a valid call (its
    required fields rightly typed, some optional ones, data), else anything: wrongly typed
    or missing fields, odd keyword names, an unknown or a reserved one."""
    own = _fields_of(name, declared)
    valid = draw(st.booleans())
    cls = event_class(name) if name in BUILTIN else None
    items: list[Any] = []
    for field, kind in own.items():
        optional = (cls is not None and field in vars(cls)) or any(
            f == field and d != "required" for f, _, d in declared.get(name, ()))
        if valid:
            if optional and draw(st.booleans()):
                continue
            value = draw(st.tuples(st.just(kind), _VALID[kind]))
        elif draw(st.integers(0, 9)) == 0:
            continue  # missing
        elif draw(st.integers(0, 9)) == 0:
            value = draw(_value)
        else:
            value = draw(_KIND_VALUES[kind])
        key_kind = "plain" if valid else draw(st.sampled_from(["plain"] * 14 + ["sub", "evil"]))
        items.append(((key_kind, field), value))
    if draw(st.integers(0, 3)):
        items.append((("plain", "data"), draw(_data)))
    extra = 9 if valid else draw(st.integers(0, 5))
    if extra == 0:
        items.append((("plain", draw(st.sampled_from(
            ["bogus", "timestamp", "context", "type", "alpah", "step", "worker_id"]))),
            draw(_leaf)))
    elif extra == 1:
        items.append((("plain", draw(_odd_text)), draw(_leaf)))
    if items and draw(st.integers(0, 3)) == 0:
        items = draw(st.permutations(items))
    return items


@st.composite
def _scripts(draw: st.DrawFn) -> dict[str, Any]:
    declared = dict(draw(st.lists(_schemas(), max_size=2)))
    types_ = BUILTIN + sorted(declared)
    pick = st.sampled_from(types_)
    sinks = draw(st.lists(st.tuples(
        st.integers(1, 5), st.sampled_from([400, 700, 1_500, 10**7]),
        st.sampled_from(["drop-newest", "drop-oldest"]), st.integers(1, 3),
        st.frozensets(st.integers(0, 3), max_size=2)), min_size=1, max_size=2))

    def handler() -> Any:
        kind = draw(st.sampled_from(["collect"] * 4 + ["raise", "interrupt", "cancel",
                                                       "subscribe", "reenter"] + ["sink"] * 4))
        if kind == "cancel":
            return ("cancel", draw(st.integers(0, 6)))
        if kind == "subscribe":
            return ("subscribe", draw(st.one_of(st.none(), pick)))
        if kind == "reenter":
            name = draw(pick)
            return ("reenter", name, draw(_field_items(name, declared)))
        if kind == "sink":
            return ("sink", draw(st.integers(0, 3)))
        return (kind,)

    def type_arg(name: str) -> Any:
        how = draw(st.integers(0, 19))
        if how < 6 and name in BUILTIN:
            return ("member", name)
        if how < 12:
            return ("name", name)
        if how < 14:
            return ("class", name)
        if how == 14:
            return ("sub", name)
        if how == 15:
            return ("name", draw(st.sampled_from(["NOPE", "metric", "", "METRIC "])))
        if how == 16:
            return ("obj", draw(_leaf))
        return ("name", name)

    steps: list[Any] = [("sub", ("all",) if draw(st.integers(0, 2)) else ("type", draw(pick)),
                         ("sink", number), draw(st.integers(0, 5)) == 0, None)
                        for number in range(len(sinks)) if draw(st.integers(0, 4))]
    for _ in range(draw(st.integers(0, 4))):
        target = draw(st.one_of(st.just(("all",)), st.tuples(st.just("type"), pick)))
        where = draw(st.one_of(st.none(), st.none(), st.none(),
                               st.tuples(st.just("data"), st.integers(0, 1)),
                               st.sampled_from([("raise",), ("bool_raises",),
                                                ("const", False), ("const", 1)])))
        steps.append(("sub", target, handler(), draw(st.booleans()), where))
    for _ in range(draw(st.integers(1, 14))):
        what = draw(st.integers(0, 19))
        name = draw(pick)
        if what < 11:
            steps.append(("record", type_arg(name), draw(_field_items(name, declared))))
        elif what < 13:
            steps.append(("publish", name, draw(_field_items(name, declared))))
        elif what == 13:
            steps.append(("publish_obj", draw(_leaf)))
        elif what < 16:
            entries = []
            for _ in range(draw(st.integers(1, 3))):
                entry_type = draw(pick)
                items = draw(_field_items(entry_type, declared))
                items.append((("plain", "timestamp"), draw(st.one_of(
                    st.just(("float", 1.5)), st.just(("int", 2)), _leaf))))
                items.append((("plain", "context"), draw(st.sampled_from(
                    [("int", 0)] * 6 + [("int", 1), ("int", 2), ("none",), ("bool", False)]))))
                name_spec = ("name", entry_type) if draw(st.integers(0, 7)) else \
                    draw(st.sampled_from([("name", "NOPE"), ("obj", ("int", 1))]))
                entries.append((name_spec, items))
            steps.append(("decode", entries))
        elif what < 18:
            target = draw(st.one_of(st.just(("all",)), st.tuples(st.just("type"), pick)))
            steps.append(("sub", target, handler(), draw(st.booleans()), None))
        else:
            steps.append(("cancel", draw(st.integers(0, 6))))
    return {"seed": draw(st.integers(0, 2**32)), "strict": draw(st.integers(0, 9)) == 0,
            "warm": draw(st.booleans()), "declared": sorted(declared.items()),
            "sinks": sinks, "steps": steps}


def _first_difference(a: Any, b: Any, path: str = "") -> str:
    if type(a) is not type(b):
        return f"{path}: {a!r:.300} != {b!r:.300}"
    if isinstance(a, dict):
        for key in list(a) + [k for k in b if k not in a]:
            if a.get(key, "<absent>") != b.get(key, "<absent>"):
                return _first_difference(a.get(key, "<absent>"), b.get(key, "<absent>"),
                                         f"{path}[{key!r}]")
    if isinstance(a, (list, tuple)):
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            if x != y:
                return _first_difference(x, y, f"{path}[{i}]")
        if len(a) != len(b):
            return f"{path}: lengths {len(a)} != {len(b)}"
    return f"{path}: {a!r:.300} != {b!r:.300}"


# -- the test ------------------------------------------------------------------------------

needs_compiled = pytest.mark.skipif(
    speedups is None, reason="eventbus._speedups is not built (no C compiler) or disabled "
    "(EVENTBUS_PURE_PYTHON): there is only one path to compare")


@pytest.mark.slow
@needs_compiled
@settings(max_examples=EXAMPLES, deadline=None, derandomize=not RANDOM,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(script=_scripts())
def test_the_compiled_and_the_pure_python_paths_give_the_same_transcript(
        script: dict[str, Any], pure_python: _PurePython) -> None:
    """Random scripts of records, publishes, decodes, subscribers and sinks: the compiled
    path gives every result, error, delivery, event, count and queue state that the
    pure-Python one gives."""
    compiled = run_script(script)
    pure = pure_python.run(script)
    if compiled != pure:
        raise AssertionError(
            "the compiled path (left) and the pure-Python one (right) differ at "
            f"{_first_difference(compiled, pure)}\nscript: {script!r:.4000}")


@needs_compiled
def test_the_pure_python_child_really_runs_the_pure_python_path(
        pure_python: _PurePython) -> None:
    """What the test above compares is two paths: the child's record() is the Python
    method, this process's the compiled Recorder."""
    probe = {"seed": 0, "strict": False, "warm": False, "declared": [], "sinks": [],
             "steps": [("publish_obj", ("str", "probe"))]}
    assert pure_python.run(probe) == run_script(probe)
    check = ("import eventbus; from eventbus._compiled import speedups; "
             "print(speedups, type(eventbus.get_default_bus().record).__name__)")
    from tests.conftest import subprocess_env

    child = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                           env=subprocess_env(EVENTBUS_PURE_PYTHON="1"), timeout=60,
                           check=True)
    assert child.stdout.split() == ["None", "method"]
    assert type(Bus("probe").record).__name__ == "Recorder"
