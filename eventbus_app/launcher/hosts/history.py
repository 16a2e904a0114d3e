"""Ledger rows from past runs' events files (``eventbus hosts --from FILES``).

A ledger started today knows nothing of last month's jobs, but their ``--events-jsonl``
files do: each event's context names its host (``hostname``), its job (``run_id``) and
its attempt (``restart_count``), which is the ledger's key. Per host, job and attempt:

* a host fault is a ``WORKER_EXIT`` or ``WORKER_STALLED`` whose ``data["host_fault"]``
  names a kind (the agent's verdict, :mod:`eventbus.app.launcher.hosts.faults`);
* ``culprit``: the ``WORKER_STALLED`` of a rank among its ``data["culprit_ranks"]``, or
  with a ``hang`` fault;
* ``straggler``: the ranks reported ``WORKER_SLOW`` at least
  :data:`~eventbus.app.launcher.hosts.faults.STRAGGLER_STREAK` times in the attempt, as the agent
  counts them (the host fault itself is in ``faults`` when the events carry it);
* ``clean``: the attempt's workers on the host all exited 0, or its agent succeeded;
* ``time``: the attempt's last event on the host.

A ``HOST_EVICTED`` names the evicted host: its row is kept even where none of its own
events is in the file. A requeued SLURM job runs again with the same run id and attempts
(often into the same files): its agents' ``AGENT_START`` carries the run's own ledger key
(``data["ledger_job"]``, ``JOB+requeueN``, as the agent writes its rows), and a host's
events after it are that run's, so each run keeps its own rows. The same event read twice
(a job-wide file and a node's own) counts once, and a row is written as an upsert:
importing a file again changes nothing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import attrs

from eventbus.app.launcher.hosts.faults import STRAGGLER_STREAK
from eventbus.app.launcher.hosts.store import HostOutcome
from eventbus.app.launcher.slurm.environment import LEDGER_JOB_KEY
from eventbus.app.protocol.host_faults import HOST_FAULT_KEY
from eventbus.app.readers.records import Problem
from eventbus.app.readers.records import Record
from eventbus.app.readers.records import read_records
from eventbus.app.sentences import as_int

__all__ = ["outcomes_from_files", "outcomes_from_records"]

#: the events that put a host in an attempt
_PRESENT = frozenset({"WORKER_START", "WORKER_EXIT", "WORKER_STALLED", "WORKER_SLOW",
                      "WORKER_PROGRESS", "RENDEZVOUS", "AGENT_EXIT", "HOST_EVICTED"})
#: the events that are counted: read once however many files hold them
_COUNTED = frozenset({"WORKER_EXIT", "WORKER_STALLED", "WORKER_SLOW"})

Key = tuple[str, str, int]


@attrs.define
class _Attempt:
    time: float = 0.0
    faults: Counter[str] = attrs.field(factory=Counter)
    culprit: int = 0
    slow: Counter[int] = attrs.field(factory=Counter)
    slow_faulted: set[int] = attrs.field(factory=set)
    exits: list[int] = attrs.field(factory=list)
    succeeded: bool = False
    evicted: bool = False

    def outcome(self, key: Key) -> HostOutcome:
        stragglers = {rank for rank, n in self.slow.items() if n >= STRAGGLER_STREAK}
        faults = Counter(self.faults)
        unsaid = stragglers - self.slow_faulted
        if unsaid and not self.slow_faulted:
            faults["straggler"] += len(unsaid)
        clean = (not faults and not self.evicted
                 and (self.succeeded or (bool(self.exits) and not any(self.exits))))
        return HostOutcome(host=key[0], job=key[1], attempt=key[2], time=self.time,
                           faults=dict(sorted(faults.items())), culprit=self.culprit,
                           straggler=len(stragglers | self.slow_faulted), clean=clean)


def _fault(record: Record) -> str | None:
    kind = record.data.get(HOST_FAULT_KEY)
    return kind if isinstance(kind, str) and kind else None


def outcomes_from_records(records: Iterable[Record]) -> list[HostOutcome]:
    """One outcome per host, job and attempt seen in ``records`` (see the module)."""
    attempts: dict[Key, _Attempt] = {}
    seen: set[str] = set()
    #: (host, run id) -> the ledger key of the run its last AGENT_START began; run id ->
    #: the latest run's, for a host whose agent's events are not in the files
    runs: dict[tuple[str, str], str] = {}
    latest: dict[str, str] = {}
    for record in records:
        job = record.context.get("run_id")
        host = record.hostname
        if record.type == "AGENT_START" and host and isinstance(job, str) and job:
            key = record.data.get(LEDGER_JOB_KEY)
            runs[(host, job)] = latest[job] = key if isinstance(key, str) and key else job
        if record.type not in _PRESENT:
            continue
        attempt = as_int(record.context.get("restart_count"))
        if not isinstance(job, str) or not job or attempt is None or attempt < 0:
            continue
        run = runs.get((host, job), latest.get(job, job))
        if record.type == "HOST_EVICTED" and isinstance(record.fields.get("host"), str):
            host = record.fields["host"]
        if not host:
            continue
        state = attempts.setdefault((host, run, attempt), _Attempt())
        state.time = max(state.time, record.timestamp)
        if record.type in _COUNTED:
            dedup = record.dedup_key()
            if dedup in seen:
                continue
            seen.add(dedup)
        _note(state, record)
    return [state.outcome(key) for key, state in sorted(attempts.items())]


def _note(state: _Attempt, record: Record) -> None:
    kind = _fault(record)
    worker = as_int(record.fields.get("worker_id"))
    if record.type == "WORKER_EXIT":
        code = as_int(record.fields.get("exit_code"))
        if code is not None:
            state.exits.append(code)
        if kind is not None:
            state.faults[kind] += 1
    elif record.type == "WORKER_STALLED":
        culprits = record.data.get("culprit_ranks")
        if kind == "hang" or (isinstance(culprits, list) and worker in culprits):
            state.culprit += 1
        if kind is not None:
            state.faults[kind] += 1
    elif record.type == "WORKER_SLOW" and worker is not None:
        state.slow[worker] += 1
        if kind is not None and worker not in state.slow_faulted:
            state.slow_faulted.add(worker)
            state.faults[kind] += 1
    elif record.type == "AGENT_EXIT":
        state.succeeded = record.fields.get("state") == "SUCCEEDED"
    elif record.type == "HOST_EVICTED":
        state.evicted = True


def outcomes_from_files(paths: Iterable[str | Path]
                        ) -> tuple[list[HostOutcome], list[Problem]]:
    """The outcomes of every file together (an event in two files counts once), and the
    lines that were not events. Raises OSError for a file that cannot be read."""
    records: list[Record] = []
    problems: list[Problem] = []
    for path in paths:
        found, bad = read_records(path)
        records += found
        problems += bad
    records.sort(key=lambda r: r.timestamp)
    return outcomes_from_records(records), problems
