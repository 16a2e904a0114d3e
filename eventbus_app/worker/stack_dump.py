"""The stall watch's stack dump, armed in each worker by the bootstrap
(:mod:`eventbus.app.worker`): on the agent's signal, every thread's Python stack is
written to ``$EVENTBUS_STACK_DIR/<pid>.stack``, which the agent's
:class:`eventbus.app.health.probes.StackDumper` reads (the files and variables of
:mod:`eventbus.app.protocol.agent_worker`)."""

from __future__ import annotations

import contextlib
import os
import signal
from typing import IO

from eventbus.app.protocol.agent_worker import stack_file_path
from eventbus.app.protocol.agent_worker import stack_signal_path

__all__ = [
    "arm_stack_dump",
    "default_stack_signal",
    "parse_stack_signal",
]

#: the open file faulthandler writes to; kept for the life of the process
_stack_file: IO[str] | None = None

#: signals a process cannot catch, or whose default action a dump must not replace
_UNUSABLE = frozenset({signal.SIGKILL, signal.SIGSTOP, signal.SIGSEGV, signal.SIGFPE,
                       signal.SIGABRT, signal.SIGBUS, signal.SIGILL, signal.SIGINT,
                       signal.SIGTERM, signal.SIGCHLD})

_OFF = ("off", "none", "no", "0")


def default_stack_signal() -> int:
    """``SIGRTMIN+3`` where real-time signals exist (Linux), else ``SIGUSR2``: a signal
    training code and its libraries rarely use (Lightning and SLURM use ``SIGUSR1``)."""
    rtmin = getattr(signal, "SIGRTMIN", None)
    if rtmin is not None:
        return int(rtmin) + 3
    return int(signal.SIGUSR2)


def parse_stack_signal(text: str) -> int | None:
    """The signal ``EVENTBUS_STACK_SIGNAL`` names: ``""`` is the default, ``off`` is None.

    Raises ``ValueError`` whose message says what is accepted, for a name that is no
    signal, a number that is none, or a signal the dump must not take (``SIGKILL``,
    ``SIGTERM``, ``SIGINT``, the fatal ones, ``SIGCHLD``)."""
    text = text.strip()
    if not text:
        return default_stack_signal()
    if text.lower() in _OFF:
        return None
    accepted = ("a free signal's name (SIGUSR2, SIGRTMIN+3) or number, or 'off' to "
                "report stalls without stacks")
    if text.isascii() and text.isdecimal() and len(text) <= 10:
        number = int(text)
    else:
        name = text.upper() if text.upper().startswith("SIG") else "SIG" + text.upper()
        base, plus, offset = name.partition("+")
        value = getattr(signal, base, None)
        if not isinstance(value, int) or (plus and not (offset.isascii() and offset.isdecimal()
                                                        and len(offset) <= 3)):
            raise ValueError(f"is not a signal; use {accepted}")
        number = int(value) + (int(offset) if plus else 0)
    if number not in signal.valid_signals():
        raise ValueError(f"is not a signal of this system; use {accepted}")
    if number in _UNUSABLE:
        raise ValueError(f"cannot carry the stack dump (it ends, stops or interrupts the "
                         f"worker); use {accepted}")
    return number


def arm_stack_dump(directory: str, signum: int) -> str:
    """Make this process write every thread's Python stack to ``<directory>/<pid>.stack``
    when it gets ``signum``, and say so in ``<pid>.sig`` (the signal's number), which the
    agent reads before it sends anything. Returns the stack file's path.

    ``faulthandler`` writes from its C signal handler, so a worker blocked in a C call (a
    collective, a read) dumps too, and nothing is killed. A handler installed before is
    chained. Calling it again returns the same path. Raises ``OSError`` when the files
    cannot be written.
    """
    global _stack_file
    import faulthandler

    pid = os.getpid()
    path = stack_file_path(directory, pid)
    if _stack_file is not None:
        return path
    previous = signal.getsignal(signum)
    stack_file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - lives with the process
    marker = stack_signal_path(directory, pid)
    try:
        with open(marker + ".part", "w", encoding="utf-8") as out:
            out.write(str(signum))
        # chain=True re-raises the signal under the previous disposition: with the default
        # one (terminate, for SIGUSR2 and real-time signals) that would kill the worker.
        faulthandler.register(signum, file=stack_file, all_threads=True,
                              chain=previous not in (signal.SIG_DFL, signal.SIG_IGN, None))
        os.replace(marker + ".part", marker)  # the agent sees the number whole or not at all
    except BaseException:
        stack_file.close()
        for leftover in (marker + ".part", path):  # nothing for the agent to read
            with contextlib.suppress(OSError):
                os.unlink(leftover)
        raise
    _stack_file = stack_file
    return path
