"""bus -> logging: events as standard ``logging`` records, one line per event.

:class:`EventLoggingHandler` is a real ``logging.Handler``. Subscribed to a bus (the default
one via :func:`eventbus.get_logging_handler`), it turns each event into a ``LogRecord``:

* the message reads ``WORKER_EXIT worker_id=0 exit_code=0 data={"epoch": 10, ...}``;
* ``record.event`` is the typed event; ``record.event_type``, ``record.event_timestamp``,
  ``record.event_data`` and ``record.event_context`` (a dict) and every typed field (as
  ``record.<field>``, or ``record.event_<field>`` where the name is taken by ``LogRecord``
  itself, e.g. ``name`` or ``message``) are attributes a JSON formatter can pick up;
* the level comes from the event: failures (``event.is_failure``) at ERROR, the rest at
  INFO, per type or by a function when configured (:meth:`EventLoggingHandler.set_levels`);
  progress heartbeats (``WORKER_PROGRESS``, one per worker every second or two) are quiet:
  DEBUG, and a handler with no level of its own (``NOTSET``) skips them, so they print
  nothing unless asked for (a handler level of DEBUG, or ``set_levels`` naming the type);
* ``record.created`` is the event's timestamp.

Nothing is formatted unless the record passes the handler's level (and, with
:meth:`~EventLoggingHandler.set_logger`, the logger's). Then the record goes either to the
handler's own stream or, with ``set_logger(logger)``, through ``logger.handle()``: that
logger's level, filters, handlers and propagation decide, as for any record of it.
Writing its own stream with no filter, a plain ``logging.Formatter`` (%-style) and the stock
``LogRecord`` factory, the handler builds no record at all: only its formatter would read
one, so the line is the format applied to the attributes it names (the values a record
would hold; :mod:`eventbus.subscribers._log_direct`, the direct path, keeps that promise);
any other setup, or a format naming thread, process, task or event attributes, gets real
records. The lines are the same either way.

One event is one line: control characters (C0, DEL, C1, hence ANSI escape sequences),
U+2028/U+2029, bidirectional overrides and lone surrogates are escaped in what this
handler writes.
A broken stream or a raising formatter never reaches ``record()``: it is reported the way
``logging.Handler.handleError`` reports it (to stderr while ``logging.raiseExceptions``).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import operator
import sys
import threading
from collections.abc import Callable
from collections.abc import Mapping
from typing import IO
from typing import Any
from typing import Literal

import attrs

from eventbus.bus import ALL
from eventbus.bus import Bus
from eventbus.bus import Subscription
from eventbus.bus import get_default_bus
from eventbus.encoding import LIMITS
from eventbus.encoding import sanitize
from eventbus.events import Event
from eventbus.events import event_class
from eventbus.subscribers._log_direct import DirectLines
from eventbus.subscribers._log_direct import record_times

__all__ = [
    "DEFAULT_FORMAT",
    "EventLoggingHandler",
    "escape_line",
    "format_event",
    "get_default_handler",
]

#: the format of a handler that was given none: the message alone, as torch's "console"
#: destination writes it (``set_format`` adds time, level, logger name)
DEFAULT_FORMAT = "%(message)s"
#: logger name of the records a handler makes while no logger is set
RECORD_NAME = "eventbus.events"
#: characters of ``data=...`` kept in a message
MAX_DATA_CHARS = 4_096
#: types logged at DEBUG unless ``set_levels`` names them, and skipped by a NOTSET handler
QUIET_TYPES = frozenset({"WORKER_PROGRESS"})

# -- one line ---------------------------------------------------------------------------------

_ESCAPES: dict[int, str] = {i: f"\\x{i:02x}" for i in range(32)}
_ESCAPES.update({i: f"\\x{i:02x}" for i in range(0x7F, 0xA0)})  # DEL and C1 (0x9b is CSI)
_ESCAPES.update({ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t"})
for _cp in (0x2028, 0x2029, *range(0x202A, 0x202F), *range(0x2066, 0x206A)):
    # line/paragraph separators; bidi embeddings, overrides and isolates
    _ESCAPES[_cp] = f"\\u{_cp:04x}"
for _cp in range(0xD800, 0xE000):
    # lone surrogates: a UTF-8 stream could not write the line at all
    _ESCAPES[_cp] = f"\\u{_cp:04x}"
del _cp


def escape_line(text: str) -> str:
    """``text`` with every character that could break or disguise a log line escaped."""
    if text.isprintable():  # the common case: nothing to escape (str.isprintable is fast)
        return text
    return text.translate(_ESCAPES)


# Made once: json.dumps with any option builds a new encoder on every call.
_quote = json.JSONEncoder(ensure_ascii=False).encode


def _data_encoder() -> Callable[[Any], str]:
    """``json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(", ", ": "))``,
    calling the C encoder directly: ``JSONEncoder.encode`` makes a new one per call.
    Only for acyclic input (what :func:`_plain` accepts, or :func:`sanitize`'s output)."""
    encoder = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(", ", ": "))
    make = getattr(json.encoder, "c_make_encoder", None)
    escape = getattr(json.encoder, "c_encode_basestring", None)
    if make is None or escape is None:
        return encoder.encode
    one_shot = make(None, encoder.default, escape, None, ": ", ", ", False, False, False)

    def encode(obj: Any) -> str:
        return "".join(one_shot(obj, 0))
    return encode


_encode_data = _data_encoder()
_NO_SANITIZE = frozenset({int, bool, type(None)})
#: an int of more bits than this may be over LIMITS.max_int_digits: sanitize it
_SAFE_INT_BITS = 3_000


def _plain(data: Mapping[str, Any]) -> bool:
    """True when ``data`` is a flat dict that :func:`sanitize` would return unchanged
    (string keys; ints, bools, None, finite floats and strings within LIMITS)."""
    if not isinstance(data, dict) or len(data) > LIMITS.max_items:
        return False
    for key, value in data.items():
        cls = type(value)
        if type(key) is not str or len(key) > 256:
            return False
        if cls in _NO_SANITIZE:
            if cls is int and value.bit_length() > _SAFE_INT_BITS:
                return False
        elif cls is float:
            if value - value != 0.0:  # NaN or an infinity: sanitize writes a tag
                return False
        elif cls is not str or len(value) > LIMITS.max_string:
            return False
    return True


def _data_text(data: Mapping[str, Any], limit: int) -> str:
    try:
        # The usual metrics dict needs no sanitizing: skip the Python-level walk.
        text = _encode_data(data if _plain(data) else sanitize(data))
    except (TypeError, ValueError, RecursionError):
        text = _quote(f"<data that does not encode: {type(data).__name__}>")
    if len(text) > limit:
        text = text[:limit] + f"...[truncated {len(text) - limit} chars]"
    return text


def format_event(event: Event, *, max_data_chars: int = MAX_DATA_CHARS) -> str:
    """``WORKER_EXIT worker_id=0 exit_code=0 data={"epoch": 10}``: one line, escaped.

    Typed fields that are ``None`` are left out; strings are JSON-quoted; ``data`` is JSON
    (bounded by :data:`eventbus.LIMITS` and ``max_data_chars``); ``rank=N`` closes the line
    when the event's context has a rank.
    """
    shape = _shape(type(event))
    return _line(event, shape, shape.read(event), max_data_chars)


def _line(event: Event, shape: _Shape, values: tuple[Any, ...], max_data_chars: int) -> str:
    """:func:`format_event` with the class's shape known and the typed fields' values
    already read, in field order."""
    parts = [shape.type_name]
    for name, value in zip(shape.fields, values, strict=True):
        if value is None:
            continue
        parts.append(f"{name}={_quote(value)}" if isinstance(value, str) else f"{name}={value}")
    data = event.data
    if data:
        parts.append("data=" + _data_text(data, max_data_chars))
    rank = event.context.rank
    if rank is not None:
        parts.append(f"rank={rank}")
    return escape_line(" ".join(parts))


# -- record attributes ------------------------------------------------------------------------

#: names a LogRecord already uses (or a Formatter adds); fields with these names are set
#: as ``event_<name>`` instead
_RECORD_NAMES = frozenset(
    logging.LogRecord("n", logging.INFO, "p", 0, "m", None, None).__dict__
) | {"message", "asctime", "taskName", "event", "event_type", "event_timestamp", "event_data",
     "event_context"}



@attrs.frozen
class _Shape:
    """What every event of one class shares in its line and its record."""

    #: the type's name
    type_name: str
    #: the typed fields' names, in order
    fields: tuple[str, ...]
    #: the record attribute of each (see :data:`_RECORD_NAMES`)
    record_attrs: tuple[str, ...]
    #: one C-level call that reads the fields' values, in order (getattr semantics: an
    #: optional field not given reads the class default)
    read: Callable[[Event], tuple[Any, ...]]


_shapes: dict[type[Event], _Shape] = {}


def _no_fields(event: Event) -> tuple[Any, ...]:
    return ()


def _shape(cls: type[Event]) -> _Shape:
    """The :class:`_Shape` of ``cls``, made on its first event (an event class's fields are
    fixed when the class is made)."""
    shape = _shapes.get(cls)
    if shape is None:
        fields = tuple(cls._fields)
        names = tuple(f"event_{name}" if name in _RECORD_NAMES else name for name in fields)
        read: Callable[[Event], tuple[Any, ...]]
        if len(fields) > 1:
            read = operator.attrgetter(*fields)
        elif fields:
            one = operator.attrgetter(fields[0])

            def read(event: Event) -> tuple[Any, ...]:
                return (one(event),)
        else:
            read = _no_fields
        shape = _Shape(str(cls.type), fields, names, read)
        _shapes[cls] = shape
    return shape


def _level_value(value: object, where: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{where}: a logging level is an int or a level name, got a bool")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        level = logging.getLevelName(value.upper())
        if isinstance(level, int):
            return level
        raise ValueError(f"{where}: unknown level name {value!r}; use DEBUG, INFO, WARNING, "
                         "ERROR, CRITICAL or an int")
    raise TypeError(f"{where}: a logging level is an int or a level name, "
                    f"got {type(value).__name__}")


#: methods that, replaced by a subclass or on the instance, need the full record path
_RECORD_PATH_METHODS = frozenset({"emit", "format", "handle"})


@attrs.frozen
class _ContextDict:
    """The last event context a handler saw, and its dict (contexts are immutable)."""

    context: object
    as_dict: dict[str, Any]


_NO_CONTEXT = _ContextDict(None, {})


LevelMap = Mapping[Any, int | str]
LevelFunction = Callable[[Event], int]


class EventLoggingHandler(logging.Handler):
    """A ``logging.Handler`` that turns bus events into log records.

    Options (keyword-only, so ``logging.config.dictConfig`` can pass them):

    * ``stream``: where lines go (default ``sys.stderr`` at the time of writing);
    * ``fmt`` / ``datefmt``: the ``logging.Formatter`` used (default :data:`DEFAULT_FORMAT`);
    * ``logger``: route records through this logger (a ``Logger`` or its name) instead;
    * ``levels``, ``failure_level``, ``default_level``: see :meth:`set_levels`;
    * ``subscribe``: ``"none"`` (default: events come from whoever calls :meth:`on_event`
      or :meth:`attach`) or ``"default-bus"``: subscribe to every event of the default bus
      now, and cancel that subscription on ``close()`` (so a handler built by
      ``dictConfig`` goes away when ``dictConfig`` runs again).
    """

    def __init__(
        self,
        level: int | str = logging.NOTSET,
        *,
        stream: IO[str] | None = None,
        fmt: str | None = None,
        datefmt: str | None = None,
        logger: logging.Logger | str | None = None,
        levels: LevelMap | LevelFunction | None = None,
        failure_level: int | str = logging.ERROR,
        default_level: int | str = logging.INFO,
        subscribe: Literal["none", "default-bus"] = "none",
    ) -> None:
        super().__init__(_level_value(level, "level"))
        self._stream: IO[str] | None = None
        self._logger: logging.Logger | None = None
        self._subscription: Subscription | None = None
        self._cancel_on_close = False
        self._by_type: dict[str, int] = {}
        self._level_fn: LevelFunction | None = None
        self._failure_level = logging.ERROR
        self._default_level = logging.INFO
        self._inside = threading.local()
        self._reentrant = itertools.count()
        self._errors = itertools.count()
        #: the last event context seen and its dict (replaced whole: no lock needed)
        self._context_dict = _NO_CONTEXT
        #: lines written without a LogRecord, while only this handler's formatter reads them
        self._direct = DirectLines(name=RECORD_NAME)
        #: characters of ``data=...`` kept in a message
        self.max_data_chars = MAX_DATA_CHARS
        self.set_stream(stream)
        self.set_logger(logger)
        self.set_levels(levels, failure=failure_level, default=default_level)
        self.set_format(fmt if fmt is not None else DEFAULT_FORMAT, datefmt=datefmt)
        if subscribe == "default-bus":
            self.attach()
            self._cancel_on_close = True
        elif subscribe != "none":
            raise ValueError(f"subscribe={subscribe!r}: use 'none' or 'default-bus'")

    # -- configuration --------------------------------------------------------------------
    def set_format(self, fmt: str, *, datefmt: str | None = None,
                   style: Literal["%", "{", "$"] = "%") -> None:
        """Use ``logging.Formatter(fmt, datefmt, style)`` for the lines this handler writes."""
        if not isinstance(fmt, str):
            raise TypeError(f"set_format(fmt): fmt is a logging format string such as "
                            f"'%(asctime)s %(levelname)s %(message)s', got {type(fmt).__name__}")
        try:
            formatter = logging.Formatter(fmt, datefmt, style)
        except ValueError as exc:
            raise ValueError(f"set_format(fmt={fmt!r}): {exc}") from None
        self.setFormatter(formatter)

    def set_stream(self, stream: IO[str] | None) -> None:
        """Write lines to ``stream`` (``None``: ``sys.stderr`` at the time of writing)."""
        if stream is not None and not callable(getattr(stream, "write", None)):
            raise TypeError(f"set_stream(stream): stream needs a write() method (a text file "
                            f"such as sys.stdout), got {type(stream).__name__}")
        with self.lock:  # type: ignore[union-attr]  # createLock() made it
            self._stream = stream

    @property
    def stream(self) -> IO[str]:
        """The stream lines go to now."""
        return self._stream if self._stream is not None else sys.stderr

    def set_logger(self, logger: logging.Logger | str | None) -> None:
        """Route event records through ``logger`` (or the logger of that name).

        Its level, filters, handlers, formatters and propagation then decide what happens to
        each record, exactly as for the logger's own records; this handler's stream is not
        written. ``None`` goes back to writing the stream.
        """
        if isinstance(logger, str):
            logger = logging.getLogger(logger)
        if logger is not None and not isinstance(logger, logging.Logger):
            raise TypeError(f"set_logger(logger): logger is a logging.Logger, its name or "
                            f"None, got {type(logger).__name__}")
        self._logger = logger

    @property
    def logger(self) -> logging.Logger | None:
        """The logger records go through, if :meth:`set_logger` set one."""
        return self._logger

    def set_levels(
        self,
        levels: LevelMap | LevelFunction | None = None,
        *,
        failure: int | str = logging.ERROR,
        default: int | str = logging.INFO,
    ) -> None:
        """How an event's log level is chosen.

        ``levels`` is ``None``; a mapping of event type (member, name or class) to level,
        which decides for every event of that type; or a function ``(event) -> level``,
        which decides for every event. Otherwise failures (``event.is_failure``: a non-zero
        exit code, a failed rendezvous, an agent that did not succeed, lost events) log at
        ``failure`` and the rest at ``default``.
        """
        by_type: dict[str, int] = {}
        level_fn: LevelFunction | None = None
        if callable(levels) and not isinstance(levels, Mapping):
            level_fn = levels
        elif isinstance(levels, Mapping):
            for key, value in levels.items():
                cls = event_class(key)
                by_type[str(cls.type)] = _level_value(value, f"levels[{key!r}]")
        elif levels is not None:
            raise TypeError("set_levels(levels): a mapping {event type: level}, a function "
                            f"(event) -> level, or None; got {type(levels).__name__}")
        self._failure_level = _level_value(failure, "failure")
        self._default_level = _level_value(default, "default")
        self._by_type, self._level_fn = by_type, level_fn

    def level_for(self, event: Event) -> int:
        """The level this handler logs ``event`` at."""
        if self._level_fn is not None:
            return _level_value(self._level_fn(event), "levels(event)")
        level = self._by_type.get(event.type)
        if level is not None:
            return level
        if event.type in QUIET_TYPES:
            return logging.DEBUG
        return self._failure_level if event.is_failure else self._default_level

    # -- subscription -----------------------------------------------------------------------
    def attach(self, bus: Bus | None = None) -> Subscription:
        """Subscribe to every event of ``bus`` (default: the default bus). Idempotent."""
        if self._subscription is None or not self._subscription.active:
            self._subscription = (bus or get_default_bus()).subscribe(
                ALL, on_event=self.on_event)
        return self._subscription

    def detach(self) -> None:
        """Stop receiving events from the bus :meth:`attach` subscribed to."""
        if self._subscription is not None:
            self._subscription.cancel()
            self._subscription = None

    @property
    def attached(self) -> bool:
        """True while subscribed to a bus."""
        return self._subscription is not None and self._subscription.active

    def close(self) -> None:
        """Close as ``logging`` does (``dictConfig`` closes every handler when it runs).

        The default handler stays subscribed (it is *the* handler of the default bus and
        survives reconfiguration); one built with ``subscribe="default-bus"`` unsubscribes.
        """
        if self._cancel_on_close:
            self.detach()
        super().close()

    # -- events in --------------------------------------------------------------------------
    def make_record(self, event: Event, level: int, name: str = RECORD_NAME) -> logging.LogRecord:
        """The ``LogRecord`` for ``event`` at ``level`` (formatting its message now)."""
        shape = _shape(type(event))
        values = shape.read(event)
        record = logging.getLogRecordFactory()(
            name, level, "eventbus", 0, _line(event, shape, values, self.max_data_chars),
            None, None)
        created = event.timestamp
        record.created = created
        record.msecs, record.relativeCreated = record_times(created)
        context = event.context
        cached = self._context_dict
        if cached.context is not context:  # contexts are immutable: one dict per context
            cached = _ContextDict(context, context.to_dict())
            self._context_dict = cached
        d = record.__dict__
        # two C-level updates instead of one Python-level store per attribute
        d.update(event=event, event_type=shape.type_name, event_timestamp=created,
                 event_data=event.data, event_context=cached.as_dict.copy())
        d.update(zip(shape.record_attrs, values, strict=True))
        return record

    def on_event(self, event: Event) -> None:
        """Log ``event`` (the bus calls this). Never raises."""
        inside = self._inside
        if getattr(inside, "active", False):
            # An event recorded by a handler, filter or formatter while this handler is
            # logging: logging it would loop. Other subscribers still get it.
            next(self._reentrant)
            return
        record: logging.LogRecord | None = None
        inside.active = True
        try:
            level = self.level_for(event)
            if level < self.level:
                return
            if (not self.level and event.type in QUIET_TYPES and self._level_fn is None
                    and event.type not in self._by_type):
                return  # a heartbeat, not asked for
            target = self._logger
            if target is None:
                if not self.filters and logging.getLogRecordFactory() is logging.LogRecord:
                    direct = self._direct.direct_for(self.formatter, self._direct_eligible)
                    if direct is not None:
                        shape = _shape(type(event))
                        text = self._direct.line(
                            direct, _line(event, shape, shape.read(event), self.max_data_chars),
                            level, event.timestamp)
                        if text is not None:
                            self._write_direct(text, event, level)
                            return
                record = self.make_record(event, level)
                self.handle(record)
            elif target.isEnabledFor(level):
                record = self.make_record(event, level, target.name)
                if self.filter(record):
                    target.handle(record)
        except Exception:
            self.handleError(record if record is not None else logging.LogRecord(
                RECORD_NAME, logging.ERROR, "eventbus", 0, "<event %s>", (event.type,), None))
        finally:
            inside.active = False

    # -- the direct path: one event line without a LogRecord (see _log_direct) ------------

    def _direct_eligible(self) -> bool:
        """Whether nothing but this handler's formatter reads its records: none of the
        methods that handle a record is replaced (on the class or the instance), and the
        handler has its lock."""
        cls = type(self)
        return (cls.emit is EventLoggingHandler.emit and cls.format is logging.Handler.format
                and cls.handle is logging.Handler.handle and self.lock is not None
                and not _RECORD_PATH_METHODS & self.__dict__.keys())

    def _write_direct(self, text: str, event: Event, level: int) -> None:
        """:meth:`emit`'s write, under the handler's lock as ``Handler.handle`` takes it."""
        line = escape_line(text) + "\n"
        try:
            with self.lock:  # type: ignore[union-attr]  # not None: _direct_eligible
                self._write_line(line)
        except Exception:
            # reported with the record the record path would have written
            try:
                record = self.make_record(event, level)
            except Exception:
                record = logging.LogRecord(RECORD_NAME, level, "eventbus", 0, text, None, None)
            self.handleError(record)

    # -- lines out --------------------------------------------------------------------------
    def emit(self, record: logging.LogRecord) -> None:
        """Write ``record`` as one escaped line to the stream."""
        try:
            self._write_line(escape_line(self.format(record)) + "\n")
        except Exception:
            self.handleError(record)

    def _write_line(self, line: str) -> None:
        """Write one finished line to the stream (stderr when none is set) and flush it."""
        stream = self._stream if self._stream is not None else sys.stderr
        stream.write(line)
        flush = getattr(stream, "flush", None)
        if flush is not None:
            flush()

    def handleError(self, record: logging.LogRecord) -> None:
        """Report as ``logging.Handler.handleError`` does; never raise (stderr may be the
        broken stream)."""
        next(self._errors)
        with contextlib.suppress(Exception):
            super().handleError(record)

    def stats(self) -> dict[str, int]:
        """Errors reported by :meth:`handleError`, and re-entrant events not logged."""
        return {"errors": int(repr(self._errors)[6:-1]),
                "reentrant_skipped": int(repr(self._reentrant)[6:-1])}

    def __repr__(self) -> str:
        target = f"logger {self._logger.name!r}" if self._logger is not None else \
            f"stream {getattr(self.stream, 'name', type(self.stream).__name__)!r}"
        return (f"<EventLoggingHandler {logging.getLevelName(self.level)} -> {target}"
                f"{' (attached)' if self.attached else ''}>")


_default: EventLoggingHandler | None = None
_lock = threading.Lock()


def get_default_handler(
    destination: str | None = None,
    *,
    stream: IO[str] | None = None,
    logger: logging.Logger | str | None = None,
    levels: LevelMap | LevelFunction | None = None,
) -> EventLoggingHandler:
    """The one default handler, subscribed to every event of the default bus on first call.

    ``destination`` is accepted for torch compatibility (``get_logging_handler("console")``)
    and changes nothing: there is one default handler. The keyword options, when given,
    configure it; so ``{"()": "eventbus.subscribers.log_handler.get_default_handler", "stream":
    "ext://sys.stdout"}`` in a ``dictConfig`` handlers section configures the default
    handler (``dictConfig`` then sets its level, formatter and filters).
    """
    global _default
    if destination is not None and not isinstance(destination, str):
        raise TypeError(f"destination is a string (torch's destination name) or None, got "
                        f"{type(destination).__name__}")
    with _lock:
        if _default is None:
            _default = EventLoggingHandler()
            _default.attach()
        handler = _default
    if stream is not None:
        handler.set_stream(stream)
    if logger is not None:
        handler.set_logger(logger)
    if levels is not None:
        handler.set_levels(levels)
    return handler
