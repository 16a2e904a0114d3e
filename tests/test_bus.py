"""Delivery semantics of the bus (docs/events.md, "Delivery semantics")."""

from __future__ import annotations

import gc
import logging
import threading
import weakref
from typing import Any

import blinker
import pytest

import eventbus
from eventbus import ALL
from eventbus import Event
from eventbus import EventType
from eventbus import event_type


def test_subscribers_are_called_in_subscription_order(bus: eventbus.Bus) -> None:
    """Type and every-type subscribers are called in the order they subscribed."""
    calls: list[str] = []
    bus.subscribe(EventType.EPOCH_END, on_event=lambda e: calls.append("a"))
    bus.subscribe(ALL, on_event=lambda e: calls.append("all"))
    bus.subscribe("EPOCH_END", on_event=lambda e: calls.append("b"))
    bus.subscribe(EventType.EPOCH_START, on_event=lambda e: calls.append("other"))
    bus.record(EventType.EPOCH_END, epoch=1)
    assert calls == ["a", "all", "b"]


def test_delivery_happens_in_the_publishing_thread(bus: eventbus.Bus) -> None:
    """on_event runs synchronously in the thread that called record()."""
    threads: list[threading.Thread] = []
    bus.subscribe(ALL, on_event=lambda e: threads.append(threading.current_thread()))
    bus.record(EventType.EPOCH_END, epoch=1)
    assert threads == [threading.current_thread()]


def test_each_subscriber_gets_each_event_once(bus: eventbus.Bus) -> None:
    """The same callable subscribed twice is two subscriptions; each delivers once."""
    got: list[Event] = []
    bus.subscribe(EventType.EPOCH_END, on_event=got.append)
    bus.subscribe(EventType.EPOCH_END, on_event=got.append)
    bus.record(EventType.EPOCH_END, epoch=1)
    assert len(got) == 2


def test_once_delivers_only_the_first_event(bus: eventbus.Bus) -> None:
    """once=True delivers the first matching event and then cancels itself."""
    got: list[Event] = []
    sub = bus.subscribe(EventType.EPOCH_END, on_event=got.append, once=True)
    for epoch in range(3):
        bus.record(EventType.EPOCH_END, epoch=epoch)
    assert [e.epoch for e in got] == [0]
    assert not sub.active


def test_where_filters_events(bus: eventbus.Bus) -> None:
    """where=predicate delivers only the events it accepts; once+where takes the first match."""
    failures: list[Event] = []
    first_big: list[Event] = []
    bus.subscribe(EventType.WORKER_EXIT, on_event=failures.append,
                  where=lambda e: e.exit_code != 0)
    bus.subscribe(EventType.WORKER_EXIT, on_event=first_big.append, once=True,
                  where=lambda e: e.worker_id >= 2)
    for rank, code in [(0, 0), (1, 3), (2, 0), (3, 1)]:
        bus.record(EventType.WORKER_EXIT, worker_id=rank, exit_code=code)
    assert [e.worker_id for e in failures] == [1, 3]
    assert [e.worker_id for e in first_big] == [2]


def test_cancel_stops_delivery_and_is_idempotent(bus: eventbus.Bus) -> None:
    """After cancel() no event arrives; a second cancel() does nothing."""
    got: list[Event] = []
    sub = bus.subscribe(EventType.EPOCH_END, on_event=got.append)
    bus.record(EventType.EPOCH_END, epoch=1)
    sub.cancel()
    sub.cancel()
    bus.record(EventType.EPOCH_END, epoch=2)
    assert [e.epoch for e in got] == [1]
    assert bus.subscriptions() == []


def test_subscribe_rejects_non_callables(bus: eventbus.Bus) -> None:
    """on_event and where must be callable; the error says which."""
    with pytest.raises(TypeError, match="on_event must be callable"):
        bus.subscribe(EventType.EPOCH_END, on_event=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="where must be a predicate"):
        bus.subscribe(EventType.EPOCH_END, on_event=print, where=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown event type"):
        bus.subscribe("NO_SUCH_TYPE", on_event=print)


def test_a_raising_subscriber_is_isolated_and_reported(
        bus: eventbus.Bus, caplog: pytest.LogCaptureFixture) -> None:
    """Others still get every event, record() never raises, one rate-limited report."""
    first: list[Event] = []
    last: list[Event] = []

    def broken(event: Event) -> None:
        raise RuntimeError("boom")

    bus.subscribe(EventType.EPOCH_END, on_event=first.append)
    bad = bus.subscribe(EventType.EPOCH_END, on_event=broken)
    bus.subscribe(EventType.EPOCH_END, on_event=last.append)
    with caplog.at_level(logging.ERROR, logger="eventbus"):
        for epoch in range(1000):
            bus.record(EventType.EPOCH_END, epoch=epoch)
    assert len(first) == len(last) == 1000
    reports = [r for r in caplog.records if r.name == "eventbus"]
    assert len(reports) == 1
    assert "broken" in reports[0].getMessage()
    assert reports[0].exc_info is not None and "boom" in str(reports[0].exc_info[1])
    assert bad.stats()["failed"] == 1000
    assert bad.stats()["delivered"] == 0


def test_strict_mode_reraises(bus: eventbus.Bus) -> None:
    """With strict=True the subscriber's exception reaches the caller of record()."""
    def broken(event: Event) -> None:
        raise RuntimeError("boom")

    bus.subscribe(EventType.EPOCH_END, on_event=broken)
    bus.strict = True
    with pytest.raises(RuntimeError, match="boom"):
        bus.record(EventType.EPOCH_END, epoch=1)


def test_a_broken_error_report_falls_back_to_stderr_once(
        bus: eventbus.Bus, capsys: pytest.CaptureFixture[str]) -> None:
    """A handler on the eventbus logger that raises causes no recursion, one stderr note."""
    class Broken(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            raise RuntimeError("handler broken")

        def handleError(self, record: logging.LogRecord) -> None:
            raise RuntimeError("handleError broken too")

    log = logging.getLogger("eventbus")
    handler = Broken()
    log.addHandler(handler)
    eventbus.bus.REPORT_INTERVAL_S, saved = 0.0, eventbus.bus.REPORT_INTERVAL_S
    try:
        bus.subscribe(EventType.EPOCH_END, on_event=lambda e: 1 / 0)
        for epoch in range(5):
            bus.record(EventType.EPOCH_END, epoch=epoch)
    finally:
        log.removeHandler(handler)
        eventbus.bus.REPORT_INTERVAL_S = saved
    err = capsys.readouterr().err
    assert err.count("eventbus: subscriber") == 1
    assert "ZeroDivisionError" in err


def test_subscribe_during_dispatch_takes_effect_from_the_next_event(bus: eventbus.Bus) -> None:
    """A subscriber added by another subscriber sees the next event, not the current one."""
    late: list[Event] = []

    def adder(event: Event) -> None:
        if event.epoch == 1:
            bus.subscribe(EventType.EPOCH_END, on_event=late.append)

    bus.subscribe(EventType.EPOCH_END, on_event=adder)
    bus.record(EventType.EPOCH_END, epoch=1)
    bus.record(EventType.EPOCH_END, epoch=2)
    assert [e.epoch for e in late] == [2]


def test_cancel_during_dispatch_takes_effect_from_the_next_event(bus: eventbus.Bus) -> None:
    """A subscriber cancelled by an earlier one still gets the current event, not the next."""
    got: list[Event] = []
    victim: list[eventbus.Subscription] = []
    bus.subscribe(EventType.EPOCH_END, on_event=lambda e: victim[0].cancel())
    victim.append(bus.subscribe(EventType.EPOCH_END, on_event=got.append))
    bus.record(EventType.EPOCH_END, epoch=1)
    bus.record(EventType.EPOCH_END, epoch=2)
    assert [e.epoch for e in got] == [1]


def test_reentrant_record_is_delivered(bus: eventbus.Bus) -> None:
    """A subscriber may record the same and other types; nested events are delivered."""
    seen: list[tuple[str, int]] = []

    def on_end(event: Event) -> None:
        seen.append(("end", event.epoch))
        if event.epoch < 3:
            bus.record(EventType.EPOCH_END, epoch=event.epoch + 1)
        bus.record(EventType.CHECKPOINT_SAVED, path=f"ckpt-{event.epoch}")

    bus.subscribe(EventType.EPOCH_END, on_event=on_end)
    bus.subscribe(EventType.CHECKPOINT_SAVED,
                  on_event=lambda e: seen.append(("ckpt", int(e.path[5:]))))
    done = threading.Event()
    worker = threading.Thread(target=lambda: (bus.record(EventType.EPOCH_END, epoch=1),
                                              done.set()))
    worker.start()
    worker.join(10)
    assert done.is_set(), "re-entrant record() deadlocked"
    assert seen == [("end", 1), ("end", 2), ("end", 3), ("ckpt", 3), ("ckpt", 2), ("ckpt", 1)]


def test_many_threads_lose_nothing_and_keep_order(bus: eventbus.Bus) -> None:
    """8 threads x 12,500 events: all 100,000 delivered, each thread's order kept."""
    got: list[tuple[int, int]] = []
    lock = threading.Lock()

    def on_metric(event: Event) -> None:
        with lock:
            got.append((event.data["thread"], event.step))

    bus.subscribe(EventType.METRIC, on_event=on_metric)
    n, per = 8, 12_500
    barrier = threading.Barrier(n)

    def produce(tid: int) -> None:
        barrier.wait(10)
        for seq in range(per):
            bus.record(EventType.METRIC, step=seq, data={"thread": tid})

    threads = [threading.Thread(target=produce, args=(t,)) for t in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(got) == n * per
    for tid in range(n):
        assert [seq for t, seq in got if t == tid] == list(range(per))
    assert bus.stats()["published"]["METRIC"] == n * per


def test_closure_subscribers_survive_garbage_collection(bus: eventbus.Bus) -> None:
    """A subscriber defined in a function scope is held strongly."""
    got: list[int] = []

    def subscribe_from_a_scope() -> None:
        def on_end(event: Event) -> None:
            got.append(event.epoch)
        bus.subscribe(EventType.EPOCH_END, on_event=on_end)

    subscribe_from_a_scope()
    gc.collect()
    bus.record(EventType.EPOCH_END, epoch=7)
    assert got == [7]


def test_blinker_signals_are_the_backbone(bus: eventbus.Bus) -> None:
    """Each type has a blinker Signal: direct receivers get record()s, send() reaches subs."""
    signal = bus.signal(EventType.EPOCH_END)
    assert isinstance(signal, blinker.Signal)
    assert bus.signal("EPOCH_END") is signal is bus.signal(eventbus.EpochEnd)
    direct: list[Any] = []

    def receiver(sender: Any) -> None:
        direct.append(sender)

    signal.connect(receiver)
    subscribed: list[Event] = []
    bus.subscribe(EventType.EPOCH_END, on_event=subscribed.append)
    bus.record(EventType.EPOCH_END, epoch=1)
    event = eventbus.EpochEnd(epoch=2)
    signal.send(event)
    assert [e.epoch for e in direct] == [1, 2]
    assert [e.epoch for e in subscribed] == [1, 2]
    signal.disconnect(receiver)
    bus.record(EventType.EPOCH_END, epoch=3)
    assert len(direct) == 2


def test_publish_delivers_a_prebuilt_event(bus: eventbus.Bus) -> None:
    """publish(event) delivers an event built elsewhere to that type's subscribers."""
    got: list[Event] = []
    bus.subscribe(EventType.WORKER_EXIT, on_event=got.append)
    event = eventbus.WorkerExit(worker_id=3, exit_code=1, timestamp=1.5)
    bus.publish(event)
    assert got == [event]
    with pytest.raises(TypeError, match="publish"):
        bus.publish({"type": "WORKER_EXIT"})  # type: ignore[arg-type]


def test_stats_count_published_delivered_failed_filtered(bus: eventbus.Bus) -> None:
    """stats() reports published per type and delivered/failed/filtered per subscription."""
    ok = bus.subscribe(EventType.WORKER_EXIT, on_event=lambda e: None)
    picky = bus.subscribe(EventType.WORKER_EXIT, on_event=lambda e: None,
                          where=lambda e: e.exit_code != 0)
    flaky = bus.subscribe(EventType.WORKER_EXIT,
                          on_event=lambda e: 1 / 0 if e.worker_id == 0 else None)
    logging.getLogger("eventbus").disabled = True
    try:
        for rank in range(4):
            bus.record(EventType.WORKER_EXIT, worker_id=rank, exit_code=rank % 2)
    finally:
        logging.getLogger("eventbus").disabled = False
    stats = bus.stats()
    assert stats["published"] == {"WORKER_EXIT": 4}
    by_sub = {id(s): row for s, row in zip([ok, picky, flaky], stats["subscribers"],
                                            strict=True)}
    assert by_sub[id(ok)]["delivered"] == 4
    assert (by_sub[id(picky)]["delivered"], by_sub[id(picky)]["filtered"]) == (2, 2)
    assert (by_sub[id(flaky)]["delivered"], by_sub[id(flaky)]["failed"]) == (3, 1)


def test_record_on_the_default_bus_reaches_the_default_publisher() -> None:
    """eventbus.record publishes on the bus that the default publisher subscribes to."""
    import eventbus.publishers

    got: list[Event] = []
    eventbus.publishers.get_default_event_publisher().subscribe(EventType.WORKER_EXIT,
                                                       on_event=got.append)
    eventbus.record(EventType.WORKER_EXIT, worker_id=0, exit_code=0, data={"epoch": 10})
    assert [(e.worker_id, e.data["epoch"]) for e in got] == [(0, 10)]


def test_module_level_record_is_the_default_bus_record() -> None:
    """eventbus.record is Bus.record bound to get_default_bus(), with its signature."""
    import inspect

    assert eventbus.record.__self__ is eventbus.get_default_bus()  # type: ignore[attr-defined]
    assert eventbus.record.__func__ is eventbus.Bus.record  # type: ignore[attr-defined]
    params = inspect.signature(eventbus.record).parameters.values()
    assert [(p.name, p.kind) for p in params] == [
        ("event_type", inspect.Parameter.POSITIONAL_ONLY),
        ("fields", inspect.Parameter.VAR_KEYWORD)]


def test_capture_events_collects_inside_the_block() -> None:
    """eventbus.testing.capture_events collects what is published inside the block only."""
    from eventbus.testing import capture_events

    with capture_events() as events:
        eventbus.record(EventType.EPOCH_END, epoch=1)
    eventbus.record(EventType.EPOCH_END, epoch=2)
    assert [e.epoch for e in events] == [1]
    with capture_events(EventType.EPOCH_START) as starts:
        eventbus.record(EventType.EPOCH_END, epoch=3)
        eventbus.record(EventType.EPOCH_START, epoch=4)
    assert [e.epoch for e in starts] == [4]


def test_strict_bus_context_reraises_inside_only() -> None:
    """eventbus.testing.strict_bus makes subscriber errors propagate inside the block."""
    from eventbus.testing import strict_bus

    bus = eventbus.Bus("strict")
    bus.subscribe(EventType.EPOCH_END, on_event=lambda e: 1 / 0)
    with strict_bus(bus), pytest.raises(ZeroDivisionError):
        bus.record(EventType.EPOCH_END, epoch=1)
    logging.getLogger("eventbus").disabled = True
    try:
        bus.record(EventType.EPOCH_END, epoch=2)
    finally:
        logging.getLogger("eventbus").disabled = False


def test_a_callable_object_subscriber_is_called_and_its_failures_counted(
        bus: eventbus.Bus) -> None:
    """A subscriber that is an instance with a Python __call__ (called through its bound
    method, see bus._direct_callable) gets every event, and its failures count against
    its own subscription."""

    class Collect:
        def __init__(self) -> None:
            self.steps: list[int] = []

        def __call__(self, event: Event) -> None:
            self.steps.append(event.fields()["step"])
            if len(self.steps) == 2:
                raise RuntimeError("second event")

    collect = Collect()
    sub = bus.subscribe(EventType.METRIC, on_event=collect)
    for step in range(3):
        bus.record(EventType.METRIC, step=step)
    assert collect.steps == [0, 1, 2]
    stats = sub.stats()
    assert (stats["delivered"], stats["failed"]) == (2, 1)


# -- one delivery loop, every path --------------------------------------------------------

def _delivery_entry_points() -> dict[str, Any]:
    """Each way an event reaches a bus's delivery loop, as ``(bus, event) -> None``: the
    Python record() and publish() (``Bus._deliver``), and their compiled stand-ins
    (``deliver()`` in eventbus/_speedups.c) where that module is built."""
    import types

    from eventbus._compiled import speedups

    def record(bus: eventbus.Bus, event: Event) -> None:
        bus.record(EventType.METRIC, step=event.step, data=dict(event.data))  # type: ignore[attr-defined]

    def publish(bus: eventbus.Bus, event: Event) -> None:
        bus.publish(event)

    def python(entry: Any) -> Any:
        def run(bus: eventbus.Bus, event: Event) -> None:
            bus.record = types.MethodType(eventbus.Bus.record, bus)  # type: ignore[method-assign]
            bus.publish = types.MethodType(eventbus.Bus.publish, bus)  # type: ignore[method-assign]
            entry(bus, event)
        return run

    points = {"python record": python(record), "python publish": python(publish)}
    if speedups is not None:
        points |= {"compiled record": record, "compiled publish": publish}
    return points


def _delivery_trace(deliver: Any) -> list[Any]:
    """What one delivery loop did with the same subscribers and events: who was called
    with what, in which order; failures counted and reported; what a strict bus and a
    KeyboardInterrupt raise; published counts."""
    trace: list[Any] = []
    bus = eventbus.Bus("delivery")
    reported: list[str] = []
    bus._report = lambda name, event, exc, suppressed: reported.append(  # type: ignore[method-assign]
        f"{name.rsplit('.', 1)[-1]}:{type(exc).__name__}:{suppressed}")

    def boom(event: Event) -> None:
        trace.append(("boom", event.step))  # type: ignore[attr-defined]
        raise RuntimeError("boom")

    def make(name: str) -> Any:
        return lambda event: trace.append((name, event.step, dict(event.data)))

    bus.subscribe(EventType.METRIC, on_event=make("first"))
    bus.subscribe(EventType.METRIC, on_event=boom)
    later = bus.subscribe(ALL, on_event=make("later"))
    bus.subscribe(EventType.METRIC, on_event=lambda e: later.cancel(), once=True)
    bus.subscribe(EventType.METRIC, on_event=make("odd"), where=lambda e: e.step % 2)
    bus.subscribe(EventType.METRIC, on_event=lambda e: trace.append(("once", e.step)),
                  once=True)
    bus.signal(EventType.METRIC).connect(make("blinker"), weak=False)

    def raising_receiver(event: Event) -> None:
        raise ValueError("not a subscription")

    bus.signal(EventType.METRIC).connect(raising_receiver, weak=False)
    metric = eventbus.events.event_class(EventType.METRIC)
    for step in range(3):
        deliver(bus, metric(step=step, data={"i": step}))
    trace.append(("stats", bus.stats()["published"],
                  [(s["subscriber"].rsplit(".", 1)[-1], s["delivered"], s["failed"],
                    s["filtered"]) for s in bus.stats()["subscribers"]]))
    trace.append(("reported", reported))

    bus.strict = True
    with pytest.raises(RuntimeError, match="boom") as raised:
        deliver(bus, metric(step=10, data={}))
    trace.append(("strict", type(raised.value).__name__))
    bus.strict = False

    stop = eventbus.Bus("interrupt")

    def interrupt(event: Event) -> None:
        raise KeyboardInterrupt

    stop.subscribe(EventType.METRIC, on_event=interrupt)
    stop.subscribe(EventType.METRIC, on_event=make("after interrupt"))
    with pytest.raises(KeyboardInterrupt):
        deliver(stop, metric(step=20, data={}))
    trace.append(("interrupted", stop.stats()["published"],
                  [s["failed"] for s in stop.stats()["subscribers"]]))
    return trace


def test_record_and_publish_share_one_delivery_loop_on_every_path() -> None:
    """record() and publish(), compiled and pure-Python, deliver alike: the same
    subscribers in the same order, failures isolated, counted and reported, a strict bus's
    re-raise, a KeyboardInterrupt straight out, a cancel effective from the next event.
    (The Python loop is Bus._deliver; the compiled one is its copy in _speedups.c.)"""
    traces = {name: _delivery_trace(deliver)
              for name, deliver in _delivery_entry_points().items()}
    expected = traces.pop("python record")
    assert ("later", 0, {"i": 0}) in expected and ("later", 1, {"i": 1}) not in expected
    for name, trace in traces.items():
        assert trace == expected, name


def test_a_dropped_bus_is_collected() -> None:
    """No module-level registry keeps a bus alive: 1,000 buses made, used and dropped,
    none left after a collection (each once held itself in two lists of hooks)."""
    refs: list[weakref.ref[eventbus.Bus]] = []
    for i in range(1000):
        bus = eventbus.Bus(f"dropped-{i}")
        sub = bus.subscribe(EventType.WORKER_EXIT, on_event=lambda event: None)
        bus.record(EventType.WORKER_EXIT, worker_id=0, exit_code=0)
        refs.append(weakref.ref(bus))
        del bus, sub
    gc.collect()
    assert sum(ref() is not None for ref in refs) == 0


def test_a_type_declared_after_a_bus_reaches_it() -> None:
    """The one declare hook still reaches every living bus: a type declared after the bus
    was made is recorded and delivered on it."""
    bus = eventbus.Bus("declared-later")

    @event_type("TEST_DECLARED_AFTER_BUS")
    class DeclaredLater(Event):
        value: int

    got: list[Event] = []
    bus.subscribe("TEST_DECLARED_AFTER_BUS", on_event=got.append)
    bus.record("TEST_DECLARED_AFTER_BUS", value=3)
    assert [e.value for e in got] == [3]  # type: ignore[attr-defined]
