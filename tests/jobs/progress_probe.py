"""Runs a script the way the bootstrap does, with the progress watch attached, and writes
this rank's WORKER_PROGRESS heartbeats to ``$PROBE_OUT/rank<RANK>.jsonl`` (one JSON line
each, flushed): the test harness of tests/test_progress_watch.py.

    python tests/jobs/progress_probe.py SCRIPT ARGS...
"""

import os
import sys

import eventbus
from eventbus.app.worker import main

out = open(  # noqa: SIM115 - written to until the process ends
    os.path.join(os.environ["PROBE_OUT"], f"rank{os.environ.get('RANK', '0')}.jsonl"), "a",
    encoding="utf-8")


def keep(event: eventbus.Event) -> None:
    out.write(event.to_json() + "\n")
    out.flush()


eventbus.get_default_bus().subscribe(eventbus.EventType.WORKER_PROGRESS, on_event=keep)
sys.exit(main(sys.argv[1:]))
