"""eventbus.subscribers.log_handler: bus events as logging records, one line per event."""

from __future__ import annotations

import io
import json
import logging
import logging.config
import re
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import eventbus
from eventbus import EventType
from eventbus.subscribers import log_handler
from eventbus.subscribers.log_handler import EventLoggingHandler
from eventbus.subscribers.log_handler import escape_line
from eventbus.subscribers.log_handler import format_event
from eventbus.testing import strict_bus

PLAIN = "%(levelname)s %(name)s %(message)s"


class Capture(logging.Handler):
    """Keeps the records a logger hands it."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class JsonFormatter(logging.Formatter):
    """What a JSON formatter does: every non-standard record attribute becomes a key."""

    STANDARD = frozenset(logging.LogRecord("n", 0, "p", 0, "m", None, None).__dict__) | {
        "message", "asctime", "taskName", "event"}

    def format(self, record: logging.LogRecord) -> str:
        out = {"level": record.levelname, "logger": record.name, "msg": record.getMessage()}
        out.update({k: v for k, v in record.__dict__.items() if k not in self.STANDARD})
        return json.dumps(out, default=str)


@pytest.fixture
def sink() -> io.StringIO:
    """A text stream to write lines to."""
    return io.StringIO()


@pytest.fixture
def handler(bus: eventbus.Bus, sink: io.StringIO) -> Iterator[EventLoggingHandler]:
    """A handler attached to the private test bus, writing PLAIN lines to ``sink``."""
    h = EventLoggingHandler(stream=sink, fmt=PLAIN)
    h.attach(bus)
    yield h
    h.detach()


@pytest.fixture
def default_handler(sink: io.StringIO) -> Iterator[EventLoggingHandler]:
    """The default handler writing to ``sink``; its settings are restored afterwards."""
    h = eventbus.get_logging_handler()
    saved = (h.formatter, h.level, h.logger, h._stream, h._by_type, h._level_fn,
             h._failure_level, h._default_level, list(h.filters))
    h.set_stream(sink)
    h.set_logger(None)
    h.set_format(PLAIN)
    h.setLevel(logging.NOTSET)
    yield h
    (h.formatter, h.level, h._logger, h._stream, h._by_type, h._level_fn,
     h._failure_level, h._default_level, h.filters) = saved


def lines(sink: io.StringIO) -> list[str]:
    return sink.getvalue().splitlines()


# -- the message -------------------------------------------------------------------------------


def test_message_reads_type_fields_and_data(bus: eventbus.Bus, handler: EventLoggingHandler,
                                            sink: io.StringIO) -> None:
    """WORKER_EXIT worker_id=0 exit_code=0 data={...}: typed fields, then data as JSON."""
    bus.record(EventType.WORKER_EXIT, worker_id=0, exit_code=0, data={"epoch": 10, "loss": 0.01})
    assert lines(sink) == [
        'INFO eventbus.events WORKER_EXIT worker_id=0 exit_code=0 '
        'data={"epoch": 10, "loss": 0.01}']


def test_progress_heartbeats_print_nothing_unless_asked_for(
        bus: eventbus.Bus, handler: EventLoggingHandler, sink: io.StringIO) -> None:
    """WORKER_PROGRESS is quiet: a NOTSET or INFO handler skips it; a DEBUG handler or a
    level map naming the type logs it; other events still log at INFO."""
    beat = {"worker_id": 1, "step": 3, "collectives": 7, "idle_s": 0.5}
    bus.record(EventType.WORKER_PROGRESS, **beat)
    handler.setLevel(logging.INFO)
    bus.record(EventType.WORKER_PROGRESS, **beat)
    bus.record(EventType.EPOCH_END, epoch=1)
    assert lines(sink) == ["INFO eventbus.events EPOCH_END epoch=1"]
    handler.setLevel(logging.DEBUG)
    bus.record(EventType.WORKER_PROGRESS, **beat)
    handler.setLevel(logging.NOTSET)
    handler.set_levels({"WORKER_PROGRESS": "INFO"})
    bus.record(EventType.WORKER_PROGRESS, **beat)
    assert lines(sink)[1:] == [
        "DEBUG eventbus.events WORKER_PROGRESS worker_id=1 step=3 collectives=7 idle_s=0.5",
        "INFO eventbus.events WORKER_PROGRESS worker_id=1 step=3 collectives=7 idle_s=0.5"]


def test_message_leaves_out_none_fields_and_quotes_strings(bus: eventbus.Bus,
                                                           handler: EventLoggingHandler,
                                                           sink: io.StringIO) -> None:
    """Optional fields left at None are not shown; string fields are JSON-quoted."""
    bus.record(EventType.CHECKPOINT_SAVED, path="/ckpt/a b.pt", epoch=2)
    assert lines(sink) == ['INFO eventbus.events CHECKPOINT_SAVED path="/ckpt/a b.pt" epoch=2']


def test_message_ends_with_the_rank_of_the_context() -> None:
    """An event recorded in a worker (context rank set) says rank=N at the end."""
    ctx = eventbus.JobContext(rank=3, hostname="h", pid=1)
    event = eventbus.EpochEnd(epoch=1, context=ctx)
    assert format_event(event) == "EPOCH_END epoch=1 rank=3"


def test_data_in_the_message_is_bounded() -> None:
    """A huge data payload is cut in the message, saying how much was cut."""
    event = eventbus.Metric(data={"blob": "x" * 100_000})
    text = format_event(event, max_data_chars=200)
    assert len(text) < 300
    assert "...[truncated" in text


def test_data_that_does_not_encode_still_formats() -> None:
    """A value whose __repr__ raises, NaN and a tensor-like in data: the message still forms."""
    class Bad:
        def __repr__(self) -> str:
            raise RuntimeError("no repr")

    text = format_event(eventbus.Metric(data={"bad": Bad(), "nan": float("nan")}))
    assert text.startswith("METRIC data={")
    assert "failing __repr__" in text


# -- the record --------------------------------------------------------------------------------


def test_record_carries_event_and_fields(bus: eventbus.Bus) -> None:
    """record.event is the typed event; fields, type, data and context are attributes."""
    capture = Capture()
    logger = logging.getLogger("test.log_handler.fields")
    logger.addHandler(capture)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    h = EventLoggingHandler(logger=logger)
    h.attach(bus)
    bus.record(EventType.WORKER_EXIT, worker_id=2, exit_code=1, data={"k": "v"})
    (record,) = capture.records
    event = record.event  # type: ignore[attr-defined]
    assert isinstance(event, eventbus.WorkerExit)
    assert (record.worker_id, record.exit_code) == (2, 1)  # type: ignore[attr-defined]
    assert record.event_type == "WORKER_EXIT"  # type: ignore[attr-defined]
    assert record.event_data == {"k": "v"}  # type: ignore[attr-defined]
    assert record.event_context["pid"] == event.context.pid  # type: ignore[attr-defined]
    assert record.created == event.timestamp
    assert record.levelno == logging.ERROR
    assert record.name == "test.log_handler.fields"


def test_field_names_taken_by_logrecord_are_prefixed() -> None:
    """Rendezvous.name/message become record.event_name/event_message; record.name stays."""
    h = EventLoggingHandler()
    event = eventbus.Rendezvous(state="SUCCEEDED", name="round-1", message="ok")
    record = h.make_record(event, logging.INFO)
    assert record.name == "eventbus.events"
    assert record.getMessage().startswith("RENDEZVOUS state=")
    assert (record.event_name, record.event_message) == ("round-1", "ok")  # type: ignore[attr-defined]


def test_json_formatter_picks_up_fields(bus: eventbus.Bus, sink: io.StringIO) -> None:
    """A JSON formatter that dumps record attributes gets the event's fields as keys."""
    h = EventLoggingHandler(stream=sink)
    h.setFormatter(JsonFormatter())
    h.attach(bus)
    bus.record(EventType.WORKER_START, worker_id=5, data={"host": "a"})
    out = json.loads(sink.getvalue())
    assert out["worker_id"] == 5
    assert out["event_type"] == "WORKER_START"
    assert out["event_data"] == {"host": "a"}
    assert out["level"] == "INFO"


def test_asctime_is_the_event_time(bus: eventbus.Bus, sink: io.StringIO) -> None:
    """%(asctime)s shows when the event happened, not when it was logged."""
    h = EventLoggingHandler(stream=sink, fmt="%(asctime)s %(message)s", datefmt="%Y")
    event = eventbus.EpochStart(epoch=1, timestamp=0.5)  # 1970
    h.on_event(event)
    assert sink.getvalue().startswith("1970 EPOCH_START")


# -- levels ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("event_type", "fields", "level"), [
    ("WORKER_EXIT", {"worker_id": 0, "exit_code": 0}, "INFO"),
    ("WORKER_EXIT", {"worker_id": 0, "exit_code": 1}, "ERROR"),
    ("WORKER_EXIT", {"worker_id": 0, "exit_code": -9}, "ERROR"),
    ("RENDEZVOUS", {"state": "SUCCEEDED"}, "INFO"),
    ("RENDEZVOUS", {"state": "FAILED"}, "ERROR"),
    ("AGENT_EXIT", {"state": "SUCCEEDED"}, "INFO"),
    ("AGENT_EXIT", {"state": "FAILED"}, "ERROR"),
    ("AGENT_EXIT", {"state": "STOPPED"}, "ERROR"),
    ("EVENTS_LOST", {"source": "store", "count": 3, "reason": "gap"}, "ERROR"),
    ("EPOCH_END", {"epoch": 1}, "INFO"),
])
def test_failures_log_at_error_the_rest_at_info(bus: eventbus.Bus, handler: EventLoggingHandler,
                                                sink: io.StringIO, event_type: str,
                                                fields: dict[str, Any], level: str) -> None:
    """Non-zero exit, failed rendezvous, an agent that did not succeed: ERROR; else INFO."""
    bus.record(event_type, **fields)
    assert lines(sink)[0].split()[0] == level


def test_levels_per_type_and_for_failures_are_configurable(bus: eventbus.Bus,
                                                          handler: EventLoggingHandler,
                                                          sink: io.StringIO) -> None:
    """set_levels: a per-type mapping wins; failure/default levels replace ERROR/INFO."""
    handler.set_levels({EventType.METRIC: "DEBUG", "EPOCH_END": logging.WARNING},
                       failure="CRITICAL", default=logging.INFO)
    bus.record(EventType.METRIC, step=1)
    bus.record(EventType.EPOCH_END, epoch=1)
    bus.record(EventType.WORKER_EXIT, worker_id=0, exit_code=2)
    bus.record(EventType.WORKER_START, worker_id=0)
    assert [line.split()[0] for line in lines(sink)] == ["DEBUG", "WARNING", "CRITICAL", "INFO"]


def test_levels_by_function(bus: eventbus.Bus, handler: EventLoggingHandler,
                            sink: io.StringIO) -> None:
    """A function (event) -> level decides for every event."""
    handler.set_levels(lambda e: logging.WARNING if e.data.get("slow") else logging.DEBUG)
    bus.record(EventType.METRIC, data={"slow": True})
    bus.record(EventType.METRIC, data={})
    assert [line.split()[0] for line in lines(sink)] == ["WARNING", "DEBUG"]


@pytest.mark.parametrize(("levels", "error", "match"), [
    ({"WORKER_EXIT": "LOUD"}, ValueError, r"levels\['WORKER_EXIT'\].*unknown level name"),
    ({"NO_SUCH_TYPE": "INFO"}, ValueError, "NO_SUCH_TYPE"),
    ({"WORKER_EXIT": True}, TypeError, "bool"),
    (["WORKER_EXIT"], TypeError, "mapping"),
])
def test_bad_level_configuration_names_the_problem(levels: Any, error: type[Exception],
                                                   match: str) -> None:
    """An unknown level name, event type or a wrong kind of value: an error naming it."""
    with pytest.raises(error, match=match):
        EventLoggingHandler(levels=levels)


def test_nothing_is_formatted_below_the_level(bus: eventbus.Bus, handler: EventLoggingHandler,
                                              sink: io.StringIO,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """An INFO event under setLevel(ERROR) (or a WARNING logger) is never formatted."""
    calls: list[eventbus.Event] = []
    original = log_handler._line  # what format_event and the handler's records call

    def counting(event: eventbus.Event, *args: Any) -> str:
        calls.append(event)
        return original(event, *args)

    monkeypatch.setattr(log_handler, "_line", counting)
    handler.setLevel(logging.ERROR)
    bus.record(EventType.WORKER_EXIT, worker_id=0, exit_code=0)
    assert calls == [] and sink.getvalue() == ""
    logger = logging.getLogger("test.log_handler.quiet")
    logger.setLevel(logging.WARNING)
    handler.setLevel(logging.NOTSET)
    handler.set_logger(logger)
    bus.record(EventType.WORKER_EXIT, worker_id=0, exit_code=0)
    assert calls == []
    bus.record(EventType.WORKER_EXIT, worker_id=0, exit_code=4)
    assert len(calls) == 1


# -- one event, one line -----------------------------------------------------------------------

HOSTILE = ["a\nb", "a\r\nb", "\x1b[31mred\x1b[0m", "\x9b31m", "x\u2028y\u2029z", "n\x85l",
           "\x00\x07\x7f", "bidi\u202eevil\u2066", "tab\there", "lone\ud800surrogate"]


@pytest.mark.parametrize("text", HOSTILE)
def test_hostile_text_in_any_field_stays_on_one_line(bus: eventbus.Bus,
                                                      handler: EventLoggingHandler,
                                                      sink: io.StringIO, text: str) -> None:
    """Newlines, ANSI escapes (ESC and CSI), U+2028/2029/0085, NUL, DEL, bidi: escaped."""
    bus.record(EventType.RENDEZVOUS, state="FAILED", name=text, message=text,
               data={text: text, "nested": [text, {"k": text}]})
    bus.record(EventType.CHECKPOINT_SAVED, path=text)
    out = sink.getvalue()
    assert len(out.splitlines()) == 2
    assert out.count("\n") == 2
    body = out.replace("\n", "")
    assert body.isprintable(), repr(body)


@settings(max_examples=300, deadline=None)
@given(st.text(st.characters(exclude_categories=())), st.text())
def test_any_text_gives_exactly_one_writable_line(text: str, key: str) -> None:
    """Property: whatever the strings (surrogates too), one line, no control or bidi
    character, encodable as UTF-8."""
    line = format_event(eventbus.Rendezvous(state=text, name=key, data={key: text}))
    assert len(line.splitlines()) == 1
    assert not set(map(ord, line)) & set(log_handler._ESCAPES)
    line.encode("utf-8")


def test_escape_line_is_idempotent() -> None:
    """Escaping an escaped line changes nothing (lines pass through it twice)."""
    once = escape_line("".join(HOSTILE))
    assert escape_line(once) == once


def test_non_event_records_through_the_handler_are_one_line_too(sink: io.StringIO) -> None:
    """Attached to an ordinary logger, a multi-line message or traceback becomes one line."""
    h = EventLoggingHandler(stream=sink, fmt="%(message)s")
    logger = logging.getLogger("test.log_handler.plain")
    logger.addHandler(h)
    logger.propagate = False
    try:
        try:
            raise ValueError("line1\nline2")
        except ValueError:
            logger.exception("first\nsecond")
    finally:
        logger.removeHandler(h)
    assert len(lines(sink)) == 1
    assert "Traceback" in sink.getvalue() and "first\\nsecond" in sink.getvalue()


# -- failures stay inside ----------------------------------------------------------------------


class BrokenStream(io.StringIO):
    def write(self, s: str) -> int:
        raise OSError("disk full")


class BadFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        raise RuntimeError("formatter bug")


@pytest.mark.parametrize("breakage", ["stream", "closed", "formatter"])
def test_broken_stream_or_formatter_never_reaches_record(bus: eventbus.Bus,
                                                         capsys: pytest.CaptureFixture[str],
                                                         breakage: str) -> None:
    """record() returns, later subscribers still get the event, handleError-style report."""
    if breakage == "stream":
        h = EventLoggingHandler(stream=BrokenStream())
    elif breakage == "closed":
        closed = io.StringIO()
        closed.close()
        h = EventLoggingHandler(stream=closed)
    else:
        h = EventLoggingHandler(stream=io.StringIO())
        h.setFormatter(BadFormatter())
    h.attach(bus)
    after: list[eventbus.Event] = []
    bus.subscribe(eventbus.ALL, on_event=after.append)
    with strict_bus(bus):  # any exception out of the handler would surface
        bus.record(EventType.WORKER_EXIT, worker_id=0, exit_code=1)
    assert len(after) == 1
    err = capsys.readouterr().err
    assert "--- Logging error ---" in err
    assert h.stats()["errors"] == 1


def test_errors_are_silent_when_logging_raise_exceptions_is_off(
        bus: eventbus.Bus, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """logging.raiseExceptions = False silences the report, as for any handler."""
    monkeypatch.setattr(logging, "raiseExceptions", False)
    h = EventLoggingHandler(stream=BrokenStream())
    h.attach(bus)
    bus.record(EventType.EPOCH_END, epoch=1)
    assert capsys.readouterr().err == ""
    assert h.stats()["errors"] == 1


def test_report_survives_a_broken_stderr(bus: eventbus.Bus,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """If stderr itself is the broken stream, the report fails quietly, record() still returns."""
    broken = io.StringIO()
    broken.close()
    monkeypatch.setattr(sys, "stderr", broken)
    h = EventLoggingHandler()  # writes to (the broken) sys.stderr
    h.attach(bus)
    with strict_bus(bus):
        bus.record(EventType.EPOCH_END, epoch=1)
    assert h.stats()["errors"] == 1


def test_raising_filter_on_the_users_logger_is_reported(bus: eventbus.Bus,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    """With set_logger, a logger filter that raises is reported, not raised into record()."""
    logger = logging.getLogger("test.log_handler.badfilter")
    logger.setLevel(logging.INFO)

    def bad_filter(record: logging.LogRecord) -> bool:
        raise RuntimeError("filter bug")

    logger.addFilter(bad_filter)
    try:
        h = EventLoggingHandler(logger=logger)
        h.attach(bus)
        with strict_bus(bus):
            bus.record(EventType.EPOCH_END, epoch=1)
    finally:
        logger.removeFilter(bad_filter)
    assert "filter bug" in capsys.readouterr().err


def test_events_recorded_while_logging_are_not_logged_again(bus: eventbus.Bus,
                                                            sink: io.StringIO) -> None:
    """A logging handler that records an event per record: no loop; the nested event is still
    delivered to other subscribers and counted as skipped here."""
    logger = logging.getLogger("test.log_handler.loop")
    logger.setLevel(logging.INFO)
    logger.propagate = False

    class Echo(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            bus.record(EventType.METRIC, data={"echo": record.getMessage()})

    echo = Echo()
    logger.addHandler(echo)
    seen: list[eventbus.Event] = []
    bus.subscribe(EventType.METRIC, on_event=seen.append)
    h = EventLoggingHandler(logger=logger)
    h.attach(bus)
    try:
        bus.record(EventType.EPOCH_END, epoch=1)
    finally:
        logger.removeHandler(echo)
    assert len(seen) == 1
    assert h.stats()["reentrant_skipped"] == 1


def test_many_threads_every_event_one_whole_line(bus: eventbus.Bus,
                                                 handler: EventLoggingHandler,
                                                 sink: io.StringIO) -> None:
    """8 threads x 500 events: 4000 lines, none interleaved."""
    handler.set_format("%(message)s")

    def work(t: int) -> None:
        for i in range(500):
            bus.record(EventType.METRIC, step=i, data={"thread": t})

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    out = lines(sink)
    assert len(out) == 4000
    assert all(re.fullmatch(r'METRIC step=\d+ data=\{"thread": \d\}', line) for line in out)


# -- configuration -----------------------------------------------------------------------------


def test_set_logger_routes_through_the_users_logger(bus: eventbus.Bus, handler: EventLoggingHandler,
                                                    sink: io.StringIO) -> None:
    """set_logger: the logger's own handlers and formatters write; the handler's stream does not."""
    own = io.StringIO()
    logger = logging.getLogger("test.log_handler.train")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    user_handler = logging.StreamHandler(own)
    user_handler.setFormatter(logging.Formatter("train| %(levelname)s %(message)s"))
    logger.addHandler(user_handler)
    try:
        handler.set_logger(logger)
        bus.record(EventType.WORKER_EXIT, worker_id=0, exit_code=0)
        handler.set_logger(None)
        bus.record(EventType.EPOCH_END, epoch=7)
    finally:
        logger.removeHandler(user_handler)
    assert own.getvalue() == "train| INFO WORKER_EXIT worker_id=0 exit_code=0\n"
    assert lines(sink) == ["INFO eventbus.events EPOCH_END epoch=7"]


def test_set_logger_respects_level_propagation_and_disabled(bus: eventbus.Bus) -> None:
    """The logger's effective level, its parents' handlers and logger.disabled all apply."""
    parent = logging.getLogger("test.log_handler.parent")
    child = logging.getLogger("test.log_handler.parent.child")
    capture = Capture()
    parent.addHandler(capture)
    parent.propagate = False
    parent.setLevel(logging.ERROR)  # the child inherits it
    try:
        h = EventLoggingHandler(logger="test.log_handler.parent.child")
        h.attach(bus)
        bus.record(EventType.WORKER_EXIT, worker_id=0, exit_code=0)  # INFO < ERROR
        bus.record(EventType.WORKER_EXIT, worker_id=0, exit_code=9)  # ERROR: propagates up
        child.disabled = True
        bus.record(EventType.WORKER_EXIT, worker_id=0, exit_code=8)
    finally:
        child.disabled = False
        parent.removeHandler(capture)
    assert [r.exit_code for r in capture.records] == [9]  # type: ignore[attr-defined]
    assert capture.records[0].name == "test.log_handler.parent.child"


def test_handler_level_is_a_first_gate_even_with_a_logger(bus: eventbus.Bus) -> None:
    """setLevel(ERROR) on the handler keeps INFO events out of a DEBUG logger too."""
    logger = logging.getLogger("test.log_handler.gate")
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    capture = Capture()
    logger.addHandler(capture)
    h = EventLoggingHandler(logger=logger, level="ERROR")
    h.attach(bus)
    bus.record(EventType.EPOCH_END, epoch=1)
    bus.record(EventType.WORKER_EXIT, worker_id=0, exit_code=1)
    logger.removeHandler(capture)
    assert [r.event_type for r in capture.records] == ["WORKER_EXIT"]  # type: ignore[attr-defined]


def test_set_stream_none_writes_to_the_current_stderr(bus: eventbus.Bus,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Without a stream the handler writes to sys.stderr as it is at the time of writing."""
    h = EventLoggingHandler(fmt="%(message)s")
    h.attach(bus)
    bus.record(EventType.EPOCH_END, epoch=3)
    assert capsys.readouterr().err == "EPOCH_END epoch=3\n"


@pytest.mark.parametrize(("call", "error", "match"), [
    (lambda h: h.set_stream(42), TypeError, "write"),
    (lambda h: h.set_format(None), TypeError, "format string"),
    (lambda h: h.set_format("%(message"), ValueError, "set_format"),
    (lambda h: h.set_logger(3.5), TypeError, "logging.Logger"),
    (lambda h: EventLoggingHandler(subscribe="yes"), ValueError, "subscribe"),
])
def test_bad_configuration_is_refused_with_the_fix(call: Any, error: type[Exception],
                                                   match: str) -> None:
    """Bad streams, formats, loggers and modes raise errors that name the argument."""
    with pytest.raises(error, match=match):
        call(EventLoggingHandler())


def test_set_format_accepts_brace_style(bus: eventbus.Bus, sink: io.StringIO) -> None:
    """set_format(fmt, style="{") uses a brace-style Formatter."""
    h = EventLoggingHandler(stream=sink)
    h.set_format("{levelname}: {message}", style="{")
    h.attach(bus)
    bus.record(EventType.EPOCH_END, epoch=1)
    assert lines(sink) == ["INFO: EPOCH_END epoch=1"]


# -- the default handler -----------------------------------------------------------------------


def test_get_logging_handler_is_one_real_handler_subscribed_once() -> None:
    """Repeated calls (any destination) return the same logging.Handler, subscribed once."""
    first = eventbus.get_logging_handler()
    assert isinstance(first, logging.Handler)
    assert eventbus.get_logging_handler("console") is first
    assert eventbus.get_logging_handler() is first
    subs = [s for s in eventbus.get_default_bus().subscriptions()
            if getattr(s.on_event, "__self__", None) is first]
    assert len(subs) == 1
    with pytest.raises(TypeError, match="destination"):
        eventbus.get_logging_handler(5)  # type: ignore[arg-type]


def test_default_handler_gets_every_event_of_the_default_bus(
        default_handler: EventLoggingHandler, sink: io.StringIO) -> None:
    """eventbus.record() of any type reaches the default handler."""
    eventbus.record(EventType.WORKER_EXIT, worker_id=0, exit_code=0)
    eventbus.record(EventType.CHECKPOINT_SAVED, path="/x")
    assert [line.split()[2] for line in lines(sink)] == ["WORKER_EXIT", "CHECKPOINT_SAVED"]


def test_default_handler_survives_close(default_handler: EventLoggingHandler,
                                        sink: io.StringIO) -> None:
    """close() (what dictConfig and logging.shutdown call) leaves the default one attached."""
    default_handler.close()
    eventbus.record(EventType.EPOCH_END, epoch=1)
    assert default_handler.attached
    assert len(lines(sink)) == 1


def test_basic_config_with_set_logger(default_handler: EventLoggingHandler,
                                      sink: io.StringIO) -> None:
    """basicConfig on the root + set_logger(getLogger("train")): lines in the root's format."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    out = io.StringIO()
    root.handlers.clear()
    try:
        logging.basicConfig(level=logging.INFO, stream=out,
                            format="%(name)s|%(levelname)s|%(message)s")
        default_handler.set_logger(logging.getLogger("train"))
        eventbus.record(EventType.WORKER_EXIT, worker_id=1, exit_code=0)
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    assert out.getvalue() == "train|INFO|WORKER_EXIT worker_id=1 exit_code=0\n"
    assert sink.getvalue() == ""


# -- dictConfig ----------------------------------------------------------------------------------


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """dictConfig rewires the root and closes handlers: put the root back afterwards."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    yield
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])


def test_dict_config_class_handler_subscribes_and_unsubscribes_on_reconfigure(
        restore_logging: None) -> None:
    """class: EventLoggingHandler with subscribe: default-bus logs events; a second dictConfig
    closes it, so events are not written twice."""
    sink = io.StringIO()

    def config() -> dict[str, Any]:
        return {
            "version": 1,
            "disable_existing_loggers": False,
            "formatters": {"plain": {"format": "cfg %(levelname)s %(message)s"}},
            "handlers": {"events": {
                "class": "eventbus.subscribers.log_handler.EventLoggingHandler",
                "subscribe": "default-bus", "stream": sink, "formatter": "plain",
                "level": "INFO", "levels": {"METRIC": "DEBUG"}}},
        }

    logging.config.dictConfig(config())
    eventbus.record(EventType.EPOCH_END, epoch=1)
    eventbus.record(EventType.METRIC, step=1)  # DEBUG < INFO: dropped
    logging.config.dictConfig(config())  # closes the first handler, builds a new one
    eventbus.record(EventType.EPOCH_END, epoch=2)
    logging.config.dictConfig({"version": 1, "disable_existing_loggers": False})
    eventbus.record(EventType.EPOCH_END, epoch=3)  # every config handler closed: nothing
    assert lines(sink) == ["cfg INFO EPOCH_END epoch=1", "cfg INFO EPOCH_END epoch=2"]


def test_dict_config_factory_configures_the_default_handler(
        restore_logging: None, default_handler: EventLoggingHandler) -> None:
    """"()": get_default_handler configures the one default handler (level, formatter, stream);
    it stays attached when dictConfig runs again."""
    sink = io.StringIO()
    logging.config.dictConfig({
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": "dflt %(levelname)s %(message)s"}},
        "handlers": {"events": {"()": "eventbus.subscribers.log_handler.get_default_handler",
                                "stream": sink, "formatter": "plain", "level": "ERROR"}},
    })
    eventbus.record(EventType.WORKER_EXIT, worker_id=0, exit_code=0)  # INFO: below ERROR
    eventbus.record(EventType.WORKER_EXIT, worker_id=0, exit_code=5)
    logging.config.dictConfig({"version": 1, "disable_existing_loggers": False})
    eventbus.record(EventType.WORKER_EXIT, worker_id=1, exit_code=6)
    assert default_handler is eventbus.get_logging_handler()
    assert lines(sink) == ["dflt ERROR WORKER_EXIT worker_id=0 exit_code=5",
                           "dflt ERROR WORKER_EXIT worker_id=1 exit_code=6"]


def test_dict_config_logger_with_json_formatter_and_set_logger(
        restore_logging: None, default_handler: EventLoggingHandler) -> None:
    """dictConfig sets up logger "train" with a JSON formatter; set_logger sends events there."""
    sink = io.StringIO()
    logging.config.dictConfig({
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": JsonFormatter}},
        "handlers": {"out": {"class": "logging.StreamHandler", "stream": sink,
                             "formatter": "json"}},
        "loggers": {"train": {"handlers": ["out"], "level": "INFO", "propagate": False}},
    })
    default_handler.set_logger("train")
    eventbus.record(EventType.WORKER_EXIT, worker_id=3, exit_code=0, data={"epoch": 10})
    out = json.loads(sink.getvalue())
    assert (out["logger"], out["worker_id"], out["exit_code"]) == ("train", 3, 0)
    assert out["event_data"] == {"epoch": 10}
    assert out["msg"].startswith("WORKER_EXIT worker_id=3 exit_code=0")
