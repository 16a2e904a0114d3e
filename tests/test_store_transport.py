"""The store transport in one process: forwarder -> real TCPStore -> receiver.

Pins the wire format, batching, per-sender numbering with gap/duplicate/drop reports,
decode validation and limits (reliability row 19), non-blocking pops on the receiver's own
client (row 21), and the two-level fan-in of the agent plugin.
"""

from __future__ import annotations

import datetime
import itertools
import json
import math
import os
import pickle
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import eventbus
from eventbus import ALL
from eventbus import EventType
from eventbus.app.launcher.transport.store import StoreTransport
from eventbus.app.launcher.transport.store import job_event_filter
from eventbus.app.plugins import RendezvousInfo
from eventbus.publishers.store_receiver import StoreReceiver
from eventbus.subscribers.store_forwarder import StoreForwarder
from eventbus.wire import ENV_BELL
from eventbus.wire import ENV_PREFIX
from eventbus.wire import ENV_STORE
from eventbus.wire import BatchEncoder
from eventbus.wire import bell_key
from eventbus.wire import namespace
from eventbus.wire import node_key
from eventbus.wire import worker_key

torch_dist = pytest.importorskip("torch.distributed")

KEY = worker_key("eventbus/test/0", 0)


@pytest.fixture
def store() -> Iterator[Any]:
    """A real TCPStore server on a free port."""
    server = torch_dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                 timeout=datetime.timedelta(seconds=10))
    yield server


def _bus_with_log(name: str) -> tuple[eventbus.Bus, list[eventbus.Event]]:
    bus = eventbus.Bus(name)
    got: list[eventbus.Event] = []
    bus.subscribe(ALL, on_event=got.append)
    return bus, got


def _ctx(rank: int = 0) -> eventbus.JobContext:
    return eventbus.JobContext(rank=rank, group_rank=0, run_id="test", restart_count=0,
                               hostname="h", pid=1)


def _receiver(store: Any, bus: eventbus.Bus, key: str = KEY, rank: int = 0, *,
              pipelined: bool = False) -> StoreReceiver:
    rx = StoreReceiver(bus=bus, host="127.0.0.1", port=store.port, connect_timeout=10,
                       pipelined=pipelined)
    rx.watch(key, kind="w", rank=rank)
    return rx


def _lost(events: list[eventbus.Event], prefix: str) -> int:
    return sum(e.count for e in events
               if e.type == EventType.EVENTS_LOST and e.reason.startswith(prefix))


@pytest.mark.parametrize("pipelined", [False, True], ids=["pops", "pipelined"])
def test_round_trip_keeps_every_event_in_order_and_batches_pushes(store: Any,
                                                                  pipelined: bool) -> None:
    """10,000 events of mixed types (NaN, tensors, unicode) arrive typed, in order, equal,
    carried by far fewer pushes than events."""
    torch = pytest.importorskip("torch")
    src = eventbus.Bus("src")
    dst, got = _bus_with_log("dst")
    fwd = StoreForwarder(host="127.0.0.1", port=store.port, key=KEY, rank=0, bus=src)
    sent: list[eventbus.Event] = []
    src.subscribe(ALL, on_event=sent.append)
    for i in range(10_000):
        if i % 3 == 0:
            src.record(EventType.EPOCH_END, epoch=i, data={"loss": math.nan, "t": torch.ones(3)})
        elif i % 3 == 1:
            src.record(EventType.CHECKPOINT_SAVED, path=f"/ckpt/\u2028{i}", step=i)
        else:
            src.record(EventType.WORKER_EXIT, worker_id=0, exit_code=i % 5, signal=None)
    assert fwd.close(5.0)
    rx = _receiver(store, dst, pipelined=pipelined)
    assert rx.drain(timeout=10)
    assert len(got) == 10_000
    assert [e.to_json() for e in got] == [e.to_json() for e in sent]
    assert math.isnan(got[0].data["loss"])
    assert got[0].data["t"]["$tensor"]["shape"] == [3]
    assert got[1].path == "/ckpt/\u20281"
    assert fwd.stats()["pushes"] < 10_000 / 100
    assert rx.stats()["rejected"] == {} and rx.stats()["lost"] == {}


def test_round_trip_dicts_equal(store: Any) -> None:
    """Decoded events have the same to_dict() as the recorded ones, context included."""
    src = eventbus.Bus("src")
    dst, got = _bus_with_log("dst")
    sent: list[eventbus.Event] = []
    src.subscribe(ALL, on_event=sent.append)
    fwd = StoreForwarder(host="127.0.0.1", port=store.port, key=KEY, rank=0, bus=src)
    eventbus.set_context(rank=0)
    try:
        for i in range(100):
            src.record(EventType.METRIC, step=i, data={"loss": 1.0 / (i + 1), "s": "x" * i})
    finally:
        eventbus.refresh_context()
    fwd.close(5.0)
    rx = _receiver(store, dst)
    rx.drain(timeout=5)
    assert [e.to_dict() for e in got] == [e.to_dict() for e in sent]


@pytest.mark.parametrize("pipelined", [False, True], ids=["pops", "pipelined"])
def test_sequence_gap_and_duplicates_are_reported_not_hidden(store: Any, pipelined: bool) -> None:
    """A jump in a sender's numbering is one EVENTS_LOST 'gap' of its size; a repeated push
    is one 'duplicate' report and its events are delivered once."""
    dst, got = _bus_with_log("dst")
    enc = BatchEncoder(kind="w", rank=0, sender="w0:test")
    events = [eventbus.EpochEnd(epoch=i, context=_ctx()) for i in range(30)]
    (first, _), = enc.encode(events[:10])
    enc.encode(events[10:20])  # numbered, never pushed: lost
    (third, _), = enc.encode(events[20:])
    for value in (first, third, third):
        store.queue_push(KEY, value)
    rx = _receiver(store, dst, pipelined=pipelined)
    rx.drain(timeout=5)
    epochs = [e.epoch for e in got if e.type == EventType.EPOCH_END]
    assert epochs == [*range(10), *range(20, 30)]
    assert _lost(got, "gap") == 10
    assert _lost(got, "duplicate") == 10
    assert rx.stats()["lost"] == {"gap": 10, "duplicate": 10}


@pytest.mark.parametrize("pipelined", [False, True], ids=["pops", "pipelined"])
def test_sender_side_drops_are_reported_so_recorded_equals_delivered_plus_lost(
        store: Any, pipelined: bool) -> None:
    """Events the forwarder's full queue dropped arrive as 'dropped by sender' reports:
    recorded = delivered + reported (reliability row 12's equation)."""
    src = eventbus.Bus("src")
    dst, got = _bus_with_log("dst")
    fwd = StoreForwarder(host="127.0.0.1", port=store.port, key=KEY, rank=0, bus=src,
                         max_events=100)
    with fwd._client_lock:  # the queue's thread blocks on its first push: the queue fills
        for i in range(1_000):
            src.record(EventType.EPOCH_END, epoch=i)
        time.sleep(0.1)
    fwd.close(5.0)
    dropped = sum(fwd.stats()["dropped"].values())
    assert dropped > 0
    rx = _receiver(store, dst, pipelined=pipelined)
    rx.drain(timeout=5)
    delivered = sum(1 for e in got if e.type == EventType.EPOCH_END)
    assert delivered + _lost(got, "dropped by sender") == 1_000
    assert _lost(got, "dropped by sender") == dropped


def _valid(seq: int, rank: int = 0, sender: str = "w0:valid") -> bytes:
    enc = BatchEncoder(kind="w", rank=rank, sender=sender)
    enc.seq = seq
    ((value, _),) = enc.encode([eventbus.EpochEnd(epoch=seq, context=_ctx(rank))])
    return value


_senders = itertools.count()


def _batch(**overrides: Any) -> bytes:
    ctx = _ctx().to_dict()
    batch: dict[str, Any] = {"v": 1, "src": f"w0:hostile{next(_senders)}", "kind": "w",
                             "rank": 0, "seq": 0, "drop": {}, "ctx": [ctx], "end": False,
                             "ev": [["EPOCH_END", {"epoch": 1, "timestamp": 1.0, "data": {},
                                                   "context": 0}]]}
    batch.update(overrides)
    return json.dumps(batch).encode()


class _Boom:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("touch " + str(_Boom.marker),))

    marker = Path("/nonexistent")


@pytest.mark.parametrize("pipelined", [False, True], ids=["pops", "pipelined"])
def test_hostile_values_are_rejected_per_reason_and_valid_ones_all_delivered(
        store: Any, pipelined: bool, tmp_path: Path) -> None:
    """Garbage, invalid UTF-8, a pickle, unknown types, wrong field types, spoofed ranks,
    deep nesting and a 16 MiB value are counted per reason; the receiver keeps running,
    delivers every valid event, and never unpickles (row 19)."""
    _Boom.marker = tmp_path / "unpickled"
    dst, got = _bus_with_log("dst")
    hostile: list[bytes] = [
        b"\x00\x01garbage",
        b"\xff\xfe\xfa not utf-8",
        pickle.dumps(_Boom()),
        b"[" * 100_000 + b"]" * 100_000,
        b"x" * (7 * 1024 * 1024),
        b'{"v": 1, "src": "w0:h", "kind": "w", "rank": 0, "seq": NaN}',
        _batch(v=99),
        _batch(src=""),
        _batch(seq=-1),
        _batch(rank=1),  # claims another rank's queue
        _batch(ev=[["NO_SUCH_TYPE", {"timestamp": 1.0, "context": 0}]]),
        _batch(ev=[["EPOCH_END", {"epoch": "one", "timestamp": 1.0, "context": 0}]]),
        _batch(ev=[["EPOCH_END", {"epoch": 1, "bogus": 2, "timestamp": 1.0, "context": 0}]]),
        _batch(ev=[["EPOCH_END", {"epoch": 1, "timestamp": "noon", "context": 0}]]),
        _batch(ev=[["EPOCH_END", {"epoch": 1, "timestamp": 1.0, "context": 7}]]),
        _batch(ev=[["EPOCH_END", {"epoch": 1, "timestamp": 1.0, "data": [], "context": 0}]]),
        _batch(ev=[{"not": "a list"}]),
        _batch(ctx=[{**_ctx().to_dict(), "rank": 5}]),  # spoofed rank in the context
        _batch(ctx=[{"rank": "zero"}]),
        _batch(drop={"x": -1}),
    ]
    for i, value in enumerate(hostile):
        store.queue_push(KEY, _valid(i))
        store.queue_push(KEY, value)
    # 16 MiB: the store server refuses it (and drops that client); the receiver never sees it
    other = torch_dist.TCPStore("127.0.0.1", store.port, is_master=False,
                                timeout=datetime.timedelta(seconds=10))
    with pytest.raises(RuntimeError):
        other.queue_push(KEY, b"x" * (16 * 1024 * 1024))
    store.queue_push(KEY, _valid(len(hostile)))
    rx = _receiver(store, dst, pipelined=pipelined)
    rx.drain(timeout=30)
    rx.close()
    epochs = [e.epoch for e in got if e.type == EventType.EPOCH_END]
    assert epochs == list(range(len(hostile) + 1)), "valid events: 100% delivered, in order"
    rejected = rx.stats()["rejected"]
    assert rejected["not UTF-8"] >= 2  # invalid UTF-8 and the pickle
    assert rejected["not JSON"] >= 2  # garbage, deep nesting, NaN
    assert rejected["value too large"] == 1
    assert rejected["spoofed sender"] == 1
    assert rejected["spoofed rank"] == 1
    assert rejected["unknown event type"] == 1
    assert rejected["bad event: fields"] == 2
    assert rejected["bad context"] == 1
    assert sum(rejected.values()) == len(hostile)
    assert _lost(got, "rejected") == sum(rejected.values())
    assert not _Boom.marker.exists()


def test_receiver_pops_only_without_blocking_on_its_own_client(store: Any) -> None:
    """Every queue_pop the receiver makes is non-blocking, on a client it made itself
    (row 21: a blocking pop stalls every other call on its client)."""
    calls: list[dict[str, Any]] = []

    class Spy:
        def __init__(self, real: Any) -> None:
            self.real = real

        def queue_pop(self, key: str, **kw: Any) -> Any:
            calls.append(kw)
            return self.real.queue_pop(key, **kw)

    dst, _ = _bus_with_log("dst")
    rx = _receiver(store, dst)
    assert rx.client is not store
    rx.client = Spy(rx.client)
    rx.start()
    time.sleep(0.2)
    rx.stop()
    assert calls and all(kw == {"block": False} for kw in calls)


def _wait_for(predicate: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def _bell_receiver(store: Any, name: str, *, poll: float,
                   idle: float) -> tuple[StoreReceiver, list[eventbus.Event], str]:
    """A started receiver watching KEY with a doorbell of its own: (receiver, what its bus
    got, the doorbell's key)."""
    dst, got = _bus_with_log("dst")
    bell = bell_key("test", name)
    rx = StoreReceiver(bus=dst, host="127.0.0.1", port=store.port, connect_timeout=10,
                       poll_interval=poll, max_idle_interval=idle, bell=bell)
    rx.watch(KEY, kind="w", rank=0)
    rx.start()
    return rx, got, bell


def test_a_ringing_sender_is_popped_at_once_not_at_the_backed_off_poll(store: Any) -> None:
    """A forwarder with the receiver's doorbell rings it after each push: its queue is
    popped at once although the receiver's idle poll of it is 60 s away."""
    rx, got, bell = _bell_receiver(store, "rx0", poll=60.0, idle=60.0)
    src = eventbus.Bus("src")
    fwd = StoreForwarder(host="127.0.0.1", port=store.port, key=KEY, rank=0, bus=src,
                         bell=bell)
    try:
        # the receiver's first poll finds the queue empty: the next is 60 s away
        assert _wait_for(lambda: rx.stats()["values"] == 0 and rx.queues(), 5.0)
        time.sleep(0.2)
        for round_ in range(3):
            src.record(EventType.EPOCH_END, epoch=round_)
            assert fwd.flush(fwd.connect_timeout + 20)  # the first waits for the connect
            assert _wait_for(lambda n=round_ + 1: len(got) == n, 20.0), rx.stats()
        assert [e.epoch for e in got] == [0, 1, 2]
        assert rx.rings >= 3
    finally:
        fwd.close(5.0)
        rx.stop()


def test_doorbell_ignores_strangers_and_stop_wakes_and_removes_it(store: Any) -> None:
    """Rings that name no watched queue (or are oversized) are ignored; stop() ends the
    blocked doorbell thread and deletes the doorbell queue; the queues are still polled."""
    rx, got, bell = _bell_receiver(store, "rx1", poll=0.01, idle=0.05)
    for token in (b"eventbus/test/0/w9", b"x" * 5000, b"\xff\xfe", KEY.encode()):
        store.queue_push(bell, token)
    src = eventbus.Bus("src")
    fwd = StoreForwarder(host="127.0.0.1", port=store.port, key=KEY, rank=0, bus=src)
    src.record(EventType.EPOCH_END, epoch=7)  # no bell: found by the poll
    assert fwd.close(5.0)
    assert _wait_for(lambda: len(got) == 1, 20.0)
    assert rx.stats()["rejected"] == {}
    thread = rx._bell_thread
    assert thread is not None and thread.is_alive()
    rx.stop(timeout=10.0)
    assert not thread.is_alive()
    assert not store.check([bell])


def test_an_idle_receiver_sleeps_until_a_queue_is_due_not_every_poll_interval(
        store: Any) -> None:
    """The agent's receiver shares a node's cores with the workers: with its queues empty
    its thread wakes when the soonest is due (backed off to ``max_idle_interval``), not
    every ``poll_interval`` (10 ms: a hundred wake-ups a second of a thread that finds
    nothing, each one taking a core from a rank in a collective). A push without a ring
    still arrives by the back-off."""
    dst, got = _bus_with_log("dst")
    rx = StoreReceiver(bus=dst, host="127.0.0.1", port=store.port, connect_timeout=10,
                       poll_interval=0.01, max_idle_interval=0.4)
    rx.watch(KEY, kind="w", rank=0)
    rx.start()
    try:
        assert _wait_for(lambda: rx.stats()["wakeups"] > 0, 10.0)
        time.sleep(1.0)  # the back-off reaches 0.4 s within 0.7 s
        before = rx.stats()["wakeups"]
        time.sleep(2.0)
        woken = rx.stats()["wakeups"] - before
        assert woken <= 8, woken  # every 10 ms: about 200
        src = eventbus.Bus("src")
        fwd = StoreForwarder(host="127.0.0.1", port=store.port, key=KEY, rank=0, bus=src)
        src.record(EventType.EPOCH_END, epoch=1)
        assert fwd.close(10.0)
        assert _wait_for(lambda: len(got) == 1, 10.0), rx.stats()
    finally:
        rx.stop()


def test_a_queue_watched_while_the_receiver_sleeps_is_polled_at_once(store: Any) -> None:
    """The thread sleeps until its soonest queue is due (here a minute away); watching a
    new queue wakes it, so that queue is popped now, not after the others' back-off."""
    dst, got = _bus_with_log("dst")
    rx = StoreReceiver(bus=dst, host="127.0.0.1", port=store.port, connect_timeout=10,
                       poll_interval=60.0, max_idle_interval=60.0)
    rx.watch(KEY, kind="w", rank=0)
    rx.start()
    other = worker_key("eventbus/test/0", 1)
    try:
        assert _wait_for(lambda: rx.stats()["wakeups"] > 0, 10.0)
        time.sleep(0.2)  # the first round found KEY empty: the thread sleeps 60 s
        src = eventbus.Bus("src")
        fwd = StoreForwarder(host="127.0.0.1", port=store.port, key=other, rank=1, bus=src)
        src.record(EventType.EPOCH_END, epoch=1)
        assert fwd.close(10.0)
        rx.watch(other, kind="w", rank=1)
        assert _wait_for(lambda: len(got) == 1, 20.0), rx.stats()
        assert [e.epoch for e in got] == [1]
    finally:
        rx.stop()


@pytest.mark.parametrize("pipelined", [False, True], ids=["pops", "pipelined"])
def test_a_held_receiver_leaves_the_pushes_in_the_store_until_released(
        store: Any, pipelined: bool) -> None:
    """While ``hold`` says so, nothing is popped (the pushes stay in the store, nothing is
    lost or reported), drain() waits within its budget and says it did not finish; once
    released, everything arrives in order."""
    dst, got = _bus_with_log("dst")
    held = [True]
    rx = StoreReceiver(bus=dst, host="127.0.0.1", port=store.port, connect_timeout=10,
                       hold=lambda: held[0], pipelined=pipelined)
    rx.watch(KEY, kind="w", rank=0)
    src = eventbus.Bus("src")
    fwd = StoreForwarder(host="127.0.0.1", port=store.port, key=KEY, rank=0, bus=src,
                         max_batch=10)
    for i in range(50):
        src.record(EventType.EPOCH_END, epoch=i)
    assert fwd.close(5.0)
    pushes = store.queue_len(KEY)
    assert pushes >= 5
    assert rx.drain(timeout=0.3) is False
    assert got == [] and store.queue_len(KEY) == pushes and rx.stats()["holds"] > 0
    held[0] = False
    assert rx.drain(timeout=10)
    assert [e.epoch for e in got] == list(range(50))
    assert rx.stats()["lost"] == {} and rx.stats()["rejected"] == {}


def test_job_event_filter_defaults_to_builtins_and_takes_exclusions() -> None:
    """Default: every built-in type; '-METRIC' keeps per-step metrics on the node;
    an unknown name is refused by name."""
    epoch = eventbus.EpochEnd(epoch=1)
    metric = eventbus.Metric(step=1)
    default = job_event_filter("builtin")
    assert default(epoch) and default(metric)
    no_metric = job_event_filter("-METRIC")
    assert no_metric(epoch) and not no_metric(metric)
    only = job_event_filter("EPOCH_END")
    assert only(epoch) and not only(metric)
    with pytest.raises(ValueError, match="NOPE"):
        job_event_filter("-NOPE")


def test_every_agent_runs_the_store_transport_by_default() -> None:
    """`eventbus run` builds a StoreTransport in every agent (no registration needed)."""
    from eventbus.app.launcher.agent import default_plugins

    assert any(isinstance(p, StoreTransport) for p in default_plugins())


def _info(store: Any, bus: eventbus.Bus, *, group_rank: int, attempt: int = 0,
          nodes: int = 2, per_node: int = 2) -> RendezvousInfo:
    return RendezvousInfo(
        store_host="127.0.0.1", store_port=store.port, run_id="job", group_rank=group_rank,
        group_world_size=nodes, restart_count=attempt, local_world_size=per_node,
        world_size=nodes * per_node,
        global_ranks=tuple(range(group_rank * per_node, (group_rank + 1) * per_node)), bus=bus)


def test_two_level_fan_in_brings_every_node_to_group_rank_0(store: Any) -> None:
    """Workers -> their node's agent -> group rank 0: group rank 0's bus holds both nodes'
    worker events (minus what the node's filter keeps local); node 1's bus holds its own;
    the exit handshake loses nothing."""
    bus0, got0 = _bus_with_log("agent0")
    bus1, got1 = _bus_with_log("agent1")
    agent0 = StoreTransport(linger=1.0)
    agent1 = StoreTransport(job_events="-METRIC", linger=1.0)
    env0 = agent0.after_rendezvous(_info(store, bus0, group_rank=0))
    env1 = agent1.after_rendezvous(_info(store, bus1, group_rank=1))
    assert {k: env0[k] for k in (ENV_STORE, ENV_PREFIX)} == {
        ENV_STORE: f"127.0.0.1:{store.port}", ENV_PREFIX: namespace("job", 0)}
    # each agent's workers ring their own agent's doorbell
    assert agent0.receiver is not None and agent1.receiver is not None
    assert env0[ENV_BELL] == agent0.receiver.bell != env1[ENV_BELL] == agent1.receiver.bell
    workers = []
    for rank in range(4):
        wbus = eventbus.Bus(f"w{rank}")
        env = env0 if rank < 2 else env1
        workers.append(StoreForwarder(host="127.0.0.1", port=store.port,
                                      key=worker_key(env[ENV_PREFIX], rank), rank=rank,
                                      bus=wbus, bell=env[ENV_BELL]))
        ctx = eventbus.JobContext(rank=rank, group_rank=rank // 2, run_id="job",
                                  restart_count=0)
        for i in range(500):
            wbus.publish(eventbus.EpochEnd(epoch=i, context=ctx))
            wbus.publish(eventbus.Metric(step=i, context=ctx))
    for fwd in workers:
        assert fwd.close(5.0)
    exits = [threading.Thread(target=a.before_exit, kwargs={"timeout": 20.0})
             for a in (agent0, agent1)]
    for t in exits:
        t.start()
    for t in exits:
        t.join(30)

    def count(events: list[eventbus.Event], kind: EventType) -> dict[int, int]:
        out: dict[int, int] = {}
        for e in events:
            if e.type == kind:
                out[e.rank] = out.get(e.rank, 0) + 1
        return out

    assert count(got0, EventType.EPOCH_END) == {0: 500, 1: 500, 2: 500, 3: 500}
    assert count(got0, EventType.METRIC) == {0: 500, 1: 500}
    assert count(got1, EventType.EPOCH_END) == {2: 500, 3: 500}
    assert count(got1, EventType.METRIC) == {2: 500, 3: 500}
    assert not [e for e in got0 + got1 if e.type == EventType.EVENTS_LOST]
    assert agent0.job_receiver is not None
    assert node_key(namespace("job", 0), 1) in agent0._node_ends


def test_queues_of_a_finished_attempt_are_still_drained_after_a_restart(store: Any) -> None:
    """Events of attempt 0 pushed after the agent moved to attempt 1 still arrive, marked
    with their attempt."""
    bus, got = _bus_with_log("agent")
    agent = StoreTransport(linger=5.0)
    agent.after_rendezvous(_info(store, bus, group_rank=0, nodes=1))
    agent.after_rendezvous(_info(store, bus, group_rank=0, nodes=1, attempt=1))
    late = StoreForwarder(host="127.0.0.1", port=store.port,
                          key=worker_key(namespace("job", 0), 1), rank=1,
                          bus=eventbus.Bus("late"))
    ctx = eventbus.JobContext(rank=1, restart_count=0)
    for i in range(10):
        late.bus.publish(eventbus.EpochEnd(epoch=i, context=ctx))
    late.close(5.0)
    agent.before_exit(timeout=10.0)
    assert [(e.epoch, e.restart_count) for e in got if e.type == EventType.EPOCH_END] == \
        [(i, 0) for i in range(10)]


@pytest.mark.parametrize("pipelined", [False, True], ids=["pops", "pipelined"])
def test_values_left_in_the_store_at_exit_are_reported(store: Any, pipelined: bool) -> None:
    """What the exit budget could not drain is reported as 'left in the store', with the
    number of pushes still queued, never dropped silently."""
    dst, got = _bus_with_log("dst")
    enc = BatchEncoder(kind="w", rank=0)
    for i in range(3):
        ((value, _),) = enc.encode([eventbus.EpochEnd(epoch=i, context=_ctx())])
        store.queue_push(KEY, value)
    rx = _receiver(store, dst, pipelined=pipelined)
    assert rx.report_leftovers() == 3
    assert _lost(got, "left in the store") == 3
    rx.drain(timeout=5)
    assert rx.report_leftovers() == 0


def test_a_typo_in_the_job_filter_keeps_the_default_instead_of_disabling_the_transport(
        caplog: pytest.LogCaptureFixture) -> None:
    """EVENTBUS_JOB_EVENTS naming an unknown type is reported and the default (every
    built-in type) applies: the plugin is still built."""
    transport = StoreTransport(job_events="-METRICS")
    assert transport.job_filter(eventbus.Metric(step=1))
    assert "METRICS" in caplog.text


def test_group_rank_0_polls_each_node_queue_less_often_in_a_larger_job() -> None:
    """The job receiver is one thread: its polls of the other nodes' queues grow apart
    with the nodes (about job_polls_per_s in all), from the fast default of a small job to
    at most job_max_poll_interval (docs/scale.md)."""
    from eventbus.app.launcher.transport.store import StoreTransport

    transport = StoreTransport()
    settings = transport.settings
    assert transport.job_poll_interval(2) == settings.job_poll_interval
    assert transport.job_poll_interval(256) == settings.job_poll_interval
    assert transport.job_poll_interval(1024) == pytest.approx(1024 / settings.job_polls_per_s)
    assert transport.job_poll_interval(1024) < 0.1  # 8,192 ranks: the beat's p99 under 1 s
    assert transport.job_poll_interval(8192) == settings.job_max_poll_interval == 0.25
    assert transport.job_poll_interval(100_000) == settings.job_max_poll_interval


def _node_values(store: Any, counts: dict[int, int]) -> dict[str, list[int]]:
    """Push ``counts[g]`` values (one EPOCH_END each, epochs 0, 1, ...) to node g's queue;
    returns each queue's epochs in push order."""
    pushed: dict[str, list[int]] = {}
    for g, n in counts.items():
        key = node_key(namespace("job", 0), g)
        enc = BatchEncoder(kind="n", rank=g)
        pushed[key] = []
        for i in range(n):
            ctx = eventbus.JobContext(rank=8 * g, group_rank=g, run_id="job",
                                      restart_count=0)
            ((value, _),) = enc.encode([eventbus.EpochEnd(epoch=i, context=ctx)])
            store.queue_push(key, value)
            pushed[key].append(i)
    return pushed


def _pipelined_receiver(store: Any, bus: eventbus.Bus, nodes: int,
                        **kw: Any) -> StoreReceiver:
    rx = StoreReceiver(bus=bus, host="127.0.0.1", port=store.port, connect_timeout=10,
                       pipelined=True, **kw)
    for g in range(1, nodes + 1):
        rx.watch(node_key(namespace("job", 0), g), kind="n", rank=g)
    return rx


def test_a_pipelined_receiver_empties_each_queue_with_one_pop_per_value(
        store: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Group rank 0's job receiver is pipelined: every queue's length in one write, then
    exactly as many pops as each holds. A queue of k values costs its length and k pops, an
    empty one its length only: no pop is made that finds a queue empty (docs/scale.md)."""
    from eventbus.store_client import QueueClient

    pops: list[str] = []
    asked: list[str] = []
    real_pops, real_lengths = QueueClient.pop_many, QueueClient.lengths

    def spy_pops(self: QueueClient, keys: Any) -> Any:
        pops.extend(keys)
        return real_pops(self, keys)

    def spy_lengths(self: QueueClient, keys: Any) -> Any:
        asked.extend(keys)
        return real_lengths(self, keys)

    monkeypatch.setattr(QueueClient, "pop_many", spy_pops)
    monkeypatch.setattr(QueueClient, "lengths", spy_lengths)
    dst, got = _bus_with_log("dst")
    counts = {g: g % 5 for g in range(1, 301)}  # 0..4 values per node, 300 nodes
    pushed = _node_values(store, counts)
    rx = _pipelined_receiver(store, dst, 300)
    assert rx.drain_once(every=True) == sum(counts.values())
    assert sorted(asked) == sorted(pushed)
    per_key = {key: pops.count(key) for key in pushed}
    assert per_key == {key: len(epochs) for key, epochs in pushed.items()}
    arrived: dict[int, list[int]] = {}
    for e in got:
        arrived.setdefault(e.group_rank, []).append(e.epoch)
    assert arrived == {g: list(range(n)) for g, n in counts.items() if n}
    assert rx.stats()["lost"] == {} and rx.stats()["rejected"] == {}
    rx.close()


def test_a_pipelined_receiver_keeps_max_pops_per_queue_and_comes_back_at_once(
        store: Any) -> None:
    """A queue holding more than ``max_pops_per_queue`` gives that many in a round and is
    due again at once; the next rounds take the rest, in order."""
    dst, got = _bus_with_log("dst")
    _node_values(store, {1: 10, 2: 2})
    rx = _pipelined_receiver(store, dst, 2, max_pops_per_queue=4)
    assert rx.drain_once() == 4 + 2
    assert rx.drain_once() == 4  # node 2's queue was emptied: not due yet
    assert rx.drain_once() == 2
    assert [e.epoch for e in got if e.group_rank == 1] == list(range(10))
    rx.close()


def test_a_pipelined_receiver_whose_connection_breaks_reconnects_and_loses_nothing(
        store: Any) -> None:
    """The pop client's connection dies between rounds: the round counts a store error
    and pops nothing; the next makes a new client and everything arrives, once."""
    dst, got = _bus_with_log("dst")
    rx = _pipelined_receiver(store, dst, 3, reconnect_interval=0.0)
    assert rx.drain_once(every=True) == 0
    assert rx._pops is not None
    popper = rx._pops.client
    assert popper is not None and popper._sock is not None
    popper._sock.shutdown(2)  # the connection is gone; the client does not know yet
    _node_values(store, {1: 3, 2: 1, 3: 2})
    assert rx.drain_once(every=True) == 0
    assert rx.store_errors == 1 and rx._pops.client is None
    assert rx.drain(timeout=10)
    assert sorted((e.group_rank, e.epoch) for e in got) == [
        (1, 0), (1, 1), (1, 2), (2, 0), (3, 0), (3, 1)]
    assert rx.stats()["lost"] == {}
    rx.close()
    assert popper.fileno() == -1


def test_a_pipelined_receiver_asks_hold_again_every_few_pops(store: Any) -> None:
    """With a ``hold`` (the agent's JSONL flow control), a pipelined round pops at most
    MAX_HELD_POPS values between two questions: a sink that falls behind mid-round leaves
    the rest in the store, as with one pop at a time."""
    from eventbus.publishers.pipelined_pops import MAX_HELD_POPS

    dst, got = _bus_with_log("dst")
    _node_values(store, {1: 30, 2: 30})
    asked = [0]

    def hold() -> bool:
        asked[0] += 1
        return asked[0] > 1  # behind from the second question on

    # a round of a minute: the time limit must not end it before the second question
    rx = _pipelined_receiver(store, dst, 2, hold=hold, max_round_s=60.0)
    assert rx.drain_once() == MAX_HELD_POPS
    assert rx.stats()["holds"] == 1
    assert store.queue_len(node_key(namespace("job", 0), 1)) + store.queue_len(
        node_key(namespace("job", 0), 2)) == 60 - MAX_HELD_POPS
    asked[0] = -1000  # caught up
    assert rx.drain(timeout=10)
    assert sorted((e.group_rank, e.epoch) for e in got) == sorted(
        (g, i) for g in (1, 2) for i in range(30))
    rx.close()
