"""The agent half of the store transport: the plugin that brings every worker's events (and
every other node's) onto the agent's bus.

Two-level fan-in over the job's long-lived c10d store (the wire format is
:mod:`eventbus.wire`):

* every agent drains the queues of its own workers (one per global rank and attempt) with a
  :class:`eventbus.publishers.store_receiver.StoreReceiver` and republishes on its bus (its JSONL,
  logging handler and reactors see worker events), and points its workers' forwarders at
  the store through their environment;
* the agent of every other node forwards what ``job_events`` selects of its bus to one
  queue per node (a :class:`eventbus.subscribers.store_forwarder.StoreForwarder` of kind ``"n"``);
  the agent of group rank 0 drains those, one queue per node, so that its bus holds the
  job-wide view.

The exit ledger (what does not depend on the store): each attempt's workers get a local
directory of this agent's (``EVENTBUS_LEDGER_DIR``) where each leaves, at exit, what it
numbered and dropped (:class:`eventbus.exit_ledger.ExitLedger`). Before the agent exits it reads
them, and for every sender whose end marker never arrived it publishes what never reached
it as ``EVENTS_LOST``: the store died, yet the loss is reported and true.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import attrs

from eventbus.app.plugins import RendezvousInfo
from eventbus.events import Event
from eventbus.events import EventType
from eventbus.events import event_class
from eventbus.exit_ledger import ENV_LEDGER_DIR
from eventbus.exit_ledger import ExitLedger
from eventbus.exit_ledger import read_counters
from eventbus.exit_ledger import read_ledgers
from eventbus.publishers.store_receiver import StoreReceiver
from eventbus.subscribers.queued import backlogged
from eventbus.subscribers.store_forwarder import StoreForwarder
from eventbus.wire import ENV_BELL
from eventbus.wire import ENV_PREFIX
from eventbus.wire import ENV_STORE
from eventbus.wire import ack_key
from eventbus.wire import bell_key
from eventbus.wire import namespace
from eventbus.wire import node_key
from eventbus.wire import worker_key

__all__ = ["ENV_JOB_EVENTS", "StoreTransport", "TransportSettings", "job_event_filter"]

logger = logging.getLogger("eventbus")

#: which event types the other nodes forward to group rank 0 (see :func:`job_event_filter`)
ENV_JOB_EVENTS = "EVENTBUS_JOB_EVENTS"


def _is_builtin(event: Event) -> bool:
    return type(type(event).type) is EventType


def job_event_filter(spec: str | None = None) -> Callable[[Event], bool]:
    """The predicate selecting what a node forwards to group rank 0.

    ``spec`` (default: ``$EVENTBUS_JOB_EVENTS``, else ``"builtin"``) is a comma-separated
    list: ``builtin`` (every built-in type), ``all`` (every type), type names to add, and
    ``-NAME`` to keep a type on its node. A spec of only exclusions starts from
    ``builtin``: ``EVENTBUS_JOB_EVENTS=-METRIC`` keeps per-step metrics local.
    """
    text = os.environ.get(ENV_JOB_EVENTS, "builtin") if spec is None else spec
    tokens = [t.strip() for t in text.split(",") if t.strip()]
    exclude = frozenset(t[1:] for t in tokens if t.startswith("-"))
    include = [t for t in tokens if not t.startswith("-")] or ["builtin"]
    every = "all" in include
    builtin = "builtin" in include
    names = frozenset(t for t in include if t not in ("all", "builtin"))
    for name in names | exclude:
        event_class(name)  # an unknown name is a typo: say so now (ValueError naming it)

    def select(event: Event) -> bool:
        name = str(type(event).type)
        if name in exclude:
            return False
        return every or name in names or (builtin and _is_builtin(event))

    return select


@attrs.frozen(kw_only=True)
class TransportSettings:
    """How often the agent's receivers poll, and how long they wait."""

    #: a worker queue that gave nothing is polled again after this, doubling while idle...
    poll_interval: float = 0.01
    #: ... up to this many seconds apart
    max_idle_interval: float = 0.5
    #: the same for the other nodes' queues, on group rank 0, whose receiver pops them
    #: pipelined (one write for a round's pops, ~1 us of its CPU per idle poll, not a
    #: store round trip of ~30 us; docs/scale.md) ...
    job_poll_interval: float = 0.02
    job_max_idle_interval: float = 0.25
    #: ... the first of which grows with the nodes, so that its one thread makes about
    #: this many polls a second while every queue is busy (idle queues back off) ...
    job_polls_per_s: float = 16384.0
    #: ... but never polls a queue less often than this (the heartbeat's latency)
    job_max_poll_interval: float = 0.25
    #: a finished attempt's queues are drained until they have been empty this long
    linger: float = 30.0
    #: the budget of a receiver's connect to the store
    connect_timeout: float = 30.0


class StoreTransport:
    """The agent plugin: worker queues -> this agent's bus; other nodes -> group rank 0.

    ``job_events`` selects what a node other than group rank 0 forwards (see
    :func:`job_event_filter`); keyword ``settings`` are fields of
    :class:`TransportSettings` (``StoreTransport(linger=5.0)``).
    """

    def __init__(
        self,
        *,
        job_events: Callable[[Event], object] | str | None = None,
        **settings: float,
    ) -> None:
        self.settings = TransportSettings(**settings)
        if callable(job_events):
            self.job_filter: Callable[[Event], object] = job_events
        else:
            try:
                self.job_filter = job_event_filter(job_events)
            except ValueError as exc:
                # A typo must not cost the job its worker events: say so, keep the default.
                logger.error("%s: %s; forwarding every built-in type to group rank 0 instead",
                             ENV_JOB_EVENTS, exc)
                self.job_filter = job_event_filter("builtin")
        self.info: RendezvousInfo | None = None
        self.receiver: StoreReceiver | None = None
        self.job_receiver: StoreReceiver | None = None
        self.job_forwarder: StoreForwarder | None = None
        self._node_ends: set[str] = set()
        self._lock = threading.Lock()
        #: this agent's exit-ledger directory, and per attempt: (its folder, its queues)
        self.ledger_root: str | None = None
        self._ledger_dirs: dict[int, tuple[str, frozenset[str]]] = {}
        #: ledgers read, senders settled from them, events reported, files refused
        self.ledger_stats: dict[str, Any] = {"read": 0, "counters": 0, "settled": 0,
                                             "reported": 0, "refused": {}}

    # -- AgentPlugin ----------------------------------------------------------------------
    def after_rendezvous(self, info: RendezvousInfo) -> Mapping[str, str]:
        """Watch this attempt's worker queues (and node queues on group rank 0); return the
        workers' environment that points their forwarders at the store."""
        with self._lock:
            previous, self.info = self.info, info
            prefix = namespace(info.run_id, info.restart_count)
            if self.receiver is None:
                # The workers ring this receiver's doorbell after each push: their batches
                # are popped at once, not at the next poll of a backed-off queue.
                bell = bell_key(info.run_id, secrets.token_hex(8))
                self.receiver = self._start_receiver(info, self.settings.poll_interval,
                                                     self.settings.max_idle_interval,
                                                     bell=bell)
            receiver = self.receiver
            self._retire_all(receiver)
            for rank in info.global_ranks:
                receiver.watch(worker_key(prefix, rank), kind="w", rank=rank)
            if info.group_rank == 0:
                self._close_job_forwarder(timeout=1.0)
                self._watch_nodes(info, prefix)
            else:
                self._forward_job_view(info, prefix, previous)
            env = {ENV_STORE: f"{info.store_host}:{info.store_port}", ENV_PREFIX: prefix}
            if receiver.bell is not None:
                env[ENV_BELL] = receiver.bell
            ledger_dir = self._ledger_dir(info, prefix)
            if ledger_dir is not None:
                env[ENV_LEDGER_DIR] = ledger_dir
            return env

    def _ledger_dir(self, info: RendezvousInfo, prefix: str) -> str | None:
        # One folder per attempt: a restarted attempt's workers never meet the ledgers
        # of the attempt before, and each ledger is checked against its attempt's queues.
        try:
            if self.ledger_root is None:
                self.ledger_root = tempfile.mkdtemp(prefix="eventbus-ledgers-")
            path = os.path.join(self.ledger_root, f"attempt-{info.restart_count}")
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            logger.warning("store transport: no exit-ledger directory (%s); a loss the store "
                           "cannot report will not be reported", exc)
            return None
        keys = frozenset(worker_key(prefix, rank) for rank in info.global_ranks)
        self._ledger_dirs[info.restart_count] = (path, keys)
        return path

    def drain(self, *, timeout: float) -> None:
        """Pull in what the workers pushed before the monitor saw them fail (the launcher
        calls this before it publishes a failure), so reactors such as
        ``StopOnNonFiniteLoss`` judge a failure with the workers' last events on the bus."""
        receiver = self.receiver
        if receiver is not None:
            receiver.drain(timeout=timeout)

    def before_exit(self, *, timeout: float) -> None:
        """Drain the workers' queues; forward the rest of this node's view to group rank 0
        and wait for its acknowledgement (other nodes), or wait for every node's last push
        (group rank 0); all within ``timeout``. Then the exit ledgers' folder is removed,
        whatever happened."""
        deadline = time.monotonic() + timeout
        try:
            with self._lock:
                info = self.info
                receiver = self.receiver
                if receiver is None or info is None:
                    return
                receiver.stop()
                # Alone, the workers' queues get the whole budget; with other nodes, half of
                # it, the rest goes to the job-wide handshake.
                share = 1.0 if info.group_world_size == 1 else 0.5
                receiver.drain(timeout=max(0.0, (deadline - time.monotonic()) * share))
                # a queue whose sender left an exit ledger is counted from it, in events (the
                # pushes left in the store included); the others as pushes left in the store
                ledgers = self._read_ledgers()
                receiver.report_leftovers(counted_elsewhere={
                    ledger.key for path, (found, _) in ledgers.items()
                    for ledger in found if ledger.key in self._ledger_dirs[path][1]})
                if info.group_rank != 0 and self.job_forwarder is not None:
                    self._finish_job_view(deadline)
                job = self.job_receiver
                if job is not None:
                    job.stop()
                    self._wait_for_nodes(info, job, deadline)
                    job.report_leftovers()
                    job.close()
                receiver.close()
                settled = self._settle_from_ledgers(receiver, ledgers)
                for sender in receiver.unended():
                    if sender in settled:
                        continue
                    logger.warning("store receiver: %s never sent its end marker and left no "
                                   "exit ledger nor record counter: the events it queued last "
                                   "may be lost, uncounted", sender)
        finally:  # read or not: the folder goes (an error, a second signal)
            self._remove_ledgers()

    def _read_ledgers(self) -> dict[int, tuple[list[ExitLedger], dict[str, int]]]:
        """Every attempt's exit ledgers, and its files refused per reason (read once, at
        exit: they decide both what is reported as left in the store and what is settled).
        Never raises."""
        out: dict[int, tuple[list[ExitLedger], dict[str, int]]] = {}
        for attempt, (path, _) in sorted(self._ledger_dirs.items()):
            try:
                out[attempt] = read_ledgers(path)
            except Exception:
                logger.exception("store transport: reading the exit ledgers in %s failed",
                                 path[:200])
        return out

    def _settle_from_ledgers(self, receiver: StoreReceiver, read: dict[
            int, tuple[list[ExitLedger], dict[str, int]]]) -> set[str]:
        """From every attempt's exit ledgers (``read``) and record counters, report, per
        sender whose end marker never arrived, what it recorded, numbered or dropped that
        did not arrive. Never raises."""
        settled: set[str] = set()
        stats = self.ledger_stats
        refused: dict[str, int] = stats["refused"]
        try:
            unreachable = receiver.client is None or receiver.store_errors > 0
            why = ("the store was unreachable (from the sender's exit ledger)" if unreachable
                   else "no end marker reached the agent (from the sender's exit ledger)")
            for attempt, (path, keys) in sorted(self._ledger_dirs.items()):
                ledgers, bad = read.get(attempt, ([], {}))
                for reason, n in bad.items():
                    refused[reason] = refused.get(reason, 0) + n
                for ledger in ledgers:
                    stats["read"] += 1
                    if ledger.key not in keys:
                        refused["ledger: not a queue of its attempt"] = refused.get(
                            "ledger: not a queue of its attempt", 0) + 1
                        continue
                    # its queue's pushes still in the store, if any, were not reported
                    # as such (report_leftovers was told of this ledger): counted here
                    reported = receiver.settle(ledger, why=why)
                    settled.add(ledger.sender)
                    if reported:
                        stats["settled"] += 1
                        stats["reported"] += reported
                # Then the record counters: what a sender had queued when it died
                # (SIGKILL: no ledger), or recorded after its ledger was written.
                counts, bad = read_counters(path)
                for reason, n in bad.items():
                    refused[reason] = refused.get(reason, 0) + n
                for count in counts:
                    stats["counters"] += 1
                    if count.key not in keys:
                        refused["counter: not a queue of its attempt"] = refused.get(
                            "counter: not a queue of its attempt", 0) + 1
                        continue
                    if count.key in receiver.leftovers:
                        settled.add(count.sender)
                        continue
                    reported = receiver.settle_count(count, why=(
                        "recorded, still queued in the sender when it died "
                        "(from its record counter)"))
                    settled.add(count.sender)
                    if reported:
                        stats["settled"] += 1
                        stats["reported"] += reported
        except Exception:
            logger.exception("store transport: reading the exit ledgers failed")
        if refused:
            logger.warning("store transport: exit ledgers refused: %s", refused)
        return settled

    def _remove_ledgers(self) -> None:
        root, self.ledger_root = self.ledger_root, None
        self._ledger_dirs.clear()
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)

    def _start_receiver(self, info: RendezvousInfo, poll_interval: float,
                        max_idle_interval: float,
                        on_end: Callable[[str, str], object] | None = None,
                        bell: str | None = None, pipelined: bool = False) -> StoreReceiver:
        # hold: a flood waits in the store while the JSONL file's queue is half full, so
        # that the job's record loses nothing to a writer that is merely slower
        receiver = StoreReceiver(bus=info.bus, host=info.store_host, port=info.store_port,
                                 connect_timeout=self.settings.connect_timeout,
                                 poll_interval=poll_interval,
                                 max_idle_interval=max_idle_interval, on_end=on_end, bell=bell,
                                 hold=backlogged, pipelined=pipelined)
        receiver.start()
        return receiver

    def _retire_all(self, receiver: StoreReceiver) -> None:
        # The previous attempt's queues: drained until they have been empty for `linger`.
        for key in receiver.queues():
            receiver.retire(key, after=self.settings.linger)

    # -- job-wide view ------------------------------------------------------------------
    def job_poll_interval(self, nodes: int) -> float:
        """How often group rank 0 polls each other node's queue in a job of ``nodes``."""
        settings = self.settings
        return min(max(settings.job_poll_interval, nodes / settings.job_polls_per_s),
                   max(settings.job_poll_interval, settings.job_max_poll_interval))

    def _watch_nodes(self, info: RendezvousInfo, prefix: str) -> None:
        interval = self.job_poll_interval(info.group_world_size)
        idle = max(interval, self.settings.job_max_idle_interval)
        if self.job_receiver is None:
            if info.group_world_size == 1:
                return  # a single node: no other node's view to receive
            self.job_receiver = self._start_receiver(info, interval, idle,
                                                     on_end=self._on_node_end, pipelined=True)
        job = self.job_receiver
        job.poll_interval, job.max_idle_interval = interval, idle  # the nodes may change
        self._retire_all(job)
        for group_rank in range(1, info.group_world_size):
            job.watch(node_key(prefix, group_rank), kind="n", rank=group_rank)
        self._node_ends.clear()

    def _on_node_end(self, key: str, sender: str) -> None:
        self._node_ends.add(key)
        job = self.job_receiver
        if job is not None:
            try:
                job.client.set(ack_key(key, sender), "1")
            except Exception as exc:
                logger.warning("store receiver: cannot acknowledge %s on %s: %s", sender, key,
                               exc)

    def _wait_for_nodes(self, info: RendezvousInfo, job: StoreReceiver,
                        deadline: float) -> None:
        prefix = namespace(info.run_id, info.restart_count)
        expected = {node_key(prefix, g) for g in range(1, info.group_world_size)}
        while True:
            popped = job.drain_once(every=True)
            if expected <= self._node_ends and popped == 0:
                return
            if time.monotonic() >= deadline:
                missing = sorted(expected - self._node_ends)
                if missing:
                    logger.warning("store receiver: no end marker from %s before the agent's "
                                   "exit deadline; their last events may be missing", missing)
                return
            if not popped:
                time.sleep(0.01)

    def _forward_job_view(self, info: RendezvousInfo, prefix: str,
                          previous: RendezvousInfo | None) -> None:
        key = node_key(prefix, info.group_rank)
        fwd = self.job_forwarder
        if fwd is not None and previous is not None and previous.group_rank == info.group_rank:
            with fwd._client_lock:
                fwd.key = key
            return
        self._close_job_forwarder(timeout=1.0)
        self.job_forwarder = StoreForwarder(
            host=info.store_host, port=info.store_port, key=key, rank=info.group_rank,
            kind="n", bus=info.bus, where=self.job_filter,
            connect_timeout=self.settings.connect_timeout, flush_interval=0.05)

    def _close_job_forwarder(self, *, timeout: float) -> None:
        fwd, self.job_forwarder = self.job_forwarder, None
        if fwd is not None:
            fwd.close(timeout)

    def _finish_job_view(self, deadline: float) -> None:
        fwd = self.job_forwarder
        if fwd is None:
            return
        fwd.close(max(0.0, (deadline - time.monotonic()) / 2))
        acked = ack_key(fwd.key, fwd.sender)
        client = fwd._client
        while client is not None and time.monotonic() < deadline:
            try:
                if client.check([acked]):
                    return
            except Exception:
                break
            time.sleep(0.02)
        logger.warning("store transport: group rank 0 did not acknowledge this node's last "
                       "push (%s) in time; its last events may be missing from the job view",
                       fwd.key)

    def stats(self) -> dict[str, Any]:
        """The receivers' and the job forwarder's statistics."""
        return {
            "workers": self.receiver.stats() if self.receiver else None,
            "nodes": self.job_receiver.stats() if self.job_receiver else None,
            "job_forwarder": self.job_forwarder.stats() if self.job_forwarder else None,
            "ledgers": {**self.ledger_stats, "refused": dict(self.ledger_stats["refused"])},
        }

