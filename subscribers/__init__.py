"""Take events out: the logging bridge, the JSON Lines recorder, the restart reactors and
the forwarder that ships a worker's events to its agent."""

from __future__ import annotations

from subscribers.log_handler import EventLoggingHandler

__all__ = ["EventLoggingHandler"]
