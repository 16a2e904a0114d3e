"""Why a sink's delivery failed, said once per reason; secrets never printed (docs/sinks.md)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from eventbus.app.sinks import SinkError
from eventbus.app.sinks import make_sink
from eventbus.app.sinks.base import failure_reason
from eventbus.app.sinks.base import redact_text
from eventbus.app.sinks.base import redact_uri
from eventbus.bus import ALL
from eventbus.bus import Bus
from tests.launcher_helpers import JOB_TIMEOUT_S
from tests.launcher_helpers import JOBS
from tests.launcher_helpers import job_env
from tests.sink_helpers import free_port
from tests.sink_helpers import make_event
from tests.sink_helpers import receiver

SECRET = "SECRETTOKEN123"


@pytest.mark.parametrize(("uri", "keep_path", "shown"), [
    ("https://hooks.example.com/services/T0/B0/" + SECRET, False, "https://hooks.example.com/***"),
    ("https://hooks.example.com/hook?token=" + SECRET, False, "https://hooks.example.com/***?***"),
    ("http://user:" + SECRET + "@mlflow.example:5000/x", True, "http://user:***@mlflow.example:5000/x"),
    ("https://" + SECRET + "@collector.example", True, "https://***@collector.example"),
    ("http://127.0.0.1:4318/v1?key=" + SECRET, True, "http://127.0.0.1:4318/v1?***"),
    ("file:///tmp/mlruns", True, "file:///tmp/mlruns"),
    ("runs/tb", True, "runs/tb"),
])
def test_redact_uri_hides_credentials(uri: str, keep_path: bool, shown: str) -> None:
    """user:password@, query and (for a webhook) the path become ***; the rest stays."""
    assert redact_uri(uri, keep_path=keep_path) == shown


def test_redact_text_hides_userinfo_inside_a_message() -> None:
    """A URI quoted inside a message keeps its user, loses its password."""
    text = f"could not reach postgresql://admin:{SECRET}@db:5432/mlflow (refused)"
    assert redact_text(text) == "could not reach postgresql://admin:***@db:5432/mlflow (refused)"


def test_redact_text_hides_a_password_holding_an_at_sign() -> None:
    """The userinfo runs to the last @ before the host: no tail of the password is left."""
    assert redact_text("https://user:p@ss@host/x") == "https://user:***@host/x"
    assert redact_text(f"go to https://user:{SECRET}@a@b@host:1/x?q=a@b now") == \
        "go to https://user:***@host:1/x?q=a@b now"
    assert redact_text("https://tok@en@host/") == "https://***@host/"


def test_a_failure_quoting_the_webhook_url_never_shows_its_path(
        caplog: pytest.LogCaptureFixture) -> None:
    """An exception that quotes the sink's own URL or its path (http.client.InvalidURL,
    requests' 'Max retries exceeded with url: /services/...') leaves the credential out of
    the warning, the dropped and failures keys."""
    import http.client

    from eventbus.app.sinks.webhook import WebhookSink

    caplog.set_level(logging.WARNING, logger="eventbus")
    url = f"https://hooks.example.com/services/T/B/{SECRET}"
    sink = WebhookSink(url + "?key=" + SECRET + "Q")
    try:
        errors = [
            http.client.InvalidURL(f"URL can't contain control characters. '/services/T/B/"
                                   f"{SECRET}?key={SECRET}Q x' (found at least ' ')"),
            OSError("HTTPSConnectionPool(host='hooks.example.com', port=443): Max retries "
                    f"exceeded with url: /services/T/B/{SECRET}?key={SECRET}Q (Caused by "
                    "ProxyError('Unable to connect to proxy'))"),
            ValueError(f"bad target {url}?key={SECRET}Q"),
        ]
        for exc in errors:
            sink.delivery_failed(failure_reason(exc), 1, what="post failed")
        stats = sink.stats()
    finally:
        sink.close(timeout=1.0)
    assert len(stats["failures"]) == 3, stats
    everything = " ".join([*(rec.getMessage() for rec in caplog.records),
                           json.dumps(stats)])
    assert SECRET not in everything and "/services/T" not in everything
    assert "Max retries exceeded with url: ***" in everything
    assert "bad target https://hooks.example.com/***?***" in everything


def test_distinct_failure_reasons_are_capped() -> None:
    """Reasons that differ per call (an exception quoting a request id) keep at most
    MAX_FAILURE_REASONS counters; the rest are counted under 'other', none lost."""
    from eventbus.app.sinks.base import MAX_FAILURE_REASONS
    from eventbus.app.sinks.webhook import WebhookSink

    sink = WebhookSink("https://hooks.example.com/x")
    try:
        for i in range(MAX_FAILURE_REASONS + 20):
            sink.delivery_failed(f"RuntimeError: request {i} failed", 2, what="post failed")
        sink.delivery_failed("RuntimeError: request 0 failed", 1, what="post failed")
        stats = sink.stats()
    finally:
        sink.close(timeout=1.0)
    assert len(stats["failures"]) == MAX_FAILURE_REASONS + 1
    assert stats["failures"]["other"] == 20
    assert stats["failures"]["RuntimeError: request 0 failed"] == 2  # a known one still counts
    assert stats["dropped"]["post failed: other"] == 40
    assert sum(stats["dropped"].values()) == 2 * (MAX_FAILURE_REASONS + 20) + 1
    assert len(sink._failure_reports) == MAX_FAILURE_REASONS + 1


def test_webhook_says_http_status_once_and_counts_it(caplog: pytest.LogCaptureFixture) -> None:
    """A receiver answering 501: dropped as 'post failed: HTTP 501 Not Implemented', counted in
    stats()['failures'], reported once (not once per post), the URL's path never shown."""
    caplog.set_level(logging.WARNING, logger="eventbus")
    with receiver(status=501) as r:
        sink = make_sink(f"webhook:{r.url}/services/T0/B0/{SECRET}")
        sink.retries, sink.backoff = 1, 0.01
        for _ in range(3):
            sink(make_event("AGENT_EXIT", state="FAILED", reason="x"))
        sink.close(timeout=10.0)
        assert len(r.requests) >= 3  # every post tried (retries stop once closing)
    stats = sink.stats()
    assert stats["dropped"] == {"post failed: HTTP 501 Not Implemented": 3}, stats
    assert stats["failures"] == {"HTTP 501 Not Implemented": 3}
    reports = [rec.getMessage() for rec in caplog.records
               if "post failed (HTTP 501 Not Implemented)" in rec.getMessage()]
    assert len(reports) == 1, reports  # once per reason, not once per post
    everything = " ".join([*(rec.getMessage() for rec in caplog.records), repr(sink),
                           json.dumps(stats), sink.name])
    assert SECRET not in everything
    assert "/services" not in everything


def test_webhook_connection_refused_and_timeout_are_named() -> None:
    """No server: 'connection refused'; a server slower than the timeout: 'timed out after'."""
    sink = make_sink(f"webhook:http://127.0.0.1:{free_port()}/x")
    sink.retries = 0
    sink(make_event("AGENT_EXIT", state="FAILED", reason="x"))
    sink.close(timeout=5.0)
    assert sink.stats()["failures"] == {"connection refused": 1}
    with receiver(delay=2.0) as r:
        from eventbus.app.sinks.webhook import WebhookSink

        slow = WebhookSink(r.url, timeout=0.3, retries=0)
        slow(make_event("AGENT_EXIT", state="FAILED", reason="x"))
        slow.close(timeout=5.0)
    assert slow.stats()["failures"] == {"timed out after 0.3 s": 1}


def test_failure_reason_of_common_errors() -> None:
    """Common delivery errors read as the same few words, credentials redacted."""
    import urllib.error

    assert failure_reason(urllib.error.URLError(ConnectionRefusedError(111, "x"))) == \
        "connection refused"
    assert failure_reason(urllib.error.URLError(TimeoutError("timed out"))) == "timed out"
    assert failure_reason(ValueError(f"bad uri http://u:{SECRET}@h/")) == \
        "ValueError: bad uri http://u:***@h/"


def test_a_sink_target_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """--sink webhook:env:NAME reads the URL from $NAME; an unset one names the variable."""
    with receiver() as r:
        monkeypatch.setenv("TEAM_WEBHOOK", f"{r.url}/hook/{SECRET}")
        sink = make_sink("webhook:env:TEAM_WEBHOOK")
        sink(make_event("AGENT_EXIT", state="FAILED", reason="x"))
        assert sink.close(timeout=10.0)
        assert [path for path, _ in r.requests] == [f"/hook/{SECRET}"]
    assert sink.name.startswith("webhook:env:TEAM_WEBHOOK=http://127.0.0.1:")
    assert SECRET not in sink.name + repr(sink) + json.dumps(sink.stats())
    bus = Bus("secrets-test")
    bus.subscribe(ALL, on_event=sink)
    assert SECRET not in json.dumps(bus.stats(), default=repr)  # what the job view's page shows
    monkeypatch.delenv("TEAM_WEBHOOK")
    with pytest.raises(SinkError) as info:
        make_sink("webhook:env:TEAM_WEBHOOK")
    assert "TEAM_WEBHOOK is not set" in str(info.value)


def test_otlp_and_mlflow_read_their_librarys_variables(monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path) -> None:
    """--sink otlp / --sink mlflow (no ARG): OTEL_EXPORTER_OTLP_ENDPOINT, MLFLOW_TRACKING_URI;
    OTLP headers and a password in the URI never in the name, repr or stats."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://user:{SECRET}@127.0.0.1:9/")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", f"authorization=Bearer {SECRET}")
    otlp = make_sink("otlp")
    assert otlp.url == f"http://user:{SECRET}@127.0.0.1:9"
    assert otlp.name == "otlp:env:OTEL_EXPORTER_OTLP_ENDPOINT=http://user:***@127.0.0.1:9"
    assert SECRET not in repr(otlp) + json.dumps(otlp.stats())
    otlp.close(timeout=1.0)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    mlflow = make_sink("mlflow")
    assert mlflow.tracking_uri == (tmp_path / "mlruns").as_uri()
    mlflow.close(timeout=5.0)


def test_otlp_export_failure_says_the_status(caplog: pytest.LogCaptureFixture) -> None:
    """An OTLP collector answering 501: the spans are dropped as 'export failed: HTTP 501 ...',
    said once by eventbus; the exporter's own line per failed export is not printed."""
    from eventbus.app.sinks.otlp import OtlpSink

    caplog.set_level(logging.WARNING)
    with receiver(status=501) as r:
        sink = OtlpSink(r.url, export_timeout=1.0, export_interval=60.0)
        for kind, fields in (("AGENT_START", {}), ("WORKER_START", {"worker_id": 0}),
                             ("WORKER_EXIT", {"worker_id": 0, "exit_code": 0}),
                             ("AGENT_EXIT", {"state": "SUCCEEDED"})):
            sink(make_event(kind, **fields))
        sink.close(timeout=5.0)
    dropped = sink.stats()["dropped"]
    assert any(key.startswith("export failed: HTTP 501") for key in dropped), dropped
    assert [rec for rec in caplog.records if rec.name == "eventbus"
            and "export failed (HTTP 501" in rec.getMessage()]
    assert not [rec for rec in caplog.records if rec.name.startswith("opentelemetry.exporter")]


@pytest.mark.parametrize(("spec", "words"), [
    ("webhok:http://x", ["unknown sink", "did you mean 'webhook'?"]),
    ("tensorbord:runs", ["did you mean 'tensorboard'?"]),
    (f"webhook:hooks.example.com/services/{SECRET}", ["not an http(s) URL", "hooks.example.com/***",
                                                      "webhook:env:"]),
])
def test_sink_usage_errors_suggest_and_hide(spec: str, words: list[str]) -> None:
    """A misspelt sink name gets a did-you-mean; a bad webhook URL is shown without its path,
    and its example is a webhook URL, not the OTLP port."""
    with pytest.raises(SinkError) as info:
        make_sink(spec)
    text = str(info.value)
    for word in words:
        assert word in text, text
    assert SECRET not in text and "4318" not in text


@pytest.mark.slow
def test_a_job_never_prints_the_webhook_secret(tmp_path: Path) -> None:
    """A real job whose webhook URL holds a secret, against a receiver answering 501: the
    secret is in no output (stdout, stderr with every event logged, the JSONL, the sink's
    stats in the end-of-job line), and the failure's why is on stderr."""
    out = tmp_path / "out"
    out.mkdir()
    events = tmp_path / "events.jsonl"
    with receiver(status=501) as r:
        url = f"{r.url}/services/T000/B000/{SECRET}?token={SECRET}"
        cmd = [sys.executable, "-m", "eventbus", "run", "--events-jsonl", str(events),
               "--log-events", "--sink", f"webhook:{url}", "--standalone", "--nproc-per-node", "2",
               "--monitor-interval", "0.1", "--max-restarts", "1",
               str(JOBS / "sinks_job.py"), "--out", str(out)]
        proc = subprocess.run(cmd, cwd=tmp_path, env=job_env(), capture_output=True,
                              text=True, timeout=JOB_TIMEOUT_S, check=False)
        tried = len(r.requests)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert tried >= 1  # the webhook did post (and was refused)
    assert "HTTP 501 Not Implemented" in proc.stderr, proc.stderr[-4000:]
    assert "eventbus: sink webhook:http://127.0.0.1:" in proc.stderr  # the stats line
    for name, text in (("stdout", proc.stdout), ("stderr", proc.stderr),
                       ("events.jsonl", events.read_text())):
        assert SECRET not in text, f"the secret is in {name}"
        assert "/services/T000" not in text, f"the webhook path is in {name}"
