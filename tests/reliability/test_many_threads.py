"""Rows 8 and 9: many threads record at once (8), while others subscribe and cancel (9).

Row 8's two tests (100,000 to_json() lines, 100,000 through the JSONL recorder: 5-10 s on 2
cores) are in ``make test-slow``; row 9 stays in the fast loop (and in the Makefile's
pure-Python re-run), with the many-thread tests of tests/test_bus.py (100,000 delivered,
no file) and tests/test_jsonl.py (16,000 lines through the recorder)."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

import eventbus
from eventbus import Bus
from eventbus import Event

THREADS = 8
PER_THREAD = 12_500


def _writers(bus: Bus, errors: list[BaseException], start: threading.Barrier) -> list[
        threading.Thread]:
    def write(tid: int) -> None:
        try:
            start.wait(30)
            for seq in range(PER_THREAD):
                bus.record("METRIC", step=seq, data={"thread": tid})
        except BaseException as exc:
            errors.append(exc)

    return [threading.Thread(target=write, args=(t,), name=f"writer-{t}")
            for t in range(THREADS)]


def _join_all(threads: list[threading.Thread], seconds: float = 120.0) -> None:
    for t in threads:
        t.join(seconds)
        assert not t.is_alive(), f"{t.name} did not finish within {seconds} s"


def _lost_and_disorder(received: list[tuple[int, int]]) -> tuple[int, int]:
    per_thread: dict[int, list[int]] = {t: [] for t in range(THREADS)}
    for tid, seq in received:
        per_thread[tid].append(seq)
    lost = THREADS * PER_THREAD - len(set(received))
    disorder = sum(seqs != sorted(seqs) for seqs in per_thread.values())
    return lost, disorder


@pytest.mark.slow
def test_many_threads_lose_nothing_and_keep_order(
    bus: Bus, tmp_path: Path, figure: Callable[[int, str], None],
) -> None:
    """8 threads x 12,500 events: all 100,000 delivered exactly once, each thread's events
    in its own order, and each event's to_json() line (written under a lock to a real
    file) parses."""
    received: list[tuple[int, int]] = []
    bus.subscribe("METRIC", on_event=lambda e: received.append(
        (e.data["thread"], e.fields()["step"])))
    path = tmp_path / "events.jsonl"
    lock = threading.Lock()
    with path.open("w", encoding="utf-8") as out:
        def write_line(event: Event) -> None:
            line = event.to_json() + "\n"
            with lock:
                out.write(line)
        bus.subscribe("METRIC", on_event=write_line)

        errors: list[BaseException] = []
        threads = _writers(bus, errors, threading.Barrier(THREADS))
        for t in threads:
            t.start()
        _join_all(threads)
    assert errors == []

    lost, disorder = _lost_and_disorder(received)
    lines = path.read_text(encoding="utf-8").splitlines()
    parsed = [json.loads(line) for line in lines]
    from_file = [(d["data"]["thread"], d["step"]) for d in parsed]
    assert len(received) == THREADS * PER_THREAD
    assert lost == 0
    assert disorder == 0
    assert sorted(from_file) == sorted(received)
    figure(8, f"lost {lost} of {len(received):,}; threads out of order {disorder}; "
              f"JSON lines parsed {len(parsed):,}/{len(received):,}")


def test_many_threads_while_others_subscribe_and_cancel(
    bus: Bus, caplog: pytest.LogCaptureFixture, figure: Callable[[int, str], None],
) -> None:
    """Row 8's load while two threads subscribe and cancel (one type, ALL, another type,
    once, where) and read stats() in a loop: 0 exceptions anywhere, nothing lost, order
    kept for the subscriber that stayed."""
    received: list[tuple[int, int]] = []
    keeper = bus.subscribe("METRIC", on_event=lambda e: received.append(
        (e.data["thread"], e.fields()["step"])))
    errors: list[BaseException] = []
    done = threading.Event()
    churned = [0, 0]

    def churn(idx: int) -> None:
        try:
            sink: list[Event] = []
            kinds = ["METRIC", eventbus.ALL, "EPOCH_END"]
            while not done.is_set():
                kind = kinds[churned[idx] % len(kinds)]
                sub = bus.subscribe(kind, on_event=sink.append,
                                    once=churned[idx] % 4 == 0,
                                    where=(lambda e: True) if churned[idx] % 5 == 0 else None)
                bus.stats()
                sub.stats()
                sub.cancel()
                sink.clear()
                churned[idx] += 1
        except BaseException as exc:
            errors.append(exc)

    start = threading.Barrier(THREADS + 2)
    churners = [threading.Thread(target=lambda i=i: (start.wait(30), churn(i)),
                                 name=f"churn-{i}") for i in range(2)]
    writers = _writers(bus, errors, start)
    with caplog.at_level(logging.WARNING, logger="eventbus"):
        for t in [*churners, *writers]:
            t.start()
        _join_all(writers)
        done.set()
        _join_all(churners)

    lost, disorder = _lost_and_disorder(received)
    reported = [r for r in caplog.records if r.name.startswith("eventbus")]
    failures = sum(s["failed"] for s in bus.stats()["subscribers"])
    n_errors = len(errors) + len(reported) + failures
    figure(9, f"errors {n_errors}; subscribe/cancel cycles {sum(churned):,}; lost {lost}")
    assert errors == []
    assert reported == []
    assert failures == 0
    assert lost == 0
    assert disorder == 0
    assert len(received) == THREADS * PER_THREAD
    assert sum(churned) > 0
    assert keeper.stats()["delivered"] == THREADS * PER_THREAD


@pytest.mark.slow
def test_many_threads_through_the_jsonl_recorder(
    bus: Bus, tmp_path: Path, figure: Callable[[int, str], None],
) -> None:
    """Row 8's load into the JSONL recorder: 100,000 lines, all parse, none lost, each
    thread's events in its own order in the file."""
    from eventbus.subscribers.jsonl import JsonlRecorder
    from eventbus.subscribers.jsonl import read_jsonl

    path = tmp_path / "events.jsonl"
    recorder = JsonlRecorder(path, max_events=THREADS * PER_THREAD)
    bus.subscribe("METRIC", on_event=recorder)
    errors: list[BaseException] = []
    threads = _writers(bus, errors, threading.Barrier(THREADS))
    for t in threads:
        t.start()
    _join_all(threads)
    assert recorder.close(timeout=120)
    assert errors == []
    read = read_jsonl(path)
    from_file = [(r["data"]["thread"], r["step"]) for r in read]
    lost, disorder = _lost_and_disorder(from_file)
    assert read.torn == 0 and read.foreign == 0
    assert len(from_file) == THREADS * PER_THREAD
    assert lost == 0 and disorder == 0
    assert recorder.stats()["dropped"] == {}
    figure(8, f"JSONL recorder: lost {lost}; lines parsed {len(from_file):,}/"
              f"{THREADS * PER_THREAD:,}; threads out of order {disorder}")
