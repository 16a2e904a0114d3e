"""Called at the end of ``import eventbus``: attach the store forwarder in workers that
``eventbus run`` started, and arm the stack dump the agent's stall watch asks for. Must
stay cheap (and torch-free) everywhere else."""

from __future__ import annotations

import os
from typing import IO
from typing import Any

from eventbus.wire import ENV_STORE

__all__ = [
    "ENV_STACK_DIR",
    "ENV_STACK_SIGNAL",
    "WORKER_ENV",
    "arm_stack_dump",
    "attach_worker_forwarder",
    "default_stack_signal",
]

#: set by the launcher in each worker's environment; absent everywhere else
WORKER_ENV = ENV_STORE

# -- stack dumps for the stall watch (docs/run.md, "Job health") --------------------------
#: the directory the agent reads stacks from; set only when ``--stall-timeout`` is on
ENV_STACK_DIR = "EVENTBUS_STACK_DIR"
#: the signal the worker dumps its stacks on: a name (``SIGUSR2``), a number, or ``off``
#: for a script that uses the default signal itself (the agent then sends nothing)
ENV_STACK_SIGNAL = "EVENTBUS_STACK_SIGNAL"

#: the open file faulthandler writes to; kept for the life of the process
_stack_file: IO[str] | None = None


def default_stack_signal() -> int:
    """``SIGRTMIN+3`` where real-time signals exist (Linux), else ``SIGUSR2``: a signal
    training code and its libraries rarely use (Lightning and SLURM use ``SIGUSR1``)."""
    import signal

    rtmin = getattr(signal, "SIGRTMIN", None)
    if rtmin is not None:
        return int(rtmin) + 3
    return int(signal.SIGUSR2)


def _stack_signal(text: str) -> int | None:
    import signal

    text = text.strip()
    if not text:
        return default_stack_signal()
    if text.lower() in ("off", "0", "none", "no"):
        return None
    if text.isdigit():
        return int(text)
    name = text.upper() if text.upper().startswith("SIG") else "SIG" + text.upper()
    if name.startswith("SIGRTMIN+") and hasattr(signal, "SIGRTMIN"):
        return int(signal.SIGRTMIN) + int(name.partition("+")[2])
    return int(getattr(signal, name))


def arm_stack_dump(environ: Any = None) -> str | None:
    """Make this process write every thread's Python stack to
    ``$EVENTBUS_STACK_DIR/<pid>.stack`` when it gets the stack signal, and say so in
    ``<pid>.sig`` (the signal's number), which the agent reads before it sends anything.

    ``faulthandler`` writes from its C signal handler, so a worker blocked in a C call (a
    collective, a read) dumps too, and nothing is killed. A handler installed before is
    chained. Without ``EVENTBUS_STACK_DIR`` this does nothing; with
    ``EVENTBUS_STACK_SIGNAL=off`` it does nothing either, and the agent publishes stalls
    without a stack. Returns the stack file's path, or None.
    """
    global _stack_file
    env = os.environ if environ is None else environ
    directory = env.get(ENV_STACK_DIR)
    if not directory or _stack_file is not None:
        return None
    signum = _stack_signal(env.get(ENV_STACK_SIGNAL, ""))
    if signum is None:
        return None
    import faulthandler
    import signal

    pid = os.getpid()
    path = os.path.join(directory, f"{pid}.stack")
    previous = signal.getsignal(signum)
    stack_file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - lives with the process
    # chain=True re-raises the signal under the previous disposition: with the default one
    # (terminate, for SIGUSR2 and real-time signals) that would kill the worker.
    faulthandler.register(signum, file=stack_file, all_threads=True,
                          chain=previous not in (signal.SIG_DFL, signal.SIG_IGN, None))
    _stack_file = stack_file
    marker = os.path.join(directory, f"{pid}.sig")
    with open(marker + ".part", "w", encoding="utf-8") as out:
        out.write(str(signum))
    os.replace(marker + ".part", marker)  # the agent sees the number whole or not at all
    return path


def attach_worker_forwarder() -> None:
    """Attach the forwarder when this process is a worker of ``eventbus run``.

    Without ``EVENTBUS_AGENT_STORE`` this is one dict lookup. With it, the forwarder (and
    torch) are imported and every event of the default bus is shipped to the agent. A
    failure here never breaks ``import eventbus``: it is reported on the ``eventbus``
    logger and the worker's events stay local.
    """
    if not os.environ.get(WORKER_ENV):
        return
    try:
        from subscribers.store_forwarder import attach_from_env

        attach_from_env()
    except Exception:
        import logging  # here: `import eventbus` does not load logging

        logging.getLogger("eventbus").exception(
            "eventbus: attaching the store forwarder failed; this worker's events stay local")
    try:
        arm_stack_dump()
    except Exception:
        logging.getLogger("eventbus").exception(
            "eventbus: arming the stack dump failed; a stall of this worker is reported "
            "without its stack")
