"""A worker that records numbered events until ``<out>/stop`` exists (at most 60 s).

At the end it writes ``<out>/rank<R>.result``: events recorded, record() errors, the
events its store forwarder counted lost, and the events it numbered (its sender id on a
second line).

Writes ``<out>/rank<R>.pid`` first, so a test can find (and end) workers an agent left, and
``<out>/rank<R>.recording`` once its first record() returned. The script never imports
torch, nor does eventbus in it (the forwarder's store client is a plain socket).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import eventbus
from eventbus import EventType


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()
    out = Path(args.out)
    rank = int(os.environ["RANK"])
    (out / f"rank{rank}.pid").write_text(str(os.getpid()))
    # the agent may stop this worker (SIGTERM) before the time is up: count until then
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    deadline = time.monotonic() + args.seconds
    i = errors = 0
    try:
        while time.monotonic() < deadline and not (out / "stop").exists():
            try:
                eventbus.record(EventType.EPOCH_END, epoch=i, data={"rank": rank})
            except Exception:
                errors += 1
            if i == 0:  # the first record() returned (the forwarder connects meanwhile)
                (out / f"rank{rank}.recording").write_text(str(time.monotonic()))
                deadline = time.monotonic() + args.seconds  # --seconds of recording
            i += 1
            time.sleep(0.01)
    finally:
        from eventbus.subscribers import store_forwarder

        fwd = store_forwarder._worker_forwarder
        if fwd is not None:
            fwd.close(5.0)
            stats = fwd.stats()
            lost = sum(stats["lost"].values())
            (out / f"rank{rank}.result").write_text(
                f"{i} {errors} {lost} {stats['next_seq']}\n{fwd.sender}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
