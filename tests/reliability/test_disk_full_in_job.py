"""Row 29 in a real job: ``eventbus run --events-jsonl`` on a small tmpfs.

* The disk fills mid-job (a filler file takes every free byte while 2 workers record),
  then space returns: the job exits 0, the failure is reported once (one ``write failed``
  warning), the lost lines are counted (the ``writing again ...; N lines were lost`` log
  line and the exit line ``N lines were lost to failed writes``: the recorder's
  ``stats()["lines_lost"]``), every line before it is intact and writing resumes.
* The directory and the file made read-only mid-job: the recorder writes through the
  descriptor it opened at the start, which permissions (checked at ``open``) and
  ``chattr +i`` do not reach, and Linux refuses ``mount -o remount,ro`` while a file is
  open for writing (EBUSY). So nothing is lost; the test tries the remount too and, on a
  kernel that allows it, holds the job to the full-disk rules instead.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from collections.abc import Iterator
from pathlib import Path

import pytest
from launcher_helpers import JOBS
from launcher_helpers import job_env
from launcher_helpers import run_command
from matrix import small_tmpfs

from eventbus.subscribers.jsonl import read_jsonl


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs mounted for the test (skips where mounting is not permitted)."""
    with small_tmpfs(tmp_path / "mnt", "1m") as mnt:
        yield mnt


def _fill(path: Path) -> int:
    """Write ``path`` until the disk is full; returns the bytes it took."""
    taken = 0
    with open(path, "wb", buffering=0) as out:
        chunk = b"\0" * 4096
        while True:
            try:
                taken += out.write(chunk)
            except OSError:
                return taken


def _flowing(out: Path, events: Path) -> bool:
    """Both workers have recorded, and the JSONL file has EPOCH_END lines of both ranks."""
    if len(list(out.glob("rank*.recording"))) < 2:
        return False
    try:
        lines = events.read_text(errors="replace").splitlines()
    except OSError:
        return False
    ranks = set()
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:  # the line being written
            continue
        if record.get("type") == "EPOCH_END":
            ranks.add(record.get("context", {}).get("rank"))
    return {0, 1} <= ranks


def _run_with_fault(tmp_path: Path, disk: Path,
                    fault: Callable[[], str]) -> tuple[subprocess.CompletedProcess[str], str,
                                                       dict[int, int], Path]:
    """A 2-worker job recording into ``disk``; ``fault`` runs 0.5 s after events of both
    workers reached the file and returns a note; then the workers stop. Returns the job,
    the note, the events recorded per rank and the JSONL path."""
    out = tmp_path / "out"
    out.mkdir()
    events = disk / "events.jsonl"
    cmd = [sys.executable, "-m", "eventbus", "run", "--events-jsonl", str(events),
           "--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.1",
           str(JOBS / "record_loop.py"), "--out", str(out), "--seconds", "60"]
    note: list[str] = []

    def drive() -> None:
        # The fault goes in once events flow end to end: both workers record (their first
        # record() imports torch, seconds on a loaded machine) and the agent has written
        # lines of both ranks. Timed from the workers' start instead, a loaded machine
        # once filled and freed the disk before anything was written.
        deadline = time.monotonic() + 120
        while not _flowing(out, events) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        try:
            note.append(fault())
        finally:
            (out / "stop").touch()

    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    done = run_command(cmd, cwd=tmp_path, env=job_env(), timeout=180)
    driver.join(10)
    recorded = {int(p.stem[4:]): int(p.read_text().split()[0]) for p in out.glob("rank*.result")}
    return done, (note or ["the fault never ran"])[0], recorded, events


def _foreign_lines(events: Path) -> list[str]:
    """The complete lines of ``events`` that are no JSON object with a type, each cut to
    300 characters (what a failing check shows)."""
    found = []
    for line in events.read_bytes().split(b"\n")[:-1]:
        try:
            value = json.loads(line)
        except ValueError:
            value = None
        if not (isinstance(value, dict) and isinstance(value.get("type"), str)):
            found.append(repr(line[:300]))
    return found


def _check_lines(events: Path, recorded: dict[int, int]) -> tuple[int, int, int]:
    """Every line parses, per rank the epochs rise; returns (lines, EPOCH_END lines, torn)."""
    read = read_jsonl(events)
    records = list(read)
    assert read.foreign == 0, _foreign_lines(events)
    epochs = 0
    for rank in recorded:
        mine = [r["epoch"] for r in records
                if r["type"] == "EPOCH_END" and r["context"].get("rank") == rank]
        assert mine == sorted(set(mine)), rank  # intact and in order, none doubled
        epochs += len(mine)
    assert any(r["type"] == "AGENT_EXIT" for r in records)  # written after the fault
    return len(records), epochs, read.torn


@pytest.mark.slow
def test_disk_full_mid_job_is_reported_once_counted_and_writing_resumes(
    tmp_path: Path, small_disk: Path, figure: Callable[[int, str], None],
) -> None:
    """Fill the JSONL's disk for 2 s mid-job: exit 0, one warning, lost lines counted,
    every line written intact, writing resumes once the filler is gone."""
    filler = small_disk / "filler"

    def fill_then_free() -> str:
        taken = _fill(filler)
        time.sleep(2.0)
        filler.unlink()
        time.sleep(1.5)  # lines written after space returned
        return f"filler took {taken:,} bytes for 2 s"

    done, note, recorded, events = _run_with_fault(tmp_path, small_disk, fill_then_free)
    failed = [line for line in done.stderr.splitlines() if "write failed" in line]
    again = re.findall(r"writing again after .*?; (\d+) lines were lost", done.stderr)
    at_exit = re.findall(r"(\d+) lines were lost to failed writes", done.stderr)
    lines, epochs, torn = _check_lines(events, recorded)
    lost = int(at_exit[0]) if at_exit else 0
    figure(29, f"in a job: rc {done.returncode}; {note}; recorded {sum(recorded.values())} "
               f"EPOCH_END, in the file {epochs} ({lines} lines, torn {torn}); lost lines "
               f"counted {lost} (log: writing again -> {again}); 'write failed' warnings "
               f"{len(failed)}")
    assert done.returncode == 0, done.stderr[-4000:]
    assert sorted(recorded) == [0, 1]
    assert len(failed) == 1, failed
    assert again and int(again[0]) > 0
    assert lost == int(again[-1])
    # what the disk refused is what is missing from the file: every EPOCH_END recorded
    # reached the agent (the store was up), so each missing one is a counted lost line
    assert sum(recorded.values()) - epochs <= lost


@pytest.mark.slow
def test_a_read_only_directory_mid_job_costs_nothing_on_the_open_file(
    tmp_path: Path, small_disk: Path, figure: Callable[[int, str], None],
) -> None:
    """chmod the directory and the file read-only (and try remount,ro) mid-job: the job
    exits 0; where the remount is refused (the file is open), no line is lost."""
    events = small_disk / "events.jsonl"

    def make_read_only() -> str:
        events.chmod(0o444)
        small_disk.chmod(0o555)
        remount = subprocess.run(["mount", "-o", "remount,ro", str(small_disk)],
                                 capture_output=True, text=True, timeout=30, check=False)
        time.sleep(2.0)
        if remount.returncode == 0:
            subprocess.run(["mount", "-o", "remount,rw", str(small_disk)], timeout=30,
                           check=False)
        small_disk.chmod(0o755)
        time.sleep(1.0)
        return ("remount,ro " + ("done" if remount.returncode == 0 else
                                 f"refused: {remount.stderr.strip().splitlines()[0]}"))

    done, note, recorded, _ = _run_with_fault(tmp_path, small_disk, make_read_only)
    _lines, epochs, _torn = _check_lines(events, recorded)
    failed = [line for line in done.stderr.splitlines() if "write failed" in line]
    figure(29, f"read-only mid-job: rc {done.returncode}; chmod 555/444 and {note}; "
               f"recorded {sum(recorded.values())} EPOCH_END, in the file {epochs}; "
               f"'write failed' warnings {len(failed)}")
    assert done.returncode == 0, done.stderr[-4000:]
    if "refused" in note:
        assert epochs == sum(recorded.values())
        assert not failed
    else:
        assert len(failed) == 1
