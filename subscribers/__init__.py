"""Take events out: the logging bridge, the JSON Lines recorder, the restart reactors and
the forwarder that ships a worker's events to its agent."""

from __future__ import annotations

from subscribers.jsonl import JsonlRecorder
from subscribers.jsonl import read_jsonl
from subscribers.log_handler import EventLoggingHandler
from subscribers.reactors import NonRetriableExitCodes
from subscribers.reactors import RestartBudget
from subscribers.reactors import StopAfterStalls
from subscribers.reactors import StopOnNonFiniteLoss

__all__ = [
    "EventLoggingHandler",
    "JsonlRecorder",
    "NonRetriableExitCodes",
    "RestartBudget",
    "StopAfterStalls",
    "StopOnNonFiniteLoss",
    "read_jsonl",
]
