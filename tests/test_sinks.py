"""The sinks in one process, with the real libraries and fabricated events (docs/sinks.md)."""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

import eventbus
from eventbus.app.sinks import SinkError
from eventbus.app.sinks import close_sinks
from eventbus.app.sinks import make_sink
from eventbus.bus import Bus
from eventbus.publishers.publisher import EventPublisher
from tests.sink_helpers import RUN_ID
from tests.sink_helpers import fabricated_job
from tests.sink_helpers import free_port
from tests.sink_helpers import make_event
from tests.sink_helpers import receiver


def feed(sink: object) -> None:
    for event in fabricated_job():
        sink(event)  # type: ignore[operator]


def test_tensorboard_writes_each_ranks_scalars_and_the_restart(tmp_path: Path) -> None:
    """tensorboard:DIR: rank<r>/ runs with every step's value, the attempt curve and texts."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = make_sink(f"tensorboard:{tmp_path / 'tb'}")
    feed(sink)
    assert sink.close(timeout=10.0)
    for rank in (0, 1):
        acc = EventAccumulator(str(tmp_path / "tb" / f"rank{rank}"),
                               size_guidance={"scalars": 0, "tensors": 0})
        acc.Reload()
        loss = [(s.step, round(s.value, 4)) for s in acc.Scalars("loss")]
        assert loss == [(step, round(rank + step / 10, 4)) for step in range(6)]
        attempts = [(s.step, s.value) for s in acc.Scalars("eventbus/attempt")]
        assert attempts == [(0, 0.0), (3, 1.0)]
        texts = [t.tensor_proto.string_val[0].decode()
                 for t in acc.Tensors("eventbus/text_summary")]
        assert any("the group restarts as attempt 1 (0 restarts left)" in t for t in texts), texts
    acc = EventAccumulator(str(tmp_path / "tb" / "rank1"), size_guidance={"tensors": 0})
    acc.Reload()
    texts = [t.tensor_proto.string_val[0].decode() for t in acc.Tensors("eventbus/text_summary")]
    assert any(t.startswith("rank 1 failed (exit code 3: boom) [attempt 0, run ")
               for t in texts), texts


def _decode_otlp(requests: list[tuple[str, bytes]]) -> tuple[list, dict[str, float]]:
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
        ExportMetricsServiceRequest,
    )
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    spans = []
    sums: dict[str, float] = {}
    for path, body in requests:
        if path == "/v1/traces":
            request = ExportTraceServiceRequest.FromString(body)
            for rs in request.resource_spans:
                for ss in rs.scope_spans:
                    spans.extend(ss.spans)
        elif path == "/v1/metrics":
            request = ExportMetricsServiceRequest.FromString(body)
            for rm in request.resource_metrics:
                for sm in rm.scope_metrics:
                    for metric in sm.metrics:
                        for point in metric.sum.data_points:
                            labels = ",".join(f"{a.key}={a.value.string_value}"
                                              for a in point.attributes)
                            sums[f"{metric.name}{{{labels}}}"] = point.as_int
                        for point in metric.gauge.data_points:
                            labels = ",".join(f"{a.key}={a.value.string_value}"
                                              for a in point.attributes)
                            sums[f"{metric.name}{{{labels}}}"] = point.as_double
    return spans, sums


def _attrs(span: object) -> dict[str, object]:
    out = {}
    for a in span.attributes:  # type: ignore[attr-defined]
        value = a.value
        out[a.key] = value.int_value if value.HasField("int_value") else value.string_value
    return out


def test_otlp_exports_spans_per_worker_per_attempt_and_counters() -> None:
    """otlp:URL: job/attempt/worker spans (the failed worker ERROR) and counters, decoded."""
    from opentelemetry.proto.trace.v1.trace_pb2 import Status

    from eventbus.app.readers.goodput import GoodputTracker

    tracker = GoodputTracker()  # what `eventbus run` gives the sink: its bus's tracker
    with receiver() as r:
        sink = make_sink(f"otlp:{r.url}")
        sink.goodput_source = tracker.result
        for event in fabricated_job():
            tracker.observe(event)
        feed(sink)
        assert sink.close(timeout=10.0)
        spans, sums = _decode_otlp(r.requests)
    by_name: dict[str, list] = {}
    for span in spans:
        by_name.setdefault(span.name, []).append(span)
    assert len(by_name["eventbus job"]) == 1
    assert {_attrs(s)["eventbus.attempt"] for s in by_name.get("eventbus attempt 0", [])
            + by_name.get("eventbus attempt 1", [])} == {0, 1}
    workers = {(_attrs(s)["eventbus.attempt"], _attrs(s)["eventbus.rank"]): s
               for name, group in by_name.items() if name.startswith("eventbus worker")
               for s in group}
    assert sorted(workers) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    failed = workers[(0, 1)]
    assert failed.status.code == Status.STATUS_CODE_ERROR
    assert failed.status.message == "rank 1 failed (exit code 3: boom)"  # its sentence
    assert _attrs(failed)["eventbus.exit_code"] == 3 and _attrs(failed)["process.pid"] == 201
    assert workers[(0, 0)].status.code == Status.STATUS_CODE_ERROR  # SIGTERM: -15
    assert _attrs(workers[(0, 0)])["eventbus.signal"] == "SIGTERM"
    assert workers[(1, 1)].status.code != Status.STATUS_CODE_ERROR
    assert [e.name for e in workers[(1, 0)].events].count("METRIC") == 3
    job = by_name["eventbus job"][0]
    assert all(w.trace_id == job.trace_id for w in workers.values())
    assert sums["eventbus.events{type=METRIC}"] == 12
    assert sums["eventbus.worker.exits{exit_code=3}"] == 1
    assert sums["eventbus.restarts{}"] == 1
    figure = tracker.result()
    assert figure is not None
    assert sums["eventbus.goodput.ratio{}"] == pytest.approx(figure.goodput_ratio)
    for cause, seconds in figure.badput_s.items():
        assert sums[f"eventbus.badput.seconds{{cause={cause}}}"] == pytest.approx(seconds)


def test_prometheus_serves_counters_on_loopback() -> None:
    """prometheus:PORT: /metrics on 127.0.0.1 parsed with prometheus_client.parser."""
    from prometheus_client.parser import text_string_to_metric_families

    from eventbus.app.readers.goodput import GoodputTracker

    port = free_port()
    sink = make_sink(f"prometheus:{port}")
    tracker = GoodputTracker()  # what `eventbus run` gives the sink: its bus's tracker
    sink.goodput_source = tracker.result
    seen = sink.write

    def write(events: Any) -> None:
        for event in events:
            tracker.observe(event)
        seen(events)

    sink.write = write  # type: ignore[method-assign]
    try:
        feed(sink)
        assert sink.flush(10.0)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    finally:
        sink.close(timeout=5.0)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("eventbus_events_total", (("type", "METRIC"),))] == 12
    assert samples[("eventbus_worker_exits_total", (("exit_code", "3"),))] == 1
    assert samples[("eventbus_restarts_total", ())] == 1
    assert samples[("eventbus_last_step", (("rank", "1"),))] == 5
    figure = tracker.result()
    assert figure is not None
    assert samples[("eventbus_goodput_ratio", ())] == pytest.approx(figure.goodput_ratio)
    causes = {dict(k[1])["cause"]: v for k, v in samples.items()
              if k[0] == "eventbus_badput_seconds"}
    assert set(causes) == set(figure.badput_s)
    assert causes == pytest.approx(figure.badput_s)
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_webhook_posts_the_failure_with_the_agents_decision() -> None:
    """webhook:URL: one readable sentence per failure, with the restart decided, and the event."""
    with receiver() as r:
        sink = make_sink(f"webhook:{r.url}/hook")
        feed(sink)
        sink(make_event("WORKER_STALLED", rank=None, restart_count=1, worker_id=0,
                        silent_s=12.5))
        assert sink.close(timeout=10.0)
        bodies = [json.loads(body) for path, body in r.requests if path == "/hook"]
    texts = [b["text"] for b in bodies]
    # the rank is named with its host (the events' context.hostname: "host")
    assert texts[0] == ("rank 1 on host failed (exit code 3: boom); the group restarts as "
                        f"attempt 1 (0 restarts left) [attempt 0, run {RUN_ID}]"), texts
    assert bodies[0]["event"]["type"] == "WORKER_EXIT" and bodies[0]["event"]["exit_code"] == 3
    assert len(bodies) == 3  # both failed exits of attempt 0, then the stall
    assert texts[2] == f"rank 0 on host stalled for 12.5 s [attempt 1, run {RUN_ID}]", texts
    assert sink.stats()["posted"] == 3 and not sink.stats()["dropped"]


def test_webhook_is_rate_limited_and_counts_the_drops() -> None:
    """webhook: posts beyond max_per_minute are dropped and counted, not sent."""
    from eventbus.app.sinks.webhook import WebhookSink

    with receiver() as r:
        sink = WebhookSink(r.url, max_per_minute=2)
        for _ in range(5):
            sink(make_event("AGENT_EXIT", state="FAILED", reason="x"))
        assert sink.close(timeout=10.0)
        assert len(r.requests) == 2
    assert sink.stats()["dropped"] == {"rate limited": 3}


@pytest.mark.parametrize("delay", [None, 10.0], ids=["receiver-down", "receiver-10s"])
def test_webhook_to_a_dead_or_slow_receiver_costs_drops_not_time(delay: float | None) -> None:
    """A dead or 10 s receiver: record() unaffected, drops in bus.stats(), close within budget
    (1 s here: the rule, not the default's size)."""
    bus = Bus("sinks-test")
    publisher = EventPublisher(bus)
    with receiver(delay=delay or 0.0) as r:
        url = r.url if delay else f"http://127.0.0.1:{free_port()}"
        sink = make_sink(f"webhook:{url}")
        publisher.subscribe_all(on_event=sink)
        started = time.monotonic()
        for _ in range(30):
            publisher.record(eventbus.EventType.AGENT_EXIT, state="FAILED", reason="down")
        recorded = time.monotonic() - started
        closed_at = time.monotonic()
        close_sinks([sink], timeout=1.0)
        close_s = time.monotonic() - closed_at
    print(f"webhook {'down' if delay is None else f'{delay}s'}: 30 records {recorded * 1e3:.1f} "
          f"ms, close {close_s:.2f} s (budget 1.0 s)")
    assert close_s < 1.0 + 1.0  # the budget, plus scheduling slack on a shared machine
    (sub_stats,) = bus.stats()["subscribers"]
    dropped = sub_stats["dropped"]
    assert sum(dropped.values()) >= 1, sub_stats
    assert sub_stats["delivered"] == 30


def test_mlflow_logs_one_run_with_steps_and_the_outcome(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """mlflow:URI: one run per job, tags, METRIC numbers per rank with steps, FINISHED."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    uri = (tmp_path / "mlruns").as_uri()
    sink = make_sink(f"mlflow:{uri}")
    feed(sink)
    assert sink.close(timeout=30.0)
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("eventbus")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.tags["eventbus.run_id"] == RUN_ID
    assert run.data.tags["eventbus.ranks"] == "2" and run.data.tags["eventbus.nodes"] == "1"
    assert run.data.tags["eventbus.end"] == "the job succeeded"
    history = client.get_metric_history(run.info.run_id, "rank1/loss")
    assert sorted((m.step, round(m.value, 4)) for m in history) == \
        [(s, round(1 + s / 10, 4)) for s in range(6)]
    failures = client.get_metric_history(run.info.run_id, "eventbus/failures")
    assert failures[-1].value == 2  # rank 1, then rank 0 stopped by the agent


@pytest.mark.parametrize(("spec", "words"), [
    ("nosuch:x", ["--sink nosuch", "unknown sink", "tensorboard", "eventbus.sinks"]),
    ("prometheus:70000", ["prometheus", "0-65535"]),
    ("prometheus:abc", ["prometheus", "HOST:PORT"]),
    ("otlp:127.0.0.1:4318", ["otlp", "not an http(s) URL", "http://"]),
    ("webhook:hooks.example/x", ["webhook", "not an http(s) URL"]),
    ("mlflow:", ["mlflow", "MLFLOW_TRACKING_URI"]),
    ("mlflow:relative/path", ["mlflow", "tracking URI"]),
    ("tensorboard", ["NAME:ARG"]),
])
def test_bad_sink_specs_name_the_sink_and_the_fix(spec: str, words: list[str]) -> None:
    """make_sink: an unknown name or a malformed ARG raises SinkError saying what to do."""
    with pytest.raises(SinkError) as info:
        make_sink(spec)
    for word in words:
        assert word in str(info.value)


def test_a_missing_extra_names_the_pip_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sink whose library is not importable says pip install 'eventbus[<extra>]'."""
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(SinkError) as info:
        make_sink("prometheus:9464")
    assert "pip install 'eventbus[prometheus]'" in str(info.value)


def test_run_rejects_a_bad_sink_before_the_job_starts(capsys: pytest.CaptureFixture[str],
                                                      tmp_path: Path) -> None:
    """eventbus run --sink with bad input: an argparse usage error (exit 2), no job."""
    from eventbus.app.launcher.command import main

    with pytest.raises(SystemExit) as info:
        main(["--sink", "otlp:localhost:4318", "--standalone", str(tmp_path / "never.py")])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "usage: eventbus run" in err and "--sink 'otlp:localhost:4318'" in err


def test_third_party_sinks_are_found_by_entry_point(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """--sink NAME:ARG finds an 'eventbus.sinks' entry point and calls it with ARG."""
    (tmp_path / "my_sink.py").write_text(
        "SEEN = []\n"
        "class Collect:\n"
        "    def __init__(self, arg): self.arg = arg\n"
        "    def __call__(self, event): SEEN.append(event)\n")
    dist = tmp_path / "my_sink-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-sink\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[eventbus.sinks]\ncollect = my_sink:Collect\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sink = make_sink("collect:some:arg")
    assert sink.arg == "some:arg"
    sink(make_event("METRIC", rank=0, data={"loss": 1.0}))
    assert len(sys.modules["my_sink"].SEEN) == 1
