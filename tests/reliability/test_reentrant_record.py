"""Row 6: a subscriber records the same and another type (re-entrant record())."""

from __future__ import annotations

import threading
from collections.abc import Callable

import eventbus
from eventbus import Bus
from eventbus import Event

DEPTH = 50


def _run_with_deadline(fn: Callable[[], None], seconds: float = 30.0) -> None:
    """Run ``fn`` in a thread; a deadlock shows up as a failed join, not a hung suite."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"record() deadlocked (still running after {seconds} s)"
    if errors:
        raise errors[0]


def test_reentrant_record_same_and_other_type(
    bus: Bus, figure: Callable[[int, str], None],
) -> None:
    """Nested record() of the same type and of another type: no deadlock; every nested
    event is delivered, depth-first, to every subscriber."""
    seen: list[tuple[str, int]] = []

    def on_metric(event: Event) -> None:
        step = event.fields()["step"]
        seen.append(("METRIC", step))
        if step < DEPTH:
            bus.record("METRIC", step=step + 1)          # same type, from inside dispatch
            bus.record("EPOCH_END", epoch=step)          # another type

    bus.subscribe("METRIC", on_event=on_metric)
    bus.subscribe("EPOCH_END", on_event=lambda e: seen.append(("EPOCH_END", e.fields()["epoch"])))
    observer: list[str] = []
    bus.subscribe(eventbus.ALL, on_event=lambda e: observer.append(str(e.type)))

    _run_with_deadline(lambda: bus.record("METRIC", step=0))

    expected = [("METRIC", s) for s in range(DEPTH + 1)] + \
        [("EPOCH_END", s) for s in reversed(range(DEPTH))]
    assert seen == expected
    assert observer.count("METRIC") == DEPTH + 1
    assert observer.count("EPOCH_END") == DEPTH
    figure(6, f"nested depth {DEPTH}: {len(seen)}/{2 * DEPTH + 1} events delivered, no deadlock")


def test_subscriber_that_subscribes_cancels_and_fails_while_nested(bus: Bus) -> None:
    """Inside a dispatch, subscribe(), cancel() and a failing nested subscriber (which
    takes the bus lock to count the failure) all work: the lock is re-entrant and is not
    held while subscribers run."""
    got: list[int] = []

    def broken(event: Event) -> None:
        raise RuntimeError("nested failure")

    def on_metric(event: Event) -> None:
        step = event.fields()["step"]
        if step == 0:
            sub = bus.subscribe("EPOCH_END", on_event=broken)
            bus.record("EPOCH_END", epoch=0)
            sub.cancel()
            bus.record("METRIC", step=1)
        got.append(step)

    bus.subscribe("METRIC", on_event=on_metric)
    _run_with_deadline(lambda: bus.record("METRIC", step=0))
    assert got == [1, 0]


def test_reentrant_record_from_another_thread_while_dispatching(bus: Bus) -> None:
    """A subscriber that waits for another thread's record() to finish: no lock held
    during dispatch, so the other thread is not blocked (no cross-thread deadlock)."""
    got: list[int] = []

    def on_metric(event: Event) -> None:
        step = event.fields()["step"]
        got.append(step)
        if step == 0:
            t = threading.Thread(target=lambda: bus.record("METRIC", step=1))
            t.start()
            t.join(10)
            assert not t.is_alive()

    bus.subscribe("METRIC", on_event=on_metric)
    bus.subscribe("METRIC", on_event=lambda e: bus.subscribe("EPOCH_END", on_event=print))
    _run_with_deadline(lambda: bus.record("METRIC", step=0))
    assert got == [0, 1]
