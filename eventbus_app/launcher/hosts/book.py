"""One node's host faults in this job, and the eviction they lead to.

The agent tells the book what it saw (a worker's failure, a stall verdict, a straggler
report); the book asks the rule (:func:`eventbus.app.launcher.hosts.faults.host_fault`) what kind of
host fault it is, counts it against this node's host, and says when the count reaches
``--evict-after``: the agent then publishes ``HOST_EVICTED`` and leaves the job with the
bad-host exit code. At each attempt's end the book gives the attempt's outcome for the host
ledger (:class:`eventbus.app.launcher.hosts.host_ledger.HostOutcome`).

The OOM killer leaves no mark on the worker's exit but a SIGKILL. The book reads the count
of OOM kills of the agent's memory cgroup (``memory.events``'s ``oom_kill`` on cgroup v2,
``memory.oom_control``'s on v1: the workers are in the agent's cgroup unless something
moved them) when an attempt starts and when a worker dies by SIGKILL; a rise says the
kernel killed. Without a readable count a SIGKILL is never an OOM kill.

Torch-free, with an injectable OOM reader (tests/test_hostbook.py).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from eventbus.app.launcher.hosts.faults import Failure
from eventbus.app.launcher.hosts.faults import host_fault
from eventbus.app.launcher.hosts.faults import kinds_said
from eventbus.app.launcher.slurm.environment import node_name

__all__ = ["DEFAULT_EVICT_AFTER", "HostBook", "oom_kill_count"]

#: ``--evict-after`` default: a second host fault on one node evicts it
DEFAULT_EVICT_AFTER = 2


def _cgroup_files(pid: int | str = "self") -> list[Path]:
    """The files that count this process's memory cgroup's OOM kills, v2 first."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            found.append(Path("/sys/fs/cgroup", path.lstrip("/"), "memory.events"))
            found.append(Path("/sys/fs/cgroup/unified", path.lstrip("/"), "memory.events"))
        elif "memory" in controllers.split(","):
            found.append(Path("/sys/fs/cgroup/memory", path.lstrip("/"), "memory.oom_control"))
    return found


def oom_kill_count() -> int | None:
    """The OOM kills of this process's memory cgroup so far; None where no count can be
    read (no cgroup memory controller, another OS)."""
    for path in _cgroup_files():
        try:
            text = path.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
    return None


class HostBook:
    """This node's host faults in this job (see the module docstring)."""

    def __init__(self, host: str, *, evict_after: int = DEFAULT_EVICT_AFTER,
                 oom_kills: Callable[[], int | None] = oom_kill_count) -> None:
        self.host = host
        #: 0: never evict (the faults are still counted and recorded)
        self.evict_after = evict_after
        self._oom_kills = oom_kills
        #: the job's host faults on this node, by kind
        self.faults: Counter[str] = Counter()
        #: this attempt's, by kind; and its culprit and straggler counts
        self.attempt_faults: Counter[str] = Counter()
        self.culprits = 0
        self.stragglers = 0
        self._oom_base = oom_kills() or 0
        self._failed_first = False
        self._slow: Counter[int] = Counter()
        self._slow_counted: set[int] = set()
        #: the eviction's reason once decided, the faults by kind ("2 signal"); the book
        #: never takes it back
        self.evicted: str | None = None

    @classmethod
    def for_this_host(cls, *, evict_after: int = DEFAULT_EVICT_AFTER) -> HostBook:
        """The book of the host this agent runs on: ``EVENTBUS_HOSTNAME``, else SLURM's
        node name (``SLURMD_NODENAME``), else the machine's name (what the events' context
        says)."""
        return cls(node_name() or os.uname().nodename, evict_after=evict_after)

    # -- what the agent saw ------------------------------------------------------------------
    def new_attempt(self) -> None:
        """A new attempt starts: its own counts, and the OOM count read afresh."""
        self.attempt_faults = Counter()
        self.culprits = self.stragglers = 0
        self._oom_base = self._oom_kills() or self._oom_base
        self._failed_first = False
        self._slow.clear()
        self._slow_counted.clear()

    def worker_failed(self, *, exit_code: int, message: str = "",
                      by_agent: bool = False) -> str | None:
        """A worker of this node failed: the kind of host fault it is (counted), or None.
        Only the node's first failure of the attempt is read for its message (the others
        are often its consequence)."""
        first = not self._failed_first and not by_agent
        self._failed_first = self._failed_first or not by_agent
        oom = 0
        if exit_code in (-9, 137) and not by_agent:
            now = self._oom_kills()
            oom = 0 if now is None else max(0, now - self._oom_base)
        kind = host_fault(Failure(exit_code=exit_code, message=message, by_agent=by_agent,
                                  oom_kills=oom, first=first))
        return self._count(kind)

    def worker_stalled(self, *, waiting_on: str | None, culprit: bool) -> str | None:
        """A stall verdict on a rank of this node."""
        if culprit:
            self.culprits += 1
        return self._count(host_fault(Failure(stalled=True, waiting_on=waiting_on,
                                              culprit=culprit)))

    def worker_slow(self, rank: int) -> str | None:
        """A ``WORKER_SLOW`` of a rank of this node: a host fault once it is persistent
        (:data:`eventbus.app.launcher.hosts.faults.STRAGGLER_STREAK` reports in this
        attempt), counted once per attempt."""
        self._slow[rank] += 1
        if rank in self._slow_counted:
            return None
        kind = host_fault(Failure(slow_streak=self._slow[rank]))
        if kind is not None:
            self._slow_counted.add(rank)
            self.stragglers += 1
        return self._count(kind)

    def marked(self, kind: str) -> str | None:
        """A reactor's mark on a failure of this node."""
        return self._count(host_fault(Failure(marked=kind)))

    def _count(self, kind: str | None) -> str | None:
        if kind is not None:
            self.faults[kind] += 1
            self.attempt_faults[kind] += 1
            if self.evict_after and self.evicted is None and \
                    sum(self.faults.values()) >= self.evict_after:
                self.evicted = kinds_said(self.faults)
        return kind

    @property
    def total(self) -> int:
        """The job's host faults on this node."""
        return sum(self.faults.values())

