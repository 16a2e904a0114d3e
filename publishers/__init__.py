"""Bring events in: the default publisher, and bridges from torch and other processes.

The public names load on first use (PEP 562), so that ``import publishers`` costs nothing
beyond eventbus until one is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from eventbus.bus import Subscription

if TYPE_CHECKING:
    from publishers.publisher import EventPublisher
    from publishers.publisher import get_default_event_publisher
    from publishers.torchelastic import install_torchelastic_bridge

__all__ = [
    "EventPublisher",
    "Subscription",
    "get_default_event_publisher",
    "install_torchelastic_bridge",
]

#: public name -> the module that defines it
_LAZY = {
    "EventPublisher": "publishers.publisher",
    "get_default_event_publisher": "publishers.publisher",
    "install_torchelastic_bridge": "publishers.torchelastic",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
