"""Exit ledgers: what a store sender numbered and dropped, left in a local file at its exit.

The store may be dead when a sender ends, and then nothing it pushes tells the receiver
what it numbered. So a worker also leaves one small local file at exit,
``<dir>/<sender>.json`` (:class:`ExitLedger`, :func:`write_ledger`), in the per-attempt
directory its agent names in :data:`ENV_LEDGER_DIR`; the agent reads them
(:func:`read_ledgers`) before it exits and reports, for every sender whose end marker never
arrived, what it numbered but never delivered.

A SIGKILLed sender writes no ledger, and the events it had queued die with it. So each
sender also keeps a *record counter* in the same directory, ``<dir>/<sender>.count``
(:func:`open_counter`): a small file mapped shared into the sender, whose count its queue
adds to for every event it is given, before ``record()`` returns
(:meth:`eventbus.subscribers.queued.QueuedSink.count_into`). The kernel keeps what a
killed process wrote to a shared mapping, so the agent reads the count after the sender
died (:func:`read_counters`) and reports what it had recorded and never delivered.

A ledger speaks of the store wire format (:mod:`eventbus.wire`): its sender id and queue
key are the wire's, it carries the wire's version, and a file it refuses raises
:class:`~eventbus.wire.WireError` with the reason it is counted under.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import stat
import struct
from collections.abc import Iterator

import attrs

from eventbus.encoding import reject_constant
from eventbus.wire import _MAX_DROP_REASONS
from eventbus.wire import _MAX_SENDER_ID
from eventbus.wire import WIRE_VERSION
from eventbus.wire import WireError

__all__ = [
    "COUNTER_BYTES",
    "ENV_LEDGER_DIR",
    "MAX_LEDGER_BYTES",
    "ExitLedger",
    "RecordCount",
    "RecordCounter",
    "ledger_path",
    "open_counter",
    "read_counters",
    "read_ledgers",
    "write_ledger",
]

#: a local directory, one per attempt, where each worker leaves its :class:`ExitLedger`
ENV_LEDGER_DIR = "EVENTBUS_LEDGER_DIR"
#: an exit ledger file larger than this is refused unread (a real one is ~300 bytes)
MAX_LEDGER_BYTES = 16 * 1024
#: the longest queue key a ledger may name
_MAX_KEY = 1024
#: a count a ledger may carry stays below this (exact as a JSON number anywhere)
_MAX_COUNT = 2**53
_LEDGER_SUFFIX = ".json"


@attrs.frozen(kw_only=True)
class ExitLedger:
    """What one sender numbered and dropped, as it left it in a local file at its exit.

    The agent compares it with what reached it through the store: ``numbered`` less the
    receiver's next expected number is what was numbered but neither delivered nor
    reported yet; ``dropped`` (cumulative, per reason) less what the pushes carried is the
    drops not reported yet. Written once, at exit, so it costs ``record()`` nothing.
    """

    #: the sender id (:func:`eventbus.wire.new_sender_id`)
    sender: str
    #: the queue it pushed to
    key: str
    #: events it numbered (the next sequence number)
    numbered: int
    #: events it dropped before they got a number, per reason (cumulative)
    dropped: dict[str, int] = attrs.field(factory=dict)
    #: whether its end marker went out (a push that returned; the store may still lose it)
    end_pushed: bool = False
    #: the process that wrote it
    pid: int = 0

    def to_json(self) -> str:
        """The file's content: one JSON object."""
        return json.dumps({"v": WIRE_VERSION, "src": self.sender, "key": self.key,
                           "seq": self.numbered, "drop": self.dropped,
                           "end": self.end_pushed, "pid": self.pid})

    @classmethod
    def from_json(cls, raw: bytes) -> ExitLedger:
        """Parse and check one ledger file's bytes; :class:`WireError` names what is wrong."""
        if len(raw) > MAX_LEDGER_BYTES:
            raise WireError("ledger too large")
        try:
            data = json.loads(bytes(raw).decode("utf-8"), parse_constant=reject_constant)
        except (ValueError, TypeError, RecursionError):
            raise WireError("ledger not JSON") from None
        if type(data) is not dict or data.get("v") != WIRE_VERSION:
            raise WireError("ledger: bad header")
        sender, key, seq = data.get("src"), data.get("key"), data.get("seq")
        dropped, end, pid = data.get("drop", {}), data.get("end", False), data.get("pid", 0)
        if type(sender) is not str or not 0 < len(sender) <= _MAX_SENDER_ID:
            raise WireError("ledger: src")
        if type(key) is not str or not 0 < len(key) <= _MAX_KEY:
            raise WireError("ledger: key")
        if type(seq) is not int or not 0 <= seq < _MAX_COUNT:
            raise WireError("ledger: seq")
        if (type(dropped) is not dict or len(dropped) > _MAX_DROP_REASONS
                or not all(type(k) is str and len(k) <= 200 and type(v) is int
                           and 0 <= v < _MAX_COUNT for k, v in dropped.items())):
            raise WireError("ledger: drop")
        if type(end) is not bool or type(pid) is not int:
            raise WireError("ledger: end/pid")
        return cls(sender=sender, key=key, numbered=seq, dropped=dict(dropped),
                   end_pushed=end, pid=pid)


def ledger_path(directory: str, sender: str) -> str:
    """The file of ``sender``'s ledger in ``directory`` (the id made safe as a file name)."""
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in sender)[:_MAX_SENDER_ID]
    return os.path.join(directory, safe + _LEDGER_SUFFIX)


def write_ledger(directory: str, ledger: ExitLedger) -> str:
    """Write ``ledger`` atomically (a temporary file renamed over the final name), so that a
    reader never sees half of it; returns its path. Raises ``OSError``."""
    path = ledger_path(directory, ledger.sender)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as out:
        out.write(ledger.to_json())
    os.replace(tmp, path)
    return path


def _refuse(refused: dict[str, int], reason: str) -> None:
    refused[reason] = refused.get(reason, 0) + 1


def _small_files(directory: str, suffix: str, max_bytes: int, what: str,
                 refused: dict[str, int],
                 max_files: int) -> Iterator[tuple[os.DirEntry[str], bytes]]:
    """``(entry, first max_bytes + 1 bytes)`` of each regular file named ``*suffix`` in
    ``directory``, in name order; a link, a non-regular or an unreadable file is counted in
    ``refused`` under ``"<what>: ..."`` and skipped. Never raises."""
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)[:max_files]
    except OSError:
        return
    for entry in entries:
        if not entry.name.endswith(suffix):
            continue
        try:
            fd = os.open(entry.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
                         | getattr(os, "O_NONBLOCK", 0))
        except OSError:
            _refuse(refused, f"{what}: cannot open (a link, or unreadable)")
            continue
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                _refuse(refused, f"{what}: not a regular file")
                continue
            raw = os.read(fd, max_bytes + 1)
        except OSError:
            _refuse(refused, f"{what}: unreadable")
            continue
        finally:
            os.close(fd)
        yield entry, raw


def read_ledgers(directory: str, *,
                 max_files: int = 100_000) -> tuple[list[ExitLedger], dict[str, int]]:
    """Every ledger in ``directory``, and the files refused, counted per reason.

    Hostile content never raises: only regular files named ``*.json`` are opened (no
    symlinks followed), at most :data:`MAX_LEDGER_BYTES` of each is read, a file whose name
    is not its sender's is refused, and a leftover temporary file is ignored.
    """
    ledgers: list[ExitLedger] = []
    refused: dict[str, int] = {}
    for entry, raw in _small_files(directory, _LEDGER_SUFFIX, MAX_LEDGER_BYTES, "ledger",
                                   refused, max_files):
        try:
            ledger = ExitLedger.from_json(raw)
        except WireError as rej:
            _refuse(refused, rej.reason)
            continue
        if ledger_path(directory, ledger.sender) != entry.path:
            _refuse(refused, "ledger: file name is not its sender's")
            continue
        ledgers.append(ledger)
    return ledgers, refused


# -- record counters ---------------------------------------------------------------------

#: a record counter file: an 8-byte magic, the count (8 bytes, native order, aligned),
#: then one JSON object naming its sender (src, key, pid), NUL-padded to this size
COUNTER_BYTES = 1024
_COUNTER_MAGIC = b"EBCOUNT1"
_COUNTER_SUFFIX = ".count"


@attrs.frozen(kw_only=True)
class RecordCount:
    """What one sender's record counter said when it was read."""

    #: the sender id, the queue it pushed to, the process
    sender: str
    key: str
    pid: int
    #: events its queue was given (queued or dropped) before it stopped
    recorded: int


class RecordCounter:
    """A sender's record counter, mapped shared (:func:`open_counter`): ``view`` is the
    8 bytes of the count, to hand to
    :meth:`eventbus.subscribers.queued.QueuedSink.count_into`."""

    def __init__(self, path: str, mapping: mmap.mmap) -> None:
        self.path = path
        self._map = mapping
        self._last = 0
        #: the count's 8 bytes
        self.view = memoryview(mapping)[8:16]

    @property
    def value(self) -> int:
        """The count now (the last one, once closed)."""
        if self._map.closed:
            return self._last
        return int(struct.unpack_from("=Q", self._map, 8)[0])

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` unmapped it."""
        return self._map.closed

    def close(self) -> None:
        """Unmap the counter (the file stays, for the agent to read). Whatever counts into
        :attr:`view` must have stopped (``count_into(None)``) first; a view still held
        elsewhere keeps the mapping until it goes. Idempotent."""
        if self._map.closed:
            return
        self._last = int(struct.unpack_from("=Q", self._map, 8)[0])
        self.view.release()
        with contextlib.suppress(BufferError):  # a view someone still holds: unmapped
            self._map.close()                      # when it goes


def counter_path(directory: str, sender: str) -> str:
    """The file of ``sender``'s record counter in ``directory``."""
    return ledger_path(directory, sender)[: -len(_LEDGER_SUFFIX)] + _COUNTER_SUFFIX


def open_counter(directory: str, sender: str, key: str) -> RecordCounter:
    """Make ``sender``'s record counter (count 0) in ``directory`` and map it shared.

    Made whole under a temporary name and renamed: a reader never sees half a header.
    Raises ``OSError`` (and ``ValueError`` for a key too long to name).
    """
    header = json.dumps({"v": WIRE_VERSION, "src": sender, "key": key,
                         "pid": os.getpid()}).encode("utf-8")
    if 16 + len(header) > COUNTER_BYTES:
        raise ValueError(f"record counter: sender and key too long ({len(header)} bytes)")
    path = counter_path(directory, sender)
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        try:
            os.write(fd, _COUNTER_MAGIC + bytes(8) + header.ljust(COUNTER_BYTES - 16, b"\0"))
            mapping = mmap.mmap(fd, COUNTER_BYTES, mmap.MAP_SHARED,
                                mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        try:
            os.replace(tmp, path)
        except OSError:
            mapping.close()
            raise
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)  # no temporary file left behind by a full disk or a failed map
        raise
    return RecordCounter(path, mapping)


def _parse_counter(raw: bytes) -> RecordCount:
    if len(raw) != COUNTER_BYTES or raw[:8] != _COUNTER_MAGIC:
        raise WireError("counter: bad header")
    (recorded,) = struct.unpack_from("=Q", raw, 8)
    try:
        data = json.loads(raw[16:].rstrip(b"\0").decode("utf-8"),
                          parse_constant=reject_constant)
    except (ValueError, TypeError, RecursionError):
        raise WireError("counter: header not JSON") from None
    if type(data) is not dict or data.get("v") != WIRE_VERSION:
        raise WireError("counter: bad header")
    sender, key, pid = data.get("src"), data.get("key"), data.get("pid")
    if type(sender) is not str or not 0 < len(sender) <= _MAX_SENDER_ID:
        raise WireError("counter: src")
    if type(key) is not str or not 0 < len(key) <= _MAX_KEY:
        raise WireError("counter: key")
    if type(pid) is not int or not 0 <= recorded < _MAX_COUNT:
        raise WireError("counter: pid/count")
    return RecordCount(sender=sender, key=key, pid=pid, recorded=recorded)


def read_counters(directory: str, *,
                  max_files: int = 100_000) -> tuple[list[RecordCount], dict[str, int]]:
    """Every record counter in ``directory``, and the files refused, counted per reason.

    Read once their senders are gone. Hostile content never raises: as for
    :func:`read_ledgers`, only regular files are read, at most :data:`COUNTER_BYTES`, and
    a file whose name is not its sender's is refused.
    """
    counts: list[RecordCount] = []
    refused: dict[str, int] = {}
    for entry, raw in _small_files(directory, _COUNTER_SUFFIX, COUNTER_BYTES, "counter",
                                   refused, max_files):
        try:
            count = _parse_counter(raw)
        except WireError as rej:
            _refuse(refused, rej.reason)
            continue
        if counter_path(directory, count.sender) != entry.path:
            _refuse(refused, "counter: file name is not its sender's")
            continue
        counts.append(count)
    return counts, refused
