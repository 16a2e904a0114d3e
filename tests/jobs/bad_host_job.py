"""A plain gloo job for the bad-host tests (tests/reliability/test_bad_hosts.py): no eventbus
in the script.

Every rank takes ``--steps`` steps in all (one ``all_reduce`` and ``--step-s`` of sleep
each), whatever the world size; the steps done so far are kept in ``<out>/step`` by rank 0,
so a new attempt goes on from there. A rank on the host ``--bad-host`` (the worker's
``EVENTBUS_HOSTNAME``) hurts its host ``--fault-at`` steps into each attempt:

- ``segv``: it dies of a real SIGSEGV;
- ``raise``: it raises ``RuntimeError`` (a script bug: never a host fault);
- ``hang``: it blocks in ``time.sleep`` while its peers wait in the collective.

Each rank writes ``<out>/<host>.attempt<A>`` when it starts (its rank and world size), A
being the job's attempt (``EVENTBUS_ATTEMPT``, the same on every node): torch's
``TORCHELASTIC_RESTART_COUNT`` counts one node's own restarts, so a node that re-forms
because another left would write its next group over its last one's file.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--step-s", type=float, default=0.1)
    parser.add_argument("--bad-host", default="")
    parser.add_argument("--fault", choices=["segv", "raise", "hang"], default="segv")
    parser.add_argument("--fault-at", type=int, default=5)
    args = parser.parse_args()
    out = Path(args.out)
    host = os.environ.get("EVENTBUS_HOSTNAME", "?")
    attempt = int(os.environ.get("EVENTBUS_ATTEMPT")
                  or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    (out / f"{host}.attempt{attempt}").write_text(f"{rank} {world}")
    done = out / "step"
    first = int(done.read_text()) if done.exists() else 0
    t = torch.ones(4)
    for step in range(first, args.steps):
        if host == args.bad_host and step - first == args.fault_at:
            if args.fault == "segv":
                ctypes.string_at(0)  # reads address 0: SIGSEGV
            elif args.fault == "raise":
                raise RuntimeError("a bug in the script")
            else:
                time.sleep(3600)
        dist.all_reduce(t)
        time.sleep(args.step_s)
        if rank == 0:
            done.write_text(str(step + 1))
    print(f"{host}: rank {rank} of {world} done at step {args.steps}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
