"""The drain under SLURM, as one agent runs it: the grace fitted to SLURM's limits, the
drain ahead of the time limit, and the requeue at the end (the rules are
:mod:`~eventbus.app.launcher.slurm.control`'s).

Outside SLURM (no ``SLURM_JOB_ID``, or no ``scontrol``) it does nothing. Under SLURM a
thread reads ``KillWait`` and the job's end time once at the start (the drain must not
wait for a command when the signal comes), and, where the job has an end time, starts
the drain :func:`~eventbus.app.launcher.slurm.control.needed_s` before it: the reason is
"the time limit", and it is never a second signal.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Sequence
from typing import Any

from eventbus.app.launcher.cli import console
from eventbus.app.launcher.drain.state import Drain
from eventbus.app.launcher.slurm.control import Slurm
from eventbus.app.launcher.slurm.control import drain_at
from eventbus.app.launcher.slurm.control import fit_grace
from eventbus.app.launcher.slurm.control import needed_s
from eventbus.app.launcher.slurm.control import requeue_after
from eventbus.app.launcher.slurm.environment import node_name

__all__ = ["TIME_LIMIT", "SlurmDrain", "requeue_after_job"]

logger = logging.getLogger("eventbus")

#: the drain's "signal" when the time limit starts it (its workers get SIGTERM at the end)
TIME_LIMIT = "the time limit"
#: how often the end time is read again while the job runs (``scontrol update`` may move it)
REREAD_S = 300.0


class SlurmDrain:
    """One agent's drain under SLURM (see the module's docstring)."""

    def __init__(self, drain: Drain, *, requeue: str = "auto",
                 slurm: Slurm | None = None) -> None:
        self.drain = drain
        self.requeue_mode = requeue
        self.slurm = slurm if slurm is not None else Slurm()
        self.kill_wait_s: float | None = None
        self.end_time: float | None = None
        self._done = threading.Event()
        self._read = threading.Event()
        self._thread: threading.Thread | None = None
        self._said = False

    def start(self) -> None:
        """Under SLURM: the grace fitted at each drain; the limits read and the time limit
        watched on a thread of its own."""
        if self._thread is not None or not self.slurm.present():
            return
        self.drain.fit = self.fit
        self._thread = threading.Thread(target=self._watch, daemon=True,
                                        name="eventbus-slurm-limit")
        self._thread.start()

    def _watch(self) -> None:
        self.kill_wait_s = self.slurm.kill_wait()
        while not self._done.is_set():
            self.end_time = self.slurm.end_time()
            self._read.set()
            if self.end_time is None:
                return  # no time limit: nothing to watch
            at = drain_at(self.end_time, self.drain.grace_s, self.drain.kill_grace_s)
            wait = at - self.slurm.clock()
            if wait <= 0:
                self.drain.begin(TIME_LIMIT, origin=self.drain.node, local=True, asked=True)
                return
            if self._done.wait(min(wait, REREAD_S)):
                return

    def fit(self, signal_name: str, grace_s: float) -> float:
        """The grace of a drain on ``signal_name`` (the drain thread calls it)."""
        self._read.wait(0.1)  # a signal at the very start: the limits may still come
        to_end = (self.end_time - self.slurm.clock()) if self.end_time is not None else None
        fitted, line = fit_grace(grace_s, signal_name, kill_grace_s=self.drain.kill_grace_s,
                                 kill_wait_s=self.kill_wait_s, seconds_to_end=to_end)
        if line is not None and not self._said:
            self._said = True
            console.write(line)
        return fitted

    def needed_s(self) -> float:
        return needed_s(self.drain.grace_s, self.drain.kill_grace_s)

    def after(self, *, announced: bool, bad_host: str | None) -> None:
        """The agent's end: requeue the job where the rules say, in one line."""
        self._done.set()
        try:
            line = requeue_after(self.slurm, drained=self.drain.active, announced=announced,
                                 bad_host=bad_host, mode=self.requeue_mode,
                                 stop_step=self.drain.stop_step)
        except Exception:
            logger.exception("eventbus: the requeue failed")
            return
        if line is not None:
            console.write(line)

    def close(self) -> None:
        self._done.set()


def requeue_after_job(agents: Sequence[Any]) -> None:
    """Under SLURM, at the end of ``eventbus run``: the requeue of a drained or evicted
    job, by the agent (an ``EventAgent``) that announced the drain or whose host was
    evicted. SLURM's requeue signals every process of the job, this one too: from here on
    the drain signals are ignored."""
    chosen = [agent for agent in agents if agent.evicted or (
        agent.drain.active and agent.draining.announced)]
    if not chosen:
        return
    agent = chosen[0]
    for name in agent.drain.signal_names:
        with contextlib.suppress(Exception):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    host = (node_name() or agent.eviction.host) if agent.evicted else None
    agent.slurm_drain.after(announced=agent.draining.announced, bad_host=host)
