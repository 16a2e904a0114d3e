"""What a rendezvous forms, as the agent keeps it: the attempt the new worker group is,
numbered the same on every node, and what the agent's plugins get after it
(:class:`~eventbus.app.plugins.RendezvousInfo`).

The attempt: torch's restart count is a node's own. After a restart that another node
decided, this node's group re-forms without counting one, and its workers' events, store
queues and the judge's heartbeats would be filed under another attempt than the other
nodes'. Where torch's rendezvous numbers its rounds (the c10d backend), the round read
after the rendezvous is the attempt (:func:`membership.job_round`); before the rendezvous
it is predicted as one more than now. Elsewhere (the static backend) torch's restart
count is the attempt.

Torch-free to import: the rendezvous handler and the worker group are read by their
attributes.
"""

from __future__ import annotations

import gc
from typing import Any

from eventbus.app.launcher.recovery import membership
from eventbus.app.plugins import RendezvousInfo
from eventbus.bus import Bus

__all__ = ["Formation", "find_tcp_store", "rendezvous_info"]


class Formation:
    """The attempt each rendezvous forms, job-wide (see the module docstring)."""

    def __init__(self) -> None:
        #: the attempt the current worker group belongs to (0 before the first rendezvous)
        self.attempt = 0
        #: whether a group formed yet, and whether the rendezvous numbers its rounds
        self.formed = False
        self.rounds = False
        self._heap_frozen = False

    def next_attempt(self, *, max_restarts: int, remaining_restarts: int) -> int:
        """The attempt the group about to form will be: one more than now where the
        rendezvous numbers its rounds (read again after it: :meth:`formed_as`), else
        torch's restart count (``max_restarts`` less the restarts left)."""
        if self.rounds:
            return self.attempt + 1
        return int(max_restarts - remaining_restarts)

    def formed_as(self, handler: Any, *, predicted: int) -> bool:
        """After a rendezvous of ``handler``: the group's attempt is the rendezvous round
        (or ``predicted`` where there are no rounds). True when rounds went by without
        this node (a group formed before, and this one is not the predicted attempt)."""
        round_ = membership.job_round(handler)
        self.rounds = round_ is not None
        self.attempt = round_ if round_ is not None else predicted
        skipped = self.formed and self.attempt != predicted
        self.formed = True
        return skipped

    def freeze_heap(self) -> None:
        """Once, after the first rendezvous: move the agent's heap so far (torch, the
        rendezvous, the plugins: it lives as long as the agent) out of the collector's
        reach. Every full collection then scans only what came later; without it, the
        collections the workers' event stream triggers scan torch's heap each time
        (measured on the 4-worker flood of benchmarks/bench_store.py: about 1 s of
        collections, pauses up to 0.3 s, against 0.05 s and 9 ms)."""
        if self._heap_frozen:
            return
        self._heap_frozen = True
        gc.freeze()


def find_tcp_store(store: Any) -> Any:
    """The TCPStore under a chain of PrefixStores (the first with a host and a port), or
    None."""
    seen = 0
    while store is not None and seen < 16:
        if hasattr(store, "port") and hasattr(store, "host"):
            return store
        store = getattr(store, "underlying_store", None)
        seen += 1
    return None


def rendezvous_info(worker_group: Any, *, attempt: int, bus: Bus) -> RendezvousInfo:
    """What plugins get after a rendezvous of ``worker_group`` (see
    :class:`~eventbus.app.plugins.RendezvousInfo`)."""
    wg = worker_group
    handler = wg.spec.rdzv_handler
    # The handler's own store is the long-lived one: the c10d backend's store at the
    # rendezvous endpoint, or the static backend's store; its port is the real one even
    # when the endpoint asked for port 0.
    tcp = find_tcp_store(getattr(handler, "_store", None)) or find_tcp_store(wg.store)
    if tcp is None:
        raise RuntimeError(
            f"the {handler.get_backend()} rendezvous has no TCPStore the agent can find; "
            "agent plugins need the c10d or static rendezvous backend")
    return RendezvousInfo(
        store_host=str(tcp.host), store_port=int(tcp.port),
        run_id=handler.get_run_id(), group_rank=int(wg.group_rank or 0),
        group_world_size=int(wg.group_world_size or 1), restart_count=attempt,
        local_world_size=int(wg.spec.local_world_size),
        world_size=int(wg.workers[0].world_size) if wg.workers else 0,
        global_ranks=tuple(w.global_rank for w in wg.workers), bus=bus,
        master_addr=wg.master_addr,
        master_port=int(wg.master_port) if wg.master_port is not None else None,
    )
