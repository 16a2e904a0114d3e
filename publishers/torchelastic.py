"""torch -> bus: torch's own ``torch.distributed.elastic.events`` records as typed events.

Torch routes ``events.record(event, destination)`` through a per-destination logger
(``torchelastic-events-<destination>``) whose one handler comes from the registry
``torch.distributed.elastic.events.handlers._log_handlers``; ``torchrun
--event-log-handler NAME`` picks the destination its agent records to. The bridge registers
a handler under its own destination (``"eventbus"`` by default) that parses each record and
publishes the typed event on the bus:

========================================================  =================================
torch record                                              bus event
========================================================  =================================
``torchelastic.worker.status.START`` (worker)             ``WORKER_START``
``...SUCCEEDED`` / ``...FAILED`` / ``...TERMINATED``      ``WORKER_EXIT`` (exit code, rank)
(worker)
``...RENDEZVOUS`` (agent, one per round, with duration)   ``RENDEZVOUS``
``...FAILED`` (agent: ``run()`` raised)                   ``AGENT_EXIT`` (state ``FAILED``)
``dynamic_rendezvous`` record in state ``FAILED``         ``RENDEZVOUS`` (state ``FAILED``)
anything else                                             ``TORCHELASTIC`` (name, source)
========================================================  =================================

The agent's ``...SUCCEEDED`` record is one of the "anything else": torch records it when
the agent's ``run()`` returned, "NOT that workers have succeeded" (torch's own comment), so
it says nothing about how the job ended and does not become ``AGENT_EXIT``.

Every bridged event carries ``data["source"] == "torchelastic"`` and the torch record's
name in ``data["torchelastic_name"]``, so a subscriber (or the launcher, whose agent
publishes worker exits itself) can tell them apart. Nothing is dropped: a record that does
not parse, or whose typed fields do not validate, still arrives as ``TORCHELASTIC``.

What the bridge guarantees torch: its ``emit`` never raises (an exception in a handler
propagates out of torch's ``record()`` into the agent and kills the job); failures are
counted and reported on the ``eventbus`` logger, rate-limited. Its logger is set to INFO
once, so ``LOGLEVEL=WARNING`` (which torch applies to every events logger it creates, and
which silently drops every torchelastic event) does not silence the bridge.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import signal as signal_module
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

import attrs

from eventbus._reporting import RateLimiter
from eventbus.bus import Bus
from eventbus.bus import get_default_bus
from eventbus.context import JobContext
from eventbus.context import current_context
from eventbus.events import AgentExit
from eventbus.events import Event
from eventbus.events import Rendezvous
from eventbus.events import TorchelasticRecord
from eventbus.events import WorkerExit
from eventbus.events import WorkerStart
from eventbus.events import signal_name

__all__ = [
    "SOURCE",
    "TorchelasticBridge",
    "install_torchelastic_bridge",
    "torchelastic_event",
    "uninstall_torchelastic_bridge",
]

#: ``data["source"]`` of every event the bridge publishes
SOURCE = "torchelastic"
#: torch's own destinations, which the bridge never replaces
_TORCH_DESTINATIONS = ("console", "dynamic_rendezvous", "null")
_RDZV_DESTINATION = "dynamic_rendezvous"
_STATUS_PREFIX = "torchelastic.worker.status."
_WORKER_EXIT_STATES = ("SUCCEEDED", "FAILED", "TERMINATED")
#: at most one failure report per this many seconds
REPORT_INTERVAL_S = 10.0
#: characters kept of an error message taken from torch's raw_error
_MESSAGE_CHARS = 2_000

_log = logging.getLogger("eventbus")


# -- conversion -------------------------------------------------------------------------------


def _first(value: Any) -> Any:
    """Torch wraps per-worker values in 1-tuples (``md["local_rank"] = (rank,)``)."""
    if isinstance(value, (list, tuple)):
        return value[0] if len(value) == 1 else None
    return value


def _int_or_none(value: Any) -> int | None:
    value = _first(value)
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value.strip())
    return None


def _nested_metadata(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """Torch's ``metadata["metadata"]`` is itself a JSON string (local rank, exit code...)."""
    raw = metadata.get("metadata")
    if isinstance(raw, str):
        try:
            parsed = json.loads(raw)
        except ValueError:
            return {}
        return parsed if isinstance(parsed, dict) else {}
    return dict(raw) if isinstance(raw, Mapping) else {}


def _short(text: str) -> str:
    text = text.strip()
    return text if len(text) <= _MESSAGE_CHARS else text[:_MESSAGE_CHARS] + "...[truncated]"


def _error_message(raw_error: Any) -> str | None:
    """A one-paragraph message from torch's ``raw_error``.

    For a worker it is the JSON of the worker's error file (``{"message": {"message": ...,
    "extraInfo": ...}}`` or ``{"message": "..."}``); for the agent, a formatted traceback.
    """
    if not isinstance(raw_error, str) or not raw_error.strip():
        return None
    try:
        parsed = json.loads(raw_error)
    except ValueError:
        lines = [line for line in raw_error.strip().splitlines() if line.strip()]
        if lines and lines[0].startswith("Traceback"):
            return _short(lines[-1])  # the exception line of a traceback
        return _short(raw_error)
    message = parsed.get("message") if isinstance(parsed, dict) else parsed
    if isinstance(message, dict):
        message = message.get("message", message)
    if message in (None, "", "<NONE>"):
        return None
    return _short(message if isinstance(message, str) else json.dumps(message))


def _context(base: JobContext, metadata: Mapping[str, Any],
             nested: Mapping[str, Any]) -> JobContext:
    """The agent's context, completed with the job facts torch's record states."""
    overrides: dict[str, Any] = {}
    run_id = metadata.get("run_id")
    if isinstance(run_id, str) and run_id and base.run_id is None:
        overrides["run_id"] = run_id
    role = metadata.get("role")
    if isinstance(role, str) and role and base.role is None:
        overrides["role"] = role
    group_rank = _int_or_none(metadata.get("group_rank"))
    if group_rank is not None and base.group_rank is None:
        overrides["group_rank"] = group_rank
    restarts = _int_or_none(metadata.get("agent_restarts"))
    if restarts is not None:
        overrides["restart_count"] = restarts
    world_size = _int_or_none(nested.get("role_world_size"))
    if world_size is not None and base.world_size is None:
        overrides["world_size"] = world_size
    return attrs.evolve(base, **overrides) if overrides else base


def _timestamp(raw: Any) -> float:
    """Torch's timestamp is in milliseconds and is almost always left at 0."""
    if isinstance(raw, (int, float)) and not isinstance(raw, bool) and raw > 0:
        seconds = raw / 1000.0
        if math.isfinite(seconds):
            return float(seconds)
    return time.time()


#: metadata keys not copied to ``data``: the nested JSON (copied parsed), the state (in the
#: name), the raw error (its message becomes the event's message; the traceback is long)
_NOT_IN_DATA = frozenset({"metadata", "state", "raw_error"})


def _marked(name: str, items: dict[str, Any]) -> dict[str, Any]:
    """``items`` with the bridge's marks; a torch key that collides is kept as ``torch_<key>``."""
    for key in ("source", "torchelastic_name"):
        if key in items:
            items[f"torch_{key}"] = items.pop(key)
    return {"source": SOURCE, "torchelastic_name": name, **items}


def _data(name: str, metadata: Mapping[str, Any], nested: Mapping[str, Any]) -> dict[str, Any]:
    items: dict[str, Any] = {}
    for key, value in metadata.items():
        if key in _NOT_IN_DATA or value is None:
            continue
        items[str(key)] = value
    for key, wrapped in nested.items():
        value = _first(wrapped)
        if value is not None:
            items.setdefault(str(key), value)
    return _marked(name, items)


def _from_status_event(payload: Mapping[str, Any], base: JobContext) -> Event:
    name = str(payload.get("name"))
    source = str(payload.get("source", ""))
    raw_metadata = payload.get("metadata")
    metadata: Mapping[str, Any] = raw_metadata if isinstance(raw_metadata, Mapping) else {}
    nested = _nested_metadata(metadata)
    context = _context(base, metadata, nested)
    timestamp = _timestamp(payload.get("timestamp"))
    data = _data(name, metadata, nested)
    state = name[len(_STATUS_PREFIX):] if name.startswith(_STATUS_PREFIX) else None
    common: dict[str, Any] = {"data": data, "timestamp": timestamp, "context": context}

    if state is not None and source == "WORKER":
        rank = _int_or_none(metadata.get("global_rank"))
        local_rank = _int_or_none(nested.get("local_rank"))
        # For the local agent, Worker.id (metadata["worker_id"]) is the worker's pid.
        pid = _int_or_none(nested.get("worker_pid"))
        if pid is None:
            pid = _int_or_none(metadata.get("worker_id"))
        if rank is not None and state == "START":
            return WorkerStart(worker_id=rank, worker_local_rank=local_rank, worker_pid=pid,
                               **common)
        if rank is not None and state in _WORKER_EXIT_STATES:
            exit_code = _int_or_none(nested.get("exit_code"))
            message = _error_message(metadata.get("raw_error"))
            if state == "SUCCEEDED" and exit_code is None:
                exit_code = 0
            elif state == "TERMINATED" and exit_code is None:
                # torch: "the worker got terminated by the torchelastic agent via SIGTERM"
                exit_code = -int(signal_module.SIGTERM)
                message = message or "stopped by the agent (SIGTERM) when the group failed"
            elif exit_code is None:  # FAILED without an exit code: still a failure
                exit_code = 1
            return WorkerExit(worker_id=rank, exit_code=exit_code, worker_local_rank=local_rank,
                              worker_pid=pid, signal=signal_name(exit_code), message=message,
                              **common)
    if state is not None and source == "AGENT":
        if state == "RENDEZVOUS":
            duration_ms = metadata.get("duration_ms")
            duration_s = (float(duration_ms) / 1000.0
                          if isinstance(duration_ms, (int, float))
                          and not isinstance(duration_ms, bool) else None)
            # The agent records the round's duration from a ``finally``: an exception on
            # its way out of next_rendezvous() means the round failed.
            exc = sys.exc_info()[1]
            if isinstance(exc, Exception):
                return Rendezvous(state="FAILED", name=name, duration_s=duration_s,
                                  message=_short(f"{type(exc).__name__}: {exc}"), **common)
            return Rendezvous(state="SUCCEEDED", name=name, duration_s=duration_s, **common)
        if state == "FAILED":
            return AgentExit(state=state, reason=_error_message(metadata.get("raw_error")),
                             **common)
    return TorchelasticRecord(name=name, source=source or None, **common)


def _from_rdzv_event(payload: Mapping[str, Any], base: JobContext) -> Event:
    name = str(payload.get("name"))
    node_state = str(payload.get("node_state", ""))
    data = _marked(name, {str(k): v for k, v in payload.items()
                          if k != "name" and v is not None
                          and v not in ("", "NoneType: None\n")})
    context = _context(base, {"run_id": payload.get("run_id")}, {})
    common: dict[str, Any] = {"data": data, "context": context}
    if node_state == "FAILED":
        message = payload.get("message")
        return Rendezvous(state="FAILED", name=name,
                          message=_short(message) if isinstance(message, str) else None,
                          **common)
    return TorchelasticRecord(name=name, source=_RDZV_DESTINATION, **common)


def torchelastic_event(payload: Mapping[str, Any] | str, *,
                       context: JobContext | None = None) -> Event:
    """The bus event for one torchelastic record (its dict, or its JSON as torch logs it).

    Never raises for a record it does not understand: such a record becomes a
    ``TORCHELASTIC`` event with what could be read. ``context`` defaults to this process's.
    """
    base = context if context is not None else current_context()
    if isinstance(payload, str):
        try:
            parsed = json.loads(payload)
        except ValueError:
            return TorchelasticRecord(name="<unparsable>", source=None, context=base,
                                      data={"source": SOURCE, "raw": _short(payload)})
        if not isinstance(parsed, Mapping):
            return TorchelasticRecord(name="<unparsable>", source=None, context=base,
                                      data={"source": SOURCE, "raw": _short(payload)})
        payload = parsed
    try:
        if "node_state" in payload:
            return _from_rdzv_event(payload, base)
        return _from_status_event(payload, base)
    except (TypeError, ValueError) as exc:
        # A field that did not validate: keep the record, say why it is not typed.
        name = payload.get("name")
        source = payload.get("source")
        return TorchelasticRecord(
            name=name if isinstance(name, str) else "<unnamed>",
            source=source if isinstance(source, str) else None,
            context=base,
            data={"source": SOURCE, "payload": dict(payload),
                  "conversion_error": _short(f"{type(exc).__name__}: {exc}")},
        )


# -- the handler torch calls ------------------------------------------------------------------


def _payload_of(record: logging.LogRecord) -> Mapping[str, Any] | str:
    msg = record.msg
    if isinstance(msg, str):
        return record.getMessage() if record.args else msg
    # ``events.get_logging_handler(dest).info(event)`` (torch's own docstring example)
    # logs the dataclass itself.
    serialize = getattr(msg, "serialize", None)
    if callable(serialize):
        text = serialize()
        if isinstance(text, str):
            return text
    return record.getMessage()


class TorchelasticBridge(logging.Handler):
    """The handler registered in torch's event destinations; publishes on ``bus``.

    ``published`` counts events published, ``failed`` records that could not be turned into
    events or published (each reported on the ``eventbus`` logger, rate-limited).
    """

    def __init__(self, bus: Bus | None = None, *, destination: str = "eventbus") -> None:
        super().__init__(logging.NOTSET)
        self.bus = bus if bus is not None else get_default_bus()
        self.destination = destination
        self.published = 0
        self.failed = 0
        self._reports = RateLimiter()
        self._count_lock = threading.Lock()
        #: what install replaced, restored by uninstall: destination -> (handler, logger)
        self._replaced: dict[str, tuple[logging.Handler | None, logging.Logger | None]] = {}

    def handle(self, record: logging.LogRecord) -> Any:
        """Filter and emit without holding the handler's lock.

        ``logging.Handler.handle`` serialises ``emit`` under a lock meant for shared I/O;
        here ``emit`` publishes on the bus (thread-safe on its own) and subscribers may take
        their own locks, so holding one more across the publish (torch records from the
        agent's main thread and from the rendezvous keep-alive thread) could only add
        contention or a lock-order deadlock.
        """
        result = self.filter(record)
        if result:
            self.emit(result if isinstance(result, logging.LogRecord) else record)
        return result

    def emit(self, record: logging.LogRecord) -> None:
        """Publish the event for ``record``. Never raises into torch."""
        try:
            event = torchelastic_event(_payload_of(record))
            self.bus.publish(event)
        except Exception as exc:
            self._failure(exc)
        else:
            with self._count_lock:
                self.published += 1

    def _failure(self, exc: Exception) -> None:
        with contextlib.suppress(Exception):
            with self._count_lock:
                self.failed += 1
                suppressed = self._reports.allow(REPORT_INTERVAL_S)
            if suppressed is None:
                return
            more = f" ({suppressed} more since the last report)" if suppressed else ""
            _log.error("torchelastic bridge %r could not publish a torch event record%s",
                       self.destination, more, exc_info=(type(exc), exc, exc.__traceback__))

    def handleError(self, record: logging.LogRecord) -> None:
        """Count it: the bridge reports its own failures (see :meth:`emit`)."""
        exc = sys.exc_info()[1]
        if isinstance(exc, Exception):
            self._failure(exc)

    def __repr__(self) -> str:
        return (f"<TorchelasticBridge {self.destination!r} -> {self.bus!r} "
                f"published={self.published} failed={self.failed}>")


# -- install / uninstall ----------------------------------------------------------------------

_installed: dict[str, TorchelasticBridge] = {}
_install_lock = threading.Lock()


def _torch_registries() -> tuple[dict[str, logging.Handler], dict[str, logging.Logger]]:
    try:
        from torch.distributed.elastic import events as torch_events
        from torch.distributed.elastic.events import handlers as torch_handlers
    except ImportError as exc:  # pragma: no cover - torch is a dependency
        raise RuntimeError(
            f"install_torchelastic_bridge needs torch.distributed.elastic: {exc}"
        ) from exc
    handlers = getattr(torch_handlers, "_log_handlers", None)
    loggers = getattr(torch_events, "_events_loggers", None)
    if not isinstance(handlers, dict) or not isinstance(loggers, dict):
        raise RuntimeError(
            "this torch has no torch.distributed.elastic.events.handlers._log_handlers / "
            "events._events_loggers registry; the bridge is tested with torch 2.8-2.15"
        )
    return handlers, loggers


def _own_logger(destination: str, bridge: TorchelasticBridge,
                loggers: dict[str, logging.Logger]) -> logging.Logger | None:
    """Create (or take over) torch's logger for ``destination`` with ``bridge`` on it."""
    previous = loggers.get(destination)
    logger = logging.getLogger(f"torchelastic-events-{destination}")
    # torch sets LOGLEVEL (default INFO) when it creates the logger; WARNING would drop
    # every record. The bridge's records are INFO: make the level independent of LOGLEVEL
    # and of the root logger.
    logger.setLevel(logging.INFO)
    logger.propagate = False
    for handler in list(logger.handlers):
        if isinstance(handler, TorchelasticBridge) and handler is not bridge:
            logger.removeHandler(handler)
    if bridge not in logger.handlers:
        logger.addHandler(bridge)
    loggers[destination] = logger
    return previous


def install_torchelastic_bridge(
    destination: str = "eventbus",
    *,
    bus: Bus | None = None,
    rendezvous_records: bool = True,
) -> TorchelasticBridge:
    """Register ``destination`` in torch's event handlers; its records reach ``bus``.

    Then ``torch.distributed.elastic.events.record(event, destination)`` (what torchrun's
    agent calls with ``--event-log-handler <destination>``) publishes the typed event on
    ``bus`` (default: the default bus). With ``rendezvous_records`` the
    ``dynamic_rendezvous`` records (torch keeps them off by default) are bridged too,
    unless the user already registered a real handler there.

    Idempotent: a second call with the same destination returns the installed bridge.
    Importing torch happens here, not at ``import eventbus.publishers``.
    """
    if not isinstance(destination, str):
        raise TypeError(f"destination must be a string, got {type(destination).__name__}")
    if not destination or destination in _TORCH_DESTINATIONS:
        raise ValueError(
            f"destination={destination!r} is not usable: pick a non-empty name other than "
            f"torch's own {', '.join(_TORCH_DESTINATIONS)} (e.g. the default 'eventbus')"
        )
    if bus is not None and not isinstance(bus, Bus):
        raise TypeError(f"bus must be an eventbus.Bus, got {type(bus).__name__}")
    handlers, loggers = _torch_registries()
    target_bus = bus if bus is not None else get_default_bus()
    with _install_lock:
        bridge = _installed.get(destination)
        if bridge is not None and handlers.get(destination) is bridge:
            if bridge.bus is not target_bus:
                raise ValueError(
                    f"the torchelastic bridge {destination!r} already publishes on "
                    f"{bridge.bus!r}; uninstall it first or use another destination"
                )
            return bridge
        bridge = TorchelasticBridge(target_bus, destination=destination)
        bridge._replaced[destination] = (handlers.get(destination),
                                         _own_logger(destination, bridge, loggers))
        handlers[destination] = bridge
        if rendezvous_records:
            current = handlers.get(_RDZV_DESTINATION)
            previous_logger = loggers.get(_RDZV_DESTINATION)
            if current is None or isinstance(current, (logging.NullHandler,
                                                        TorchelasticBridge)):
                # torch skips building rendezvous records while this is a NullHandler
                handlers[_RDZV_DESTINATION] = bridge
            _own_logger(_RDZV_DESTINATION, bridge, loggers)
            bridge._replaced[_RDZV_DESTINATION] = (current, previous_logger)
        _installed[destination] = bridge
        return bridge


def uninstall_torchelastic_bridge(destination: str = "eventbus") -> bool:
    """Undo :func:`install_torchelastic_bridge`; True if a bridge was installed."""
    handlers, loggers = _torch_registries()
    with _install_lock:
        bridge = _installed.pop(destination, None)
        if bridge is None:
            return False
        for dest, (previous_handler, previous_logger) in bridge._replaced.items():
            logger = logging.getLogger(f"torchelastic-events-{dest}")
            if bridge in logger.handlers:
                logger.removeHandler(bridge)
            if handlers.get(dest) is not bridge:
                continue  # another bridge (or the user) took the destination over since
            restore = previous_handler
            if isinstance(restore, TorchelasticBridge) and restore not in _installed.values():
                restore = None
            if restore is not None:
                handlers[dest] = restore
                if isinstance(restore, TorchelasticBridge) and restore not in logger.handlers:
                    logger.addHandler(restore)
            elif dest == _RDZV_DESTINATION:
                handlers[dest] = logging.NullHandler()  # torch's default: records off
            else:
                handlers.pop(dest, None)
            if previous_logger is None and restore is None:
                loggers.pop(dest, None)
        bridge._replaced.clear()
        return True
