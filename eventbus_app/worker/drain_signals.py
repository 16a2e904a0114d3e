"""A scheduler's drain signal to the worker itself: handed to the drain, not a death.

SLURM signals every process of a job step (``--signal``, ``scancel``, ``scontrol
requeue``, preemption), the workers as well as their agent. A worker left at the signal's
default action would die of it (exit code -10, -15) before the drain reaches it. So the
bootstrap, before the script runs, takes each drain signal (:data:`ENV_DRAIN_SIGNALS`)
that is still at its default action; its handler (on the main thread, between two of the
script's bytecodes) does one of three things:

* **the first copy** (no drain here yet, or within ``--drain-signal-window`` of the first
  copy or of the drain's ``PREEMPTING``): the worker keeps running and asks its agent for
  a drain (:func:`~eventbus.app.protocol.drain_signals.ask_signal`). Under SLURM the agent
  got its own copy and the ask changes nothing; a signal sent by hand to this worker
  alone drains the whole job. ``should_stop()`` becomes true at the agreed step as for
  any drain;
* **a later copy** during the drain (a second signal: the scheduler insists; the agent's
  forward at the deadline): the signal's default action, as without the handler;
* **the agent's own stop** (a stall, a failure's survivors, a restart: the agent marks
  it, :func:`~eventbus.app.protocol.drain_signals.agent_stopping`): the default action,
  so the worker dies of it as it would without the handler;
* **the bootstrap's own "signal now"** for a script that acts on no drain
  (:func:`default_action`): the default action too.

A script that installs its own handler for the signal replaces this one and gets the
signal as before. Nothing is taken when the agent set no :data:`ENV_DRAIN_SIGNALS`.
"""

from __future__ import annotations

import contextlib
import os
import signal as signals
import threading
import time
from collections.abc import Mapping
from typing import Any

from eventbus import preemption
from eventbus.app.protocol.drain_signals import DEFAULT_SIGNAL_WINDOW_S
from eventbus.app.protocol.drain_signals import ENV_AGENT_PID
from eventbus.app.protocol.drain_signals import ENV_AGENT_STOP
from eventbus.app.protocol.drain_signals import ENV_DRAIN_SIGNALS
from eventbus.app.protocol.drain_signals import ENV_DRAIN_WINDOW
from eventbus.app.protocol.drain_signals import ask_signal

__all__ = ["default_action", "install", "installed", "state"]


class _State:
    def __init__(self) -> None:
        #: signum -> index in the drain signals (the ask's offset)
        self.taken: dict[int, int] = {}
        self.window_s = DEFAULT_SIGNAL_WINDOW_S
        self.agent_pid: int | None = None
        #: the file that exists while the agent stops its workers itself
        self.agent_stop: str | None = None
        #: monotonic time of the first copy handled here
        self.first: float | None = None
        #: signals whose next delivery gets the default action
        self.release: set[int] = set()
        #: what each copy did: (signal number, "asked" | "kept" | "default")
        self.seen: list[tuple[int, str]] = []


_state = _State()


def state() -> _State:
    return _state


def installed() -> tuple[int, ...]:
    """The signals this bootstrap took."""
    return tuple(_state.taken)


def install(environ: Mapping[str, str] | None = None) -> tuple[int, ...]:
    """Take the agent's drain signals that are at their default action (main thread
    only). Returns those taken; nothing without :data:`ENV_DRAIN_SIGNALS`."""
    env = os.environ if environ is None else environ
    names = [n.strip() for n in env.get(ENV_DRAIN_SIGNALS, "").split(",") if n.strip()]
    if not names or threading.current_thread() is not threading.main_thread():
        return ()
    with contextlib.suppress(ValueError):
        _state.window_s = max(0.0, float(env.get(ENV_DRAIN_WINDOW, "")))
    with contextlib.suppress(ValueError):
        _state.agent_pid = int(env.get(ENV_AGENT_PID, ""))
    _state.agent_stop = env.get(ENV_AGENT_STOP) or None
    for index, name in enumerate(names):
        signum = getattr(signals, name, None)
        if not isinstance(signum, int) or signum in (signals.SIGKILL, signals.SIGSTOP):
            continue
        if signals.getsignal(signum) is not signals.SIG_DFL:
            continue  # ignored, or someone's handler already: left alone
        signals.signal(signum, _handle)
        _state.taken[int(signum)] = index
    return tuple(_state.taken)


def default_action(signum: int) -> None:
    """Give this process ``signum`` with its default action (or the script's own handler
    if it replaced ours): the bootstrap's "signal now" to a script that acts on no drain.
    Any thread; the handler, on the main thread, gives the signal back to its default."""
    _state.release.add(int(signum))
    os.kill(os.getpid(), signum)


def _began() -> float | None:
    drain = preemption.current_drain()
    times = [t for t in (_state.first, getattr(drain, "began", None)) if t is not None]
    return min(times) if times else None


def _handle(signum: int, frame: Any) -> None:
    now = time.monotonic()
    began = _began()
    drain = preemption.current_drain()
    late = began is not None and now - began > _state.window_s
    due = drain is not None and drain.seconds_left() <= 0.5
    stopping = _state.agent_stop is not None and os.path.exists(_state.agent_stop)
    if signum in _state.release or late or due or stopping:
        _state.seen.append((signum, "default"))
        signals.signal(signum, signals.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    if _state.first is None:
        _state.first = now
    if drain is not None:
        _state.seen.append((signum, "kept"))
        return  # the drain is known here: this copy is the same signal
    _state.seen.append((signum, "asked"))
    _ask(signum)


def _ask(signum: int) -> None:
    """Ask the agent for a drain: it starts one where none is under way."""
    agent, index = _state.agent_pid, _state.taken.get(signum)
    ask = ask_signal(index) if index is not None else None
    if agent is None or ask is None or os.getppid() != agent:
        return  # no agent of ours to ask: its own copy, if any, drains the job
    with contextlib.suppress(OSError):
        os.kill(agent, ask)


def _after_fork_in_child() -> None:
    global _state
    _state = _State()
    # a forked child (a data loader's worker) keeps the handlers; without the agent's
    # relation it asks nobody (os.getppid() is not the agent)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
