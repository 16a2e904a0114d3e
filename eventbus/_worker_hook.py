"""Called at the end of ``import eventbus``: attach the store forwarder in workers that
``eventbus run`` started. Must stay cheap (and torch-free) everywhere else."""

from __future__ import annotations

import os

__all__ = ["WORKER_ENV", "attach_worker_forwarder"]

#: set by the launcher in each worker's environment; absent everywhere else
WORKER_ENV = "EVENTBUS_AGENT_STORE"


def attach_worker_forwarder() -> None:
    """Attach the forwarder when this process is a worker of ``eventbus run``."""
    if not os.environ.get(WORKER_ENV):
        return
    # Implemented by subscribers.store_forwarder (the store transport).
