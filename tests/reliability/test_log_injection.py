"""Row 18: line breaks, control and escape sequences in fields never split an event.

One event is one JSON line (to_json), one log line (the logging bridge) and one line of
the JSONL recorder's file.
"""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Callable
from pathlib import Path

import eventbus
from eventbus import Bus
from eventbus import Event
from eventbus.subscribers.log_handler import EventLoggingHandler

HOSTILE = [
    "line\nbreak", "carriage\rreturn", "crlf\r\n", "u2028\u2028sep", "u2029\u2029sep",
    "nel\x85", "vt\x0bff\x0c", "fs\x1cgs\x1drs\x1e", "\x1b[2J\x1b[31mred", "\x1b]0;title\x07",
    "nul\x00", "del\x7f", "tab\tx", "\ud800 lone surrogate",
    "fake\n2026-11-29 10:00:00,000 - eventbus - INFO - WORKER_EXIT worker_id=0 exit_code=0",
]


def _record_all(bus: Bus) -> int:
    n = 0
    for text in HOSTILE:
        bus.record("CHECKPOINT_SAVED", path=text, data={text: text, "list": [text]})
        bus.record("WORKER_EXIT", worker_id=1, exit_code=1, message=text, signal=text)
        bus.record("METRIC", data={"note": text})
        n += 3
    return n


def test_one_json_line_per_event(bus: Bus, figure: Callable[[int, str], None]) -> None:
    """Every hostile string, in typed fields, data keys and data values: each to_json()
    is exactly one line by str.splitlines() (the broadest definition of a line break),
    has no raw control character, and decodes back to the same text."""
    got: list[Event] = []
    bus.subscribe(eventbus.ALL, on_event=got.append)
    n = _record_all(bus)
    text = "\n".join(e.to_json() for e in got)
    lines = text.splitlines()
    assert len(lines) == n == len(got)
    for line in lines:
        assert not any(ord(c) < 0x20 for c in line)
        assert "\x7f" not in line or json.loads(line)  # DEL is legal JSON, not a break
    back = [Event.from_json(line) for line in lines]
    assert [e.to_dict()["data"] for e in back] == [e.to_dict()["data"] for e in got]
    figure(18, f"JSON lines {len(lines)} == events {n}")


def test_one_log_line_per_event(bus: Bus, figure: Callable[[int, str], None]) -> None:
    """The logging bridge writes one line per event, whatever the payload: no raw
    control characters (no terminal escape sequences) and no forged extra records."""
    stream = io.StringIO()
    handler = EventLoggingHandler(stream=stream)
    handler.set_format("%(asctime)s - %(name)s - %(levelname)s - %(message)s")
    handler.attach(bus)
    n = _record_all(bus)
    out = stream.getvalue()
    lines = out.splitlines()
    assert len(lines) == n
    assert not any(ord(c) < 0x20 and c != "\n" for c in out)
    # every line is one record of ours: it starts with its own timestamp and level (the
    # forged record inside a payload stays inside its line)
    stamp = re.compile(
        r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} - eventbus\.events - (INFO|ERROR) - ")
    assert all(stamp.match(line) for line in lines)
    figure(18, f"log lines {len(lines)} == events {n}")


def test_one_log_line_per_event_through_a_user_logger(bus: Bus) -> None:
    """Routed through a user's logger and a plain logging.StreamHandler, the message the
    bridge builds is still one line per event."""
    stream = io.StringIO()
    user = logging.getLogger("reliability.row18")
    user.propagate = False
    user.setLevel(logging.INFO)
    plain = logging.StreamHandler(stream)
    user.addHandler(plain)
    try:
        handler = EventLoggingHandler()
        handler.set_logger(user)
        handler.attach(bus)
        n = _record_all(bus)
    finally:
        user.removeHandler(plain)
    assert len(stream.getvalue().splitlines()) == n


def test_one_jsonl_line_per_event(tmp_path: Path, figure: Callable[[int, str], None]) -> None:
    """Through the JSONL recorder: the file has exactly one line per event (split on
    b"\\n", the way line-based tools read it) and each decodes to its event."""
    from eventbus.subscribers.jsonl import JsonlRecorder
    from eventbus.subscribers.jsonl import read_jsonl

    bus = Bus("row18-jsonl")
    path = tmp_path / "events.jsonl"
    recorder = JsonlRecorder(path)
    bus.subscribe(eventbus.ALL, on_event=recorder)
    n = _record_all(bus)
    assert recorder.close(timeout=30)
    raw = path.read_bytes()
    assert raw.count(b"\n") == n
    assert len(raw.decode("utf-8").splitlines()) == n
    read = read_jsonl(path, decode="event")
    assert len(list(read)) == n and read.skipped == 0
    figure(18, f"JSONL lines {len(raw.splitlines())} == events {n}")
