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
import time
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

from eventbus.app.launcher.cli import console
from eventbus.app.launcher.drain.notices import NoticeBoard
from eventbus.app.launcher.drain.state import Drain
from eventbus.app.launcher.slurm.control import EXIT_MARGIN_S
from eventbus.app.launcher.slurm.control import Slurm
from eventbus.app.launcher.slurm.control import drain_at
from eventbus.app.launcher.slurm.control import fit_grace
from eventbus.app.launcher.slurm.control import needed_s
from eventbus.app.launcher.slurm.control import requeue_after
from eventbus.app.launcher.slurm.environment import node_name

__all__ = ["TIME_LIMIT", "SlurmDrain", "requeue_after_job", "wait_for_drains"]

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

    def after(self, *, announced: bool, bad_host: str | None,
              before_requeue: Callable[[], object] | None = None) -> None:
        """The agent's end: requeue the job where the rules say, in one line."""
        self._done.set()
        try:
            line = requeue_after(self.slurm, drained=self.drain.active, announced=announced,
                                 bad_host=bad_host, mode=self.requeue_mode,
                                 stop_step=self.drain.stop_step,
                                 before_requeue=before_requeue)
        except Exception:
            logger.exception("eventbus: the requeue failed")
            return
        if line is not None:
            console.write(line)

    def close(self) -> None:
        self._done.set()


def requeue_after_job(agents: Sequence[Any]) -> None:
    """Under SLURM, at the end of ``eventbus run``: each drained agent records that its
    drain ended; then the requeue of a drained or evicted job, by the agent (an
    ``EventAgent``) that announced the drain or whose host was evicted, a drained job's
    once every node's drain ended. SLURM's requeue signals every process of the job, this
    one and the other nodes' agents still exiting too: from here on the drain signals are
    ignored by each."""
    chosen = [agent for agent in agents if agent.evicted or (
        agent.drain.active and agent.draining.announced)]
    ended = [agent for agent in agents
             if agent.drain.active and agent.slurm_drain.slurm.present()]
    for agent in chosen[:1] + ended:  # the requeue's SIGTERM must not kill this exit
        for name in agent.drain.signal_names:
            with contextlib.suppress(Exception):
                signal.signal(getattr(signal, name), signal.SIG_IGN)
    for agent in ended:
        board = _board(agent)
        if board is not None:
            board.drain_ended()
    if not chosen:
        return
    agent = chosen[0]
    host = (node_name() or agent.eviction.host) if agent.evicted else None
    board = _board(agent)
    wait: Callable[[], object] | None = None
    if board is not None and board.info is not None and agent.drain.active:
        nodes = board.info.group_world_size
        drain = agent.drain
        left = (drain.deadline - drain.clock()) if drain.deadline is not None else 0.0
        bound = max(left, 0.0) + drain.kill_grace_s + EXIT_MARGIN_S

        def wait() -> None:
            line = wait_for_drains(board.drains_ended, nodes, bound)
            if line is not None:
                console.write(line)

    agent.slurm_drain.after(announced=agent.draining.announced, bad_host=host,
                            before_requeue=wait)


def _board(agent: Any) -> NoticeBoard | None:
    return next((p for p in getattr(agent, "plugins", ()) if isinstance(p, NoticeBoard)),
                None)


def wait_for_drains(ended: Callable[[], int | None], nodes: int, bound_s: float, *,
                    clock: Callable[[], float] = time.monotonic,
                    sleep: Callable[[float], object] = time.sleep,
                    poll_s: float = 0.1) -> str | None:
    """Wait until ``ended()`` (the nodes whose drain ended) reaches ``nodes``, at most
    ``bound_s`` seconds. ``ended()`` None: the store is gone, so the agent that hosted it
    ended, and with it the wait. The ``eventbus:`` line (without the prefix) when the
    bound passed first, else None."""
    deadline = clock() + bound_s
    count = ended()
    while count is not None and count < nodes:
        if clock() >= deadline:
            return (f"{nodes - count} of {nodes} nodes had not ended their drain within "
                    f"{bound_s:.0f} s of this one's end: the job is requeued all the same")
        sleep(poll_s)
        count = ended()
    return None
