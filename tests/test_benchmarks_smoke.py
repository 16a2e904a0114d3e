"""Smoke runs of benchmarks/: each benchmark still runs and produces its table.

Tiny repeat counts and sizes; no test here asserts a time (speed lives in
benchmarks/RESULTS.md as same-run ratios).
"""

from __future__ import annotations

import math
import subprocess
import sys
from typing import Any

import pytest

from benchmarks import bench_dispatch
from benchmarks import bench_import
from benchmarks import bench_logging
from benchmarks import bench_memory
from benchmarks import bench_store
from benchmarks.report import render
from tests.conftest import ROOT
from tests.conftest import subprocess_env


@pytest.fixture(scope="module")
def dispatch() -> dict[str, Any]:
    """One quick dispatch run shared by the tests that read it."""
    return bench_dispatch.run(quick=True)


def _positive(value: object) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def test_dispatch_measures_every_peer_at_every_count(dispatch: dict[str, Any]) -> None:
    """Every peer has a figure at 0, 1 and 10 subscribers; torch and the default bus at 0."""
    table = dispatch["ns"]
    for row in ("direct call", "eventbus record()", "eventbus record(), hoisted type",
                bench_dispatch.PURE_ROW,
                "blinker Signal.send", "psygnal emit_fast", "psygnal emit", "pyee emit"):
        assert sorted(table[row]) == [0, 1, 10], row
        assert all(_positive(v) for v in table[row].values()), row
    assert list(table["torch events.record()"]) == [0]
    assert list(table["eventbus.record(), default bus"]) == [0]


def test_dispatch_reports_each_target_as_a_ratio(dispatch: dict[str, Any]) -> None:
    """The four dispatch targets come back as ratio, limit and met."""
    targets = dispatch["targets"]
    assert [t["target"] for t in targets] == [t[0] for t in bench_dispatch.TARGETS]
    for t in targets:
        assert _positive(t["ratio"])
        assert t["met"] == (t["ratio"] <= t["limit"])
    assert "validate + build (dict + _build)" in dispatch["breakdown"]


def test_dispatch_benchmark_leaves_the_default_bus_alone(dispatch: dict[str, Any]) -> None:
    """The benchmark subscribes only on its private buses."""
    import eventbus

    names = {s.name for s in eventbus.get_default_bus().subscriptions()}
    assert not any("noop" in n for n in names)


def test_logging_benchmark_compares_with_a_plain_stream_handler() -> None:
    """Each logging path has a figure and a ratio to the plain StreamHandler line."""
    result = bench_logging.run(quick=True)
    rows = result["rows"]
    assert rows["logging.StreamHandler line"]["vs plain line"] == 1.0
    for name in ("record() -> EventLoggingHandler",
                 "record() -> EventLoggingHandler -> user logger"):
        assert _positive(rows[name]["ns"])
        assert "handler only vs plain line" in rows[name]


def test_logging_benchmark_judges_its_target() -> None:
    """The logged-line target comes back as ratio, limit and met."""
    (target,) = bench_logging.run(quick=True)["targets"]
    assert _positive(target["ratio"]) and target["limit"] == bench_logging.TARGET
    assert target["met"] == (target["ratio"] <= target["limit"])


def test_import_benchmark_compares_with_blinker_and_attrs() -> None:
    """Fresh interpreters time blinker+attrs and eventbus on top; the ratio is judged,
    the costliest modules are listed, and no torch is imported."""
    result = bench_import.run(quick=True)
    ratio = result[f"whole / blinker+attrs (target <= {bench_import.TARGET:g})"]
    assert ratio > 1 and result["met"] == (ratio <= bench_import.TARGET)
    assert result["torch imported"] is False
    assert any(row["module"] == "eventbus.events" for row in result["rows"])


def test_memory_benchmark_reports_peak_rss_per_size() -> None:
    """One row per size, each with a peak RSS and every event either queued or dropped."""
    result = bench_memory.run(quick=True)
    rows = result["rows"]
    assert [r["events"] for r in rows] == list(bench_memory.QUICK_SIZES)
    for row in rows:
        assert row["peak rss (MiB)"] >= row["rss after imports (MiB)"] > 0
        assert row["queued"] + row["dropped"] == row["events"]
    assert _positive(result["growth"])


@pytest.mark.slow
def test_store_benchmark_reports_each_producer_count() -> None:
    """Five real eventbus run jobs (1 and 4 flooding workers, 4 paced ones, 4 flooding
    with their heaps frozen, 4 flooding into a held agent) report arrivals, latency, the
    forwarder's cost and the workers' full collections, each target is judged, and the
    report renders them."""
    result = bench_store.run(quick=True)
    rows = result["rows"]
    # flooding 1 and 4, paced 4, flooding 4 with frozen heaps, flooding 4 into a held agent
    assert [r["producers"] for r in rows] == [1, 4, 4, 4, 4]
    assert [r["workers' heap"] for r in rows] == ["as imported"] * 3 + ["frozen",
                                                                        "as imported"]
    assert [r["agent receives"] for r in rows] == ["during the flood"] * 4 + [
        "after the flood (held)"]
    for row in rows:
        assert row["arrived"] + row["lost"] == row["events"]
        if row is not rows[-1]:  # held: its latency is the hold's
            assert row["p99 latency ms"] >= row["p50 latency ms"] >= 0
        assert row["forwarder / no subscriber"] > 0
        assert row["full collections per worker during the flood"] >= 0
        assert row["s in them per worker (wall)"] >= 0
    text = render({"store": result}, machine={}, versions={}, when="now", quick=True,
                  seconds={})
    assert "## Worker -> agent through a real TCPStore" in text
    assert "| producers | 1 | 4 | 4 | 4 | 4 |" in text
    for t in result["targets"]:
        assert t["met"] == (t["value"] >= t["limit"] if t["at_least"]
                            else t["value"] <= t["limit"]), t


def test_report_has_every_section(dispatch: dict[str, Any]) -> None:
    """render() writes machine, versions and the dispatch, ratio and target tables."""
    text = render({"dispatch": dispatch}, machine={"cpus": "2"}, versions={"blinker": "1.9.0"},
                  when="now", quick=True, seconds={"dispatch": 1.0})
    for heading in ("# Benchmark results", "## Dispatch: ns per call", "### Ratios",
                    "### Targets", "| blinker | 1.9.0 |"):
        assert heading in text, heading
    assert "record() at 1 subscriber <= 0.4x blinker send" in text
    assert "floor (interpreter)" in text
    assert "floor with a snapshot" in text


def test_python_dash_m_benchmarks_writes_the_report(tmp_path: Any) -> None:
    """python -m benchmarks --quick --output PATH runs the runner end to end."""
    out = tmp_path / "RESULTS.md"
    subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--only", "logging",
                    "--output", str(out)], cwd=ROOT, env=subprocess_env(),
                   capture_output=True, text=True, timeout=300, check=True)
    text = out.read_text(encoding="utf-8")
    assert "Smoke run" in text
    assert "## Logging: ns per event" in text


def test_sinks_benchmark_measures_each_sink() -> None:
    """bench_sinks: events/s and enqueue ns for TensorBoard, OTLP and MLflow, no drops."""
    from benchmarks import bench_sinks

    result = bench_sinks.run(quick=True)
    assert {"tensorboard", "otlp", "mlflow"} <= set(result["rows"])
    for row in result["rows"].values():
        assert _positive(row["events/s"]) and _positive(row["enqueue ns/event"])
        assert row["dropped"] == 0
    text = render({"sinks": result}, machine={}, versions={}, when="now", quick=True,
                  seconds={"sinks": 1.0})
    assert "## Sinks" in text and "| otlp |" in text


def test_preemption_benchmark_measures_should_stop_against_a_ddp_step() -> None:
    """bench_preemption: should_stop() ns with and without a drain, a real DDP step, the
    share in percent and the step-loop A/B; the host's preemption state is left alone, and
    the report renders the section. No time is asserted."""
    from benchmarks import bench_preemption
    from eventbus import preemption

    before = preemption._state
    result = bench_preemption.run(quick=True)
    assert preemption._state is before
    cases = {row["case"]: row for row in result["rows"]}
    for name in ("should_stop(), no drain", "should_stop(step), no drain",
                 "should_stop(), drain under way, before its stop step"):
        assert _positive(cases[name]["ns"]) and _positive(cases[name]["% of a step"]), name
    assert _positive(result["step ms"]) and _positive(result["percent"])
    assert result["met"] == (result["percent"] <= bench_preemption.TARGET_PERCENT)
    for key in ("plain step ms", "checked step ms", "ratio", "paired p25", "paired p75"):
        assert _positive(result["ab"][key]), key
    text = render({"preemption": result}, machine={}, versions={}, when="now", quick=True,
                  seconds={"preemption": 1.0})
    assert "## Preemption: `should_stop()` per step" in text
    assert "Target: `should_stop()` without a drain <= 1% of a step" in text
