"""What every sink shares: a bounded queue in front of the backend, a bounded close.

A sink is a plain subscriber (``callable(event)``): :class:`EventSink` *is* a
:class:`~eventbus.subscribers.queued.QueuedSink`, so ``record()`` (or the agent's monitor thread)
only appends to a bounded deque and the backend (a file writer, an HTTP exporter, a tracking
server) runs on the queue's own thread. A slow or dead backend costs dropped events, counted
per reason in :meth:`stats` (and so in the bus's ``stats()``) and reported rate-limited on
the ``eventbus`` logger; it never blocks the caller.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import ssl
import threading
import time
import urllib.error
import urllib.parse
from collections.abc import Sequence
from typing import Any
from typing import ClassVar

from eventbus._reporting import RateLimiter
from eventbus.app.sentences import sentence
from eventbus.app.sentences import stopped_by_agent
from eventbus.events import Event
from eventbus.events import WorkerStalled
from eventbus.subscribers.queued import QueuedSink
from eventbus.subscribers.queued import QueueSettings

__all__ = [
    "FAILURE_REPORT_INTERVAL_S",
    "MAX_FAILURE_REASONS",
    "OTHER_REASON",
    "REDACTED",
    "SINK_CLOSE_TIMEOUT_S",
    "SINK_QUEUE",
    "EventSink",
    "MissingExtraError",
    "SinkArgumentError",
    "attempt_of",
    "failure_reason",
    "is_stall",
    "numbers_of",
    "rank_of",
    "redact_text",
    "redact_uri",
    "require_extra",
    "resolve_target",
    "scrub_target",
    "sink_text",
]

logger = logging.getLogger("eventbus")

#: the default budget of one sink's ``close()``: flush the queue, then shut the backend
SINK_CLOSE_TIMEOUT_S = 5.0

#: the queue every built-in sink sits behind unless given ``settings``: 10 000 events held
#: at most, newest dropped when full, drops reported at most every 10 s
SINK_QUEUE = QueueSettings(max_events=10_000, max_bytes=16 * 1024 * 1024, max_batch=500,
                           flush_interval=0.2, close_timeout=SINK_CLOSE_TIMEOUT_S)


#: a delivery failure is reported once per reason, then at most once per this many seconds
#: per reason (with the count held back in between)
FAILURE_REPORT_INTERVAL_S = 60.0

#: distinct failure reasons a sink keeps (counters, report limiters); the rest are counted
#: under :data:`OTHER_REASON` (an exception text that varies per call cannot grow them)
MAX_FAILURE_REASONS = 32

#: the reason the failures past :data:`MAX_FAILURE_REASONS` distinct ones are counted under
OTHER_REASON = "other"

#: what a redacted part of a URI becomes
REDACTED = "***"


class SinkArgumentError(ValueError):
    """A sink's ``ARG`` is malformed (a port out of range, a URL without a scheme, ...)."""


class MissingExtraError(ImportError):
    """The optional dependency a sink needs is not installed; the message names the fix."""


def require_extra(sink: str, extra: str, *modules: str) -> None:
    """Import ``modules`` or raise :class:`MissingExtraError` naming ``extra``."""
    import importlib

    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise MissingExtraError(
                f"the {sink} sink needs the {extra!r} extra ({exc}): "
                f"pip install 'eventbus[{extra}]'") from exc


# -- secrets ------------------------------------------------------------------------------


def redact_uri(uri: str, *, keep_path: bool = True) -> str:
    """``uri`` fit to print: the password of ``user:password@`` (a bare ``token@``: all of
    it), the query and the fragment replaced by ``***``; with ``keep_path=False`` the path
    too (a chat webhook's URL carries its credential in the path:
    ``https://hooks.example.com/***``). Text that is no URI comes back unchanged."""
    try:
        parts = urllib.parse.urlsplit(uri)
    except ValueError:
        return redact_text(uri)
    if not parts.scheme or (not parts.netloc and "//" not in uri):
        # no scheme (``hooks.example.com/T0/B0/x``): what follows the first / is the path
        if not keep_path and "/" in uri.strip("/"):
            return uri.split("/", 1)[0] + "/" + REDACTED
        return redact_text(uri)
    netloc = parts.netloc
    if not netloc:  # sqlite:///x.db, file:/x: no host, no credential but in a query
        base = uri.split("?", 1)[0].split("#", 1)[0]
        return base + (f"?{REDACTED}" if parts.query else "")
    if "@" in netloc:
        user, _, host = netloc.rpartition("@")
        name, colon, _ = user.partition(":")
        netloc = f"{name}:{REDACTED}@{host}" if colon else f"{REDACTED}@{host}"
    path = parts.path
    if not keep_path and path not in ("", "/"):
        path = "/" + REDACTED
    return urllib.parse.urlunsplit((parts.scheme, netloc, path,
                                    REDACTED if parts.query else "",
                                    REDACTED if parts.fragment else ""))


# the userinfo runs to the last @ before the host's end (a password may hold an @)
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)([^/\s?#]*)@")


def _redact_userinfo(match: re.Match[str]) -> str:
    user, colon, _ = match[2].partition(":")
    return f"{match[1]}{user}:{REDACTED}@" if colon else f"{match[1]}{REDACTED}@"


def redact_text(text: str) -> str:
    """``text`` with the credentials of every ``scheme://user:password@`` in it replaced
    (an error message that quotes a URI, say)."""
    return _USERINFO.sub(_redact_userinfo, text)


def scrub_target(text: str, target: str | None, *, keep_path: bool = True) -> str:
    """``text`` (an exception's message, say) with a sink's own ``target`` hidden wherever
    it is quoted: the whole URL becomes its :func:`redact_uri` form, its query and password
    become ``***``, and so does its path unless ``keep_path`` (a webhook's path is its
    credential: ``Max retries exceeded with url: /services/T/B/***``)."""
    if not target:
        return redact_text(text)
    text = text.replace(target, redact_uri(target, keep_path=keep_path))
    try:
        parts = urllib.parse.urlsplit(target)
    except ValueError:
        return redact_text(text)
    secrets = []
    if not keep_path and len(parts.path) > 1:
        if parts.query:
            secrets.append(f"{parts.path}?{parts.query}")
        secrets.append(parts.path)
    if parts.query:
        secrets.append(parts.query)
    if parts.password:
        secrets.append(parts.password)
    for secret in secrets:
        if len(secret) >= 4:  # a shorter one would mangle the text; redact_text covers it
            text = text.replace(secret, REDACTED)
    return redact_text(text)


def resolve_target(sink: str, arg: str, *, default_env: str | None = None) -> tuple[str, str]:
    """A sink's target and where it came from: ``env:NAME`` is the value of the environment
    variable ``NAME`` (so a URL with a credential stays out of ``ps`` and shell history); an
    empty ``arg`` is ``$default_env`` (the variable the backend's own library reads) when
    the sink has one. Returns ``(target, origin)``, the origin being ``"env:NAME"`` or
    ``""``; :class:`SinkArgumentError` names the variable when it is unset or empty."""
    name = ""
    if arg.startswith("env:"):
        name = arg[4:]
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise SinkArgumentError(f"{sink}: env:{name} does not name an environment "
                                    f"variable; e.g. --sink {sink}:env:MY_{sink.upper()}_URL")
    elif not arg and default_env:
        name = default_env
    if not name:
        return arg, ""
    value = os.environ.get(name, "").strip()
    if not value:
        raise SinkArgumentError(f"{sink}: the environment variable {name} is not set (or "
                                f"empty); export {name}=... or give --sink {sink}:ARG")
    return value, f"env:{name}"


# -- delivery failures --------------------------------------------------------------------


def failure_reason(exc: BaseException) -> str:
    """Why a delivery failed, in a few words that are the same for the same cause:
    ``HTTP 501 Not Implemented``, ``connection refused``, ``timed out``, ``host not
    found``, ``TLS error``, else the exception's type and (redacted) message."""
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code} {exc.reason or ''}".rstrip()
    cause: BaseException = exc
    if isinstance(exc, urllib.error.URLError) and isinstance(exc.reason, BaseException):
        cause = exc.reason
    if isinstance(cause, ConnectionRefusedError):
        return "connection refused"
    if isinstance(cause, (TimeoutError, socket.timeout)):
        return "timed out"
    if isinstance(cause, socket.gaierror):
        return "host not found"
    if isinstance(cause, ssl.SSLError):
        return f"TLS error ({cause.reason or cause.__class__.__name__})"
    if isinstance(cause, ConnectionResetError):
        return "connection reset"
    # libraries built on requests/urllib3 (the OpenTelemetry exporter, MLflow's client)
    text = f"{type(cause).__name__}: {cause}"
    lowered = text.lower()
    if "connection refused" in lowered:
        return "connection refused"
    if "timed out" in lowered or "timeout" in lowered:
        return "timed out"
    status = getattr(getattr(cause, "response", None), "status_code", None)
    if isinstance(status, int):
        return f"HTTP {status}"
    first = redact_text(text.splitlines()[0] if text else type(cause).__name__)
    return first if len(first) <= 160 else first[:157] + "..."


def numbers_of(data: dict[str, Any]) -> dict[str, float]:
    """The real numbers of a ``METRIC``'s ``data`` (bools and non-numbers left out)."""
    out: dict[str, float] = {}
    for key, value in data.items():
        cls = value.__class__
        if cls is int or cls is float or (isinstance(value, (int, float))
                                          and not isinstance(value, bool)):
            out[str(key)] = float(value)
    return out


def is_stall(event: Event) -> bool:
    """Whether ``event`` reports a stalled worker."""
    return isinstance(event, WorkerStalled)


def rank_of(event: Event) -> int | None:
    """The worker rank an event is about: ``worker_id`` for the agent's worker events, the
    recording process's rank otherwise."""
    worker = getattr(event, "worker_id", None)
    if isinstance(worker, int) and not isinstance(worker, bool):
        return worker
    return event.rank


def attempt_of(event: Event) -> int:
    """The attempt an event belongs to (``WORKER_RESTART``: the new attempt)."""
    attempt = getattr(event, "attempt", None) if str(event.type) == "WORKER_RESTART" else None
    if isinstance(attempt, int):
        return attempt
    return event.restart_count or 0


def sink_text(event: Event, *, decision: str | None = None, host: bool = False) -> str:
    """What a sink writes for people about ``event``: its sentence
    (:func:`eventbus.app.sentences.sentence`), the agent's ``decision`` after it (never
    on a worker the agent stopped: the decision is the culprit's), then the attempt and
    the run, e.g. ``rank 1 failed (exit code 3: boom); the group restarts as attempt 1 (0
    restarts left) [attempt 0, run 7f3a]``. ``host``: the rank named with its host
    (``rank 1 on node-17 failed ...``), as the alerting sinks (webhook, W&B) say it."""
    text = sentence(event, host=host)
    if decision and not stopped_by_agent(event):
        text += f"; {decision}"
    tags = [f"attempt {attempt_of(event)}"]
    if event.run_id:
        tags.append(f"run {event.run_id}")
    return f"{text} [{', '.join(tags)}]"


class EventSink(QueuedSink):
    """Base of the built-in sinks: a :class:`QueuedSink` whose batches go to :meth:`write`.

    Subclasses implement ``write(events)`` (on the queue's thread) and may implement
    ``shutdown()`` (release the backend). :meth:`close` spends at most its ``timeout`` on
    both together: what the queue still holds when the budget runs out is counted as dropped
    ("closed before delivery"), and a backend shutdown still running then is left to its
    daemon thread.
    """

    #: the sink's name on the command line (``--sink NAME:ARG``)
    kind: ClassVar[str] = "sink"

    def __init__(self, *, label: str, settings: QueueSettings | None = None,
                 target: str | None = None, target_path_secret: bool = False,
                 **options: Any) -> None:
        # the backend's URL, hidden in every failure reason (an exception may quote it)
        self._target = target
        self._target_keep_path = not target_path_secret
        #: reason -> how many deliveries failed for it (also in ``stats()["failures"]``)
        self.failures: dict[str, int] = {}
        self._failure_reports: dict[str, RateLimiter] = {}
        super().__init__(self._write_batch, name=f"{self.kind}:{label}",
                         settings=settings or SINK_QUEUE, **options)
        self._shut = False

    def _write_batch(self, events: Sequence[Event]) -> None:
        try:
            self.write(events)
        except Exception as exc:
            # The backend failed (a tracking server down, a full disk): the events are
            # dropped for that reason, reported once per reason, never a traceback a batch.
            self.delivery_failed(failure_reason(exc), len(events))

    def delivery_failed(self, reason: str, n: int, *, what: str = "delivery failed") -> None:
        """Count ``n`` events lost to ``reason`` (as dropped, ``"<what>: <reason>"``) and
        report it: the first time for each reason at once, then at most once per
        :data:`FAILURE_REPORT_INTERVAL_S` per reason, with the count held back since.
        Past :data:`MAX_FAILURE_REASONS` distinct reasons a new one is counted (and
        rate-limited) as :data:`OTHER_REASON`; its warning still says the reason."""
        reason = scrub_target(reason, self._target, keep_path=self._target_keep_path)
        with self._cond:
            counted = reason
            if reason not in self.failures and len(self.failures) >= MAX_FAILURE_REASONS:
                counted = OTHER_REASON
            self._drop(f"{what}: {counted}", n)
            self.failures[counted] = self.failures.get(counted, 0) + 1
            limiter = self._failure_reports.get(counted)
            if limiter is None:
                limiter = self._failure_reports[counted] = RateLimiter()
            held = limiter.allow(FAILURE_REPORT_INTERVAL_S)
        if held is not None:
            more = f"; {held} more since the last report" if held else ""
            lost = f"; {n} event(s) dropped" if n else ""
            logger.warning("sink %s: %s (%s)%s%s", self.name, what, reason, more, lost)

    def write(self, events: Sequence[Event]) -> None:
        """Hand ``events`` to the backend (runs on the queue's thread)."""
        raise NotImplementedError

    def count_lost(self, reason: str, n: int) -> None:
        """Count ``n`` events the backend lost after the queue handed them over (an
        exporter's failed batch, say), as dropped for ``reason``; callable from any thread."""
        reason = scrub_target(reason, self._target, keep_path=self._target_keep_path)
        with self._cond:
            self._drop(reason, n)

    def shutdown(self) -> None:
        """Release the backend: flush its own buffers, stop its server (may block)."""

    def close(self, timeout: float | None = None) -> bool:
        """Deliver what is queued and shut the backend, within ``timeout`` in all (default
        the settings' ``close_timeout``). True when everything was delivered in time."""
        budget = self.settings.close_timeout if timeout is None else timeout
        deadline = time.monotonic() + budget
        # Most of the budget for the queue, the rest (at least a fifth) for the backend.
        delivered = super().close(budget * 0.8)
        if self._shut:
            return delivered
        self._shut = True
        done = threading.Event()

        def shut() -> None:
            try:
                self.shutdown()
            except Exception:
                logger.exception("sink %s failed to shut down", self.name)
            else:
                done.set()

        thread = threading.Thread(target=shut, name=f"eventbus-sink-close:{self.name}",
                                  daemon=True)
        thread.start()
        thread.join(max(0.0, deadline - time.monotonic()))
        if not done.is_set():
            logger.warning("sink %s: the backend did not shut down within %.1f s; left behind",
                           self.name, budget)
        return delivered and done.is_set()

    def stats(self) -> dict[str, Any]:
        """The queue's counts, and ``failures``: reason -> failed deliveries."""
        out = super().stats()
        with self._cond:
            out["failures"] = dict(self.failures)
        return out

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} pending={self.pending}>"
