"""A 2-worker gloo job that stops making steps for a while, then goes on (for
``--alert-after``, tests/test_stuck_watch.py).

Each rank records ``METRIC`` steps 0-4 (one ``all_reduce`` each), then every rank sleeps
``--quiet`` seconds in one place (the line marked ``QUIET``: the heartbeats' ``where``),
then records steps 5-7 and ends.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist

import eventbus


def step(number: int) -> None:
    t = torch.ones(1)
    dist.all_reduce(t)
    eventbus.record(eventbus.EventType.METRIC, step=number, data={"loss": 1.0 / (number + 1)})


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--quiet", type=float, default=10.0)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    for number in range(5):
        step(number)
        time.sleep(0.1)
    time.sleep(args.quiet)  # QUIET
    for number in range(5, 8):
        step(number)
        time.sleep(0.1)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
