"""A record read back from a JSONL file, seen as the live event it was: what lets the job
view fold a file's records and a bus's events with the same handlers.

:class:`RecordEvent` gives a :class:`~eventbus.app.readers.records.Record` the attributes
the handlers read of an event; :func:`as_str` is their reading of a field that should be a
string.
"""

from __future__ import annotations

from typing import Any

from eventbus.app.readers.records import Record
from eventbus.app.sentences import as_int

__all__ = ["RecordEvent", "as_str"]


def as_str(value: object) -> str | None:
    """``value`` if it is a string, else None (a field of a foreign or older record)."""
    return value if isinstance(value, str) else None


class RecordEvent:
    """A :class:`~eventbus.app.readers.records.Record` seen through an event's attributes:
    its typed fields as attributes (missing ones read None), ``data``, ``timestamp`` and
    the context's ``rank``, ``restart_count``, ``group_rank``, ``hostname`` and ``pid``."""

    # private, so that no field of an event shadows it: the job view's modules read it
    # (the heartbeat's handler takes its fields straight from it)
    __slots__ = ("_record",)

    def __init__(self, record: Record) -> None:
        self._record = record

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self._record.fields.get(name)

    @property
    def type(self) -> str:
        return self._record.type

    @property
    def timestamp(self) -> float:
        return self._record.timestamp

    @property
    def data(self) -> dict[str, Any]:
        return self._record.data

    @property
    def rank(self) -> int | None:
        return self._record.rank

    @property
    def group_rank(self) -> int | None:
        return self._record.group_rank

    @property
    def restart_count(self) -> int | None:
        return as_int(self._record.context.get("restart_count"))

    @property
    def run_id(self) -> str | None:
        return as_str(self._record.context.get("run_id"))

    @property
    def world_size(self) -> int | None:
        return as_int(self._record.context.get("world_size"))

    @property
    def hostname(self) -> str:
        return self._record.hostname

    @property
    def pid(self) -> int | None:
        return self._record.pid

    def fields(self) -> dict[str, Any]:
        return dict(self._record.fields)

    def to_dict(self) -> dict[str, Any]:
        return self._record.to_dict()
