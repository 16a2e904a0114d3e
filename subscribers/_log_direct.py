"""The log handler's direct path: an event's log line without a ``LogRecord``.

Private machinery of :class:`eventbus.subscribers.log_handler.EventLoggingHandler`. When the
only reader of a record would be the handler's own formatter (no logger, no filter, the
stock ``LogRecord`` factory, a plain ``logging.Formatter`` with a %-style format, the
handler's own ``emit``/``format``/``handle``), the record is not needed: the line is the
format applied to the attributes it names, the values the record would hold. That halves
the handler's cost per line (``benchmarks/bench_logging.py``: about 0.95x a plain
``StreamHandler`` line on this path, about 1.5x with a record built for every event).

The contract, pinned byte for byte by ``tests/test_log_handler_direct.py``: for a
:class:`DirectFormat` that :func:`make_plan` gave for ``formatter``,
``DirectLines.line(direct, message, level, created)`` is either exactly
``formatter.format(record)``, where ``record`` is what ``EventLoggingHandler.make_record``
builds for that message, level and timestamp, or None (then the caller builds the record).
A format naming an attribute this path does not make (thread, process, task, the event's
own attributes) gives None once and sends that formatter to the record path for good.

What this reads of ``logging``'s private parts: ``Formatter._style``, and the style's
``_fmt`` and ``_defaults``. A plan is remade whenever the formatter, its style or the
style's format string is not the one it was made for (:meth:`Plan.fits`), so every change
to the formatter applies from the next event.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import attrs

__all__ = ["NO_PLAN", "START_S", "DirectFormat", "DirectLines", "Plan", "make_plan",
           "record_times"]

#: the attributes of every record the handler makes that depend neither on the event nor on
#: the thread, process or task: taken from a real record, so they are what LogRecord sets
_CONSTANT_ATTRS = {
    key: value for key, value in logging.LogRecord(
        "eventbus.events", logging.INFO, "eventbus", 0, "", None, None).__dict__.items()
    if key in ("args", "pathname", "filename", "module", "exc_info", "exc_text", "stack_info",
               "lineno", "funcName")}
#: when logging was imported, in seconds (``relativeCreated`` counts from it): Python 3.13
#: keeps ``logging._startTime`` in nanoseconds, earlier versions in seconds
START_S: float = (logging._startTime / 1e9  # type: ignore[attr-defined]
                  if isinstance(logging._startTime, int)  # type: ignore[attr-defined]
                  else logging._startTime)  # type: ignore[attr-defined]
#: converters that are a pure function of the whole second (``time.localtime`` rounds
#: down): their ``asctime`` can be kept for the rest of that second
_SECOND_CONVERTERS = (time.localtime, time.gmtime)


def record_times(created: float) -> tuple[float, float]:
    """``(msecs, relativeCreated)`` of a record created at ``created``, as ``LogRecord``
    computes them: the one rule both paths read."""
    return int((created - int(created)) * 1000) + 0.0, (created - START_S) * 1000


@attrs.frozen
class DirectFormat:
    """What the direct path needs of a formatter it can stand in for."""

    #: the formatter itself (its date format and converter are read at each line)
    formatter: logging.Formatter
    #: its %-style format string
    fmt: str
    #: whether the format shows ``asctime``
    uses_time: bool


@attrs.frozen
class Plan:
    """How lines are written for one formatter: directly (``direct``) or through records
    (``direct`` is None), with what the plan was made for, to tell when it is stale."""

    #: the handler's formatter when the plan was made (None included)
    formatter: object
    #: that formatter's style object then
    style: object
    #: that style's format string then
    fmt: object
    #: how to write a line without a record, or None: build records
    direct: DirectFormat | None

    def fits(self, formatter: object) -> bool:
        """Whether this plan still holds for ``formatter`` (the handler's formatter now)."""
        if self.formatter is not formatter:
            return False
        if self.direct is None:
            return True  # records are always right
        style = self.style
        return style is getattr(formatter, "_style", None) and \
            self.fmt is getattr(style, "_fmt", None)


#: the plan of a handler that has written nothing yet: it fits no formatter
NO_PLAN = Plan(object(), object(), object(), None)


def make_plan(formatter: object, *, eligible: bool) -> Plan:
    """The plan for ``formatter``; ``eligible``: whether the handler's own setup (nothing
    but its formatter reads its records) allows the direct path at all."""
    style = getattr(formatter, "_style", None)
    fmt = getattr(style, "_fmt", None)
    direct: DirectFormat | None = None
    if (eligible and type(formatter) is logging.Formatter
            and type(style) is logging.PercentStyle and isinstance(fmt, str)
            and not getattr(style, "_defaults", None)):
        direct = DirectFormat(formatter, fmt, style.usesTime())
    return Plan(formatter, style, fmt, direct)


@attrs.frozen
class _Asctime:
    """The ``asctime`` text of the last whole second formatted, and what it depends on."""

    second: float
    converter: object
    timefmt: str
    #: ``time.tzname`` then (``time.tzset()`` replaces it)
    tzname: object
    text: str


_NO_ASCTIME = _Asctime(-1.0, None, "", None, "")


class DirectLines:
    """One handler's direct path: its current :class:`Plan` and its ``asctime`` cache.

    Each is replaced whole, never changed in place: threads logging at once need no lock.
    """

    def __init__(self, *, name: str) -> None:
        #: the logger name of the handler's records (``%(name)s``)
        self.name = name
        self.plan = NO_PLAN
        self._asctime = _NO_ASCTIME

    def direct_for(self, formatter: object,
                   eligible: Callable[[], bool]) -> DirectFormat | None:
        """How to write the next line for ``formatter`` without a record, or None. The plan
        is remade, asking ``eligible()`` (see :func:`make_plan`), when it no longer fits."""
        plan = self.plan
        if not plan.fits(formatter):
            plan = self.plan = make_plan(formatter, eligible=eligible())
        return plan.direct

    def line(self, direct: DirectFormat, message: str, level: int,
             created: float) -> str | None:
        """``direct.formatter.format(record)`` for the handler's record of ``message`` at
        ``level`` created at ``created`` (not yet escaped), or None: build the record."""
        try:
            msecs, relative = record_times(created)
            values: dict[str, Any] = {
                **_CONSTANT_ATTRS, "name": self.name, "msg": message, "message": message,
                "levelname": logging.getLevelName(level), "levelno": level, "created": created,
                "msecs": msecs, "relativeCreated": relative,
            }
            if direct.uses_time:
                values["asctime"] = self._format_time(direct.formatter, created, msecs)
            return direct.fmt % values
        except KeyError:
            # the format names an attribute only a full record has: records from now on
            self.plan = attrs.evolve(self.plan, direct=None)
            return None
        except Exception:
            return None

    def _format_time(self, formatter: logging.Formatter, created: float, msecs: float) -> str:
        """``logging.Formatter.formatTime``; the strftime text is kept for the rest of its
        second when the converter is ``time.localtime`` or ``time.gmtime``."""
        converter = formatter.converter
        datefmt = formatter.datefmt
        timefmt = datefmt or formatter.default_time_format
        if converter in _SECOND_CONVERTERS:
            second = created // 1
            tzname = time.tzname  # time.tzset() replaces it
            kept = self._asctime
            if kept.second == second and kept.converter is converter and \
                    kept.timefmt == timefmt and kept.tzname is tzname:
                text = kept.text
            else:
                text = time.strftime(timefmt, converter(created))
                self._asctime = _Asctime(second, converter, timefmt, tzname, text)
        else:
            text = time.strftime(timefmt, converter(created))
        if not datefmt and formatter.default_msec_format:
            text = formatter.default_msec_format % (text, msecs)
        return text
