"""Row 3: the error report itself fails (a broken handler on the ``eventbus`` logger)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from eventbus import Bus
from eventbus import Event


def _broken(event: Event) -> None:
    raise RuntimeError("subscriber failure")


@contextmanager
def _handler_on_eventbus_logger(handler: logging.Handler) -> Iterator[None]:
    log = logging.getLogger("eventbus")
    log.addHandler(handler)
    try:
        yield
    finally:
        log.removeHandler(handler)


class _RaisingHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    # handle(), not emit(): a Handler's emit errors go to handleError, which a user's
    # broken handler need not call; raising out of handle() is the worst case.
    def handle(self, record: logging.LogRecord) -> bool:
        self.calls += 1
        raise OSError("the log destination is gone")


def test_broken_log_handler_one_stderr_fallback(
    bus: Bus, capfd: pytest.CaptureFixture[str], report_interval: Callable[[float], None],
    figure: Callable[[int, str], None],
) -> None:
    """A handler that raises on every report: record() still never raises, the failure is
    written to stderr once, not once per event."""
    report_interval(0.0)  # no rate limit: every failure tries to report
    handler = _RaisingHandler()
    got: list[Event] = []
    bus.subscribe("METRIC", on_event=_broken)
    bus.subscribe("METRIC", on_event=got.append)
    with _handler_on_eventbus_logger(handler):
        for i in range(200):
            bus.record("METRIC", step=i)
    err = capfd.readouterr().err
    fallbacks = err.count("eventbus: subscriber")
    assert handler.calls == 200  # every report was attempted
    assert fallbacks == 1, err
    assert "RuntimeError: subscriber failure" in err
    assert len(got) == 200
    figure(3, f"depth 1 (handler raised {handler.calls} times, stderr fallbacks {fallbacks})")


def test_reporting_handler_that_records_does_not_recurse(
    bus: Bus, report_interval: Callable[[float], None], figure: Callable[[int, str], None],
) -> None:
    """A handler on the eventbus logger that records an event whose subscriber raises
    again: the nested failure is not reported again, so reporting nests at most 1 deep."""
    report_interval(0.0)
    depth = 0
    max_depth = 0

    class RecordingHandler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            nonlocal depth, max_depth
            depth += 1
            max_depth = max(max_depth, depth)
            try:
                bus.record("METRIC", step=-1)  # its broken subscriber raises again
            finally:
                depth -= 1

    bus.subscribe("METRIC", on_event=_broken)
    with _handler_on_eventbus_logger(RecordingHandler()):
        for i in range(50):
            bus.record("METRIC", step=i)
    assert max_depth == 1
    # the nested failures are still counted, only not reported
    assert bus.subscriptions()[0].stats()["failed"] == 100
    figure(3, f"depth {max_depth} with a handler that re-records (100 failures counted)")
