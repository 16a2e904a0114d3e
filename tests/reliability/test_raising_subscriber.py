"""Row 1: a subscriber raises; the others get everything and record() never raises."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from eventbus import Bus
from eventbus import Event

N = 10_000


def _broken(event: Event) -> None:
    raise RuntimeError(f"broken subscriber at step {event.fields()['step']}")


def test_middle_subscriber_raises_others_get_all(
    bus: Bus, caplog: pytest.LogCaptureFixture, report_interval: Callable[[float], None],
    figure: Callable[[int, str], None],
) -> None:
    """3 subscribers, the middle raises on all 10k events: the others get all 10k, in
    order; record() never raises; one report; the count is in stats() and the next report."""
    report_interval(1e9)  # one interval spans the whole load, however slow the machine
    first: list[int] = []
    third: list[int] = []
    bus.subscribe("METRIC", on_event=lambda e: first.append(e.fields()["step"]))
    middle = bus.subscribe("METRIC", on_event=_broken)
    bus.subscribe("METRIC", on_event=lambda e: third.append(e.fields()["step"]))

    with caplog.at_level(logging.ERROR, logger="eventbus"):
        for i in range(N):
            bus.record("METRIC", step=i)  # must not raise
    reports = [r for r in caplog.records if r.name == "eventbus"]

    assert first == list(range(N))
    assert third == list(range(N))
    assert len(reports) == 1, [r.getMessage() for r in reports]
    assert reports[0].exc_info is not None
    assert reports[0].exc_info[0] is RuntimeError
    assert "_broken" in reports[0].getMessage()
    failed = middle.stats()["failed"]
    assert failed == N
    assert middle.stats()["delivered"] == 0
    delivered = len(first) + len(third)

    # Past the interval, the next report carries the count of the suppressed ones.
    report_interval(0.0)
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="eventbus"):
        bus.record("METRIC", step=N)
    (late,) = [r for r in caplog.records if r.name == "eventbus"]
    assert f"({N - 1} more failures since the last report)" in late.getMessage()

    figure(1, f"delivered {delivered:,}/{2 * N:,}; reports 1 (+1 carrying {N - 1:,} "
              f"suppressed); failed counted {failed:,}")
    assert delivered == 2 * N


def test_raising_subscriber_on_the_default_bus(
    caplog: pytest.LogCaptureFixture, report_interval: Callable[[float], None],
) -> None:
    """The module-level record() isolates failures exactly like Bus.record()."""
    import eventbus
    from eventbus.publishers import get_default_event_publisher

    report_interval(1e9)
    got: list[int] = []
    pub = get_default_event_publisher()
    subs = [pub.subscribe("METRIC", on_event=_broken),
            pub.subscribe("METRIC", on_event=lambda e: got.append(e.fields()["step"]))]
    try:
        with caplog.at_level(logging.ERROR, logger="eventbus"):
            for i in range(100):
                eventbus.record(eventbus.EventType.METRIC, step=i)
    finally:
        for sub in subs:
            sub.cancel()
    assert got == list(range(100))
    assert len([r for r in caplog.records if r.name == "eventbus"]) == 1
    assert subs[0].stats()["failed"] == 100


def test_base_exception_is_not_swallowed(bus: Bus) -> None:
    """KeyboardInterrupt/SystemExit from a subscriber are not failures to isolate: they
    reach the caller (a bus must not eat Ctrl-C)."""

    def interrupt(event: Event) -> None:
        raise KeyboardInterrupt

    bus.subscribe("METRIC", on_event=interrupt)
    with pytest.raises(KeyboardInterrupt):
        bus.record("METRIC", step=0)
