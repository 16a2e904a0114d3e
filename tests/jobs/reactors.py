"""Reactors the end-to-end tests name with ``--reactor tests.jobs.reactors:ATTR``."""

from __future__ import annotations

from eventbus import Decision
from eventbus import WorkerExit
from eventbus.subscribers.reactors import NonRetriableExitCodes
from eventbus.subscribers.reactors import StopOnNonFiniteLoss


def always_restart(event: WorkerExit) -> Decision:
    """Restart on every failure (while --max-restarts allows)."""
    return Decision.RESTART


#: exit code 3 means "this will never work": stop at once
exit_3_is_fatal = NonRetriableExitCodes({3})


def broken(event: WorkerExit) -> Decision:
    """A reactor with a bug: it raises, which must count as no decision."""
    raise RuntimeError("reactor bug")


#: a worker that reported a NaN loss before failing will fail again: stop
stop_on_nan = StopOnNonFiniteLoss()


def stop_on_stall(event: object) -> Decision | None:
    """STOP when a worker stalls; no decision on other failures."""
    if getattr(event, "type", None) == "WORKER_STALLED":
        return Decision.STOP
    return None


def oom_is_fatal(event: object) -> Decision | None:
    """The README's reactor: stop on out-of-memory errors, no opinion otherwise."""
    if "out of memory" in (getattr(event, "message", None) or ""):
        return Decision.STOP
    return None


def answers_stop_as_text(event: object) -> object:
    """A reactor that returns the string "stop": not an answer (no decision)."""
    return "stop"


def restart_on_data(event: object) -> Decision | None:
    """RESTART when a rank is reported waiting for data (a report alone restarts
    nothing); no decision on other failures."""
    data = getattr(event, "data", None) or {}
    if getattr(event, "type", None) == "WORKER_STALLED" and data.get("waiting_on") == "data":
        return Decision.RESTART
    return None
