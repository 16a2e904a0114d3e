"""Rank 1 fails first but exits last; rank 0 fails because of it and exits first.

An ordinary script (no ``@record``): on attempt 0 rank 1 raises ``RuntimeError("injected
failure ...")`` and then spends ``--teardown-s`` seconds exiting (an ``atexit`` handler, as
torch's interpreter teardown can take); rank 0 waits until rank 1's error file exists (the
worker bootstrap writes it before the traceback prints) and then raises "lost its peer", so
it dies first with the later error. Every other attempt finishes.
"""

import argparse
import atexit
import os
import time
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--teardown-s", type=float, default=3.0)
args = parser.parse_args()
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
rank = int(os.environ["RANK"])
(Path(args.out) / f"attempt{attempt}_rank{rank}.started").write_text(str(os.getpid()))

if attempt == 0 and rank == 1:
    atexit.register(time.sleep, args.teardown_s)
    raise RuntimeError("injected failure: rank 1 lost its data loader")
if attempt == 0 and rank == 0:
    mine = os.environ["TORCHELASTIC_ERROR_FILE"]  # .../attempt_0/0/error.json
    peer = os.path.join(os.path.dirname(os.path.dirname(mine)), "1",
                        os.path.basename(mine))
    deadline = time.monotonic() + 60
    while not os.path.exists(peer) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)  # the error file's time must differ from the peer's
    raise RuntimeError("rank 0 lost its peer: connection closed")
