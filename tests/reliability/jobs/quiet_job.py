"""A plain 2-rank gloo DDP script (no eventbus import) with one quiet phase or one hang, for
rows 41 and 42 of the fault matrix (tests/reliability/test_quiet_phases.py).

``QUIET_MODE`` (attempt 0 only unless ``QUIET_ATTEMPT=all``; every other attempt is healthy):

- quiet phases, each ``QUIET_S`` seconds (default 90) after step ``QUIET_STEP`` (default 10):
  ``validate`` (every rank runs forward passes under ``torch.no_grad()``, no collective),
  ``save`` (rank 0 writes a checkpoint with ``torch.save`` to storage that takes
  ``QUIET_S`` to write it, while rank 1 waits in a barrier), ``evaluate`` (rank 0 runs
  forward passes alone while rank 1 waits in a barrier), ``compile`` (a ``torch.compile``
  recompile mid-run whose compiler takes ``QUIET_S``: a backend that waits, then compiles
  with aot_eager), ``data`` (rank 1's next batch takes ``QUIET_S`` to arrive from a
  ``DataLoader`` with a worker process, while rank 0 waits in the step's all_reduce);
- hangs of rank ``QUIET_RANK`` (default 1) at step ``QUIET_STEP``: ``lock`` (blocked on a
  lock before the step's all_reduce), ``sleep`` (a long sleep before it), ``spin`` (a
  Python loop in one line), ``mismatch`` (its all_reduce has a different size: gloo waits),
  ``skip`` (it never enters the all_reduce rank 0 waits in: it waits in a barrier).

``QUIET_STEPS`` (default 30) steps of ``QUIET_STEP_S`` (default 0.02 s) each; the hung rank
writes ``<QUIET_OUT>/attempt<A>_rank<R>.bad`` (``time.time()``) when its hang begins, and
each rank ``<QUIET_OUT>/done_rank<R>`` at its end.
"""

import os
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist


def env(name: str, default: str) -> str:
    return os.environ.get(name, default)


MODE = env("QUIET_MODE", "none")
QUIET_S = float(env("QUIET_S", "90"))
OUT = Path(env("QUIET_OUT", "."))


class SlowStorage:
    """A file whose writes take QUIET_S in all (storage that is slow to write)."""

    def __init__(self, path: Path, seconds: float) -> None:
        self.file = open(path, "wb")  # noqa: SIM115
        self.deadline = time.monotonic() + seconds

    def write(self, data: bytes) -> int:
        left = self.deadline - time.monotonic()
        if left > 0:
            time.sleep(min(left, 0.5))
        return self.file.write(data)

    def flush(self) -> None:
        """torch.save's last call: the storage acknowledges the write at the deadline."""
        time.sleep(max(0.0, self.deadline - time.monotonic()))
        self.file.flush()

    def finish(self) -> None:
        self.file.close()


class Batches(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Batches of 8 x 16; item ``slow`` takes QUIET_S to make (in the worker process)."""

    def __init__(self, slow: int) -> None:
        self.slow = slow

    def __len__(self) -> int:
        return 10_000

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == self.slow:
            time.sleep(QUIET_S)
        return torch.randn(8, 16)


def forward_for(model: torch.nn.Module, seconds: float) -> None:
    """Forward passes under no_grad for ``seconds`` (a validation pass)."""
    deadline = time.monotonic() + seconds
    with torch.no_grad():
        while time.monotonic() < deadline:
            model(torch.randn(64, 16))


def slow_backend(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> object:
    """A compiler that takes QUIET_S (a big graph's compile), then aot_eager's."""
    from torch._dynamo.backends.common import aot_autograd

    time.sleep(QUIET_S)
    return aot_autograd(fw_compiler=lambda g, _: g)(gm, inputs)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    attempt = env("TORCHELASTIC_RESTART_COUNT", "0")
    active = env("QUIET_ATTEMPT", "0") in ("all", attempt)
    mode = MODE if active else "none"
    bad_rank, at = int(env("QUIET_RANK", "1")), int(env("QUIET_STEP", "10"))
    steps, step_s = int(env("QUIET_STEPS", "30")), float(env("QUIET_STEP_S", "0.02"))
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    compiled = torch.compile(model, backend=slow_backend, dynamic=False) \
        if mode == "compile" else None
    loader = iter(torch.utils.data.DataLoader(
        Batches(slow=at if mode == "data" and rank == 1 else -1), batch_size=None,
        num_workers=1 if mode == "data" else 0))
    lock = threading.Lock()

    def mark() -> None:
        (OUT / f"attempt{attempt}_rank{rank}.bad").write_text(str(time.time()))

    for step in range(steps):
        if step == at and mode == "validate":
            forward_for(model, QUIET_S)
        elif step == at and mode in ("save", "evaluate"):
            if rank == 0:
                if mode == "save":
                    storage = SlowStorage(OUT / "ckpt.pt", QUIET_S)
                    torch.save({"model": model.state_dict(), "step": step}, storage)
                    storage.finish()
                else:
                    forward_for(model, QUIET_S)
            dist.barrier()
        elif step == at and mode == "compile" and compiled is not None:
            with torch.no_grad():
                compiled(torch.randn(3, 16))  # a new shape: a recompile (the first compile)
        batch = next(loader)
        if step == at and rank == bad_rank and mode in ("lock", "sleep", "spin", "skip"):
            mark()
            if mode == "lock":
                lock.acquire()
                lock.acquire()  # the hang: blocked on a lock it holds
            elif mode == "sleep":
                time.sleep(10_000)  # the hang: a sleep before the collective
            elif mode == "spin":
                n = 0
                while True: n += 1  # noqa: E701  # the hang: spinning in one line
            else:
                dist.barrier()  # the hang: rank 0 waits in all_reduce, this rank never joins
        loss = ddp(batch).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()  # DDP's all_reduce of the gradients
        optimizer.step()
        if step == at and mode == "mismatch":
            if rank == bad_rank:
                mark()
            size = 5 if rank == bad_rank else 4
            dist.all_reduce(torch.ones(size))  # the hang on rank 0: the sizes differ
        time.sleep(step_s)
    (OUT / f"done_rank{rank}").write_text(str(time.time()))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
