"""``tests/soak.py`` (``make soak``) on a fake slow test: the table counts every run and
each distinct failure, the exit status says a run failed, and a soak stopped by SIGTERM
kills the round in flight (its pytest and what that started) and still writes the table
of the rounds it finished."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import soak

ROOT = Path(__file__).resolve().parents[1]
SOAK = ROOT / "tests" / "soak.py"

# Run 1 passes, run 2 fails, run 3 writes its pid and sleeps until it is killed.
FAKE = '''
import os, time
from pathlib import Path
import pytest

STATE = Path({state!r})

@pytest.mark.slow
def test_flaky():
    runs = int(STATE.read_text()) + 1 if STATE.exists() else 1
    STATE.write_text(str(runs))
    if runs == 2:
        raise AssertionError("second run fails")
    if runs == 3:
        (STATE.parent / "pid").write_text(str(os.getpid()))
        time.sleep(600)
'''


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (not yet reaped by its parent, which the soak killed too) is gone as well
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[-1].split()[0] != "Z"


def _junit(path: Path, cases: str) -> Path:
    path.write_text(f"<testsuites><testsuite>{cases}</testsuite></testsuites>")
    return path


def test_the_table_counts_runs_outcomes_and_each_distinct_failure(tmp_path: Path) -> None:
    """read_junit, render and write_doc in-process (the fast loop's check of the table)."""
    table: dict[str, soak.Outcome] = {}
    one = _junit(tmp_path / "1.xml", (
        '<testcase classname="tests.x" name="test_a" time="1.25"/>'
        '<testcase classname="tests.x" name="test_b" time="0.5">'
        '<failure message="assert 1 == 2&#10;where 1 = f()">tb</failure></testcase>'
        '<testcase classname="tests.x" name="test_c" time="0"><skipped message="no"/>'
        '</testcase>'))
    two = _junit(tmp_path / "2.xml", (
        '<testcase classname="tests.x" name="test_a" time="3.5">'
        '<error message="">\n\nboom in setup\n</error></testcase>'
        '<testcase classname="tests.x" name="test_b" time="0.1">'
        '<failure message="assert 1 == 2&#10;where 1 = g()">tb</failure></testcase>'))
    assert soak.read_junit(one, table) == 3 and soak.read_junit(two, table) == 2
    rows = soak.render(table, ["round 3: pytest exit 2 (see x)"]).splitlines()
    assert rows[2:] == [
        "| tests.x::test_a | 2 | 1 | 1 | 0 | 3.5 | `boom in setup` (1) |",
        "| tests.x::test_b | 2 | 0 | 2 | 0 | 0.5 | `assert 1 == 2` (2) |",
        "| tests.x::test_c | 1 | 0 | 0 | 1 | 0.0 | - |",
        "| (round) | - | - | 1 | - | - | `round 3: pytest exit 2 (see x)` |"]
    doc = tmp_path / "doc.md"
    doc.write_text(f"a\n{soak.BEGIN}\nold\n{soak.END}\nb\n")
    soak.write_doc(doc, "new")
    assert doc.read_text() == f"a\n{soak.BEGIN}\nnew\n{soak.END}\nb\n"
    with pytest.raises(SystemExit, match="no <!-- soak:begin -->"):
        soak.write_doc(tmp_path / "1.xml", "new")


@pytest.mark.slow  # three pytest rounds under a busy process, then a SIGTERM: ~5 s
def test_soak_tabulates_runs_and_failures_and_an_interrupted_soak_keeps_its_table(
    tmp_path: Path,
) -> None:
    fake = tmp_path / "fake" / "test_fake_slow.py"
    fake.parent.mkdir()
    fake.write_text(FAKE.format(state=str(tmp_path / "runs")))
    doc = tmp_path / "doc.md"
    doc.write_text("before\n<!-- soak:begin -->\nold table\n<!-- soak:end -->\nafter\n")
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, str(SOAK), "-n", "5", "--load", "1", "--out", str(out),
         "--doc", str(doc), str(fake)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        pid_file = tmp_path / "pid"
        while not pid_file.exists():
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "round 3 never started"
            time.sleep(0.05)
        sleeper = int(pid_file.read_text())
        proc.send_signal(signal.SIGTERM)
        text, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    # the failed run decides the exit status; the stop is in the summary
    assert proc.returncode == 1, text[-3000:]
    assert "stopped during round 3; the table has the 2 rounds done" in text
    assert "N = 2 rounds (of 5 planned: stopped early)" in text
    assert "2 test runs, 1 failed" in text
    row = next(line for line in text.splitlines() if "test_flaky" in line)
    cells = [c.strip() for c in row.split("|")[2:-1]]
    assert cells[:4] == ["2", "1", "1", "0"], row  # runs, passed, failed, skipped
    assert "second run fails" in cells[5], row
    # the round in flight died with the soak
    deadline = time.monotonic() + 10
    while _alive(sleeper) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(sleeper)
    written = doc.read_text()
    assert written.startswith("before\n<!-- soak:begin -->\nSoak of ")
    assert "old table" not in written and written.endswith("<!-- soak:end -->\nafter\n")
    assert "test_flaky" in written


LEAK = '''
import subprocess, sys
from pathlib import Path

def test_leaves_a_process_behind():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                            start_new_session=True)
    Path({pid!r}).write_text(str(proc.pid))
'''


@pytest.mark.slow  # one pytest round, then the soak's 5 s grace for leftovers
def test_a_process_a_test_leaves_behind_fails_the_round_and_is_killed(tmp_path: Path) -> None:
    """A test that passes but leaves a process behind (in a session of its own, out of the
    round's process group) fails the soak: the round names the process, and the soak kills
    it."""
    fake = tmp_path / "fake" / "test_fake_leak.py"
    fake.parent.mkdir()
    pid_file = tmp_path / "leaked.pid"
    fake.write_text(LEAK.format(pid=str(pid_file)))
    done = subprocess.run(
        [sys.executable, str(SOAK), "-n", "1", "--load", "0", "--out", str(tmp_path / "out"),
         str(fake)], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    leaked = int(pid_file.read_text())
    try:
        assert done.returncode == 1, done.stdout[-3000:]
        assert "1 test runs, 1 failed" in done.stdout, done.stdout[-3000:]
        assert f"1 process(es) left behind, killed: {leaked} " in done.stdout
        deadline = time.monotonic() + 10
        while _alive(leaked) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(leaked)
    finally:
        if _alive(leaked):
            os.kill(leaked, signal.SIGKILL)


def test_the_default_selection_is_the_fault_matrix() -> None:
    """With no path, a soak runs tests/reliability, slow and fast tests alike."""
    assert soak.DEFAULT_PATHS == ("tests/reliability",)
    assert (ROOT / "tests" / "reliability").is_dir()
