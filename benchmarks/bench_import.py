"""Import time: ``import eventbus, eventbus.publishers, eventbus.subscribers`` against
``import blinker, attrs``.

Each round is a fresh interpreter (``.pyc`` caches warmed by an untimed first run) that
times ``import blinker, attrs`` and then, in the same process, ``import eventbus,
eventbus.publishers, eventbus.subscribers`` on top. eventbus imports both, so their time is
the floor; the target is the whole at most 2x theirs. One more child runs with ``-X
importtime`` to name the modules of this project that cost the most (self time,
microseconds).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["TARGET", "run"]

#: the whole import at most this many times ``import blinker, attrs``
TARGET = 2.0

_ROOT = Path(__file__).resolve().parents[1]

_CHILD = """
import time
t0 = time.perf_counter()
import blinker, attrs
t1 = time.perf_counter()
import eventbus, eventbus.publishers, eventbus.subscribers
t2 = time.perf_counter()
import json, sys
json.dump([t1 - t0, t2 - t1, "torch" in sys.modules], sys.stdout)
"""

_OURS = ("eventbus", "eventbus.publishers", "eventbus.subscribers")


def _env() -> dict[str, str]:
    # Warm caches are the promise: a PYTHONDONTWRITEBYTECODE=1 shell would otherwise time
    # compiling every module from source. The caches go to a private prefix, not the tree.
    env = {k: v for k, v in os.environ.items()
           if k not in ("EVENTBUS_AGENT_STORE", "EVENTBUS_STORE_PREFIX",
                        "PYTHONDONTWRITEBYTECODE")}
    env["PYTHONPYCACHEPREFIX"] = os.path.join(tempfile.gettempdir(),
                                              "eventbus-bench-pycache")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_ROOT), env.get("PYTHONPATH")]))
    return env


def _child(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *flags, "-c", _CHILD], capture_output=True,
                          text=True, env=_env(), cwd=_ROOT, timeout=120, check=True)


def _top_modules(stderr: str, count: int = 8) -> list[dict[str, Any]]:
    rows = []
    for line in stderr.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        parts = [p.strip() for p in line[len("import time:"):].split("|")]
        if len(parts) != 3 or not parts[0].isdigit():
            continue
        name = parts[2].strip()
        if name.split(".")[0] in _OURS:
            rows.append({"module": name, "self us": int(parts[0]),
                         "cumulative us": int(parts[1])})
    rows.sort(key=lambda r: -r["self us"])
    return rows[:count]


def run(*, quick: bool = False) -> dict[str, Any]:
    """Median import times over fresh interpreters, the ratio and the costliest modules."""
    rounds = 3 if quick else 21
    _child()  # warm the .pyc caches
    base: list[float] = []
    ours: list[float] = []
    ratios: list[float] = []
    torch_loaded = False
    for _ in range(rounds):
        t_base, t_ours, torch_seen = json.loads(_child().stdout)
        base.append(t_base)
        ours.append(t_ours)
        ratios.append((t_base + t_ours) / t_base)
        torch_loaded = torch_loaded or torch_seen
    ratio = statistics.median(ratios)
    top = _top_modules(_child("-X", "importtime").stderr)
    return {
        "rows": top,
        "rounds": rounds,
        "import blinker, attrs (ms)": statistics.median(base) * 1e3,
        "then import eventbus and its publishers, subscribers (ms)": statistics.median(ours) * 1e3,
        f"whole / blinker+attrs (target <= {TARGET:g})": ratio,
        "met": ratio <= TARGET,
        "torch imported": torch_loaded,
    }
