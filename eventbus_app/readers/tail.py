"""``eventbus tail [-f] EVENTS.jsonl``: one readable line per event, following a growing
file.

::

    10:00:03.600  node-a  agent    WORKER_EXIT       worker_id=1 exit_code=3 message='...'
    10:00:05.500  node-a  rank 0   DATA_SHARD_LOADED shard=3 | rows=4096

Colours on a terminal (``--color`` to force or refuse; ``NO_COLOR`` is honoured): failures
red, restarts bold yellow, workers the agent stopped after another's failure yellow,
rendezvous magenta, starts green, epochs cyan, checkpoints blue; a drain (``PREEMPTING``,
the ``AGENT_EXIT`` of a preempted job: neither a failure nor a success) bold cyan, the
workers that did not stop within its grace yellow.
Filters: ``--type`` and ``--rank`` (repeatable or comma-separated; ``--rank agent`` for the
agent's own events; an agent's ``WORKER_START``/``WORKER_EXIT`` about a worker counts as
that worker's). ``--type -TORCHELASTIC`` (or ``!TORCHELASTIC``, or ``--exclude
TORCHELASTIC``) leaves a type out; a type that is neither built in nor in the file is a
usage error naming the valid ones. The workers' progress heartbeats (``WORKER_PROGRESS``,
one a second per rank) are shown only when ``--type`` asks for them.

Long things stay short unless ``--full``: a stall's stack shows as the top frame of the
worker's main thread, torch's own ``TORCHELASTIC`` records as their name and state, other
data cut after :data:`DATA_CHARS` characters. With ``--full`` everything is shown, and a
stack (or any text of several lines, a traceback) prints on several indented lines under
its event's line: the main thread first, eventbus's own threads last and marked.

Lines that are not events (torn writes, output of something else) are reported on stderr
with their line number and skipped. With ``-f`` an unfinished last line is held until its
newline arrives; a truncated file is read again from its start, a replaced one (same path,
new file) is reopened.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import json
import math
import os
import sys
import time
from collections.abc import Iterator
from collections.abc import Sequence
from pathlib import Path
from typing import IO
from typing import Any
from typing import Literal

from eventbus.app.health.stacks import EVENTBUS_MARK
from eventbus.app.health.stacks import format_stack
from eventbus.app.health.stacks import parse_stack
from eventbus.app.health.stacks import stack_lines
from eventbus.app.health.stacks import where_of
from eventbus.app.readers.records import Problem
from eventbus.app.readers.records import Record
from eventbus.app.readers.records import decode_line
from eventbus.app.sentences import job_outcome
from eventbus.errors import TYPE_CUTOFF
from eventbus.errors import did_you_mean
from eventbus.events import EventType

__all__ = ["DATA_CHARS", "HIDDEN_TYPES", "EventFileReader", "TypeFilter", "format_record",
           "main", "parse_types"]

_RESET = "\033[0m"
_DIM = "\033[2m"
_BOLD = "\033[1m"
_COLOURS = {
    "failure": "\033[1;31m",
    "stopped": "\033[33m",
    "WORKER_RESTART": "\033[1;33m",
    "RENDEZVOUS": "\033[35m",
    "WORKER_START": "\033[32m",
    "AGENT_START": "\033[32m",
    "AGENT_EXIT": "\033[32m",
    "WORKER_EXIT": "\033[32m",
    "EPOCH_START": "\033[36m",
    "EPOCH_END": "\033[36m",
    "CHECKPOINT_SAVED": "\033[34m",
    "METRIC": "",
    "preempted": "\033[1;36m",
    "PREEMPTING": "\033[1;36m",
}
_ESCAPES = {i: f"\\x{i:02x}" for i in range(32)}
_ESCAPES.update({ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t", 0x7F: "\\x7f",
                 0x85: "\\x85", 0x2028: "\\u2028", 0x2029: "\\u2029", 0x1B: "\\x1b"})


def _one_line(text: str) -> str:
    return text.translate(_ESCAPES)


def _value(value: Any) -> str:
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, float):
        return f"{value:.6g}" if math.isfinite(value) else str(value)
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"), default=repr, allow_nan=True)
    return str(value)


#: characters of ``data`` shown per line unless ``--full`` (torch's own records carry a lot)
DATA_CHARS = 240

#: types shown only when ``--type`` names them: the workers' heartbeats, one a second per rank
HIDDEN_TYPES = frozenset({str(EventType.WORKER_PROGRESS)})

#: the keys of a torch record's ``data`` its short line keeps (the rest: ``--full``)
_TORCH_KEYS = ("state", "node_state", "global_rank", "group_rank", "rank", "bridged_as",
               "message", "raw_error")
#: a torch record's texts (a rendezvous message, an error) are cut after this many chars
_TORCH_TEXT_CHARS = 60

#: the keys an event with a stack shows first (its line is cut after DATA_CHARS)
_FIRST_KEYS = ("stack", "diagnosis", "culprit_ranks", "waiting_ranks")

#: the indent of the lines printed under an event's line (``--full``)
_INDENT = "    "


def _top_frame(text: str) -> str | None:
    """``file.py:LINE in func`` of the innermost frame of the first thread
    :func:`~eventbus.app.health.stacks.format_stack` puts first (the main thread), and
    how many threads there are; None when ``text`` is no faulthandler dump."""
    threads = format_stack(text)
    if not threads:
        return None
    head = threads[0]
    frame = head.frames[0].strip() if head.frames else "(no frame)"
    if frame.startswith('File "'):
        path, _, rest = frame[6:].partition('", line ')
        line, _, func = rest.partition(" in ")
        frame = f"{os.path.basename(path)}:{line} in {func}" if func else frame
    which = "main thread" if head.is_main else "current thread"
    more = f"; {len(threads)} threads, --full" if len(threads) > 1 else "; --full"
    script = where_of(text)  # the script's own innermost frame, when the top one is not
    if script and not frame.startswith(script + " "):
        frame += f", from {script}"
    return f"{frame} ({which}{more})"


def _short_fields(record: Record) -> dict[str, Any]:
    """The fields as the one-line view shows them: a torch record's name without the file
    it came from (``dynamic_rendezvous.py:``), and without its source."""
    if record.type != EventType.TORCHELASTIC:
        return record.fields
    name = record.fields.get("name")
    if isinstance(name, str) and ".py:" in name:
        name = name.partition(".py:")[2]
    return {"name": name}


def _short_data(record: Record) -> dict[str, Any]:
    """``data`` as the one-line view shows it: a stack as its top frame, peers' stacks as a
    count, a torch record as its name and state."""
    data = dict(record.data)
    if record.type == EventType.TORCHELASTIC:
        short: dict[str, Any] = {}
        for key in _TORCH_KEYS:
            value = data.get(key)
            if value in (None, "", {}, []):
                continue
            if isinstance(value, str):
                run_id = data.get("run_id")
                if isinstance(run_id, str) and len(run_id) > 8:
                    value = value.replace(run_id, run_id[:8] + "...")
                if key == "message" and value.startswith("The node '"):
                    value = value.partition("' ")[2] or value  # the node is in the line
                if len(value) > _TORCH_TEXT_CHARS:
                    value = value[:_TORCH_TEXT_CHARS - 3] + "..."
            short[key] = value
        return short
    stack = data.get("stack")
    if isinstance(stack, str) and stack:
        top = _top_frame(stack)
        data["stack"] = top if top is not None else stack.strip().splitlines()[0]
        # where the worker is, and why, before the rest: the line is cut after DATA_CHARS
        first = {k: data.pop(k) for k in _FIRST_KEYS if k in data}
        data = {**first, **{k: v for k, v in data.items() if v is not None}}
    peers = data.get("peer_stacks")
    if isinstance(peers, dict) and peers:
        data["peer_stacks"] = f"{len(peers)} rank(s), --full"
    return data


def _blocks(record: Record) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """``--full``: the fields and data with every text of several lines taken out, and
    those texts as lines to print under the event's line (a stack in reading order)."""
    lines: list[str] = []

    def take(values: dict[str, Any]) -> dict[str, Any]:
        kept: dict[str, Any] = {}
        for key, value in values.items():
            if key == "peer_stacks" and isinstance(value, dict) and value and all(
                    isinstance(v, str) for v in value.values()):
                kept[key] = "(below)"
                for peer, text in value.items():
                    lines.append(f"{_INDENT}peer_stacks[{peer}]:")
                    lines.extend(_INDENT * 2 + line if line else "" for line in _text_lines(text))
            elif isinstance(value, str) and "\n" in value.strip():
                kept[key] = "(below)"
                lines.append(f"{_INDENT}{key}:")
                lines.extend(_INDENT * 2 + line if line else "" for line in _text_lines(value))
            else:
                kept[key] = value
        return kept

    fields = take(record.fields)
    data = take(record.data)
    return fields, data, [_one_line(line) for line in lines]


def _text_lines(text: str) -> list[str]:
    """A stack in reading order (:func:`~eventbus.app.health.stacks.stack_lines`), any
    other text as its lines."""
    if parse_stack(text)[1]:
        return stack_lines(text, full=True)
    return text.rstrip().splitlines()


def format_record(record: Record, *, colour: bool = False, utc: bool = False,
                  data_chars: int | None = DATA_CHARS) -> str:
    """One line: time, host, who (``agent`` / ``rank N``), type, fields, ``|`` data (cut
    after ``data_chars`` characters, a stack shown as its top frame, a torch record as its
    name and state). ``data_chars=None`` (``--full``): all of it, and every text of
    several lines (a stack, a traceback) on indented lines under the event's line."""
    when = datetime.datetime.fromtimestamp(
        record.timestamp, datetime.timezone.utc if utc else None)
    stamp = when.strftime("%H:%M:%S.") + f"{when.microsecond // 1000:03d}"
    # Everything that came from the file is escaped before any colour code is added.
    host = f"{_one_line(record.hostname[:12]):<12}"
    who = f"{'agent' if record.rank is None else f'rank {record.rank}':<8}"
    name = f"{_one_line(record.type):<17}"
    below: list[str] = []
    if data_chars is None:
        shown_fields, shown_data, below = _blocks(record)
    else:
        shown_fields, shown_data = _short_fields(record), _short_data(record)
    fields = _one_line(" ".join(f"{k}={_value(v)}" for k, v in shown_fields.items()
                                if v is not None))
    data = _one_line(" ".join(f"{k}={_value(v)}" for k, v in shown_data.items()))
    if data_chars is not None and len(data) > data_chars:
        data = data[:data_chars] + f"... (+{len(data) - data_chars} chars, --full)"
    tail = "".join("\n" + line for line in below)
    if not colour:
        return "  ".join((stamp, host, who, name, fields + (" | " + data if data else "")
                          )).rstrip() + tail
    # bold: a user-declared type
    if record.stopped_by_agent:  # collateral of another worker's failure, or of a drain
        tint = _COLOURS["stopped"]
    elif record.type == EventType.AGENT_EXIT and job_outcome(record) == "preempted":
        tint = _COLOURS["preempted"]  # drained: not a red failure
    elif record.is_failure:
        tint = _COLOURS["failure"]
    else:
        tint = _COLOURS.get(record.type, _BOLD)
    return "  ".join((
        _DIM + stamp + _RESET,
        _DIM + host + _RESET,
        who,
        (tint + name + _RESET) if tint else name,
        fields + ((_DIM + " | " + _RESET + data) if data else ""),
    )).rstrip() + "".join(
        "\n" + (_BOLD + line + _RESET if EVENTBUS_MARK not in line and line.strip().startswith(
            ("Thread 0x", "Current thread 0x")) else line) for line in below)


class EventFileReader:
    """Reads a JSONL events file incrementally: :meth:`poll` returns what was appended
    since the last call, holding back an unfinished last line.

    Survives truncation (reads again from the start) and replacement (reopens the path).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._fh: IO[bytes] | None = None
        self._inode: tuple[int, int] | None = None
        self._pending = b""
        self._line = 0
        #: notes about the file itself (truncated, replaced) for the caller to show
        self.notices: list[str] = []

    def _open(self) -> bool:
        try:
            fh = open(self.path, "rb")  # noqa: SIM115 - kept open across polls
        except FileNotFoundError:
            return False
        st = os.fstat(fh.fileno())
        self._fh, self._inode = fh, (st.st_dev, st.st_ino)
        self._pending, self._line = b"", 0
        return True

    def close(self) -> None:
        """Close the file."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def _check_replaced(self) -> None:
        assert self._fh is not None
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return  # removed: keep reading what we have; a new file will be picked up
        if (st.st_dev, st.st_ino) != self._inode:
            self.notices.append(f"{self.path}: replaced by a new file; reading it from the "
                                "start")
            self.close()
            self._open()
        elif st.st_size < self._fh.tell():
            self.notices.append(f"{self.path}: truncated; reading it again from the start")
            self._fh.seek(0)
            self._pending, self._line = b"", 0

    def poll(self) -> list[Record | Problem]:
        """Everything appended since the last poll (complete lines only)."""
        if self._fh is None and not self._open():
            return []
        self._check_replaced()
        if self._fh is None:
            return []
        chunk = self._fh.read()
        if not chunk:
            return []
        data = self._pending + chunk
        *lines, self._pending = data.split(b"\n")
        return self._decode(lines, complete=True)

    def finish(self) -> list[Record | Problem]:
        """The unfinished last line, if any, decoded as such (call once, at the end)."""
        if not self._pending.strip():
            return []
        rest, self._pending = self._pending, b""
        return self._decode([rest], complete=False)

    def _decode(self, lines: list[bytes], *, complete: bool) -> list[Record | Problem]:
        out: list[Record | Problem] = []
        for raw in lines:
            self._line += 1
            if not raw.strip():
                continue
            text = raw.decode("utf-8", errors="replace")
            out.append(decode_line(text, source=str(self.path), line=self._line,
                                   complete=complete))
        return out


def _split(values: Sequence[str]) -> list[str]:
    return [v.strip() for value in values for v in value.split(",") if v.strip()]


def _ranks(values: Sequence[str]) -> set[int | Literal["agent"]]:
    ranks: set[int | Literal["agent"]] = set()
    for v in _split(values):
        if v.lower() == "agent":
            ranks.add("agent")
            continue
        try:
            ranks.add(int(v))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"--rank {v!r}: give a global rank number (e.g. --rank 1) or 'agent'"
            ) from None
    return ranks


class TypeFilter:
    """Which types ``--type``/``--exclude`` let through: ``include`` (empty: all but
    :data:`HIDDEN_TYPES`), minus ``exclude``; names upper-case."""

    __slots__ = ("exclude", "include")

    def __init__(self, include: frozenset[str] = frozenset(),
                 exclude: frozenset[str] = frozenset()) -> None:
        self.include = include
        self.exclude = exclude

    def __call__(self, type_name: str) -> bool:
        name = type_name.upper()
        if name in self.exclude:
            return False
        if self.include:
            return name in self.include
        return name not in HIDDEN_TYPES


def parse_types(values: Sequence[str], excluded: Sequence[str] = (), *,
                known: Sequence[str] = (), strict: bool = True) -> tuple[TypeFilter, list[str]]:
    """``--type`` and ``--exclude`` values (repeatable, comma-separated; in ``--type`` a
    leading ``-`` or ``!`` excludes) as a :class:`TypeFilter`, and notes for names that
    are neither built in nor in ``known`` (the types in the file).

    Such a name is an ``argparse.ArgumentTypeError`` naming the valid types and the
    closest one, unless ``strict`` is False (``-f``: the type may come later) and no valid
    name is close to it: then it is kept and a note says so.
    """
    builtin = [str(t) for t in EventType]
    valid = sorted({*builtin, *(k.upper() for k in known)})
    include: set[str] = set()
    exclude: set[str] = set()
    notes: list[str] = []
    tokens = [(v, False) for v in _split(values)] + [(v, True) for v in _split(excluded)]
    for token, from_exclude in tokens:
        name = token.lstrip("-!").strip()
        is_exclude = from_exclude or name != token
        option = "--exclude" if from_exclude else "--type"
        if not name:
            raise argparse.ArgumentTypeError(f"{option} {token!r}: give an event type name, "
                                             "e.g. --type WORKER_EXIT or --type -TORCHELASTIC")
        upper = name.upper()
        if upper not in valid:
            hint = did_you_mean(upper, valid, cutoff=TYPE_CUTOFF)
            if strict or hint:
                raise argparse.ArgumentTypeError(
                    f"{option} {token!r}: no such event type{hint}; the types are "
                    f"{', '.join(valid)} (built in, or in the file)")
            notes.append(f"{name!r} is not a built-in type and not in the file yet; "
                         "showing it when it comes")
        (exclude if is_exclude else include).add(upper)
    return TypeFilter(frozenset(include), frozenset(exclude)), notes


def _matches(record: Record, types: TypeFilter, ranks: set[int | Literal["agent"]]) -> bool:
    if not types(record.type):
        return False
    if not ranks:
        return True
    if record.rank is not None:
        return record.rank in ranks
    if "agent" in ranks:
        return True
    worker_id = record.fields.get("worker_id")
    return type(worker_id) is int and worker_id in ranks


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eventbus tail",
        description="Show an events JSONL file one line per event; -f follows it as it grows.")
    parser.add_argument("path", metavar="EVENTS.jsonl")
    parser.add_argument("-f", "--follow", action="store_true",
                        help="keep reading as the file grows (Ctrl-C to stop)")
    parser.add_argument("-n", "--lines", type=int, default=None, metavar="N",
                        help="start with only the last N matching events")
    parser.add_argument("--type", action="append", default=[], metavar="TYPE",
                        help="only these event types (repeat or comma-separate); -TYPE or "
                             "!TYPE leaves one out (--type=-TORCHELASTIC). WORKER_PROGRESS "
                             "heartbeats show only when named here")
    parser.add_argument("--exclude", action="append", default=[], metavar="TYPE",
                        help="leave these event types out (repeat or comma-separate)")
    parser.add_argument("--rank", action="append", default=[], metavar="RANK",
                        help="only these global ranks, or 'agent' (repeat or comma-separate)")
    parser.add_argument("--color", "--colour", choices=("auto", "always", "never"),
                        default="auto", help="colourise (auto: when stdout is a terminal)")
    parser.add_argument("--utc", action="store_true", help="times in UTC, not local time")
    parser.add_argument("--full", action="store_true",
                        help=f"show all of each event's data (default: {DATA_CHARS} chars, a "
                             "stack as its top frame, torch's records as their name and "
                             "state), stacks and tracebacks on several lines")
    parser.add_argument("--interval", type=float, default=0.25, metavar="SECONDS",
                        help="how often -f looks for new lines (default 0.25)")
    return parser


def _use_colour(mode: str, stream: IO[str]) -> bool:
    if mode != "auto":
        return mode == "always"
    if os.environ.get("NO_COLOR"):
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class _Printer:
    def __init__(self, *, colour: bool, utc: bool, full: bool, types: TypeFilter,
                 ranks: set[int | Literal["agent"]]) -> None:
        self.colour, self.utc, self.types, self.ranks = colour, utc, types, ranks
        self.data_chars = None if full else DATA_CHARS
        self.shown = self.skipped = self.hidden = 0

    def line(self, item: Record | Problem) -> str | None:
        if isinstance(item, Problem):
            self.skipped += 1
            return None
        if not _matches(item, self.types, self.ranks):
            if item.type.upper() in HIDDEN_TYPES and not self.types.include:
                self.hidden += 1
            return None
        self.shown += 1
        return format_record(item, colour=self.colour, utc=self.utc,
                             data_chars=self.data_chars)

    def problem(self, item: Problem) -> None:
        text = f"eventbus tail: skipped {item.describe()}"
        if self.colour and _use_colour("auto", sys.stderr):
            text = _COLOURS["WORKER_RESTART"] + text + _RESET
        print(text, file=sys.stderr, flush=True)


def _emit(printer: _Printer, items: Sequence[Record | Problem]) -> None:
    for item in items:
        text = printer.line(item)
        if isinstance(item, Problem):
            printer.problem(item)
        elif text is not None:
            sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _follow(reader: EventFileReader, printer: _Printer, interval: float) -> Iterator[None]:
    waiting_said = False
    while True:
        items = reader.poll()
        for notice in reader.notices:
            print(f"eventbus tail: {notice}", file=sys.stderr, flush=True)
        reader.notices.clear()
        if items:
            _emit(printer, items)
        elif not reader.path.exists() and not waiting_said:
            print(f"eventbus tail: waiting for {reader.path} to appear", file=sys.stderr,
                  flush=True)
            waiting_said = True
        yield
        time.sleep(interval)


def _joined_type_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``--type -TORCHELASTIC`` as ``--type=-TORCHELASTIC``: argparse would take the value
    for an option of its own and say ``--type`` lacks one."""
    options = set(parser._option_string_actions)
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("--type", "--exclude") and i + 1 < len(argv) \
                and argv[i + 1][:1] in ("-", "!") and argv[i + 1] not in options \
                and argv[i + 1] != "--":
            out.append(f"{arg}={argv[i + 1]}")
            i += 2
            continue
        out.append(arg)
        i += 1
    return out


def main(argv: Sequence[str]) -> int:
    """``eventbus tail``: 0 when done (or stopped with Ctrl-C), 2 on a usage error."""
    parser = _parser()
    args = parser.parse_args(_joined_type_values(parser, list(argv)))
    try:
        ranks = _ranks(args.rank)
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    if args.lines is not None and args.lines < 0:
        parser.error(f"-n {args.lines}: give a number of events >= 0")
    if args.interval <= 0:
        parser.error(f"--interval {args.interval}: give a positive number of seconds")
    path = Path(args.path)
    if path.is_dir():
        found = sorted(p.name for p in path.glob("*.jsonl"))
        more = " ..." if len(found) > 5 else ""
        hint = (f"; give one of its events files: {', '.join(found[:5])}{more}"
                if found else "; it holds no *.jsonl file")
        print(f"eventbus tail: {path} is a directory, not an events file{hint}",
              file=sys.stderr)
        return 2
    if not args.follow and not path.is_file():
        print(f"eventbus tail: {path}: no such file (-f waits for it to appear)",
              file=sys.stderr)
        return 2
    reader = EventFileReader(path)
    first = reader.poll()
    if not args.follow:
        first += reader.finish()
    try:
        types, notes = parse_types(
            args.type, args.exclude, strict=not args.follow,
            known=sorted({item.type for item in first if isinstance(item, Record)}))
    except argparse.ArgumentTypeError as exc:
        reader.close()
        parser.error(str(exc))
    for note in notes:
        print(f"eventbus tail: {note}", file=sys.stderr)
    printer = _Printer(colour=_use_colour(args.color, sys.stdout), utc=args.utc, full=args.full,
                       types=types, ranks=ranks)
    try:
        if args.lines is not None:
            # keep the last N matching events (and every problem, in its place)
            keep: collections.deque[int] = collections.deque(maxlen=max(args.lines, 0))
            for i, item in enumerate(first):
                if isinstance(item, Record) and _matches(item, printer.types, printer.ranks):
                    keep.append(i)
            kept = set(keep) if args.lines else set()
            first = [it for i, it in enumerate(first)
                     if isinstance(it, Problem) or i in kept]
        _emit(printer, first)
        if args.follow:
            for _ in _follow(reader, printer, args.interval):
                pass
    except KeyboardInterrupt:
        _emit(printer, reader.finish())
    except BrokenPipeError:
        # the reader of our output went away (`| head`): stop quietly
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silences the exit flush
        return 0
    finally:
        reader.close()
    if printer.skipped:
        print(f"eventbus tail: {printer.shown} event(s) shown, {printer.skipped} line(s) "
              "skipped (not events)", file=sys.stderr)
    if printer.hidden:
        print(f"eventbus tail: {printer.hidden} WORKER_PROGRESS heartbeat(s) not shown "
              "(--type WORKER_PROGRESS shows them)", file=sys.stderr)
    return 0
