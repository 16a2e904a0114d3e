"""The exceptions eventbus raises.

Each one also subclasses the builtin that fits (``TypeError`` for a wrongly typed or
unknown field, ``ValueError`` for an unknown type or undecodable input), so callers that
catch the builtins keep working.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = [
    "TYPE_CUTOFF",
    "EventBusError",
    "EventDecodeError",
    "FieldTypeError",
    "FieldValueError",
    "MissingFieldError",
    "UnknownEventTypeError",
    "UnknownFieldError",
    "did_you_mean",
]


#: how close an event type name must be to a misspelt one to be suggested: the names share
#: long prefixes (``WORKER_``), so the default 0.6 would offer WORKER_SLOW for WORKER_EXPLODED
TYPE_CUTOFF = 0.8


def did_you_mean(word: str, choices: Iterable[str], *, cutoff: float = 0.6) -> str:
    """`` (did you mean 'x'?)`` for the choice closest to a misspelt ``word`` (difflib's
    ratio of at least ``cutoff``), else ``""``: the one suggestion rule of every "unknown
    name" message (fields, event types, sinks, reactor attributes)."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=cutoff)
    return f" (did you mean {close[0]!r}?)" if close else ""


class EventBusError(Exception):
    """Base class of every error eventbus raises on purpose."""


class UnknownEventTypeError(EventBusError, ValueError):
    """An event type name that no built-in or declared event type has."""

    def __init__(self, event_type: object, known: list[str]) -> None:
        self.event_type = event_type
        hint = (did_you_mean(event_type.upper(), known, cutoff=TYPE_CUTOFF)
                if isinstance(event_type, str) else "")
        super().__init__(
            f"unknown event type {event_type!r}{hint}: use an EventType member, the name of "
            f"one ({', '.join(known)}), or declare it first with "
            f"@eventbus.event_type({event_type!r})"
        )


class _FieldError(EventBusError):
    """An error about one field of one event type; both are attributes."""

    def __init__(self, event_type: str, field: str, message: str) -> None:
        self.event_type = event_type
        self.field = field
        super().__init__(message)


class UnknownFieldError(_FieldError, TypeError):
    """A field that the event type does not declare."""

    def __init__(self, event_type: str, field: str, allowed: list[str]) -> None:
        hint = did_you_mean(field, allowed)
        super().__init__(
            event_type, field,
            f"{event_type} has no field {field!r}{hint}; its fields are {', '.join(allowed)}. "
            f"Put free-form values in data={{...}}")


class MissingFieldError(_FieldError, TypeError):
    """A required field that was not given."""

    def __init__(self, event_type: str, field: str, expected: str) -> None:
        super().__init__(event_type, field,
                         f"{event_type} needs field {field!r} ({expected}); pass {field}=...")


class FieldTypeError(_FieldError, TypeError):
    """A field whose value has the wrong type."""

    def __init__(self, event_type: str, field: str, expected: str, value: object) -> None:
        self.value = value
        super().__init__(
            event_type, field,
            f"{event_type}.{field} must be {expected}, got {type(value).__name__} "
            f"{_short_repr(value)}")


class FieldValueError(_FieldError, ValueError):
    """A field whose value has the right type but an unusable value."""

    def __init__(self, event_type: str, field: str, problem: str) -> None:
        super().__init__(event_type, field, f"{event_type}.{field}: {problem}")


class EventDecodeError(EventBusError, ValueError):
    """Text or a mapping that does not decode to a valid event."""


def _short_repr(value: object, limit: int = 80) -> str:
    try:
        text = repr(value)
    except Exception:
        return f"<{type(value).__name__} with a failing __repr__>"
    return text if len(text) <= limit else text[: limit - 3] + "..."
