"""A 2-worker gloo job: rank 1 exits with ``--exit-code`` on the attempts in ``--fail-on``.

``--env-var NAME`` writes the worker's ``$NAME`` to ``<out>/attempt<A>_rank<R>.env``.

Every rank writes ``<out>/attempt<A>_rank<R>.started`` once its process group is up; the
failing rank writes ``time.time()`` to ``<out>/attempt<A>_rank<R>.exit`` just before it
exits, so tests can compare the agent's WORKER_EXIT timestamp with the real exit.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

import eventbus
from eventbus.subscribers.queued import flush_all


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--exit-code", type=int, default=3)
    parser.add_argument("--fail-on", default="0", help="comma-separated attempts that fail")
    parser.add_argument("--fail-rank", type=int, default=1)
    parser.add_argument("--env-var", default=None, help="write this env var to <out>")
    parser.add_argument("--hold", type=float, default=0.0,
                        help="seconds every rank sleeps once its process group is up")
    parser.add_argument("--hold-until", default=None,
                        help="on an attempt not in --fail-on, every rank then waits until "
                             "this file exists (at most 120 s): the test says when")
    parser.add_argument("--nan-loss", action="store_true",
                        help="the failing rank reports a NaN loss (METRIC) before it fails")
    parser.add_argument("--fail-how", choices=["exit", "raise", "sigkill"], default="exit",
                        help="exit with --exit-code, raise (torch's @record writes the "
                             "error file), or SIGKILL itself")
    parser.add_argument("--torn-error-file", action="store_true",
                        help="on a failing attempt, the other ranks leave a torn error file "
                             "(what a worker killed inside torch's record_exception leaves) "
                             "and wait to be stopped instead of meeting the failed peer")
    args = parser.parse_args()
    out = Path(args.out)
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    fail_on = {int(a) for a in args.fail_on.split(",") if a}

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == dist.get_world_size(), t
    (out / f"attempt{attempt}_rank{rank}.started").write_text(str(os.getpid()))
    if args.env_var:
        value = os.environ.get(args.env_var, "<unset>")
        (out / f"attempt{attempt}_rank{rank}.env").write_text(value)
    eventbus.record(eventbus.EventType.EPOCH_START, epoch=0)
    time.sleep(args.hold)
    if args.hold_until and attempt not in fail_on:
        deadline = time.monotonic() + 120
        while not os.path.exists(args.hold_until) and time.monotonic() < deadline:
            time.sleep(0.05)

    if attempt in fail_on and rank == args.fail_rank:
        if args.nan_loss:
            eventbus.record(eventbus.EventType.METRIC, step=1, data={"loss": float("nan")})
        # Hand this worker's events to the agent first, then die at a known instant:
        # sys.exit would spend 1-4 s more in torch's interpreter teardown, blurring the
        # exit time the tests compare the agent's WORKER_EXIT timestamp with.
        flush_all(5.0)
        (out / f"attempt{attempt}_rank{rank}.exit").write_text(repr(time.time()))
        if args.fail_how == "raise":
            raise RuntimeError(f"bad config on rank {rank}: learning rate missing")
        if args.fail_how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(args.exit_code)

    if attempt in fail_on and args.torn_error_file:
        with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
            f.write('{"message": {"message": "RuntimeError: conn')  # cut by SIGTERM
        time.sleep(120)  # the agent's SIGTERM ends it here, the file left torn
    dist.barrier()  # the survivor waits here for a peer that may be gone
    dist.all_reduce(t)
    eventbus.record(eventbus.EventType.EPOCH_END, epoch=0)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    # torch's @record writes an uncaught exception to the worker's error file, which the
    # agent reads into WORKER_EXIT.message
    sys.exit(record(main)())
