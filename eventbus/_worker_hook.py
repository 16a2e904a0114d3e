"""Called at the end of ``import eventbus``: attach the store forwarder in workers that
``eventbus run`` started. Must stay cheap (and torch-free) everywhere else."""

from __future__ import annotations

import os

from eventbus.wire import ENV_STORE

__all__ = ["WORKER_ENV", "attach_worker_forwarder"]

#: set by the launcher in each worker's environment; absent everywhere else
WORKER_ENV = ENV_STORE


def attach_worker_forwarder() -> None:
    """Attach the forwarder when this process is a worker of ``eventbus run``.

    Without ``EVENTBUS_AGENT_STORE`` this is one dict lookup. With it, the forwarder (and
    torch) are imported and every event of the default bus is shipped to the agent. A
    failure here never breaks ``import eventbus``: it is reported on the ``eventbus``
    logger and the worker's events stay local.
    """
    if not os.environ.get(WORKER_ENV):
        return
    try:
        from subscribers.store_forwarder import attach_from_env

        attach_from_env()
    except Exception:
        import logging  # here: `import eventbus` does not load logging

        logging.getLogger("eventbus").exception(
            "eventbus: attaching the store forwarder failed; this worker's events stay local")
