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

#: these tests read the machine: make test runs them alone, after the parallel pass
pytestmark = pytest.mark.serial


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
    for key in ("plain step ms", "checked step ms", "ratio"):
        assert _positive(result["ab"][key]), key
    # paired differences of two timings: noise can make either quartile negative
    for key in ("paired p25", "paired p75"):
        assert math.isfinite(result["ab"][key]), key
    text = render({"preemption": result}, machine={}, versions={}, when="now", quick=True,
                  seconds={"preemption": 1.0})
    assert "## Preemption: `should_stop()` per step" in text
    assert "Target: `should_stop()` without a drain <= 1% of a step" in text


def test_detection_percentiles_interpolate_between_ranks() -> None:
    """bench_detection's percentile: linear between the closest ranks, NaN for none."""
    from benchmarks.bench_detection import percentile

    values = [float(v) for v in range(1, 21)]  # 20 hangs
    assert percentile(values, 50) == 10.5
    assert percentile(values, 95) == pytest.approx(19.05)
    assert percentile(values, 100) == 20.0 and percentile([3.0], 95) == 3.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile(values, 101)


def test_detection_section_is_inserted_once_then_replaced_in_place() -> None:
    """The section goes after the hand-run marker of RESULTS.md (or before docs/run.md's
    next heading), and a rerun replaces it between its markers, leaving the rest alone."""
    from benchmarks.__main__ import HAND_RUN_MARKER
    from benchmarks.bench_detection import BEGIN
    from benchmarks.bench_detection import DOC_ANCHOR
    from benchmarks.bench_detection import END
    from benchmarks.bench_detection import replace_section

    results = f"# Results\n\nmade by make bench\n\n{HAND_RUN_MARKER}\n\n## by hand\n\nkept\n"
    first = replace_section(results, "## Detection\n\nrun one", after=HAND_RUN_MARKER)
    assert first == (f"# Results\n\nmade by make bench\n\n{HAND_RUN_MARKER}\n\n{BEGIN}\n"
                     f"## Detection\n\nrun one\n{END}\n\n## by hand\n\nkept\n")
    second = replace_section(first, "## Detection\n\nrun two\n", after=HAND_RUN_MARKER)
    assert second == first.replace("run one", "run two")
    doc = "## Job health\n\ntext\n\n## Restarts that work\n\nmore\n"
    placed = replace_section(doc, "### Detection", after=DOC_ANCHOR)
    assert placed == (f"## Job health\n\ntext\n\n{BEGIN}\n### Detection\n{END}\n\n"
                      "## Restarts that work\n\nmore\n")
    assert replace_section(placed, "### Detection", after=DOC_ANCHOR) == placed
    with pytest.raises(ValueError):
        replace_section("no anchor here\n", "x", after=HAND_RUN_MARKER)
    with pytest.raises(ValueError):
        replace_section(f"{END}\n{BEGIN}\n", "x", after=HAND_RUN_MARKER)


def test_detection_table_counts_misses_and_names_false_events() -> None:
    """render() of made-up figures: a miss is counted and named, never dropped; a false
    stall is counted and its data shown; a skipped trainer is named."""
    from benchmarks.bench_detection import Hang
    from benchmarks.bench_detection import Healthy
    from benchmarks.bench_detection import render

    stall = {"type": "WORKER_STALLED", "worker_id": 0, "silent_s": 6.1, "timeout_s": 5.0}
    result = {
        "quick": False, "commit": "abc1234", "torch": "2.13", "python": "3.11",
        "date": "today", "cores": 2, "busy": 2, "timeout_s": 4.0, "auto_floor_s": 5.0,
        "load": [2.5, 4.0], "seconds": 600.0, "skipped": {"transformers": "no module"},
        "hangs": [vars(Hang(1, 12.0, 1, latency_s=4.3, waiting_on="spinning")),
                  vars(Hang(2, 12.0, 1, latency_s=4.5, waiting_on="spinning")),
                  vars(Hang(3, 240.0, None, note="killed at the job's limit"))],
        "healthy": [vars(Healthy("plain", 4, 20.0, 0, "SUCCEEDED (0)")),
                    vars(Healthy("lightning", 5, 30.0, 1, "FAILED (1)", stalls=[stall]))],
    }
    text = render(result)
    assert "| 3 | 1 | 4.40 s (+0.40) |" in text and "(not met)" in text
    assert "- miss, hang 3: killed at the job's limit" in text
    assert "| 1 | 1 | 0 | 0 | 1 (run 5: exit code 1, FAILED (1)) |" in text
    assert "| spin | 2/3 | no verdict x1, spinning x2 |" in text
    assert '- lightning run 5: WORKER_STALLED {"type": "WORKER_STALLED"' in text
    assert "skipped: no module" in text and "load average 2.5-4.0" in text


def test_scale_simulator_pushes_exactly_what_the_encoder_writes() -> None:
    """bench_scale's simulated pushes (cut from a template) equal the real encoder's bytes
    for real heartbeats, with and without the member list, and decode into the beats."""
    from benchmarks import scale_job
    from eventbus.wire import BatchDecoder
    from eventbus.wire import BatchEncoder

    for members in (True, False):
        template = scale_job.live_template(64, members=members)
        template.check(kind="n", rank=2)  # raises where a byte differs
        template.check(kind="w", rank=5)
        value = template.push(BatchEncoder(kind="n", rank=3),
                              [(24, 1.7e9, 5, 50, 51, 50), (29, 1.7e9 + 0.5, 5, 50, 50, 50)])
        batch = BatchDecoder().batch(value, kind="n", rank=3)
        beats: list[Any] = []
        BatchDecoder.publish_all(batch.entries, batch.contexts, beats.append, pytest.fail)
        assert [(b.worker_id, b.context.rank, b.timestamp) for b in beats] == [
            (24, 24, 1.7e9), (29, 29, 1.7e9 + 0.5)]
        assert beats[0].data["pgs"]["0"]["enqueued"] == 51
        assert list(beats[0].data["pgs"]["0"]["ranks"]) == (list(range(64)) if members
                                                            else [])


def test_scale_schedule_beats_every_rank_once_a_second_on_its_senders_grid() -> None:
    """One second of the simulated job: each rank's beat in exactly one push; the other
    nodes push to node queues, group rank 0's workers each to its own worker queue."""
    from benchmarks import scale_job

    schedule, offsets = scale_job._schedule(64)
    carried = sorted(r for _, _, _, ranks in schedule for r in ranks)
    assert carried == list(range(64)) and len(offsets) == 64
    for tick, kind, who, ranks in schedule:
        assert all(tick >= offsets[r] for r in ranks)  # pushed after it beat
        if kind == "w":
            assert ranks == (who,) and who < scale_job.RANKS_PER_NODE
        else:
            assert who >= 1 and all(r // scale_job.RANKS_PER_NODE == who for r in ranks)


def test_scale_culprit_cost_names_the_one_culprit() -> None:
    """The stall check over every rank's decoded beat names the rank that has not entered
    the collective (a small job here); its timings are positive."""
    from benchmarks import bench_scale

    cost = bench_scale.culprit_cost(64, repeats=1)
    assert cost["diagnosis"].startswith("rank 35 has not entered allreduce #4001")
    assert all(_positive(cost[k]) for k in ("verdict ms", "progress_of ms", "analyze ms"))


def test_scale_hour_reads_memory_every_interval_of_simulated_time() -> None:
    """The accelerated fold reads memory at the start and every interval, folding every
    sampled rank's beat once a simulated second; the collector is left unfrozen."""
    import gc

    from benchmarks import bench_scale

    result = bench_scale.hour(64, 16, 120, 60)
    assert [r["simulated min"] for r in result["readings"]] == [0, 1, 2]
    assert result["events"] == 16 * 120 == result["readings"][-1]["events folded"]
    assert gc.get_freeze_count() == 0


@pytest.mark.slow
def test_scale_benchmark_quick_run_reports_each_size_and_renders() -> None:
    """bench_scale's quick run: a real store, transport and agent subscribers fed by the
    simulator process, with and without the member list; every beat of the window arrives,
    each target is judged and the report renders the section."""
    from benchmarks import bench_scale

    result = bench_scale.run(quick=True)
    for rows in (result["rows"], result["bare rows"]):
        assert [r["ranks"] for r in rows] == list(bench_scale.QUICK_SIZES)
        for row in rows:
            assert row["lost or rejected"] == 0
            assert row["beats in window"] > 0 and row["delivered %"] > 0
            assert row["receiving % of a core"] > 0 and row["store server % of a core"] >= 0
    for t in result["targets"]:
        assert t["met"] == (t["value"] <= t["limit"]), t
    text = render({"scale": result}, machine={}, versions={}, when="now", quick=True,
                  seconds={"scale": 1.0})
    assert "## Scale: the agent of group rank 0 at 1,024 to 8,192 ranks" in text
    assert "### Beats as the workers send them now" in text
    assert "### Beats as they were sent before" in text
