"""The demo's restart reactor: ``--reactor examples.reactor:restart_on_crash``.

A reactor is a callable ``(WorkerExit) -> Decision | None`` that the agent consults on each
failed worker, before torchelastic's own policy. This one restarts the group after a crash,
but stops the job at once when a worker exits with code 2 (bad arguments never heal by
restarting), whatever ``--max-restarts`` says.
"""

from __future__ import annotations

import logging

from eventbus import Decision
from eventbus import WorkerExit

__all__ = ["restart_on_crash"]

logger = logging.getLogger("examples.reactor")

#: exit codes that no restart can fix
FATAL_EXIT_CODES = frozenset({2})


def restart_on_crash(event: WorkerExit) -> Decision | None:
    """RESTART after a worker crash; STOP on a usage error; no opinion on a worker the agent
    stopped itself (it is collateral of another worker's failure)."""
    if event.data.get("stopped_by_agent"):
        return None
    if event.exit_code in FATAL_EXIT_CODES:
        logger.error("rank %d exited with %d (usage error): stopping the job",
                     event.worker_id, event.exit_code)
        return Decision.STOP
    logger.warning("rank %d crashed (exit %d): restarting the worker group",
                   event.worker_id, event.exit_code)
    return Decision.RESTART
