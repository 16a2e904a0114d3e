"""The JSON Lines recorder and the tolerant reader (subscribers/jsonl.py), on real files."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import eventbus
from eventbus import ALL
from eventbus import Bus
from eventbus import EventType
from eventbus.subscribers.jsonl import JsonlRecorder
from eventbus.subscribers.jsonl import read_jsonl

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def test_every_event_is_one_strict_json_line(tmp_path: Path) -> None:
    """Events subscribed with ALL land one per line, strict JSON, NaN round-tripping."""
    path = tmp_path / "events.jsonl"
    bus = Bus("jsonl-test")
    recorder = JsonlRecorder(path)
    bus.subscribe(ALL, on_event=recorder)
    bus.record(EventType.WORKER_EXIT, worker_id=1, exit_code=3,
               data={"loss": math.nan, "note": "line\nbreak\u2028sep"})
    bus.record(EventType.EPOCH_END, epoch=7)
    assert recorder.close(timeout=10)
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b"" and len(lines) == 3
    for line in lines[:-1]:
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-strict {c}"))
    events = list(read_jsonl(path, decode="event"))
    assert [e.type for e in events] == [EventType.WORKER_EXIT, EventType.EPOCH_END]
    assert math.isnan(events[0].data["loss"]) and events[0].data["note"] == "line\nbreak\u2028sep"
    dicts = list(read_jsonl(path))
    assert dicts[1] == {**events[1].to_dict()}
    assert recorder.stats()["lines_written"] == 2


def test_writes_happen_off_the_callers_thread(tmp_path: Path) -> None:
    """record() returns before the line is written; the writer thread writes it."""
    path = tmp_path / "events.jsonl"
    recorder = JsonlRecorder(path)
    writer_threads: set[str] = set()
    original = recorder._write_batch

    def spy(batch: object) -> None:
        writer_threads.add(threading.current_thread().name)
        original(batch)  # type: ignore[arg-type]

    recorder._sink.handle_batch = spy
    bus = Bus("jsonl-thread")
    bus.subscribe(ALL, on_event=recorder)
    bus.record(EventType.EPOCH_START, epoch=1)
    assert recorder.flush(timeout=10)
    assert writer_threads and threading.current_thread().name not in writer_threads
    recorder.close(timeout=5)


def test_many_threads_lose_nothing(tmp_path: Path) -> None:
    """8 threads x 2,000 events: every event is one parseable line, per-thread order kept."""
    path = tmp_path / "events.jsonl"
    bus = Bus("jsonl-threads")
    recorder = JsonlRecorder(path)
    bus.subscribe(ALL, on_event=recorder)

    def produce(tid: int) -> None:
        for seq in range(2000):
            bus.record(EventType.METRIC, step=seq, data={"tid": tid})

    threads = [threading.Thread(target=produce, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert recorder.close(timeout=30)
    read = read_jsonl(path)
    records = list(read)
    assert len(records) == 16_000 and read.torn == 0 and read.foreign == 0
    for tid in range(8):
        steps = [r["step"] for r in records if r["data"]["tid"] == tid]
        assert steps == list(range(2000))


def test_full_queue_drops_are_counted(tmp_path: Path) -> None:
    """A stuck disk fills the bounded queue; the overflow is counted, never silent."""
    path = tmp_path / "events.jsonl"
    recorder = JsonlRecorder(path, max_events=10)
    release = threading.Event()
    original = recorder._write_batch

    def stuck(batch: object) -> None:
        release.wait(30)
        original(batch)  # type: ignore[arg-type]

    recorder._sink.handle_batch = stuck
    bus = Bus("jsonl-full")
    bus.subscribe(ALL, on_event=recorder)
    for i in range(100):
        bus.record(EventType.EPOCH_END, epoch=i)
    release.set()
    assert recorder.close(timeout=10)
    stats = recorder.stats()
    written = len(list(read_jsonl(path)))
    assert written + stats["dropped"].get("queue full", 0) == 100
    assert stats["dropped"]["queue full"] > 0
    bus.record(EventType.EPOCH_END, epoch=101)
    assert recorder.stats()["dropped"]["closed"] == 1


def test_torn_last_line_is_skipped_and_the_next_writer_starts_fresh(tmp_path: Path) -> None:
    """A file cut in the middle of its last line: the reader counts one torn line, and a
    new recorder's first line does not glue onto it."""
    path = tmp_path / "events.jsonl"
    recorder = JsonlRecorder(path)
    for i in range(5):
        recorder(eventbus.EpochEnd(epoch=i))
    recorder.close(timeout=10)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 40])  # what kill -9 mid-write leaves
    read = read_jsonl(path)
    assert [r["epoch"] for r in read] == [0, 1, 2, 3] and read.torn == 1
    again = JsonlRecorder(path)
    again(eventbus.EpochEnd(epoch=99))
    again.close(timeout=10)
    read = read_jsonl(path)
    assert [r["epoch"] for r in read] == [0, 1, 2, 3, 99]
    assert read.torn == 1 and read.foreign == 0


@pytest.mark.parametrize("cut", [1, 5, 8, 9])
def test_a_cut_shorter_than_the_line_prefix_is_torn_not_foreign(tmp_path: Path,
                                                                 cut: int) -> None:
    """A full disk that lets only the first bytes of a line land (b"{", b'{"typ'), ended by
    the next write's newline, is a torn line, not a foreign one (seen in the disk-full job
    test: one write landed a single "{")."""
    path = tmp_path / "events.jsonl"
    good = eventbus.EpochEnd(epoch=1).to_json().encode()
    path.write_bytes(good + b"\n" + good[:cut] + b"\n" + good + b"\n")
    read = read_jsonl(path)
    assert len(list(read)) == 2
    assert (read.torn, read.foreign) == (1, 0)


def test_foreign_lines_are_counted_not_fatal(tmp_path: Path) -> None:
    """Lines that are not events (a stray print, other JSON) are skipped and counted."""
    path = tmp_path / "events.jsonl"
    good = eventbus.EpochEnd(epoch=1).to_json()
    path.write_text(f"hello\n{good}\n[1, 2]\n{{\"type\": \"NO_SUCH\", \"timestamp\": 1}}\n\n"
                    f"{good}\n")
    read = read_jsonl(path, decode="event")
    assert len(list(read)) == 2
    assert read.foreign == 3 and read.torn == 0


def test_bad_path_fails_at_construction(tmp_path: Path) -> None:
    """A path that cannot be opened is an OSError from the constructor, not a lost thread."""
    with pytest.raises(OSError):
        JsonlRecorder(tmp_path / "no-such-dir" / "events.jsonl")
    with pytest.raises(ValueError, match="fsync"):
        JsonlRecorder(tmp_path / "x.jsonl", fsync="always")  # type: ignore[arg-type]


_WRITER = textwrap.dedent("""
    import sys, eventbus
    from eventbus import ALL
    from eventbus.subscribers.jsonl import JsonlRecorder
    rec = JsonlRecorder(sys.argv[1], flush_interval=0.001)
    eventbus.get_default_bus().subscribe(ALL, on_event=rec)
    # ~1 MiB per line: 64 strings of 16,000 characters (under the per-string limit)
    big = {f"k{j}": "x" * 16_000 for j in range(64)}
    i = 0
    while True:
        eventbus.record("METRIC", step=i, data=big)
        i += 1
        if i % 4 == 0:
            rec.flush(5)
""")


@pytest.mark.slow
def test_kill_9_mid_write_leaves_at_most_one_torn_line(tmp_path: Path) -> None:
    """kill -9 of a process writing 1 MiB events: every complete line is recovered, at most
    one is torn, and the next writer starts on a fresh line."""
    path = tmp_path / "events.jsonl"
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(path)], env=_env(),
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if path.exists() and path.stat().st_size > 8 << 20:
                break
            time.sleep(0.01)
        else:
            pytest.fail("the writer wrote nothing within 120 s")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    size = path.stat().st_size
    read = read_jsonl(path)
    steps = [r["step"] for r in read]
    complete = path.read_bytes().count(b"\n")
    print(f"recovered {len(steps)}/{len(steps) + read.torn} lines of {size} bytes")
    assert size / max(1, complete) > 1_000_000  # the lines really are ~1 MiB
    assert len(steps) == complete and read.torn <= 1 and read.foreign == 0
    assert steps == list(range(len(steps)))
    after = JsonlRecorder(path)
    after(eventbus.EpochEnd(epoch=1))
    after.close(timeout=10)
    read = read_jsonl(path)
    records = list(read)
    assert records[-1]["type"] == "EPOCH_END" and read.torn <= 1
