"""``eventbus view EVENTS.jsonl [--ui [HOST:]PORT] [--ui-token TOKEN]``: the job view of a
run's JSONL file, following it while it grows (the reader of ``eventbus tail -f``: an
unfinished last line waits for its newline, a truncated or replaced file is read again).

Serves until Ctrl-C (or SIGTERM); exit code 0 then, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from eventbus.app.readers.records import Problem
from eventbus.app.readers.tail import EventFileReader
from eventbus.app.ui import DEFAULT_HOST
from eventbus.app.ui import TOKEN_ENV
from eventbus.app.ui import JobState
from eventbus.app.ui import parse_address
from eventbus.app.ui import resolve_token
from eventbus.app.ui import serve
from eventbus.app.ui.state import DEFAULT_MAX_EVENTS

__all__ = ["feed", "main"]


def feed(reader: EventFileReader, state: JobState) -> int:
    """Hand what the file gained since the last call to ``state``; returns how many lines
    were read (events and unreadable lines)."""
    items = reader.poll()
    records = [item for item in items if not isinstance(item, Problem)]
    if records:
        state.add_records(records)  # one hold of the state's lock per chunk of records
    bad = len(items) - len(records)
    if bad:
        state.add_unreadable(bad)
    return len(items)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eventbus view",
        description="Serve the job view (the page of `eventbus run --ui`) for an events "
                    "JSONL file, following it while it grows.")
    parser.add_argument("path", metavar="EVENTS.jsonl")
    parser.add_argument("--ui", metavar="[HOST:]PORT", default="0",
                        help=f"where to serve (default: a free port on {DEFAULT_HOST}; a "
                             "host other than loopback requires a token)")
    parser.add_argument("--ui-token", metavar="TOKEN", default=None,
                        help=f"the token the page requires (default: ${TOKEN_ENV}, else "
                             "none on loopback and a generated one on any other host)")
    parser.add_argument("--events", type=int, default=DEFAULT_MAX_EVENTS, metavar="N",
                        help=f"recent events kept for the list (default {DEFAULT_MAX_EVENTS})")
    parser.add_argument("--interval", type=float, default=0.25, metavar="SECONDS",
                        help="how often the file is read for new lines (default 0.25)")
    return parser


def main(argv: Sequence[str]) -> int:
    """``eventbus view``."""
    parser = _parser()
    args = parser.parse_args(list(argv))
    try:
        address = parse_address(args.ui)
        token, generated = resolve_token(address.host, args.ui_token)
    except ValueError as exc:
        parser.error(str(exc))
    if args.events < 1:
        parser.error(f"--events {args.events}: give a number of events >= 1")
    if args.interval <= 0:
        parser.error(f"--interval {args.interval}: give a positive number of seconds")
    path = Path(args.path)
    if path.is_dir():
        parser.error(f"{path}: a directory; give the events JSONL file "
                     "(eventbus run --events-jsonl PATH)")
    state = JobState(max_events=args.events, live=False, source=str(path))
    reader = EventFileReader(path)
    feed(reader, state)
    state.snapshot()  # the goodput figure, computed once: the first page gets it at once
    try:
        server = serve(state, address, token, show_token=generated)
    except OSError as exc:
        print(f"eventbus view: --ui {args.ui}: cannot listen on {address.host}:"
              f"{address.port} ({exc}); pick another port (--ui 0: a free one)",
              file=sys.stderr)
        return 2
    if not path.exists():
        print(f"eventbus view: waiting for {path} to appear", file=sys.stderr, flush=True)
    stop = threading.Event()

    def on_term(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        while not stop.is_set():
            stop.wait(args.interval)
            feed(reader, state)
            for notice in reader.notices:
                print(f"eventbus view: {notice}", file=sys.stderr, flush=True)
            reader.notices.clear()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        server.close(timeout=1.0)
        reader.close()
    return 0
