"""A worker that records numbered events until ``<out>/stop`` exists (at most 60 s).

Writes ``<out>/rank<R>.pid`` first, so a test can find (and end) workers an agent left.
"""

from __future__ import annotations

import argparse
import os
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
    deadline = time.monotonic() + args.seconds
    i = 0
    while time.monotonic() < deadline and not (out / "stop").exists():
        eventbus.record(EventType.EPOCH_END, epoch=i, data={"rank": rank})
        i += 1
        time.sleep(0.01)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
