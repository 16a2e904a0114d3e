"""Row 4: a slow sink (a 10 ms file write per batch) behind eventbus.subscribers.queued.QueuedSink
does not slow down record()."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from collections.abc import Sequence
from pathlib import Path

from matrix import full_or

import eventbus
from eventbus import Bus
from eventbus import Event
from eventbus.subscribers.queued import QueuedSink

N = full_or(20_000, 100_000)


def _p99_us(samples: list[int]) -> float:
    ordered = sorted(samples)
    return ordered[int(len(ordered) * 0.99)] / 1000


def _timed_records(bus: Bus, n: int) -> list[int]:
    out = []
    clock = time.perf_counter_ns
    for i in range(n):
        t0 = clock()
        bus.record("METRIC", step=i, data={"loss": 0.25})
        out.append(clock() - t0)
    return out


def test_slow_file_sink_stays_off_the_callers_thread(
    tmp_path: Path, figure: Callable[[int, str], None],
) -> None:
    """A sink that writes, fsyncs and then sleeps 10 ms per batch: record() never runs it
    (it runs on the sink's own thread), nothing is lost, and the figure compares record()'s
    p99 with a bus whose only subscriber is a plain in-memory list."""
    path = tmp_path / "slow.jsonl"
    sink_threads: set[int] = set()
    with path.open("w", encoding="utf-8") as out:
        def slow_write(batch: Sequence[Event]) -> None:
            sink_threads.add(threading.get_ident())
            out.write("".join(e.to_json() + "\n" for e in batch))
            out.flush()
            os.fsync(out.fileno())
            time.sleep(0.010)

        bus = Bus("row4")
        sink = QueuedSink(slow_write, name="slow-file")
        bus.subscribe(eventbus.ALL, on_event=sink)
        slow = _timed_records(bus, N)
        assert sink.flush(timeout=120)

    baseline_bus = Bus("row4-baseline")
    kept: list[Event] = []
    baseline_bus.subscribe(eventbus.ALL, on_event=kept.append)
    base = _timed_records(baseline_bus, N)

    lines = path.read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(N))
    assert threading.get_ident() not in sink_threads
    stats = sink.stats()
    assert stats["handled"] == N and stats["dropped"] == {} and stats["failed"] == 0
    figure(4, f"record p99 {_p99_us(slow):.1f} us with the 10 ms sink vs "
              f"{_p99_us(base):.1f} us with a list subscriber ({N:,} events, "
              f"{len(lines):,} lines written)")


def test_record_completes_while_the_sink_is_stuck_in_a_write(bus: Bus) -> None:
    """While the sink's thread is blocked inside a write, record() calls still return
    (they only enqueue); once the write ends, every event reaches the sink in order."""
    gate = threading.Event()
    entered = threading.Event()
    written: list[int] = []

    def blocked_write(batch: Sequence[Event]) -> None:
        entered.set()
        gate.wait(60)
        written.extend(e.fields()["step"] for e in batch)

    sink = QueuedSink(blocked_write, name="stuck")
    bus.subscribe("METRIC", on_event=sink)
    bus.record("METRIC", step=0)
    assert entered.wait(10)
    for i in range(1, 1_001):  # the sink holds event 0 inside its write
        bus.record("METRIC", step=i)
    assert written == []
    assert sink.pending == 1_001
    gate.set()
    assert sink.flush(timeout=30)
    assert written == list(range(1_001))
    sink.close(timeout=5)
