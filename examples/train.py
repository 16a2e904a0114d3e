"""The demo's training script: a real (small) elastic data-parallel job on CPU.

Each worker trains a 2-layer MLP on its shard of a synthetic regression problem, data
parallel over gloo (gradients averaged with ``all_reduce`` every step), and records what a
training loop knows on the bus: ``EPOCH_START``/``EPOCH_END``, a ``METRIC`` every few
steps (loss, throughput), ``CHECKPOINT_SAVED`` after each epoch (rank 0 writes it).
``import eventbus`` is the only setup: under ``eventbus run`` these events reach the agent.

Elastic like a real job: every attempt resumes from the last checkpoint. On attempt 0,
``--crash-rank`` raises in the middle of epoch ``--crash-epoch`` (torch's ``@record``
writes the error to the agent's error file, so the agent's ``WORKER_EXIT`` carries the
message); the agent restarts the group and attempt 1 finishes the training.

Run it under the launcher::

    python -m eventbus run --standalone --nproc-per-node 2 --max-restarts 1 \\
        --events-jsonl events.jsonl --log-events examples/train.py --checkpoint-dir ckpt
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

import eventbus
from eventbus import EventType

FEATURES = 32
SAMPLES_PER_RANK = 4096


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=100, help="steps per epoch")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--metric-every", type=int, default=25, metavar="STEPS")
    parser.add_argument("--checkpoint-dir", type=Path, required=True)
    parser.add_argument("--crash-rank", type=int, default=1,
                        help="the rank that crashes on attempt 0 (-1: nobody)")
    parser.add_argument("--crash-epoch", type=int, default=1)
    return parser.parse_args(argv)


def synthetic_shard(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of y = sin(x @ w) + noise, the same every attempt."""
    truth = torch.Generator().manual_seed(0)
    w = torch.randn(FEATURES, 1, generator=truth)
    own = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(SAMPLES_PER_RANK, FEATURES, generator=own)
    y = torch.sin(x @ w) + 0.05 * torch.randn(SAMPLES_PER_RANK, 1, generator=own)
    return x, y


class MomentumSGD:
    """SGD with momentum, the update of ``torch.optim.SGD(momentum=...)`` written out.

    Why not torch.optim: building a torch.optim optimizer imports ``torch._dynamo``, which
    costs each worker several seconds of CPU at start-up; on a 2-core machine running two
    workers twice, that is most of the demo's minute.
    """

    def __init__(self, params: list[torch.nn.Parameter], *, lr: float,
                 momentum: float) -> None:
        self.params, self.lr, self.momentum = params, lr, momentum
        self.buffers = [torch.zeros_like(p) for p in params]

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        with torch.no_grad():
            for p, buf in zip(self.params, self.buffers, strict=True):
                if p.grad is not None:
                    buf.mul_(self.momentum).add_(p.grad)
                    p.add_(buf, alpha=-self.lr)

    def state_dict(self) -> dict[str, list[torch.Tensor]]:
        return {"momentum_buffers": self.buffers}

    def load_state_dict(self, state: dict[str, list[torch.Tensor]]) -> None:
        for buf, saved in zip(self.buffers, state["momentum_buffers"], strict=True):
            buf.copy_(saved)


def save_checkpoint(path: Path, model: torch.nn.Module, optimizer: MomentumSGD,
                    epoch: int, step: int) -> None:
    """Write atomically: a crash mid-write never leaves a half checkpoint behind."""
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "epoch": epoch, "step": step}, tmp)
    os.replace(tmp, path)


@record
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 1))
    optimizer = MomentumSGD(list(model.parameters()), lr=args.lr, momentum=0.9)
    args.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = args.checkpoint_dir / "last.pt"
    start_epoch, step = 0, 0
    if checkpoint.exists():  # elastic: every attempt resumes where the last one got to
        state = torch.load(checkpoint, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch, step = int(state["epoch"]) + 1, int(state["step"])
    # Data parallel by hand: the same start, then every step's gradients averaged over the
    # workers (what DistributedDataParallel does, without the seconds it takes to import
    # and set up on a small CPU machine).
    for tensor in model.state_dict().values():
        dist.broadcast(tensor, src=0)
    x, y = synthetic_shard(rank)
    order = torch.Generator().manual_seed(rank)

    for epoch in range(start_epoch, args.epochs):
        eventbus.record(EventType.EPOCH_START, epoch=epoch,
                        data={"attempt": attempt, "world_size": world})
        began, seen, window_loss, window_steps = time.perf_counter(), 0, 0.0, 0
        for i in range(args.steps):
            if attempt == 0 and rank == args.crash_rank and epoch == args.crash_epoch \
                    and i == args.steps // 2:
                raise RuntimeError(f"injected failure: rank {rank} lost its data loader "
                                   f"in epoch {epoch} (attempt {attempt})")
            index = torch.randint(0, SAMPLES_PER_RANK, (args.batch_size,), generator=order)
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x[index]), y[index])
            loss.backward()
            for param in model.parameters():
                if param.grad is not None:
                    dist.all_reduce(param.grad)
                    param.grad /= world
            optimizer.step()
            step += 1
            seen += args.batch_size
            window_loss += loss.item()
            window_steps += 1
            if step % args.metric_every == 0:
                eventbus.record(EventType.METRIC, step=step, data={
                    "loss": round(window_loss / window_steps, 4),
                    "samples_per_s": round(seen / max(time.perf_counter() - began, 1e-9))})
                window_loss, window_steps = 0.0, 0
        dist.barrier()  # every rank finished the epoch before it counts as done
        eventbus.record(EventType.EPOCH_END, epoch=epoch, data={"steps": step})
        if rank == 0:
            save_checkpoint(checkpoint, model, optimizer, epoch, step)
            eventbus.record(EventType.CHECKPOINT_SAVED, path=str(checkpoint), epoch=epoch,
                            step=step, data={"bytes": checkpoint.stat().st_size})
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
