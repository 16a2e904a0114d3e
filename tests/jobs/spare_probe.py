"""What a worker sees of itself, for tests/test_spares.py: written to
``<PROBE_OUT>/probe_attempt<A>_rank<R>.json`` by each rank of each attempt. Attempt 0 is
started fresh; after its first optimizer step it waits ``PROBE_WAIT_S`` (the spares warm
up; less once the file ``PROBE_GO`` names exists), then rank 1 exits 1; attempt 1 runs on
the warm spares and ends with exit code 0.

The facts: ``warm`` (torch already imported at the script's first line), ``argv``,
``file``, ``path0``, ``cwd``, ``env``, every signal's disposition, what a ``spawn`` child of
``multiprocessing`` and a ``DataLoader`` worker report, whether ``torch.distributed`` was
initialised before the script initialised it, and the world it then formed.
"""

import sys

WARM = "torch" in sys.modules  # the first line: a spare has imported torch already

import json  # noqa: E402
import multiprocessing  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def child(queue: "multiprocessing.Queue[dict[str, object]]") -> None:
    queue.put({"rank": os.environ.get("RANK"), "main": sys.modules["__main__"].__file__})


class Items(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([os.getppid(), int(os.environ.get("RANK", "-1"))])


def dispositions() -> dict[str, str]:
    out = {}
    for number in range(1, signal.NSIG):
        try:
            handler = signal.getsignal(number)
        except (ValueError, OSError):
            continue
        out[str(number)] = "default" if handler is signal.SIG_DFL else \
            "ignore" if handler is signal.SIG_IGN else "python" if callable(handler) else \
            str(handler)
    return out


def main() -> None:
    attempt, rank = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["RANK"]
    initialised_before = dist.is_initialized()
    dist.init_process_group("gloo")
    facts: dict[str, object] = {
        "warm": WARM, "argv": sys.argv, "file": __file__, "path0": sys.path[0],
        "cwd": os.getcwd(), "env": dict(os.environ), "signals": dispositions(),
        "initialised_before": initialised_before, "world": dist.get_world_size(),
        "pid": os.getpid()}
    queue: multiprocessing.Queue[dict[str, object]] = multiprocessing.get_context(
        "spawn").Queue()
    proc = multiprocessing.get_context("spawn").Process(target=child, args=(queue,))
    proc.start()
    facts["spawn_child"] = queue.get(timeout=120)
    proc.join(60)
    loader = torch.utils.data.DataLoader(Items(), batch_size=None, num_workers=1)
    facts["loader"] = [item.tolist() for item in loader]
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    out = os.environ["PROBE_OUT"]
    with open(os.path.join(out, f"probe_attempt{attempt}_rank{rank}.json"), "w") as f:
        json.dump(facts, f)
    if attempt == "0":
        # at most PROBE_WAIT_S; less once the file PROBE_GO names exists (the test saw
        # the spares started: a spare imports torch before it reads its assignment, so
        # one started is used warm)
        go = os.environ.get("PROBE_GO")
        deadline = time.monotonic() + float(os.environ.get("PROBE_WAIT_S", "8"))
        while time.monotonic() < deadline and not (go and os.path.exists(go)):
            time.sleep(0.1)
        if rank == "1":
            os._exit(1)
    # DDP's reducer holds the process group: freed here, before the group is destroyed
    # while the peer is still there. Freed at the end of main(), after the peer exited,
    # its gloo group's destructor once hung joining its threads (a spare's attempt 1,
    # 1 run in about 10; the stack was torch's ~ProcessGroupGloo under ~Reducer).
    del model, optimizer
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
