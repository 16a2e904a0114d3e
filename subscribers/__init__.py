"""Take events out: the logging bridge, the JSON Lines recorder, the restart reactors and
the forwarder that ships a worker's events to its agent.

The public names load on first use (PEP 562): ``import eventbus.subscribers`` alone costs nothing
beyond eventbus, and a worker that only records never pays for the logging bridge.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from eventbus._lazy import lazy_exports as _lazy_exports

if TYPE_CHECKING:
    from eventbus.subscribers.jsonl import JsonlRecorder
    from eventbus.subscribers.jsonl import read_jsonl
    from eventbus.subscribers.log_handler import EventLoggingHandler
    from eventbus.subscribers.reactors import NonRetriableExitCodes
    from eventbus.subscribers.reactors import RestartBudget
    from eventbus.subscribers.reactors import StopAfterStalls
    from eventbus.subscribers.reactors import StopOnNonFiniteLoss

__all__ = [
    "EventLoggingHandler",
    "JsonlRecorder",
    "NonRetriableExitCodes",
    "RestartBudget",
    "StopAfterStalls",
    "StopOnNonFiniteLoss",
    "read_jsonl",
]

#: public name -> the module that defines it
_LAZY = {
    "EventLoggingHandler": "eventbus.subscribers.log_handler",
    "JsonlRecorder": "eventbus.subscribers.jsonl",
    "NonRetriableExitCodes": "eventbus.subscribers.reactors",
    "RestartBudget": "eventbus.subscribers.reactors",
    "StopAfterStalls": "eventbus.subscribers.reactors",
    "StopOnNonFiniteLoss": "eventbus.subscribers.reactors",
    "read_jsonl": "eventbus.subscribers.jsonl",
}


__getattr__, __dir__ = _lazy_exports(__name__, _LAZY, __all__)

if __name__ != "eventbus.subscribers":
    # The checkout's subscribers/ folder on sys.path would be a second copy of every module,
    # with its own state: the one name is eventbus.subscribers (pyproject.toml's package-dir).
    raise ImportError(f"subscribers/ is installed as eventbus.subscribers: import that, "
                      f"not {__name__}")
