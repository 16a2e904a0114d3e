"""eventbus.subscribers.log_handler's direct path (eventbus.subscribers._log_direct): the same
lines as the LogRecord path, byte for byte."""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Callable
from collections.abc import Iterator

import pytest

import eventbus
from eventbus.subscribers._log_direct import DirectLines
from eventbus.subscribers._log_direct import make_plan
from eventbus.subscribers.log_handler import DEFAULT_FORMAT
from eventbus.subscribers.log_handler import RECORD_NAME
from eventbus.subscribers.log_handler import EventLoggingHandler

HOSTILE = "a\nb \x1b[31mred\x1b[0m \x9b31m x\u2028y bidi\u202eevil lone\ud800s tab\there"
ctx = eventbus.JobContext(rank=3, hostname="h", pid=1)
#: events whose lines both paths must agree on: typed fields, data, rank, failures (ERROR),
#: hostile text, timestamps on both sides of a second and of 1970
EVENTS: list[eventbus.Event] = [
    eventbus.WorkerExit(worker_id=0, exit_code=0, data={"epoch": 10, "loss": 0.01},
                        timestamp=1_764_410_000.25),
    eventbus.WorkerExit(worker_id=1, exit_code=-9, signal="SIGKILL", timestamp=1_764_410_000.999),
    eventbus.WorkerExit(worker_id=1, exit_code=3, timestamp=1_764_410_001.0005),
    eventbus.Rendezvous(state="FAILED", name="round-1", message=HOSTILE, timestamp=0.5),
    eventbus.CheckpointSaved(path=HOSTILE, epoch=2, context=ctx, timestamp=1.0),
    eventbus.Metric(step=4, data={"k": HOSTILE, "nan": float("nan"), "nested": {"a": [1, 2]}},
                    context=ctx, timestamp=1_764_410_001.5),
    eventbus.EpochEnd(epoch=1, context=ctx, timestamp=1_764_410_061.75),
]
FORMATS = [
    DEFAULT_FORMAT,
    "%(levelname)s %(name)s %(message)s",
    "%(asctime)s - %(name)s - %(levelname)s - %(message)s",
    "%(asctime)s.%(msecs)03d %(created)f %(relativeCreated)d %(levelno)d %(message)s",
    "%(pathname)s %(filename)s %(module)s %(lineno)d %(funcName)s %(args)s %(msg)s",
    "%(exc_info)s %(exc_text)s %(stack_info)s %(levelname)-8s|%(message)-30s|%% done",
    # attributes the direct path does not make: these take the record path
    "%(process)d %(processName)s %(thread)d %(threadName)s %(message)s",
    "%(event_type)s %(event_timestamp)s %(event_context)s %(message)s",
]


class Pass(logging.Filter):
    """A filter that keeps every record: it makes the handler build records."""

    def filter(self, record: logging.LogRecord) -> bool:
        return True


def pair(fmt: str, datefmt: str | None = None
         ) -> tuple[EventLoggingHandler, io.StringIO, EventLoggingHandler, io.StringIO]:
    """A handler taking the direct path and one forced onto the record path (a filter)."""
    direct_sink, record_sink = io.StringIO(), io.StringIO()
    direct = EventLoggingHandler(stream=direct_sink, fmt=fmt, datefmt=datefmt)
    by_record = EventLoggingHandler(stream=record_sink, fmt=fmt, datefmt=datefmt)
    by_record.addFilter(Pass())
    return direct, direct_sink, by_record, record_sink


def feed(*handlers: EventLoggingHandler) -> None:
    for event in EVENTS:
        for handler in handlers:
            handler.on_event(event)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("datefmt", [None, "%Y-%m-%dT%H:%M:%S%z"])
def test_the_module_contract_direct_line_is_the_formatted_record(fmt: str,
                                                                 datefmt: str | None) -> None:
    """DirectLines.line() is formatter.format(make_record(...)) for the same message, level and
    time, or None where the format names what only a record has (and from then on, records)."""
    handler = EventLoggingHandler(stream=io.StringIO(), fmt=fmt, datefmt=datefmt)
    formatter = handler.formatter
    assert formatter is not None
    direct_lines = DirectLines(name=RECORD_NAME)
    direct = direct_lines.direct_for(formatter, lambda: True)
    assert direct is not None and direct_lines.plan == make_plan(formatter, eligible=True)
    for event in EVENTS:
        level = handler.level_for(event)
        record = handler.make_record(event, level)
        line = direct_lines.line(direct, record.getMessage(), level, event.timestamp)
        if line is None:
            assert fmt in FORMATS[-2:]  # they name the thread, process or event attributes
            assert direct_lines.direct_for(formatter, lambda: True) is None
            return
        assert line == formatter.format(record)
    assert fmt not in FORMATS[-2:]


def test_a_plan_holds_until_the_formatter_changes() -> None:
    """The plan is remade when the formatter, its style or the format string is replaced, and
    an ineligible handler gets records for any formatter."""
    formatter = logging.Formatter("%(message)s")
    direct_lines = DirectLines(name=RECORD_NAME)
    first = direct_lines.direct_for(formatter, lambda: True)
    assert first is not None and direct_lines.plan.fits(formatter)
    formatter._style._fmt = "%(levelname)s %(message)s"
    assert not direct_lines.plan.fits(formatter)
    second = direct_lines.direct_for(formatter, lambda: True)
    assert second is not None and second.fmt == "%(levelname)s %(message)s"
    assert direct_lines.direct_for(logging.Formatter("%(message)s"), lambda: False) is None
    assert direct_lines.direct_for(logging.Formatter("{message}", style="{"),
                                   lambda: True) is None


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("datefmt", [None, "%Y-%m-%dT%H:%M:%S%z"])
def test_direct_lines_equal_record_lines_for_every_format(fmt: str, datefmt: str | None) -> None:
    """Every format and date format: the direct path writes exactly the record path's lines."""
    direct, direct_sink, by_record, record_sink = pair(fmt, datefmt)
    feed(direct, by_record)
    assert direct_sink.getvalue() == record_sink.getvalue()
    assert direct_sink.getvalue().count("\n") == len(EVENTS)
    assert direct.stats() == by_record.stats() == {"errors": 0, "reentrant_skipped": 0}


def test_plain_formats_take_the_direct_path_others_the_record_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The direct path is really taken for plain formats, and not for one naming the thread."""
    made: list[eventbus.Event] = []
    original = EventLoggingHandler.make_record

    def counting(self: EventLoggingHandler, event: eventbus.Event, *args: object
                 ) -> logging.LogRecord:
        made.append(event)
        return original(self, event, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(EventLoggingHandler, "make_record", counting)
    handler = EventLoggingHandler(stream=io.StringIO(), fmt=FORMATS[2])
    feed(handler)
    assert made == []
    handler.set_format("%(threadName)s %(message)s")
    feed(handler)
    assert made == EVENTS


@pytest.mark.parametrize("change", ["set_format", "setFormatter", "datefmt", "converter",
                                    "msec_format", "style_fmt", "brace", "subclass", "none"])
def test_formatter_changes_apply_from_the_next_event(change: str) -> None:
    """Whatever changes the formatter, the next line is what the record path writes."""
    direct, direct_sink, by_record, record_sink = pair(FORMATS[2])
    feed(direct, by_record)
    for handler in (direct, by_record):
        formatter = handler.formatter
        assert formatter is not None
        if change == "set_format":
            handler.set_format("%(levelname)s:%(message)s")
        elif change == "setFormatter":
            handler.setFormatter(logging.Formatter("%(name)s %(asctime)s %(message)s"))
        elif change == "datefmt":
            formatter.datefmt = "%H:%M"
        elif change == "converter":
            formatter.converter = time.gmtime
        elif change == "msec_format":
            formatter.default_msec_format = "%s.%03d"
        elif change == "style_fmt":
            formatter._style._fmt = "%(levelno)s %(message)s"
        elif change == "brace":
            handler.set_format("{levelname} {message}", style="{")
        elif change == "subclass":
            class Upper(logging.Formatter):
                def format(self, record: logging.LogRecord) -> str:
                    return super().format(record).upper()
            handler.setFormatter(Upper("%(levelname)s %(message)s"))
        else:
            handler.setFormatter(None)
    feed(direct, by_record)
    assert direct_sink.getvalue() == record_sink.getvalue()
    assert direct_sink.getvalue().count("\n") == 2 * len(EVENTS)


@pytest.fixture
def lowercase_levels() -> Iterator[None]:
    """A record factory that writes level names in lower case (restored afterwards)."""
    original: Callable[..., logging.LogRecord] = logging.getLogRecordFactory()

    def factory(*args: object, **kwargs: object) -> logging.LogRecord:
        record = original(*args, **kwargs)
        record.levelname = record.levelname.lower()
        return record

    logging.setLogRecordFactory(factory)
    yield
    logging.setLogRecordFactory(original)


def test_a_custom_record_factory_still_makes_the_records(lowercase_levels: None) -> None:
    """With a LogRecord factory installed, lines come from the records it makes."""
    sink = io.StringIO()
    handler = EventLoggingHandler(stream=sink, fmt="%(levelname)s %(message)s")
    handler.on_event(EVENTS[0])
    handler.on_event(EVENTS[1])
    assert sink.getvalue().splitlines() == [
        'info WORKER_EXIT worker_id=0 exit_code=0 data={"epoch": 10, "loss": 0.01}',
        'error WORKER_EXIT worker_id=1 exit_code=-9 signal="SIGKILL"']


def test_a_format_naming_a_missing_attribute_is_reported_as_before() -> None:
    """A format naming an attribute no record has: the record path's error report, once."""
    handler = EventLoggingHandler(stream=io.StringIO(), fmt="%(no_such_attr)s %(message)s")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(logging, "raiseExceptions", False)
        handler.on_event(EVENTS[0])
    assert handler.stats()["errors"] == 1


def test_subclass_overriding_emit_gets_records() -> None:
    """A subclass that overrides emit receives a LogRecord per event, as before."""
    seen: list[logging.LogRecord] = []

    class Keep(EventLoggingHandler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    Keep(stream=io.StringIO()).on_event(EVENTS[0])
    assert [record.event for record in seen] == [EVENTS[0]]  # type: ignore[attr-defined]


def test_relative_created_counts_from_logging_start_on_every_python() -> None:
    """relativeCreated of an event's record is what logging gives a record made at the same
    moment (Python 3.13 keeps logging's start time in nanoseconds, earlier ones in seconds),
    on both paths."""
    event = eventbus.EpochEnd(epoch=1)
    plain = logging.LogRecord("x", logging.INFO, "p", 0, "m", None, None)
    handler = EventLoggingHandler(stream=io.StringIO())
    record = handler.make_record(event, logging.INFO)
    assert abs(record.relativeCreated - plain.relativeCreated) < 60_000
    direct, direct_sink, _, _ = pair("%(relativeCreated)d")
    direct.on_event(event)
    assert abs(int(direct_sink.getvalue()) - plain.relativeCreated) < 60_000
