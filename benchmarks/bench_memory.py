"""Peak memory with a sink that never drains, as the number of recorded events grows.

Each size runs in its own subprocess (peak RSS is a high-water mark of the whole process;
read from ``VmHWM``). The child subscribes one ``eventbus.subscribers.queued.QueuedSink`` (default
bounds: 100,000 events, 64 MiB) whose sink blocks forever, records N ``WORKER_EXIT`` events with a
small ``data`` dict holding a list through ``eventbus.record()`` (so every queued event
holds its snapshot: a read-only dict and a read-only list), and reports its peak RSS, the RSS after
imports, and what the queue holds and dropped. Bounded means flat: 1e6 events must peak
where 1e5 do, the rest counted as dropped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["SIZES", "run"]

SIZES = (100_000, 1_000_000)
QUICK_SIZES = (1_000, 10_000)

_ROOT = Path(__file__).resolve().parents[1]


def _peak_rss_mib() -> float:
    """This process's peak resident set size.

    ``VmHWM`` where Linux has it: ``ru_maxrss`` survives fork + exec, so a child started
    by a parent that had imported torch would report the parent's high-water mark.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _child(n: int) -> dict[str, Any]:
    import threading

    import eventbus
    from eventbus import EventType
    from eventbus.subscribers.queued import QueuedSink

    never = threading.Event()

    def never_drains(batch: object) -> None:
        never.wait()  # the sink is stuck (a dead filesystem, a hung store)

    sink = QueuedSink(never_drains, name="never-drains")
    eventbus.get_default_bus().subscribe(eventbus.ALL, on_event=sink)
    before = _peak_rss_mib()
    record = eventbus.record
    for i in range(n):
        record(EventType.WORKER_EXIT, worker_id=i % 8, exit_code=0,
               data={"step": i, "loss": 0.01, "lr": [0.1, 0.01]})
    peak = _peak_rss_mib()
    stats = sink.stats()
    return {
        "events": n,
        "rss after imports (MiB)": before,
        "peak rss (MiB)": peak,
        "queued": stats["pending"],
        "queued (MiB, estimated)": stats["queued_bytes"] / 2**20,
        "dropped": sum(stats["dropped"].values()),
        "max_events": sink.settings.max_events,
    }


def _run_child(n: int, timeout: float) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_memory", str(n)],
        env=env, cwd=_ROOT, capture_output=True, text=True, timeout=timeout, check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"memory benchmark child (n={n}) failed:\n{proc.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def run(*, quick: bool = False) -> dict[str, Any]:
    """Peak RSS per size, and the growth from the smallest to the largest size."""
    sizes = QUICK_SIZES if quick else SIZES
    rows = [_run_child(n, timeout=300) for n in sizes]
    first, last = rows[0]["peak rss (MiB)"], rows[-1]["peak rss (MiB)"]
    return {"rows": rows, "growth": last / first}


if __name__ == "__main__":
    print(json.dumps(_child(int(sys.argv[1]))), flush=True)
    # The sink's thread is stuck on purpose; skip the exit-time flush that would wait for it.
    os._exit(0)
