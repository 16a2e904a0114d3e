"""A worker's exit hooks: the worker bootstrap (:mod:`eventbus.app.worker`) installs
them once its forwarder is attached, so that the events a worker recorded reach its agent
however the worker ends.

* normal exit and ``sys.exit``: an ``atexit`` hook closes the forwarder;
* SIGTERM (the agent stopping the group): a handler flushes, then chains the handler the
  script installed before, or ends the process by the signal as the default would;
* ``os._exit`` (failing workers often leave by it to skip a teardown that would hang):
  replaced by one that flushes first, within :data:`OS_EXIT_FLUSH_TIMEOUT`;
* the exit of a multiprocessing child (a DataLoader worker): a multiprocessing finalizer.

Installing them is an explicit act of the bootstrap: ``import eventbus`` changes nothing of
``os`` or ``signal``.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import Any
from typing import NoReturn

from eventbus.subscribers.store_forwarder import StoreForwarder
from eventbus.subscribers.store_forwarder import worker_forwarder

__all__ = ["OS_EXIT_FLUSH_TIMEOUT", "install_exit_hooks"]

logger = logging.getLogger("eventbus")

_previous_sigterm: Any = None
_hooks_installed = False


def _close_worker_forwarder(timeout: float | None = None) -> None:
    fwd = worker_forwarder()
    if fwd is not None and fwd.in_this_process:
        try:
            fwd.close(timeout)
        except Exception:
            logger.exception("closing the store forwarder failed")


def _lock_free(fwd: StoreForwarder) -> bool:
    # The SIGTERM handler runs in the main thread between two bytecodes, possibly inside
    # the forwarder's enqueue: never flush inline then (see QueuedSink.can_wait_here).
    return fwd.sink.can_wait_here(0.2)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    fwd = worker_forwarder()
    previous = _previous_sigterm
    chained = callable(previous)
    if fwd is not None and fwd.in_this_process:
        if _lock_free(fwd):
            if chained:
                fwd.flush()
            else:
                _close_worker_forwarder()
        elif not chained:
            # Finish on a helper thread once the interrupted frame released the lock;
            # the helper ends the process the way SIGTERM would have.
            threading.Thread(target=_close_and_die, args=(signum, previous),
                             name="eventbus-sigterm", daemon=True).start()
            return
    if chained:
        previous(signum, frame)
        return
    _die(signum, previous)


def _close_and_die(signum: int, previous: Any) -> None:
    _close_worker_forwarder()
    _die(signum, previous)


def _die(signum: int, previous: Any) -> None:
    if previous == signal.SIG_IGN:
        return
    # The default action: end the process by the signal, as if no handler were installed.
    with contextlib.suppress(Exception):
        signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    time.sleep(1.0)
    _real_os_exit(128 + signum)


def _register_mp_finalizer(_: object = None) -> None:
    # multiprocessing children (DataLoader workers) leave through os._exit after running
    # multiprocessing's own finalizers, never through atexit. Their finalizer registry
    # is cleared at the child's start, then the after-fork callbacks run: register there.
    import multiprocessing.util

    multiprocessing.util.Finalize(None, _close_worker_forwarder, exitpriority=100)


_real_os_exit = os._exit
#: the budget of the flush in os._exit (the process asked to end at once)
OS_EXIT_FLUSH_TIMEOUT = 2.0


def _os_exit_flushing(status: int) -> NoReturn:
    """``os._exit`` that first pushes what the worker's forwarder still holds."""
    with contextlib.suppress(BaseException):
        _close_worker_forwarder(OS_EXIT_FLUSH_TIMEOUT)
    _real_os_exit(status)


def install_exit_hooks() -> None:
    """Flush and end the worker's forwarder on normal exit, ``sys.exit``, SIGTERM (chaining
    the handler installed before), ``os._exit`` (within :data:`OS_EXIT_FLUSH_TIMEOUT`) and
    the exit of a multiprocessing child. Idempotent."""
    global _hooks_installed, _previous_sigterm
    if _hooks_installed:
        return
    _hooks_installed = True
    atexit.register(_close_worker_forwarder)
    # Failing workers often leave by os._exit (to skip teardown that would hang); it
    # runs no atexit hook, so without this their last ~20 ms of events would be lost.
    os._exit = _os_exit_flushing
    if threading.current_thread() is threading.main_thread():
        try:
            _previous_sigterm = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, _on_sigterm)
        except (ValueError, OSError):  # not allowed here (embedded interpreter)
            logger.warning("eventbus: cannot install a SIGTERM handler; events queued when "
                           "the agent stops this worker may be lost")
    if "multiprocessing" in sys.modules:
        import multiprocessing.util

        multiprocessing.util.register_after_fork(_register_mp_finalizer,
                                                 _register_mp_finalizer)
