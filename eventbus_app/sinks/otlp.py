"""``otlp:URL``: OpenTelemetry traces and metrics over OTLP/HTTP (protobuf).

``URL`` is the collector's base URL: spans go to ``URL/v1/traces``, metrics to
``URL/v1/metrics`` (the ``otel`` extra: ``opentelemetry-sdk`` and
``opentelemetry-exporter-otlp-proto-http``). Spans, with the events' own timestamps:

* ``eventbus job`` from ``AGENT_START`` to ``AGENT_EXIT`` (status ERROR when it failed);
* ``eventbus attempt <n>``, a child of the job, per attempt of the worker group;
* ``eventbus worker <rank>``, a child of its attempt, from ``WORKER_START`` to
  ``WORKER_EXIT``, with ``eventbus.rank``, ``eventbus.attempt``, ``process.pid``,
  ``eventbus.exit_code`` and ``eventbus.signal``; status ERROR for a failed or stalled worker.
  Workers' ``METRIC``, epoch and checkpoint events are span events of their worker's span.

Spans of a failed export are counted as dropped (``"export failed: <why>"``, the why being
``HTTP 503 Service Unavailable``, ``connection refused``, ``timed out``, ...) in
``stats()``, and each why is reported once on the ``eventbus`` logger (then at most once a
minute); the counters are cumulative, so a failed metrics export is made up by the next one
(its why is counted in ``stats()["failures"]`` all the same).

``URL`` may be empty (``--sink otlp``) to use ``$OTEL_EXPORTER_OTLP_ENDPOINT``, or
``env:NAME``. Headers (an API key) come from ``$OTEL_EXPORTER_OTLP_HEADERS``, which the
exporter reads itself; eventbus never prints them, and shows the URL without its
``user:password@`` and query.
Counters (monotonic sums): ``eventbus.events`` by ``type``, ``eventbus.worker.exits`` by
``exit_code``, ``eventbus.restarts``, ``eventbus.stalls``; gauges, when ``eventbus run``
gave the sink the job's figure (:attr:`OtlpSink.goodput_source`): ``eventbus.goodput.ratio``
and ``eventbus.badput.seconds`` by ``cause`` (docs/goodput.md). Spans are batched; metrics are
exported every ``export_interval`` seconds and at close. :meth:`close` flushes both within
its budget (default :data:`OTLP_CLOSE_TIMEOUT_S`); each HTTP export gives up after
``export_timeout`` seconds.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import urllib.parse
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any

from eventbus.app.sentences import sentence
from eventbus.app.sinks.base import EventSink
from eventbus.app.sinks.base import SinkArgumentError
from eventbus.app.sinks.base import attempt_of
from eventbus.app.sinks.base import failure_reason
from eventbus.app.sinks.base import is_stall
from eventbus.app.sinks.base import numbers_of
from eventbus.app.sinks.base import rank_of
from eventbus.app.sinks.base import redact_uri
from eventbus.app.sinks.base import require_extra
from eventbus.app.sinks.base import resolve_target
from eventbus.events import Event
from eventbus.subscribers.queued import QueueSettings

__all__ = ["OTLP_CLOSE_TIMEOUT_S", "OtlpSink", "check_url"]

#: the default budget of close(): the last spans and metrics exported, or given up
OTLP_CLOSE_TIMEOUT_S = 5.0

_SPAN_EVENT_TYPES = frozenset({"METRIC", "EPOCH_START", "EPOCH_END", "CHECKPOINT_SAVED"})


def check_url(sink: str, url: str, *, example: str = "http://127.0.0.1:4318",
              keep_path: bool = True) -> str:
    """``url`` without a trailing slash, or :class:`SinkArgumentError` naming the sink and
    showing ``url`` redacted (``keep_path=False``: its path too, see
    :func:`~eventbus.app.sinks.base.redact_uri`)."""
    try:
        parsed = urllib.parse.urlsplit(url)
    except ValueError:
        parsed = urllib.parse.urlsplit("")
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        shown = redact_uri(url, keep_path=keep_path)
        raise SinkArgumentError(f"{sink}: {shown!r} is not an http(s) URL; e.g. "
                                f"--sink {sink}:{example}")
    return url.rstrip("/")


def _ns(timestamp: float) -> int:
    return int(timestamp * 1e9)


#: the loggers the OTLP/HTTP exporters report a failed export on, once per export
_EXPORTER_LOGGERS = ("opentelemetry.exporter.otlp.proto.http.trace_exporter",
                     "opentelemetry.exporter.otlp.proto.http.metric_exporter",
                     "opentelemetry.exporter.otlp.common.http")


class _Quiet(logging.Filter):
    """Drops what the exporters log while one of this module's sinks exports on the
    current thread: the sink reports the reason itself, once per reason
    (:meth:`~eventbus.app.sinks.base.EventSink.delivery_failed`), where the library would
    log every failed export. Anything logged outside such an export passes."""

    def __init__(self) -> None:
        super().__init__()
        self.local = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(self.local, "exporting", False)

    @contextlib.contextmanager
    def exporting(self) -> Iterator[None]:
        before = getattr(self.local, "exporting", False)
        self.local.exporting = True
        try:
            yield
        finally:
            self.local.exporting = before


_QUIET = _Quiet()


def _quiet_exporter_loggers() -> None:
    for name in _EXPORTER_LOGGERS:
        found = logging.getLogger(name)
        if _QUIET not in found.filters:
            found.addFilter(_QUIET)


class _LastResult:
    """Why an exporter's last export failed: its HTTP client's result, read by wrapping
    the client's ``export`` where the exporter has one (opentelemetry-exporter-otlp 1.3x);
    else no why is known beyond "export failed"."""

    def __init__(self, exporter: Any) -> None:
        self.reason: str | None = None
        client: Any = getattr(exporter, "_client", None)
        export = getattr(client, "export", None)
        if not callable(export):
            return

        def remembering(data: bytes) -> Any:
            self.reason = None
            result = export(data)
            if not getattr(result, "success", True):
                code = getattr(result, "status_code", None)
                error = getattr(result, "error", None)
                if isinstance(code, int):
                    self.reason = f"HTTP {code} {getattr(result, 'reason', None) or ''}".rstrip()
                elif isinstance(error, BaseException):
                    self.reason = failure_reason(error)
            return result

        # a slotted client refuses: no why beyond the failure then
        with contextlib.suppress(AttributeError, TypeError):
            client.export = remembering

    def take(self) -> str:
        reason, self.reason = self.reason, None
        return reason or "the exporter reported a failure"


def _counting(exporter: Any, sink: OtlpSink) -> Any:
    """``exporter`` whose failed exports count their spans as dropped ("export failed: why")
    in ``sink``'s stats: the SDK's batch processor would otherwise lose them silently."""
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.sdk.trace.export import SpanExportResult

    last = _LastResult(exporter)

    class Counting(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            try:
                with _QUIET.exporting():
                    result: SpanExportResult = exporter.export(spans)
            except Exception as exc:
                result = SpanExportResult.FAILURE
                last.reason = failure_reason(exc)
            if result is not SpanExportResult.SUCCESS:
                sink.delivery_failed(last.take(), len(spans), what="export failed")
            return result

        def shutdown(self) -> None:
            exporter.shutdown()

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return bool(exporter.force_flush(timeout_millis))

    return Counting()


def _noting(exporter: Any, sink: OtlpSink) -> Any:
    """The metric ``exporter`` with its failures' whys counted in ``sink``'s stats (no
    event is lost: the counters are cumulative, the next export makes up for it)."""
    last = _LastResult(exporter)
    export = exporter.export

    def noting(metrics_data: Any, *args: Any, **kwargs: Any) -> Any:
        from opentelemetry.sdk.metrics.export import MetricExportResult

        try:
            with _QUIET.exporting():
                result = export(metrics_data, *args, **kwargs)
        except Exception as exc:
            last.reason = failure_reason(exc)
            result = MetricExportResult.FAILURE
        if result is not MetricExportResult.SUCCESS:
            sink.delivery_failed(last.take(), 0, what="metrics export failed")
        return result

    exporter.export = noting
    return exporter


class OtlpSink(EventSink):
    """``OtlpSink(URL)``: see the module docstring."""

    kind = "otlp"

    def __init__(self, url: str, *, settings: QueueSettings | None = None,
                 export_timeout: float = 2.0, export_interval: float = 5.0,
                 service_name: str = "eventbus") -> None:
        target, origin = resolve_target("otlp", url, default_env="OTEL_EXPORTER_OTLP_ENDPOINT")
        self.url = check_url("otlp", target)
        shown = redact_uri(self.url)
        require_extra("otlp", "otel", "opentelemetry.sdk.trace",
                      "opentelemetry.exporter.otlp.proto.http.trace_exporter")
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        _quiet_exporter_loggers()
        resource = Resource.create({"service.name": service_name})
        self._tracer_provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        self._tracer_provider.add_span_processor(BatchSpanProcessor(
            _counting(OTLPSpanExporter(endpoint=f"{self.url}/v1/traces",
                                       timeout=export_timeout), self),
            schedule_delay_millis=int(export_interval * 1000),
            export_timeout_millis=int(export_timeout * 1000)))
        reader = PeriodicExportingMetricReader(
            _noting(OTLPMetricExporter(endpoint=f"{self.url}/v1/metrics",
                                       timeout=export_timeout), self),
            export_interval_millis=export_interval * 1000,
            export_timeout_millis=export_timeout * 1000)
        self._meter_provider = MeterProvider(resource=resource, metric_readers=[reader],
                                             shutdown_on_exit=False)
        self._tracer = self._tracer_provider.get_tracer("eventbus")
        meter = self._meter_provider.get_meter("eventbus")
        self._events = meter.create_counter("eventbus.events", description="events by type")
        self._exits = meter.create_counter("eventbus.worker.exits",
                                           description="worker exits by exit code")
        self._restarts = meter.create_counter("eventbus.restarts",
                                              description="worker group restarts")
        self._stalls = meter.create_counter("eventbus.stalls", description="stalled workers")
        #: a callable returning the job's goodput so far (``goodput_ratio``, ``badput_s``)
        #: or None: set by ``eventbus run`` (its one tracker of the bus); read at export
        self.goodput_source: Any = None
        meter.create_observable_gauge(
            "eventbus.goodput.ratio", callbacks=[self._observe_ratio],
            description="the job's goodput so far: the share of its wall time kept")
        meter.create_observable_gauge(
            "eventbus.badput.seconds", callbacks=[self._observe_badput], unit="s",
            description="the job's wall time lost so far, by cause")
        self._job: Any = None
        self._attempts: dict[int, Any] = {}
        self._workers: dict[tuple[int, int], Any] = {}  # (attempt, rank) -> span
        super().__init__(label=f"{origin}={shown}" if origin else shown, settings=settings,
                         target=self.url)

    # -- goodput (docs/goodput.md), observed at each export --------------------------------
    def _figure(self) -> Any:
        source = self.goodput_source
        if source is None:
            return None
        try:
            return source()
        except Exception:
            logging.getLogger("eventbus").exception("otlp: the goodput figure failed")
            return None

    def _observe_ratio(self, options: Any) -> list[Any]:
        from opentelemetry.metrics import Observation

        figure = self._figure()
        return [] if figure is None else [Observation(figure.goodput_ratio)]

    def _observe_badput(self, options: Any) -> list[Any]:
        from opentelemetry.metrics import Observation

        figure = self._figure()
        if figure is None:
            return []
        return [Observation(seconds, {"cause": cause})
                for cause, seconds in figure.badput_s.items()]

    # -- spans --------------------------------------------------------------------------
    def _job_span(self, event: Event) -> Any:
        if self._job is None:
            self._job = self._tracer.start_span(
                "eventbus job", start_time=_ns(event.timestamp),
                attributes={"eventbus.run_id": event.run_id or ""})
        return self._job

    def _attempt_span(self, attempt: int, event: Event) -> Any:
        span = self._attempts.get(attempt)
        if span is None:
            from opentelemetry import trace

            ctx = trace.set_span_in_context(self._job_span(event))
            span = self._tracer.start_span(f"eventbus attempt {attempt}", context=ctx,
                                           start_time=_ns(event.timestamp),
                                           attributes={"eventbus.attempt": attempt})
            self._attempts[attempt] = span
        return span

    def _worker_span(self, attempt: int, rank: int, event: Event) -> Any:
        span = self._workers.get((attempt, rank))
        if span is None:
            from opentelemetry import trace

            ctx = trace.set_span_in_context(self._attempt_span(attempt, event))
            span = self._tracer.start_span(
                f"eventbus worker {rank}", context=ctx, start_time=_ns(event.timestamp),
                attributes={"eventbus.rank": rank, "eventbus.attempt": attempt})
            self._workers[(attempt, rank)] = span
        return span

    def _end_attempt(self, attempt: int, end: int) -> None:
        for key in [k for k in self._workers if k[0] == attempt]:
            self._workers.pop(key).end(end_time=end)
        span = self._attempts.pop(attempt, None)
        if span is not None:
            span.end(end_time=end)

    def write(self, events: Sequence[Event]) -> None:
        from opentelemetry.trace import Status
        from opentelemetry.trace import StatusCode

        for event in events:
            kind = str(event.type)
            self._events.add(1, {"type": kind})
            attempt = attempt_of(event)
            if kind == "AGENT_START":
                self._job_span(event)
            elif kind == "WORKER_START":
                span = self._worker_span(attempt, rank_of(event) or 0, event)
                pid = getattr(event, "worker_pid", None)
                if pid is not None:
                    span.set_attribute("process.pid", pid)
            elif kind == "WORKER_EXIT":
                code = int(getattr(event, "exit_code", 0))
                self._exits.add(1, {"exit_code": str(code)})
                rank = rank_of(event) or 0
                span = self._worker_span(attempt, rank, event)
                pid = getattr(event, "worker_pid", None)
                if pid is not None:
                    span.set_attribute("process.pid", pid)
                span.set_attribute("eventbus.exit_code", code)
                if getattr(event, "signal", None):
                    span.set_attribute("eventbus.signal", str(event.signal))  # type: ignore[attr-defined]
                if code != 0:
                    span.set_status(Status(StatusCode.ERROR, sentence(event)))
                span.end(end_time=_ns(event.timestamp))
                del self._workers[(attempt, rank)]
            elif is_stall(event):
                self._stalls.add(1)
                span = self._worker_span(attempt, rank_of(event) or 0, event)
                span.add_event("WORKER_STALLED", timestamp=_ns(event.timestamp))
                span.set_status(Status(StatusCode.ERROR, sentence(event)))
            elif kind == "WORKER_RESTART":
                self._restarts.add(1)
                self._end_attempt(attempt - 1, _ns(event.timestamp))
                self._attempt_span(attempt, event)
            elif kind == "AGENT_EXIT":
                end = _ns(event.timestamp)
                for open_attempt in list(self._attempts):
                    self._end_attempt(open_attempt, end)
                job = self._job_span(event)
                if event.is_failure:
                    job.set_status(Status(StatusCode.ERROR, sentence(event)))
                job.set_attribute("eventbus.state", str(getattr(event, "state", "")))
                job.end(end_time=end)
                self._job = None
            elif kind in _SPAN_EVENT_TYPES and event.rank is not None:
                attributes: dict[str, Any] = dict(numbers_of(event.data))
                step = getattr(event, "step", None)
                if isinstance(step, int):
                    attributes["step"] = step
                self._worker_span(attempt, event.rank, event).add_event(
                    kind, attributes=attributes, timestamp=_ns(event.timestamp))

    def shutdown(self) -> None:
        # Spans still open (no AGENT_EXIT seen: the agent was killed) end now.
        import time

        now = _ns(time.time())
        for open_attempt in list(self._attempts):
            self._end_attempt(open_attempt, now)
        for span in self._workers.values():
            span.end(end_time=now)
        if self._job is not None:
            self._job.end(end_time=now)
        self._tracer_provider.shutdown()
        self._meter_provider.shutdown()
