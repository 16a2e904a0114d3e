"""`eventbus tail` / eventbus.app.readers.tail: one readable line per event, following a file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

import pytest

from eventbus.app.cli import main as cli_main
from eventbus.app.readers.records import Problem
from eventbus.app.readers.records import Record
from eventbus.app.readers.records import decode_line
from eventbus.app.readers.tail import EventFileReader
from eventbus.app.readers.tail import format_record

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
NODE0 = FIXTURES / "job_node0.jsonl"
NODE1 = FIXTURES / "job_node1.jsonl"
ANSI = "\x1b["


def _line(type_: str = "EPOCH_END", t: float = 1_764_410_000.0, rank: int | None = 0,
          **fields: object) -> str:
    return json.dumps({"type": type_, "timestamp": t, **fields, "data": {},
                       "context": {"rank": rank, "hostname": "h", "pid": 1}})


def test_renders_a_fixture_with_a_torn_line_and_an_unknown_type(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Every event is one line on stdout, the user type included; the torn last line is
    reported on stderr with its number; exit 0."""
    assert cli_main(["tail", str(NODE0)]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert len(lines) == 42
    user = next(line for line in lines if "DATA_SHARD_LOADED" in line)
    assert "rank 0" in user and "shard=3 | rows=4096" in user
    failure = next(line for line in lines if "exit_code=3" in line)
    assert "agent" in failure and "WORKER_EXIT" in failure
    assert ANSI not in captured.out  # not a terminal: no colour
    assert "job_node0.jsonl:43: torn line" in captured.err
    assert "42 event(s) shown, 1 line(s) skipped" in captured.err


def test_foreign_lines_are_reported_in_place(capsys: pytest.CaptureFixture[str]) -> None:
    """A line some other program wrote into the file is skipped and named, not fatal."""
    assert cli_main(["tail", str(NODE1)]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.splitlines()) == 37
    assert "job_node1.jsonl:8: foreign line (not JSON" in captured.err
    assert "W1129 10:00:03.123 torch/distributed/run.py" in captured.err


def test_type_and_rank_filters(capsys: pytest.CaptureFixture[str]) -> None:
    """--type is case-insensitive and repeatable; --rank N includes the agent's events
    about worker N; --rank agent is the agent's own events."""
    assert cli_main(["tail", "--type", "worker_exit,worker_restart", str(NODE0)]) == 0
    types = [line.split()[3] for line in capsys.readouterr().out.splitlines()]
    assert types == ["WORKER_EXIT", "WORKER_RESTART", "WORKER_EXIT", "WORKER_EXIT"]

    assert cli_main(["tail", "--rank", "1", "--type", "WORKER_START", str(NODE0)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and all("worker_id=1" in line for line in out)

    assert cli_main(["tail", "--rank", "1", "--type", "EPOCH_END", str(NODE0)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 4 and all("rank 1" in line for line in out)

    assert cli_main(["tail", "--rank", "agent", str(NODE0)]) == 0
    assert all(" agent " in line for line in capsys.readouterr().out.splitlines())


def test_bad_rank_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """--rank x exits 2 and says what a rank looks like."""
    with pytest.raises(SystemExit) as exc:
        cli_main(["tail", "--rank", "x", str(NODE0)])
    assert exc.value.code == 2
    assert "--rank 'x': give a global rank number" in capsys.readouterr().err


def test_missing_file_without_follow(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No file, no -f: exit 2 naming the file."""
    assert cli_main(["tail", str(tmp_path / "none.jsonl")]) == 2
    assert "none.jsonl: no such file" in capsys.readouterr().err


def test_last_n(capsys: pytest.CaptureFixture[str]) -> None:
    """-n N keeps the last N matching events."""
    assert cli_main(["tail", "-n", "2", str(NODE0)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[3] for line in out] == ["WORKER_EXIT", "AGENT_EXIT"]


def test_colour_marks_failures_red_and_user_types_bold() -> None:
    """With colour, a failure's type is bold red, a user type bold, a restart yellow."""
    failure = decode_line(_line("WORKER_EXIT", rank=None, worker_id=1, exit_code=3))
    assert isinstance(failure, Record)
    assert "\x1b[1;31mWORKER_EXIT" in format_record(failure, colour=True)
    user = decode_line(_line("MY_EVENT", shard=1))
    assert isinstance(user, Record)
    assert "\x1b[1mMY_EVENT" in format_record(user, colour=True)
    restart = decode_line(_line("WORKER_RESTART", rank=None, attempt=1))
    assert isinstance(restart, Record)
    assert "\x1b[1;33mWORKER_RESTART" in format_record(restart, colour=True)


def test_hostile_payloads_stay_on_one_line_without_escape_codes() -> None:
    """Newlines, escape sequences and line separators from the file are escaped."""
    record = decode_line(json.dumps({
        "type": "EVIL\x1b[2J", "timestamp": 1.0, "msg": "a\nb\u2028c",
        "data": {"k": "\x1b]0;title\x07"}, "context": {"hostname": "h\nx"}}))
    assert isinstance(record, Record)
    for colour in (False, True):
        text = format_record(record, colour=colour)
        assert "\n" not in text and "\u2028" not in text
        assert "\x1b[2J" not in text and "\x1b]0" not in text
        assert "EVIL\\x1b[2J" in text


def test_reader_holds_an_unfinished_line_until_its_newline(tmp_path: Path) -> None:
    """A half-written line is not reported as torn while the writer may finish it."""
    path = tmp_path / "events.jsonl"
    full = _line(epoch=1)
    path.write_text(full[:20])
    reader = EventFileReader(path)
    assert reader.poll() == []
    with path.open("a") as fh:
        fh.write(full[20:] + "\n")
    items = reader.poll()
    assert len(items) == 1 and isinstance(items[0], Record) and items[0].fields == {"epoch": 1}
    with path.open("a") as fh:
        fh.write('{"type": "EPOCH_END", "timest')
    assert reader.poll() == []
    torn = reader.finish()
    assert len(torn) == 1 and isinstance(torn[0], Problem) and torn[0].kind == "torn"
    assert torn[0].line == 2
    reader.close()


def test_reader_survives_truncation_and_replacement(tmp_path: Path) -> None:
    """A truncated file is read from its start again; a replaced one is reopened."""
    path = tmp_path / "events.jsonl"
    path.write_text(_line(epoch=1) + "\n" + _line(epoch=2) + "\n")
    reader = EventFileReader(path)
    assert len(reader.poll()) == 2
    path.write_text(_line(epoch=3) + "\n")  # truncates in place: shorter than before
    items = reader.poll()
    assert [i.fields["epoch"] for i in items if isinstance(i, Record)] == [3]
    assert any("truncated" in n for n in reader.notices)
    reader.notices.clear()
    replacement = tmp_path / "new.jsonl"
    replacement.write_text(_line(epoch=4) + "\n" + _line(epoch=5) + "\n" + _line(epoch=6)
                           + "\n")
    os.replace(replacement, path)
    items = reader.poll()
    assert [i.fields["epoch"] for i in items if isinstance(i, Record)] == [4, 5, 6]
    assert any("replaced" in n for n in reader.notices)
    reader.close()


def _read_until(stream: IO[str] | None, needle: str, timeout: float) -> list[str]:
    """Lines of a child's stream up to the one containing needle (fails after timeout)."""
    got: list[str] = []
    found = threading.Event()

    def pump() -> None:
        assert stream is not None
        for line in stream:
            got.append(line)
            if needle in line:
                found.set()
                return

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    if not found.wait(timeout):
        raise AssertionError(f"{needle!r} not seen within {timeout}s; got {got!r}")
    return got


def test_follow_prints_lines_as_the_file_grows(tmp_path: Path) -> None:
    """`eventbus tail -f` waits for the file, prints each event once its line is complete,
    reports a foreign line, and exits 0 on Ctrl-C (SIGINT)."""
    path = tmp_path / "events.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "eventbus", "tail", "-f", "--interval", "0.05", str(path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        _read_until(proc.stderr, "waiting for", timeout=30)
        with path.open("w") as fh:
            fh.write(_line(epoch=7) + "\n")
            fh.flush()
            first = _read_until(proc.stdout, "epoch=7", timeout=30)
            assert len(first) == 1
            late = _line("MY_EVENT", shard=9)
            fh.write("garbage from elsewhere\n" + late[:15])
            fh.flush()
            time.sleep(0.3)
            fh.write(late[15:] + "\n")
            fh.flush()
            second = _read_until(proc.stdout, "MY_EVENT", timeout=30)
            assert len(second) == 1 and "shard=9" in second[0]
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0
        assert "events.jsonl:2: foreign line" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)


def test_long_data_is_cut_unless_full(tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A huge data payload is cut with a note saying how much and how to see it; --full
    shows it whole."""
    path = tmp_path / "events.jsonl"
    path.write_text(json.dumps({"type": "TORCHELASTIC", "timestamp": 1.0, "name": "x",
                                "data": {"blob": "y" * 1000}, "context": {}}) + "\n")
    assert cli_main(["tail", str(path)]) == 0
    short = capsys.readouterr().out
    assert "chars, --full)" in short and len(short) < 500
    assert cli_main(["tail", "--full", str(path)]) == 0
    assert "y" * 1000 in capsys.readouterr().out


def test_the_viewers_import_neither_torch_nor_matplotlib() -> None:
    """trace, tail and the job model read a file without torch; matplotlib loads only to
    draw, so `eventbus tail` starts fast on a login node."""
    code = ("import sys, eventbus.app.readers.trace, eventbus.app.readers.tail, "
            "eventbus.app.readers.timeline\n"
            "from eventbus.app.readers.jobview import JobView\n"
            f"JobView.from_files([{str(NODE0)!r}])\n"
            "print(sorted(m for m in ('torch', 'matplotlib') if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    assert out.strip() == "[]"
