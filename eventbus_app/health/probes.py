"""What the agent asks of its workers' processes when a group stalls: their Python stacks
(:class:`StackDumper`) and their flight-recorder traces (the dump requests).

The agent's half of the conversation whose worker half is the bootstrap's stack dump and
progress watch; the names, files and rules both halves share are
:mod:`eventbus.app.protocol.agent_worker`. Torch-free.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterable
from collections.abc import MutableMapping

from eventbus.app.protocol.agent_worker import ENV_FR_DUMP_DIR
from eventbus.app.protocol.agent_worker import ENV_STACK_SIGNAL
from eventbus.app.protocol.agent_worker import FR_DUMP_PREFIX
from eventbus.app.protocol.agent_worker import FR_REQUEST_FILE
from eventbus.app.protocol.agent_worker import fr_dump_folder
from eventbus.app.protocol.agent_worker import fr_dump_path
from eventbus.app.protocol.agent_worker import read_stack_signal
from eventbus.app.protocol.agent_worker import stack_file_path
from eventbus.app.protocol.agent_worker import write_fr_request

__all__ = [
    "FR_DUMP_WAIT_S",
    "MAX_STACK_CHARS",
    "FlightRecorderDumps",
    "StackDumper",
    "ask_fr_dumps",
    "request_fr_dumps",
    "wait_fr_dumps",
]

logger = logging.getLogger("eventbus")

#: each stack in an event is cut to this many characters (its end, the innermost frames
#: of the last thread, is kept whole by faulthandler's "most recent call first" order)
MAX_STACK_CHARS = 32_000
#: how long the agent waits for the workers' flight-recorder dumps
FR_DUMP_WAIT_S = 2.0


# -- stacks --------------------------------------------------------------------------------


class StackDumper:
    """Ask workers for their Python stacks through the files of ``directory``.

    A worker of ``eventbus run`` with ``EVENTBUS_STACK_DIR`` set arms ``faulthandler`` on
    a signal and writes the signal's number to ``<dir>/<pid>.sig``
    (:func:`eventbus.app.worker.stack_dump.arm_stack_dump`); this sends that signal and reads
    what the worker's C handler appended to ``<dir>/<pid>.stack`` (the files of
    :mod:`eventbus.app.protocol.agent_worker`). A worker without the ``.sig`` file (opted
    out, or not started through the worker bootstrap) is never signalled.
    """

    def __init__(self, directory: str, *, wait_s: float = 1.0) -> None:
        self.directory = directory
        self.wait_s = wait_s

    def _stack(self, pid: int) -> str:
        return stack_file_path(self.directory, pid)

    def capture(self, pids: Iterable[int]) -> dict[int, str]:
        """pid -> the stack text each armed, live worker wrote (others: a note why not)."""
        offsets: dict[int, int] = {}
        result: dict[int, str] = {}
        for pid in pids:
            try:
                signum = read_stack_signal(self.directory, pid)
            except (OSError, ValueError):
                result[pid] = ("(no stack: the worker did not arm the stack dump; "
                               f"{ENV_STACK_SIGNAL}=off, or it did not start through the "
                               "worker bootstrap: a --no-python program)")
                continue
            try:
                offsets[pid] = os.path.getsize(self._stack(pid))
                os.kill(pid, signum)
            except OSError as exc:
                result[pid] = f"(no stack: {exc})"
                offsets.pop(pid, None)
        deadline = time.monotonic() + self.wait_s
        sizes = {pid: -1 for pid in offsets}
        stable = 0
        while offsets and time.monotonic() < deadline:
            time.sleep(0.05)
            now = {pid: _size(self._stack(pid)) for pid in offsets}
            grown = all(now[pid] > offsets[pid] for pid in offsets)
            if grown and now == sizes:
                stable += 1
                if stable >= 2:
                    break
            else:
                stable = 0
            sizes = now
        for pid, offset in offsets.items():
            try:
                with open(self._stack(pid), encoding="utf-8",
                          errors="replace") as f:
                    f.seek(offset)
                    text = f.read()
            except OSError as exc:
                text = f"(no stack: {exc})"
            if not text:
                text = "(no stack: the worker wrote nothing within the wait)"
            result[pid] = text[-MAX_STACK_CHARS:]
        return result


# -- flight-recorder dumps -----------------------------------------------------------------


def ask_fr_dumps(folder: str, token: str) -> int:
    """Ask the workers whose ``EVENTBUS_FR_DUMP_DIR`` is ``folder`` for their traces
    (:func:`~eventbus.app.protocol.agent_worker.write_fr_request`: each worker serves a new
    token once). Returns when it asked (``time.time_ns()``, less a second for coarse file
    times), for :func:`wait_fr_dumps`."""
    asked = time.time_ns() - 1_000_000_000
    write_fr_request(folder, token)
    return asked


def wait_fr_dumps(folder: str, ranks: Iterable[int], asked: int, *,
                  wait_s: float = FR_DUMP_WAIT_S) -> bool:
    """Wait up to ``wait_s`` for a ``fr_trace_rank_<r>`` newer than ``asked`` of each of
    ``ranks``; whether at least one came."""
    want = [fr_dump_path(folder, r) for r in ranks]

    def fresh(path: str) -> bool:
        try:
            return os.stat(path).st_mtime_ns >= asked
        except OSError:
            return False

    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and not all(fresh(p) for p in want):
        time.sleep(0.05)
    return any(fresh(p) for p in want)


def request_fr_dumps(folder: str, token: str, ranks: Iterable[int], *,
                     wait_s: float = FR_DUMP_WAIT_S) -> str | None:
    """:func:`ask_fr_dumps` and :func:`wait_fr_dumps`: ``folder`` when at least one dump
    came, else None (workers without the progress watch, or opted out)."""
    asked = ask_fr_dumps(folder, token)
    return folder if wait_fr_dumps(folder, ranks, asked, wait_s=wait_s) else None


class FlightRecorderDumps:
    """The run's flight-recorder dumps (``root``: the protocol's ``fr_dump_root``; None
    when off): each attempt's folder armed for its workers, asked for once per attempt.

    A folder that cannot be made or written is one warning, and that attempt goes without
    dumps (the stall is still reported). :meth:`close` removes the folders that hold no
    dump; a dump is evidence and stays."""

    def __init__(self, root: str | None) -> None:
        self.root = root
        #: attempt -> its dump folder once asked ("" when asking failed or none came)
        self._asked: dict[int, str] = {}
        #: the attempts whose folders this agent made (or may have made)
        self._armed: set[int] = set()

    def arm(self, attempt: int, environ: MutableMapping[str, str]) -> None:
        """Point the attempt's workers at its folder (``EVENTBUS_FR_DUMP_DIR`` in
        ``environ``, which they inherit), emptied of a former run's dumps."""
        if self.root is None:
            return
        folder = fr_dump_folder(self.root, attempt)
        self._armed.add(attempt)
        try:
            _make_folder(folder)
            for name in os.listdir(folder):  # a former run's of the same run id
                if name.startswith(FR_DUMP_PREFIX):
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(folder, name))
        except OSError as exc:
            logger.warning("eventbus: no flight-recorder dumps (%s: %s)", folder, exc)
            environ.pop(ENV_FR_DUMP_DIR, None)
            return
        environ[ENV_FR_DUMP_DIR] = folder

    def ask(self, attempt: int) -> tuple[str | None, int]:
        """Ask the attempt's workers for their traces, once per attempt, without waiting:
        (the folder, or None; when it asked, for :func:`wait_fr_dumps`)."""
        if self.root is None or attempt in self._asked:
            return None, 0
        folder = fr_dump_folder(self.root, attempt)
        try:
            asked = ask_fr_dumps(folder, _token(attempt))
        except (OSError, ValueError) as exc:
            logger.warning("eventbus: no flight-recorder dumps: %s", exc)
            self._asked[attempt] = ""
            return None, 0
        self._asked[attempt] = folder
        return folder, asked

    def request(self, attempt: int, ranks: Iterable[int]) -> str | None:
        """Ask the attempt's workers ``ranks`` for their traces (once per attempt) and wait
        for them briefly; the folder, or None without dumps."""
        if self.root is None:
            return None
        if attempt in self._asked:
            return self._asked[attempt] or None
        try:
            folder = request_fr_dumps(fr_dump_folder(self.root, attempt), _token(attempt),
                                      ranks)
        except (OSError, ValueError) as exc:
            logger.warning("eventbus: no flight-recorder dumps: %s", exc)
            folder = None
        self._asked[attempt] = folder or ""
        return folder

    def close(self) -> None:
        """The agent's end: each attempt's folder that holds no dump is removed (the
        request and the workers' unfinished temp files with it), then the run's folder and
        ``eventbus-fr`` when empty. A folder with a dump stays whole: it is the evidence a
        ``WORKER_STALLED`` or a SIGABRT's diagnosis names. Never raises."""
        if self.root is None:
            return
        for attempt in sorted(self._armed | set(self._asked)):
            folder = fr_dump_folder(self.root, attempt)
            try:
                names = os.listdir(folder)
            except OSError:
                continue
            if any(name.startswith(FR_DUMP_PREFIX) for name in names):
                continue
            for name in names:
                if name == FR_REQUEST_FILE or name.endswith(".tmp"):
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(folder, name))
            with contextlib.suppress(OSError):  # a file of another kind keeps it
                os.rmdir(folder)
        self._armed.clear()
        # Only when empty: another agent of the same run on this host may still use them.
        for folder in (self.root, os.path.dirname(self.root)):
            try:
                os.rmdir(folder)
            except OSError:
                return


def _make_folder(folder: str) -> None:
    """``os.makedirs``, once more when another agent's :meth:`FlightRecorderDumps.close`
    removed an empty parent between its steps."""
    try:
        os.makedirs(folder, exist_ok=True)
    except FileNotFoundError:
        os.makedirs(folder, exist_ok=True)


def _token(attempt: int) -> str:
    return f"stall-attempt{attempt}-{time.time():.3f}"


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return -1
