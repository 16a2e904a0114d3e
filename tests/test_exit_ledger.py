"""The exit ledger: what a worker numbered and dropped, left in a local file at its exit,
so that the agent reports a loss the store cannot (reliability row 27's in-process half).

A real TCPStore serves the agent's receiver; the senders whose loss is reported point at a
closed port (the store is unreachable for them, as after the store died), and the ledger
directory is the one the agent's transport hands its workers.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
from collections.abc import Callable
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import eventbus
from eventbus import ALL
from eventbus import EventType
from eventbus.app.launcher.transport.store import StoreTransport
from eventbus.app.plugins import RendezvousInfo
from eventbus.exit_ledger import ENV_LEDGER_DIR
from eventbus.exit_ledger import ExitLedger
from eventbus.exit_ledger import read_ledgers
from eventbus.exit_ledger import write_ledger
from eventbus.subscribers.store_forwarder import StoreForwarder
from eventbus.wire import namespace
from eventbus.wire import worker_key

torch_dist = pytest.importorskip("torch.distributed")


@pytest.fixture
def store() -> Iterator[Any]:
    """A real TCPStore server on a free port."""
    yield torch_dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=10))


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _info(store: Any, bus: eventbus.Bus, *, attempt: int = 0) -> RendezvousInfo:
    return RendezvousInfo(
        store_host="127.0.0.1", store_port=store.port, run_id="job", group_rank=0,
        group_world_size=1, restart_count=attempt, local_world_size=2, world_size=2,
        global_ranks=(0, 1), bus=bus)


def _agent(store: Any, *, attempt: int = 0) -> tuple[StoreTransport, list[eventbus.Event],
                                                        dict[str, str]]:
    bus = eventbus.Bus("agent")
    got: list[eventbus.Event] = []
    bus.subscribe(ALL, on_event=got.append)
    agent = StoreTransport(linger=0.5)
    env = dict(agent.after_rendezvous(_info(store, bus, attempt=attempt)))
    return agent, got, env


def _record(fwd: StoreForwarder, n: int, rank: int) -> None:
    ctx = eventbus.JobContext(rank=rank, run_id="job", restart_count=0)
    for i in range(n):
        fwd.bus.publish(eventbus.EpochEnd(epoch=i, context=ctx))


def _lost(got: list[eventbus.Event], sender: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for e in got:
        if isinstance(e, eventbus.EventsLost) and e.source == sender:
            out[e.reason] = out.get(e.reason, 0) + e.count
    return out


def test_a_sender_that_never_reached_the_store_is_reported_whole_from_its_ledger(
    store: Any,
) -> None:
    """A worker whose store is unreachable: numbered + dropped events are reported by the
    agent from its ledger, and the total equals what it recorded."""
    agent, got, env = _agent(store)
    ledger_dir = env[ENV_LEDGER_DIR]
    assert os.path.isdir(ledger_dir)
    fwd = StoreForwarder(host="127.0.0.1", port=_closed_port(),
                         key=worker_key(namespace("job", 0), 1), rank=1,
                         bus=eventbus.Bus("w1"), ledger_dir=ledger_dir, max_events=50,
                         connect_timeout=0.5)
    _record(fwd, 500, rank=1)
    fwd.close(2.0)
    assert fwd.ledger is not None and os.path.exists(fwd.ledger)
    agent.before_exit(timeout=5.0)
    lost = _lost(got, fwd.sender)
    print(f"recorded 500; reported from the ledger {lost}")
    assert sum(lost.values()) == 500
    assert any(r.startswith("dropped by sender: ") for r in lost)
    assert any("(from the sender's exit ledger)" in r for r in lost)
    assert agent.ledger_stats["reported"] == 500
    assert not os.path.exists(ledger_dir)  # the agent removes its ledgers at exit


def test_a_sender_whose_end_marker_arrived_is_not_reported_twice(store: Any) -> None:
    """The end marker tells everything: its ledger is read and reports nothing."""
    agent, got, env = _agent(store)
    fwd = StoreForwarder(host="127.0.0.1", port=store.port,
                         key=worker_key(namespace("job", 0), 0), rank=0,
                         bus=eventbus.Bus("w0"), ledger_dir=env[ENV_LEDGER_DIR])
    _record(fwd, 200, rank=0)
    assert fwd.close(5.0)
    agent.before_exit(timeout=5.0)
    assert [e.epoch for e in got if e.type == EventType.EPOCH_END] == list(range(200))
    assert not [e for e in got if isinstance(e, eventbus.EventsLost)]
    assert agent.ledger_stats["read"] == 1


def test_hostile_ledger_files_are_refused_and_counted_and_the_agent_goes_on(
    store: Any, tmp_path: Path,
) -> None:
    """Garbage, a huge file, a FIFO, a link to /dev/zero, a renamed ledger, another queue's
    ledger and a leftover temporary file: each refused (counted), none raises, and a valid
    ledger of the previous attempt beside them is still settled."""
    agent, got, _env = _agent(store, attempt=0)
    assert agent.info is not None
    env1 = dict(agent.after_rendezvous(_info(store, agent.info.bus, attempt=1)))
    dir0 = str(Path(env1[ENV_LEDGER_DIR]).parent / "attempt-0")
    dir1 = env1[ENV_LEDGER_DIR]
    assert dir0 != dir1 and os.path.isdir(dir0)
    # attempt 0: a valid ledger of a sender never seen by the receiver
    good = ExitLedger(sender="w0:host:1:abcd", key=worker_key(namespace("job", 0), 0),
                      numbered=7, dropped={"queue full": 3})
    write_ledger(dir0, good)
    # attempt 1: hostile files
    Path(dir1, "garbage.json").write_bytes(b"\xff\x00{not json")
    Path(dir1, "huge.json").write_bytes(b"{" + b" " * 100_000 + b"}")
    os.mkfifo(os.path.join(dir1, "fifo.json"))
    os.symlink("/dev/zero", os.path.join(dir1, "zero.json"))
    renamed = ExitLedger(sender="w1:host:2:beef", key=worker_key(namespace("job", 1), 1),
                         numbered=5)
    Path(dir1, "someone-else.json").write_text(renamed.to_json())
    foreign = ExitLedger(sender="w9:host:3:cafe", key=worker_key(namespace("job", 1), 9),
                         numbered=1_000)
    write_ledger(dir1, foreign)
    Path(dir1, "w1_host_4_0000.json.12.tmp").write_text("{")
    Path(dir1, "nan.json").write_text(json.dumps({"v": 1, "src": "nan.json"})[:-1]
                                      + ', "seq": NaN}')
    agent.before_exit(timeout=5.0)
    refused = agent.ledger_stats["refused"]
    print(f"refused {refused}")
    assert sum(refused.values()) == 7
    assert refused["ledger: not a queue of its attempt"] == 1
    assert refused["ledger: file name is not its sender's"] == 1
    assert _lost(got, good.sender) == {
        "not delivered: no end marker reached the agent (from the sender's exit ledger)": 7,
        "dropped by sender: queue full": 3}
    assert not _lost(got, foreign.sender)


def test_a_sender_without_ledger_or_end_marker_is_named_as_such(
    store: Any, caplog: pytest.LogCaptureFixture,
) -> None:
    """A worker killed by SIGKILL writes no ledger: its loss shows only as a missing end
    marker, and the warning says that no ledger counted it."""
    agent, got, _env = _agent(store)
    fwd = StoreForwarder(host="127.0.0.1", port=store.port,
                         key=worker_key(namespace("job", 0), 0), rank=0,
                         bus=eventbus.Bus("w0"))
    _record(fwd, 20, rank=0)
    assert fwd.flush(fwd.connect_timeout + 20)  # the first batch waits for the connect
    fwd.sink.close(1.0)  # stopped without the end marker, as SIGKILL would
    with caplog.at_level(logging.WARNING, logger="eventbus"):
        agent.before_exit(timeout=5.0)
    assert any("left no exit ledger" in r.getMessage() and fwd.sender in r.getMessage()
               for r in caplog.records)
    assert not _lost(got, fwd.sender)


def test_read_ledgers_of_a_missing_directory_is_empty(tmp_path: Path) -> None:
    """A directory that is gone reads as no ledgers, no refusal."""
    assert read_ledgers(str(tmp_path / "gone")) == ([], {})


def _attach_with(store: Any, monkeypatch: pytest.MonkeyPatch,
                 caplog: pytest.LogCaptureFixture, var: str,
                 values: Callable[[dict[str, str]], list[str]],
                 read: Callable[[Any], Any]) -> tuple[dict[str, str], list[Any]]:
    """Attach a worker forwarder through the worker bootstrap's :func:`attach`, from a real
    agent's environment with ``var`` set to each
    of ``values(env)`` in turn (warnings captured); ``read`` of each forwarder, and the
    agent's environment."""
    import eventbus.subscribers.store_forwarder as sf
    from eventbus.app.worker import attach
    from eventbus.subscribers import worker_exit

    monkeypatch.setattr(worker_exit, "install_exit_hooks", lambda: None)
    agent, _got, env = _agent(store)
    base = {"RANK": "0", "EVENTBUS_AGENT_STORE": env["EVENTBUS_AGENT_STORE"],
            "EVENTBUS_STORE_PREFIX": env["EVENTBUS_STORE_PREFIX"]}
    seen = []
    for value in values(env):
        monkeypatch.setattr(sf, "_worker_forwarder", None)
        with caplog.at_level(logging.WARNING, logger="eventbus"):
            side = attach({**base, var: value})
        fwd = sf.worker_forwarder()
        assert side.forwarding and fwd is not None
        seen.append(read(fwd))
        fwd.close(2.0)
    agent.before_exit(timeout=5.0)
    return env, seen


@pytest.mark.parametrize("hostile", ["/", "relative/attempt-0", "/tmp/attempt-0", "/x\n"])
def test_a_worker_leaves_its_ledger_only_in_a_folder_its_agent_made(
    store: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    hostile: str,
) -> None:
    """An inherited EVENTBUS_LEDGER_DIR that is not an agent's attempt folder is refused
    with one warning (no file dropped there); the agent's own folder is taken."""
    env, taken = _attach_with(store, monkeypatch, caplog, ENV_LEDGER_DIR,
                              lambda env: [hostile, env[ENV_LEDGER_DIR]],
                              lambda fwd: fwd.ledger_dir)
    assert taken == [None, env[ENV_LEDGER_DIR]]
    assert len([r for r in caplog.records if ENV_LEDGER_DIR in r.getMessage()]) == 1


def test_a_worker_rings_its_agents_doorbell_and_refuses_a_hostile_one(
    store: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """EVENTBUS_STORE_BELL from the agent is the worker forwarder's doorbell; a value that
    is not a plain store key is refused with a warning (the events still go, unrung)."""
    from eventbus.wire import ENV_BELL

    env, bells = _attach_with(store, monkeypatch, caplog, ENV_BELL,
                              lambda env: [env[ENV_BELL], "../../x", "x" * 600],
                              lambda fwd: fwd.bell)
    assert bells == [env[ENV_BELL], None, None]
    assert len([r for r in caplog.records if ENV_BELL in r.getMessage()]) == 2


def test_pushes_left_in_the_store_are_counted_in_events_from_the_ledger(
    store: Any,
) -> None:
    """The exit budget ran out with a sender's pushes still in the store (an agent whose
    store came back just before it exited, after a partition): its ledger counts in
    events what never arrived, those pushes included; they are not also reported as a
    count of pushes, which would neither be events nor add up."""
    agent, got, env = _agent(store)
    assert agent.receiver is not None
    agent.receiver.stop()  # nothing is popped from now on: the pushes stay in the store
    fwd = StoreForwarder(host="127.0.0.1", port=store.port,
                         key=worker_key(namespace("job", 0), 0), rank=0,
                         bus=eventbus.Bus("w0"), ledger_dir=env[ENV_LEDGER_DIR])
    ctx = eventbus.JobContext(rank=0, run_id="job", restart_count=0)
    for i in range(300):  # 100 pushes of 3 events
        fwd.bus.publish(eventbus.EpochEnd(epoch=i, context=ctx))
        if i % 3 == 2:
            assert fwd.flush(fwd.connect_timeout + 20)
    fwd.close(fwd.connect_timeout + 20)
    agent.receiver.max_pops_per_queue = 10  # one pass of the exit's drain pops 10 of them
    agent.before_exit(timeout=0.0)
    assert not [e for e in got if isinstance(e, eventbus.EventsLost)
                and e.reason.startswith("left in the store")]
    delivered = len([e for e in got if e.type == EventType.EPOCH_END])
    lost = _lost(got, fwd.sender)
    print(f"delivered {delivered}, reported from the ledger {lost}")
    assert delivered + sum(lost.values()) == 300
    assert all("(from the sender's exit ledger)" in r for r in lost)
