"""The job-health rules without a torch job (eventbus_app/health/watches.py, options.py,
probes.py): stall and straggler rules on a fake clock, the command line's validation, the
worker's stack dump on a real signal, and the new event types."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import attrs
import pytest

import eventbus
from eventbus import JobContext
from eventbus.app.health import probes
from eventbus.app.health import watches
from eventbus.app.launcher.cli import options
from eventbus.app.protocol.agent_worker import ENV_STACK_DIR
from eventbus.app.protocol.agent_worker import ENV_STACK_SIGNAL
from eventbus.app.protocol.agent_worker import EXPECT_SILENCE_KEY
from tests.launcher_helpers import ROOT


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _event(rank: int | None, *, attempt: int = 0, step: int | None = None,
           timestamp: float | None = None, data: dict[str, object] | None = None
           ) -> eventbus.Event:
    ctx = JobContext(rank=rank, restart_count=attempt)
    return eventbus.Metric(step=step, data=data or {}, context=ctx,
                           timestamp=time.time() if timestamp is None else timestamp)


def test_never_stalled_before_the_first_event() -> None:
    """A worker that recorded nothing yet is never stalled, however long it is silent."""
    clock = Clock()
    watch = watches.StallWatch(1.0, clock=clock)
    clock.now += 1000
    assert watch.stalled(0, [0, 1]) == []


def test_silence_longer_than_the_timeout_is_a_stall_reported_once() -> None:
    """After its first event, silence > timeout is a stall, reported once per attempt."""
    clock = Clock()
    watch = watches.StallWatch(2.0, clock=clock)
    watch.observe(_event(0))
    watch.observe(_event(1))
    clock.now += 1.5
    watch.observe(_event(1))
    clock.now += 1.0
    (stall,) = watch.stalled(0, [0, 1])
    assert stall.rank == 0 and stall.silent_s == pytest.approx(2.5) and stall.timeout_s == 2.0
    assert watch.stalled(0, [0, 1]) == []


def test_only_live_ranks_of_the_current_attempt_are_checked() -> None:
    """Events of another attempt, and ranks not passed as live, never stall."""
    clock = Clock()
    watch = watches.StallWatch(1.0, clock=clock)
    watch.observe(_event(0, attempt=0))
    clock.now += 5
    assert watch.stalled(1, [0]) == []
    assert watch.stalled(0, []) == []


def test_agent_events_without_a_rank_are_ignored() -> None:
    """The agents' own events (no rank) are no worker's heartbeat."""
    clock = Clock()
    watch = watches.StallWatch(1.0, clock=clock)
    watch.observe(_event(None))
    clock.now += 5
    assert watch.stalled(0, [0]) == [] and watch._seen == {}


def test_an_announced_quiet_period_is_not_a_stall() -> None:
    """data['expect_silence_s'] holds the stall off for that long after the event."""
    clock = Clock()
    watch = watches.StallWatch(2.0, clock=clock)
    watch.observe(_event(0, data={EXPECT_SILENCE_KEY: 10.0}))
    clock.now += 9
    assert watch.stalled(0, [0]) == []
    clock.now += 2
    assert [s.rank for s in watch.stalled(0, [0])] == [0]


def test_auto_timeout_is_a_floor_or_a_multiple_of_the_longest_interval() -> None:
    """auto: max(floor, factor x longest interval seen for that worker)."""
    clock = Clock()
    watch = watches.StallWatch("auto", auto_floor_s=60.0, auto_factor=5.0, clock=clock)
    watch.observe(_event(0))
    assert watch.timeout_for(0, 0) == 60.0
    clock.now += 30
    watch.observe(_event(0))
    assert watch.timeout_for(0, 0) == 150.0
    clock.now += 149
    assert watch.stalled(0, [0]) == []
    clock.now += 2
    assert [s.rank for s in watch.stalled(0, [0])] == [0]


@pytest.mark.parametrize("text", ["0", "-1", "abc", "nan", "inf", ""])
def test_bad_stall_timeouts_are_usage_errors(text: str) -> None:
    """0, negative, non-finite and non-numeric values other than auto are refused."""
    with pytest.raises(argparse.ArgumentTypeError, match="'off', seconds > 0 or 'auto'"):
        options.parse_stall_timeout(text)


def test_the_auto_floor_is_an_option_and_bounds_auto() -> None:
    """--stall-auto-floor (default 60 s) is the floor of auto's rule; it parses seconds > 0
    and the watch applies it: max(floor, 5 x the longest interval)."""
    from eventbus.app.launcher.command import build_parser

    args = build_parser().parse_args(["--stall-auto-floor", "2", "x.py"])
    assert args.stall_auto_floor == 2.0
    assert build_parser().parse_args(["x.py"]).stall_auto_floor == options.AUTO_FLOOR_S
    clock = Clock()
    watch = watches.StallWatch("auto", auto_floor_s=2.0, clock=clock)
    watch.observe(_event(0))
    assert watch.timeout_for(0, 0) == 2.0  # nothing learnt yet: the floor
    clock.now += 1.0
    watch.observe(_event(0))
    assert watch.timeout_for(0, 0) == 5.0  # 5 x 1 s > the floor
    with pytest.raises(ValueError, match="auto_floor_s"):
        watches.StallWatch("auto", auto_floor_s=0.0)


def test_good_stall_timeouts_parse() -> None:
    """Seconds, auto and off (None: no detection) parse."""
    assert options.parse_stall_timeout("2.5") == 2.5
    assert options.parse_stall_timeout("AUTO") == "auto"
    assert options.parse_stall_timeout(" off ") is None


def test_bad_health_options_are_usage_errors_of_the_parser() -> None:
    """A bad --stall-timeout, --stop-exit-code, --slow-factor or --stall-auto-floor: exit 2."""
    from eventbus.app.launcher.command import build_parser

    parser = build_parser()
    for argv in (["--stall-timeout", "-3"], ["--stop-exit-code", "0"],
                 ["--slow-factor", "0.5"], ["--stall-auto-floor", "0"],
                 ["--stall-auto-floor", "soon"]):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args([*argv, "x.py"])
        assert exc.value.code == 2


@pytest.mark.slow  # the real command, its torch import included: ~2 s on 2 cores
def test_bad_options_stop_eventbus_run_before_anything_starts(tmp_path: Path) -> None:
    """`eventbus run --stall-timeout 0` is an argparse usage error (exit 2) naming the
    option; no worker starts."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "eventbus", "run", "--stall-timeout", "0",
                           "--standalone", "--nproc-per-node", "2", "never_run.py"],
                          check=False, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    assert ("argument --stall-timeout: expected 'off', seconds > 0 or 'auto', got '0'"
            in done.stderr)
    assert "WORKER_START" not in done.stderr


def test_defaults_of_the_options() -> None:
    """--stop-exit-code defaults to 3 (not torchrun's 1), --slow-factor to 2, and stall
    detection is on: --stall-timeout auto (off turns it off)."""
    from eventbus.app.launcher.command import build_parser

    args = build_parser().parse_args(["x.py"])
    assert args.stop_exit_code == 3 and args.slow_factor == 2.0 and args.stall_timeout == "auto"
    assert build_parser().parse_args(["--stall-timeout", "off", "x.py"]).stall_timeout is None


def _steps(watch: watches.StragglerWatch, rank: int, step_s: float, n: int) -> None:
    for step in range(n):
        watch.observe(_event(rank, step=step, timestamp=1000.0 + step * step_s))


def test_a_3x_straggler_is_reported_rate_limited() -> None:
    """A rank 3x slower than its peers' median is reported, at most once per interval."""
    clock = Clock()
    watch = watches.StragglerWatch(2.0, report_interval_s=60, clock=clock)
    for rank in (0, 1, 2):
        _steps(watch, rank, 0.1, 10)
    _steps(watch, 3, 0.3, 10)
    (slow,) = watch.check(0)
    assert slow.rank == 3 and slow.factor == pytest.approx(3.0)
    assert slow.median_step_time_s == pytest.approx(0.1)
    assert watch.check(0) == []
    clock.now += 61
    assert [s.rank for s in watch.check(0)] == [3]


def test_balanced_and_tiny_steps_are_never_slow() -> None:
    """Balanced ranks, and steps below min_step_time_s, are never reported."""
    watch = watches.StragglerWatch(2.0, clock=Clock())
    _steps(watch, 0, 0.1, 10)
    _steps(watch, 1, 0.12, 10)
    assert watch.check(0) == []
    tiny = watches.StragglerWatch(2.0, clock=Clock())
    _steps(tiny, 0, 0.001, 10)
    _steps(tiny, 1, 0.01, 10)
    assert tiny.check(0) == []


def test_own_step_times_win_over_timestamps() -> None:
    """data['step_time_s'] (lock-step training, where timestamps are all equal) is used."""
    watch = watches.StragglerWatch(2.0, clock=Clock())
    for rank, own in ((0, 0.1), (1, 0.1), (2, 0.5)):
        for step in range(6):
            watch.observe(_event(rank, step=step, timestamp=1000.0 + step,
                                 data={"step_time_s": own}))
    assert [s.rank for s in watch.check(0)] == [2]


def test_stall_and_slow_events_round_trip() -> None:
    """WORKER_STALLED (a failure) and WORKER_SLOW are built-in, typed, and survive JSON."""
    stalled = eventbus.WorkerStalled(worker_id=1, silent_s=3.5, data={"stack": "x"})
    slow = eventbus.WorkerSlow(worker_id=2, factor=3.0, step_time_s=0.3)
    assert stalled.is_failure and not slow.is_failure
    for event in (stalled, slow):
        assert eventbus.Event.from_json(event.to_json()) == event
    assert eventbus.EventType.WORKER_STALLED == "WORKER_STALLED"
    with pytest.raises(TypeError, match="silent_s"):
        eventbus.record(eventbus.EventType.WORKER_STALLED, worker_id=1, silent_s="long")


def test_progress_heartbeat_is_a_typed_built_in() -> None:
    """WORKER_PROGRESS: worker_id required, step/collectives optional, idle_s 0.0 by
    default; not a failure; survives JSON with its data."""
    beat = eventbus.WorkerProgress(worker_id=3, step=10, collectives=42, idle_s=1.5,
                                   data={"pgs": {"0": {"enqueued": 42, "completed": 42}}})
    assert beat.type == eventbus.EventType.WORKER_PROGRESS == "WORKER_PROGRESS"
    assert not beat.is_failure
    assert eventbus.Event.from_json(beat.to_json()) == beat
    bare = eventbus.WorkerProgress(worker_id=0)
    assert (bare.step, bare.collectives, bare.idle_s) == (None, None, 0.0)
    with pytest.raises(TypeError, match="idle_s"):
        eventbus.record(eventbus.EventType.WORKER_PROGRESS, worker_id=1, idle_s="long")


CHILD = """
import os, sys, time
from eventbus.app.worker import attach
def stuck_in_here():
    print(attach().stack_file, flush=True)
    while True:
        time.sleep(0.01)
stuck_in_here()
"""


def _child(tmp_path: Path, **env: str) -> subprocess.Popen[str]:
    full = {**os.environ, "PYTHONPATH": str(ROOT), ENV_STACK_DIR: str(tmp_path), **env}
    proc = subprocess.Popen([sys.executable, "-c", CHILD], env=full, text=True,
                            stdout=subprocess.PIPE)
    assert proc.stdout is not None
    proc.stdout.readline()  # armed
    return proc


def test_the_stack_dump_names_the_function_and_keeps_the_worker_alive(tmp_path: Path) -> None:
    """The agent's signal makes the worker write every thread's stack; it lives on."""
    proc = _child(tmp_path)
    try:
        stacks = probes.StackDumper(str(tmp_path)).capture([proc.pid])
        assert "stuck_in_here" in stacks[proc.pid], stacks
        again = probes.StackDumper(str(tmp_path)).capture([proc.pid])
        assert "stuck_in_here" in again[proc.pid] and proc.poll() is None
    finally:
        proc.kill()
        proc.wait(10)


def test_a_worker_that_opts_out_is_never_signalled(tmp_path: Path) -> None:
    """EVENTBUS_STACK_SIGNAL=off: no .sig file, no signal, a note instead of a stack."""
    proc = _child(tmp_path, **{ENV_STACK_SIGNAL: "off"})
    try:
        stacks = probes.StackDumper(str(tmp_path)).capture([proc.pid])
        assert stacks[proc.pid].startswith("(no stack") and proc.poll() is None
    finally:
        proc.kill()
        proc.wait(10)


def test_stop_after_stalls_stops_on_the_kth_stall_of_a_rank() -> None:
    """StopAfterStalls(2): the first stall of a rank restarts, its second stops; other
    ranks count apart; failures get no opinion."""
    from eventbus.subscribers import StopAfterStalls

    reactor = StopAfterStalls(2)
    stall = eventbus.WorkerStalled(worker_id=1, silent_s=5.0)
    assert reactor(stall) is None
    assert reactor(eventbus.WorkerStalled(worker_id=0, silent_s=5.0)) is None
    assert reactor(eventbus.WorkerExit(worker_id=1, exit_code=1)) is None
    assert reactor(stall) is eventbus.Decision.STOP


def test_exit_code_and_loss_reactors_have_no_opinion_on_stalls() -> None:
    """NonRetriableExitCodes and StopOnNonFiniteLoss return None for WORKER_STALLED;
    RestartBudget counts a stall like a failure."""
    from eventbus.subscribers import NonRetriableExitCodes
    from eventbus.subscribers import RestartBudget
    from eventbus.subscribers import StopOnNonFiniteLoss

    stall = eventbus.WorkerStalled(worker_id=1, silent_s=5.0, data={"attempt": 0})
    assert NonRetriableExitCodes({3})(stall) is None
    assert StopOnNonFiniteLoss()(stall) is None
    budget = RestartBudget(1, 3600)
    assert budget(stall) is eventbus.Decision.RESTART
    assert budget(eventbus.WorkerStalled(worker_id=1, silent_s=5.0,
                                         data={"attempt": 1})) is eventbus.Decision.STOP


def test_stalls_and_slow_ranks_show_on_their_rank_in_the_trace_and_timeline(
        tmp_path: Path) -> None:
    """The trace has a 'stall' and a 'slow' instant on the rank's own thread (the stack in
    its args); the timeline draws both (and a legend entry) without error."""
    import json

    from eventbus.app.readers.trace import export_trace

    lines = (ROOT / "tests" / "fixtures" / "job_node0.jsonl").read_text().splitlines()
    start = next(json.loads(line) for line in lines if '"WORKER_START"' in line
                 and '"worker_id":1' in line)
    ctx = JobContext(**start["context"])
    extra = [eventbus.WorkerStalled(worker_id=1, silent_s=301.5, timeout_s=300.0,
                                    data={"stack": "File x.py in spin_forever"},
                                    timestamp=start["timestamp"] + 3, context=ctx),
             eventbus.WorkerSlow(worker_id=1, factor=3.0, step_time_s=0.3,
                                 timestamp=start["timestamp"] + 2, context=ctx)]
    path = tmp_path / "job.jsonl"
    path.write_text("\n".join([*lines, *(e.to_json() for e in extra)]) + "\n")
    trace = export_trace([path], tmp_path / "trace.json")
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
               if e["ph"] == "M" and e["name"] == "thread_name"}
    found = {e["cat"]: e for e in trace["traceEvents"] if e.get("cat") in ("stall", "slow")}
    assert set(found) == {"stall", "slow"}
    for event in found.values():
        assert threads[(event["pid"], event["tid"])] == "rank 1"
    assert found["stall"]["name"] == "rank 1 stalled (silent 301.5 s)"
    assert "spin_forever" in found["stall"]["args"]["data"]["stack"]
    pytest.importorskip("matplotlib")
    from eventbus.app.cli import main as cli_main

    assert cli_main(["plot", str(path), "-o", str(tmp_path / "job.png")]) == 0
    assert (tmp_path / "job.png").stat().st_size > 0


@pytest.mark.serial
def test_health_benchmark_reports_worker_and_agent_costs() -> None:
    """benchmarks/bench_health.py runs (quick) and reports the worker's record() before and
    after arming the stack dump, the agent's cost per event and its share of a core. The
    figures that start processes (a real job, a bootstrap worker) are the slow test's
    below."""
    from benchmarks import bench_health

    result = bench_health.run(quick=True, workers=False)
    assert result["armed"] is True
    assert result["worker_record_ns"]["before"] > 0 and result["worker_record_ns"]["ratio"] > 0
    assert result["per_event_ns"] >= 0 and result["core_share_8_workers"] > 0
    assert "worker" not in result and "first_record" not in result


@pytest.mark.slow
def test_health_benchmark_measures_a_real_worker() -> None:
    """benchmarks/bench_health.py's figures from processes, at their quick sizes: the CPU
    of eventbus's threads in rank 0 of a real 2-rank ``eventbus run`` job, and a bootstrap
    worker's first record() before its script imports torch."""
    from benchmarks import bench_health

    worker = bench_health.worker_cost(runs=1, steps=2000)
    assert worker["runs"] == 1 and worker["steps_per_s"] > 0, worker
    assert worker["total_ms_per_s"] >= 0 and worker["threads_ms_per_s"], worker
    first = bench_health.first_record(idle_s=0.5)
    assert first["first_record_ms"] >= 0 and first["pushed"] >= 1, first


def test_the_observer_writes_what_the_two_watches_write() -> None:
    """watches.observer (the agent's one subscriber, routing to each watch) leaves both
    watches in the state their own observe() methods leave: heartbeats, quiet periods,
    auto's longest interval, step windows (with a step counter going back), agents' events
    skipped."""
    clock = Clock()
    events = []
    contexts: dict[tuple[int, int], JobContext] = {}
    for i in range(30):
        rank = i % 3
        data: dict[str, object] = {"loss": 0.5}
        if i == 7:
            data["expect_silence_s"] = 120
        if rank == 2:
            data["step_time_s"] = 0.2
        step = i // 3 if i < 20 else i // 3 - 5  # the counter goes back once
        event = _event(rank, attempt=i // 25, step=step, timestamp=1000.0 + i, data=data)
        if i % 2:  # as the store receiver decodes them: one context object per worker
            event = attrs.evolve(event, context=contexts.setdefault(
                (i // 25, rank), JobContext(rank=rank, restart_count=i // 25)))
        events.append(event)
        if i % 5 == 0:  # several events of one worker in a row (one batch)
            events.append(attrs.evolve(event, step=step + 1 if step is not None else None))
    events.append(_event(None, step=1))  # an agent's own event
    events.append(eventbus.EpochEnd(epoch=0, context=JobContext(rank=1, restart_count=0)))
    fused = (watches.StallWatch("auto", clock=clock), watches.StragglerWatch(2.0, clock=clock))
    plain = (watches.StallWatch("auto", clock=clock), watches.StragglerWatch(2.0, clock=clock))
    observe = watches.observer(*fused)
    assert observe is not None
    for i, event in enumerate(events):
        clock.now = 100.0 + i * (1 + i % 4)
        observe(event)
        plain[0].observe(event)
        plain[1].observe(event)

    def state(watches: tuple[watches.StallWatch, watches.StragglerWatch]) -> object:
        stall, straggler = watches
        return ({k: (s.last, s.longest, s.quiet_until) for k, s in stall._seen.items()},
                {k: list(v) for k, v in straggler._steps.items()})

    assert state(fused) == state(plain)
    assert fused[0]._seen and fused[1]._steps
    assert watches.observer(None, None) is None
