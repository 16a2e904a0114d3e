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
stderr and goes on exiting as before, with that collective still in flight. That helper
is started by :func:`install`, before the script runs, and waits for the request: from
Python 3.12 ``Thread.start()`` inside an exit hook raises ``RuntimeError: can't create new
thread at interpreter shutdown``. Without the helper (a thread could not be started) the
destroy runs inline, unbounded.

First of all the hook sends the progress watch's final ``exiting`` beat
(:func:`eventbus.app.worker.progress.end_progress_watch`), so that the agent knows the
silence of a destroy that waits is the process ending, not a stall.

A forked child inherits the hook; it does nothing in any process but the one that installed
it (the groups are the parent's, and the helper thread did not survive the fork).

``destroy_process_group()`` drops only torch's own references to the groups; gloo has no
``shutdown()``, and its threads are joined only when the last reference to a group goes. So
after the destroy the helper also drops the script's module-level names (in ``__main__``)
bound to a ``ProcessGroup`` or a ``DistributedDataParallel`` module, and collects: a DDP
model or a ``dist.new_group(...)`` kept in a global ends here too. Finalization would clear
those names anyway; only the time their ``__del__`` runs moves, to before the forwarder
closes. What is not covered: a reference held elsewhere (a local of a frame that
``sys.last_traceback`` keeps after an uncaught exception, an attribute of another object,
a container, a module other than ``__main__``) keeps that group's gloo threads into
finalization, as without this hook. Such a script should destroy its groups and drop its
references itself (``del model``), in a ``finally`` when it can fail.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["DESTROY_TIMEOUT_S", "end_process_groups", "install"]

logger = logging.getLogger("eventbus")

#: the longest the exit waits for ``destroy_process_group()`` (collectives in flight)
DESTROY_TIMEOUT_S = 10.0

_installed = False
#: the process that installed the hook (a forked child inherits it, not the groups' ownership)
_pid: int | None = None
#: the helper thread's requests (started at install: not startable at shutdown from 3.12)
_jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
_helper: threading.Thread | None = None


def _serve() -> None:
    while True:
        _jobs.get()()


def install() -> None:
    """Register :func:`end_process_groups` to run at exit and start its helper (once)."""
    global _installed, _pid, _helper
    if not _installed:
        _installed = True
        _pid = os.getpid()
        _helper = threading.Thread(target=_serve, name="eventbus-destroy-process-group",
                                   daemon=True)
        _helper.start()
        atexit.register(end_process_groups)


def _start(job: Callable[[], None]) -> None:
    """Run ``job`` on another thread: the helper, else a new one, else (no thread can start
    at interpreter shutdown) inline."""
    if _helper is not None and _helper.is_alive():
        _jobs.put(job)
        return
    try:
        threading.Thread(target=job, name="eventbus-destroy-process-group",
                         daemon=True).start()
    except RuntimeError:  # "can't create new thread at interpreter shutdown" (3.12+)
        job()


def _drop_main_references(dist: Any) -> None:
    """Drop the script's module-level references to process groups and DDP modules, so
    that the groups' last references go (and gloo joins its threads) now, while the
    interpreter is whole, rather than in finalization, which clears them anyway."""
    main = sys.modules.get("__main__")
    kinds = tuple(k for k in (getattr(dist, "ProcessGroup", None), getattr(
        sys.modules.get("torch.nn.parallel.distributed"), "DistributedDataParallel", None))
        if isinstance(k, type))
    if main is None or not kinds:
        return
    namespace = vars(main)
    names = [name for name, value in list(namespace.items()) if isinstance(value, kinds)]
    for name in names:
        namespace.pop(name, None)
    if names:
        gc.collect()


def end_process_groups(timeout: float = DESTROY_TIMEOUT_S) -> bool:
    """Send the progress watch's final beat, then destroy torch's process groups if the
    script left them initialized; True when there were none or they were destroyed within
    ``timeout`` seconds. Never raises; does nothing in a forked child."""
    if _pid is not None and os.getpid() != _pid:
        return True  # a forked child: the groups, and the hook, are the parent's
    try:
        from eventbus.app.worker.progress import end_progress_watch

        end_progress_watch()
    except Exception:  # the beat is best effort; the destroy still matters
        pass
    dist: Any = sys.modules.get("torch.distributed")
    try:
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return True
    except Exception:  # a half-imported torch at exit: nothing of ours to end
        return True
    failed: list[BaseException] = []
    done = threading.Event()

    def destroy() -> None:
        try:
            dist.destroy_process_group()
            _drop_main_references(dist)
        except BaseException as exc:  # reported below; an exit must not fail on it
            failed.append(exc)
        finally:
            done.set()

    began = time.monotonic()
    _start(destroy)
    if not done.wait(timeout):
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
