"""Nodes lost: a node of the last round that is in none of the new round's lists, and
did not say why it left.

A node that dies at once (a kernel panic, a power cut, SLURM's node failure) never writes
its own outcome: its agent dies with it. The survivors' workers fail on the lost peer (a
collective's timeout), their agents restart, and torch's rendezvous forms again without
it once its keep-alive has expired. The round that follows is where the loss shows: a
participant of the last round that is neither a participant of the new one nor waiting
(torch's wait and redundancy lists: a node left out at a re-form is alive) and did not
announce its eviction (``HOST_EVICTED``) left without a word.

Each agent writes its own host name into each round's store, under its rendezvous node
id (``addr_pid_localid``), so that the next round can name a participant that is gone by
the name it reported (``SLURMD_NODENAME`` under SLURM), not by its address. The new round's
group rank 0 says it on the console, the agent's ``RENDEZVOUS`` event carries it in
``data["lost"]``, and the ledger gets the lost node's row of the last attempt with a
``lost`` fault (docs/hosts.md).

Reads torch's rendezvous state, which is private (as membership.py does): where the
handler is not torch's dynamic one, nothing is found lost. Torch-free to import.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any

__all__ = ["KEY", "LostNodes"]

logger = logging.getLogger(__name__)

#: the store key of a rendezvous node's host name, under each round's store
KEY = "eventbus/roster/"


def _state(handler: Any) -> Any:
    return getattr(getattr(handler, "_state_holder", None), "state", None)


def _ids(nodes: Any) -> set[str]:
    try:
        return {repr(node) for node in nodes}
    except TypeError:
        return set()


class LostNodes:
    """The nodes each round lost (see the module docstring), from this agent's view."""

    def __init__(self, host: str) -> None:
        self.host = host
        #: the last round: its participants' ids and its store
        self._last: tuple[set[str], Any] | None = None

    def formed(self, handler: Any, store: Any, *, gone_by_word: Collection[str] = ()
               ) -> list[str]:
        """After a rendezvous of ``handler`` whose round's store is ``store``: write this
        node's name, and return the host names of the last round's participants lost
        (``gone_by_word``: hosts that said why they left, an eviction)."""
        state = _state(handler)
        this = getattr(handler, "_this_node", None)
        if state is None or this is None or store is None:
            return []
        try:
            store.set(KEY + repr(this), self.host)
        except Exception:
            logger.debug("eventbus: the roster's key could not be written", exc_info=True)
        now = _ids(getattr(state, "participants", ()))
        here = (now | _ids(getattr(state, "wait_list", ()))
                | _ids(getattr(state, "redundancy_list", ())))
        last, self._last = self._last, (now, store)
        if last is None:
            return []
        lost = []
        for node in sorted(last[0] - here):
            host = self._name(last[1], node)
            if host != self.host and host not in gone_by_word:
                lost.append(host)
        return lost

    @staticmethod
    def _name(store: Any, node: str) -> str:
        """The host name ``node`` wrote into its round's store, else its address."""
        key = KEY + node
        try:
            if store.check([key]):
                return bytes(store.get(key)).decode()
        except Exception:
            logger.debug("eventbus: the roster's key could not be read", exc_info=True)
        return node.rsplit("_", 2)[0]
