"""``eventbus.preemption.should_stop()`` against one step of a small DDP model.

The promise: ``should_stop()`` is cheap enough to call every step, at most 1% of a step of
a small DDP model. The step is real: a process group of one rank (``gloo`` over a
``HashStore``), ``DistributedDataParallel`` of a 64-64-10 MLP, a batch of 32, forward,
backward (DDP's all-reduce included) and an SGD step, on one intra-op thread (a model this
small gains nothing from more, and the shorter step is the stricter denominator). Its
median wall time over single timed steps is the reference.

``should_stop()`` is timed like every call in these benchmarks (``_timing.measure``:
calibrated loops, interleaved rounds, CPU time of the thread): without a drain (the every
step case: a counter and one attribute read), with the caller's ``step``, and with a drain
under way before its stop step (``eventbus.testing.drain(stop_at=10**12)``: the rank
promises and checks its step each call). The figure that matters is its ns as a share of
the step. The step-loop A/B (the same loop with and without one ``should_stop()`` per
step, rounds interleaved ABAB/BABA, ratio of the median per-step times) checks the same
thing end to end, but the step's own round-to-round noise (stated) is far larger than the
effect, so it can only say "no visible difference".
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from benchmarks._timing import Case
from benchmarks._timing import measure

__all__ = ["BATCH", "HIDDEN", "TARGET_PERCENT", "run"]

#: should_stop() at most this share of one step of the small DDP model, in percent
TARGET_PERCENT = 1.0
HIDDEN = 64
BATCH = 32


def _ddp_step() -> tuple[Callable[[], None], Callable[[], None]]:
    """One training step of a small DDP model in a real one-rank process group, and the
    call that tears the group down (a no-op when the group was there before)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    ours = not dist.is_initialized()
    if ours:
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 10)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = torch.nn.CrossEntropyLoss()
    x = torch.randn(BATCH, HIDDEN)
    y = torch.randint(0, 10, (BATCH,))

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        optimizer.step()

    def close() -> None:
        if ours and dist.is_initialized():
            dist.destroy_process_group()

    return step, close


def _step_ns(step: Callable[[], None], steps: int) -> float:
    """Median wall ns of single steps (wall: DDP's all-reduce runs on gloo's threads)."""
    samples = []
    for _ in range(steps):
        start = time.perf_counter_ns()
        step()
        samples.append(time.perf_counter_ns() - start)
    return statistics.median(samples)


def _loop_ns(step: Callable[[], None], steps: int, *, check: bool) -> float:
    """Wall ns per step of ``steps`` steps, with or without one should_stop() each."""
    from eventbus.preemption import should_stop

    if check:
        start = time.perf_counter_ns()
        for _ in range(steps):
            step()
            if should_stop():
                break
        return (time.perf_counter_ns() - start) / steps
    start = time.perf_counter_ns()
    for _ in range(steps):
        step()
    return (time.perf_counter_ns() - start) / steps


def _ab(step: Callable[[], None], *, rounds: int, steps: int) -> dict[str, float]:
    """Interleaved rounds of the loop without (A) and with (B) should_stop() per step."""
    plain: list[float] = []
    checked: list[float] = []
    for r in range(rounds):
        for check in ((False, True) if r % 2 == 0 else (True, False)):
            (checked if check else plain).append(_loop_ns(step, steps, check=check))
    paired = sorted(b / a for a, b in zip(plain, checked, strict=True))
    low, high = (statistics.quantiles(paired, n=4)[::2] if len(paired) >= 2
                 else (paired[0], paired[0]))
    return {"plain": statistics.median(plain), "checked": statistics.median(checked),
            "ratio": statistics.median(checked) / statistics.median(plain),
            "p25": low, "p75": high}


def _should_stop_ns(*, repeats: int, target_s: float) -> dict[str, float]:
    """Median ns per should_stop() call: no drain (floored by a no-op call), and with a
    drain under way before its stop step."""
    from eventbus import preemption
    from eventbus import testing

    def noop() -> bool:
        return False

    ns = measure([
        Case("no-op Python call (floor)", "f()", {"f": noop}),
        Case("should_stop(), no drain", "f()", {"f": preemption.should_stop}),
        Case("should_stop(step), no drain", "f(7)", {"f": preemption.should_stop}),
    ], repeats=repeats, target_s=target_s)
    with testing.drain(stop_at=10**12):
        ns.update(measure([
            Case("should_stop(), drain under way, before its stop step", "f()",
                 {"f": preemption.should_stop}),
        ], repeats=repeats, target_s=target_s))
    return ns


def run(*, quick: bool = False) -> dict[str, Any]:
    """should_stop() ns per call, the DDP step's ms, the share in percent and the A/B."""
    import torch

    from eventbus import preemption

    repeats = 3 if quick else 21
    target_s = 0.0005 if quick else 0.01
    steps = 10 if quick else 500
    rounds, round_steps = (2, 5) if quick else (20, 200)

    saved = preemption._state  # the benchmark's calls and drain must not leak into its host
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    step, close = _ddp_step()
    try:
        preemption.reset()
        for _ in range(5 if quick else 50):  # warm up: allocator, autograd, DDP's buckets
            step()
        step_ns = _step_ns(step, steps)
        ab = _ab(step, rounds=rounds, steps=round_steps)
        preemption.reset()
        ns = _should_stop_ns(repeats=repeats, target_s=target_s)
    finally:
        close()
        torch.set_num_threads(threads)
        preemption._state = saved

    call_ns = ns["should_stop(), no drain"]
    percent = call_ns / step_ns * 100
    rows = [{"case": name, "ns": value, "% of a step": value / step_ns * 100}
            for name, value in ns.items()]
    return {
        "rows": rows,
        "repeats": repeats,
        "steps": steps,
        "step ms": step_ns / 1e6,
        "percent": percent,
        "target percent": TARGET_PERCENT,
        "met": percent <= TARGET_PERCENT,
        "ab": {"rounds": rounds, "steps per round": round_steps,
               "plain step ms": ab["plain"] / 1e6, "checked step ms": ab["checked"] / 1e6,
               "ratio": ab["ratio"], "paired p25": ab["p25"], "paired p75": ab["p75"]},
    }
