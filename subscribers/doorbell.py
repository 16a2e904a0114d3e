"""A queue thread's wake-up (:class:`Doorbell`): how the thread of a
:class:`~eventbus.subscribers.queued.QueuedSink` sleeps with no timeout while it has
nothing to do, and how an enqueue wakes it.

One descriptor pair made with the thread: an ``eventfd`` (Linux: one descriptor, both
ends), else a non-blocking pipe, both close-on-exec. A ring is one ``write`` system call,
nothing else (no object the garbage collector tracks, so none runs under the sink's lock);
a full pipe or counter means a wake-up is pending already. The thread polls the read end,
then drains it. Where the platform has no ``poll()``, there is no descriptor: a ring
notifies the sink's condition, and the thread waits on it for at most the sink's
``flush_interval`` at a time.

The sink's lock guards the descriptors: rings come with it held, and the thread closes
them under it when it ends.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
from collections.abc import Callable

__all__ = ["Doorbell"]

#: poll()'s longest timeout (a C int of milliseconds); a longer one is as good as none
_POLL_MAX_MS = 2**31 - 1
#: what one ring writes: an eventfd takes an 8-byte count, a pipe any byte
_RING_BYTES = (1).to_bytes(8, "little") if hasattr(os, "eventfd") else b"\x01"


class Doorbell:
    """The wake-up of one queue thread. ``cond``: the sink's condition (over its lock);
    ``fallback_s``: the longest wait where there is no ``poll()``; ``needed``: whether the
    thread has a reason not to wait at all there (a flush or a close under way)."""

    def __init__(self, cond: threading.Condition, *, fallback_s: float,
                 needed: Callable[[], bool]) -> None:
        self._cond = cond
        self._fallback_s = fallback_s
        self._needed = needed
        #: the read and write ends (one eventfd is both); None before the thread, after
        #: it ended, and where there is no poll()
        self.read_fd: int | None = None
        self.write_fd: int | None = None
        #: times the thread came back from a wait (a ring or a timeout): what an idle sink
        #: must not add to
        self.wakeups = 0

    def open(self) -> None:
        """New descriptors, for a new thread (with the lock held)."""
        if not hasattr(select, "poll"):
            return
        if hasattr(os, "eventfd"):
            fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            self.read_fd = self.write_fd = fd
            return
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        self.read_fd, self.write_fd = r, w

    def close(self) -> None:
        """Close the descriptors (the thread's end, with the lock held; a forked child
        closes the ones it inherited)."""
        for fd in {self.read_fd, self.write_fd}:
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.read_fd = self.write_fd = None

    def ring(self) -> None:
        """Wake the thread (with the lock held): one system call."""
        fd = self.write_fd
        if fd is None:
            self._cond.notify()  # no poll() here: the thread waits on the condition
            return
        try:  # noqa: SIM105  (no context manager object: nothing the collector tracks)
            os.write(fd, _RING_BYTES)
        except OSError:
            pass

    def wait(self, timeout: float | None) -> None:
        """The thread's one way to wait, without the lock: until a ring, or ``timeout``
        seconds (None: no limit)."""
        self.wakeups += 1
        fd = self.read_fd
        if fd is None:
            limit = self._fallback_s
            with self._cond:
                if not self._needed():
                    self._cond.wait(limit if timeout is None else min(timeout, limit))
            return
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        poller.poll(None if timeout is None else min(_POLL_MAX_MS, max(0, int(timeout * 1000))))
        self.drain()

    def drain(self) -> None:
        """Empty the read end: rings so far are seen (an eventfd's count, a pipe's bytes)."""
        fd = self.read_fd
        if fd is None:
            return
        with contextlib.suppress(OSError):
            os.read(fd, 4096)
