"""The agent's monitor tick, woken by a worker's exit.

Torch's agent loop sleeps ``--monitor-interval`` between two looks at its workers, so a
worker that dies is seen up to one interval later (0.1 s by default, 0.05 s on average):
the first part of every restart. :class:`ExitWatch` replaces that sleep with a wait on
the workers themselves: one pidfd per worker (``os.pidfd_open``, Linux 5.3), which turns
readable when the process exits, and ``poll()`` on them with the interval as its timeout.
The tick comes at once when a worker exits, and no later than the interval otherwise (the
stall, drain and STOP checks keep their pace).

A pidfd is opened right after its worker started, while the process is the agent's
unreaped child, so its pid cannot have been reused. Each pidfd wakes the loop once: it is
closed when it turns readable (a dead worker stays a zombie until torch reaps it, and its
pidfd would stay readable: kept, it would make every later wait return at once). Where
``os.pidfd_open`` is missing or refused (another OS, an old kernel, a seccomp filter), the
wait is the plain sleep torch does.

:class:`QuickWaits` does the same for torch's wait for the workers it stopped (the
survivors of a failure, at a restart, at the end), which polls.

Torch-free; the counts (:attr:`ExitWatch.ticks`, :attr:`ExitWatch.woken`) show the
loop's pace: at most one tick per interval plus one per worker exit, never a busy loop.
"""

from __future__ import annotations

import contextlib
import os
import select
import time
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Iterator
from typing import Any

__all__ = ["ExitWatch", "QuickWaits"]


class ExitWatch:
    """The wait between two monitor ticks (see the module docstring).

    ``interval``: the longest wait, seconds (the agent's ``--monitor-interval``);
    ``sleep``: the wait where no pidfd can be had.
    """

    def __init__(self, interval: float = 0.1, *,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.interval = float(interval)
        self._sleep = sleep
        self._fds: dict[int, int] = {}  # pidfd -> pid
        #: whether pidfds work here (False after the first refusal: plain sleeps)
        self.usable = hasattr(os, "pidfd_open")
        #: waits done, and those a worker's exit ended before the interval
        self.ticks = 0
        self.woken = 0

    def watch(self, pids: Iterable[int]) -> None:
        """Watch the workers ``pids`` just started (those watched before are dropped)."""
        self.close()
        if not self.usable:
            return
        for pid in pids:
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:  # gone already: the next tick sees it
                continue
            except OSError:  # no pidfds here (ENOSYS, EPERM under a filter)
                self.usable = False
                self.close()
                return
            self._fds[fd] = pid

    def wait(self) -> list[int]:
        """Wait until a watched worker exits or :attr:`interval` passed; the pids that
        exited (each given once; empty when the interval ran out)."""
        self.ticks += 1
        if not self._fds:
            self._sleep(self.interval)
            return []
        poller = select.poll()
        for fd in self._fds:
            poller.register(fd, select.POLLIN)
        ready = poller.poll(max(0, int(self.interval * 1000)))
        exited = []
        for fd, _ in ready:
            pid = self._fds.pop(fd, None)
            if pid is not None:
                exited.append(pid)
                with contextlib.suppress(OSError):
                    os.close(fd)
        if exited:
            self.woken += 1
        return exited

    def close(self) -> None:
        """Stop watching: every pidfd closed."""
        fds, self._fds = self._fds, {}
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    @contextlib.contextmanager
    def ticking(self, spec: Any) -> Iterator[None]:
        """While torch's agent loop runs on ``spec`` (its ``WorkerSpec``): the loop's sleep
        is this watch's :meth:`wait`, the agent's monitor calls it. Torch's loop reads
        ``spec.monitor_interval`` once, as it begins, and sleeps that long before each
        tick: it is 0 meanwhile, and the interval is this watch's."""
        self.interval = float(spec.monitor_interval)
        spec.monitor_interval = 0.0
        try:
            yield
        finally:
            spec.monitor_interval = self.interval
            self.close()


class QuickWaits:
    """Torch's wait for the workers it stopped, ended by their exit.

    Torch's process context stops a group by signalling every worker and then calling
    each one's ``Popen.wait(timeout)``, which polls: it sleeps 0.5 ms, doubling up to
    50 ms, between two looks. A survivor that takes 60 ms to exit is seen up to 50 ms
    later. :meth:`install` gives each worker's ``Popen`` a ``wait`` that first waits on a
    pidfd for the exit (the timeout bound as before), then lets ``Popen.wait`` reap it:
    its first look finds it. Where pidfds are refused, ``Popen.wait`` as it is.
    """

    def __init__(self) -> None:
        #: waits a pidfd ended (the worker exited before the timeout)
        self.ended = 0

    def install(self, pcontext: Any) -> None:
        """Each worker ``Popen`` of torch's process context ``pcontext`` waits this way."""
        handlers = getattr(pcontext, "subprocess_handlers", None)
        if not isinstance(handlers, dict) or not hasattr(os, "pidfd_open"):
            return
        for handler in handlers.values():
            proc = getattr(handler, "proc", None)
            wait = getattr(proc, "wait", None)
            if proc is None or wait is None or getattr(wait, "_eventbus_quick", False):
                continue
            quick = self._quick(proc, wait)
            quick._eventbus_quick = True  # type: ignore[attr-defined]
            proc.wait = quick

    def _quick(self, proc: Any, wait: Callable[..., Any]) -> Callable[..., Any]:
        def quick_wait(timeout: float | None = None) -> Any:
            if timeout is None or proc.returncode is not None:
                return wait(timeout)
            deadline = time.monotonic() + timeout
            try:
                fd = os.pidfd_open(proc.pid)  # unreaped (no returncode): still its pid
            except OSError:
                return wait(timeout)
            try:
                poller = select.poll()
                poller.register(fd, select.POLLIN)
                if poller.poll(max(0, int(timeout * 1000))):
                    self.ended += 1
            finally:
                os.close(fd)
            return wait(max(0.0, deadline - time.monotonic()))

        return quick_wait
