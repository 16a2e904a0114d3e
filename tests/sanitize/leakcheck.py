"""100,000 calls of each fast-path shape of eventbus/_speedups.c, checking for leaks.

Run by tests/sanitize/run.sh (``make test-sanitize``) under AddressSanitizer, where a
missing ``Py_INCREF`` shows up as a use after free; this script looks for the opposite, a
missing ``Py_DECREF``. sys.gettotalrefcount() needs a debug build of CPython, so instead,
after a warm-up, across the 100,000 calls of each shape:

* ``sys.getrefcount`` of every object a call touches that outlives it (the bus, its
  compiled ``record``/``publish``, the event class and member, the field-name strings, the
  subscribers, the sink, the shared values in ``data``, the context, a published event):
  a reference leaked per call would add 100,000; the check allows a drift of 100;
* the heap: under AddressSanitizer, the bytes its allocator holds
  (``__sanitizer_get_current_allocated_bytes``; every Python object is malloc'ed there, as
  run.sh sets PYTHONMALLOC=malloc), else pymalloc's ``sys.getallocatedblocks()`` (counted
  as 64 bytes each); a leaked event, dict or tuple per call would keep megabytes; the check
  allows 256 KiB (tracemalloc would see the same, at ten times the run time);
* ``len(gc.get_objects())``: a leaked container per call would add 100,000; allowed: 100.

Exits 1 naming the shape and the measure that grew. Runs on the plain build too:
``.venv/bin/python tests/sanitize/leakcheck.py``.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

from eventbus import ALL
from eventbus import Bus
from eventbus import EventType
from eventbus._compiled import speedups
from eventbus.context import current_context
from eventbus.events import event_class
from eventbus.subscribers.queued import QueuedSink
from eventbus.wire import BatchDecoder

CALLS = 100_000
WARM_UP = 2_000
MAX_REF_DRIFT = 100
MAX_HEAP_GROWTH = 256 * 1024
MAX_GC_GROWTH = 100

#: shared by every event's data: its reference count must come back
NAME = "".join(["shared-", "value"])
METRIC = event_class(EventType.METRIC)
WORKER_EXIT = event_class(EventType.WORKER_EXIT)


def _noop(event: Any) -> None:
    pass


def _raises(event: Any) -> None:
    raise ValueError("subscriber failure (expected)")


Shape = tuple[Callable[[int], object], list[Any], Callable[[], None]]


def _bus(n_subscribers: int, *, handler: Callable[[Any], object] = _noop) -> Bus:
    bus = Bus("leakcheck")
    for _ in range(n_subscribers):
        bus.subscribe(EventType.METRIC, on_event=handler)
    bus.record(EventType.METRIC, step=0)  # the type's code generated: the compiled path
    return bus


def _watched(bus: Bus, *compiled: Any) -> list[Any]:
    """What a call touches and outlives it, the objects the compiled callables hold among
    them (their bus, views, fallback and failure handler; an Enqueuer's sink, kick,
    overflow, sizes and free types: what a C path could leak a reference to once per
    call without the bus's own count moving). On 3.12+ strings like "step" are immortal
    and their count never moves: the referents carry the check there."""
    held = [bus.record, bus.publish, *compiled]
    referents = [r for c in held for r in gc.get_referents(c)]
    return [bus, *held, *referents, METRIC, EventType.METRIC, "step", "data", NAME, _noop,
            _raises, current_context(), *filter(None, [METRIC.__dict__.get("_spec")])]


def record_shape(n_subscribers: int) -> Shape:
    bus = _bus(n_subscribers)
    record = bus.record

    def call(i: int) -> object:
        return record(EventType.METRIC, step=i, data={"loss": 0.5, "name": NAME})
    return call, _watched(bus), lambda: None


def record_nested() -> Shape:
    """data with containers: the compiled snapshot copies them."""
    bus = _bus(1)
    record = bus.record

    def call(i: int) -> object:
        return record(EventType.METRIC, step=i,
                      data={"l": [i, NAME, (1.5, NAME)], "d": {"k": {NAME}}})
    return call, _watched(bus), lambda: None


def record_by_name_and_coerced() -> Shape:
    """A type given by its name and an optional field that needs coercing (bool->int is
    refused, so a numpy-free stand-in: an int subclass)."""
    class Step(int):
        pass

    bus = _bus(1)
    record = bus.record
    step = Step(3)

    def call(i: int) -> object:
        return record("METRIC", step=step, data={"name": NAME})
    return call, [*_watched(bus), step, "METRIC"], lambda: None


def record_invalid() -> Shape:
    """A wrongly typed field and an unknown one: the error paths."""
    bus = _bus(1)
    record = bus.record

    def call(i: int) -> object:
        with contextlib.suppress(TypeError):
            record(EventType.METRIC, step=NAME)
        with contextlib.suppress(TypeError):
            record(EventType.WORKER_EXIT, worker_id=i, exit_code=0, bogus=NAME)
        return None
    return call, [*_watched(bus), WORKER_EXIT, "bogus"], lambda: None


def record_raising_subscriber() -> Shape:
    """A subscriber that raises: counted (the report is rate-limited)."""
    bus = _bus(1, handler=_raises)
    bus.subscribe(EventType.METRIC, on_event=_noop)
    record = bus.record

    def call(i: int) -> object:
        return record(EventType.METRIC, step=i, data={"name": NAME})
    return call, _watched(bus), lambda: None


def record_once_and_where() -> Shape:
    """A where= filter that lets half through, and a once=True subscriber per call."""
    bus = _bus(0)
    bus.subscribe(EventType.METRIC, on_event=_noop, where=lambda e: e.step % 2)
    record = bus.record

    def call(i: int) -> object:
        bus.subscribe(EventType.METRIC, on_event=_noop, once=True)
        return record(EventType.METRIC, step=i, data={"name": NAME})
    return call, _watched(bus), lambda: None


def publish_shape() -> Shape:
    bus = _bus(1)
    bus.subscribe(ALL, on_event=_noop)
    publish = bus.publish
    event = METRIC(step=1, data={"name": NAME})

    def call(i: int) -> object:
        publish(event)
        with contextlib.suppress(TypeError):
            publish(NAME)  # type: ignore[arg-type]
        return None
    return call, [*_watched(bus), event], lambda: None


def enqueue_shape() -> Shape:
    """record() into a QueuedSink (the compiled enqueue), its thread draining; a small
    bound, so that some enqueues take the drop path."""
    bus = _bus(0)
    sink = QueuedSink(lambda batch: None, name="leakcheck", max_events=500, max_batch=100)
    bus.subscribe(EventType.METRIC, on_event=sink)
    record = bus.record
    # what a bus calls for the sink: the compiled enqueue (called directly too)
    direct = getattr(sink, "_eventbus_direct", lambda: sink)()
    event = METRIC(step=1, data={"name": NAME, "l": [1, 2]})

    def call(i: int) -> object:
        record(EventType.METRIC, step=i, data={"name": NAME})
        return direct(event)

    def done() -> None:
        sink.flush(10)
    return call, [*_watched(bus, direct), sink, event], done


def decode_shape() -> Shape:
    """The store receiver's decoder: valid entries (the compiled decode) and ones it hands
    back or the receiver rejects."""
    bus = _bus(1)
    bus.subscribe(EventType.WORKER_EXIT, on_event=_noop)
    contexts = [current_context()]
    rejected: list[str] = []
    publish_all = BatchDecoder.publish_all

    def call(i: int) -> object:
        entries = [
            ["WORKER_EXIT", {"worker_id": i, "exit_code": 0, "data": {"a": NAME, "l": [1]},
                             "timestamp": 1.5, "context": 0}],
            ["METRIC", {"step": i, "timestamp": 2, "context": 0}],
            ["WORKER_EXIT", {"worker_id": NAME, "exit_code": 0, "timestamp": 1.5,
                             "context": 0}],
            ["WORKER_EXIT", {"worker_id": 1, "timestamp": 1.5, "context": 0}],
        ]
        publish_all(entries, contexts, bus.publish, rejected.append)
        del rejected[:]
        return None
    return call, [*_watched(bus), WORKER_EXIT, "WORKER_EXIT", "worker_id", "exit_code"], \
        lambda: None


SHAPES: dict[str, Callable[[], Shape]] = {
    "record(), 0 subscribers": lambda: record_shape(0),
    "record(), 1 subscriber": lambda: record_shape(1),
    "record(), 10 subscribers": lambda: record_shape(10),
    "record(), nested data": record_nested,
    "record(), by name, coerced": record_by_name_and_coerced,
    "record(), invalid fields": record_invalid,
    "record(), raising subscriber": record_raising_subscriber,
    "record(), once= and where=": record_once_and_where,
    "publish()": publish_shape,
    "QueuedSink enqueue": enqueue_shape,
    "store receiver decode": decode_shape,
}


def _heap_meter() -> Callable[[], int]:
    try:
        allocated = ctypes.CDLL(None).__sanitizer_get_current_allocated_bytes
    except (AttributeError, OSError):  # not under ASan: pymalloc's count of blocks
        return lambda: sys.getallocatedblocks() * 64
    allocated.restype = ctypes.c_size_t
    allocated.argtypes = []
    return lambda: int(allocated())


HEAP = _heap_meter()


def measure(name: str, make: Callable[[], Shape]) -> list[str]:
    call, watched, done = make()
    for i in range(WARM_UP):
        call(i)
    done()
    gc.collect()
    refs = [sys.getrefcount(obj) for obj in watched]
    objects = len(gc.get_objects())
    heap = HEAP()
    start = time.perf_counter()
    for i in range(CALLS):
        call(i)
    elapsed = time.perf_counter() - start
    done()
    gc.collect()
    heap_growth = HEAP() - heap
    gc_growth = len(gc.get_objects()) - objects
    drifts = [(obj, sys.getrefcount(obj) - before) for obj, before in zip(watched, refs,
                                                                           strict=True)]
    problems = [f"{name}: refcount of {obj!r:.60} changed by {d:+d}" for obj, d in drifts
                if abs(d) > MAX_REF_DRIFT]
    if heap_growth > MAX_HEAP_GROWTH:
        problems.append(f"{name}: the Python heap grew by {heap_growth} bytes")
    if gc_growth > MAX_GC_GROWTH:
        problems.append(f"{name}: {gc_growth} more objects tracked by the collector")
    worst = max(abs(d) for _, d in drifts)
    print(f"{name:32} {elapsed:6.2f} s  refcount drift <= {worst:3d}  "
          f"heap {heap_growth:+8d} B  gc objects {gc_growth:+4d}  "
          f"{'LEAK' if problems else 'ok'}", flush=True)
    return problems


def main() -> int:
    if speedups is None:
        print("eventbus._speedups is not built or disabled: nothing to check")
        return 1
    logging.getLogger("eventbus").addHandler(logging.NullHandler())
    logging.getLogger("eventbus").propagate = False  # the raising subscriber's reports
    problems = [p for name, make in SHAPES.items() for p in measure(name, make)]
    for problem in problems:
        print(problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
