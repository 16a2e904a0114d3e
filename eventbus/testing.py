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

__all__ = ["capture_events", "strict_bus"]


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
