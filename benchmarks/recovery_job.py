"""The recovery benchmark's job (benchmarks/bench_recovery.py): a 2-rank gloo DDP MLP that
saves a checkpoint every 20 steps; on attempt 0 rank 1 dies at step 40 (``os._exit(1)``),
4 s after the first step (``RECOVERY_STEP_S``, 0.1 s a step; ``RECOVERY_CRASH_AT`` moves
the step, ``RECOVERY_STEPS`` the last one).
Each attempt restores the latest checkpoint and trains to step 60. It never imports
eventbus: the same script runs under torchrun and under ``eventbus run``.

Each rank appends its script-clock marks (``time.time()``) to ``<RECOVERY_OUT>/marks.jsonl``
as one JSON line per mark: ``start`` (the script's first line), ``import`` (torch
imported), ``init`` (the process group ready), ``restore`` (the checkpoint loaded),
``step`` (the first step of the attempt completed), and ``crash`` (rank 1, just before it
dies).
"""

import json
import os
import time

START = time.time()
OUT = os.environ.get("RECOVERY_OUT", ".")
RANK = int(os.environ.get("RANK", "0"))
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def mark(name: str, t: float | None = None) -> None:
    line = json.dumps({"mark": name, "t": time.time() if t is None else t, "rank": RANK,
                       "attempt": ATTEMPT, "pid": os.getpid()})
    with open(os.path.join(OUT, "marks.jsonl"), "a") as f:
        f.write(line + "\n")


mark("start", START)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

mark("import")
CRASH_AT = int(os.environ.get("RECOVERY_CRASH_AT", "40"))
SAVE_EVERY, STEPS = 20, int(os.environ.get("RECOVERY_STEPS", "60"))
#: each step's compute stand-in: 40 steps of 0.1 s put the crash 4 s after the first step
STEP_S = float(os.environ.get("RECOVERY_STEP_S", "0.1"))


def main() -> None:
    dist.init_process_group("gloo")
    mark("init")
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    ckpt = os.path.join(OUT, "ckpt.pt")
    first = 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        first = state["step"] + 1
    mark("restore")
    x, y = torch.randn(16, 32), torch.randn(16, 1)
    for step in range(first, STEPS):
        if ATTEMPT == 0 and RANK == 1 and step == CRASH_AT:
            mark("crash")
            os._exit(1)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == first:
            mark("step")
        if step % SAVE_EVERY == 0 and RANK == 0:
            tmp = ckpt + ".tmp"
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "step": step}, tmp)
            os.replace(tmp, ckpt)
        time.sleep(STEP_S)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
