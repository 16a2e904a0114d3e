"""The agents' exit barrier, for a node whose group ended failed.

torch keeps an agent whose worker group SUCCEEDED in an exit barrier until every agent of
the rendezvous round has checked in (``--exit-barrier-timeout``, 300 s by default), so that
a node hosting the store outlives the others. An agent whose group ended FAILED never
checks in: torch returns its result at once. A node whose ranks finished while another
node's failed (a rank that ends early and cleanly, a script whose ranks do not wait for each
other at the end) then sits out the whole timeout for a node that is already gone.

:func:`check_in_failed` is the failed agent's check-in on its way out: it counts itself in
exactly as torch's barrier does (``<prefix>/num_members``; the last member sets
``<prefix>/last_member``), so the nodes waiting for it go on, and waits for nothing itself.
Torch-free: any object with ``add``/``set`` and a timeout (a c10d ``Store``) will do.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Protocol

__all__ = ["TERMINAL_STATE_PREFIX", "check_in_failed"]

logger = logging.getLogger(__name__)

#: torch's key prefix of the agents' exit barrier (``_TERMINAL_STATE_SYNC_ID`` in
#: torch.distributed.elastic.agent.server.api), with the two keys its barrier uses
TERMINAL_STATE_PREFIX = "torchelastic/agent/terminal_state"
_NUM_MEMBERS = "/num_members"
_LAST_MEMBER = "/last_member"


class _BarrierStore(Protocol):
    @property
    def timeout(self) -> timedelta: ...

    def set_timeout(self, timeout: timedelta) -> None: ...

    def add(self, key: str, value: int) -> int: ...

    def set(self, key: str, value: str) -> None: ...


def check_in_failed(store: _BarrierStore | None, world_size: int | None, *,
                    timeout_s: float = 5.0) -> bool:
    """Count this agent in to its round's exit barrier without waiting in it; set the last
    member's key when this agent completes the count. True when the check-in reached the
    store; False (logged, never raised) when there is no store or it is gone: the others
    then wait as torch's barrier would."""
    if store is None or not world_size or world_size < 1:
        return False
    try:
        before = store.timeout
        store.set_timeout(timedelta(seconds=timeout_s))
        try:
            if store.add(TERMINAL_STATE_PREFIX + _NUM_MEMBERS, 1) == world_size:
                store.set(TERMINAL_STATE_PREFIX + _LAST_MEMBER, "<val_ignored>")
        finally:
            store.set_timeout(before)
    except Exception as exc:  # the store's host may be gone already
        logger.info("eventbus: the exit barrier's check-in of a failed node did not reach "
                    "the store: %s: %s", type(exc).__name__, exc)
        return False
    return True
