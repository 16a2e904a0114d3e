"""The workers' store of each attempt, hosted by the agent before the workers start.

Without a shared store (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, which ``eventbus run``
sets: docs/run.md, "Restarts that work"), torch's worker of global rank 0 starts the
attempt's ``TCPStore`` server inside ``init_process_group``, and every other rank connects
to it. A rank that comes first finds nothing listening and its client backs off, for
seconds, before it tries again: on a restart on warm spares, every rank reaches
``init_process_group`` within milliseconds of the others, and the order is luck.

So the agent of group rank 0 starts that server itself, on the address and port the
rendezvous chose for the attempt, before it starts the workers, and tells every worker
(``TORCHELASTIC_USE_AGENT_STORE=True``, torch's own variable) that the store is there:
each rank then connects as a client, to a server already listening. Every attempt gets a
new server on its own port, the last one's closed (its workers are gone): no key of a dead
attempt is ever read. Where the server cannot be started (the port was taken since the
rendezvous chose it), the workers start as before and rank 0 hosts it.

Every node must tell its workers the same thing: the decision follows from the variable
alone, which ``eventbus run`` sets alike on every node.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

__all__ = ["SHARE_ENV", "WorkerStore"]

logger = logging.getLogger("eventbus")

#: torch reads it where it builds the workers' environment (the rendezvous handler's
#: ``use_agent_store``): "1" means each attempt's rank 0 hosts the workers' store
SHARE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


class WorkerStore:
    """The workers' store of this agent's attempts (see the module docstring)."""

    def __init__(self, *, enabled: bool = True, timeout_s: float = 900.0) -> None:
        self.enabled = enabled
        if enabled and os.environ.setdefault(SHARE_ENV, "1") != "1":
            logger.warning(
                "%s=%s is set: restarts share the rendezvous store with the dead "
                "attempt's process-group keys and may fail (pytorch/pytorch#135712)",
                SHARE_ENV, os.environ[SHARE_ENV])
        self.timeout_s = timeout_s
        self._server: Any = None
        #: the (address, port) of the server now hosted, if any
        self.hosted: tuple[str, int] | None = None

    @contextlib.contextmanager
    def hosting(self, worker_group: Any) -> Iterator[bool]:
        """While torch starts ``worker_group``'s workers: on group rank 0, the attempt's
        store started first; on every node, the workers told to connect to it. Yields
        whether they are. Nothing where torch shares its own store already."""
        if not self.enabled or os.environ.get(SHARE_ENV) != "1":
            yield False
            return
        self.close()
        port = worker_group.master_port
        if worker_group.group_rank in (0, None) and port:
            try:
                from torch.distributed import TCPStore  # type: ignore[attr-defined]

                self._server = TCPStore(
                    host_name=str(worker_group.master_addr), port=int(port),
                    is_master=True, wait_for_workers=False,
                    timeout=timedelta(seconds=self.timeout_s))
            except Exception as exc:  # the port was taken: rank 0 hosts it, as before
                logger.warning("eventbus: the workers' store of this attempt could not be "
                               "started on port %s (%s); its rank 0 starts it", port, exc)
                yield False
                return
            self.hosted = (str(worker_group.master_addr), int(port))
        # torch's handler reads the variable as it builds the workers' environment
        os.environ[SHARE_ENV] = "0"
        try:
            yield True
        finally:
            os.environ[SHARE_ENV] = "1"

    def close(self) -> None:
        """Stop the server hosted for the last attempt (its workers are gone)."""
        server, self._server, self.hosted = self._server, None, None
        del server
