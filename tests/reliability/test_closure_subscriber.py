"""Row 10: a subscriber made in a function scope stays subscribed after gc.collect()."""

from __future__ import annotations

import gc
from collections.abc import Callable

from eventbus import Bus
from eventbus import Event
from eventbus.publishers import EventPublisher


def _subscribe_closure(bus: Bus, sink: list[int]) -> None:
    def on_event(event: Event) -> None:  # only the bus references it after return
        sink.append(event.fields()["step"])

    bus.subscribe("METRIC", on_event=on_event)  # the Subscription is dropped too


class _Counter:
    def __init__(self, sink: list[int]) -> None:
        self.sink = sink

    def on_event(self, event: Event) -> None:
        self.sink.append(event.fields()["step"])


def test_closure_lambda_and_bound_method_survive_gc(
    bus: Bus, figure: Callable[[int, str], None],
) -> None:
    """A closure, a lambda and a bound method of an otherwise unreferenced object are
    held strongly: still delivered after the scope is gone and gc.collect() ran."""
    closure: list[int] = []
    lam: list[int] = []
    method: list[int] = []
    _subscribe_closure(bus, closure)
    EventPublisher(bus).subscribe("METRIC", on_event=lambda e: lam.append(e.fields()["step"]))
    bus.subscribe("METRIC", on_event=_Counter(method).on_event)
    gc.collect()
    gc.collect()
    for i in range(3):
        bus.record("METRIC", step=i)
    assert closure == lam == method == [0, 1, 2]
    figure(10, "closure, lambda, bound method: 3/3 delivered after gc.collect()")


def test_cancel_releases_the_closure(bus: Bus) -> None:
    """The other half of holding strongly: cancel() lets the subscriber be collected."""
    import weakref

    class Sink:
        def __call__(self, event: Event) -> None:
            pass

    sink = Sink()
    ref = weakref.ref(sink)
    sub = bus.subscribe("METRIC", on_event=sink)
    del sink
    gc.collect()
    assert ref() is not None
    sub.cancel()
    del sub
    gc.collect()
    assert ref() is None
