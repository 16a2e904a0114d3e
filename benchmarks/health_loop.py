"""The plain 2-rank gloo loop of benchmarks/bench_health.py's job figures (never imports
eventbus): small tensors, one ``all_reduce`` and one optimizer step per step, no sleep.

Rank 0 prints one JSON line: ``{"steps_per_s": ..., "steps": N}`` over the steps after
``BENCH_WARMUP`` warm-up steps (environment: ``BENCH_STEPS``, default 3000).
"""

import json
import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    steps = int(os.environ.get("BENCH_STEPS", "3000"))
    warmup = int(os.environ.get("BENCH_WARMUP", "200"))
    dist.init_process_group("gloo")
    model = torch.nn.Linear(16, 16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 16)
    started = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            dist.barrier()
            started = time.perf_counter()
        optimizer.zero_grad()
        model(x).sum().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        dist.all_reduce(grads)
        optimizer.step()
    elapsed = time.perf_counter() - started
    if dist.get_rank() == 0:
        print(json.dumps({"steps_per_s": steps / elapsed, "steps": steps}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
