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
          data: dict[str, object] | None = None, **fields: object) -> str:
    return json.dumps({"type": type_, "timestamp": t, **fields, "data": data or {},
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


def test_a_worker_the_agent_stopped_is_yellow_from_its_fields() -> None:
    """A WORKER_EXIT the agent caused (data["stopped_by_agent"], or a cause other than
    the worker's own failure) is yellow, not a red failure."""
    marked = _line("WORKER_EXIT", rank=None, data={"stopped_by_agent": True}, worker_id=0,
                   exit_code=-15)
    caused = _line("WORKER_EXIT", rank=None, worker_id=0, exit_code=-15, cause="remote_stop")
    for line in (marked, caused):
        stopped = decode_line(line)
        assert isinstance(stopped, Record)
        assert "\x1b[33mWORKER_EXIT" in format_record(stopped, colour=True)
    own = decode_line(_line("WORKER_EXIT", rank=None, worker_id=1, exit_code=3,
                            cause="failure"))
    assert isinstance(own, Record)
    assert "\x1b[1;31mWORKER_EXIT" in format_record(own, colour=True)


def test_a_drain_is_cyan_and_its_late_worker_yellow_not_red() -> None:
    """PREEMPTING and a preempted job's AGENT_EXIT are bold cyan (a drain: neither a
    failure nor a success), the worker that did not stop in time yellow (its agent
    stopped it), the one that stopped by itself green."""
    from tests.test_jobview import drained_job_lines

    shown = {}
    for line in drained_job_lines():
        record = decode_line(line.rstrip("\n"))
        assert isinstance(record, Record)
        key = record.type + (f" {record.fields['worker_id']}"
                             if record.type == "WORKER_EXIT" else "")
        shown[key] = format_record(record, colour=True)
    assert "\x1b[1;36mPREEMPTING" in shown["PREEMPTING"]
    assert "\x1b[1;36mAGENT_EXIT" in shown["AGENT_EXIT"]
    assert "\x1b[33mWORKER_EXIT" in shown["WORKER_EXIT 1"]
    assert "\x1b[32mWORKER_EXIT" in shown["WORKER_EXIT 0"]
    assert not any("\x1b[1;31m" in text for text in shown.values())
    failed = decode_line(_line("AGENT_EXIT", rank=None, state="FAILED", exit_code=1))
    assert isinstance(failed, Record)
    assert "\x1b[1;31mAGENT_EXIT" in format_record(failed, colour=True)


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
    # The child must hear the SIGINT this test sends. A process that starts with SIGINT
    # ignored (a job a non-interactive shell put in the background, and so its children)
    # keeps it ignored, as Python does; a handler, unlike an ignore, is not inherited, so
    # with one set here for the fork the child starts with Python's own.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "eventbus", "tail", "-f", "--interval", "0.05", str(path)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)
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
    path.write_text(json.dumps({"type": "MY_EVENT", "timestamp": 1.0, "name": "x",
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


# -- stalls, type filters, torch's records (issue 23) --------------------------------------

OWN = str(ROOT / "eventbus" / "subscribers" / "store_forwarder.py")
#: a faulthandler dump as the agent used to store it: eventbus's thread first, main last
STACK = f"""Thread 0x00007f0000000001 (most recent call first):
  File "{OWN}", line 210 in _run
  File "/usr/lib/python3.11/threading.py", line 975 in run
  File "/usr/lib/python3.11/threading.py", line 995 in _bootstrap

Current thread 0x00007f0000000002 (most recent call first):
  File "/job/.venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", \
line 2800 in all_reduce
  File "/job/train.py", line 18 in main
  File "/job/train.py", line 30 in <module>
"""


def _stall_file(tmp_path: Path) -> Path:
    path = tmp_path / "events.jsonl"
    lines = [
        _line("EPOCH_START", rank=1, epoch=0),
        json.dumps({"type": "WORKER_STALLED", "timestamp": 1_764_410_005.0, "worker_id": 1,
                    "silent_s": 5.2, "data": {"stack": STACK, "peer_stacks": {"0": STACK}},
                    "context": {"rank": None, "hostname": "h", "pid": 9}}),
        json.dumps({"type": "WORKER_PROGRESS", "timestamp": 1_764_410_001.0, "worker_id": 1,
                    "step": 3, "data": {}, "context": {"rank": 1, "hostname": "h", "pid": 2}}),
        json.dumps({"type": "TORCHELASTIC", "timestamp": 1_764_410_000.5,
                    "name": "torchelastic.worker.status.SUCCEEDED", "source": "AGENT",
                    "data": {"state": "SUCCEEDED", "global_rank": 1, "group_rank": 0,
                             "entry_point": "python", "raw_error": None,
                             "metadata": json.dumps({"x": "y" * 400})},
                    "context": {"rank": None, "hostname": "h", "pid": 9}}),
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_stall_shows_the_main_threads_top_frame(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Without --full a stall's stack is the top frame of the worker's main thread (not
    eventbus's own thread, which came first in the dump), on one line."""
    assert cli_main(["tail", "--type", "WORKER_STALLED", str(_stall_file(tmp_path))]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert ("stack='distributed_c10d.py:2800 in all_reduce, from train.py:18 (main thread; 2 "
            "threads, --full)'") in line, line
    assert "store_forwarder" not in line and "peer_stacks='1 rank(s), --full'" in line


def test_full_prints_a_stack_on_several_lines_main_thread_first(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--full: the stack under the event's line, indented, the main thread first and
    eventbus's own thread last and marked; the peers' stacks after it."""
    assert cli_main(["tail", "--full", "--type", "WORKER_STALLED",
                     str(_stall_file(tmp_path))]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "WORKER_STALLED" in lines[0] and "stack='(below)'" in lines[0]
    assert lines[1] == "    stack:"
    headers = [i for i, line in enumerate(lines) if "(most recent call first)" in line]
    assert lines[headers[0]].strip().startswith("Current thread 0x00007f0000000002")
    assert "[eventbus's own thread]" in lines[headers[1]]
    assert lines[headers[0] + 1].strip().startswith('File "/job/.venv')
    assert lines[headers[0] + 1].startswith("        ")
    assert "    peer_stacks[0]:" in lines
    assert all("\\n" not in line for line in lines)


@pytest.mark.parametrize("args", [
    ["--type", "-TORCHELASTIC"], ["--type=-TORCHELASTIC"], ["--type", "!TORCHELASTIC"],
    ["--exclude", "torchelastic"], ["--type", "epoch_start,worker_stalled"],
    ["--type", "EPOCH_START", "--type", "WORKER_STALLED"],
])
def test_type_selects_several_and_excludes(args: list[str], tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """--type takes several types; -TYPE, !TYPE and --exclude leave one out."""
    assert cli_main(["tail", *args, str(_stall_file(tmp_path))]) == 0
    types = [next(w for w in line.split() if w.isupper() and "_" in w)
             for line in capsys.readouterr().out.splitlines()]
    assert types == ["EPOCH_START", "WORKER_STALLED"], types


def test_heartbeats_are_hidden_unless_asked_for(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """WORKER_PROGRESS (one a second per rank) is left out, and said so on stderr, unless
    --type names it."""
    path = _stall_file(tmp_path)
    assert cli_main(["tail", str(path)]) == 0
    captured = capsys.readouterr()
    assert "WORKER_PROGRESS" not in captured.out
    assert "1 WORKER_PROGRESS heartbeat(s) not shown" in captured.err
    assert cli_main(["tail", "--type", "worker_progress", str(path)]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert "WORKER_PROGRESS" in line and "step=3" in line


def test_torch_records_are_one_short_line_unless_full(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A TORCHELASTIC record shows its name and state; --full shows its metadata."""
    path = _stall_file(tmp_path)
    assert cli_main(["tail", "--type", "TORCHELASTIC", str(path)]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert "name='torchelastic.worker.status.SUCCEEDED'" in line
    assert "state='SUCCEEDED'" in line and "global_rank=1" in line
    assert "metadata" not in line and len(line) < 200
    assert cli_main(["tail", "--full", "--type", "TORCHELASTIC", str(path)]) == 0
    assert "y" * 400 in capsys.readouterr().out


@pytest.mark.parametrize(("value", "words"), [
    ("METRC", ["--type 'METRC': no such event type (did you mean 'METRIC'?)", "WORKER_EXIT"]),
    ("-WORKER_EXT", ["did you mean 'WORKER_EXIT'?"]),
    ("-", ["give an event type name"]),
])
def test_an_unknown_type_is_a_usage_error(value: str, words: list[str], tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A type neither built in nor in the file: exit 2, the valid names, the closest one."""
    with pytest.raises(SystemExit) as exc:
        cli_main(["tail", f"--type={value}", str(_stall_file(tmp_path))])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err, err


def test_a_user_type_in_the_file_is_valid(capsys: pytest.CaptureFixture[str]) -> None:
    """Types of the user's own, found in the file, are accepted like built-in ones."""
    assert cli_main(["tail", "--type", "data_shard_loaded", str(NODE0)]) == 0
    assert "DATA_SHARD_LOADED" in capsys.readouterr().out


def test_a_directory_is_named_as_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """tail DIR: exit 2, 'is a directory', and the events files in it."""
    _stall_file(tmp_path)
    assert cli_main(["tail", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "is a directory, not an events file; give one of its events files: events.jsonl" in err


def test_a_stall_with_the_agents_analysis_keeps_where_and_why_on_its_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The agent's WORKER_STALLED carries a diagnosis, the collective and more: the stack's
    top frame and the diagnosis come first, so the 240-character cut never hides them."""
    path = tmp_path / "events.jsonl"
    path.write_text(json.dumps({
        "type": "WORKER_STALLED", "timestamp": 1_764_410_005.0, "worker_id": 1,
        "silent_s": 65.2, "timeout_s": 60.0,
        "data": {"attempt": 0, "culprit_ranks": [1], "waiting_ranks": [0],
                 "collective": {"pg": "0", "op": "all_reduce", "seq": 12,
                                "sizes": [[1024]] * 20, "dtypes": ["Float"]},
                 "diagnosis": "rank 1 never entered all_reduce #12 that rank 0 waits in",
                 "mismatch": None, "stack": STACK, "peer_stacks": {"0": STACK}},
        "context": {"rank": None, "hostname": "h", "pid": 9}}) + "\n")
    assert cli_main(["tail", str(path)]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    data = line.split(" | ", 1)[1]
    assert data.startswith("stack='distributed_c10d.py:2800 in all_reduce, from train.py:18")
    assert "diagnosis='rank 1 never entered all_reduce #12" in data
    assert "mismatch" not in data and "--full)" in data
