"""eventbus: typed events for PyTorch elastic training jobs.

``record()`` publishes a typed, validated event on the default bus; subscribe with
``eventbus.publishers.get_default_event_publisher().subscribe(...)``.

``import eventbus`` only defines: in any environment it imports no torch, starts no thread,
installs no signal handler and replaces nothing of ``os`` or ``signal``. The worker side of
``eventbus run`` is started by its bootstrap (:mod:`eventbus.app.worker`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from eventbus.bus import ALL
from eventbus.bus import Bus
from eventbus.bus import Subscription
from eventbus.bus import get_default_bus
from eventbus.bus import publish
from eventbus.bus import record
from eventbus.context import JobContext
from eventbus.context import current_context
from eventbus.context import refresh_context
from eventbus.context import set_context
from eventbus.encoding import LIMITS
from eventbus.errors import EventBusError
from eventbus.errors import EventDecodeError
from eventbus.errors import FieldTypeError
from eventbus.errors import FieldValueError
from eventbus.errors import MissingFieldError
from eventbus.errors import UnknownEventTypeError
from eventbus.errors import UnknownFieldError
from eventbus.events import AgentExit
from eventbus.events import AgentStart
from eventbus.events import Cause
from eventbus.events import CheckpointSaved
from eventbus.events import Decision
from eventbus.events import EpochEnd
from eventbus.events import EpochStart
from eventbus.events import Event
from eventbus.events import EventsLost
from eventbus.events import EventType
from eventbus.events import HostEvicted
from eventbus.events import JobStuck
from eventbus.events import JobUnstuck
from eventbus.events import Metric
from eventbus.events import Preempting
from eventbus.events import Recovered
from eventbus.events import Rendezvous
from eventbus.events import TorchelasticRecord
from eventbus.events import WorkerExit
from eventbus.events import WorkerProgress
from eventbus.events import WorkerRestart
from eventbus.events import WorkerSlow
from eventbus.events import WorkerStalled
from eventbus.events import WorkerStart
from eventbus.events import event_class
from eventbus.events import event_type
from eventbus.events import event_types
from eventbus.events import signal_name

if TYPE_CHECKING:
    from eventbus.subscribers.log_handler import EventLoggingHandler

__all__ = [
    "ALL",
    "AgentExit",
    "AgentStart",
    "Bus",
    "Cause",
    "CheckpointSaved",
    "Decision",
    "EpochEnd",
    "EpochStart",
    "Event",
    "EventBusError",
    "EventDecodeError",
    "EventType",
    "EventsLost",
    "FieldTypeError",
    "FieldValueError",
    "HostEvicted",
    "JobContext",
    "JobStuck",
    "JobUnstuck",
    "LIMITS",
    "Metric",
    "MissingFieldError",
    "Preempting",
    "Recovered",
    "Rendezvous",
    "Subscription",
    "TorchelasticRecord",
    "UnknownEventTypeError",
    "UnknownFieldError",
    "WorkerExit",
    "WorkerProgress",
    "WorkerRestart",
    "WorkerSlow",
    "WorkerStalled",
    "WorkerStart",
    "current_context",
    "event_class",
    "event_type",
    "event_types",
    "get_default_bus",
    "get_logging_handler",
    "publish",
    "record",
    "refresh_context",
    "set_context",
    "signal_name",
]

__version__ = "0.1.0.dev0"


def get_logging_handler(destination: str | None = None) -> EventLoggingHandler:
    """The one default :class:`eventbus.subscribers.log_handler.EventLoggingHandler`.

    The first call subscribes it to every event of the default bus. ``destination`` is
    accepted for torch compatibility (``events.get_logging_handler("console")``).
    """
    from eventbus.subscribers.log_handler import get_default_handler

    return get_default_handler(destination)

