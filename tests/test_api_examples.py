"""The user's example (the design document's, imports translated) runs verbatim, in a fresh
interpreter, and prints what it promises. (The README's and docs' examples: test_docs.py.)"""

# ruff: noqa: E501  (the user's example is kept verbatim, long comment lines included)

from __future__ import annotations

import re
import subprocess
import sys

from tests.conftest import ROOT
from tests.conftest import subprocess_env

#: the user's example, verbatim (the API promise's), comments included
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

import eventbus.publishers as publisher
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
