"""Row 29: the JSONL file's disk fills (a real 256 KiB tmpfs) mid-stream. Recording goes
on; the failure is reported once and counted in stats(); every line written before it is
intact; writing resumes when space returns."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from matrix import small_tmpfs

import eventbus
from eventbus import EventType
from eventbus.subscribers.jsonl import JsonlRecorder
from eventbus.subscribers.jsonl import read_jsonl


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs mounted for the test (skips where mounting is not permitted)."""
    with small_tmpfs(tmp_path / "mnt", "256k") as mnt:
        yield mnt


def test_a_full_disk_loses_lines_counted_and_writing_resumes(
    small_disk: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """Fill the disk mid-stream: record() never raises, one warning, lines_lost counted,
    the lines before intact, and lines after space returns written again."""
    path = small_disk / "events.jsonl"
    filler = small_disk / "filler"
    filler.write_bytes(b"\0" * 160 * 1024)
    bus = eventbus.Bus("row29")
    recorder = JsonlRecorder(path, report_interval=60.0)
    bus.subscribe(eventbus.ALL, on_event=recorder)
    caplog.set_level(logging.WARNING, logger="eventbus")
    recorded = 0
    for i in range(3_000):  # ~600 KB of lines: the disk fills after ~90 KB
        bus.record(EventType.EPOCH_END, epoch=1, data={"i": i, "pad": "p" * 100})
        recorded += 1
        if i % 100 == 0:
            assert recorder.flush(10)
    assert recorder.flush(10)
    full = recorder.stats()
    filler.unlink()  # space returns
    for i in range(100):
        bus.record(EventType.EPOCH_END, epoch=2, data={"i": i})
    assert recorder.close(10)
    after = recorder.stats()
    read = read_jsonl(path)
    records = list(read)
    print(f"row 29: disk full after {full['lines_written']:,} lines; lost {full['lines_lost']:,}"
          f" (counted in stats); {len([r for r in records if r['epoch'] == 2])} lines written"
          f" after space returned; torn {read.torn}; warnings "
          f"{len([r for r in caplog.records if 'write failed' in r.getMessage()])}")
    assert full["lines_lost"] > 0
    assert full["write_error"] is not None and "No space" in full["write_error"]
    assert full["lines_written"] + full["lines_lost"] == recorded
    assert after["write_error"] is None
    assert after["lines_written"] == full["lines_written"] + 100
    epoch1 = [r["data"]["i"] for r in records if r["epoch"] == 1]
    # every line that was written is intact and in order; none counted lost is there
    assert len(epoch1) == full["lines_written"]
    assert epoch1 == sorted(set(epoch1))
    assert [r["data"]["i"] for r in records if r["epoch"] == 2] == list(range(100))
    assert read.foreign == 0  # a line the disk cut is ended and read as torn
    failures = [r for r in caplog.records if "write failed" in r.getMessage()]
    assert len(failures) == 1
    assert any("writing again" in r.getMessage() for r in caplog.records)
