"""The agent <-> worker protocol (eventbus_app/protocol/agent_worker.py) driven from both
ends: the one grammar of the progress sources, the flight-recorder request file and dump
names, the stack-dump files, and the rule that no other module defines the variables'
names again."""

from __future__ import annotations

import argparse
import ast
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import eventbus
from eventbus.app import worker
from eventbus.app.health import probes
from eventbus.app.launcher.cli import options
from eventbus.app.protocol import agent_worker as aw
from eventbus.app.worker.progress import ProgressWatch
from tests.conftest import ROOT
from tests.conftest import subprocess_env

ACCEPTED = "use off, all, or a comma list of collectives, steps, events"

#: strings of the grammar, good and bad: every word it knows, in any case and spacing,
#: and a few it does not
_WORDS = st.sampled_from(["collectives", "steps", "events", "off", "all", "", " Steps ",
                          "EVENTS", "gpu", "step", "off ", "collectives\t"])
_TEXTS = st.lists(_WORDS, min_size=1, max_size=4).map(",".join)


def _worker_reads(value: str | None) -> tuple[tuple[str, ...], list[str]]:
    """What the worker bootstrap makes of ``EVENTBUS_PROGRESS=value`` (None: unset): the
    sources and its warnings."""
    notes: list[str] = []
    env = {} if value is None else {aw.ENV_PROGRESS: value}
    return worker._progress_sources(env, notes), notes


def _agent_parses(text: str) -> tuple[str, ...] | None:
    """``--progress text`` on the agent's command line: the sources, None for a usage
    error."""
    try:
        return options.parse_progress(text)
    except argparse.ArgumentTypeError:
        return None


# -- the one grammar of the progress sources ---------------------------------------------


@pytest.mark.parametrize("text", ["", "  ", "all", "ALL", "off", " Off ", "steps",
                                  "events,steps", "steps, collectives ,events",
                                  "steps,steps", "Collectives"])
def test_what_the_agent_accepts_the_worker_reads_back_to_the_same_sources(text: str) -> None:
    """For an accepted --progress value, the value the agent writes
    (format_progress(parse_progress(x))) is read by the worker to the same sources, with
    no warning; the command line, the protocol and the worker take x alike."""
    sources = aw.parse_progress(text)
    assert options.parse_progress(text) == sources
    assert sources == tuple(s for s in aw.PROGRESS_SOURCES if s in sources)  # canonical
    assert _worker_reads(aw.format_progress(sources)) == (sources, [])
    assert _worker_reads(text) == (sources, [])


def test_empty_unset_and_all_are_all_three_and_off_is_none() -> None:
    """"", unset and "all" mean all three sources (the agent's default too); "off" none;
    the agent writes "off" and the canonical comma list."""
    everything = ("collectives", "steps", "events")
    assert everything == aw.PROGRESS_SOURCES
    assert aw.parse_progress("") == aw.parse_progress("all") == everything
    assert _worker_reads(None) == (everything, [])
    assert _worker_reads(options.DEFAULT_PROGRESS) == (everything, [])
    assert aw.parse_progress("off") == () and aw.format_progress(()) == "off"
    assert aw.format_progress(["events", "steps", "events"]) == "steps,events"
    assert aw.format_progress(everything) == "collectives,steps,events"


@pytest.mark.parametrize(("text", "bad"), [("gpu", "'gpu'"), ("steps,colectives", "'colectives'"),
                                           ("steps,", "''"), (",", "''"),
                                           ("off,steps", "'off'"), ("steps, all", "'all'")])
def test_a_bad_value_names_the_bad_item_and_what_is_accepted(text: str, bad: str) -> None:
    """A bad value is a ValueError naming the bad item and what is accepted; the command
    line turns it into a usage error with the same words, and the worker into one warning
    naming the variable, after which it uses all three sources."""
    with pytest.raises(ValueError, match=r"no progress source|stands alone") as exc:
        aw.parse_progress(text)
    message = str(exc.value)
    assert bad in message and ACCEPTED in message
    with pytest.raises(argparse.ArgumentTypeError) as usage:
        options.parse_progress(text)
    assert str(usage.value) == f"{text!r} {message}"
    sources, notes = _worker_reads(text)
    assert sources == aw.PROGRESS_SOURCES and len(notes) == 1
    assert notes[0].startswith(f"eventbus: {aw.ENV_PROGRESS}={text!r} {message}")


def test_format_progress_refuses_a_name_that_is_no_source() -> None:
    """The agent cannot write a source the worker would refuse."""
    with pytest.raises(ValueError, match="'gpu'"):
        aw.format_progress(["steps", "gpu"])


@settings(max_examples=200, deadline=None, derandomize=True)
@given(text=_TEXTS)
def test_both_ends_accept_exactly_the_same_strings(text: str) -> None:
    """Any comma list of known and unknown words: the command line accepts it exactly
    when the worker reads it without a warning, to the same sources, and what the agent
    writes for it reads back to them."""
    agent = _agent_parses(text)
    sources, notes = _worker_reads(text)
    if agent is None:
        assert len(notes) == 1 and sources == aw.PROGRESS_SOURCES
    else:
        assert (sources, notes) == (agent, [])
        assert _worker_reads(aw.format_progress(agent)) == (agent, [])


# -- the flight-recorder request and dump files -----------------------------------------


def test_a_request_is_served_once_and_one_older_than_the_reader_never(tmp_path: Path) -> None:
    """The agent's write_fr_request and the worker's FrRequestReader: a request written
    before the reader existed (a former attempt's) is never served; each new request is
    served once, the same token written again is a new request."""
    aw.write_fr_request(str(tmp_path), "old")
    reader = aw.FrRequestReader(str(tmp_path))
    assert reader.take() is None
    aw.write_fr_request(str(tmp_path), "stall-1")
    assert reader.take() == "stall-1"
    assert reader.take() is None
    aw.write_fr_request(str(tmp_path), "stall-1")
    assert reader.take() == "stall-1" and reader.take() is None
    assert aw.FrRequestReader(None).take() is None


def test_the_request_file_is_one_token_written_whole(tmp_path: Path) -> None:
    """The request is the token and a newline in <folder>/request (the folder made if
    need be), no temp file left; a token of 0 or more than 200 characters, or with a line
    break, is refused before anything is written."""
    folder = tmp_path / "attempt0"
    aw.write_fr_request(str(folder), "x" * aw.MAX_FR_TOKEN_CHARS)
    assert os.listdir(folder) == [aw.FR_REQUEST_FILE]
    assert (folder / aw.FR_REQUEST_FILE).read_text() == "x" * aw.MAX_FR_TOKEN_CHARS + "\n"
    for bad in ("", "x" * (aw.MAX_FR_TOKEN_CHARS + 1), "a\nb"):
        with pytest.raises(ValueError, match="1-200 printable"):
            aw.write_fr_request(str(tmp_path / "other"), bad)
    assert not (tmp_path / "other").exists()


def test_the_agent_asks_the_worker_dumps_and_the_agent_finds_the_dump(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """probes.ask_fr_dumps -> the worker's watch serves the token once and writes
    fr_trace_rank_<rank> (fr_dump_path), answering with fr_dump_token and fr_dump ->
    probes.wait_fr_dumps sees that file."""
    monkeypatch.setitem(sys.modules, "torch._C._distributed_c10d",
                        SimpleNamespace(_dump_fr_trace=lambda *args: b"trace"))
    folder = aw.fr_dump_folder(str(tmp_path), 2)
    watch = ProgressWatch(frozenset({"collectives"}), rank=3, dump_dir=folder,
                          bus=eventbus.Bus("protocol-test"), record=lambda *a, **k: None)
    asked = probes.ask_fr_dumps(folder, "stall-attempt2")
    served = watch._serve_request()
    path = aw.fr_dump_path(folder, 3)
    assert served == {aw.FR_DUMP_TOKEN_KEY: "stall-attempt2", aw.FR_DUMP_KEY: path}
    assert watch._serve_request() is None
    assert Path(path).read_bytes() == b"trace"
    assert probes.wait_fr_dumps(folder, [3], asked, wait_s=1.0)
    assert sorted(os.listdir(folder)) == ["fr_trace_rank_3", aw.FR_REQUEST_FILE]


def test_the_dump_names() -> None:
    """<tmp>/eventbus-fr/<run id, made safe>/attempt<A>/fr_trace_rank_<rank>."""
    root = aw.fr_dump_root("job/1 x")
    assert root.endswith(os.path.join("eventbus-fr", "job_1_x")) and os.path.isabs(root)
    assert aw.fr_dump_root("").endswith(os.path.join("eventbus-fr", "run"))
    folder = aw.fr_dump_folder(root, 2)
    assert folder == os.path.join(root, "attempt2")
    assert aw.fr_dump_path(folder, 7) == os.path.join(folder, "fr_trace_rank_7")
    assert os.path.basename(aw.fr_dump_path(folder, 7)).startswith(aw.FR_DUMP_PREFIX)
    assert not aw.FR_REQUEST_FILE.startswith(aw.FR_DUMP_PREFIX)


# -- the stack-dump files ------------------------------------------------------------------


def test_the_stack_files_are_named_by_pid(tmp_path: Path) -> None:
    """<dir>/<pid>.sig holds the signal's number, <dir>/<pid>.stack the stacks; the
    agent's reader refuses a .sig that holds no number and raises OSError without one."""
    assert aw.stack_signal_path("/d", 12) == os.path.join("/d", "12.sig")
    assert aw.stack_file_path("/d", 12) == os.path.join("/d", "12.stack")
    with pytest.raises(OSError):
        aw.read_stack_signal(str(tmp_path), 12)
    for junk in ("", "SIGUSR2", "-3", "0"):
        Path(aw.stack_signal_path(str(tmp_path), 12)).write_text(junk)
        with pytest.raises(ValueError, match="no signal number"):
            aw.read_stack_signal(str(tmp_path), 12)
    Path(aw.stack_signal_path(str(tmp_path), 12)).write_text("45\n")
    assert aw.read_stack_signal(str(tmp_path), 12) == 45


def test_the_signal_the_worker_arms_is_the_one_the_agent_reads(tmp_path: Path) -> None:
    """A worker's arm_stack_dump writes the files the agent's reader finds: the signal's
    number in <pid>.sig, and <pid>.stack."""
    code = ("import os, signal; from eventbus.app.worker.stack_dump import arm_stack_dump;"
            f"print(os.getpid(), arm_stack_dump({str(tmp_path)!r}, signal.SIGUSR2))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=subprocess_env(), timeout=60, check=True)
    pid, stack = done.stdout.split()
    assert aw.read_stack_signal(str(tmp_path), int(pid)) == signal.SIGUSR2
    assert stack == aw.stack_file_path(str(tmp_path), int(pid)) and os.path.exists(stack)


# -- one definition ----------------------------------------------------------------------

#: the variables only the protocol module may name in a module-level constant
VARIABLES = frozenset({"EVENTBUS_PROGRESS", "EVENTBUS_FR_DUMP_DIR", "EVENTBUS_STACK_DIR",
                       "EVENTBUS_STACK_SIGNAL"})
PROTOCOL = Path("eventbus_app", "protocol", "agent_worker.py")


def _module_constants(path: Path) -> set[str]:
    """The strings of ``VARIABLES`` in the values assigned at the module level of
    ``path`` (a tuple of names included)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            found.update(n.value for n in ast.walk(node.value)
                         if isinstance(n, ast.Constant) and n.value in VARIABLES)
    return found


def test_only_the_protocol_module_defines_the_variables_names() -> None:
    """No module of the four folders but protocol/agent_worker.py assigns the strings
    EVENTBUS_PROGRESS, EVENTBUS_FR_DUMP_DIR, EVENTBUS_STACK_DIR, EVENTBUS_STACK_SIGNAL at
    its module level (so the two ends cannot define them apart); that one defines each."""
    defined: dict[Path, set[str]] = {}
    for folder in ("eventbus", "publishers", "subscribers", "eventbus_app"):
        for directory, subdirs, files in os.walk(ROOT / folder):  # links not followed
            subdirs[:] = [d for d in subdirs if d != "__pycache__"]
            for name in files:
                if name.endswith(".py"):
                    path = Path(directory, name)
                    found = _module_constants(path)
                    if found:
                        defined[path.relative_to(ROOT)] = found
    assert defined.pop(PROTOCOL, set()) == VARIABLES
    assert defined == {}


def test_the_heartbeat_interval_grows_with_the_job_within_the_stall_timeout() -> None:
    """1 s up to BEATS_PER_S ranks; then group rank 0 receives about BEATS_PER_S beats a
    second; never above a quarter of the stall timeout nor MAX_BEAT_S. The workers read
    it back from EVENTBUS_BEAT_S, anything odd being 1 s."""
    from eventbus.app.protocol import agent_worker as aw

    assert aw.beat_interval(2) == 1.0
    assert aw.beat_interval(aw.BEATS_PER_S) == 1.0
    assert aw.beat_interval(8192) == 8192 / aw.BEATS_PER_S == 4.0
    assert aw.beat_interval(8192, stall_timeout=8.0) == 2.0
    assert aw.beat_interval(8192, stall_timeout=2.0) == 1.0
    assert aw.beat_interval(1_000_000) == aw.MAX_BEAT_S
    assert aw.parse_beat("4") == 4.0
    for odd in (None, "", "0.5", "nan", "inf", "soon", "11"):
        assert aw.parse_beat(odd) == 1.0


def test_a_worker_beats_at_the_interval_its_agent_set(monkeypatch: pytest.MonkeyPatch
                                                      ) -> None:
    """With EVENTBUS_BEAT_S=3 a progressing rank beats 3 s apart and an idle one 6 s apart
    (the ticks driven by hand: the watch's clock is the monotonic one, so the beat times
    are moved back instead)."""
    import eventbus
    from eventbus.app.worker import progress

    monkeypatch.setenv("EVENTBUS_BEAT_S", "3")
    beats: list[dict[str, object]] = []
    watch = progress.ProgressWatch(frozenset({"events"}), rank=0,
                                   bus=eventbus.Bus("beat-interval"),
                                   record=lambda _type, **fields: beats.append(fields))
    assert watch.beat_s == 3.0
    watch.armed = True
    watch.tick()
    first = len(beats)
    assert first == 1
    watch._changed = True
    watch._beat_t -= 2.0  # progressing, 2 s since the beat: not yet
    watch.tick()
    assert len(beats) == first
    watch._changed = True
    watch._beat_t -= 1.1  # 3.1 s: a beat
    watch.tick()
    assert len(beats) == first + 1
    watch._beat_t -= 5.0  # idle 5 s: not yet; 6.1 s: an idle beat
    watch.tick()
    assert len(beats) == first + 1
    watch._beat_t -= 1.1
    watch.tick()
    assert len(beats) == first + 2
