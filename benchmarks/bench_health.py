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

    python -m benchmarks.bench_health            # prints the figures (not in RESULTS.md's
    python -m benchmarks.bench_health --quick    # default run: see the note there)
"""

from __future__ import annotations

import argparse
import itertools
import os
import tempfile
from typing import Any

from benchmarks._timing import Case
from benchmarks._timing import measure
from eventbus import ALL
from eventbus import Bus
from eventbus import EventType
from eventbus import JobContext
from eventbus import Metric
from eventbus.app.launcher.health import StallWatch
from eventbus.app.launcher.health import StragglerWatch
from eventbus.app.launcher.health import observer
from eventbus.app.worker.stack_dump import arm_stack_dump
from eventbus.app.worker.stack_dump import default_stack_signal

__all__ = ["EVENTS_PER_WORKER_S", "WORKERS", "run"]

#: the load the core share is computed for: 8 workers, each recording this many events/s
WORKERS = 8
EVENTS_PER_WORKER_S = 1_000
MONITOR_INTERVAL_S = 0.1
#: events of one worker per value the store receiver pops (1,000 events/s, 10 ms poll)
BATCH = 10


def _noop(event: Any) -> None:
    pass


def run(*, quick: bool = False) -> dict[str, Any]:
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
    return {
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
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_health")
    parser.add_argument("--quick", action="store_true")
    result = run(quick=parser.parse_args(argv).quick)
    w = result["worker_record_ns"]
    print(f"worker record(): {w['before']:.0f} ns before, "
          f"{w['after arming the stack dump']:.0f} ns after arming the stack dump "
          f"(ratio {w['ratio']:.2f})")
    for name, value in result["agent_ns"].items():
        print(f"{name}: {value:.0f} ns")
    print(f"agent cost per event: {result['per_event_ns']:.0f} ns; share of a core for "
          f"{result['load']}: {result['core_share_8_workers'] * 100:.2f} % "
          f"(at 100 events/s each: {result['core_share_8_workers_100_per_s'] * 100:.2f} %)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
