"""Events read back from JSONL files, as the offline readers need them.

A :class:`Record` is one event line decoded as plain JSON, not as a typed event: a file may
hold user-declared types that this process never declared, and the readers must still show
them. :func:`decode_line` and :func:`read_records` are tolerant: a torn or foreign line
becomes a :class:`Problem`, never an exception.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from typing import Literal

import attrs

from eventbus.app.sentences import as_int
from eventbus.app.sentences import as_number
from eventbus.app.sentences import stopped_by_agent
from eventbus.encoding import decode_json

__all__ = ["Problem", "Record", "decode_line", "read_records", "record_from_dict"]

_RESERVED = frozenset({"type", "timestamp", "data", "context"})
_LINE_PREFIX = '{"type":'


@attrs.frozen
class Record:
    """One event as read from a JSONL file: its type name, time, typed fields, data and
    context, plus where it was read."""

    type: str
    timestamp: float
    fields: dict[str, Any]
    data: dict[str, Any]
    context: dict[str, Any]
    source: str = ""
    line: int = 0
    # Read from the context once: the views ask for them for every record, many times.
    #: the global rank of the worker that recorded it (None for agent events)
    rank: int | None = attrs.field(init=False)
    #: the node (group rank) of the process that recorded it, when known
    group_rank: int | None = attrs.field(init=False)
    #: the host of the process that recorded it
    hostname: str = attrs.field(init=False)
    #: the pid of the process that recorded it
    pid: int | None = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        ctx = self.context
        host = ctx.get("hostname")
        object.__setattr__(self, "rank", as_int(ctx.get("rank")))
        object.__setattr__(self, "group_rank", as_int(ctx.get("group_rank")))
        object.__setattr__(self, "hostname", host if isinstance(host, str) else "")
        object.__setattr__(self, "pid", as_int(ctx.get("pid")))

    @property
    def is_failure(self) -> bool:
        """Same rule as the typed events: non-zero exit, failed rendezvous, failed agent,
        lost events."""
        if self.type == "WORKER_EXIT":
            return self.fields.get("exit_code") not in (0, None)
        if self.type == "RENDEZVOUS":
            return self.fields.get("state") == "FAILED"
        if self.type == "AGENT_EXIT":
            return self.fields.get("state") not in ("SUCCEEDED", None)
        return self.type == "EVENTS_LOST"

    @property
    def stopped_by_agent(self) -> bool:
        """A WORKER_EXIT of a worker its agent stopped (another rank failed or stalled, a
        STOP): not a failure of its own (:func:`eventbus.app.sentences.stopped_by_agent`
        reads ``data["stopped_by_agent"]`` and ``cause``)."""
        return stopped_by_agent(self)

    @property
    def is_own_failure(self) -> bool:
        """A failure, not counting workers stopped as collateral of another failure."""
        return self.is_failure and not self.stopped_by_agent

    def dedup_key(self) -> str:
        """Identical for the same event read from two files (job-wide and per-node)."""
        return json.dumps([self.type, self.timestamp, self.fields, self.data, self.context],
                          sort_keys=True, default=repr)

    def to_dict(self) -> dict[str, Any]:
        """The record back in the JSONL shape."""
        return {"type": self.type, "timestamp": self.timestamp, **self.fields,
                "data": self.data, "context": self.context}


@attrs.frozen
class Problem:
    """Lines that are not events: ``torn`` (cut short by a writer that crashed: unfinished
    at the end of the file, or ended by the next writer) or ``foreign`` (anything else).

    One line (``line`` > 0, with its ``text``) or, from a whole-file read, a count
    (``line`` 0).
    """

    source: str
    line: int
    kind: Literal["torn", "foreign"]
    reason: str
    text: str = ""
    count: int = 1

    def describe(self) -> str:
        """``events.jsonl:12: foreign line (not JSON: ...): '<start of the line>'``, or
        ``events.jsonl: 2 torn line(s) skipped (...)`` for a count."""
        if self.line <= 0:
            return f"{self.source}: {self.count} {self.kind} line(s) skipped ({self.reason})"
        where = f"{self.source}:{self.line}" if self.source else f"line {self.line}"
        snippet = self.text if len(self.text) <= 100 else self.text[:97] + "..."
        return f"{where}: {self.kind} line ({self.reason}): {snippet!r}"


def _duration(r: Record) -> float | None:
    """A rendezvous' ``duration_s``, when it is a usable one."""
    duration = as_number(r.fields.get("duration_s"))
    return duration if duration is not None and duration >= 0 else None


def decode_line(text: str, *, source: str = "", line: int = 0,
                complete: bool = True) -> Record | Problem:
    """One JSONL line as a :class:`Record`, or the :class:`Problem` with it.

    ``complete=False`` says the line had no newline at the end of the file: if it does not
    decode it is reported as ``torn`` rather than ``foreign``.
    """
    stripped = text.strip()

    def problem(reason: str, kind: Literal["torn", "foreign"] = "foreign") -> Problem:
        return Problem(source, line, kind, reason, stripped)

    try:
        raw = decode_json(stripped)
    except (ValueError, TypeError) as exc:
        why = str(exc).splitlines()[0][:80]
        if not complete:
            return problem(f"no newline at the end of the file, not JSON: {why}", "torn")
        if stripped.startswith(_LINE_PREFIX):
            # Starts like a recorder's line but does not parse: a writer crashed mid-line
            # and the next one ended it (the rule eventbus.subscribers.jsonl.read_jsonl counts by).
            return problem(f"an event line cut short: {why}", "torn")
        return problem(f"not JSON: {why}")
    if not isinstance(raw, dict):
        return problem(f"a JSON {type(raw).__name__}, not an event object")
    return _from_object(raw, source=source, line=line, text=stripped)


def _from_object(raw: dict[str, Any], *, source: str, line: int,
                 text: str = "") -> Record | Problem:
    def problem(reason: str) -> Problem:
        return Problem(source, line, "foreign", reason, text)

    name = raw.get("type")
    if not isinstance(name, str) or not name:
        return problem("no string 'type'")
    timestamp = as_number(raw.get("timestamp"))
    if timestamp is None:
        return problem("no finite numeric 'timestamp'")
    data = raw.get("data")
    context = raw.get("context")
    if data is not None and not isinstance(data, dict):
        return problem("'data' is not an object")
    if context is not None and not isinstance(context, dict):
        return problem("'context' is not an object")
    fields = {k: v for k, v in raw.items() if k not in _RESERVED}
    return Record(name, timestamp, fields, data or {}, context or {}, source, line)


def record_from_dict(raw: dict[str, Any], *, source: str = "") -> Record | None:
    """A decoded JSONL object as a :class:`Record`, or None when it is not an event."""
    item = _from_object(raw, source=source, line=0)
    return item if isinstance(item, Record) else None


def read_records(path: str | Path) -> tuple[list[Record], list[Problem]]:
    """Every event of one JSONL file (read by :func:`eventbus.subscribers.jsonl.read_jsonl`), and
    how many lines were skipped: torn or foreign (``eventbus tail`` shows each one)."""
    from eventbus.subscribers.jsonl import read_jsonl

    source = str(path)
    read = read_jsonl(path)
    records: list[Record] = []
    not_events = 0
    for raw in read:
        record = record_from_dict(raw, source=source)
        if record is None:
            not_events += 1
        else:
            records.append(record)
    problems = []
    if read.torn:
        problems.append(Problem(source, 0, "torn", "cut short by a writer that crashed",
                                count=read.torn))
    if read.foreign + not_events:
        problems.append(Problem(source, 0, "foreign", "not events",
                                count=read.foreign + not_events))
    return records, problems
