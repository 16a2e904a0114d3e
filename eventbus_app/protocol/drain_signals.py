"""The drain signals between the agent and its workers: which signals drain the job, how
long one signal's copies count as one, and how a worker asks its agent for a drain.

A scheduler (SLURM: ``--signal``, ``scancel``, ``scontrol requeue``, preemption) signals
every process of a job step, not only the agent: each worker gets its own copy of the
drain signal. The agent writes into the workers' environment:

* :data:`ENV_DRAIN_SIGNALS`: the drain signals (``--drain-signals``), comma-separated
  names; the worker's bootstrap takes each one the script leaves at its default action
  (:mod:`eventbus.app.worker.drain_signals`), so the scheduler's copy kills no worker;
* :data:`ENV_DRAIN_WINDOW`: ``--drain-signal-window``, the seconds within which copies of
  one signal are one drain; a copy later than that is a second signal (the scheduler
  insists) and gets the signal's default action;
* :data:`ENV_AGENT_STOP`: a path that exists while the agent itself signals its workers
  (a stall's stop, the survivors of a failure, a restart, the drain's deadline:
  :func:`agent_stopping`); a worker's handler takes a drain signal that arrives then as
  the agent's stop, with the signal's default action, never as a scheduler's signal to
  ask about;
* :data:`ENV_AGENT_PID`: the agent's pid. A worker that catches a drain signal asks that
  agent for a drain with :func:`ask_signal` (a real-time signal the agent alone catches,
  one per drain signal: the agent learns which one). An ask starts a drain where none is
  under way and is never a second signal, so a signal sent by hand to one worker drains
  the job, and the copies every worker sends under SLURM change nothing.

Torch-free and import-light: the worker bootstrap reads it before the script runs.
"""

from __future__ import annotations

import contextlib
import os
import signal as signals
import threading
from collections.abc import Iterator
from collections.abc import Sequence

__all__ = [
    "ASK_OFFSET",
    "DEFAULT_SIGNAL_WINDOW_S",
    "ENV_AGENT_PID",
    "ENV_AGENT_STOP",
    "ENV_DRAIN_SIGNALS",
    "ENV_DRAIN_WINDOW",
    "agent_stopping",
    "ask_signal",
    "asked_signal",
]

ENV_DRAIN_SIGNALS = "EVENTBUS_DRAIN_SIGNALS"
ENV_DRAIN_WINDOW = "EVENTBUS_DRAIN_WINDOW"
ENV_AGENT_PID = "EVENTBUS_AGENT_PID"
ENV_AGENT_STOP = "EVENTBUS_AGENT_STOP"

#: copies of one drain signal within this many seconds of the drain's start are one
#: drain (SLURM signals every node's processes within well under a second); a signal
#: later than that during a drain is a second one and moves the deadline to now
DEFAULT_SIGNAL_WINDOW_S = 3.0

#: the ask for drain signal ``i`` (its index in ``--drain-signals``) is SIGRTMIN + 4 + i:
#: clear of the first real-time signals, which threading libraries take
ASK_OFFSET = 4


def ask_signal(index: int) -> int | None:
    """The real-time signal by which a worker asks for a drain on drain signal ``index``,
    or None where there are no real-time signals (not Linux) or too few."""
    low = getattr(signals, "SIGRTMIN", None)
    high = getattr(signals, "SIGRTMAX", None)
    if not isinstance(low, int) or not isinstance(high, int):
        return None
    signum = int(low) + ASK_OFFSET + index
    return signum if signum <= int(high) else None


def asked_signal(signum: int, names: Sequence[str]) -> str | None:
    """The drain signal's name that the ask ``signum`` stands for, or None."""
    for index, name in enumerate(names):
        if ask_signal(index) == signum:
            return name
    return None


_stopping_lock = threading.Lock()
_stopping_depth = 0


@contextlib.contextmanager
def agent_stopping(path: str | None = None) -> Iterator[None]:
    """In the agent, around every act that signals its own workers: the file at ``path``
    (default: :data:`ENV_AGENT_STOP` of this process's environment, which the workers
    inherit) exists meanwhile. Nested uses keep it until the outermost ends; no path, no
    file. A file that cannot be made costs only the distinction (the workers ask)."""
    global _stopping_depth
    path = os.environ.get(ENV_AGENT_STOP) if path is None else path
    if not path:
        yield
        return
    with _stopping_lock:
        _stopping_depth += 1
        if _stopping_depth == 1:
            with contextlib.suppress(OSError), open(path, "a"):
                pass
    try:
        yield
    finally:
        with _stopping_lock:
            _stopping_depth -= 1
            if _stopping_depth == 0:
                with contextlib.suppress(OSError):
                    os.unlink(path)
