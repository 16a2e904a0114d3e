"""A worker's torch process groups end before its interpreter does.

Why: a script that leaves without ``torch.distributed.destroy_process_group()`` (any
script that fails: the demo's rank 1 raises in the middle of an epoch) leaves gloo's worker
threads running into the interpreter's finalization. When one of them finishes a
collective it drops the last reference to the work's tensors; a tensor whose Python object
is already gone takes the GIL to free it. On Python 3.11 a thread that takes the GIL after
finalization began is ended with ``pthread_exit``, whose unwinding through torch's
``noexcept`` destructor calls ``std::terminate``: the worker prints ``terminate called
without an active exception`` / ``Fatal Python error: Aborted`` and dies by SIGABRT instead
of exiting with its own code. (The same holds for any C++ call that re-takes the GIL after
finalization began.)

So the bootstrap registers :func:`end_process_groups` with ``atexit`` before the script
runs; it therefore runs after the script's own exit hooks (which may still use the group)
and before the forwarder is closed (so that what it logs reaches the agent). It destroys
the default group, and with it every group, while the interpreter is whole: torch's
destructor waits for the work in flight and joins gloo's threads, so none is left to
re-take the GIL later.

The destroy runs on a helper thread, bounded by :data:`DESTROY_TIMEOUT_S`: a collective
whose peers never take part (they died, or wait elsewhere) would otherwise hold the exit
for the group's whole timeout (30 min by default). Past the bound the worker says so on
stderr and goes on exiting as before, with that collective still in flight.
"""

from __future__ import annotations

import atexit
import logging
import sys
import threading
import time
from typing import Any

__all__ = ["DESTROY_TIMEOUT_S", "end_process_groups", "install"]

logger = logging.getLogger("eventbus")

#: the longest the exit waits for ``destroy_process_group()`` (collectives in flight)
DESTROY_TIMEOUT_S = 10.0

_installed = False


def install() -> None:
    """Register :func:`end_process_groups` to run at exit (once)."""
    global _installed
    if not _installed:
        _installed = True
        atexit.register(end_process_groups)


def end_process_groups(timeout: float = DESTROY_TIMEOUT_S) -> bool:
    """Destroy torch's process groups if the script left them initialized; True when there
    were none or they were destroyed within ``timeout`` seconds. Never raises."""
    dist: Any = sys.modules.get("torch.distributed")
    try:
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return True
    except Exception:  # a half-imported torch at exit: nothing of ours to end
        return True
    failed: list[BaseException] = []

    def destroy() -> None:
        try:
            dist.destroy_process_group()
        except BaseException as exc:  # reported below; an exit must not fail on it
            failed.append(exc)

    began = time.monotonic()
    helper = threading.Thread(target=destroy, name="eventbus-destroy-process-group",
                              daemon=True)
    helper.start()
    helper.join(timeout)
    if helper.is_alive():
        logger.warning("eventbus: the worker's process group still had a collective in "
                       "flight %.0f s after the script ended (a peer is gone or waits "
                       "elsewhere); exiting without waiting for it", timeout)
        return False
    if failed:
        logger.warning("eventbus: destroy_process_group() at exit failed after %.1f s: "
                       "%s: %s", time.monotonic() - began, type(failed[0]).__name__,
                       str(failed[0]).splitlines()[0] if str(failed[0]) else "")
        return False
    return True
