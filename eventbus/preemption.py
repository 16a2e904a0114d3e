"""Preemption, for the training loop: ``should_stop()`` says when to save and stop.

Under ``eventbus run``, a drain signal to any node's agent (a scheduler about to take a
node: SIGTERM, SIGUSR1) starts a drain of the whole job, and every worker hears it
(``PREEMPTING`` on its default bus). A loop that calls :func:`should_stop` once per step
gets ``True`` on every rank at the same step, then saves its checkpoint and returns::

    for step, batch in enumerate(loader):
        train_step(batch)
        if eventbus.preemption.should_stop():
            save_checkpoint(step)
            break

**The same step on every rank, by construction.** A step is the caller's ``step`` when it
passes one (a trainer's global step), else the number of calls so far; every rank sees the
same sequence of steps. When the drain reaches a rank, the rank *promises* a step it will
not pass without knowing the stop step: its current one plus a lead (about 0.25 s of
steps, at least 2). The promises meet in the job's store; the stop step is the largest of
them, so it is at or after every rank's current step when it becomes known, and every
rank stops exactly there. A rank that reaches its promise before the stop step is known
waits for it (in practice a few milliseconds, once); if the agreement cannot finish (a
rank died, the store is gone) within :data:`AGREE_TIMEOUT_S` or half the time left, the
rank stops where it is and the drain says so.

**The cost.** Without a drain, ``should_stop()`` is a counter increment and one attribute
read (tens of nanoseconds; ``benchmarks/bench_preemption.py`` measures it against a small
DDP step). Outside ``eventbus run`` it always returns ``False``.

Torch-free and inert: importing this module starts nothing. The agreement over the store is
the worker bootstrap's (:mod:`eventbus.app.worker.notices`); this module keeps the state.
"""

from __future__ import annotations

import math
import threading
import time

__all__ = [
    "AGREE_TIMEOUT_S",
    "Drain",
    "current_drain",
    "deadline_s",
    "draining",
    "should_stop",
    "stop_step",
]

#: the longest a rank waits at its promised step for the others' promises
AGREE_TIMEOUT_S = 10.0
#: the lead of a promise, in seconds of steps (at least :data:`MIN_LEAD` steps)
LEAD_S = 0.25
MIN_LEAD = 2
MAX_LEAD = 10_000


class Drain:
    """One drain as this process sees it: when it must end, and where the loop stops."""

    def __init__(self, *, deadline: float, reason: str, signal: str | None = None) -> None:
        #: ``time.monotonic()`` at which the agents forward the signal
        self.deadline = deadline
        #: ``time.monotonic()`` when this process heard the drain
        self.began = time.monotonic()
        self.reason = reason
        self.signal = signal
        #: the step this rank promised not to pass before the stop step is known
        self.promise: int | None = None
        #: the agreed stop step; None until known (and after the agreement failed)
        self.stop_at: int | None = None
        #: why the agreement failed, if it did: the rank stops where it is
        self.failed: str | None = None
        #: the step at which should_stop() first returned True here
        self.stopped_at: int | None = None
        self.settled = threading.Event()
        self._lock = threading.Lock()

    def make_promise(self, position: int, lead: int) -> int:
        """The step this rank will not pass without the stop step (set once)."""
        with self._lock:
            if self.promise is None:
                self.promise = position + max(1, lead)
            return self.promise

    def settle(self, stop_at: int | None, *, failed: str | None = None) -> None:
        """The agreement's result: the stop step, or None and why it failed."""
        with self._lock:
            if self.settled.is_set():
                return
            self.stop_at = stop_at
            self.failed = failed if stop_at is None else None
            self.settled.set()

    def seconds_left(self) -> float:
        return self.deadline - time.monotonic()


class _State:
    __slots__ = ("calls", "drain", "mark_calls", "mark_time", "position")

    def __init__(self) -> None:
        self.calls = 0
        self.position = 0
        self.drain: Drain | None = None
        #: (calls, time) every 64 calls: the step rate the lead is made from
        self.mark_calls = 0
        self.mark_time = 0.0


_state = _State()


def should_stop(step: int | None = None) -> bool:
    """``True`` once a drain started anywhere in the job and this rank reached the agreed
    stop step; ``False`` otherwise (always, outside ``eventbus run``). Call it once per
    optimizer step; ``step`` is the caller's own step counter (a trainer's global step),
    by default the number of calls."""
    state = _state
    calls = state.calls = state.calls + 1
    position = state.position = calls if step is None else step
    drain = state.drain
    if drain is None:
        if not calls & 63:
            state.mark_calls, state.mark_time = calls, time.monotonic()
        return False
    return _drained(drain, position)


def _drained(drain: Drain, position: int) -> bool:
    if drain.stopped_at is not None:
        return True
    promise = drain.promise
    if promise is None:
        promise = drain.make_promise(position, lead())
    if not drain.settled.is_set() and position >= promise:
        budget = min(AGREE_TIMEOUT_S, max(0.0, drain.seconds_left() / 2))
        drain.settled.wait(budget)
        if not drain.settled.is_set():
            drain.settle(None, failed=f"no agreement on a stop step within {budget:.1f} s")
    if drain.settled.is_set() and (drain.stop_at is None or position >= drain.stop_at):
        drain.stopped_at = position
        return True
    return False


def lead() -> int:
    """How many steps ahead a promise goes: about :data:`LEAD_S` of steps at the rate of
    the last calls, within :data:`MIN_LEAD` and :data:`MAX_LEAD`."""
    state = _state
    done = state.calls - state.mark_calls
    elapsed = time.monotonic() - state.mark_time
    if state.mark_calls == 0 or done <= 0 or elapsed <= 0:
        return MIN_LEAD
    per_step = elapsed / done
    return max(MIN_LEAD, min(MAX_LEAD, math.ceil(LEAD_S / per_step) + 1))


def position() -> int:
    """The last step :func:`should_stop` saw (0 before the first call)."""
    return _state.position


def called() -> bool:
    """Whether this process has called :func:`should_stop` (it acts on drains)."""
    return _state.calls > 0


def draining() -> bool:
    """Whether a drain started (this process heard ``PREEMPTING``)."""
    return _state.drain is not None


def current_drain() -> Drain | None:
    """The drain under way, or None."""
    return _state.drain


def deadline_s() -> float | None:
    """Seconds left before the agents forward the signal, or None without a drain."""
    drain = _state.drain
    return None if drain is None else drain.seconds_left()


def stop_step() -> int | None:
    """The agreed stop step, once known."""
    drain = _state.drain
    return None if drain is None else drain.stop_at


def begin(*, deadline_s: float, reason: str, signal: str | None = None) -> Drain:
    """Start a drain in this process (the worker bootstrap calls it when ``PREEMPTING``
    arrives; :func:`eventbus.testing.drain` in a test). Idempotent: the first drain stays."""
    state = _state
    if state.drain is None:
        state.drain = Drain(deadline=time.monotonic() + deadline_s, reason=reason,
                            signal=signal)
    return state.drain


def reset() -> None:
    """Forget the drain and the step count (tests; a forked child starts afresh)."""
    global _state
    _state = _State()
