"""The event publisher: torch's ``utils.publisher`` name for subscribing to a bus."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from eventbus.bus import ALL
from eventbus.bus import Bus
from eventbus.bus import Subscription
from eventbus.bus import get_default_bus
from eventbus.events import Event
from eventbus.events import EventType

__all__ = ["EventPublisher", "get_default_event_publisher"]


class EventPublisher:
    """Subscribe to, and publish on, one bus."""

    def __init__(self, bus: Bus | None = None) -> None:
        self.bus = bus if bus is not None else Bus("publisher")

    def subscribe(
        self,
        event_type: EventType | str | type[Event] | Any,
        *,
        on_event: Callable[[Event], object],
        once: bool = False,
        where: Callable[[Event], object] | None = None,
    ) -> Subscription:
        """Call ``on_event(event)`` with each later event of ``event_type``.

        In subscription order, in the publishing thread. ``once=True``: only the first
        such event. ``where=predicate``: only events for which it is true. Pass
        ``eventbus.ALL`` (or use :meth:`subscribe_all`) for every type.
        """
        return self.bus.subscribe(event_type, on_event=on_event, once=once, where=where)

    def subscribe_all(
        self,
        *,
        on_event: Callable[[Event], object],
        once: bool = False,
        where: Callable[[Event], object] | None = None,
    ) -> Subscription:
        """Call ``on_event(event)`` with each later event of every type."""
        return self.bus.subscribe(ALL, on_event=on_event, once=once, where=where)

    def record(self, event_type: EventType | str | type[Event], /, **fields: Any) -> None:
        """Validate and publish a typed event (see :func:`eventbus.record`)."""
        self.bus.record(event_type, **fields)

    def publish(self, event: Event) -> None:
        """Publish an event built elsewhere."""
        self.bus.publish(event)

    def __repr__(self) -> str:
        return f"<EventPublisher on {self.bus!r}>"


_default_publisher = EventPublisher(get_default_bus())


def get_default_event_publisher() -> EventPublisher:
    """The publisher of the default bus (the one :func:`eventbus.record` publishes on)."""
    return _default_publisher
