"""Row 11: fork while another thread holds the bus lock; the child records normally.

The queued-sink part (no inherited buffer duplicated) and the store part (the child opens
its own store client) are in test_fork_sinks.py, against eventbus.subscribers.queued and the
store forwarder.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

import eventbus
from eventbus import Bus
from eventbus import Event

FORKS = 50
CHILD_DEADLINE_S = 20.0

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


@contextmanager
def _lock_held_by_another_thread(*locks: threading.RLock) -> Iterator[None]:
    """Hold ``locks`` in a helper thread for the duration of the block."""
    held = threading.Event()
    release = threading.Event()

    def hold() -> None:
        for lock in locks:
            lock.acquire()
        held.set()
        release.wait(60)
        for lock in reversed(locks):
            lock.release()

    t = threading.Thread(target=hold, name="lock-holder", daemon=True)
    t.start()
    assert held.wait(10)
    try:
        yield
    finally:
        release.set()
        t.join(10)


def _wait_child(pid: int, deadline_s: float) -> int | None:
    """The child's exit status, or None (after killing it) if it did not finish in time."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.005)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return None


def _child(bus: Bus, parent_pid: int) -> int:
    """What each forked child does; returns its exit code (0 = all checks passed)."""
    if eventbus.current_context().pid != os.getpid() or os.getpid() == parent_pid:
        return 2
    got: list[Event] = []
    subs = [bus.subscribe("METRIC", on_event=got.append),
            eventbus.get_default_bus().subscribe("METRIC", on_event=got.append)]

    def broken(event: Event) -> None:
        raise RuntimeError("failure in the child")

    # a failing subscriber takes the bus lock to count (and maybe report) the failure
    failing = bus.subscribe("METRIC", on_event=broken)
    for step in range(10):
        bus.record("METRIC", step=step)
        eventbus.record("METRIC", step=step)
    if len(got) != 20 or any(e.pid != os.getpid() for e in got):
        return 3
    if failing.stats()["failed"] != 10:
        return 4
    for sub in [*subs, failing]:
        sub.cancel()
    bus.stats()
    return 0


def test_fork_with_bus_lock_held(bus: Bus, figure: Callable[[int, str], None]) -> None:
    """50 forks, each while another thread holds the default bus's and a private bus's
    lock: every child subscribes, records, counts a failure and exits 0 in time; its
    events carry its own pid."""
    parent_pid = os.getpid()
    sink: list[Event] = []
    bus.subscribe("METRIC", on_event=sink.append)  # inherited by the children
    statuses: list[int | None] = []
    for _ in range(FORKS):
        with _lock_held_by_another_thread(bus._lock, eventbus.get_default_bus()._lock):
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the child
                code = 1
                try:
                    code = _child(bus, parent_pid)
                finally:
                    os._exit(code)
            statuses.append(_wait_child(pid, CHILD_DEADLINE_S))
    ok = statuses.count(0)
    figure(11, f"{ok}/{FORKS} forks ok with the bus lock held "
               f"(hung: {statuses.count(None)}, failed: {FORKS - ok - statuses.count(None)})")
    assert ok == FORKS, statuses
    assert sink == []  # nothing a child recorded reached the parent's subscribers
