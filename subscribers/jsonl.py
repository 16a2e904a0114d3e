"""The JSON Lines recorder, and a reader that survives what a crash leaves behind.

Writing: :class:`JsonlRecorder` is a bus subscriber (``bus.subscribe(eventbus.ALL,
on_event=recorder)``) that appends one ``event.to_json()`` line per event. ``record()`` only
enqueues (a bounded :class:`~eventbus.subscribers.queued.QueuedSink` whose drops are counted
per reason); a background thread writes each batch with one ``write()`` on an ``O_APPEND``
descriptor, so complete lines are never interleaved with another writer's and a crash can
tear at most the line being written.

Crash safety: after ``kill -9`` the file may end in a torn line (no ``\\n``). The next
writer that opens the file first ends that line, so its own lines start fresh; readers
skip and count the torn line (:func:`read_jsonl`).

Reading: :func:`read_jsonl` yields each complete line's dict (or typed event) and counts
what it skipped: ``torn`` (a line cut short by a crash) and ``foreign`` (a complete line
that is not an event).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from typing import Literal

from eventbus._reporting import RateLimiter
from eventbus.encoding import decode_json
from eventbus.events import Event
from eventbus.subscribers.queued import QueuedSink
from eventbus.subscribers.queued import QueueSettings

__all__ = ["JSONL_QUEUE", "JsonlRead", "JsonlRecorder", "read_jsonl"]

Fsync = Literal["never", "batch", "close"]

_LINE_PREFIX = b'{"type":'

logger = logging.getLogger("eventbus")

#: the recorder's default queue: the file is the job's record, so a flood from the workers
#: waits in the store (the agent's receiver holds off, see eventbus.subscribers.queued.backlogged)
#: instead of being dropped here while the writer is still writing
JSONL_QUEUE = QueueSettings(flow_control=True)


class JsonlRecorder:
    """Append every event it is given to ``path`` as one JSON line, off the caller's thread.

    Options (keyword-only): ``fsync``: ``"never"`` (the OS writes back), ``"batch"`` (after
    every batch: survives a machine crash, costs a disk flush per batch) or ``"close"``;
    ``settings``: the queue's :class:`~eventbus.subscribers.queued.QueueSettings` (bounds, which
    event a full queue drops, the writer's idle wait, the default budget of :meth:`close`;
    default :data:`JSONL_QUEUE`, with flow control on), and any of its fields as keyword
    options to override them (``max_events=1000``).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        fsync: Fsync = "never",
        settings: QueueSettings | None = None,
        **options: Any,
    ) -> None:
        if fsync not in ("never", "batch", "close"):
            raise ValueError(f"fsync must be 'never', 'batch' or 'close', got {fsync!r}")
        queue = (settings or JSONL_QUEUE).with_options(options)  # bad options: no file
        self.path = Path(path)
        self.fsync: Fsync = fsync
        self._fd: int | None = None
        self._fd_pid = 0
        self._fd_lock = threading.Lock()
        self.lines_written = 0
        self.encode_errors = 0
        #: lines lost because the write failed (disk full, file system read-only, EIO)
        self.lines_lost = 0
        #: the last write error, or None once writing works again
        self.write_error: str | None = None
        # A failed write may have left part of a line: the next write ends it first.
        self._torn_tail = False
        self._write_reports = RateLimiter()
        # Open (and end a torn last line) now, so a bad path fails here, not in the thread.
        self._open()
        self._sink = QueuedSink(self._write_batch, name=f"jsonl:{self.path}",
                                settings=queue)

    # -- subscriber side --------------------------------------------------------------------
    def __call__(self, event: Event) -> None:
        """Enqueue ``event`` (never blocks on the disk)."""
        self._sink(event)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every event enqueued so far is written; False if ``timeout`` ran out."""
        return self._sink.flush(timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Write what is queued within ``timeout``, then close the file. Events still queued
        at the deadline, or arriving later, are counted as dropped. True if all were written."""
        done = self._sink.close(timeout)
        with self._fd_lock:
            if self._fd is not None and self._fd_pid == os.getpid():
                if self.fsync in ("batch", "close"):
                    with contextlib.suppress(OSError):
                        os.fsync(self._fd)
                os.close(self._fd)
            self._fd = None
        return done

    def stats(self) -> dict[str, Any]:
        """The queue's counts (enqueued, handled, failed, pending, dropped per reason), the
        lines written by this process, ``lines_lost`` to failed writes (a full or read-only
        disk) and ``write_error`` (the last one, None once writing works again)."""
        out = self._sink.stats()
        out["lines_written"] = self.lines_written
        out["encode_errors"] = self.encode_errors
        out["lines_lost"] = self.lines_lost
        out["write_error"] = self.write_error
        return out

    # -- writer side ------------------------------------------------------------------------
    def _open(self) -> int:
        with self._fd_lock:
            if self._fd is not None and self._fd_pid == os.getpid():
                return self._fd
            # A forked child writes through its own descriptor (same file, O_APPEND).
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC,
                         0o644)
            try:
                size = os.fstat(fd).st_size
                if size:
                    with open(self.path, "rb") as f:
                        f.seek(size - 1)
                        if f.read(1) != b"\n":
                            _write_all(fd, b"\n")  # end the torn line of a crashed writer
            except BaseException:
                os.close(fd)
                raise
            self._fd, self._fd_pid = fd, os.getpid()
            return fd

    def _write_batch(self, events: Sequence[Event]) -> None:
        lines = []
        for event in events:
            try:
                lines.append(event.to_json())
            except Exception:  # to_json sanitises; this is a last resort, counted
                self.encode_errors += 1
        if not lines:
            return
        data = ("\n".join(lines) + "\n").encode("utf-8")
        prefix = b"\n" if self._torn_tail else b""  # end what a failed write left
        data = prefix + data
        written = 0
        try:
            fd = self._open()
            written = _write_all(fd, data)
            if self.fsync == "batch":
                os.fsync(fd)
        except OSError as exc:
            # A full or read-only disk must not end the job nor spam its log: the lines
            # that did not land are counted lost, reported at most once per
            # report_interval, and the next batch tries again (writing resumes when space
            # returns). The complete lines that landed before the error count as written.
            written = getattr(exc, "eventbus_written", written)
            landed = data[:written].count(b"\n") - (1 if prefix and written else 0)
            self.lines_written += landed
            self._torn_tail = (written > 0 and not data[:written].endswith(b"\n")) or \
                (written == 0 and self._torn_tail)
            self._write_failed(exc, len(lines) - landed)
            return
        self._torn_tail = False
        if self.write_error is not None:
            logger.warning("jsonl %s: writing again after %s; %d lines were lost",
                           self.path, self.write_error, self.lines_lost)
            self.write_error = None
        self.lines_written += len(lines)

    def _write_failed(self, exc: OSError, n: int) -> None:
        self.lines_lost += n
        first = self.write_error is None
        self.write_error = f"{type(exc).__name__}: {exc.strerror or exc}"
        held = self._write_reports.allow(self._sink.settings.report_interval, n,
                                         force=first)
        if held is None:
            return
        logger.warning("jsonl %s: write failed (%s); %d lines lost (%d in all); writing "
                       "resumes when the file can be written again", self.path,
                       self.write_error, held + n, self.lines_lost)

    def __repr__(self) -> str:
        return f"<JsonlRecorder {str(self.path)!r} written={self.lines_written}>"


def _write_all(fd: int, data: bytes) -> int:
    """Write all of ``data``; an ``OSError`` raised part-way carries ``eventbus_written``,
    the bytes that reached the file before it."""
    view = memoryview(data)
    done = 0
    while view:
        try:
            written = os.write(fd, view)
        except OSError as exc:
            exc.eventbus_written = done  # type: ignore[attr-defined]
            raise
        done += written
        view = view[written:]
    return done


class JsonlRead:
    """What :func:`read_jsonl` returns: iterate it for records; after (or during) the
    iteration, ``lines``, ``records``, ``torn`` and ``foreign`` count what was seen."""

    def __init__(self, path: str | os.PathLike[str], decode: Literal["dict", "event"]) -> None:
        if decode not in ("dict", "event"):
            raise ValueError(f"decode must be 'dict' or 'event', got {decode!r}")
        self.path = Path(path)
        self.decode = decode
        #: lines seen (complete or not)
        self.lines = 0
        #: records yielded
        self.records = 0
        #: lines cut short by a crashed writer (skipped)
        self.torn = 0
        #: complete lines that are not events of this project (skipped)
        self.foreign = 0

    def __iter__(self) -> Iterator[Any]:
        with open(self.path, "rb") as f:
            for raw in f:
                self.lines += 1
                complete = raw.endswith(b"\n")
                text = raw.rstrip(b"\r\n")
                if not text.strip():
                    self.lines -= 1
                    continue
                try:
                    value = decode_json(text)
                except (ValueError, TypeError):
                    # A line that does not parse and starts like ours (or is last and
                    # unterminated) was cut short by a crash or a full disk; a cut as
                    # short as b"{" is a start of ours too (the next write ends it).
                    if not complete or text.startswith(_LINE_PREFIX) or \
                            _LINE_PREFIX.startswith(text):
                        self.torn += 1
                    else:
                        self.foreign += 1
                    continue
                try:
                    value = self._as_record(value)
                except (ValueError, TypeError):
                    self.foreign += 1
                    continue
                self.records += 1
                yield value

    def _as_record(self, value: Any) -> Any:
        if not isinstance(value, dict) or not isinstance(value.get("type"), str):
            raise ValueError("not an event object")
        if self.decode == "event":
            return Event.from_dict(value)
        return value

    @property
    def skipped(self) -> int:
        """torn + foreign."""
        return self.torn + self.foreign

    def __repr__(self) -> str:
        return (f"<JsonlRead {str(self.path)!r} records={self.records} torn={self.torn} "
                f"foreign={self.foreign}>")


def read_jsonl(path: str | os.PathLike[str], *,
               decode: Literal["dict", "event"] = "dict") -> JsonlRead:
    """Read an events JSONL file, tolerating what crashes and strangers leave.

    Iterate the result for each record: the event's dict (``decode="dict"``, NaN and
    infinities restored) or the typed, validated event (``decode="event"``). Torn lines
    (cut by ``kill -9``) and foreign lines (not events) are skipped and counted on the
    result (``torn``, ``foreign``)::

        read = read_jsonl("events.jsonl")
        exits = [r for r in read if r["type"] == "WORKER_EXIT"]
        print(read.torn, read.foreign)
    """
    return JsonlRead(path, decode)
