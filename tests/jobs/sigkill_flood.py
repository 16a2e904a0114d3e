"""A worker that floods record() until it is SIGKILLed, many times over (tests/reliability/
test_sigkill_count.py).

This process imports torch once, then, for each ``go RANK`` line on stdin, forks a child
that attaches the worker forwarder for RANK (as the worker bootstrap does) and records
METRIC events in bursts until it is killed. The child keeps its own truth in
``TRUTH_DIR/truth-RANK`` (two native unsigned 64-bit integers, shared-mapped, so they
survive the kill): record() calls begun, and record() calls that returned. Lines out:
``pid PID`` once the child's first record() returned, ``reaped RANK`` once it is gone.

argv: host port prefix bell ledger_dir truth_dir
"""

from __future__ import annotations

import mmap
import os
import random
import sys
import time

import torch.distributed  # noqa: F401  (imported once, before the forks)

import eventbus
from eventbus.subscribers.store_forwarder import attach_worker_forwarder


def flood(rank: int, host: str, port: int, prefix: str, bell: str, ledger_dir: str,
          truth_dir: str) -> None:
    path = os.path.join(truth_dir, f"truth-{rank}")
    with open(path, "wb") as f:
        f.write(bytes(16))
    with open(path, "r+b") as f:
        truth = memoryview(mmap.mmap(f.fileno(), 16)).cast("Q")
    attach_worker_forwarder(host=host, port=port, prefix=prefix, rank=rank,
                            ledger_dir=ledger_dir, bell=bell)
    record = eventbus.get_default_bus().record
    rng = random.Random(rank)
    i = 0
    while True:
        for _ in range(rng.randint(1, 3000)):
            truth[0] = i + 1
            record("METRIC", data={"r": rank, "i": i})
            truth[1] = i + 1
            if i == 0:
                print(f"pid {os.getpid()}", flush=True)
            i += 1
        time.sleep(rng.random() * 0.004)


def main() -> None:
    host, port, prefix, bell, ledger_dir, truth_dir = sys.argv[1:7]
    for line in sys.stdin:
        word, rank = line.split()
        assert word == "go"
        pid = os.fork()
        if pid == 0:
            try:
                flood(int(rank), host, int(port), prefix, bell, ledger_dir, truth_dir)
            finally:
                os._exit(1)
        os.waitpid(pid, 0)
        print(f"reaped {rank}", flush=True)


if __name__ == "__main__":
    main()
