"""Bring events in: the default publisher, and bridges from torch and other processes."""

from __future__ import annotations

from eventbus.bus import Subscription
from publishers.publisher import EventPublisher
from publishers.publisher import get_default_event_publisher

__all__ = [
    "EventPublisher",
    "Subscription",
    "get_default_event_publisher",
]
