"""The Python stacks a stalled worker leaves, read and put in the order a person reads
them: the main thread first (where the script is), the script's other threads, then
eventbus's own threads, marked, with their top frame only.

Two shapes are read: ``faulthandler``'s dump (the stall watch's stack dump, innermost call
first) and a heartbeat's stack in ``traceback``'s format
(:func:`eventbus.app.worker.where.format_stacks`, innermost call last).

A base module of the application: torch-free, it imports only the core, so the agent's
console (``launcher/cli/console.py``), the sentences (``sentences.py``) and ``eventbus tail``
(``readers/tail.py``) share it without the readers importing the launcher.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence

__all__ = [
    "EVENTBUS_MARK",
    "MAX_STACK_LINES",
    "StackThread",
    "format_stack",
    "own_roots",
    "parse_stack",
    "stack_lines",
    "where_of",
]

#: at most this many lines of a stack on the console (the event keeps it whole)
MAX_STACK_LINES = 60

_HEADER = re.compile(
    r"^(Current thread|Thread) (0x[0-9a-fA-F]+)(.*)\(most recent call first\):\s*$")
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]*)", line (?P<line>\d+|\?+) in (?P<func>.*)$')
#: a heartbeat's stack (eventbus.app.worker.where.format_stacks): traceback's format,
#: one header per thread, ``Thread 0x.. "name" (main), most recent call last:``
_TB_HEADER = re.compile(
    r'^Thread (0x[0-9a-fA-F]+)(?P<rest>.*), most recent call last:\s*$')
_TB_FRAME = re.compile(r'^(?P<indent>\s*)File "(?P<file>[^"]*)", line (?P<line>\d+), in '
                       r'(?P<func>.*)$')
#: what marks one of eventbus's own threads in a formatted stack
EVENTBUS_MARK = "[eventbus's own thread]"


class StackThread:
    """One thread of a ``faulthandler`` dump: its header and frame lines, innermost first."""

    __slots__ = ("current", "frames", "header", "ident")

    def __init__(self, header: str, ident: str, current: bool) -> None:
        self.header = header
        self.ident = ident
        self.current = current
        self.frames: list[str] = []

    def files(self) -> list[str]:
        return [m.group("file") for m in (_FRAME.match(f) for f in self.frames) if m]

    @property
    def is_main(self) -> bool:
        """A thread started by ``threading`` has ``_bootstrap`` as its outermost frame;
        the main thread does not (a heartbeat's stack names it: ``(main)``)."""
        if self.current and "(main)" in self.header:
            return True
        files = self.files()
        if not files:
            return self.current
        return os.path.basename(files[-1]) != "threading.py"


def parse_stack(text: str) -> tuple[list[str], list[StackThread]]:
    """The lines before the first thread header, and the threads of a faulthandler dump
    (every other line kept with the thread it follows).

    A heartbeat's stack (traceback's format, ``most recent call last``, as
    :func:`eventbus.app.worker.where.format_stacks` writes it) is read too: its frames
    come back in faulthandler's shape and order (``File "x.py", line N in f``, innermost
    first, the source lines left out), its thread marked ``(main)`` is the main thread and
    one marked ``(eventbus's own)`` gets :data:`EVENTBUS_MARK`."""
    preamble: list[str] = []
    threads: list[StackThread] = []
    pending: list[str] = []  # a traceback-format thread's frames, outermost first
    trailer: list[str] = []  # its other lines (a cut note), kept after the frames

    def close_traceback() -> None:
        if threads and (pending or trailer):
            threads[-1].frames.extend([*reversed(pending), *trailer])
        pending.clear()
        trailer.clear()

    in_traceback = False
    for raw in text.splitlines():
        line = raw.rstrip()
        header = _HEADER.match(line.strip())
        tb_header = None if header else _TB_HEADER.match(line.strip())
        if header or tb_header:
            close_traceback()
        if header:
            in_traceback = False
            threads.append(StackThread(line.strip(), header.group(2),
                                       header.group(1) == "Current thread"))
        elif tb_header:
            in_traceback = True
            rest = tb_header.group("rest").strip()
            main = "(main)" in rest
            own = "(eventbus's own)" in rest
            rest = rest.replace("(eventbus's own)", "").strip()
            title = f"Thread {tb_header.group(1)}{' ' + rest if rest else ''} " \
                "(most recent call first):"
            if own:
                title = f"{title} {EVENTBUS_MARK}"
            threads.append(StackThread(title, tb_header.group(1), main))
        elif in_traceback:
            frame = _TB_FRAME.match(line)
            if frame:
                pending.append(f'  File "{frame.group("file")}", line {frame.group("line")} '
                               f'in {frame.group("func")}')
            elif line and not (pending and line.startswith("    ")):  # not a source line
                trailer.append(line)
        elif threads:
            if line:
                threads[-1].frames.append(line)
        elif line:
            preamble.append(line)
    close_traceback()
    return preamble, threads


def own_roots() -> tuple[str, ...]:
    """The folders eventbus's own code is imported from (a frame in one is eventbus's,
    not the script's), the checkout's and their real paths both."""
    roots: set[str] = set()
    for name in ("eventbus", "eventbus.subscribers", "eventbus.publishers", "eventbus.app"):
        module = sys.modules.get(name)
        for entry in getattr(module, "__path__", []) if module is not None else []:
            roots.add(os.path.join(entry, ""))
            roots.add(os.path.join(os.path.realpath(entry), ""))
    roots.add(os.sep + os.path.join("site-packages", "eventbus", ""))
    return tuple(sorted(roots))


def _is_own_file(path: str, roots: Sequence[str]) -> bool:
    return any(path.startswith(root) or root in path for root in roots)


def _is_stdlib(path: str) -> bool:
    return (os.sep + "lib" + os.sep + "python") in path and "site-packages" not in path


def _is_eventbus_thread(thread: StackThread, roots: Sequence[str]) -> bool:
    """Marked already, or a thread of eventbus's own code: at least one eventbus frame and
    none of the script's (a script's thread that records an event is the script's)."""
    if EVENTBUS_MARK in thread.header:
        return True
    files = thread.files()
    return (any(_is_own_file(f, roots) for f in files)
            and all(_is_own_file(f, roots) or _is_stdlib(f) for f in files))


def format_stack(text: str, *, roots: Sequence[str] | None = None) -> list[StackThread]:
    """The threads of ``text`` in reading order: the main thread first (the culprit's
    current thread: where the script is), the other threads of the script, then
    eventbus's own threads (the forwarder, the queues), their headers marked."""
    _, threads = parse_stack(text)
    own = own_roots() if roots is None else tuple(roots)
    main = [t for t in threads if t.is_main]
    mine = [t for t in threads if t not in main and _is_eventbus_thread(t, own)]
    others = [t for t in threads if t not in main and t not in mine]
    for thread in mine:
        if EVENTBUS_MARK not in thread.header:
            thread.header = f"{thread.header} {EVENTBUS_MARK}"
    return [*main, *others, *mine]


def stack_lines(text: str, *, full: bool = False,
                max_lines: int = MAX_STACK_LINES) -> list[str]:
    """A stack text as lines a person reads: :func:`format_stack`'s order; eventbus's own
    threads with their top frame only unless ``full``; at most ``max_lines`` lines unless
    ``full`` (the last one says how many were left out). Text that is not a faulthandler
    dump (a note why there is no stack) comes back as its own lines."""
    preamble, _ = parse_stack(text)
    own = own_roots()
    threads = format_stack(text, roots=own)
    lines = list(preamble)
    for thread in threads:
        if lines:
            lines.append("")
        lines.append(thread.header)
        frames = thread.frames
        if not full and EVENTBUS_MARK in thread.header and len(frames) > 1:
            # the frame that says which of eventbus's threads it is (its queue, ...)
            mine = [f for f in frames if _is_own_frame(f, own)] or frames
            frames = [mine[0], f"  ... {len(thread.frames) - 1} more frames"]
        elif not full and thread.is_main:
            frames = _without_bootstrap(frames, own)
        lines.extend(frames)
    if not full and len(lines) > max_lines:
        left = len(lines) - (max_lines - 1)
        lines = [*lines[:max_lines - 1],
                 f"... {left} more lines (the event's data[\"stack\"] has them all)"]
    return lines


def _is_own_frame(frame: str, roots: Sequence[str]) -> bool:
    match = _FRAME.match(frame)
    return match is not None and _is_own_file(match.group("file"), roots)


def _without_bootstrap(frames: list[str], roots: Sequence[str]) -> list[str]:
    """The main thread's frames less the outermost ones that are the worker bootstrap's
    and runpy's (everything outside the script's ``<module>`` frame)."""
    end = len(frames)
    while end > 1:
        match = _FRAME.match(frames[end - 1])
        if match is None or not (_is_own_file(match.group("file"), roots)
                                 or match.group("file").startswith("<frozen runpy")
                                 or os.path.basename(match.group("file")) == "runpy.py"):
            break
        end -= 1
    return frames[:end]


def where_of(text: str, *, roots: Sequence[str] | None = None) -> str | None:
    """``FILE:LINE`` of the main thread's innermost frame in the script's own code (not
    torch, not eventbus, not the standard library), e.g. ``train.py:18``; None without
    one."""
    own = own_roots() if roots is None else tuple(roots)
    threads = format_stack(text, roots=own)
    if not threads:
        return None
    skip = (os.sep + "torch" + os.sep, os.sep + "site-packages" + os.sep,
            os.sep + "lib" + os.sep + "python")
    frames = [m for m in (_FRAME.match(f) for f in threads[0].frames) if m]
    for match in frames:
        path = match.group("file")
        if _is_own_file(path, own) or any(s in path for s in skip) or path.startswith("<"):
            continue
        return f"{os.path.basename(path)}:{match.group('line')}"
    return None
