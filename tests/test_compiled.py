"""The compiled hot path (eventbus/_speedups.c) against the pure-Python one it stands in for.

The compiled record(), decoder and enqueue take only the common case and hand anything
else to the Python code with the same arguments; these tests pin that the two give the
same events, the same errors and the same queue state for every kind of call, and what the
compiled path adds: events of atomic values are invisible to the garbage collector.
"""

from __future__ import annotations

import gc
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import threading
import types
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import eventbus
from eventbus import ALL
from eventbus import Bus
from eventbus import EventType
from eventbus._compiled import speedups
from eventbus.context import current_context
from eventbus.events import event_class
from eventbus.subscribers.queued import QueuedSink
from eventbus.subscribers.queued import estimate_size
from tests.conftest import subprocess_env

needs_compiled = pytest.mark.skipif(speedups is None,
                                    reason="eventbus._speedups is not built or disabled")


def _compiler() -> str | None:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(cc)


def test_the_compiled_path_is_built_where_a_compiler_is() -> None:
    """`make test` builds eventbus._speedups: where a C compiler is at hand, a missing
    module is a broken build, not a reason to test only the Python path."""
    if os.environ.get("EVENTBUS_PURE_PYTHON", "") not in ("", "0"):
        assert speedups is None
        pytest.skip("EVENTBUS_PURE_PYTHON is set: the pure-Python path is under test")
    if _compiler() is None:
        pytest.skip("no C compiler here: eventbus runs its pure-Python path")
    assert speedups is not None, "eventbus._speedups did not build (pip install -e .)"
    assert type(eventbus.get_default_bus().record).__name__ == "Recorder"


def _pure(bus: Bus) -> Bus:
    """``bus`` with its record() set back to the pure-Python method."""
    bus.record = types.MethodType(Bus.record, bus)  # type: ignore[method-assign]
    return bus


def _outcome(bus: Bus, event_type: Any, fields: dict[str, Any]) -> Any:
    got: list[eventbus.Event] = []
    sub = bus.subscribe(ALL, on_event=got.append)
    try:
        bus.record(event_type, **fields)
    except Exception as exc:
        return ("raised", type(exc), str(exc))
    finally:
        sub.cancel()
    [event] = got
    snapshot = {k: v for k, v in event.__dict__.items() if k != "timestamp"}
    return ("event", type(event), list(event.__dict__), repr(snapshot),
            type(event.data), bus.stats()["published"])


class _Weird:
    def __repr__(self) -> str:
        return "<weird>"


class _HashingMeta(type):
    """A metaclass with its own __hash__: looking its classes up in a set runs Python
    code, which could change ``data`` while it is read (the compiled copy leaves such
    values to the Python one)."""

    def __hash__(cls) -> int:
        return 1


class _Odd(metaclass=_HashingMeta):
    def __repr__(self) -> str:
        return "<odd>"


CALLS: list[tuple[Any, dict[str, Any]]] = [
    (EventType.WORKER_EXIT, {"worker_id": 0, "exit_code": 1}),
    (EventType.WORKER_EXIT, {"worker_id": 0, "exit_code": 1, "data": {"a": 1, "b": "x"}}),
    (EventType.WORKER_EXIT, {"data": {"a": 1.5}, "exit_code": 1, "worker_id": 0}),
    (EventType.WORKER_EXIT, {"worker_id": 0, "exit_code": 1, "data": None}),
    (EventType.WORKER_EXIT, {"worker_id": 0, "exit_code": 1, "data": {}}),
    (EventType.WORKER_EXIT, {"worker_id": 0, "exit_code": 1, "data": {"l": [1, [2]]}}),
    (EventType.WORKER_EXIT, {"worker_id": 0, "exit_code": 1, "data": {"a": np.arange(3)}}),
    (EventType.WORKER_EXIT, {"worker_id": 0, "exit_code": 1, "data": OrderedDict(a=1)}),
    (EventType.WORKER_EXIT, {"worker_id": 0, "exit_code": 1, "data": {1: "int key"}}),
    (EventType.WORKER_EXIT, {"worker_id": 0, "exit_code": 1, "data": [1, 2]}),
    (EventType.WORKER_EXIT, {"worker_id": 0, "exit_code": 1, "data": {"w": _Weird()}}),
    (EventType.WORKER_EXIT, {"worker_id": 0, "exit_code": 1, "data": {"o": _Odd(), "n": 1}}),
    (EventType.WORKER_EXIT, {"worker_id": 0, "exit_code": 1, "signal": "SIGTERM"}),
    (EventType.WORKER_EXIT, {"worker_id": 0, "exit_code": 1, "signal": None}),
    (EventType.WORKER_EXIT, {"worker_id": 0, "exit_code": 1, "worker_pid": np.int64(7)}),
    (EventType.WORKER_EXIT, {"worker_id": np.int64(3), "exit_code": 1}),
    (EventType.WORKER_EXIT, {"worker_id": True, "exit_code": 1}),
    (EventType.WORKER_EXIT, {"worker_id": 1.0, "exit_code": 1}),
    (EventType.WORKER_EXIT, {"worker_id": None, "exit_code": 1}),
    (EventType.WORKER_EXIT, {"worker_id": 0}),
    (EventType.WORKER_EXIT, {"worker_id": 0, "exit_cod": 1}),
    (EventType.WORKER_EXIT, {"worker_id": 0, "exit_code": 1, "bogus": 2}),
    (EventType.WORKER_EXIT, {"worker_id": 0, "exit_code": 1, "timestamp": 1.0}),
    (EventType.WORKER_EXIT, {"worker_id": 0, "exit_code": 1, "context": None}),
    (EventType.WORKER_EXIT, {}),
    ("WORKER_EXIT", {"worker_id": 0, "exit_code": 1}),
    (event_class(EventType.WORKER_EXIT), {"worker_id": 0, "exit_code": 1}),
    ("NO_SUCH_TYPE", {"x": 1}),
    ([], {"x": 1}),
    (EventType.METRIC, {}),
    (EventType.METRIC, {"step": 3, "data": {"loss": 0.5}}),
    (EventType.METRIC, {"step": None, "data": {"loss": 0.5}}),
    (EventType.METRIC, {"step": "3"}),
    (EventType.METRIC, {"data": {"nan": float("nan"), "b": b"x", "c": 1j, "n": None}}),
    (EventType.CHECKPOINT_SAVED, {"path": Path("/tmp/x"), "step": 1}),
    (EventType.CHECKPOINT_SAVED, {"path": "/tmp/x", "step": 1}),
]


@needs_compiled
@pytest.mark.parametrize(("event_type", "fields"), CALLS,
                         ids=[f"{i}-{t!s}" for i, (t, _) in enumerate(CALLS)])
def test_compiled_record_matches_the_python_path(event_type: Any,
                                                 fields: dict[str, Any]) -> None:
    compiled, pure = Bus("compiled"), _pure(Bus("pure"))
    assert type(compiled.record).__name__ == "Recorder"
    for _ in range(2):  # the first call of a type generates its code: both paths
        assert _outcome(compiled, event_type, dict(fields)) == \
            _outcome(pure, event_type, dict(fields))


@needs_compiled
def test_the_usual_call_takes_the_compiled_path_and_the_rest_the_python_one() -> None:
    """What the parity test above compares is really two paths: the compiled record()
    counts what it publishes in its view, the Python one in the slot's own counter, and
    stats() adds the two."""
    from eventbus.bus import _count_value

    Bus("warm-up").record(EventType.WORKER_EXIT, worker_id=0, exit_code=1)  # code generated
    bus = Bus("split")
    bus.subscribe(EventType.WORKER_EXIT, on_event=lambda e: None)
    slot = bus._slots[EventType.WORKER_EXIT]
    for _ in range(4):
        bus.record(EventType.WORKER_EXIT, worker_id=0, exit_code=1, data={"a": 1})
    bus.record(EventType.WORKER_EXIT, worker_id=np.int64(0), exit_code=1)  # coerced
    bus.record("WORKER_EXIT", worker_id=0, exit_code=1)  # by name: the dict hit serves
    assert (slot.view.count, _count_value(slot.published)) == (5, 1)
    assert bus.stats()["published"] == {"WORKER_EXIT": 6}


@needs_compiled
def test_keywords_that_are_not_interned_still_take_the_fast_path() -> None:
    """record(**fields) with names built at run time (not the compiler's interned
    constants) matches them by text."""
    bus = Bus("dynamic")
    bus.record(EventType.WORKER_EXIT, worker_id=0, exit_code=0)  # its code generated
    got: list[eventbus.Event] = []
    bus.subscribe(EventType.WORKER_EXIT, on_event=got.append)
    view = bus._slots[EventType.WORKER_EXIT].view
    before = view.count
    names = ["".join(["worker", "_id"]), "".join(["exit", "_code"]), "".join(["da", "ta"])]
    bus.record(EventType.WORKER_EXIT, **dict(zip(names, [1, 2, {"k": 3}], strict=True)))
    assert (got[0].worker_id, got[0].exit_code, dict(got[0].data)) == (1, 2, {"k": 3})
    assert view.count == before + 1  # the compiled path took it


@needs_compiled
def test_compiled_record_keeps_the_delivery_semantics() -> None:
    """A raising subscriber is counted and the next still gets the event; a strict bus
    re-raises; KeyboardInterrupt goes straight out; a subscriber that cancels another
    mid-dispatch does not stop it for this event."""
    bus = Bus("semantics")
    seen: list[str] = []

    def boom(event: eventbus.Event) -> None:
        raise RuntimeError("boom")

    bus.subscribe(EventType.METRIC, on_event=boom)
    later = bus.subscribe(EventType.METRIC, on_event=lambda e: seen.append("later"))
    bus.subscribe(EventType.METRIC, on_event=lambda e: later.cancel(), once=True)
    bus.record(EventType.METRIC, step=1)
    bus.record(EventType.METRIC, step=2)
    assert seen == ["later"]  # the cancel took effect from the next event
    stats = {s["subscriber"].rsplit(".", 1)[-1]: s for s in bus.stats()["subscribers"]}
    assert stats["boom"]["failed"] == 2 and bus.stats()["published"] == {"METRIC": 2}

    bus.strict = True
    with pytest.raises(RuntimeError, match="boom"):
        bus.record(EventType.METRIC, step=3)

    stop = Bus("interrupt")

    def interrupt(event: eventbus.Event) -> None:
        raise KeyboardInterrupt

    stop.subscribe(EventType.METRIC, on_event=interrupt)
    after = stop.subscribe(EventType.METRIC, on_event=lambda e: seen.append("after"))
    with pytest.raises(KeyboardInterrupt):
        stop.record(EventType.METRIC, step=1)
    assert "after" not in seen and after.stats()["failed"] == 0


@needs_compiled
def test_compiled_publish_matches_the_python_path() -> None:
    """publish() of a built event: the same deliveries, counts and failures; anything
    that is not an event gets the Python method's error."""
    compiled, pure = Bus("compiled-publish"), Bus("pure-publish")
    pure.publish = types.MethodType(Bus.publish, pure)  # type: ignore[method-assign]
    assert type(compiled.publish).__name__ == "Publisher"
    event = event_class(EventType.METRIC)(step=1, data={"loss": 0.5})
    outcomes = []
    for bus in (compiled, pure):
        got: list[eventbus.Event] = []
        bus.subscribe(EventType.METRIC, on_event=got.append)
        bus.subscribe(ALL, on_event=lambda e: 1 / 0)
        bus.subscribe(ALL, on_event=got.append)
        bus.publish(event)
        bus.publish(event_class(EventType.WORKER_EXIT)(worker_id=1, exit_code=0))
        with pytest.raises(TypeError) as error:
            bus.publish("not an event")  # type: ignore[arg-type]
        outcomes.append(([type(e).__name__ for e in got], got[0] is event,
                         bus.stats()["published"],
                         [s["failed"] for s in bus.stats()["subscribers"]], str(error.value)))
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][0] == ["Metric", "Metric", "WorkerExit"]


@needs_compiled
def test_compiled_record_is_the_bus_method_to_introspection() -> None:
    bus = eventbus.get_default_bus()
    assert eventbus.record is bus.record
    assert bus.record.__self__ is bus and bus.record.__func__ is Bus.record  # type: ignore[attr-defined]
    import inspect
    assert list(inspect.signature(bus.record).parameters) == ["event_type", "fields"]
    assert bus.record.__doc__ == Bus.record.__doc__


@needs_compiled
def test_a_bus_subclass_overriding_record_keeps_its_own() -> None:
    class Counting(Bus):
        calls = 0

        def record(self, event_type: Any, /, **fields: Any) -> None:
            Counting.calls += 1
            super().record(event_type, **fields)

    bus = Counting("sub")
    bus.record(EventType.METRIC, step=1)
    assert Counting.calls == 1


@needs_compiled
def test_events_of_atomic_values_are_not_tracked_by_the_collector() -> None:
    """An event whose fields and data are numbers and strings cannot be in a reference
    cycle, so the compiled path leaves it, its __dict__ and its data out of the garbage
    collector's sight: a backlog of them costs no collection. One with a container in its
    data stays tracked, as does its context."""
    bus = Bus("gc")
    got: list[eventbus.Event] = []
    bus.subscribe(ALL, on_event=got.append)
    bus.record(EventType.METRIC, step=1, data={"loss": 0.5, "name": "x"})
    bus.record(EventType.METRIC, step=1, data={"losses": [0.5]})
    bus.record(EventType.METRIC, step=1, data={1: 0.5})  # a key that is not a str
    plain, nested, odd_key = got
    assert not gc.is_tracked(plain) and not gc.is_tracked(plain.__dict__)
    assert not gc.is_tracked(plain.data)
    assert gc.is_tracked(nested) and gc.is_tracked(odd_key)
    assert gc.is_tracked(current_context())

    kept: list[eventbus.Event] = []
    bus.subscribe(EventType.WORKER_EXIT, on_event=kept.append)
    before = len(gc.get_objects())
    for i in range(3_000):
        bus.record(EventType.WORKER_EXIT, worker_id=i, exit_code=0, data={"a": 1})
    grown = len(gc.get_objects()) - before
    # What each collection traverses. Tracked, each kept event would add three objects
    # (event, __dict__, data): 9,000.
    assert grown < 300, grown
    assert [e.worker_id for e in kept] == list(range(3_000))


@needs_compiled
def test_untracked_events_are_still_freed() -> None:
    import weakref

    bus = Bus("free")
    refs: list[weakref.ref[eventbus.Event]] = []
    bus.subscribe(EventType.METRIC, on_event=lambda e: refs.append(weakref.ref(e)))
    for i in range(100):
        bus.record(EventType.METRIC, step=i, data={"v": i})
    assert refs and all(r() is None for r in refs)


def _shape(value: Any) -> Any:
    """A value as a snapshot left it: each container's class and items, an array's
    values and writeability, anything else by class and repr."""
    if isinstance(value, dict):
        return (type(value).__name__, type(value).__module__,
                [(k, _shape(v)) for k, v in value.items()])
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(map(repr, value)) if isinstance(value, (set, frozenset)) \
            else [_shape(v) for v in value]
        return (type(value).__name__, type(value).__module__, items)
    if isinstance(value, np.ndarray):
        return ("ndarray", value.tolist(), value.flags.writeable)
    return (type(value).__name__, repr(value))


@needs_compiled
def test_compiled_snapshot_matches_the_python_snapshot() -> None:
    """The compiled record() copies ``data`` by snapshot.py's rules (it reads ATOMIC and
    calls the Python snapshot for anything else): for random data, the event's data is
    the same as the pure-Python record()'s and the constructor's, class by class."""
    import random
    from collections import namedtuple

    Pair = namedtuple("Pair", "a b")

    class Text(str):
        pass

    class Number(int):
        pass

    rng = random.Random(11)
    leaves: list[Any] = [0, -1, 2**80, 1.5, float("inf"), "s", "", True, None, b"b", 1j,
                         Text("t"), Number(3), np.int64(4), np.float32(0.5), _Weird(),
                         _Odd(), bytearray(b"ba")]

    def value(depth: int) -> Any:
        kind = rng.randrange(9 if depth < 3 else 1)
        if kind == 1:
            return [value(depth + 1) for _ in range(rng.randrange(3))]
        if kind == 2:
            return {f"n{i}": value(depth + 1) for i in range(rng.randrange(3))}
        if kind == 3:
            return tuple(value(depth + 1) for _ in range(rng.randrange(3)))
        if kind == 4:
            return {rng.randrange(5) for _ in range(rng.randrange(3))}
        if kind == 5:
            return Pair(value(depth + 1), 1)
        if kind == 6:
            return np.arange(rng.randrange(1, 4))
        return rng.choice(leaves)

    metric = event_class(EventType.METRIC)
    metric._source  # noqa: B018 (generates the class's code: the compiled path takes all)
    compiled, pure = Bus("snap-compiled"), _pure(Bus("snap-pure"))
    got: dict[str, list[eventbus.Event]] = {"compiled": [], "pure": []}
    compiled.subscribe(EventType.METRIC, on_event=got["compiled"].append)
    pure.subscribe(EventType.METRIC, on_event=got["pure"].append)
    for i in range(400):
        data = {f"k{j}": value(0) for j in range(rng.randrange(5))}
        compiled.record(EventType.METRIC, step=i, data=data)
        pure.record(EventType.METRIC, step=i, data=data)
        built = metric(step=i, data=data)
        a, b = got["compiled"][-1].data, got["pure"][-1].data
        assert _shape(a) == _shape(b) == _shape(built.data), data
    assert compiled._slots[EventType.METRIC].view.count == 400  # the compiled path ran


@needs_compiled
def test_a_spec_refuses_an_atomic_set_without_the_usual_classes() -> None:
    """The compiled snapshot shares floats, ints, strs, bools and None without looking
    them up in snapshot.ATOMIC; a Spec made with an ATOMIC lacking one is refused, so the
    shortcut cannot outlive the rule it stands for."""
    import time

    from eventbus.context import _holder
    from eventbus.snapshot import ATOMIC

    assert speedups is not None
    metric = event_class(EventType.METRIC)
    for missing in (float, int, str, bool, type(None)):
        with pytest.raises(ValueError, match=missing.__name__):
            speedups.Spec(cls=metric, names=(), kinds=(), nullable=(), n_required=0,
                          empty={}, snap=dict, atomic=ATOMIC - {missing}, time=time.time,
                          holder=_holder, set_dict=eventbus.Event.__dict__["__dict__"])


# -- the receiver's decoder -----------------------------------------------------------------

DECODES: list[tuple[Any, dict[str, Any]]] = [
    (EventType.WORKER_EXIT, {"worker_id": 0, "exit_code": 1, "data": {"a": 1}}),
    (EventType.WORKER_EXIT, {"worker_id": 0, "exit_code": 1}),
    (EventType.WORKER_EXIT, {"worker_id": 0, "exit_code": 1, "data": {"l": [1, {"x": 2}]}}),
    (EventType.WORKER_EXIT, {"worker_id": 0, "exit_code": 1.0}),
    (EventType.WORKER_EXIT, {"worker_id": 0}),
    (EventType.WORKER_EXIT, {"worker_id": 0, "exit_code": 1, "extra": 1}),
    (EventType.WORKER_EXIT, {"worker_id": 0, "exit_code": 1, "data": [1]}),
    (EventType.METRIC, {"step": None, "data": {"loss": 0.5}}),
    (EventType.METRIC, {"step": "x"}),
]


@needs_compiled
@pytest.mark.parametrize(("event_type", "fields"), DECODES)
def test_compiled_decode_matches_the_python_decoder(event_type: Any,
                                                    fields: dict[str, Any]) -> None:
    cls = event_class(event_type)
    cls._source  # noqa: B018 (generates the class's code)
    spec = cls.__dict__["_spec"]
    context = current_context()
    compiled = spec.decode(dict(fields), 12.5, context)

    def python() -> Any:
        try:
            return cls._decode(dict(fields), 12.5, context)
        except (TypeError, ValueError) as exc:
            return exc

    expected = python()
    if compiled is None:  # handed back: the Python decoder decides
        return
    assert not isinstance(expected, Exception)
    assert compiled.__dict__ == expected.__dict__
    assert list(compiled.__dict__) == list(expected.__dict__)
    assert type(compiled.data) is type(expected.data)


@needs_compiled
def test_compiled_decode_hands_back_what_it_does_not_take() -> None:
    spec = event_class(EventType.WORKER_EXIT).__dict__["_spec"]
    context = current_context()
    for fields in [{"worker_id": 0}, {"worker_id": 0, "exit_code": "1"},
                   {"worker_id": 0, "exit_code": 1, "x": 1}, {1: 0},
                   {"worker_id": 0, "exit_code": 1, "data": [1]}]:
        before = dict(fields)
        assert spec.decode(fields, 1.0, context) is None
        assert fields == before  # untouched, for the Python decoder


# -- the queued sink's enqueue ----------------------------------------------------------------

def _state(sink: QueuedSink) -> tuple[Any, ...]:
    return (sink.queued_bytes, list(sink._sizes), len(sink._queue), dict(sink.dropped),
            sink.enqueued)


@needs_compiled
@pytest.mark.parametrize("options", [
    {}, {"max_events": 3}, {"max_bytes": 2_000}, {"max_events": 3, "overflow": "drop-newest"},
    {"max_bytes": 700},
])
def test_compiled_enqueue_matches_the_python_path(options: dict[str, Any]) -> None:
    """The same events through the compiled enqueue and through ``__call__`` leave the
    same bytes, sizes, queue and drops, whether the queue has room, evicts or refuses.
    Neither sink's thread runs (a long interval and a batch bigger than the test)."""
    cls = event_class(EventType.METRIC)
    events = [cls(step=i, data=data) for i, data in enumerate([
        {}, {"loss": 0.5}, {"name": "x" * 100}, {"l": list(range(10))}, {"a": np.zeros(8)},
        {"b": b"xyz", "n": None, "t": True}, {"big": "y" * 1_000}, {"loss": 1.5},
    ])]
    compiled_sink = QueuedSink(lambda batch: None, name="compiled", **options)
    python_sink = QueuedSink(lambda batch: None, name="python", **options)
    try:
        enqueue = compiled_sink._eventbus_direct()
        assert type(enqueue).__name__ == "Enqueuer"
        for sink in (compiled_sink, python_sink):
            # a thread never started: a kick wakes no one, and the queues stay as the
            # enqueues left them
            sink._thread = threading.Thread(target=lambda: None)
            sink._sync_direct()
        for event in events:
            enqueue(event)
            python_sink(event)
            assert _state(compiled_sink) == _state(python_sink)
        assert compiled_sink.queued_bytes == sum(estimate_size(e) for e in compiled_sink._queue)
        for sink in (compiled_sink, python_sink):  # closed: an enqueue is dropped as such
            with sink._lock:
                sink._queue.clear()
                sink._sizes.clear()
                sink.queued_bytes = 0
            sink.close(0)
        enqueue(events[0])
        python_sink(events[0])
        assert compiled_sink.dropped == python_sink.dropped
        assert compiled_sink.dropped.get("closed") == 1
    finally:
        compiled_sink.close(0)
        python_sink.close(0)


@needs_compiled
def test_compiled_enqueue_sizes_events_as_estimate_size_does() -> None:
    """The compiled enqueue walks ``data`` itself but reads estimate_size()'s rules (its
    constants, its free classes, _value_size for the rest): each event's queued size is
    estimate_size()'s, for every kind of value, including subclasses of the free ones."""
    import enum
    import random

    class Flag(enum.IntEnum):
        ON = 1

    class Text(str):
        pass

    rng = random.Random(7)
    values: list[Any] = [0, 1.5, True, None, 2**70, "x" * 37, b"by", bytearray(b"12345"),
                         Text("sub"), Flag.ON, [1, 2, 3], (1,), {"a": 1, "b": 2}, {1, 2},
                         frozenset({3}), np.zeros(5), np.float64(1.0), 1j, _Weird()]
    cls = event_class(EventType.METRIC)
    events = [cls(step=i, data={f"k{j}": rng.choice(values) for j in range(rng.randrange(6))})
              for i in range(300)]
    sink = QueuedSink(lambda batch: None, name="sizes", max_events=1_000,
                      max_bytes=1 << 40)
    try:
        sink._thread = threading.Thread(target=lambda: None)  # never started: sizes stay
        sink._sync_direct()
        enqueue = sink._eventbus_direct()
        assert type(enqueue).__name__ == "Enqueuer"
        for event in events:
            enqueue(event)
        assert list(sink._sizes) == [estimate_size(e) for e in events]
        assert sink.queued_bytes == sum(sink._sizes)
    finally:
        sink.close(0)


def test_the_compiled_code_looks_up_no_private_python_name() -> None:
    """eventbus/_speedups.c names no ``_``-prefixed attribute of a Python object (dunders
    aside): what it needs of the bus and the sinks is handed to it as callables and public
    attributes, so renaming a private method cannot silently break it."""
    source = (Path(__file__).resolve().parents[1] / "eventbus" / "_speedups.c").read_text()
    names = set(re.findall(r'"(_[A-Za-z0-9_]*)"', source))
    assert {n for n in names if not (n.startswith("__") and n.endswith("__"))} == set()


@needs_compiled
def test_compiled_enqueue_starts_and_wakes_the_sink() -> None:
    handled: list[eventbus.Event] = []
    sink = QueuedSink(handled.extend, name="wakes", max_batch=10)
    bus = Bus("wakes")
    bus.subscribe(ALL, on_event=sink)
    try:
        for i in range(1_000):
            bus.record(EventType.METRIC, step=i)
        assert sink.flush(10)
        assert [e.step for e in handled] == list(range(1_000))
        assert sink._thread is not None
    finally:
        sink.close(5)


@needs_compiled
def test_sinks_that_are_not_plain_keep_the_python_enqueue() -> None:
    class Own(QueuedSink):
        seen = 0

        def __call__(self, event: eventbus.Event) -> None:
            Own.seen += 1
            super().__call__(event)

    own = Own(lambda batch: None, name="own")
    custom = QueuedSink(lambda batch: None, name="custom", size_of=lambda e: 10)
    try:
        assert own._eventbus_direct() == own.__call__
        bus = Bus("own")
        bus.subscribe(ALL, on_event=own)
        bus.subscribe(ALL, on_event=custom)
        bus.record(EventType.METRIC, step=1)
        assert Own.seen == 1
        assert custom.flush(5) and custom.queued_bytes == 0 and custom.enqueued == 1
    finally:
        own.close(0)
        custom.close(0)


PURE_RUN = r"""
import gc, eventbus
from eventbus import ALL, EventType
from eventbus._compiled import speedups
got = []
eventbus.get_default_bus().subscribe(ALL, on_event=got.append)
eventbus.record(EventType.METRIC, step=1, data={"loss": 0.5})
eventbus.record(EventType.METRIC, step=2, data={"loss": 0.5})
print(speedups, type(eventbus.record).__name__, gc.is_tracked(got[-1]), len(got))
"""


def test_eventbus_pure_python_disables_the_compiled_path() -> None:
    proc = subprocess.run([sys.executable, "-c", PURE_RUN],
                          env=subprocess_env(EVENTBUS_PURE_PYTHON="1"), capture_output=True,
                          text=True, timeout=60, check=True)
    assert proc.stdout.split() == ["None", "method", "True", "2"]
