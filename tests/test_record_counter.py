"""The record counter: every event a store sender's queue is given, counted in a shared
mapping the agent reads after the sender died (issue 25, item 3; the SIGKILL soak is
tests/reliability/test_sigkill_count.py)."""

from __future__ import annotations

import datetime
import mmap
import os
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import eventbus
from eventbus import ALL
from eventbus import Bus
from eventbus._compiled import speedups
from eventbus.exit_ledger import COUNTER_BYTES
from eventbus.exit_ledger import counter_path
from eventbus.exit_ledger import open_counter
from eventbus.exit_ledger import read_counters
from eventbus.subscribers.queued import QueuedSink

PATHS = ["compiled", "pure"]


def _sink(path: str, **options: Any) -> QueuedSink:
    if path == "compiled" and speedups is None:
        pytest.skip("eventbus._speedups is not built or disabled")
    sink = QueuedSink(lambda batch: None, **options)
    if path == "pure":
        sink._direct = None
    return sink


def _count(mm: mmap.mmap) -> int:
    return int(struct.unpack_from("=Q", mm, 8)[0])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("overflow", ["drop-newest", "drop-oldest"])
def test_every_event_given_is_counted_queued_or_dropped(path: str, overflow: str) -> None:
    mm = mmap.mmap(-1, 16)
    sink = _sink(path, max_events=50, overflow=overflow, flush_interval=60.0)
    sink.count_into(memoryview(mm)[8:16])
    bus = Bus()
    bus.subscribe(ALL, on_event=sink)
    for i in range(300):
        bus.record("METRIC", data={"i": i, "s": "x" * (i % 7)})
    bus.record("METRIC", data={"big": "y" * 2_000_000})  # too large: dropped, counted
    stats = sink.stats()
    assert _count(mm) == 301
    assert _count(mm) == stats["enqueued"] + sum(stats["dropped"].values()) - (
        stats["dropped"].get("queue full", 0) if overflow == "drop-oldest" else 0)
    sink.close(1.0)
    bus.record("METRIC")  # after close: dropped ("closed"), still counted
    assert _count(mm) == 302
    sink.count_into(None)
    bus.record("METRIC")
    assert _count(mm) == 302


@pytest.mark.parametrize("path", PATHS)
def test_a_forked_child_does_not_count_into_its_parents_counter(path: str) -> None:
    mm = mmap.mmap(-1, 16)  # anonymous, shared: the child's writes would show here
    sink = _sink(path, flush_interval=60.0)
    sink.count_into(memoryview(mm)[8:16])
    bus = Bus()
    bus.subscribe(ALL, on_event=sink)
    bus.record("METRIC")
    pid = os.fork()
    if pid == 0:
        try:
            for _ in range(10):
                bus.record("METRIC")
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert _count(mm) == 1
    sink.close(1.0)


def test_count_into_refuses_a_short_buffer() -> None:
    sink = QueuedSink(lambda batch: None)
    with pytest.raises(ValueError, match="8 contiguous bytes"):
        sink.count_into(memoryview(bytearray(4)))
    if speedups is not None:
        direct = sink._eventbus_direct()
        with pytest.raises(ValueError, match="aligned"):
            direct.count_into(memoryview(bytearray(16))[1:9])  # type: ignore[attr-defined]
    sink.close(0.5)


def test_a_counter_survives_its_writer_and_hostile_files_are_refused(tmp_path: Path) -> None:
    counter = open_counter(str(tmp_path), "w0:host:1:ab", "run/0/w0")
    assert os.path.getsize(counter.path) == COUNTER_BYTES
    counter.view.cast("Q")[0] = 1234
    (tmp_path / "garbage.count").write_bytes(b"x" * COUNTER_BYTES)
    (tmp_path / "huge.count").write_bytes(b"EBCOUNT1" + bytes(COUNTER_BYTES))
    os.symlink("/dev/zero", tmp_path / "zero.count")
    raw = Path(counter.path).read_bytes()
    (tmp_path / "renamed.count").write_bytes(raw)  # a file not named after its sender
    (tmp_path / "w9.count.123.tmp").write_bytes(raw)  # a leftover temporary: ignored
    counts, refused = read_counters(str(tmp_path))
    assert [(c.sender, c.key, c.recorded) for c in counts] == [
        ("w0:host:1:ab", "run/0/w0", 1234)]
    assert sum(refused.values()) == 4, refused
    assert counter_path(str(tmp_path), "w0:host:1:ab") == counter.path


def test_a_failed_counter_leaves_no_temporary_and_close_unmaps(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """open_counter removes its temporary when mapping fails; close() unmaps, keeps the
    file and the last value, and may be called again."""
    counter = open_counter(str(tmp_path), "w0:host:1:ab", "run/0/w0")
    counter.view.cast("Q")[0] = 7
    counter.close()
    counter.close()
    assert counter.closed and counter.value == 7
    assert read_counters(str(tmp_path))[0][0].recorded == 7

    def no_map(*args: Any, **kwargs: Any) -> mmap.mmap:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", no_map)  # the module eventbus.exit_ledger maps with
    with pytest.raises(OSError, match="Cannot allocate"):
        open_counter(str(tmp_path), "w1:host:1:ab", "run/0/w1")
    assert sorted(p.name for p in tmp_path.iterdir()) == [Path(counter.path).name]


@pytest.fixture
def store() -> Iterator[Any]:
    torch_dist = pytest.importorskip("torch.distributed")
    store = torch_dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                timeout=datetime.timedelta(seconds=10))
    yield store
    del store  # TCPStore has no close(): its server stops with the last reference


def test_the_agent_reports_what_a_dead_sender_had_queued_from_its_counter(
        store: Any) -> None:
    """A sender whose queue's thread is stuck in a push (as if SIGKILLed then: no close,
    no ledger, no end marker): the agent reports exactly what it recorded and did not
    deliver, once."""
    from eventbus.app.launcher.transport.store import StoreTransport
    from eventbus.app.plugins import RendezvousInfo
    from eventbus.exit_ledger import ENV_LEDGER_DIR
    from eventbus.subscribers.store_forwarder import StoreForwarder
    from eventbus.wire import ENV_PREFIX
    from eventbus.wire import worker_key

    agent_bus = Bus("agent")
    got: list[eventbus.Event] = []
    agent_bus.subscribe(ALL, on_event=got.append)
    agent = StoreTransport(linger=0.5)
    info = RendezvousInfo(store_host="127.0.0.1", store_port=store.port, run_id="job",
                          group_rank=0, group_world_size=1, restart_count=0,
                          local_world_size=1, world_size=1, global_ranks=(0,), bus=agent_bus)
    env = agent.after_rendezvous(info)
    fwd = StoreForwarder(host="127.0.0.1", port=store.port,
                         key=worker_key(env[ENV_PREFIX], 0), rank=0, bus=Bus("w0"),
                         ledger_dir=env[ENV_LEDGER_DIR], max_batch=100)
    stuck = threading.Event()
    exited = False
    try:
        for i in range(250):
            fwd.bus.record("METRIC", data={"i": i})
        assert fwd.flush(10.0)
        fwd.sink.handle_batch = lambda batch: stuck.wait(30)  # the thread hangs in a push
        for i in range(250, 1000):
            fwd.bus.record("METRIC", data={"i": i})
        assert fwd.counter is not None and fwd.counter.value == 1000
        agent.before_exit(timeout=5.0)
        exited = True
        stuck.set()
        delivered = [e for e in got if e.type == eventbus.EventType.METRIC]
        lost = [e for e in got if isinstance(e, eventbus.EventsLost)]
        assert len(delivered) == 250
        assert [(e.count, e.data["from"]) for e in lost] == [(750, "record counter")]
        assert "still queued" in lost[0].reason
        assert agent.ledger_stats["counters"] == 1
        fwd.close(1.0)
        assert fwd.counter.closed  # close() unmapped it
    finally:
        stuck.set()
        if not exited:  # a failure above: the agent's receiver still runs
            agent.before_exit(timeout=5.0)
        fwd.close(1.0)  # idempotent
