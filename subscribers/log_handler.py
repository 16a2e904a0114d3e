"""The logging bridge: bus events -> Python logging records."""

from __future__ import annotations

import logging
import sys
import threading
from typing import IO
from typing import Any

from eventbus.bus import ALL
from eventbus.bus import Subscription
from eventbus.bus import get_default_bus
from eventbus.events import Event

__all__ = ["EventLoggingHandler", "format_event", "get_default_handler"]

_ESCAPES = {i: f"\\x{i:02x}" for i in range(32)}
_ESCAPES.update({ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t", 0x7F: "\\x7f",
                 0x85: "\\x85", 0x2028: "\\u2028", 0x2029: "\\u2029"})


def _one_line(text: str) -> str:
    return text.translate(_ESCAPES)


def format_event(event: Event) -> str:
    """``WORKER_EXIT worker_id=0 exit_code=0 data={...}``: one line, control chars escaped."""
    parts = [str(event.type)]
    for name, value in event.fields().items():
        if value is not None:
            parts.append(f"{name}={value!r}" if isinstance(value, str) else f"{name}={value}")
    if event.data:
        parts.append(f"data={event.data!r}")
    return _one_line(" ".join(parts))


class EventLoggingHandler(logging.Handler):
    """A ``logging.Handler`` fed by bus events; see :func:`eventbus.get_logging_handler`."""

    def __init__(self, level: int = logging.NOTSET, *, stream: IO[str] | None = None) -> None:
        super().__init__(level)
        self._stream: IO[str] | None = stream
        self._logger: logging.Logger | None = None
        self._subscription: Subscription | None = None
        self.setFormatter(logging.Formatter("%(message)s"))

    def set_format(self, fmt: str) -> None:
        """Use ``logging.Formatter(fmt)`` for the lines this handler writes."""
        self.setFormatter(logging.Formatter(fmt))

    def set_stream(self, stream: IO[str]) -> None:
        """Write lines to ``stream`` (default: ``sys.stderr`` at the time of writing)."""
        self._stream = stream

    def set_logger(self, logger: logging.Logger | None) -> None:
        """Route event records through ``logger`` and its handlers instead of the stream."""
        self._logger = logger

    def attach(self, bus: Any = None) -> None:
        """Subscribe to every event of ``bus`` (default: the default bus). Idempotent."""
        if self._subscription is None:
            self._subscription = (bus or get_default_bus()).subscribe(
                ALL, on_event=self.on_event)

    def on_event(self, event: Event) -> None:
        """Turn ``event`` into a ``LogRecord`` and handle it."""
        level = logging.ERROR if event.is_failure else logging.INFO
        target = self._logger
        name = target.name if target is not None else "eventbus.events"
        record = logging.LogRecord(name, level, __file__, 0, format_event(event), None, None)
        record.event = event
        record.created = event.timestamp
        if target is not None:
            if target.isEnabledFor(level):
                target.handle(record)
            return
        if level >= self.level:
            self.handle(record)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = _one_line(self.format(record))
            stream = self._stream if self._stream is not None else sys.stderr
            stream.write(line + "\n")
            stream.flush()
        except Exception:
            self.handleError(record)


_default: EventLoggingHandler | None = None
_lock = threading.Lock()


def get_default_handler(destination: str | None = None) -> EventLoggingHandler:
    """The one default handler, subscribed to the default bus on first call."""
    global _default
    with _lock:
        if _default is None:
            _default = EventLoggingHandler()
            _default.attach()
        return _default
