"""Helpers for users' own tests.

>>> from eventbus.testing import capture_events
>>> with capture_events() as events:
...     eventbus.record(EventType.EPOCH_END, epoch=1)
>>> [e.epoch for e in events]
[1]
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from eventbus.bus import ALL
from eventbus.bus import Bus
from eventbus.bus import get_default_bus
from eventbus.events import Event

__all__ = ["capture_events", "drain", "strict_bus"]


@contextmanager
def capture_events(event_type: Any = ALL, *, bus: Bus | None = None) -> Iterator[list[Event]]:
    """Collect every event (or every event of one type) published inside the block."""
    captured: list[Event] = []
    sub = (bus or get_default_bus()).subscribe(event_type, on_event=captured.append)
    try:
        yield captured
    finally:
        sub.cancel()


@contextmanager
def strict_bus(bus: Bus | None = None) -> Iterator[Bus]:
    """Inside the block, a subscriber's exception propagates out of ``record()``."""
    target = bus or get_default_bus()
    previous, target.strict = target.strict, True
    try:
        yield target
    finally:
        target.strict = previous


@contextmanager
def drain(*, stop_at: int | None = None, deadline_s: float = 60.0,
          reason: str = "a test drain") -> Iterator[Any]:
    """Inside the block, this process is draining as if ``PREEMPTING`` had arrived under
    ``eventbus run``: :func:`eventbus.preemption.should_stop` returns ``True`` from step
    ``stop_at`` on (default: the step after the current one). For tests of training code
    and trainer integrations; the drain is forgotten on the way out (with the step count).
    Yields the :class:`eventbus.preemption.Drain`."""
    from eventbus import preemption

    state = preemption.begin(deadline_s=deadline_s, reason=reason)
    state.settle(preemption.position() + 1 if stop_at is None else stop_at)
    try:
        yield state
    finally:
        preemption.reset()

