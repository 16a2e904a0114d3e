"""A warm spare's priority: once the workers train, its warm-up yields the CPU to them;
the worker it becomes runs at the worker's normal priority (eventbus_app/worker/spare.py).

A spare started beside starting workers warms up at their priority (the job is not
training yet). At the workers' first step the agent lowers it (:func:`demote`); a spare
started after that step lowers itself from its start. Two levels, because Linux weighs
threads within a scheduling group, and groups against each other:

- **The session's group** (:class:`GroupNice`). With autogroup
  (``/proc/sys/kernel/sched_autogroup_enabled``, processes in the root cgroup), each
  session is a group weighed against the others at the group's nice value, and every
  worker and spare is a session of its own: a thread's own priority would change nothing
  against a worker. The spare's session's autogroup nice value goes to 19, and back to a
  new session's 0 (any process may lower an autogroup's nice value back to 0) when the
  warm-up ends or the spare becomes the worker, whichever comes first.
- **The warm-up thread**, for the other cases (a cgroup of its own, no autogroup). Linux
  lets an unprivileged thread be put at ``SCHED_IDLE`` or a higher nice value, never back,
  and the threads a thread starts inherit its policy (torch starts one at import). So the
  thread that becomes the worker is never lowered: the imports run on a thread of their
  own, which goes to ``SCHED_IDLE`` and nice 19 only where the process may raise it back
  (:func:`can_raise`: root, ``CAP_SYS_NICE``, or a ``RLIMIT_NICE`` that allows it); the
  main thread keeps the agent's policy and nice value and sleeps on the pipe meanwhile.
  When the spare becomes the worker, every thread left at ``SCHED_IDLE`` is put back at
  the main thread's priority (:func:`raise_threads`).

The agent puts a spare back itself as it hands it its worker (:func:`promote`): the
spare's main thread needs the GIL to do it, which a warm-up thread starved at the lowest
priority may hold. Where neither level applies (no autogroup in effect and no right to
raise a priority), the warm-up runs at the worker's priority throughout.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time

__all__ = ["AUTOGROUP", "LOW_NICE", "GroupNice", "can_raise", "demote",
           "lower_this_thread", "promote", "raise_threads", "sched_of"]

#: the nice value of a spare's warm-up (the lowest priority)
LOW_NICE = 19
AUTOGROUP = "/proc/self/autogroup"
#: Linux lets an unprivileged process change an autogroup's nice value once per 100 ms
#: (system-wide; EAGAIN otherwise): how long a restore is retried
RESTORE_FOR_S = 2.0
#: /proc/PID/stat's fields after the command's ")" (0-based): nice (field 19), policy (41)
_NICE_FIELD, _POLICY_FIELD = 16, 38


#: CAP_SYS_NICE's bit in /proc/self/status's CapEff
_CAP_SYS_NICE = 23


def can_raise(nice: int | None = None) -> bool:
    """Whether this process may put a thread back from ``SCHED_IDLE`` and nice 19 to nice
    ``nice`` (default: the calling thread's): ``CAP_SYS_NICE``, or a ``RLIMIT_NICE`` whose
    ceiling allows ``nice``."""
    if nice is None:
        nice = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        with open("/proc/self/status") as f:
            caps = next((line.split()[1] for line in f if line.startswith("CapEff:")), "0")
        if int(caps, 16) >> _CAP_SYS_NICE & 1:
            return True
        import resource

        return resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20 - nice
    except (OSError, ValueError, AttributeError, ImportError):
        return False


def lower_this_thread() -> None:
    """The calling thread, and the threads it starts, to ``SCHED_IDLE`` (where the
    platform has it) and nice :data:`LOW_NICE`. Nothing where neither can be set."""
    tid = threading.get_native_id()
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, tid, LOW_NICE)


def raise_threads(pid: int | None = None) -> int:
    """Every thread of process ``pid`` (default: this one) at ``SCHED_IDLE`` back to
    ``SCHED_OTHER`` at the nice value of its main thread, where the caller may do so. How
    many were put back."""
    pid = os.getpid() if pid is None else pid
    count = 0
    try:
        nice = sched_of(pid)[1]
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except (OSError, ValueError, IndexError):
        return 0
    for tid in tids:
        try:
            if sched_of(pid, tid)[0] != getattr(os, "SCHED_IDLE", 5):
                continue
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except (AttributeError, OSError, ValueError, IndexError):
            continue
        count += 1
    return count


def demote(pid: int) -> None:
    """Spare ``pid`` to the lowest priority, from the agent, once the workers train: its
    session's autogroup to :data:`LOW_NICE`, and its threads but the main one (the
    warm-up's) to ``SCHED_IDLE`` and :data:`LOW_NICE` where they can be put back
    (:func:`can_raise`). Nothing for a thread that ended meanwhile."""
    group = GroupNice(f"/proc/{pid}/autogroup")
    if group.original is not None and group.original < LOW_NICE:
        group._write(LOW_NICE)  # refused (rate limited): the spare stays as it is
    if not can_raise():
        return
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except (OSError, ValueError):
        return
    for tid in tids:
        if tid == pid:
            continue
        with contextlib.suppress(AttributeError, OSError):
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, tid, LOW_NICE)


def promote(pid: int) -> None:
    """Spare ``pid`` is becoming a worker: its session's autogroup and its threads back at
    the worker's priority, from the agent. The spare does the same itself, but only once
    it holds the GIL, which its warm-up thread may hold while starved at the lowest
    priority on a busy node; the agent is not starved."""
    GroupNice(f"/proc/{pid}/autogroup", original=0).restore()
    raise_threads(pid)


def sched_of(pid: int, tid: int | None = None) -> tuple[int, int]:
    """(policy, nice) of process ``pid`` (its main thread) or of its thread ``tid``, read
    from ``/proc``: policy 0 is ``SCHED_OTHER``, 5 ``SCHED_IDLE``."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[_POLICY_FIELD]), int(fields[_NICE_FIELD])


def _autogroup_nice(path: str = AUTOGROUP) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().split()[-1])
    except (OSError, ValueError, IndexError):
        return None


class GroupNice:
    """This process's autogroup nice value: lowered for the warm-up, put back after.

    A no-op where there is no autogroup file (another kernel, another OS). The restore is
    retried in the background for :data:`RESTORE_FOR_S` where the kernel's rate limit
    refuses it at first, so the worker never waits for it.
    """

    def __init__(self, path: str = AUTOGROUP, *, original: int | None = None) -> None:
        self.path = path
        now = _autogroup_nice(path)
        #: the value to put back (None: no autogroup here, nothing lowered); ``original``
        #: puts back a value known (a new session's 0) over one already lowered
        self.original = original if original is not None and now is not None else now
        self.lowered = original is not None and now is not None and now != original
        self._lock = threading.Lock()

    def _write(self, value: int) -> int:
        """0 once written; the error's number otherwise."""
        try:
            with open(self.path, "w") as f:
                f.write(str(value))
        except OSError as exc:
            return exc.errno or -1
        return 0

    def _write_retrying(self, value: int) -> bool:
        """Write ``value``, retried while the kernel's rate limit refuses it (for
        :data:`RESTORE_FOR_S` at most); whether it was written."""
        deadline = time.monotonic() + RESTORE_FOR_S
        while True:
            error = self._write(value)
            if error != errno.EAGAIN or time.monotonic() > deadline:
                return error == 0
            time.sleep(0.02)

    def lower(self) -> None:
        """The group to :data:`LOW_NICE`, before the warm-up begins (retried while rate
        limited: the spare waits meanwhile, at no cost of CPU)."""
        if self.original is None or self.original >= LOW_NICE:
            return
        self.lowered = self._write_retrying(LOW_NICE)

    def restore(self) -> None:
        """Put the group's nice value back, now or, refused, from a thread that retries."""
        with self._lock:
            if not self.lowered or self.original is None:
                return
            self.lowered = False
        original = self.original
        if self._write(original) != errno.EAGAIN:
            return
        threading.Thread(target=self._write_retrying, args=(original,),
                         name="eventbus-spare-priority", daemon=True).start()
