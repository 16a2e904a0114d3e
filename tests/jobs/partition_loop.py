"""A worker that records numbered events every 10 ms for ``--seconds`` and times each
record() (tests/reliability/test_partition.py).

Imports torch first, as a training script does (the first event would import it
otherwise: seconds on a loaded machine, not the bus's own time). Writes
``<out>/rank<R>.pid`` once its first record() returned, and at the end
``<out>/rank<R>.json``: the loop's record() calls that returned and those that raised, the
slowest (seconds) and when it ended (``time.time()``), the calls slower than 0.1 s, every
event its bus delivered to a counting subscriber (the bootstrap's own included: the truth
of what the forwarder was given), and its forwarder's sender id, numbered events and
counted losses.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch.distributed  # noqa: F401  (before the loop, as a training script does)

import eventbus
from eventbus import ALL
from eventbus import EventType


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()
    out = Path(args.out)
    rank = int(os.environ["RANK"])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    # torch's import leaves ~170k objects a full collection scans (docs/guarantees.md,
    # Known limits): frozen, so the figure is the bus's own
    gc.collect()
    gc.freeze()
    seen = [0]

    def count(_: eventbus.Event) -> None:
        seen[0] += 1

    eventbus.get_default_bus().subscribe(ALL, on_event=count)
    deadline = time.monotonic() + args.seconds
    i = errors = slow = 0
    slowest = slowest_at = 0.0
    record = eventbus.record
    try:
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            try:
                record(EventType.EPOCH_END, epoch=i, data={"rank": rank})
            except Exception:
                errors += 1
            took = time.perf_counter() - t0
            if took > slowest:
                slowest, slowest_at = took, time.time()
            slow += took > 0.1
            if i == 0:
                (out / f"rank{rank}.pid").write_text(str(os.getpid()))
            i += 1
            time.sleep(0.01)
    finally:
        from eventbus.subscribers import store_forwarder

        fwd = store_forwarder._worker_forwarder
        result = {"recorded": i - errors, "errors": errors, "slowest_s": slowest,
                  "slowest_at": slowest_at, "over_100ms": slow, "bus_events": seen[0]}
        if fwd is not None:
            fwd.close(5.0)
            stats = fwd.stats()
            result.update(sender=fwd.sender, numbered=stats["next_seq"],
                          lost=stats["lost"], dropped=stats["dropped"],
                          given=fwd.counter.value if fwd.counter is not None else None)
        (out / f"rank{rank}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
