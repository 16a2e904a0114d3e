"""The exit-order bookkeeping of the agent: which worker failed first, which were only
stopped because of it, and which exits are already reported. Torch-free: the agent hands
it plain facts (ranks, exit codes, error files) and a clock, and a unit test drives it
without processes (tests/test_exits.py).

Why the order needs keeping: a worker whose script raised writes its error file at once
(the bootstrap, or torch's ``@record``) and then spends seconds in its interpreter's
teardown; its peers meanwhile fail on the lost connection ("Connection closed by peer")
and can exit first. Judged by exits alone, a peer would be blamed and the worker that
raised first counted as stopped by the agent. So the error files' times order the
failures, and a live worker whose error file is older than every failure seen is given
up to :data:`DYING_GRACE_S` to exit by itself (once per attempt) before the failures are
decided on.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Sequence
from typing import Literal

import attrs

from eventbus.app.worker.process_groups import DESTROY_TIMEOUT_S

__all__ = [
    "DYING_GRACE_S",
    "ExitBook",
    "Proc",
    "error_time",
]

#: how long the monitor waits for a worker that failed first (its error file written) but
#: is still in its interpreter's teardown: the bootstrap's exit-time destroy of the process
#: groups alone may take DESTROY_TIMEOUT_S. The monitor does not block meanwhile: its ticks
#: return "healthy" until the worker exits or the grace ends.
DYING_GRACE_S = DESTROY_TIMEOUT_S + 2.0


def error_time(path: object) -> int | None:
    """When an error file was written (ns), None without one (or an empty one)."""
    if not isinstance(path, str) or path in ("<N/A>", os.devnull):
        return None
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_mtime_ns if stat.st_size > 0 else None


@attrs.frozen
class Proc:
    """A worker process as the bookkeeping sees it: its global rank, its exit code (None
    while it runs; ``-signum`` for a signal) and its error file (None without one)."""

    rank: int
    exit_code: int | None = None
    error_file: str | None = None


class ExitBook:
    """Per attempt: the ranks whose exit is reported, the first failure's error-file time,
    and the grace given to a worker that failed first and is still exiting.

    ``clock`` (monotonic seconds) and ``error_time`` (path -> ns or None) are injectable.
    """

    def __init__(self, *, grace_s: float = DYING_GRACE_S,
                 clock: Callable[[], float] = time.monotonic,
                 error_time: Callable[[object], int | None] = error_time) -> None:
        self.grace_s = float(grace_s)
        self._clock = clock
        self._error_time = error_time
        self._reported: set[tuple[int, int]] = set()
        #: attempt -> when the grace for a worker still exiting ends (set once per attempt)
        self._dying_until: dict[int, float] = {}
        #: attempt -> the earliest error file time (ns) of the failures decided on
        self._first_error_ns: dict[int, int] = {}

    # -- reported exits ------------------------------------------------------------------
    def reported(self, attempt: int, rank: int) -> bool:
        """Whether the exit of ``rank`` in ``attempt`` is already published."""
        return (attempt, rank) in self._reported

    def report(self, attempt: int, rank: int) -> bool:
        """Note that the exit is published now; False if it already was (publish nothing)."""
        key = (attempt, rank)
        if key in self._reported:
            return False
        self._reported.add(key)
        return True

    def decided(self, attempt: int, rank: int, error_file: object) -> None:
        """A failure is decided on: reported, and its error file's time kept (the late
        failures are judged against the earliest)."""
        self._reported.add((attempt, rank))
        written = self._error_time(error_file)
        if written is not None:
            first = self._first_error_ns.get(attempt)
            self._first_error_ns[attempt] = written if first is None else min(first, written)

    # -- who failed first ----------------------------------------------------------------
    def wait_for_dying(self, attempt: int, found: Sequence[Proc],
                       workers: Iterable[Proc]) -> Literal["wait", "look again", "go"]:
        """Whether the failures ``found`` can be decided on now.

        ``"wait"``: a live worker (``exit_code`` None, not reported, not found) whose error
        file is older than all of theirs is still exiting within the grace: the monitor's
        tick returns healthy and looks again. ``"look again"``: the grace ended with it
        alive; decide now, with whatever else exited meanwhile. ``"go"``: nothing to wait
        for (a failure without an error file, a signal or ``os._exit``, leaves the order
        as seen: nothing says when it happened)."""
        if not found:
            return "go"
        times = [self._error_time(p.error_file) for p in found]
        if any(t is None for t in times):
            return "go"
        first = min(t for t in times if t is not None)
        seen = {p.rank for p in found}
        dying = False
        for proc in workers:
            if proc.rank in seen or self.reported(attempt, proc.rank) or \
                    proc.exit_code is not None:
                continue
            written = self._error_time(proc.error_file)
            if written is not None and written < first:
                dying = True
                break
        if not dying:
            return "go"
        deadline = self._dying_until.setdefault(attempt, self._clock() + self.grace_s)
        return "wait" if self._clock() < deadline else "look again"

    def in_failure_order(self, error_files: Sequence[object]) -> list[int]:
        """The indexes of ``error_files`` in the order the failures happened: by error file
        time; one without an error file goes last (stable)."""
        def key(i: int) -> int:
            written = self._error_time(error_files[i])
            return written if written is not None else sys.maxsize
        return sorted(range(len(error_files)), key=key)

    def stopped_by_agent(self, attempt: int, unseen: Sequence[Proc], *,
                         decided_this_tick: bool) -> dict[int, bool]:
        """Of the failed workers torch's result reports and nobody published yet: rank ->
        whether the agent (or torch, because of another rank) stopped it, rather than it
        failing by itself.

        A worker whose error file predates the first failure decided on failed first (the
        grace ended during its teardown): its own failure, never "stopped". Otherwise, when
        this tick already decided on failures, the rest were stopped because of them; and
        without a peek (no waitid, or an exit in between) torch's result mixes the workers
        that failed with those it stopped with SIGTERM because of them."""
        own = {p.rank for p in unseen if p.exit_code != -int(signal.SIGTERM)}
        first_seen = self._first_error_ns.get(attempt)
        out: dict[int, bool] = {}
        for proc in unseen:
            written = self._error_time(proc.error_file)
            earlier = written is not None and first_seen is not None and written < first_seen
            out[proc.rank] = not earlier and (
                decided_this_tick or (bool(own) and proc.rank not in own))
        return out

    def new_attempt(self) -> None:
        """The group restarts: the grace and the first failure's time are done with (a
        membership change keeps the attempt's number)."""
        self._dying_until.clear()
        self._first_error_ns.clear()
