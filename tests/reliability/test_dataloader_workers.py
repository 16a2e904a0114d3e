"""Row 12: DataLoader workers (fork, num_workers=4) record in ``__getitem__``; their
events reach the agent through the store: published = delivered + dropped (per reason)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from matrix import WORKER
from matrix import drain_until_ended
from matrix import subprocess_env

import eventbus
from eventbus import EventType

ITEMS = 2_000
EPOCHS = 2
MAIN_EVENTS = 100

SCRIPT = r"""
import sys
import torch
import eventbus
from eventbus import EventType

items, epochs, main_events = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])

class Data(torch.utils.data.Dataset):
    def __len__(self):
        return items
    def __getitem__(self, i):
        eventbus.record(EventType.METRIC, step=i, data={"i": i})
        return i

if __name__ == "__main__":
    for e in range(epochs):
        eventbus.record(EventType.EPOCH_START, epoch=e)
        loader = torch.utils.data.DataLoader(Data(), batch_size=16, num_workers=4,
                                             multiprocessing_context="fork")
        seen = sorted(int(x) for batch in loader for x in batch)
        assert seen == list(range(items))
    for i in range(main_events - epochs):
        eventbus.record(EventType.EPOCH_END, epoch=i)
"""


@pytest.mark.slow
def test_dataloader_workers_published_equals_delivered_plus_dropped(
    store: Any, tmp_path: Path, figure: Callable[[int, str], None],
) -> None:
    """Every event recorded in the main process and in 2 epochs x 4 forked DataLoader
    workers is delivered to the agent's bus or reported lost with a reason: the gap is 0
    (and with an idle store, nothing is lost at all)."""
    from eventbus.publishers.store_receiver import StoreReceiver
    from eventbus.wire import ENV_PREFIX
    from eventbus.wire import ENV_STORE
    from eventbus.wire import worker_key

    prefix = "eventbus/row12/0"
    # the progress watch off: its heartbeats are eventbus's own events, not the script's,
    # and this row counts the script's (the watch has its own tests)
    env = subprocess_env(**{ENV_STORE: f"127.0.0.1:{store.port}", ENV_PREFIX: prefix,
                            "RANK": "0", "EVENTBUS_PROGRESS": "off"})
    proc = subprocess.run([*WORKER, "-c", SCRIPT, str(ITEMS), str(EPOCHS),
                           str(MAIN_EVENTS)], env=env, check=False, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]

    bus = eventbus.Bus("row12-agent")
    got: list[eventbus.Event] = []
    bus.subscribe(eventbus.ALL, on_event=got.append)
    rx = StoreReceiver(bus=bus, client=store)
    rx.watch(worker_key(prefix, 0), kind="w", rank=0)
    ended = drain_until_ended(rx, senders=1 + 4 * EPOCHS, timeout=60)

    published = ITEMS * EPOCHS + MAIN_EVENTS
    delivered = sum(1 for e in got if e.type != EventType.EVENTS_LOST)
    dropped = {}
    for e in got:
        if e.type == EventType.EVENTS_LOST:
            reason = e.fields()["reason"]
            dropped[reason] = dropped.get(reason, 0) + e.fields()["count"]
    gap = published - delivered - sum(dropped.values())
    steps = sorted(e.fields()["step"] for e in got if e.type == EventType.METRIC)
    worker_pids = {e.pid for e in got if e.type == EventType.METRIC}
    figure(12, f"published {published:,} = delivered {delivered:,} + dropped "
               f"{sum(dropped.values())} {dropped}; gap {gap}; senders "
               f"{len(rx.stats()['senders'])} ({len(worker_pids)} worker processes)")
    assert gap == 0
    assert ended
    assert steps == sorted(list(range(ITEMS)) * EPOCHS)
    assert len(worker_pids) == 4 * EPOCHS
    assert rx.stats()["lost"] == {} and rx.stats()["rejected"] == {}


def test_a_half_imported_orjson_falls_back_to_json_and_loses_nothing(
    store: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What a DataLoader worker inherits when it is forked while the forwarder's thread
    imports orjson: the module half made, without ``dumps`` (soak of 2026-12-02: one
    worker's every event lost, "partially initialized module 'orjson'"). The codec then
    takes json, and everything arrives."""
    import types

    from eventbus import wire
    from eventbus.publishers.store_receiver import StoreReceiver
    from eventbus.subscribers.store_forwarder import StoreForwarder

    half = types.ModuleType("orjson")
    half.__spec__ = None  # what a fork leaves: the import never finished
    monkeypatch.setitem(sys.modules, "orjson", half)
    monkeypatch.setattr(wire, "_orjson", False)
    assert wire._codec() is None
    src = eventbus.Bus("half-orjson")
    key = "eventbus/half-orjson/0/w0"
    fwd = StoreForwarder(host="127.0.0.1", port=store.port, key=key, rank=0, bus=src)
    for i in range(50):
        src.record(EventType.METRIC, step=i, data={"loss": 1.0 / (i + 1)})
    assert fwd.close(10.0)
    assert fwd.lost == {} and fwd.sink.dropped == {}
    bus = eventbus.Bus("half-orjson-agent")
    got: list[eventbus.Event] = []
    bus.subscribe(eventbus.ALL, on_event=got.append)
    rx = StoreReceiver(bus=bus, client=store)
    rx.watch(key, kind="w", rank=0)
    assert drain_until_ended(rx, senders=1, timeout=20)
    assert [e.fields()["step"] for e in got] == list(range(50))


def test_the_encoder_imports_its_codec_on_the_thread_that_makes_it() -> None:
    """A worker's forwarder is made on its main thread, before the script can fork: the
    codec is imported there, never first on the queue's thread, which a fork may catch
    halfway (the row 12 loss above)."""
    code = ("import sys; from eventbus import wire; assert 'orjson' not in sys.modules; "
            "wire.BatchEncoder(kind='w', rank=0); "
            "assert wire._orjson is not False and wire._orjson is sys.modules.get('orjson')")
    proc = subprocess.run([sys.executable, "-c", code], env=subprocess_env(),
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
