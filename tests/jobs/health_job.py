"""A 2-worker gloo job for the job-health tests (``eventbus run --stall-timeout``).

``--hang loop``: on attempt 0, rank 1 records a few events and then spins forever in
``spin_forever()`` (a Python loop); rank 0 keeps recording steadily. ``--hang collective``:
the same rank 1, while rank 0 waits for it in a gloo ``all_reduce`` (gloo's own timeout:
30 min). Every other attempt (and ``--hang none``) runs ``--steps`` steps of ``--step-s``
seconds after ``--start-delay`` seconds of silence, with an optional quiet checkpoint write
of ``--checkpoint-s`` announced by an event (``data["expect_silence_s"]``); rank
``--slow-rank`` steps ``--slow-x`` times slower and no collective syncs the steps.
``--beat-s`` sets the rhythm of the events before the hang; ``--ignore-sigterm`` makes the
hung rank ignore SIGTERM (only the agent's SIGKILL ends it).
Writes ``<out>/attempt<A>_rank<R>.hung`` (``time.time()``) when the hang begins.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

import eventbus


def spin_forever() -> None:
    """A Python loop that never ends and never records."""
    n = 0
    while True:
        n += 1


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--hang", choices=["none", "loop", "collective"], default="none")
    parser.add_argument("--start-delay", type=float, default=0.0)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--step-s", type=float, default=0.1)
    parser.add_argument("--checkpoint-s", type=float, default=0.0)
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--slow-x", type=float, default=1.0)
    parser.add_argument("--beat-s", type=float, default=0.1,
                        help="seconds between the events before the hang (its rhythm)")
    parser.add_argument("--ignore-sigterm", action="store_true",
                        help="the hung rank ignores SIGTERM (only SIGKILL ends it)")
    args = parser.parse_args()
    out = Path(args.out)
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.ones(1)
    if args.hang != "none" and attempt == 0:
        eventbus.record(eventbus.EventType.EPOCH_START, epoch=0)
        for step in range(3):
            eventbus.record(eventbus.EventType.METRIC, step=step, data={"loss": 1.0})
            time.sleep(args.beat_s)
        if rank == 1:
            if args.ignore_sigterm:
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
            (out / f"attempt{attempt}_rank{rank}.hung").write_text(repr(time.time()))
            spin_forever()
        if args.hang == "collective":
            dist.all_reduce(t)  # waits for rank 1 forever (gloo's timeout: 30 min)
        step = 3
        while True:  # rank 0 of --hang loop: healthy, recording, until the agent stops it
            eventbus.record(eventbus.EventType.METRIC, step=step, data={"loss": 1.0})
            step += 1
            time.sleep(0.2)
    time.sleep(args.start_delay)
    eventbus.record(eventbus.EventType.EPOCH_START, epoch=0)
    step_s = args.step_s * (args.slow_x if rank == args.slow_rank else 1.0)
    for step in range(args.steps):
        time.sleep(step_s)
        eventbus.record(eventbus.EventType.METRIC, step=step, data={"loss": 1.0})
        if args.checkpoint_s and step == args.steps // 2:
            eventbus.record(eventbus.EventType.METRIC, step=step,
                            data={"checkpoint": "writing",
                                  "expect_silence_s": args.checkpoint_s * 2})
            time.sleep(args.checkpoint_s)
    dist.all_reduce(t)
    eventbus.record(eventbus.EventType.EPOCH_END, epoch=0)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
