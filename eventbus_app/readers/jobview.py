"""The shape of a recorded job, rebuilt from its events: what the trace exporter, the
timeline plot and the tail view share.

Input is the events as decoded JSON objects (one ``Event.to_json()`` line each), not typed
events: a file may hold user-declared types that this process never declared, and it must
still be drawn. Everything here is tolerant: a record missing a field it should have is
shown as an instant, never dropped and never fatal.

How a flat event stream becomes a picture:

* **Nodes.** A worker's events carry its ``group_rank``. An agent's carry it only once it
  has rendezvoused (``AGENT_START`` comes before; torchrun's agent process has no
  ``GROUP_RANK``), so an agent is also tied to its node through the workers it started:
  ``WORKER_START.worker_pid`` is the pid in that worker's own events. An agent nothing ties
  to a node is shown under its hostname.
* **Attempts.** Each node's timeline is cut into attempts by its ``WORKER_RESTART``
  events: attempt 0 runs from the node's first event to its first restart, and so on. The
  workers' ``TORCHELASTIC_RESTART_COUNT`` is not used for this: torchelastic does not
  increase it when a node restarts its workers because another node joined or failed.
* **Worker runs.** One span per worker *process* (hostname + pid), from ``WORKER_START``
  (or its first event) to its ``WORKER_EXIT`` (or, when the agent stopped it without
  recording an exit, to the end of its attempt).
* **Rendezvous.** ``RENDEZVOUS`` is recorded when a round ends; with ``duration_s`` it is
  the span ``[timestamp - duration_s, timestamp]``.
* **Drains.** A ``PREEMPTING`` (a drain signal to an agent) begins the job's drain; it
  lasts until the job's ``AGENT_EXIT`` (the first after it), or, without one, to the last
  event. Its end holds the drain's facts (``data["drain"]``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from collections.abc import Iterator
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from typing import Literal

import attrs

from eventbus.app.readers.records import Problem
from eventbus.app.readers.records import Record
from eventbus.app.readers.records import _duration
from eventbus.app.readers.records import read_records
from eventbus.app.sentences import as_int
from eventbus.app.sentences import cause_of
from eventbus.app.sentences import drain_facts
from eventbus.app.sentences import job_outcome
from eventbus.events import Cause

__all__ = [
    "AGENT",
    "Attempt",
    "DrainSpan",
    "EpochSpan",
    "JobView",
    "Marker",
    "NodeView",
    "Outcome",
    "RendezvousSpan",
    "WorkerRun",
    "expand_inputs",
    "iter_tracks",
    "load_for_command",
]

#: the track key of a node's agent (worker tracks are keyed by global rank)
AGENT: Literal["agent"] = "agent"

# -- the job ---------------------------------------------------------------------------------


@attrs.define
class NodeView:
    """One node (agent + its workers) as the picture shows it."""

    key: tuple[int, int | str]
    label: str
    hostname: str
    group_rank: int | None
    ranks: list[int] = attrs.Factory(list)


#: how an attempt ended: the words of the job view's page (``timeline[].outcome``)
Outcome = Literal["failed", "succeeded", "stopped", "preempted", "restarted", "running"]


@attrs.frozen
class Attempt:
    """One attempt of one node: ``[start, end]``, cut by the node's ``WORKER_RESTART``s.

    ``outcome``: ``failed`` when the restart that ended it was for a failure or a stall
    of this node (its ``cause``; a file without it: a worker of this node failed by
    itself), ``restarted`` for another restart (the group re-formed through the
    rendezvous); the last attempt: the job's outcome
    (:func:`eventbus.app.sentences.job_outcome`: ``succeeded``, ``stopped``, ``preempted``
    or ``failed``), ``running`` without an ``AGENT_EXIT``."""

    node: str
    index: int
    start: float
    end: float
    outcome: Outcome
    #: the WORKER_RESTART that began it (None for attempt 0)
    restart: Record | None


@attrs.frozen
class WorkerRun:
    """One worker process: its rank, its attempt, when it ran and how it ended."""

    node: str
    rank: int | None
    attempt: int
    start: float
    end: float
    hostname: str
    pid: int | None
    local_rank: int | None
    exit_code: int | None
    #: what ``end`` comes from: its WORKER_EXIT, the end of its attempt, or its last event
    ended_by: Literal["exit", "attempt end", "last event"]
    exit: Record | None
    signal: str | None = None
    message: str | None = None
    #: the first and the last event the worker recorded itself (None: it recorded none).
    #: Before the first: the process starting (importing torch, joining the process
    #: group); after the last: it shutting down.
    first_event: float | None = None
    last_event: float | None = None

    @property
    def failed(self) -> bool:
        """It exited with a non-zero code (see :attr:`stopped_by_agent`)."""
        return self.exit_code not in (0, None)

    @property
    def stopped_by_agent(self) -> bool:
        """Its agent stopped it (SIGTERM) because another worker failed."""
        return self.exit is not None and self.exit.stopped_by_agent


@attrs.frozen
class EpochSpan:
    """``EPOCH_START`` .. ``EPOCH_END`` of one rank in one attempt."""

    node: str
    rank: int | None
    attempt: int
    epoch: int
    start: float
    end: float
    finished: bool


@attrs.frozen
class RendezvousSpan:
    """One rendezvous round of one node."""

    node: str
    start: float
    end: float
    record: Record


@attrs.frozen
class DrainSpan:
    """A drain of the job: from its ``PREEMPTING`` to the job's ``AGENT_EXIT`` (``exit``;
    None while it drains, when ``end`` is the last event), with that end's
    ``data["drain"]`` (:func:`eventbus.app.sentences.drain_facts`)."""

    start: float
    end: float
    preempting: Record
    exit: Record | None

    @property
    def facts(self) -> dict[str, Any] | None:
        """The end's ``data["drain"]``, read as :func:`~eventbus.app.sentences.drain_facts`
        does; None while it drains or without one."""
        return drain_facts(self.exit) if self.exit is not None else None


@attrs.frozen
class Marker:
    """A point event on a track: failures, restarts, checkpoints, metrics, user types..."""

    node: str
    track: int | Literal["agent"]
    timestamp: float
    record: Record


def _by_time(records: Iterable[Record]) -> list[Record]:
    return sorted(records, key=lambda r: r.timestamp)


@attrs.define
class JobView:
    """The job, rebuilt: nodes, their attempts, worker runs, epochs, rendezvous, markers.

    Build it with :meth:`from_records` or :meth:`from_files`.
    """

    records: list[Record]
    problems: list[Problem]
    t0: float
    t1: float
    nodes: list[NodeView]
    attempts: list[Attempt]
    runs: list[WorkerRun]
    epochs: list[EpochSpan]
    rendezvous: list[RendezvousSpan]
    markers: list[Marker]
    #: records that became part of a span (WORKER_START, clean WORKER_EXIT, EPOCH_*,
    #: RENDEZVOUS with a duration); every other record is a marker
    consumed: int = 0
    #: the job's drains (a PREEMPTING each, to the job's end)
    drains: list[DrainSpan] = attrs.Factory(list)

    @property
    def run_id(self) -> str | None:
        """The torchelastic run id, when the events carry one."""
        for r in self.records:
            run_id = r.context.get("run_id")
            if isinstance(run_id, str):
                return run_id
        return None

    @classmethod
    def from_files(cls, paths: Iterable[str | Path]) -> JobView:
        """Read and merge several JSONL files (one per node, or a job-wide one plus per-node
        ones: an event found in two files is kept once)."""
        records: list[Record] = []
        problems: list[Problem] = []
        paths = list(paths)
        for path in paths:
            found, bad = read_records(path)
            records.extend(found)
            problems.extend(bad)
        return cls.from_records(records, problems=problems, dedup=len(paths) > 1)

    @classmethod
    def from_records(cls, records: Iterable[Record], *, problems: Iterable[Problem] = (),
                     dedup: bool = True) -> JobView:
        """The job described by ``records`` (any order). ``dedup``: drop events seen twice
        (what merging a job-wide file with per-node files gives)."""
        given = list(records)
        unique = given
        if dedup:
            seen: set[str] = set()
            unique = []
            for r in given:
                key = r.dedup_key()
                if key not in seen:
                    seen.add(key)
                    unique.append(r)
        return _Builder(_by_time(unique), list(problems)).build()

    def node(self, label: str) -> NodeView:
        """The node with this label."""
        for n in self.nodes:
            if n.label == label:
                return n
        raise KeyError(label)

    def attempt_count(self) -> int:
        """How many attempts the longest-lived node went through."""
        return max((a.index for a in self.attempts), default=-1) + 1

    def outcome(self) -> str:
        """How the job ended, from its ``AGENT_EXIT`` events read as the page reads them
        (:func:`eventbus.app.sentences.job_outcome`), in capitals: ``SUCCEEDED``,
        ``FAILED``, ``STOPPED`` (a reactor's STOP), ``PREEMPTED`` (a drain signal drained
        it); the worst of several nodes' ends; ``unknown`` without an ``AGENT_EXIT``."""
        outcomes = {job_outcome(r) for r in self.records if r.type == "AGENT_EXIT"}
        for word in ("stopped", "failed", "preempted", "succeeded"):
            if word in outcomes:
                return word.upper()
        return "unknown"


def _failed(restart: Record | None, recs: Sequence[Record], start: float,
            end: float) -> bool:
    """Whether the attempt ``[start, end]`` that ``restart`` ended failed on this node: the
    restart's ``cause`` says a failure or a stall; a file from before the field: a worker
    of this node failed by itself within it."""
    if restart is not None and restart.fields.get("cause") is not None:
        return cause_of(restart) in (Cause.FAILURE.value, Cause.STALL.value)
    return any(r.is_own_failure and r.type == "WORKER_EXIT" and start <= r.timestamp <= end
               for r in recs)


class _Builder:
    """The inference steps of :class:`JobView`, in order."""

    def __init__(self, records: list[Record], problems: list[Problem]) -> None:
        self.records = records
        self.problems = problems
        self.agent_node: dict[tuple[str, int | None], str] = {}
        self.worker_node: dict[tuple[str, int | None], str] = {}
        self.nodes: dict[str, NodeView] = {}
        self.consumed: set[int] = set()

    # -- nodes ---------------------------------------------------------------------------
    def _node_for_group(self, group: int, hostname: str) -> str:
        label = f"node {group}"
        if label not in self.nodes:
            self.nodes[label] = NodeView((0, group), label, hostname, group)
        elif not self.nodes[label].hostname:
            self.nodes[label].hostname = hostname
        return label

    def _node_for_host(self, hostname: str, pid: int | None, unique_host: bool) -> str:
        label = (hostname or "unknown host") if unique_host else f"{hostname}:{pid}"
        if label not in self.nodes:
            self.nodes[label] = NodeView((1, label), label, hostname, None)
        return label

    def _assign_nodes(self) -> None:
        # Workers first: they know their group rank.
        for r in self.records:
            if r.rank is not None and r.group_rank is not None:
                self.worker_node[(r.hostname, r.pid)] = self._node_for_group(
                    r.group_rank, r.hostname)
        # Agents: their own group rank, else the node of a worker they started.
        for r in self.records:
            if r.rank is not None:
                continue
            key = (r.hostname, r.pid)
            if r.group_rank is not None:
                self.agent_node[key] = self._node_for_group(r.group_rank, r.hostname)
            elif key not in self.agent_node and r.type in ("WORKER_START", "WORKER_EXIT"):
                worker = (r.hostname, as_int(r.fields.get("worker_pid")))
                if worker in self.worker_node:
                    self.agent_node[key] = self.worker_node[worker]
        # The agents left: under their hostname.
        loose = {(r.hostname, r.pid) for r in self.records
                 if r.rank is None and (r.hostname, r.pid) not in self.agent_node}
        hosts = [h for h, _ in loose]
        for host, pid in sorted(loose, key=lambda k: (k[0], k[1] or 0)):
            self.agent_node[(host, pid)] = self._node_for_host(host, pid, hosts.count(host) == 1)
        # Workers without a group rank: through the agent that started them.
        started_by = {(a.hostname, as_int(a.fields.get("worker_pid"))): (a.hostname, a.pid)
                      for a in self.records if a.rank is None and a.type == "WORKER_START"}
        for r in self.records:
            if r.rank is None or r.group_rank is not None:
                continue
            key = (r.hostname, r.pid)
            if key in self.worker_node:
                continue
            agent = started_by.get(key)
            self.worker_node[key] = (self.agent_node[agent] if agent is not None
                                     else self._node_for_host(r.hostname, None, True))

    def node_of(self, r: Record) -> str:
        key = (r.hostname, r.pid)
        if r.rank is None:
            return self.agent_node[key]
        return self.worker_node[key]

    def track_of(self, r: Record) -> int | Literal["agent"]:
        if r.rank is not None:
            return r.rank
        if r.type in ("WORKER_START", "WORKER_EXIT", "WORKER_STALLED", "WORKER_SLOW"):
            worker_id = as_int(r.fields.get("worker_id"))
            if worker_id is not None:
                return worker_id
        return AGENT

    # -- attempts ------------------------------------------------------------------------
    def _attempts(self) -> list[Attempt]:
        by_node: dict[str, list[Record]] = {}
        for r in self.records:
            by_node.setdefault(self.node_of(r), []).append(r)
        attempts: list[Attempt] = []
        for label, recs in by_node.items():
            first = min(_start_of(r) for r in recs)
            last = max(r.timestamp for r in recs)
            restarts = [r for r in recs if r.type == "WORKER_RESTART" and r.rank is None]
            bounds: list[tuple[float, Record | None]] = [(first, None)]
            bounds += [(r.timestamp, r) for r in restarts]
            agent_exit = next((r for r in recs if r.type == "AGENT_EXIT"), None)
            for i, (start, restart) in enumerate(bounds):
                if i + 1 < len(bounds):
                    end, ended_by = bounds[i + 1]
                    outcome: Outcome = "failed" if _failed(ended_by, recs, start, end) \
                        else "restarted"
                else:
                    end = agent_exit.timestamp if agent_exit is not None else last
                    end = max(end, last)
                    if agent_exit is None:
                        outcome = "running"
                    else:
                        ended = job_outcome(agent_exit)
                        outcome = ("succeeded" if ended == "succeeded" else
                                   "stopped" if ended == "stopped" else
                                   "preempted" if ended == "preempted" else "failed")
                attempts.append(Attempt(label, i, start, end, outcome, restart))
        return attempts

    @staticmethod
    def attempt_at(attempts: list[Attempt], node: str, t: float) -> Attempt | None:
        found = None
        for a in attempts:
            if a.node == node and a.start <= t:
                found = a
        return found

    # -- worker runs -----------------------------------------------------------------------
    def _runs(self, attempts: list[Attempt]) -> list[WorkerRun]:
        # A worker process: (hostname, pid), known from WORKER_START or its own events.
        starts: dict[tuple[str, int | None], Record] = {}
        first: dict[tuple[str, int | None], Record] = {}
        last: dict[tuple[str, int | None], Record] = {}
        key: tuple[str, int | None]
        for r in self.records:
            if r.type == "WORKER_START" and r.rank is None:
                pid = as_int(r.fields.get("worker_pid"))
                # no pid: a key of its own (negative: never a real pid)
                key = (r.hostname, pid) if pid is not None else (r.hostname, -len(starts) - 1)
                starts.setdefault(key, r)
            elif r.rank is not None:
                key = (r.hostname, r.pid)
                first.setdefault(key, r)
                last[key] = r
        exits = [r for r in self.records if r.type == "WORKER_EXIT" and r.rank is None]
        used_exits: set[int] = set()
        runs: list[WorkerRun] = []
        for key in sorted(set(starts) | set(first),
                          key=lambda k: (starts.get(k) or first[k]).timestamp):
            start_rec = starts.get(key)
            own = first.get(key)
            if start_rec is not None:
                self.consumed.add(id(start_rec))
                node = self.node_of(start_rec)
                rank = as_int(start_rec.fields.get("worker_id"))
                local_rank = as_int(start_rec.fields.get("worker_local_rank"))
                start = start_rec.timestamp
            else:
                assert own is not None
                node = self.node_of(own)
                rank = own.rank
                local_rank = as_int(own.context.get("local_rank"))
                start = own.timestamp
            if rank is None and own is not None:
                rank = own.rank
            attempt = self.attempt_at(attempts, node, start)
            index = attempt.index if attempt is not None else 0
            pid = key[1] if key[1] is not None and key[1] >= 0 else None
            exit_rec = self._exit_for(exits, used_exits, node, rank=rank, pid=pid,
                                     attempt=attempt)
            if exit_rec is not None:
                used_exits.add(id(exit_rec))
                end = exit_rec.timestamp
                ended_by: Literal["exit", "attempt end", "last event"] = "exit"
            elif attempt is not None and (attempt.index < self._last_index(attempts, node)
                                          or attempt.outcome != "running"):
                # Stopped by its agent (a restart of the group, or the end of the job)
                # without an exit of its own on record.
                end, ended_by = attempt.end, "attempt end"
            else:
                tail = last.get(key)
                end, ended_by = (tail.timestamp if tail is not None else start), "last event"
            if own is not None:
                end = max(end, last[key].timestamp) if ended_by != "exit" else end
            exit_code = (as_int(exit_rec.fields.get("exit_code"))
                         if exit_rec is not None else None)
            if exit_rec is not None and exit_code == 0:
                self.consumed.add(id(exit_rec))
            signal = exit_rec.fields.get("signal") if exit_rec is not None else None
            message = exit_rec.fields.get("message") if exit_rec is not None else None
            self._note_ranks(node, rank)
            runs.append(WorkerRun(
                node=node, rank=rank, attempt=index, start=start, end=max(end, start),
                hostname=key[0], pid=pid, local_rank=local_rank, exit_code=exit_code,
                ended_by=ended_by, exit=exit_rec,
                signal=signal if isinstance(signal, str) else None,
                first_event=own.timestamp if own is not None else None,
                last_event=last[key].timestamp if own is not None else None,
                message=message if isinstance(message, str) else None))
        return runs

    @staticmethod
    def _last_index(attempts: list[Attempt], node: str) -> int:
        return max((a.index for a in attempts if a.node == node), default=0)

    def _exit_for(self, exits: list[Record], used: set[int], node: str, *,
                  rank: int | None, pid: int | None,
                  attempt: Attempt | None) -> Record | None:
        for r in exits:
            if id(r) in used or self.node_of(r) != node:
                continue
            worker_pid = as_int(r.fields.get("worker_pid"))
            if pid is not None and worker_pid is not None:
                if worker_pid == pid:
                    return r
                continue
            if as_int(r.fields.get("worker_id")) != rank:
                continue
            if attempt is None or attempt.start <= r.timestamp <= attempt.end:
                return r
        return None

    def _note_ranks(self, node: str, rank: int | None) -> None:
        if rank is not None and rank not in self.nodes[node].ranks:
            self.nodes[node].ranks.append(rank)
            self.nodes[node].ranks.sort()

    # -- epochs and rendezvous -------------------------------------------------------------
    def _epochs(self, attempts: list[Attempt], runs: list[WorkerRun]) -> list[EpochSpan]:
        open_: dict[tuple[str, int | None, int | None, object], Record] = {}
        spans: list[EpochSpan] = []
        for r in self.records:
            if r.type not in ("EPOCH_START", "EPOCH_END") or "epoch" not in r.fields:
                continue
            epoch = r.fields["epoch"]
            if type(epoch) is not int:
                continue
            key = (r.hostname, r.pid, r.rank, epoch)
            if r.type == "EPOCH_START":
                open_[key] = r
                continue
            begin = open_.pop(key, None)
            if begin is None:
                continue  # an end without a start stays a marker
            node = self.node_of(r)
            attempt = self.attempt_at(attempts, node, begin.timestamp)
            spans.append(EpochSpan(node, r.rank, attempt.index if attempt else 0, epoch,
                                   begin.timestamp, r.timestamp, True))
            self.consumed.update((id(begin), id(r)))
        for begin in open_.values():  # started, never ended: cut at the end of its run
            node = self.node_of(begin)
            run = next((w for w in runs if w.hostname == begin.hostname and w.pid == begin.pid
                        and w.start <= begin.timestamp), None)
            end = run.end if run is not None else begin.timestamp
            attempt = self.attempt_at(attempts, node, begin.timestamp)
            spans.append(EpochSpan(node, begin.rank, attempt.index if attempt else 0,
                                   int(begin.fields["epoch"]), begin.timestamp,
                                   max(end, begin.timestamp), False))
            self.consumed.add(id(begin))
        spans.sort(key=lambda s: (s.start, s.rank or 0))
        return spans

    def _rendezvous(self) -> list[RendezvousSpan]:
        spans = []
        for r in self.records:
            if r.type != "RENDEZVOUS":
                continue
            duration = _duration(r)
            if duration is not None:
                spans.append(RendezvousSpan(self.node_of(r), r.timestamp - duration,
                                            r.timestamp, r))
                if not r.is_failure:
                    self.consumed.add(id(r))
        return spans

    def _drains(self) -> list[DrainSpan]:
        """A span per ``PREEMPTING`` that no earlier drain covers: to the first
        ``AGENT_EXIT`` after it (the job's, group rank 0's, when there is one), else to the
        last event."""
        spans: list[DrainSpan] = []
        last = self.records[-1].timestamp if self.records else 0.0
        for r in self.records:
            if r.type != "PREEMPTING" or (spans and r.timestamp <= spans[-1].end):
                continue
            exits = [e for e in self.records if e.type == "AGENT_EXIT"
                     and e.timestamp >= r.timestamp]
            end = next((e for e in exits if e.group_rank in (0, None)),
                       exits[0] if exits else None)
            spans.append(DrainSpan(r.timestamp, end.timestamp if end is not None else last,
                                   r, end))
        return spans

    def build(self) -> JobView:
        self._assign_nodes()
        attempts = self._attempts()
        runs = self._runs(attempts)
        epochs = self._epochs(attempts, runs)
        rendezvous = self._rendezvous()
        for r in self.records:  # ranks that only ever show up in their own events
            if r.rank is not None:
                self._note_ranks(self.node_of(r), r.rank)
        markers = [Marker(self.node_of(r), self.track_of(r), r.timestamp, r)
                   for r in self.records if id(r) not in self.consumed]
        nodes = sorted(self.nodes.values(), key=lambda n: n.key)
        t0 = min((_start_of(r) for r in self.records), default=0.0)
        t1 = max((r.timestamp for r in self.records), default=t0)
        return JobView(records=self.records, problems=self.problems, t0=t0, t1=t1,
                       nodes=nodes, attempts=attempts, runs=runs, epochs=epochs,
                       rendezvous=rendezvous, markers=markers, consumed=len(self.consumed),
                       drains=self._drains())


def _start_of(r: Record) -> float:
    """When a record's activity began (a rendezvous began ``duration_s`` before it)."""
    if r.type == "RENDEZVOUS":
        duration = _duration(r)
        if duration is not None:
            return r.timestamp - duration
    return r.timestamp


def iter_tracks(view: JobView) -> Iterator[tuple[NodeView, int | Literal["agent"]]]:
    """Every track in display order: per node, its agent then its ranks."""
    for node in view.nodes:
        yield node, AGENT
        for rank in node.ranks:
            yield node, rank


def expand_inputs(command: str, inputs: Sequence[str]) -> list[str] | None:
    """The events files ``inputs`` name for ``eventbus COMMAND``: a directory stands for the
    ``*.jsonl`` files in it (a run's output folder; per-node files merge into one view,
    and one event in two files counts once). ``None``, after saying why on stderr, for a
    path that does not exist or a directory with no ``*.jsonl`` file."""
    files: list[str] = []
    for path in inputs:
        p = Path(path)
        if p.is_dir():
            found = sorted(str(f) for f in p.glob("*.jsonl") if f.is_file())
            if not found:
                print(f"eventbus {command}: {path} is a directory with no *.jsonl file in "
                      "it; pass the file written by `eventbus run --events-jsonl PATH`",
                      file=sys.stderr)
                return None
            print(f"eventbus {command}: {path} is a directory; reading its events files: "
                  f"{', '.join(Path(f).name for f in found)}", file=sys.stderr)
            files.extend(found)
        elif p.is_file():
            files.append(path)
        else:
            print(f"eventbus {command}: {path}: no such file (pass the file written by "
                  "`eventbus run --events-jsonl PATH`, or the folder it is in)",
                  file=sys.stderr)
            return None
    return files


def load_for_command(command: str, inputs: Sequence[str]) -> JobView | None:
    """The job in ``inputs`` for ``eventbus COMMAND``: skipped lines are reported on stderr
    (each with where to look); ``None``, after saying so, when there is no event at all."""
    view = JobView.from_files(inputs)
    for problem in view.problems:
        print(f"eventbus {command}: {problem.describe()}; `eventbus tail {problem.source}` "
              "shows each line", file=sys.stderr)
    if not view.records:
        print(f"eventbus {command}: no events in {', '.join(inputs)}", file=sys.stderr)
        return None
    return view
