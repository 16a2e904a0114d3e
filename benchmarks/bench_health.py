"""Job health (``eventbus run --stall-timeout``): what it costs, and where.

The watch lives on the agent. A worker's ``record()`` gains nothing: no subscriber, no
lock, no clock read; the worker hook only arms ``faulthandler`` on a signal at import (a
C-level handler that runs when the agent asks for stacks). The first rows show it: the
same ``record()`` before and after :func:`eventbus.app.worker.stack_dump.arm_stack_dump`.

On the agent, each event that reaches its bus costs the stall watch one dict lookup and
store (and a ``METRIC`` one deque append for the straggler watch), paid inside the bus's
dispatch: the ``agent publish`` rows time ``Bus.publish`` of a worker's event with and
without the two watches subscribed; their difference is the per-event cost. The monitor's
check of 8 workers runs once per ``--monitor-interval``. The share of a core for 8 workers
at ``EVENTS_PER_WORKER_S`` events/s each is computed from both.

A worker's side, measured where wall-clock noise cannot hide it (:func:`worker_cost`, in
the default run): each thread's CPU time inside rank 0 of the tight 2-rank gloo loop
(benchmarks/health_loop.py) under ``eventbus run --stall-timeout`` with the watch on, as
ms of CPU per second of wall for eventbus's threads (target <= 1), with the watch's ticks
and the store forwarder's wake-ups per second; and :func:`first_record`: a worker's first
``record()`` before the script imported torch (it must not wait for that import) and the
forwarder's wake-ups while nothing is queued (target 0), counted.

The progress watch's figures on real jobs (``--jobs``):
steps/s of a plain 2-rank gloo loop with small tensors (benchmarks/health_loop.py, which
never imports eventbus) under plain torchrun and under ``eventbus run --stall-timeout``
with the watch on, rounds interleaved and the ratio taken within the run; the flight
recorder's own cost (plain torchrun, ``TORCH_FR_BUFFER_SIZE`` 64 against 0); the
stall-to-event latency of a hang (tests/jobs/plain_train.py); and the culprit analysis of
64 simulated ranks (always).

    python -m benchmarks --only health           # the default figures, into RESULTS.md
    python -m benchmarks.bench_health            # prints them
    python -m benchmarks.bench_health --quick
    python -m benchmarks.bench_health --jobs     # adds the steps/s figures (minutes)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks._timing import Case
from benchmarks._timing import measure
from eventbus import ALL
from eventbus import Bus
from eventbus import EventType
from eventbus import JobContext
from eventbus import Metric
from eventbus import WorkerProgress
from eventbus.app.health import culprit
from eventbus.app.health.watches import StallWatch
from eventbus.app.health.watches import StragglerWatch
from eventbus.app.health.watches import observer
from eventbus.app.worker.stack_dump import arm_stack_dump
from eventbus.app.worker.stack_dump import default_stack_signal

__all__ = ["EVENTS_PER_WORKER_S", "WORKERS", "culprit_cost", "first_record", "job_figures",
           "run", "worker_cost"]

#: the load the core share is computed for: 8 workers, each recording this many events/s
WORKERS = 8
EVENTS_PER_WORKER_S = 1_000
MONITOR_INTERVAL_S = 0.1
#: events of one worker per value the store receiver pops (1,000 events/s, 10 ms poll)
BATCH = 10


def _noop(event: Any) -> None:
    pass


def run(*, quick: bool = False, workers: bool = True) -> dict[str, Any]:
    """The figures; ``workers=False`` leaves out the two that start processes (a real
    ``eventbus run`` job and a bootstrap worker: :func:`worker_cost`, :func:`first_record`),
    keeping those measured in this process."""
    repeats = 3 if quick else 15
    # 1. the worker's record(): the same call before and after the stack dump is armed
    worker_bus = Bus("bench-health-worker")
    worker_bus.subscribe(EventType.METRIC, on_event=_noop)  # the forwarder's stand-in
    ns = {"bus": worker_bus, "METRIC": EventType.METRIC}
    record = Case("worker record()", "bus.record(METRIC, step=1)", ns)
    before = measure([record], repeats=repeats)["worker record()"]
    with tempfile.TemporaryDirectory() as tmp:
        armed = arm_stack_dump(tmp, default_stack_signal())
        after = measure([record], repeats=repeats)["worker record()"]
    # 2. the agent: publish of a worker's METRIC with and without the watches: a stream
    #    of 8 ranks' steps with a loss, as the store receiver hands them to the bus: a
    #    popped value of BATCH events of one worker at a time (at 1,000 events/s and the
    #    receiver's 10 ms poll), its decoder's one context object per worker
    contexts = [JobContext(rank=rank, restart_count=0) for rank in range(WORKERS)]
    stream = [Metric(step=step, data={"loss": 0.5}, context=contexts[rank])
              for first in range(1, 1_251, BATCH) for rank in range(WORKERS)
              for step in range(first, first + BATCH)]
    plain, watched = Bus("bench-health-plain"), Bus("bench-health-watched")
    for bus in (plain, watched):
        bus.subscribe(EventType.METRIC, on_event=_noop)  # the JSONL recorder's stand-in
    stall, straggler = StallWatch(60.0), StragglerWatch(2.0)
    watched.subscribe(ALL, on_event=observer(stall, straggler))  # as the agent does
    for rank in range(WORKERS):
        stall.observe(Metric(step=1, context=JobContext(rank=rank, restart_count=0)))
    ranks = list(range(WORKERS))
    agent = measure([
        Case("agent publish, no watch", "plain.publish(next(events))",
             {"plain": plain, "events": itertools.cycle(stream)}),
        Case("agent publish, stall + straggler watch", "watched.publish(next(events))",
             {"watched": watched, "events": itertools.cycle(stream)}),
        Case("monitor check of 8 workers", "stall.overdue(0, ranks)",
             {"stall": stall, "ranks": ranks}),
        Case("straggler check of 8 workers", "straggler.check(0)",
             {"straggler": straggler}),
    ], repeats=repeats)
    per_event = max(0.0, agent["agent publish, stall + straggler watch"]
                    - agent["agent publish, no watch"])
    per_s = (WORKERS * EVENTS_PER_WORKER_S * per_event
             + agent["monitor check of 8 workers"] / MONITOR_INTERVAL_S
             + agent["straggler check of 8 workers"])  # once a second
    typical = (WORKERS * 100 * per_event
               + agent["monitor check of 8 workers"] / MONITOR_INTERVAL_S
               + agent["straggler check of 8 workers"])
    result: dict[str, Any] = {
        "core_share_8_workers_100_per_s": typical / 1e9,
        "worker_record_ns": {"before": before, "after arming the stack dump": after,
                             "ratio": after / before if before else float("nan")},
        "armed": armed is not None,
        "agent_ns": agent,
        "per_event_ns": per_event,
        "core_share_8_workers": per_s / 1e9,
        "load": f"{WORKERS} workers x {EVENTS_PER_WORKER_S:,} events/s, monitor every "
                f"{MONITOR_INTERVAL_S:g} s",
        "pid": os.getpid(),
        "culprit_ms": culprit_cost(repeats=repeats),
    }
    if workers:
        result["worker"] = worker_cost(runs=1 if quick else 3,
                                       steps=2000 if quick else 12_000)
        result["first_record"] = first_record(idle_s=0.5 if quick else 3.0)
    return result


#: the simulated job of the culprit-analysis figure
CULPRIT_RANKS = 64
ROOT = Path(__file__).resolve().parents[1]
LOOP = ROOT / "benchmarks" / "health_loop.py"
PLAIN_TRAIN = ROOT / "tests" / "jobs" / "plain_train.py"


def _simulated_beats(ranks: int) -> list[culprit.RankProgress]:
    """``ranks`` ranks' latest heartbeats: every rank waits in all_reduce #100 of group 0
    and in #40 of a second group, except rank 17, still at #99 (a hang in Python)."""
    beats = []
    for rank in range(ranks):
        late = rank == 17
        data: dict[str, Any] = {
            "pgs": {"0": {"enqueued": 99 if late else 100, "completed": 99,
                          "ranks": list(range(ranks)), "name": "0"},
                    "1": {"enqueued": 40, "completed": 40,
                          "ranks": list(range(0, ranks, 2)), "name": "1"}},
            "where": "train.py:18 in main"}
        if not late:
            data["pending"] = {"0": {"seq": 100, "op": "all_reduce", "sizes": [[1024]],
                                     "dtypes": ["Float"], "state": "scheduled"}}
        beat = WorkerProgress(worker_id=rank, step=99, collectives=139, idle_s=5.0,
                              data=data)
        progress = culprit.progress_of(beat, age_s=0.2)
        assert progress is not None
        beats.append(progress)
    return beats


def culprit_cost(*, repeats: int, ranks: int = CULPRIT_RANKS) -> dict[str, float]:
    """ms per :func:`culprit.analyze` of ``ranks`` simulated ranks: one culprit; and a
    mismatch (rank 17 in broadcast) decided by torch's analyzer where it is there."""
    beats = _simulated_beats(ranks)
    mismatch = [culprit.RankProgress(
        rank=p.rank, silent_s=p.silent_s, pgs={**p.pgs, "0": culprit.PgState(
            100, 99, p.pgs["0"].ranks, "0")},
        pending={"0": culprit.Pending(100, "broadcast" if p.rank == 17 else "all_reduce",
                                      [[1024]], ["Float"])}, where=p.where)
        for p in beats]
    assert culprit.analyze(beats).culprit_ranks == (17,)
    assert culprit.analyze(mismatch).mismatch
    found = measure([
        Case("analyze, one culprit", "analyze(beats)",
             {"analyze": culprit.analyze, "beats": beats}),
        Case("analyze, a mismatch", "analyze(beats)",
             {"analyze": culprit.analyze, "beats": mismatch}),
        Case("progress_of x ranks (the agent's input)",
             "[progress_of(b, age_s=0.2) for b in raw]",
             {"progress_of": culprit.progress_of,
              "raw": [WorkerProgress(worker_id=p.rank, idle_s=5.0, data={
                  "pgs": {pg: {"enqueued": st.enqueued, "completed": st.completed,
                               "ranks": list(st.ranks)} for pg, st in p.pgs.items()}})
                  for p in beats]}),
    ], repeats=repeats)
    return {name: ns / 1e6 for name, ns in found.items()}


#: eventbus's threads in a worker, watch on: the most CPU per second of wall they may use
WORKER_CPU_TARGET_MS_PER_S = 1.0


def worker_cost(*, runs: int = 3, steps: int = 12_000, warmup: int = 2_000) -> dict[str, Any]:
    """eventbus's threads in rank 0 of the tight 2-rank gloo loop under ``eventbus run
    --stall-timeout 60`` (the progress watch on, all three sources): CPU per second of
    wall, each thread's and their sum, from each thread's own CPU time (health_loop.py
    reads ``/proc/self/task``); the watch's ticks, beats and the forwarder's wake-ups per
    second; the training thread's CPU for scale. Medians over ``runs`` jobs, the worst
    run's sum beside them."""
    cmd = [sys.executable, "-m", "eventbus", "run", "--stall-timeout", "60", "--standalone",
           "--nproc-per-node", "2", "--monitor-interval", "0.1", str(LOOP)]
    per_run: list[dict[str, Any]] = []
    for _ in range(runs):
        env = _env(BENCH_STEPS=str(steps), BENCH_WARMUP=str(warmup))
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600,
                              cwd=tempfile.gettempdir(), check=False)
        line = next((x for x in done.stdout.splitlines() if x.startswith("{")), None)
        if line is None:
            raise RuntimeError(f"{cmd} printed no figures (rc {done.returncode}): "
                               f"{done.stderr[-2000:]}")
        figures = json.loads(line)
        wall = float(figures["wall_s"])
        threads = {("eventbus-sink:store-forwarder" if name.startswith(
            "eventbus-sink:store-forwarder") else name): cpu
            for name, cpu in figures["threads"].items()}
        own = {name: cpu / wall * 1e3 for name, cpu in threads.items()
               if name.startswith("eventbus")}
        per_run.append({
            "own": own, "total": sum(own.values()),
            "main": threads.get("main", 0.0) / wall * 1e3,
            "ticks/s": figures.get("watch_ticks", 0) / wall,
            "beats/s": figures.get("watch_beats", 0) / wall,
            "forwarder wake-ups/s": figures.get("forwarder_wakeups", 0) / wall,
            "steps/s": float(figures["steps_per_s"]), "wall_s": wall})
    names = sorted({name for r in per_run for name in r["own"]})
    median = statistics.median
    return {
        "runs": runs, "steps": steps,
        "threads_ms_per_s": {name: median(r["own"].get(name, 0.0) for r in per_run)
                             for name in names},
        "total_ms_per_s": median(r["total"] for r in per_run),
        "worst_total_ms_per_s": max(r["total"] for r in per_run),
        "training_thread_ms_per_s": median(r["main"] for r in per_run),
        "ticks_per_s": median(r["ticks/s"] for r in per_run),
        "beats_per_s": median(r["beats/s"] for r in per_run),
        "forwarder_wakeups_per_s": median(r["forwarder wake-ups/s"] for r in per_run),
        "steps_per_s": median(r["steps/s"] for r in per_run),
        "target_ms_per_s": WORKER_CPU_TARGET_MS_PER_S,
    }


FIRST_RECORD_SCRIPT = r"""
import json, sys, time
started = time.perf_counter()
import eventbus
from eventbus import EventType
t = time.perf_counter()
eventbus.record(EventType.EPOCH_END, epoch=0)
first_ms = (time.perf_counter() - t) * 1e3
torch_after_first = "torch" in sys.modules
from eventbus.subscribers.store_forwarder import worker_forwarder
forwarder = worker_forwarder()
assert forwarder.flush(30), forwarder.stats()
time.sleep(0.2)  # the thread settles into its idle wait
woken = forwarder.sink.wakeups
time.sleep(float(sys.argv[1]))
idle_wakeups = forwarder.sink.wakeups - woken
t = time.perf_counter()
import torch
import_ms = (time.perf_counter() - t) * 1e3
print(json.dumps({"first_record_ms": first_ms, "torch_imported_by_it": torch_after_first,
                  "pushed": forwarder.stats()["pushed"], "idle_wakeups": idle_wakeups,
                  "import_torch_ms": import_ms}), flush=True)
"""


def first_record(*, idle_s: float = 3.0) -> dict[str, Any]:
    """A worker (the bootstrap, ``python -m eventbus.app.worker``, with a real TCPStore)
    whose script records before it imports torch: that ``record()``'s time and whether
    torch got imported by it (it must not: the forwarder's client is a plain socket),
    the ``import torch`` the script then does (the wait it was spared), and the
    forwarder's wake-ups over ``idle_s`` seconds with nothing queued (target 0)."""
    import datetime

    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=30))
    try:
        env = _env(EVENTBUS_AGENT_STORE=f"127.0.0.1:{store.port}",
                   EVENTBUS_STORE_PREFIX="eventbus/bench/0", RANK="0")
        done = subprocess.run([sys.executable, "-m", "eventbus.app.worker", "-c",
                               FIRST_RECORD_SCRIPT, str(idle_s)], env=env,
                              capture_output=True, text=True, timeout=300, check=False)
    finally:
        del store
    line = next((x for x in done.stdout.splitlines() if x.startswith("{")), None)
    if line is None:
        raise RuntimeError(f"the first-record worker printed nothing (rc "
                           f"{done.returncode}): {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(line)
    result["idle_s"] = idle_s
    return result


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep)
    env["OMP_NUM_THREADS"] = "1"
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "EVENTBUS_PROGRESS"):
        env.pop(name, None)
    env.update(extra)
    return env


def _loop_rate(launcher: list[str], env: dict[str, str]) -> float:
    cmd = [*launcher, "--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.1",
           str(LOOP)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600,
                          cwd=tempfile.gettempdir(), check=False)
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            return float(json.loads(line)["steps_per_s"])
    raise RuntimeError(f"{cmd} printed no rate (rc {done.returncode}): "
                       f"{done.stderr[-2000:]}")


def _stall_latency(timeout_s: float = 4.0) -> float:
    """Seconds from a rank's hang (plain_train.py) to WORKER_STALLED, less the timeout."""
    with tempfile.TemporaryDirectory() as tmp:
        events = Path(tmp) / "events.jsonl"
        cmd = [sys.executable, "-m", "eventbus", "run", "--events-jsonl", str(events),
               "--stall-timeout", str(timeout_s), "--standalone", "--nproc-per-node", "2",
               "--monitor-interval", "0.1", "--max-restarts", "0", str(PLAIN_TRAIN)]
        subprocess.run(cmd, env=_env(PLAIN_MODE="hang", PLAIN_STEP="5", PLAIN_STEPS="10",
                                     PLAIN_OUT=tmp), capture_output=True, timeout=300,
                       cwd=tmp, check=False)
        hung_at = float((Path(tmp) / "attempt0_rank1.bad").read_text())
        for line in events.read_text().splitlines():
            event = json.loads(line)
            if event["type"] == "WORKER_STALLED":
                return float(event["timestamp"]) - hung_at - timeout_s
    raise RuntimeError("the hang was never reported")


def job_figures(*, rounds: int = 3, steps: int = 3000) -> dict[str, Any]:
    """Real jobs: steps/s under torchrun and under ``eventbus run`` with the watch on (and
    with the flight recorder off and on under torchrun), rounds interleaved; medians and
    ratios of one run; and the stall-to-event latency."""
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    eventbus_run = [sys.executable, "-m", "eventbus", "run", "--stall-timeout", "60"]
    cases = {
        "torchrun (flight recorder off)": (torchrun, _env(TORCH_FR_BUFFER_SIZE="0")),
        "torchrun, TORCH_FR_BUFFER_SIZE=64": (torchrun, _env(TORCH_FR_BUFFER_SIZE="64")),
        "eventbus run --stall-timeout 60 (watch on)": (eventbus_run, _env()),
    }
    rates: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(rounds):
        names = list(cases)
        for name in names[r % len(names):] + names[:r % len(names)]:
            launcher, env = cases[name]
            env["BENCH_STEPS"] = str(steps)
            rates[name].append(_loop_rate(launcher, env))
    median = {name: statistics.median(v) for name, v in rates.items()}
    plain = median["torchrun (flight recorder off)"]
    return {
        "steps_per_s": median,
        "all_rounds": rates,
        "flight_recorder_ratio": median["torchrun, TORCH_FR_BUFFER_SIZE=64"] / plain,
        "watch_ratio": median["eventbus run --stall-timeout 60 (watch on)"] / plain,
        "stall_latency_over_timeout_s": _stall_latency(),
        "steps": steps, "rounds": rounds,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_health")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--jobs", action="store_true",
                        help="also the real-job figures (steps/s, flight recorder, latency)")
    args = parser.parse_args(argv)
    result = run(quick=args.quick)
    w = result["worker_record_ns"]
    print(f"worker record(): {w['before']:.0f} ns before, "
          f"{w['after arming the stack dump']:.0f} ns after arming the stack dump "
          f"(ratio {w['ratio']:.2f})")
    for name, value in result["agent_ns"].items():
        print(f"{name}: {value:.0f} ns")
    print(f"agent cost per event: {result['per_event_ns']:.0f} ns; share of a core for "
          f"{result['load']}: {result['core_share_8_workers'] * 100:.2f} % "
          f"(at 100 events/s each: {result['core_share_8_workers_100_per_s'] * 100:.2f} %)")
    for name, ms in result["culprit_ms"].items():
        print(f"culprit analysis, {CULPRIT_RANKS} simulated ranks, {name}: {ms:.3f} ms "
              "(target < 100 ms)")
    if args.jobs:
        jobs = job_figures(rounds=2 if args.quick else 3, steps=1000 if args.quick else 3000)
        for name, rate in jobs["steps_per_s"].items():
            print(f"{name}: {rate:.0f} steps/s (rounds: "
                  f"{', '.join(f'{v:.0f}' for v in jobs['all_rounds'][name])})")
        print(f"flight recorder on / off: {jobs['flight_recorder_ratio']:.3f}")
        print(f"eventbus run with the watch / torchrun: {jobs['watch_ratio']:.3f} "
              "(target >= 0.99)")
        print(f"stall-to-event latency: timeout + {jobs['stall_latency_over_timeout_s']:.2f} s "
              "(target <= timeout + 2 s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
