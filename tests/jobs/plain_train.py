"""A plain DDP-style training loop that never imports eventbus (job-health tests).

gloo, a small model, SGD, and one ``all_reduce`` of the flattened gradients per step.
Environment (all optional):

- ``PLAIN_MODE``: ``healthy`` (default), ``hang`` (rank PLAIN_RANK spins in a Python loop
  before the step's collective: the line ending in ``the hang`` below), ``mismatch`` (that
  rank calls ``broadcast`` while its peers call ``all_reduce``: both hang on gloo),
  ``size_mismatch`` (that rank's ``all_reduce`` has one element more: gloo aborts the
  receiving rank), ``straggler`` (that rank sleeps PLAIN_DELAY s more per step, from
  PLAIN_STEP on), ``slow_start`` (that rank sleeps PLAIN_DELAY s before its first step);
- ``PLAIN_RANK`` (default 1), ``PLAIN_STEP`` (default 25): who misbehaves, and from which step;
- ``PLAIN_STEPS`` (default 50), ``PLAIN_STEP_S`` (default 0.02: compute sleep per step);
- ``PLAIN_DELAY`` (default 0.25 for a straggler, 10 for a slow start);
- ``PLAIN_ATTEMPT``: the restart attempt that misbehaves (default 0; ``all``: every one);
- ``PLAIN_SAVE_AT``: at that step rank 0 saves a checkpoint with ``torch.save`` (the model
  and a 32 MiB tensor) to ``PLAIN_OUT/ckpt.pt`` and writes its start and end to
  ``PLAIN_OUT/save.json`` (no eventbus call: the bootstrap notices it);
- ``PLAIN_OUT``: a folder; the misbehaving rank writes ``attempt<A>_rank<R>.bad`` there
  (its ``time.time()``) just before it misbehaves.
"""

import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist


def spin() -> None:
    n = 0
    while True: n += 1  # noqa: E701 (one line: every sample names it)  # the hang


def main() -> None:
    env = os.environ.get
    mode = env("PLAIN_MODE", "healthy")
    bad_rank, bad_step = int(env("PLAIN_RANK", "1")), int(env("PLAIN_STEP", "25"))
    steps, step_s = int(env("PLAIN_STEPS", "50")), float(env("PLAIN_STEP_S", "0.02"))
    delay = float(env("PLAIN_DELAY", "10" if mode == "slow_start" else "0.25"))
    attempt = env("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    bad = rank == bad_rank and env("PLAIN_ATTEMPT", "0") in ("all", attempt)

    def mark() -> None:
        if env("PLAIN_OUT"):
            Path(env("PLAIN_OUT", "."), f"attempt{attempt}_rank{rank}.bad").write_text(
                str(time.time()))

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=0.01)
    x, y = torch.randn(8, 16), torch.randn(8, 1)
    if bad and mode == "slow_start":
        mark()
        time.sleep(delay)
    for step in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        grads = torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)])
        time.sleep(step_s)
        misbehave = bad and step == bad_step
        if misbehave and mode != "slow_start":
            mark()
        if misbehave and mode == "hang":
            spin()
        if bad and step >= bad_step and mode == "straggler":
            time.sleep(delay)
        if misbehave and mode == "mismatch":
            dist.broadcast(grads, src=0)
        elif misbehave and mode == "size_mismatch":
            dist.all_reduce(torch.cat([grads, torch.zeros(1)]))
        else:
            dist.all_reduce(grads)
        offset = 0
        for p in params:
            p.grad = grads[offset:offset + p.numel()].view_as(p) / dist.get_world_size()
            offset += p.numel()
        optimizer.step()
        if env("PLAIN_SAVE_AT") and step == int(env("PLAIN_SAVE_AT", "0")) and rank == 0:
            began = time.time()
            torch.save({"model": model.state_dict(), "ballast": torch.zeros(8 * 2**20)},
                       Path(env("PLAIN_OUT", "."), "ckpt.pt"))
            Path(env("PLAIN_OUT", "."), "save.json").write_text(
                json.dumps({"start": began, "end": time.time()}))
    print(f"rank {rank}: {steps} steps done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
