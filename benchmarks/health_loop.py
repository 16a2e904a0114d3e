"""The plain 2-rank gloo loop of benchmarks/bench_health.py's job figures (never imports
eventbus): small tensors, one ``all_reduce`` and one optimizer step per step, no sleep.

Rank 0 prints one JSON line over the steps after ``BENCH_WARMUP`` warm-up steps
(environment: ``BENCH_STEPS``, default 3000): ``steps_per_s``, ``steps``, ``wall_s``,
``first_step_unix`` (the wall clock when the warm-up steps were done), and
``threads``, each Python thread's CPU seconds in those steps by thread name (``main`` for
the training thread; eventbus's own threads are named ``eventbus-*``), read from
``/proc/self/task/<tid>/schedstat`` (nanoseconds; ``.../stat``'s clock ticks where there is
none), so that a watch's cost is read as CPU time, which wall-clock noise cannot hide.
Under ``eventbus run`` also the progress watch's ticks and beats and the store forwarder's
wake-ups in those steps (read from modules the worker bootstrap loaded).
"""

import json
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def thread_cpu() -> dict[str, float]:
    """CPU seconds of each live Python thread of this process, by name (Linux; empty
    elsewhere). Threads of the same name are summed."""
    out: dict[str, float] = {}
    for thread in threading.enumerate():
        tid = thread.native_id
        try:  # nanoseconds on the CPU, where the kernel keeps scheduler statistics
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                seconds = int(f.read().split()[0]) / 1e9
        except (OSError, IndexError, ValueError):
            try:  # clock ticks (10 ms): utime and stime, fields 14 and 15
                with open(f"/proc/self/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                seconds = (int(fields[11]) + int(fields[12])) / _TICK
            except (OSError, IndexError, ValueError):
                continue
        name = "main" if thread is threading.main_thread() else thread.name
        out[name] = out.get(name, 0.0) + seconds
    return out


def wakeups() -> dict[str, int]:
    """Under ``eventbus run``: the progress watch's ticks and the store forwarder's
    wake-ups so far, read from the modules the worker bootstrap loaded (never imported
    here); empty under plain torchrun."""
    out: dict[str, int] = {}
    progress = sys.modules.get("eventbus.app.worker.progress")
    watch = getattr(progress, "_watch", None)
    if watch is not None:
        out["watch_ticks"] = int(watch.ticks)
        out["watch_beats"] = int(watch.beats)
    forwarder_module = sys.modules.get("eventbus.subscribers.store_forwarder")
    forwarder = getattr(forwarder_module, "_worker_forwarder", None)
    if forwarder is not None:
        out["forwarder_wakeups"] = int(forwarder.sink.wakeups)
    return out


def main() -> None:
    steps = int(os.environ.get("BENCH_STEPS", "3000"))
    warmup = int(os.environ.get("BENCH_WARMUP", "200"))
    dist.init_process_group("gloo")
    model = torch.nn.Linear(16, 16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 16)
    started = first_step_unix = 0.0
    cpu_before: dict[str, float] = {}
    woken_before: dict[str, int] = {}
    for step in range(warmup + steps):
        if step == warmup:
            first_step_unix = time.time()  # the warm-up's steps done (BENCH_WARMUP=1: one)
            dist.barrier()
            started = time.perf_counter()
            cpu_before = thread_cpu()
            woken_before = wakeups()
        optimizer.zero_grad()
        model(x).sum().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        dist.all_reduce(grads)
        optimizer.step()
    elapsed = time.perf_counter() - started
    cpu_after = thread_cpu()
    threads = {name: round(cpu - cpu_before.get(name, 0.0), 6)
               for name, cpu in cpu_after.items()}
    if dist.get_rank() == 0:
        print(json.dumps({"steps_per_s": steps / elapsed, "steps": steps,
                          "wall_s": elapsed, "threads": threads,
                          "first_step_unix": first_step_unix,
                          **{k: v - woken_before.get(k, 0) for k, v in wakeups().items()}}),
              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
