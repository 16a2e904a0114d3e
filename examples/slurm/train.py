"""A small data-parallel training loop for examples/slurm/train.sbatch.

Each rank fits a linear model to its shard of a synthetic problem, gradients averaged over
gloo every step. Every attempt resumes from ``--checkpoint`` when it exists; the loop asks
:func:`eventbus.preemption.should_stop` once a step and, on a drain (Slurm's
``--signal=USR1@N`` before the time limit, a preemption), saves and returns at the step
every rank agreed on. The script never installs a signal handler: ``eventbus run`` turns the
signal into the drain. Rank 0 writes the checkpoint (``torch.save``) and a one-line
summary beside it (``PATH.txt``). With ``--report-dir``, each rank also writes
``rank<N>.txt``: its rank, its Slurm node and the address it reaches rank 0 from.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist

import eventbus.preemption

FEATURES = 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--report-dir", type=Path, default=None)
    parser.add_argument("--collective-timeout", type=float, default=None, metavar="SECONDS",
                        help="a collective waiting longer for a peer fails (default: "
                             "torch's 30 min); an elastic job's survivors of a lost node "
                             "restart without it after this")
    return parser.parse_args(argv)


def own_address() -> str:
    """The address this host reaches rank 0's store from (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])))
        return str(s.getsockname()[0])


def save(path: Path, step: int, model: torch.nn.Module, loss: float) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"step": step, "model": model.state_dict()}, tmp)
    os.replace(tmp, path)
    path.with_name(path.name + ".txt").write_text(f"step {step} loss {loss:.6f}\n")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    timeout = (None if args.collective_timeout is None
               else datetime.timedelta(seconds=args.collective_timeout))
    dist.init_process_group("gloo", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.report_dir is not None:
        node = os.environ.get("SLURMD_NODENAME", socket.gethostname())
        (args.report_dir / f"rank{rank}.txt").write_text(f"{rank} {node} {own_address()}\n")

    model = torch.nn.Linear(FEATURES, 1)
    start = 0
    if args.checkpoint.exists():
        saved = torch.load(args.checkpoint)
        model.load_state_dict(saved["model"])
        start = saved["step"]
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    own = torch.Generator().manual_seed(rank)
    x = torch.randn(256, FEATURES, generator=own)
    y = x.sum(dim=1, keepdim=True)

    loss = torch.tensor(0.0)
    step = start
    while step < args.steps:
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        for p in model.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad)
            p.grad /= world
        optimizer.step()
        step += 1
        if eventbus.preemption.should_stop(step=step):
            break
    if rank == 0:
        save(args.checkpoint, step, model, loss.item())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
