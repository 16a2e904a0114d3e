"""The drain: a scheduler's signal ends the job with every rank's checkpoint, not a kill.

The rules (docs/preemption.md):

* a drain signal (``--drain-signals``, default SIGTERM and SIGUSR1) to any node's agent
  starts a drain of the whole job. That agent publishes ``PREEMPTING`` (``deadline_s``:
  the grace, ``--drain-grace``; ``reason``: "SIGTERM on node 1"), which the job-wide
  notices carry to every worker and every other agent within a second;
* every agent then gives its workers until the deadline to stop by themselves (the
  script's ``eventbus.preemption.should_stop()`` or an integration saves and returns; a
  script that acts on none of it got the signal at once from its own bootstrap), uses no
  restart, and starts no new attempt;
* at the deadline it forwards the signal to the workers still running, and SIGKILLs those
  alive :data:`KILL_GRACE_S` later, as torchrun does; each is reported as a ``WORKER_EXIT``
  with cause ``preemption`` and named in the console line;
* a second drain signal during a drain moves the deadline to now (the scheduler insists);
  a copy within ``--drain-signal-window`` of the drain's start (default
  :data:`~eventbus.app.protocol.drain_signals.DEFAULT_SIGNAL_WINDOW_S`) is the same signal:
  SLURM signals every node's agent and every worker at once, and another node's
  ``PREEMPTING`` may reach this agent before its own copy does;
* a worker that caught a drain signal asks its agent for a drain (a real-time signal,
  :mod:`eventbus.app.protocol.drain_signals`): a drain starts where none is under way, and
  an ask is never a second signal;
* the job ends with ``AGENT_EXIT`` state ``PREEMPTED``, ``--drain-exit-code`` (default
  :data:`~eventbus.app.launcher.cli.options.DEFAULT_DRAIN_EXIT_CODE`, sysexits' EX_TEMPFAIL:
  "retry later"), and one
  ``eventbus:`` line (:meth:`Drain.summary_line`).

Torch-free. The signal handler only writes a byte to a pipe (async-signal-safe); a thread
reads it and starts the drain, so the agent's main thread (torch's monitor loop, or a
rendezvous it is blocked in) is never interrupted by the handler's work. The agent applies
the rest in its monitor (:meth:`EventAgent._drain_tick`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal as signals
import threading
import time
from collections.abc import Callable
from collections.abc import Iterable
from typing import Any

from eventbus.app.launcher.cli.options import DEFAULT_DRAIN_EXIT_CODE
from eventbus.app.launcher.cli.options import DEFAULT_DRAIN_GRACE_S
from eventbus.app.launcher.cli.options import DEFAULT_DRAIN_SIGNALS
from eventbus.app.protocol.drain_signals import DEFAULT_SIGNAL_WINDOW_S
from eventbus.app.protocol.drain_signals import ask_signal
from eventbus.app.protocol.drain_signals import asked_signal

__all__ = [
    "DEFAULT_SIGNAL_WINDOW_S",
    "KILL_GRACE_S",
    "Drain",
]

logger = logging.getLogger("eventbus")

#: after the forwarded signal, SIGKILL for those still alive
KILL_GRACE_S = 5.0


class Drain:
    """One agent's drain: its signals, its state, its deadline and what it says at the end.

    ``grace_s``: the workers' time to stop; ``exit_code``: the job's code when drained;
    ``node``: this agent's group rank (set at each rendezvous); ``on_begin(drain)``: called
    on the drain thread when a signal starts a drain here (the agent publishes
    ``PREEMPTING``)."""

    def __init__(self, *, signals_: Iterable[str] = DEFAULT_DRAIN_SIGNALS,
                 grace_s: float = DEFAULT_DRAIN_GRACE_S,
                 exit_code: int = DEFAULT_DRAIN_EXIT_CODE,
                 kill_grace_s: float = KILL_GRACE_S,
                 on_begin: Callable[[Drain], object] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 window_s: float = DEFAULT_SIGNAL_WINDOW_S) -> None:
        self.signal_names = tuple(signals_)
        self.grace_s = float(grace_s)
        self.exit_code = int(exit_code)
        self.kill_grace_s = float(kill_grace_s)
        self.on_begin = on_begin
        self.clock = clock
        #: copies of the signal within this many seconds of the start are one drain
        self.window_s = float(window_s)
        #: ``fit(signal name, grace) -> grace``: the grace a local drain gets (SLURM's
        #: limits, drain/slurm.py); None: ``grace_s``
        self.fit: Callable[[str, float], float] | None = None
        self.node: int | None = None
        #: set when a drain started: (signal name, node that got it, this node got it)
        self.signal: str | None = None
        self.origin: int | None = None
        self.local = False
        self.started: float | None = None
        self.deadline: float | None = None
        #: the deadline moved to now by a second signal
        self.escalated = False
        #: when the first real drain signal reached this agent (None: none yet, or the
        #: drain came from another node); a drain that an ask or the time limit started
        #: takes the scheduler's first signal after it as that signal, not a second one
        self.first_signal_at: float | None = None
        #: the drain was started by an ask or the time limit
        self.origin_asked = False
        #: when the signal was forwarded to the workers still running (the deadline)
        self.forwarded_at: float | None = None
        #: ranks still running at the deadline (they did not stop in time), all nodes' as
        #: far as this agent knows
        self.late_ranks: set[int] = set()
        #: ranks that ended with a non-zero code by themselves during the drain
        self.failed_ranks: dict[int, int] = {}
        #: when this node's last worker ended
        self.ended_at: float | None = None
        #: the agreed stop step, when known (the store's key, read by the agent)
        self.stop_step: int | None = None
        self._lock = threading.Lock()
        self._installed: dict[int, Any] = {}
        self._pipe: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None

    # -- state ---------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        return self.started is not None

    def begin(self, signal_name: str, *, origin: int | None, local: bool,
              deadline_s: float | None = None, asked: bool = False) -> bool:
        """Start the drain (True), or, during one, take a second local signal as "now"
        (False). ``deadline_s``: the time left, for a drain another node started;
        ``asked``: a worker's ask or the time limit, which starts a drain but never
        escalates one. A local signal within :attr:`window_s` of the start is a copy of
        the one that started it (of the first real signal, where an ask or the time limit
        started the drain: the scheduler's own warning after it is not a second signal)."""
        grace = self.grace_s
        if local and deadline_s is None and self.fit is not None and self.started is None:
            try:
                grace = self.fit(signal_name, self.grace_s)
            except Exception:
                logger.exception("eventbus: fitting the drain's grace failed; %g s",
                                 self.grace_s)
        with self._lock:
            now = self.clock()
            if self.started is not None:
                if asked or not local:
                    return False
                if self.first_signal_at is None and self.origin_asked:
                    self.first_signal_at = now  # the scheduler's first signal
                    return False
                first = self.first_signal_at if self.first_signal_at is not None \
                    else self.started
                if now - first <= self.window_s:
                    return False  # the same signal, another copy of it
                if not self.escalated:
                    self.escalated = True
                    self.deadline = min(self.deadline or now, now)
                    logger.warning("eventbus: %s again during the drain: the workers still "
                                   "running get it now", signal_name)
                return False
            self.signal, self.origin, self.local = signal_name, origin, local
            self.started = now
            self.origin_asked = asked
            self.first_signal_at = now if local and not asked else None
            self.deadline = now + (grace if deadline_s is None
                                   else max(0.0, float(deadline_s)))
        if local and self.on_begin is not None:
            try:
                self.on_begin(self)
            except Exception:
                logger.exception("eventbus: telling the job about the drain failed; this "
                                 "node drains alone")
        return True

    def due(self) -> bool:
        """The deadline has passed (the workers still running get the signal)."""
        return self.deadline is not None and self.clock() >= self.deadline

    def seconds_left(self) -> float:
        return 0.0 if self.deadline is None else max(0.0, self.deadline - self.clock())

    @property
    def signum(self) -> int:
        value = getattr(signals, self.signal or "SIGTERM", signals.SIGTERM)
        return int(value)

    def reason(self) -> str:
        where = f"node {self.origin}" if self.origin is not None else "this node"
        return f"{self.signal or 'a drain signal'} on {where}"

    # -- what it says --------------------------------------------------------------------
    def facts(self) -> dict[str, Any]:
        """``AGENT_EXIT.data["drain"]``: the drain as facts."""
        used = None
        if self.started is not None:
            end = self.forwarded_at or self.ended_at or self.clock()
            used = round(max(0.0, end - self.started), 3)
        return {"signal": self.signal, "node": self.origin, "grace_s": self.grace_s,
                "used_s": used, "stop_step": self.stop_step,
                "late_ranks": sorted(self.late_ranks),
                "failed_ranks": {str(r): c for r, c in sorted(self.failed_ranks.items())},
                "escalated": self.escalated}

    def summary_line(self) -> str:
        """The one ``eventbus:`` line (without the prefix) of how the drain went: which
        signal on which node, the stop step, the grace used, who did not stop in time."""
        facts = self.facts()
        stop = facts["stop_step"]
        late = facts["late_ranks"]
        failed = {int(r): c for r, c in facts["failed_ranks"].items()}
        if stop is None:
            step = "no stop step was agreed"
        elif late or failed:
            step = f"the other ranks stopped at step {stop}"
        else:
            step = f"every rank stopped at step {stop}"
        used = facts["used_s"]
        grace = (f"{used:.1f} s of the {self.grace_s:g} s grace used" if used is not None
                 else f"grace {self.grace_s:g} s")
        if self.escalated:
            grace += ", cut short by a second signal"
        tail = ""
        signalled = sorted(r for r, c in failed.items() if c == -self.signum)
        failed = {r: c for r, c in failed.items() if c != -self.signum}
        if signalled:
            tail += (f"; rank{'s' if len(signalled) > 1 else ''} "
                     f"{', '.join(map(str, signalled))} ended on {self.signal} at once (the "
                     "script does not act on drains)")
        if failed:
            tail += "; " + ", ".join(f"rank {r} ended with exit code {c}"
                                     for r, c in sorted(failed.items()))
        if late:
            tail += (f"; rank{'s' if len(late) > 1 else ''} {', '.join(map(str, late))} did "
                     f"not stop in time ({self.signal}, then SIGKILL)")
        return (f"{self.reason()}: the job drained ({step}; {grace}){tail}; exit code "
                f"{self.exit_code}")

    # -- signals -------------------------------------------------------------------------
    def install(self) -> bool:
        """Catch the drain signals (main thread only; True if installed). Idempotent, and
        again after torch's process context installed its own (``_start_workers``)."""
        if not self.signal_names or threading.current_thread() is not threading.main_thread():
            return False
        if self._pipe is None:
            read_fd, write_fd = os.pipe()
            os.set_blocking(write_fd, False)
            self._pipe = (read_fd, write_fd)
            self._thread = threading.Thread(target=self._listen, daemon=True,
                                            name="eventbus-drain-signals")
            self._thread.start()
        for index, name in enumerate(self.signal_names):
            for signum in (int(getattr(signals, name)), ask_signal(index)):
                if signum is None:
                    continue
                previous = signals.signal(signum, self._handle)
                if signum not in self._installed:
                    self._installed[signum] = previous
        return True

    def _handle(self, signum: int, frame: Any) -> None:
        pipe = self._pipe
        if pipe is not None:
            with contextlib.suppress(OSError):
                os.write(pipe[1], bytes([signum & 0xFF]))

    def _listen(self) -> None:
        pipe = self._pipe
        assert pipe is not None
        while True:
            try:
                data = os.read(pipe[0], 64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum == 0:
                    return
                asked = asked_signal(signum, self.signal_names)
                if asked is not None:  # a worker caught this drain signal and asks
                    self.begin(asked, origin=self.node, local=True, asked=True)
                    continue
                try:
                    name = signals.Signals(signum).name
                except ValueError:
                    name = f"signal {signum}"
                self.begin(name, origin=self.node, local=True)

    def uninstall(self) -> None:
        """Give the signals back to what handled them before; end the listening thread."""
        if threading.current_thread() is threading.main_thread():
            for signum, previous in self._installed.items():
                with contextlib.suppress(Exception):
                    signals.signal(signum, previous if previous is not None
                                   else signals.SIG_DFL)
        self._installed.clear()
        pipe, self._pipe = self._pipe, None
        if pipe is not None:
            with contextlib.suppress(OSError):
                os.write(pipe[1], b"\x00")
            if self._thread is not None:
                self._thread.join(1.0)
            for fd in pipe:
                with contextlib.suppress(OSError):
                    os.close(fd)
