"""An ordinary 2-worker gloo script: no ``@record``, no ``import eventbus``.

On attempt 0 rank 1 raises ``torch.OutOfMemoryError`` (what a CUDA allocation that does
not fit raises) after the group's first ``all_reduce``; rank 0 waits for it in a barrier.
Every other attempt finishes. ``--out`` gets ``attempt<A>_rank<R>.started``.
"""

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
args = parser.parse_args()
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])

dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(1)
dist.all_reduce(t)
(Path(args.out) / f"attempt{attempt}_rank{rank}.started").write_text(str(os.getpid()))


def allocate_activations() -> None:
    raise torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 1; 79.15 GiB total capacity)")


if attempt == 0 and rank == 1:
    allocate_activations()
dist.barrier()
dist.destroy_process_group()
