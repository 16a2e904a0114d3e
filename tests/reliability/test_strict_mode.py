"""Row 2: strict mode lets a subscriber's exception reach the caller."""

from __future__ import annotations

import pytest

import eventbus
from eventbus import Bus
from eventbus import Event
from eventbus.testing import strict_bus


class Boom(Exception):
    pass


def _raise(event: Event) -> None:
    raise Boom(f"step {event.fields()['step']}")


def test_strict_bus_reraises() -> None:
    """Bus(strict=True): the very exception the subscriber raised comes out of record()."""
    bus = Bus("strict", strict=True)
    before: list[Event] = []
    bus.subscribe("METRIC", on_event=before.append)
    bus.subscribe("METRIC", on_event=_raise)
    with pytest.raises(Boom, match="step 7"):
        bus.record("METRIC", step=7)
    assert len(before) == 1  # earlier subscribers still got it


def test_strict_bus_context_manager_on_default_bus() -> None:
    """eventbus.testing.strict_bus() turns strict mode on for the block only."""
    sub = eventbus.get_default_bus().subscribe("METRIC", on_event=_raise)
    try:
        with strict_bus(), pytest.raises(Boom):
            eventbus.record("METRIC", step=1)
        eventbus.record("METRIC", step=2)  # strict is off again: isolated, no raise
        assert eventbus.get_default_bus().strict is False
    finally:
        sub.cancel()
