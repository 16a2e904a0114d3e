"""``webhook:URL``: failures, stalls, restarts, an unsuccessful end and a stuck job POSTed
as JSON.

Stdlib only (``urllib``). Each post's body is ``{"text": ..., "event": ...}``: ``text`` is
one readable sentence (the event's sentence, :func:`eventbus.app.sentences.sentence`,
naming the rank with its host, ``rank 5 on node-17``, with what the agent decided, the
attempt and the run: what Slack-compatible incoming webhooks display) and ``event`` the
event's ``to_dict()``. ``JOB_STUCK`` and ``JOB_UNSTUCK`` (``eventbus run
--alert-after``) are posted as they come.
A failed worker's post waits for the agent's decision (the ``WORKER_RESTART`` or
``AGENT_EXIT`` that follows it, in the same or the next batch) and says it; a restart that
follows failures already posted with it is not posted again.

Delivery, on the sink's own thread: each POST gives up after ``timeout`` seconds
(default 5) and is retried ``retries`` times (default 2) with exponential backoff from
``backoff`` seconds (0.5, 1, ...); at most ``max_per_minute`` posts (default
:data:`WEBHOOK_MAX_PER_MINUTE`) start in any minute: a post over the limit, or one that
still failed after its retries, is dropped and counted in ``stats()["dropped"]`` (reasons
``"rate limited"`` and ``"post failed: <why>"``, the why being ``HTTP 501 Not
Implemented``, ``connection refused``, ``timed out``, ...; ``stats()["failures"]`` counts
the whys). Each why is reported on the ``eventbus`` logger the first time, then at most once
a minute. Closing stops retries at once.

The URL is a credential for most chat services (Slack's carries its token in the path):
it is never printed. The sink's name, its messages and its repr show
``https://HOST/***``; ``URL`` may be ``env:NAME`` to read it from the environment variable
``NAME``, out of ``ps`` and shell history.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from eventbus.app.sentences import sentence
from eventbus.app.sinks.base import SINK_QUEUE
from eventbus.app.sinks.base import EventSink
from eventbus.app.sinks.base import failure_reason
from eventbus.app.sinks.base import is_stall
from eventbus.app.sinks.base import redact_uri
from eventbus.app.sinks.base import resolve_target
from eventbus.app.sinks.base import sink_text
from eventbus.app.sinks.otlp import check_url
from eventbus.events import Event
from eventbus.subscribers.queued import QueueSettings

__all__ = ["WEBHOOK_MAX_PER_MINUTE", "WebhookSink"]

logger = logging.getLogger("eventbus")

#: the types a post may come from (with WORKER_STALLED)
_POSTED_TYPES = frozenset({"WORKER_EXIT", "WORKER_STALLED", "WORKER_RESTART", "AGENT_EXIT",
                           "JOB_STUCK", "JOB_UNSTUCK"})

#: posts started per minute at most, by default
WEBHOOK_MAX_PER_MINUTE = 20


class WebhookSink(EventSink):
    """``WebhookSink(URL)``: see the module docstring."""

    kind = "webhook"

    def __init__(self, url: str, *, settings: QueueSettings | None = None,
                 timeout: float = 5.0, retries: int = 2, backoff: float = 0.5,
                 max_per_minute: int = WEBHOOK_MAX_PER_MINUTE) -> None:
        target, origin = resolve_target("webhook", url)
        self.url = check_url("webhook", target, keep_path=False,
                             example="https://hooks.example.com/services/T0/B0/XXXX (or "
                                     "--sink webhook:env:WEBHOOK_URL)")
        #: the URL fit to print: its host, never its path nor query (the credential)
        self.shown_url = redact_uri(self.url, keep_path=False)
        label = f"{origin}={self.shown_url}" if origin else self.shown_url
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self.max_per_minute = max_per_minute
        self.posted = 0
        self._starts: collections.deque[float] = collections.deque()
        self._pending: list[Event] = []  # failed exits waiting for the agent's decision
        self._closing = threading.Event()
        # One event per batch: what is not posted when close() gives up stays queued, and
        # is counted as dropped ("closed before delivery") rather than lost in flight.
        super().__init__(label=label, settings=settings or SINK_QUEUE, max_batch=1,
                         target=self.url, target_path_secret=True)

    def __call__(self, event: Event) -> None:
        """Enqueue the events a post may come from; the rest (metrics, ...) never queue."""
        kind = str(event.type)
        if kind in _POSTED_TYPES:
            super().__call__(event)

    def write(self, events: Sequence[Event]) -> None:
        for event in events:
            kind = str(event.type)
            if kind == "WORKER_EXIT" and event.is_failure:
                self._pending.append(event)
            elif is_stall(event) or kind in ("JOB_STUCK", "JOB_UNSTUCK"):
                self._post(sink_text(event, host=True), event)
            elif kind == "WORKER_RESTART":
                if self._pending:
                    # the decision is the restart's own sentence, without its reason:
                    # the failure it would repeat is the post's subject
                    self._post_pending(sentence(event, short=True))
                else:
                    self._post(sink_text(event, host=True), event)
            elif kind == "AGENT_EXIT":
                self._post_pending(sentence(event, short=True))
                if event.is_failure:
                    self._post(sink_text(event, host=True), event)

    def _post_pending(self, decision: str) -> None:
        pending, self._pending = self._pending, []
        for event in pending:
            self._post(sink_text(event, decision=decision, host=True), event)

    def _post(self, text: str, event: Event) -> None:
        now = time.monotonic()
        while self._starts and now - self._starts[0] >= 60.0:
            self._starts.popleft()
        if len(self._starts) >= self.max_per_minute:
            self._drop("rate limited", 1)
            return
        self._starts.append(now)
        body = json.dumps({"text": text, "event": event.to_dict()}, default=str).encode()
        delay = self.backoff
        reason = "not tried: the sink was closing"
        for attempt in range(self.retries + 1):
            if self._closing.is_set() and attempt:
                break
            try:
                request = urllib.request.Request(
                    self.url, data=body, method="POST",
                    headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    response.read()
                self.posted += 1
                return
            except (OSError, urllib.error.URLError, ValueError) as exc:
                reason = failure_reason(exc)
                if reason == "timed out":
                    reason = f"timed out after {self.timeout:g} s"
            if attempt < self.retries and self._closing.wait(delay):
                break
            delay *= 2
        self.delivery_failed(reason, 1, what="post failed")

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        out["posted"] = self.posted
        return out

    def close(self, timeout: float | None = None) -> bool:
        self._closing.set()  # no more retries nor backoff waits
        return super().close(timeout)

    def shutdown(self) -> None:
        # Failures still waiting for a decision go out with what is known (one try each).
        self._post_pending("the agent's decision was not seen")
