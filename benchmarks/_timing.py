"""Interleaved timing: every case once per round, rounds repeated, medians reported."""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
import timeit
from collections.abc import Mapping
from importlib import metadata
from typing import Any

__all__ = ["Case", "machine", "measure", "versions"]


class Case:
    """One statement to time, with the namespace it runs in (built once, outside the loop)."""

    __slots__ = ("name", "namespace", "setup", "stmt")

    def __init__(self, name: str, stmt: str, namespace: Mapping[str, Any], setup: str = "pass"):
        self.name = name
        self.stmt = stmt
        self.setup = setup
        self.namespace = dict(namespace)


def _timer(case: Case) -> timeit.Timer:
    # CPU time of this thread, not wall time: on a shared machine the time the scheduler
    # gives other processes would otherwise land, at random, on whichever case was running.
    return timeit.Timer(case.stmt, setup=case.setup, timer=time.thread_time,
                        globals=case.namespace)


def measure(cases: list[Case], *, repeats: int, target_s: float = 0.01) -> dict[str, float]:
    """Median ns per call of each case.

    Each case gets a loop count calibrated to take about ``target_s`` per round; then
    ``repeats`` rounds run every case once, in an order rotated each round, so drift on a
    shared machine (another process waking up, frequency changes) hits every case alike.
    """
    timers = {case.name: _timer(case) for case in cases}
    numbers: dict[str, int] = {}
    for name, timer in timers.items():
        number, elapsed = 1, 0.0
        while True:
            elapsed = timer.timeit(number)
            if elapsed >= target_s / 10 or number >= 10**7:
                break
            number *= 10
        numbers[name] = max(1, int(number * target_s / max(elapsed, 1e-9)))
    samples: dict[str, list[float]] = {name: [] for name in timers}
    names = list(timers)
    for r in range(repeats):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            n = numbers[name]
            samples[name].append(timers[name].timeit(n) / n * 1e9)
    return {name: statistics.median(values) for name, values in samples.items()}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, str]:
    """Where the figures come from: cores, CPU, OS, Python."""
    return {
        "cpus": str(os.cpu_count()),
        "cpu": _cpu_model(),
        "os": f"{platform.system()} {platform.release()}",
        "python": f"{platform.python_implementation()} {sys.version.split()[0]}",
    }


def versions(*packages: str) -> dict[str, str]:
    """Installed version of each package ("-" when it is not installed)."""
    out = {}
    for name in packages:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:  # e.g. eventbus run from its source tree
            module = sys.modules.get(name)
            out[name] = str(getattr(module, "__version__", "-"))
    return out
