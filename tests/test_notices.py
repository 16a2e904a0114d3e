"""Job-wide notices (eventbus/app/protocol/notices.py, eventbus/app/worker/notices.py,
eventbus/app/launcher/notices.py) over a real TCPStore: what is a notice, what is stale,
each notice heard once from where the attempt began, each subscriber on its own thread (a
blocking or raising one costs only itself), the process's own sinks left out, a closed
ear leaves its store call at once."""

from __future__ import annotations

import contextlib
import datetime
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

import eventbus
import eventbus.context as context_module
from eventbus import Bus
from eventbus import EventType
from eventbus.app.launcher.drain.notices import NoticeBoard
from eventbus.app.plugins import RendezvousInfo
from eventbus.app.protocol import notices as log
from eventbus.app.worker.notices import NoticeReader
from eventbus.app.worker.notices import local_only
from eventbus.context import set_context
from eventbus.events import Preempting
from eventbus.events import WorkerExit
from eventbus.events import WorkerSlow
from eventbus.events import WorkerStalled
from eventbus.subscribers.queued import QueuedSink

torch_dist = pytest.importorskip("torch.distributed")

ROOT = "eventbus/notices/test-run"


@contextlib.contextmanager
def _context(**fields: Any) -> Iterator[None]:
    """Events made inside carry these context fields; the context is restored after."""
    saved = context_module._holder.value
    set_context(**fields)
    try:
        yield
    finally:
        context_module._holder.value = saved


@pytest.fixture
def store() -> Iterator[Any]:
    server = torch_dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                 timeout=datetime.timedelta(seconds=10))
    yield server


def _client(store: Any) -> Any:
    return torch_dist.TCPStore("127.0.0.1", store.port, is_master=False,
                               wait_for_workers=False, timeout=datetime.timedelta(seconds=10))


def _wait_for(predicate: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return bool(predicate())


def _exit(rank: int, code: int = 1, **data: Any) -> WorkerExit:
    return WorkerExit(worker_id=rank, exit_code=code, data=data)


def test_which_events_are_notices() -> None:
    assert log.is_notice(Preempting(deadline_s=5.0, reason="SIGTERM on node 0"))
    assert log.is_notice(_exit(1, 1))
    assert log.is_notice(WorkerStalled(worker_id=1, silent_s=9.0))
    assert log.is_notice(WorkerSlow(worker_id=1, factor=3.0))
    assert not log.is_notice(_exit(1, 0))  # a success is no news to the peers
    assert not log.is_notice(_exit(1, -15, stopped_by_agent=True))  # a consequence
    assert not log.is_notice(WorkerExit(worker_id=1, exit_code=0))
    assert not log.is_notice(eventbus.Metric(step=1))


def test_a_notice_about_an_earlier_attempt_is_stale_a_drain_never() -> None:
    with _context(restart_count=0):
        old = _exit(1)
        drain = Preempting(deadline_s=5.0, reason="x")
    assert log.stale(old, 1) and not log.stale(old, 0) and not log.stale(old, None)
    assert not log.stale(drain, 3)


def test_append_then_read_in_order(store: Any) -> None:
    client = _client(store)
    assert log.head(client, ROOT) == 0
    seqs = [log.append(client, ROOT, _exit(r)) for r in range(3)]
    assert seqs == [1, 2, 3] and log.head(client, ROOT) == 3
    back = [log.read_entry(client, ROOT, s, timeout=1.0) for s in seqs]
    assert [e.worker_id for e in back if isinstance(e, WorkerExit)] == [0, 1, 2]
    assert log.read_entry(client, ROOT, 4, timeout=0.2) is None  # nothing yet: None


def _reader(store: Any, bus: Bus, *, start_after: int = 0, attempt: int | None = 0,
            rank: int = 0, world: int = 1) -> NoticeReader:
    reader = NoticeReader(host="127.0.0.1", port=store.port, root=ROOT,
                          start_after=start_after, rank=rank, world_size=world,
                          attempt=attempt, bus=bus)
    reader.start()
    return reader


def test_each_notice_once_from_where_the_attempt_began(store: Any) -> None:
    """A reader hears the notices after its start position, each once, in order; not the
    ones before it, not a late report about an earlier attempt."""
    writer = _client(store)
    log.append(writer, ROOT, _exit(7))  # before this attempt: not heard
    bus = Bus("worker")
    heard: list[int] = []
    bus.subscribe(EventType.WORKER_EXIT, on_event=lambda e: heard.append(e.worker_id))
    reader = _reader(store, bus, start_after=log.head(writer, ROOT), attempt=1)
    try:
        with _context(restart_count=0):
            late = _exit(8)  # attempt 0's failure, reported after attempt 1 began
        log.append(writer, ROOT, late)
        with _context(restart_count=1):  # this attempt's (whatever earlier tests set)
            for rank in (1, 2):
                log.append(writer, ROOT, _exit(rank))
        assert _wait_for(lambda: heard == [1, 2]), heard
        time.sleep(0.1)
        assert heard == [1, 2]
        assert reader.stats["stale"] == 1 and reader.stats["heard"] == 3
    finally:
        reader.close()


def test_a_notice_arrives_within_a_second_with_the_context_of_whom_it_is_about(
        store: Any) -> None:
    writer = _client(store)
    bus = Bus("worker")
    got: list[tuple[float, Any]] = []
    bus.subscribe(EventType.WORKER_STALLED, on_event=lambda e: got.append((time.time(), e)))
    reader = _reader(store, bus)
    try:
        time.sleep(0.3)  # the reader is in its wait
        with _context(rank=5, group_rank=2):
            event = WorkerStalled(worker_id=5, silent_s=12.0)
        sent = time.time()
        log.append(writer, ROOT, event)
        assert _wait_for(lambda: bool(got), 5.0)
        at, heard = got[0]
        assert at - sent < 1.0, at - sent
        assert heard.worker_id == 5 and heard.context.rank == 5
        assert heard.context.group_rank == 2 and heard.context.pid == os.getpid()
    finally:
        reader.close()


def test_a_blocking_or_raising_subscriber_costs_only_itself(store: Any) -> None:
    """Subscribers in order: one that blocks forever on its first notice, one that raises,
    one that records. The third hears both notices; the first's later notice waits for it
    alone; the raise is counted, not spread."""
    writer = _client(store)
    bus = Bus("worker")
    release = threading.Event()
    blocked: list[int] = []
    heard: list[int] = []

    def block(event: Any) -> None:
        blocked.append(event.worker_id)
        release.wait(30)

    def boom(event: Any) -> None:
        raise RuntimeError("subscriber bug")

    bus.subscribe(EventType.WORKER_EXIT, on_event=block)
    bus.subscribe(EventType.WORKER_EXIT, on_event=boom)
    bus.subscribe(EventType.WORKER_EXIT, on_event=lambda e: heard.append(e.worker_id))
    reader = _reader(store, bus)
    try:
        log.append(writer, ROOT, _exit(1))
        log.append(writer, ROOT, _exit(2))
        assert _wait_for(lambda: heard == [1, 2]), heard
        assert blocked == [1]  # still in its first notice
        release.set()
        assert _wait_for(lambda: blocked == [1, 2])
        failed = [s for s in bus.stats()["subscribers"] if s.get("failed")]
        assert failed and failed[0]["failed"] == 2
    finally:
        release.set()
        reader.close()


def test_the_processes_own_sinks_and_marked_subscribers_hear_no_notice(store: Any) -> None:
    writer = _client(store)
    bus = Bus("worker")
    sunk: list[Any] = []
    sink = QueuedSink(sunk.extend, name="own-sink")
    counted: list[Any] = []
    heard: list[Any] = []
    bus.subscribe(eventbus.ALL, on_event=sink)
    bus.subscribe(eventbus.ALL, on_event=local_only(counted.append))
    bus.subscribe(eventbus.ALL, on_event=heard.append)
    reader = _reader(store, bus)
    try:
        log.append(writer, ROOT, _exit(3))
        assert _wait_for(lambda: len(heard) == 1)
        sink.flush(2.0)
        assert not sunk and not counted
    finally:
        sink.close()
        reader.close()


def test_close_ends_the_wait_at_once_and_the_others_hear_on(store: Any) -> None:
    """The ear blocks in the store's wait (no wake-up). close() puts a leaving mark where
    it waits, so the wait returns as for a notice (c10d prints nothing, the thread leaves
    torch's C++ code now); another reader waiting there skips the mark, and the next
    notice goes to the next seq."""
    writer = _client(store)
    leaving, staying = Bus("leaving"), Bus("staying")
    heard: list[int] = []
    staying.subscribe(EventType.WORKER_EXIT, on_event=lambda e: heard.append(e.worker_id))
    first = _reader(store, leaving)
    second = _reader(store, staying)
    try:
        assert _wait_for(lambda: first._ear is not None and second._ear is not None)
        time.sleep(0.2)
        started = time.monotonic()
        first.close(timeout=5.0)
        assert not first.alive
        assert time.monotonic() - started < 2.0
        assert first._ear is not None and not first._ear.shut_down  # woken, not cut off
        assert bytes(writer.get(log.entry_key(ROOT, 1))) == log.LEFT
        assert log.append(writer, ROOT, _exit(6)) == 2  # seq 1 is the mark's
        assert _wait_for(lambda: heard == [6]), heard
        assert second.stats["heard"] == 1  # the mark is no notice
    finally:
        second.close()


def test_a_gap_left_by_a_dead_writer_is_skipped(store: Any) -> None:
    """An agent that died between its add and its set leaves a seq that never comes; a
    later notice proves it and the reader moves on (after one wait)."""
    writer = _client(store)
    writer.add(log.counter_key(ROOT), 1)  # seq 1 taken, never written
    log.append(writer, ROOT, _exit(4))  # seq 2
    bus = Bus("worker")
    heard: list[int] = []
    bus.subscribe(EventType.WORKER_EXIT, on_event=lambda e: heard.append(e.worker_id))
    reader = NoticeReader(host="127.0.0.1", port=store.port, root=ROOT, start_after=0,
                          rank=0, world_size=1, attempt=0, bus=bus)
    original = log.read_entry

    def short_wait(client: Any, root: str, seq: int, *, timeout: float = 0.0) -> Any:
        return original(client, root, seq, timeout=0.3)

    import eventbus.app.worker.notices as worker_notices
    worker_notices.log.read_entry = short_wait  # type: ignore[assignment]
    try:
        reader.start()
        assert _wait_for(lambda: heard == [4], 10.0), heard
        assert reader.stats["gaps"] == 1
    finally:
        worker_notices.log.read_entry = original  # type: ignore[assignment]
        reader.close()


def _info(store: Any, bus: Bus, *, group_rank: int = 0, nodes: int = 1) -> RendezvousInfo:
    return RendezvousInfo(store_host="127.0.0.1", store_port=store.port, run_id="test-run",
                          group_rank=group_rank, group_world_size=nodes, restart_count=0,
                          local_world_size=1, world_size=nodes, global_ranks=(group_rank,),
                          bus=bus)


def test_the_board_tells_its_own_decisions_only_and_gives_the_head(store: Any) -> None:
    """The agent's board appends this agent's failures, stalls, stragglers and drains,
    not its workers' own events nor a success; the env names the root and the head."""
    bus = Bus("agent")
    board = NoticeBoard()
    env = board.after_rendezvous(_info(store, bus))
    try:
        assert env == {log.ENV_NOTICES: ROOT, log.ENV_NOTICE_FROM: "0"}
        bus.publish(_exit(1))
        bus.publish(_exit(0, 0))
        bus.publish(WorkerSlow(worker_id=1, factor=2.5))
        with _context(pid=os.getpid() + 1):  # a worker's event republished here
            bus.publish(_exit(2))
        assert board.flush(5.0)
        client = _client(store)
        assert log.head(client, ROOT) == 2
        told = [log.read_entry(client, ROOT, s, timeout=1.0) for s in (1, 2)]
        assert [type(e).__name__ for e in told] == ["WorkerExit", "WorkerSlow"]
        again = board.after_rendezvous(_info(store, bus))
        assert again[log.ENV_NOTICE_FROM] == "2"  # the next attempt hears what comes next
    finally:
        board.before_exit(timeout=2.0)


def test_another_nodes_drain_reaches_this_agent(store: Any) -> None:
    """Two boards (two nodes): node 1's PREEMPTING reaches node 0's on_drain, with its
    seq; node 1 does not hear its own."""
    heard: dict[int, list[Any]] = {0: [], 1: []}
    boards = {}
    buses = {n: Bus(f"agent{n}") for n in (0, 1)}
    for node in (0, 1):
        boards[node] = NoticeBoard(on_drain=lambda e, seq, n=node: heard[n].append((e, seq)))
        boards[node].after_rendezvous(_info(store, buses[node], group_rank=node, nodes=2))
    try:
        time.sleep(0.3)
        buses[1].publish(Preempting(deadline_s=20.0, reason="SIGTERM on node 1",
                                    signal="SIGTERM", node=1))
        assert _wait_for(lambda: bool(heard[0]), 5.0)
        event, seq = heard[0][0]
        assert event.node == 1 and seq == 1 and boards[1].drain_seq == 1
        time.sleep(0.2)
        assert not heard[1]
    finally:
        for board in boards.values():
            board.before_exit(timeout=2.0)
