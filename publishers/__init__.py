"""Bring events in: the default publisher, and bridges from torch and other processes.

The public names load on first use (PEP 562), so that ``import eventbus.publishers`` costs nothing
beyond eventbus until one is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from eventbus._lazy import lazy_exports as _lazy_exports
from eventbus.bus import Subscription

if TYPE_CHECKING:
    from eventbus.publishers.publisher import EventPublisher
    from eventbus.publishers.publisher import get_default_event_publisher
    from eventbus.publishers.torchelastic import install_torchelastic_bridge

__all__ = [
    "EventPublisher",
    "Subscription",
    "get_default_event_publisher",
    "install_torchelastic_bridge",
]

#: public name -> the module that defines it
_LAZY = {
    "EventPublisher": "eventbus.publishers.publisher",
    "get_default_event_publisher": "eventbus.publishers.publisher",
    "install_torchelastic_bridge": "eventbus.publishers.torchelastic",
}


__getattr__, __dir__ = _lazy_exports(__name__, _LAZY, __all__)

if __name__ != "eventbus.publishers":
    # The checkout's publishers/ folder on sys.path would be a second copy of every module,
    # with its own state: the one name is eventbus.publishers (pyproject.toml's package-dir).
    raise ImportError(f"publishers/ is installed as eventbus.publishers: import that, "
                      f"not {__name__}")
