"""The job-wide STOP as the agent uses it: the key watched once the group has several
nodes, another node's STOP acted on (this node's workers stopped, no restart), this
node's STOP announced to the others, and the acknowledgements waited for at the end.

Why a module of its own: :mod:`~eventbus.app.launcher.drain.stop_signal` is the key in the
store; the agent meets it at four moments (each rendezvous, each monitor tick, each
decision, its end), which this object keeps in one place, apart from the torch hooks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from eventbus.app.launcher.cli import console
from eventbus.app.launcher.decisions.decider import Decider
from eventbus.app.launcher.drain.stop_signal import StopSignal
from eventbus.app.plugins import RendezvousInfo
from eventbus.events import Cause

if TYPE_CHECKING:
    from torch.distributed.elastic.agent.server.api import RunResult

    from eventbus.app.launcher.group.workers import Workers

__all__ = ["RemoteStop"]

logger = logging.getLogger("eventbus")


class RemoteStop:
    """This agent's side of the job-wide STOP key (none with one node)."""

    def __init__(self) -> None:
        self._signal: StopSignal | None = None
        #: the attempt the last rendezvous formed (the one a restart ends)
        self._attempt: int | None = None

    def remote(self) -> str | None:
        """The reason of a STOP another node announced, or None."""
        return self._signal.remote if self._signal is not None else None

    def watch(self, info: Callable[[], RendezvousInfo], group_world_size: int) -> None:
        """After a rendezvous: watch the key, once, when the group has several nodes (the
        group's ranks kept up to date at each rendezvous after that)."""
        if self._signal is not None:
            try:
                rdzv = info()
            except Exception:
                logger.exception("eventbus: the job-wide STOP keeps the last group's ranks")
                self._attempt = None
                return
            self._signal.group_rank = rdzv.group_rank
            self._signal.group_world_size = rdzv.group_world_size
            self._attempt = rdzv.restart_count
            return
        if group_world_size < 2:
            return
        try:
            rdzv = info()
            self._attempt = rdzv.restart_count
            self._signal = StopSignal(host=rdzv.store_host, port=rdzv.store_port,
                                      run_id=rdzv.run_id, group_rank=rdzv.group_rank,
                                      group_world_size=rdzv.group_world_size)
            self._signal.start()
        except Exception:
            logger.exception("eventbus: no job-wide STOP watch; a STOP on another node "
                             "ends this one only when its workers lose their peers")

    def stop_workers(self, decider: Decider, workers: Workers) -> RunResult:
        """Another node's reactor stopped the job (:meth:`remote`): its console line, the
        first time, and this node's workers stopped; the FAILED result returned (the
        caller uses no restart)."""
        line = decider.stop_for_remote()
        if line is not None:
            console.write(line)
        return workers.stop({rank: (local, pid) for rank, local, pid in workers.procs()},
                            cause=str(Cause.REMOTE_STOP), why="STOP on another node")

    def before_restart(self) -> str | None:
        """About to restart: another node's STOP, set while this node's workers lost their
        peers to it (waited for a moment, less when every other node decided to restart
        the same attempt: stop_signal.py), or None."""
        if self._signal is None:
            return None
        return self._signal.wait_remote(attempt=self._attempt)

    def announce(self, reason: str) -> None:
        """This node's STOP: the other nodes hear it."""
        if self._signal is not None:
            self._signal.announce(reason)

    def close(self) -> None:
        """The agent's end: the others' acknowledgements waited for after a STOP of ours
        (our process may host the store), the watch ended."""
        if self._signal is not None:
            if self._signal.announced:
                self._signal.wait_for_acks()
            self._signal.close()
