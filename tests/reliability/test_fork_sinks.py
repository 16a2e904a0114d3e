"""Row 11, the sinks' side: fork while the bus lock is held, a queued sink holds
undelivered events and the store forwarder has a batch stuck on its client. Each child
starts with empty queues (no inherited buffer duplicated), numbers its events as a new
sender and opens its own store client.

Runs in a child interpreter (which forks 50 times) so the forks never copy pytest.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
from matrix import drain_until_ended
from matrix import subprocess_env

import eventbus
from eventbus import EventType

FORKS = 50

SCRIPT = r"""
import datetime, faulthandler, json, os, sys, threading, time
import eventbus
from eventbus import EventType
from eventbus.subscribers.queued import QueuedSink
from eventbus.subscribers.store_forwarder import StoreForwarder

port, forks, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
parent = os.getpid()
eventbus.set_context(rank=0)
bus = eventbus.get_default_bus()
gate = threading.Event()
written = []  # what the queued sink handed to its "file", in this process

def slow_file(batch):
    if os.getpid() == parent:
        gate.wait(600)  # the parent's sink is stuck with events in flight and queued
    written.extend(e.fields()["epoch"] for e in batch)

sink = QueuedSink(slow_file, name="slow-file")
bus.subscribe(EventType.EPOCH_END, on_event=sink)
fwd = StoreForwarder(host="127.0.0.1", port=port, key="row11/w0", rank=0)
parent_sender = fwd.sender
import torch.distributed  # as a worker's first record() does: never in a sink thread
eventbus.record(EventType.METRIC, step=0)
fwd.flush(30)  # connected: the parent has a live client
parent_client = fwd._client
assert parent_client is not None

def child(n):
    checks = {
        "queue empty": sink.pending == 0 and sink.stats()["enqueued"] == 0,
        "forwarder queue empty": fwd.sink.pending == 0,
        "new sender": fwd.sender != parent_sender,
        "no inherited client": fwd._client is None,
        "own pid": eventbus.current_context().pid == os.getpid(),
    }
    for i in range(10):
        eventbus.record(EventType.EPOCH_END, epoch=10_000 * (n + 1) + i)
    checks["sink delivered own events only"] = (
        sink.flush(10) and written == [10_000 * (n + 1) + i for i in range(10)])
    checks["forwarder closed"] = fwd.close(10)
    checks["own client"] = fwd._client is not None and fwd._client is not parent_client
    return [name for name, ok in checks.items() if not ok]

held, release = threading.Event(), threading.Event()
def holder():
    with bus._lock, fwd._client_lock:  # the bus lock, and the forwarder stuck mid-push
        held.set()
        release.wait(120)

t = threading.Thread(target=holder, daemon=True)
t.start()
held.wait(10)
for i in range(100):  # both sinks now hold these: in flight or queued
    eventbus.record(EventType.EPOCH_END, epoch=i)
deadline = time.monotonic() + 10
while (sink.pending, fwd.sink.pending) != (100, 100) and time.monotonic() < deadline:
    time.sleep(0.01)
assert (sink.pending, fwd.sink.pending) == (100, 100), (sink.pending, fwd.sink.pending)
results = {}
for n in range(forks):
    pid = os.fork()
    if pid == 0:
        code = 99
        faulthandler.dump_traceback_later(25, exit=True)  # a hang shows where, not only that
        try:
            failed = child(n)
            with open(f"{out}.{n}", "w") as f:
                json.dump(failed, f)
            code = 0 if not failed else 1
        finally:
            os._exit(code)
    deadline = time.monotonic() + 30
    status = None
    while time.monotonic() < deadline:
        done, raw = os.waitpid(pid, os.WNOHANG)
        if done:
            status = os.waitstatus_to_exitcode(raw)
            break
        time.sleep(0.005)
    if status is None:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    results[n] = {"pid": pid, "status": status}
release.set()
t.join(10)
gate.set()
parent_ok = sink.flush(30) and written == list(range(100)) and fwd.close(30)
print(json.dumps({"results": results, "parent_ok": parent_ok, "parent_sender": parent_sender}))
"""


@pytest.mark.slow
def test_forks_start_with_empty_queues_and_their_own_store_client(
    store: Any, tmp_path: Any, figure: Callable[[int, str], None],
) -> None:
    """50 forks with the bus lock held, a stuck queued sink and a forwarder stuck on its
    client: every child passes its checks and exits in time; the receiver gets the
    parent's 100 events once and each child's 10 events, from 51 senders that all ended,
    with no gap or duplicate."""
    from eventbus.publishers.store_receiver import StoreReceiver

    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(store.port), str(FORKS),
                           str(tmp_path / "child")], env=subprocess_env(),
                          check=False, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    failures = {n: json.loads((tmp_path / f"child.{n}").read_text())
                for n, r in out["results"].items() if r["status"] != 0
                and (tmp_path / f"child.{n}").exists()}
    ok = sum(1 for r in out["results"].values() if r["status"] == 0)

    bus = eventbus.Bus("row11-agent")
    got: list[eventbus.Event] = []
    bus.subscribe(EventType.EPOCH_END, on_event=got.append)
    rx = StoreReceiver(bus=bus, client=store)
    rx.watch("row11/w0", kind="w", rank=0)
    ended = drain_until_ended(rx, senders=FORKS + 1, timeout=120)
    epochs = [e.fields()["epoch"] for e in got]
    parent_epochs = [e for e in epochs if e < 10_000]
    child_epochs = sorted(e for e in epochs if e >= 10_000)
    stats = rx.stats()

    figure(11, f"{ok}/{FORKS} forks ok with a stuck queue and forwarder; parent's events "
               f"delivered {len(parent_epochs)}/100 (duplicated {len(parent_epochs) - 100}); "
               f"senders {len(stats['senders'])}")
    assert ok == FORKS, (out["results"], failures)
    assert ended, {k: v for k, v in stats["senders"].items() if not v["ended"]}
    assert out["parent_ok"]
    assert parent_epochs == list(range(100))
    assert child_epochs == sorted(10_000 * (n + 1) + i for n in range(FORKS) for i in range(10))
    assert len(stats["senders"]) == FORKS + 1
    assert stats["lost"] == {} and stats["rejected"] == {}
