"""Restart reactors: what to do when a worker of a torchrun job fails.

A reactor is a callable ``(event: WorkerExit) -> Decision | None``. ``eventbus run
--reactor MODULE:ATTR`` (or ``EventAgent(reactors=[...])``) subscribes it to the failed
workers' ``WORKER_EXIT`` on the agent's bus:

* ``Decision.STOP`` from any reactor fails the job at once, restarts left or not;
* ``Decision.RESTART`` restarts the worker group, using one of ``--max-restarts``;
* ``None``: no opinion, torchrun's own policy (restart while restarts are left).

A reactor that also needs to watch other events (the loss, say) defines
``attach(bus)``; the agent calls it once with its bus before the job starts.

The reactors here:

* :class:`NonRetriableExitCodes`: some failures never heal by restarting (bad config,
  missing data, a code bug that exits with a known code): stop at once;
* :class:`RestartBudget`: at most ``max_restarts`` restarts per ``window_s`` seconds, with
  exponential backoff between them: a crash loop stops instead of burning the cluster;
* :class:`StopOnNonFiniteLoss`: a worker reported a NaN/inf loss before the failure:
  restarting from the same checkpoint reproduces it, so stop;
* :class:`StopAfterStalls`: the same rank stalled ``k`` times (``--stall-timeout``): it
  will hang again, stop.

With ``eventbus run --stall-timeout`` reactors are also called with each
``WORKER_STALLED``: the reactors here tell the two apart (``RestartBudget`` counts a stall
restart like a failure restart; the exit-code and loss reactors have no opinion on stalls).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from collections.abc import Iterable
from typing import Any

from eventbus.bus import Bus
from eventbus.bus import Subscription
from eventbus.events import Decision
from eventbus.events import Event
from eventbus.events import EventType
from eventbus.events import WorkerExit
from eventbus.events import WorkerStalled

__all__ = [
    "NonRetriableExitCodes",
    "RestartBudget",
    "StopAfterStalls",
    "StopOnNonFiniteLoss",
    "stop_on_nonfinite_loss",
]


class NonRetriableExitCodes:
    """STOP when a worker exits with one of ``exit_codes`` (or is killed by one of
    ``signals``, e.g. ``{"SIGSEGV"}``); no decision otherwise.

    >>> reactor = NonRetriableExitCodes({3, 4}, signals={"SIGSEGV"})
    """

    def __init__(self, exit_codes: Iterable[int] = (), *,
                 signals: Iterable[str] = ()) -> None:
        codes = frozenset(exit_codes)
        for code in codes:
            if type(code) is not int:
                raise TypeError(f"exit_codes must be ints, got {code!r}")
        names = frozenset(str(s).upper() for s in signals)
        for name in names:
            if not name.startswith("SIG"):
                raise ValueError(f"signals are names like 'SIGSEGV', got {name!r}")
        if not codes and not names:
            raise ValueError("NonRetriableExitCodes needs at least one exit code or signal")
        self.exit_codes = codes
        self.signals = names

    def __call__(self, event: WorkerExit) -> Decision | None:
        if not isinstance(event, WorkerExit):
            return None  # a stall has no exit code
        if event.exit_code in self.exit_codes:
            return Decision.STOP
        if event.signal is not None and event.signal.upper() in self.signals:
            return Decision.STOP
        return None

    def __repr__(self) -> str:
        return (f"NonRetriableExitCodes({sorted(self.exit_codes)}, "
                f"signals={sorted(self.signals)})")


class RestartBudget:
    """RESTART at most ``max_restarts`` times within any ``window_s`` seconds, then STOP.

    Before each RESTART it waits (in the agent's monitor thread, before the group is
    restarted) ``backoff_s * backoff_factor ** (n - 1)`` seconds, capped at
    ``max_backoff_s``, where ``n`` counts the restarts in the current window. Several
    workers failing in the same attempt count as one failure of the group.
    ``--max-restarts`` still caps the total: the budget only ever restarts less. A stall
    (``WORKER_STALLED``) restarts the group too and counts the same.
    """

    def __init__(self, max_restarts: int, window_s: float, *, backoff_s: float = 0.0,
                 backoff_factor: float = 2.0, max_backoff_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if type(max_restarts) is not int or max_restarts < 0:
            raise ValueError(f"max_restarts must be an int >= 0, got {max_restarts!r}")
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0 seconds, got {window_s!r}")
        if backoff_s < 0 or backoff_factor < 1 or max_backoff_s < 0:
            raise ValueError("backoff_s >= 0, backoff_factor >= 1 and max_backoff_s >= 0 "
                             f"are required, got {backoff_s}, {backoff_factor}, "
                             f"{max_backoff_s}")
        self.max_restarts = max_restarts
        self.window_s = float(window_s)
        self.backoff_s = float(backoff_s)
        self.backoff_factor = float(backoff_factor)
        self.max_backoff_s = float(max_backoff_s)
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._restarts: deque[float] = deque()
        #: (run id, attempt) -> the decision already taken for that group failure
        self._decided: dict[tuple[str | None, int | None], Decision] = {}

    def __call__(self, event: WorkerExit) -> Decision:
        key = (event.context.run_id, _attempt(event))
        with self._lock:
            if key in self._decided:
                return self._decided[key]
            now = self._clock()
            while self._restarts and now - self._restarts[0] >= self.window_s:
                self._restarts.popleft()
            if len(self._restarts) >= self.max_restarts:
                self._decided[key] = Decision.STOP
                return Decision.STOP
            self._restarts.append(now)
            n = len(self._restarts)
            self._decided[key] = Decision.RESTART
        delay = self.backoff_delay(n)
        if delay > 0:
            self._sleep(delay)
        return Decision.RESTART

    def backoff_delay(self, n: int) -> float:
        """The wait before the ``n``-th restart of a window (n >= 1)."""
        if self.backoff_s <= 0 or n < 1:
            return 0.0
        return float(min(self.max_backoff_s, self.backoff_s * self.backoff_factor ** (n - 1)))

    def __repr__(self) -> str:
        return (f"RestartBudget({self.max_restarts} per {self.window_s:g}s, "
                f"backoff {self.backoff_s:g}s x{self.backoff_factor:g})")


class StopAfterStalls:
    """STOP when the same rank has stalled ``k`` times (over every attempt of the run);
    no decision before that (the group restarts), and none on failures.

    >>> reactor = StopAfterStalls(2)   # the second stall of a rank ends the job
    """

    def __init__(self, k: int = 2) -> None:
        if type(k) is not int or k < 1:
            raise ValueError(f"k must be an int >= 1, got {k!r}")
        self.k = k
        self._lock = threading.Lock()
        #: (run id, rank) -> stalls seen
        self.stalls: dict[tuple[str | None, int], int] = {}

    def __call__(self, event: Event) -> Decision | None:
        if not isinstance(event, WorkerStalled):
            return None
        key = (event.context.run_id, event.worker_id)
        with self._lock:
            n = self.stalls[key] = self.stalls.get(key, 0) + 1
        return Decision.STOP if n >= self.k else None

    def __repr__(self) -> str:
        return f"StopAfterStalls({self.k})"


def _attempt(event: Event) -> int | None:
    attempt = event.data.get("attempt")
    if type(attempt) is int:
        return attempt
    return event.context.restart_count


class StopOnNonFiniteLoss:
    """STOP when, before a worker failed, some worker reported a NaN or infinite loss.

    It watches ``METRIC``, ``EPOCH_END`` and ``CHECKPOINT_SAVED`` events on the agent's bus
    (workers' events reach it through the store transport) for ``data[key]`` (default
    ``"loss"``), and the failed worker's own ``WORKER_EXIT`` ``data[key]`` and message
    (``FloatingPointError``, "non-finite loss"). No decision when the loss was fine.
    """

    watched = (EventType.METRIC, EventType.EPOCH_END, EventType.CHECKPOINT_SAVED)

    def __init__(self, key: str = "loss") -> None:
        if not isinstance(key, str) or not key:
            raise ValueError(f"key must be a non-empty data key, got {key!r}")
        self.key = key
        self._lock = threading.Lock()
        #: (run id, attempt) -> (rank, value) of the first non-finite loss reported
        self.seen: dict[tuple[str | None, int | None], tuple[int | None, float]] = {}
        self._subs: list[Subscription] = []

    def attach(self, bus: Bus) -> None:
        """Watch ``bus`` for worker-reported losses. Idempotent per bus."""
        if any(sub.active and sub._bus is bus for sub in self._subs):
            return
        for event_type in self.watched:
            self._subs.append(bus.subscribe(event_type, on_event=self.observe))

    def detach(self) -> None:
        """Stop watching."""
        for sub in self._subs:
            sub.cancel()
        self._subs.clear()

    def observe(self, event: Event) -> None:
        """Note a non-finite ``data[key]`` (a number, or a tensor summary)."""
        value = _number(event.data.get(self.key))
        if value is not None and not math.isfinite(value):
            key = (event.context.run_id, event.context.restart_count)
            with self._lock:
                self.seen.setdefault(key, (event.context.rank, value))

    def __call__(self, event: WorkerExit) -> Decision | None:
        if not isinstance(event, WorkerExit):
            return None
        value = _number(event.data.get(self.key))
        if value is not None and not math.isfinite(value):
            return Decision.STOP
        message = (event.message or "").lower()
        if "floatingpointerror" in message or "non-finite loss" in message:
            return Decision.STOP
        with self._lock:
            if (event.context.run_id, _attempt(event)) in self.seen:
                return Decision.STOP
        return None

    def __repr__(self) -> str:
        return f"StopOnNonFiniteLoss(key={self.key!r})"


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, dict):  # a tensor summary or a tagged float from JSON
        for k in ("value", "$float"):
            if k in value:
                return _number(value[k]) if k == "value" else _tagged(value[k])
    if hasattr(value, "item") and callable(value.item):  # 0-d tensor / numpy scalar
        try:
            return _number(value.item())
        except Exception:
            return None
    return None


def _tagged(text: Any) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


#: ``--reactor eventbus.subscribers.reactors:stop_on_nonfinite_loss`` (watches ``data["loss"]``)
stop_on_nonfinite_loss = StopOnNonFiniteLoss()
