"""Row 22's training script: 2 gloo workers, each records EVENTS numbered METRIC events per
attempt; on attempt 0 both then meet at a barrier, rank 1 exits with code 3 and rank 0
records on until stopped.

The failing rank leaves by ``sys.exit(3)``, so eventbus's exit hook flushes its events;
the last exit hook (registered before ``import eventbus``, so it runs after eventbus's)
writes ``<out>/attempt<A>_rank<R>.exit`` (time.time()) and ends the process at once, so
that the time is the process's real end (not the start of a slow interpreter teardown).
"""

from __future__ import annotations

import argparse
import atexit
import os
import sys
import time
from pathlib import Path

_exit_marker: list[Path] = []


def _last_exit_hook() -> None:
    if _exit_marker:
        _exit_marker[0].write_text(repr(time.time()))
        os._exit(3)


atexit.register(_last_exit_hook)  # before eventbus's hook: runs after it

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import eventbus  # noqa: E402

EVENTS = 2_000


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.ones(1)
    dist.all_reduce(t)
    for step in range(EVENTS):
        eventbus.record(eventbus.EventType.METRIC, step=step,
                        data={"rank": rank, "attempt": attempt})
    if attempt == 0:
        # Both ranks have recorded EVENTS before rank 1 fails, so that rank 0's are owed
        # in full: without it, a rank 0 descheduled under load (0.24 s in a soak) had
        # recorded 782 when the agent stopped it, every one of them delivered, and the
        # test counted the 1,218 it never recorded as lost.
        dist.barrier()
    if attempt == 0 and rank == 1:
        _exit_marker.append(out / f"attempt{attempt}_rank{rank}.exit")
        sys.exit(3)
    if attempt == 0:
        # rank 0 keeps recording until the agent stops it (SIGTERM): its last events are
        # still in flight while the agent restarts the group
        step = EVENTS
        while True:
            eventbus.record(eventbus.EventType.METRIC, step=step,
                            data={"rank": rank, "attempt": attempt})
            step += 1
            if step % 200 == 0:
                time.sleep(0.001)
    dist.barrier()  # on attempt 0, rank 0 waits here until the agent stops it
    eventbus.record(eventbus.EventType.EPOCH_END, epoch=attempt)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
