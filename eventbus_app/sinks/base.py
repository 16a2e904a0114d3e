"""What every sink shares: a bounded queue in front of the backend, a bounded close.

A sink is a plain subscriber (``callable(event)``): :class:`EventSink` *is* a
:class:`~eventbus.subscribers.queued.QueuedSink`, so ``record()`` (or the agent's monitor thread)
only appends to a bounded deque and the backend (a file writer, an HTTP exporter, a tracking
server) runs on the queue's own thread. A slow or dead backend costs dropped events, counted
per reason in :meth:`stats` (and so in the bus's ``stats()``) and reported rate-limited on
the ``eventbus`` logger; it never blocks the caller.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any
from typing import ClassVar

from eventbus.events import Event
from eventbus.events import WorkerStalled
from eventbus.subscribers.queued import QueuedSink
from eventbus.subscribers.queued import QueueSettings

__all__ = [
    "SINK_CLOSE_TIMEOUT_S",
    "SINK_QUEUE",
    "EventSink",
    "MissingExtraError",
    "SinkArgumentError",
    "attempt_of",
    "describe",
    "is_stall",
    "numbers_of",
    "rank_of",
    "require_extra",
]

logger = logging.getLogger("eventbus")

#: the default budget of one sink's ``close()``: flush the queue, then shut the backend
SINK_CLOSE_TIMEOUT_S = 5.0

#: the queue every built-in sink sits behind unless given ``settings``: 10 000 events held
#: at most, newest dropped when full, drops reported at most every 10 s
SINK_QUEUE = QueueSettings(max_events=10_000, max_bytes=16 * 1024 * 1024, max_batch=500,
                           flush_interval=0.2, close_timeout=SINK_CLOSE_TIMEOUT_S)


class SinkArgumentError(ValueError):
    """A sink's ``ARG`` is malformed (a port out of range, a URL without a scheme, ...)."""


class MissingExtraError(ImportError):
    """The optional dependency a sink needs is not installed; the message names the fix."""


def require_extra(sink: str, extra: str, *modules: str) -> None:
    """Import ``modules`` or raise :class:`MissingExtraError` naming ``extra``."""
    import importlib

    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise MissingExtraError(
                f"the {sink} sink needs the {extra!r} extra ({exc}): "
                f"pip install 'eventbus[{extra}]'") from exc


def numbers_of(data: dict[str, Any]) -> dict[str, float]:
    """The real numbers of a ``METRIC``'s ``data`` (bools and non-numbers left out)."""
    out: dict[str, float] = {}
    for key, value in data.items():
        cls = value.__class__
        if cls is int or cls is float or (isinstance(value, (int, float))
                                          and not isinstance(value, bool)):
            out[str(key)] = float(value)
    return out


#: the stall event's type name, matched as a string: the type may not be declared (yet)


def is_stall(event: Event) -> bool:
    """Whether ``event`` reports a stalled worker."""
    return isinstance(event, WorkerStalled)


def rank_of(event: Event) -> int | None:
    """The worker rank an event is about: ``worker_id`` for the agent's worker events, the
    recording process's rank otherwise."""
    worker = getattr(event, "worker_id", None)
    if isinstance(worker, int) and not isinstance(worker, bool):
        return worker
    return event.rank


def attempt_of(event: Event) -> int:
    """The attempt an event belongs to (``WORKER_RESTART``: the new attempt)."""
    attempt = getattr(event, "attempt", None) if str(event.type) == "WORKER_RESTART" else None
    if isinstance(attempt, int):
        return attempt
    return event.restart_count or 0


def describe(event: Event, *, decision: str | None = None) -> str:
    """One readable sentence: which rank, what happened, which attempt, what was decided."""
    kind = str(event.type)
    attempt = attempt_of(event)
    if kind == "WORKER_EXIT":
        code = getattr(event, "exit_code", None)
        signal = getattr(event, "signal", None)
        how = f"was killed by {signal}" if signal else f"exited with code {code}"
        text = f"Rank {rank_of(event)} {how} on attempt {attempt}"
        message = getattr(event, "message", None)
        if message:
            text += f" ({str(message).splitlines()[0][:200]})"
    elif isinstance(event, WorkerStalled):
        text = (f"Rank {rank_of(event)} stalled on attempt {attempt}: no event for "
                f"{event.silent_s:.1f} s")
        if event.timeout_s is not None:
            text += f" (stall timeout {event.timeout_s:g} s)"
    elif kind == "WORKER_RESTART":
        left = getattr(event, "restarts_left", None)
        text = f"The agent restarts the worker group as attempt {attempt}"
        if left is not None:
            text += f" ({left} restarts left)"
        reason = getattr(event, "reason", None)
        if reason:
            text += f" after: {reason}"
    elif kind == "AGENT_EXIT":
        text = f"The job ended {getattr(event, 'state', '?')} after attempt {attempt}"
        reason = getattr(event, "reason", None)
        if reason:
            text += f": {reason}"
    else:
        text = f"{kind} from rank {rank_of(event)} on attempt {attempt}"
    if decision:
        text += f"; {decision}"
    run_id = event.run_id
    return f"{text}{'' if text.endswith('.') else '.'}" + (f" [run {run_id}]" if run_id else "")


class EventSink(QueuedSink):
    """Base of the built-in sinks: a :class:`QueuedSink` whose batches go to :meth:`write`.

    Subclasses implement ``write(events)`` (on the queue's thread) and may implement
    ``shutdown()`` (release the backend). :meth:`close` spends at most its ``timeout`` on
    both together: what the queue still holds when the budget runs out is counted as dropped
    ("closed before delivery"), and a backend shutdown still running then is left to its
    daemon thread.
    """

    #: the sink's name on the command line (``--sink NAME:ARG``)
    kind: ClassVar[str] = "sink"

    def __init__(self, *, label: str, settings: QueueSettings | None = None,
                 **options: Any) -> None:
        super().__init__(self._write_batch, name=f"{self.kind}:{label}",
                         settings=settings or SINK_QUEUE, **options)
        self._shut = False

    def _write_batch(self, events: Sequence[Event]) -> None:
        self.write(events)

    def write(self, events: Sequence[Event]) -> None:
        """Hand ``events`` to the backend (runs on the queue's thread)."""
        raise NotImplementedError

    def count_lost(self, reason: str, n: int) -> None:
        """Count ``n`` events the backend lost after the queue handed them over (an
        exporter's failed batch, say), as dropped for ``reason``; callable from any thread."""
        with self._cond:
            self._drop(reason, n)

    def shutdown(self) -> None:
        """Release the backend: flush its own buffers, stop its server (may block)."""

    def close(self, timeout: float | None = None) -> bool:
        """Deliver what is queued and shut the backend, within ``timeout`` in all (default
        the settings' ``close_timeout``). True when everything was delivered in time."""
        budget = self.settings.close_timeout if timeout is None else timeout
        deadline = time.monotonic() + budget
        # Most of the budget for the queue, the rest (at least a fifth) for the backend.
        delivered = super().close(budget * 0.8)
        if self._shut:
            return delivered
        self._shut = True
        done = threading.Event()

        def shut() -> None:
            try:
                self.shutdown()
            except Exception:
                logger.exception("sink %s failed to shut down", self.name)
            else:
                done.set()

        thread = threading.Thread(target=shut, name=f"eventbus-sink-close:{self.name}",
                                  daemon=True)
        thread.start()
        thread.join(max(0.0, deadline - time.monotonic()))
        if not done.is_set():
            logger.warning("sink %s: the backend did not shut down within %.1f s; left behind",
                           self.name, budget)
        return delivered and done.is_set()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} pending={self.pending}>"
