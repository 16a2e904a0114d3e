"""Bring events in: the default publisher, and bridges from torch and other processes."""

from __future__ import annotations

from eventbus.bus import Subscription
from publishers.publisher import EventPublisher
from publishers.publisher import get_default_event_publisher
from publishers.torchelastic import install_torchelastic_bridge

__all__ = [
    "EventPublisher",
    "Subscription",
    "get_default_event_publisher",
    "install_torchelastic_bridge",
]
