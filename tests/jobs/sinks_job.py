"""A 2-worker gloo job that reports metrics: rank 1 exits 3 on attempt 0 after its metrics.

Each rank records ``METRIC`` steps ``3*A .. 3*A+2`` (A = the attempt) with
``loss = rank + step / 10``, :data:`STEP_S` apart; on the last attempt every rank waits for
``<out>/release`` (at most ``--hold`` seconds) before it ends, so a test can scrape the
agent meanwhile. Each rank of the last attempt writes ``$EVENTBUS_WANDB_RUN_ID`` to
``<out>/attempt<A>_rank<R>.wandb_id``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import eventbus
from eventbus.subscribers.queued import flush_all

#: the time a step takes: the kept steps of the last attempt are the job's goodput (three
#: steps recorded in the same millisecond made a goodput ratio that rounds to 0)
STEP_S = 0.2


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--hold", type=float, default=0.0)
    args = parser.parse_args()
    out = Path(args.out)
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.ones(1)
    dist.all_reduce(t)
    for step in range(3 * attempt, 3 * attempt + 3):
        if step > 3 * attempt:
            time.sleep(STEP_S)
        eventbus.record(eventbus.EventType.METRIC, step=step, data={"loss": rank + step / 10})
    if attempt == 0 and rank == 1:
        flush_all(5.0)
        os._exit(3)
    (out / f"attempt{attempt}_rank{rank}.started").write_text(str(os.getpid()))
    # what the W&B sink exports for the script's own wandb.init (empty without it)
    (out / f"attempt{attempt}_rank{rank}.wandb_id").write_text(
        os.environ.get("EVENTBUS_WANDB_RUN_ID", ""))
    deadline = time.monotonic() + args.hold
    while time.monotonic() < deadline and not (out / "release").exists():
        time.sleep(0.1)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
