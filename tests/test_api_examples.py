"""The user's examples (the design document's, imports translated) run verbatim, in a fresh
interpreter, and print what they promise; so do the README's logging examples."""

# ruff: noqa: E501  (the user's example is kept verbatim, long comment lines included)

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.conftest import subprocess_env

#: the user's example, verbatim (shared/API.md), comments included
USER_EXAMPLE = '''\
import logging, sys
import eventbus as events

handler = events.get_logging_handler()
handler.set_format("%(asctime)s - %(name)s - %(levelname)s - %(message)s")
handler.set_stream(sys.stdout)
handler.setLevel(logging.INFO)
events.record(events.EventType.WORKER_EXIT, worker_id=0, exit_code=0,
              data={"epoch": 10, "loss": 0.01})
# -> one line on stdout: "2026-11-29 10:00:00,123 - <logger> - INFO - WORKER_EXIT worker_id=0 exit_code=0 ... epoch ... loss ..."

logger = logging.getLogger("train")
handler.set_logger(logger)          # event records now go through the user's own logger and its handlers

import publishers as publisher
event_publisher = publisher.get_default_event_publisher()
event_publisher.subscribe(events.EventType.WORKER_EXIT, on_event=on_worker_exit)
# on_worker_exit(event) is called with the typed event for every later WORKER_EXIT
'''

#: the example uses on_worker_exit without defining it: the smallest definition
BEFORE = '''\
def on_worker_exit(event):
    print("on_worker_exit", type(event).__name__, event.worker_id, event.exit_code,
          sorted(event.data))
'''

#: what the example says happens next: later WORKER_EXITs reach the callback, and event
#: records go through logger "train" (no handlers of its own: Python's last-resort handler
#: prints WARNING and above to stderr), no longer to the handler's stdout
AFTER = '''\
events.record(events.EventType.WORKER_EXIT, worker_id=1, exit_code=0, data={"epoch": 11})
events.record(events.EventType.WORKER_EXIT, worker_id=1, exit_code=3)
logger.addHandler(logging.StreamHandler(sys.stdout))
logger.setLevel(logging.INFO)
events.record(events.EventType.EPOCH_END, epoch=12)
'''

LINE = re.compile(
    r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} - eventbus\.events - INFO - "
    r"WORKER_EXIT worker_id=0 exit_code=0 .*epoch.*10.*loss.*0\.01.*")


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=subprocess_env(), cwd=ROOT, timeout=120, check=False)


def test_user_example_prints_one_line() -> None:
    """The example alone: exactly one line on stdout, in the requested format, nothing on
    stderr."""
    proc = _run(BEFORE + USER_EXAMPLE)
    assert proc.returncode == 0, proc.stderr
    print(proc.stdout, end="")
    assert len(proc.stdout.splitlines()) == 1
    assert LINE.fullmatch(proc.stdout.splitlines()[0]), proc.stdout
    assert proc.stderr == ""


def test_user_example_then_later_events() -> None:
    """After the example: the subscriber gets typed WORKER_EXITs; records go via "train"."""
    proc = _run(BEFORE + USER_EXAMPLE + AFTER)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    assert LINE.fullmatch(out[0])
    assert out[1:] == [
        "on_worker_exit WorkerExit 1 0 ['epoch']",
        "on_worker_exit WorkerExit 1 3 []",
        "EPOCH_END epoch=12",  # through train's own StreamHandler ("%(message)s")
    ]
    # INFO below the last-resort's WARNING: only the failure shows, on stderr
    assert proc.stderr == "WORKER_EXIT worker_id=1 exit_code=3\n"


def _readme_logging_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    start = text.index("## Logging")
    end = text.index("\n## ", start + 1)
    return re.findall(r"```python\n(.*?)```", text[start:end], flags=re.S)


def test_readme_has_logging_examples() -> None:
    """The README's logging section shows runnable examples."""
    assert len(_readme_logging_blocks()) >= 3


def _check_promises(block: str, printed: str) -> None:
    for promised in re.findall(r"# -> (.+)", block):
        pattern = re.escape(promised.strip()).replace(r"\.\.\.", ".*")
        assert re.search(pattern, printed), (promised, printed)


_IN_PROCESS_BLOCKS = [b for b in _readme_logging_blocks() if "launch.py" not in b]


@pytest.mark.parametrize("block", _IN_PROCESS_BLOCKS,
                         ids=[f"block{i}" for i in range(len(_IN_PROCESS_BLOCKS))])
def test_readme_logging_example_runs(block: str) -> None:
    """Each python block of the README's logging section runs as written; the lines it says
    it prints (``# -> ...`` comments) are printed."""
    block = textwrap.dedent(block)
    proc = _run(block)
    assert proc.returncode == 0, proc.stderr
    _check_promises(block, proc.stdout + proc.stderr)


@pytest.mark.slow
def test_readme_launcher_example_runs_a_real_job(tmp_path: Path) -> None:
    """The README's launch.py, run as its comment says on a 2-worker job, prints both exits."""
    (block,) = [b for b in _readme_logging_blocks() if "launch.py" in b]
    (tmp_path / "launch.py").write_text(block)
    (tmp_path / "train.py").write_text("print('training')\n")
    proc = subprocess.run(
        [sys.executable, "launch.py", "--standalone", "--nproc-per-node", "2",
         "--monitor-interval", "0.1", "train.py"],
        capture_output=True, text=True, env=subprocess_env(), cwd=tmp_path, timeout=180,
        check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_promises(block, proc.stdout)
