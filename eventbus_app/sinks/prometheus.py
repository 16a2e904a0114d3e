"""``prometheus:PORT`` (or ``prometheus:HOST:PORT``): ``/metrics`` served by the agent.

A ``prometheus_client`` HTTP server on ``127.0.0.1:PORT`` by default (give
``0.0.0.0:PORT`` to let a Prometheus on another host scrape it), up from the sink's start
until its close, i.e. while the job runs. Its own registry (no process or GC collectors):

* ``eventbus_events_total{type}``: events that reached the agent's bus, by type;
* ``eventbus_worker_exits_total{exit_code}``: worker exits by exit code;
* ``eventbus_restarts_total``: worker group restarts;
* ``eventbus_stalls_total``: stalled workers (``WORKER_STALLED``);
* ``eventbus_last_step{rank}``: the last ``step`` of each rank's ``METRIC``;
* ``eventbus_attempt``: the attempt the worker group is on;
* ``eventbus_goodput_ratio`` and ``eventbus_badput_seconds{cause}``: the job's goodput so
  far and its badput by cause (docs/goodput.md), recomputed at most once a second, when
  the launcher gave the sink the job's figure (:attr:`PrometheusSink.goodput_source`).

Port 0 picks a free port (read it from :attr:`PrometheusSink.port`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

from eventbus.app.sinks.base import EventSink
from eventbus.app.sinks.base import SinkArgumentError
from eventbus.app.sinks.base import attempt_of
from eventbus.app.sinks.base import is_stall
from eventbus.app.sinks.base import require_extra
from eventbus.events import Event
from eventbus.subscribers.queued import QueueSettings

__all__ = ["PrometheusSink", "parse_address"]

_MAX_PORT = 65535


def parse_address(arg: str) -> tuple[str, int]:
    """``PORT`` or ``HOST:PORT`` as ``(host, port)``; :class:`SinkArgumentError` otherwise."""
    host, sep, port_text = arg.rpartition(":")
    if not sep:
        host = "127.0.0.1"
    try:
        port = int(port_text)
    except ValueError:
        port = -1
    if not 0 <= port <= _MAX_PORT or not host:
        raise SinkArgumentError(f"prometheus: {arg!r} is not a port (0-65535) or HOST:PORT; "
                                "e.g. --sink prometheus:9464")
    return host, port


class PrometheusSink(EventSink):
    """``PrometheusSink(PORT)``: see the module docstring. Serves from construction."""

    kind = "prometheus"

    def __init__(self, address: str | int, *, settings: QueueSettings | None = None) -> None:
        host, port = parse_address(str(address))
        require_extra("prometheus", "prometheus", "prometheus_client")
        from prometheus_client import CollectorRegistry
        from prometheus_client import Counter
        from prometheus_client import Gauge
        from prometheus_client import start_http_server

        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._events = Counter("eventbus_events", "Events on the agent's bus, by type",
                               ["type"], registry=r)
        self._exits = Counter("eventbus_worker_exits", "Worker exits by exit code",
                              ["exit_code"], registry=r)
        self._restarts = Counter("eventbus_restarts", "Worker group restarts", registry=r)
        self._stalls = Counter("eventbus_stalls", "Stalled workers", registry=r)
        self._last_step = Gauge("eventbus_last_step", "Last METRIC step per rank", ["rank"],
                                registry=r)
        self._attempt = Gauge("eventbus_attempt", "The worker group's attempt", registry=r)
        self._goodput = Gauge("eventbus_goodput_ratio", "The job's goodput so far: the share "
                              "of its wall time that became kept progress", registry=r)
        self._badput = Gauge("eventbus_badput_seconds", "The job's wall time lost so far, "
                             "by cause", ["cause"], registry=r)
        #: a callable returning the job's goodput so far (an object with ``goodput_ratio``
        #: and ``badput_s``) or None: set by ``eventbus run`` (its one tracker of the bus)
        self.goodput_source: Callable[[], Any] | None = None
        self._figured = 0.0
        try:
            served: Any = start_http_server(port, addr=host, registry=r)
        except OSError as exc:
            raise SinkArgumentError(f"prometheus: cannot serve on {host}:{port} ({exc})") \
                from exc
        self._server = served[0] if isinstance(served, tuple) else None
        self.host = host
        #: the port actually served (the chosen one when asked for 0)
        self.port: int = self._server.server_address[1] if self._server else port
        super().__init__(label=f"{host}:{self.port}", settings=settings)

    def write(self, events: Sequence[Event]) -> None:
        for event in events:
            kind = str(event.type)
            self._events.labels(type=kind).inc()
            if kind == "WORKER_EXIT":
                self._exits.labels(exit_code=str(getattr(event, "exit_code", ""))).inc()
            elif kind == "WORKER_RESTART":
                self._restarts.inc()
                self._attempt.set(attempt_of(event))
            elif is_stall(event):
                self._stalls.inc()
            elif kind == "METRIC":
                step = getattr(event, "step", None)
                if isinstance(step, int) and event.rank is not None:
                    self._last_step.labels(rank=str(event.rank)).set(step)
        now = time.monotonic()
        ended = any(str(e.type) == "AGENT_EXIT" for e in events)
        if ended or now - self._figured >= 1.0:
            self._figured = now
            self._figure()

    def _figure(self) -> None:
        source = self.goodput_source
        result = source() if source is not None else None
        if result is None:
            return
        self._goodput.set(result.goodput_ratio)
        for cause, seconds in result.badput_s.items():
            self._badput.labels(cause=cause).set(seconds)

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
