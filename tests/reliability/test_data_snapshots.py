"""Row 23: data changed after ``record()``, and a subscriber writing into ``event.data``.

Every kind of mutable value is changed in place right after each ``record()``; each sink
(a later in-thread subscriber, a ``QueuedSink`` held back until all the changes are made,
the JSONL file, the store transport into another bus) must see the values at ``record()``
time. The CUDA half of the row (no synchronisation in the caller's thread) is pinned by
construction in eventbus/snapshot.py and was not run on a device here.
"""

from __future__ import annotations

import copy
import datetime
import json
import pickle
import threading
from collections.abc import Callable
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import eventbus
from eventbus import ALL
from eventbus import Bus
from eventbus import Event
from eventbus import EventType
from eventbus.publishers.store_receiver import StoreReceiver
from eventbus.snapshot import MAX_ARRAY_BYTES
from eventbus.subscribers.jsonl import JsonlRecorder
from eventbus.subscribers.jsonl import read_jsonl
from eventbus.subscribers.queued import QueuedSink
from eventbus.subscribers.store_forwarder import StoreForwarder
from eventbus.wire import worker_key

N = 200


class _Live:
    """The caller's mutable state: one of each kind, changed in place after each record()."""

    def __init__(self) -> None:
        self.lst = [0]
        self.dct = {"v": 0}
        self.nested = {"a": [{"b": [0]}]}
        self.arr = np.zeros(3)
        self.acc = torch.zeros(3)
        self.in_list = [torch.zeros(2)]
        self.st = {0}

    def data(self, i: int) -> dict[str, Any]:
        return {"i": i, "lst": self.lst, "dct": self.dct, "nested": self.nested,
                "arr": self.arr, "acc": self.acc, "in_list": self.in_list, "st": self.st}

    def mutate(self, i: int) -> None:
        self.lst.append(i + 1)
        self.lst[0] = i + 1
        self.dct["v"] = i + 1
        self.nested["a"][0]["b"][0] = i + 1
        self.arr += 1
        self.acc += 1
        self.in_list[0].add_(1)
        self.st.add(i + 1)


def _wrong_live(data: Any) -> list[str]:
    """The keys of an in-process event's data that do not hold record()-time values."""
    i = data["i"]
    bad = []
    if list(data["lst"]) != [i, *range(1, i + 1)]:
        bad.append("lst")
    if data["dct"]["v"] != i:
        bad.append("dct")
    if data["nested"]["a"][0]["b"][0] != i:
        bad.append("nested")
    if data["arr"].tolist() != [float(i)] * 3:
        bad.append("arr")
    if data["acc"].tolist() != [float(i)] * 3:
        bad.append("acc")
    if data["in_list"][0].tolist() != [float(i)] * 2:
        bad.append("in_list")
    if set(data["st"]) != set(range(i + 1)):
        bad.append("st")
    return bad


def _wrong_decoded(data: Any) -> list[str]:
    """The same check on data decoded from JSON (tensors and arrays are summaries)."""
    i = data["i"]
    bad = []
    if data["lst"] != [i, *range(1, i + 1)]:
        bad.append("lst")
    if data["dct"]["v"] != i:
        bad.append("dct")
    if data["nested"]["a"][0]["b"][0] != i:
        bad.append("nested")
    if data["arr"]["$tensor"]["head"] != [float(i)] * 3:
        bad.append("arr")
    if data["acc"]["$tensor"]["head"] != [float(i)] * 3:
        bad.append("acc")
    if data["in_list"][0]["$tensor"]["head"] != [float(i)] * 2:
        bad.append("in_list")
    if sorted(data["st"]) != list(range(i + 1)):
        bad.append("st")
    return bad


def _record_and_mutate(bus: Bus) -> None:
    live = _Live()
    for i in range(N):
        bus.record(EventType.METRIC, step=i, data=live.data(i))
        live.mutate(i)


def _count_wrong(datas: list[Any], check: Callable[[Any], list[str]]) -> tuple[int, set[str]]:
    wrong = 0
    kinds: set[str] = set()
    for data in datas:
        bad = check(data)
        wrong += bool(bad)
        kinds.update(bad)
    return wrong, kinds


def test_later_subscriber_and_held_back_queue_see_record_time_values(
        figure: Callable[[int, str], None]) -> None:
    """A later subscriber and a queue drained only after every change see record()-time
    values of every kind: wrong values 0 of N."""
    bus = Bus("snap-queue")
    later: list[Event] = []
    gate = threading.Event()
    queued: list[Event] = []

    def handle(batch: Any) -> None:
        assert gate.wait(30)
        queued.extend(batch)

    sink = QueuedSink(handle, name="held-back", max_events=10 * N)
    bus.subscribe(EventType.METRIC, on_event=later.append)
    bus.subscribe(ALL, on_event=sink)
    _record_and_mutate(bus)
    gate.set()
    assert sink.close(30)
    later_wrong, later_kinds = _count_wrong([e.data for e in later], _wrong_live)
    queued_wrong, queued_kinds = _count_wrong([e.data for e in queued], _wrong_live)
    queued_json, _ = _count_wrong([json.loads(e.to_json())["data"] for e in queued],
                                  _wrong_decoded)
    figure(23, f"later subscriber: wrong values {later_wrong} of {len(later)}; queue drained "
               f"after the changes: {queued_wrong} of {len(queued)} (encoded there: "
               f"{queued_json} wrong)")
    assert len(later) == len(queued) == N
    assert (later_wrong, later_kinds) == (0, set())
    assert (queued_wrong, queued_kinds) == (0, set())
    assert queued_json == 0


def test_jsonl_file_holds_record_time_values(tmp_path: Path,
                                             figure: Callable[[int, str], None]) -> None:
    """The JSONL recorder, encoding on its own thread, writes record()-time values:
    wrong values 0 of N."""
    bus = Bus("snap-jsonl")
    path = tmp_path / "events.jsonl"
    rec = JsonlRecorder(path, max_events=10 * N)
    bus.subscribe(ALL, on_event=rec)
    _record_and_mutate(bus)
    assert rec.close(30)
    datas = [r["data"] for r in read_jsonl(path)]
    wrong, kinds = _count_wrong(datas, _wrong_decoded)
    figure(23, f"JSONL file: wrong values {wrong} of {len(datas)}")
    assert len(datas) == N
    assert (wrong, kinds) == (0, set())


@pytest.fixture
def store() -> Iterator[Any]:
    """A real TCPStore server on a free port."""
    dist = pytest.importorskip("torch.distributed")
    yield dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                        timeout=datetime.timedelta(seconds=10))


def test_store_transport_carries_record_time_values(store: Any,
                                                    figure: Callable[[int, str], None]) -> None:
    """Through StoreForwarder -> real TCPStore -> StoreReceiver, the agent's bus sees
    record()-time values: wrong values 0 of N."""
    key = worker_key("eventbus/snap/0", 0)
    src = Bus("snap-src")
    dst = Bus("snap-dst")
    got: list[Event] = []
    dst.subscribe(EventType.METRIC, on_event=got.append)
    fwd = StoreForwarder(host="127.0.0.1", port=store.port, key=key, rank=0, bus=src)
    _record_and_mutate(src)
    assert fwd.close(10.0)
    rx = StoreReceiver(bus=dst, host="127.0.0.1", port=store.port, connect_timeout=10)
    rx.watch(key, kind="w", rank=0)
    try:
        assert rx.drain(timeout=10)
    finally:
        rx.close()
    wrong, kinds = _count_wrong([e.data for e in got], _wrong_decoded)
    figure(23, f"store transport: wrong values {wrong} of {len(got)}")
    assert len(got) == N
    assert (wrong, kinds) == (0, set())


def test_a_subscriber_write_raises_and_the_next_subscriber_sees_the_original(
        figure: Callable[[int, str], None]) -> None:
    """Every write into event.data, at any depth, raises TypeError naming the event type,
    and the next subscriber sees the data unchanged."""
    bus = Bus("snap-write", strict=True)
    attempts: list[Callable[[Any], object]] = [
        lambda d: d.__setitem__("x", 1), lambda d: d.pop("lst"), lambda d: d.update(x=1),
        lambda d: d.setdefault("x", 1), lambda d: d.clear(), lambda d: d.popitem(),
        lambda d: d.__delitem__("i"), lambda d: d["lst"].append(1),
        lambda d: d["lst"].__setitem__(0, 9), lambda d: d["lst"].sort(),
        lambda d: d["nested"]["a"][0]["b"].extend([1]), lambda d: d["nested"].pop("a"),
        lambda d: d["st"].add(5), lambda d: d["dct"].__ior__({"v": 9}),
    ]
    raised: list[str] = []

    def writer(event: Event) -> None:
        for attempt in attempts:
            try:
                attempt(event.data)
            except TypeError as exc:
                raised.append(str(exc))
    seen: list[Event] = []
    bus.subscribe(EventType.METRIC, on_event=writer)
    bus.subscribe(EventType.METRIC, on_event=seen.append)
    bus.record(EventType.METRIC, step=0, data=_Live().data(0))
    figure(23, f"subscriber writes into event.data: {len(raised)} of {len(attempts)} raised "
               f"TypeError; the next subscriber's data changed: {bool(_wrong_live(seen[0].data))}")
    assert len(raised) == len(attempts)
    assert all(msg.startswith("METRIC event data is read-only") for msg in raised)
    assert _wrong_live(seen[0].data) == []
    assert seen[0].data["lst"] == [0] and "x" not in seen[0].data


def test_read_only_data_behaves_as_plain_data_for_readers() -> None:
    """Read-only data compares equal to plain data, dumps as JSON, pickles, copies and
    round-trips through to_json/from_json unchanged."""
    plain = {"a": [1, {"b": (2, 3)}], "s": {4}, "f": 1.5, "n": None}
    event = eventbus.Metric(step=1, data=plain)
    assert event.data == plain and isinstance(event.data, dict)
    assert json.dumps(event.data, default=sorted) == json.dumps(plain, default=sorted)
    assert pickle.loads(pickle.dumps(event.data)) == plain
    assert copy.deepcopy(event.data) == plain
    assert type(dict(event.data)) is dict and type(event.data.copy()) is dict
    listed = eventbus.Metric(step=1, data={"a": [1, {"b": [2, 3]}], "f": 1.5, "n": None})
    assert Event.from_json(listed.to_json()) == listed
    mutable = dict(event.data)
    mutable["new"] = 1  # a copy is the caller's to change
    with pytest.raises(TypeError, match="METRIC event data is read-only"):
        pickle.loads(pickle.dumps(event.data))["a"].append(1)


def test_a_constructed_event_is_a_snapshot_too() -> None:
    """An event built with its constructor (then published) copies data like record()."""
    mine = {"l": [1]}
    event = eventbus.WorkerExit(worker_id=0, exit_code=0, data=mine)
    mine["l"].append(2)
    assert event.data == {"l": [1]}
    with pytest.raises(TypeError, match="WORKER_EXIT event data is read-only"):
        event.data["l"].append(3)


def test_a_tensor_over_the_bound_is_summarised_not_copied() -> None:
    """A tensor or array of more than MAX_ARRAY_BYTES becomes its summary (shape, dtype,
    device, first values); a small one is a private copy."""
    big = torch.zeros(MAX_ARRAY_BYTES // 4 + 1)
    big_np = np.zeros(MAX_ARRAY_BYTES // 8 + 1)
    small = torch.ones(4, requires_grad=True)
    event = eventbus.Metric(data={"big": big, "big_np": big_np, "small": small})
    summary = event.data["big"]["$tensor"]
    assert summary["shape"] == (big.numel(),) and summary["device"] == "cpu"
    assert summary["dtype"] == "float32" and len(summary["head"]) == 8
    assert event.data["big_np"]["$tensor"]["numel"] == big_np.size
    copied = event.data["small"]
    assert copied is not small and not copied.requires_grad and copied.tolist() == [1.0] * 4
    assert json.loads(event.to_json())["data"]["big"]["$tensor"]["numel"] == big.numel()


def test_scalars_are_shared_and_a_self_containing_dict_is_bounded() -> None:
    """Immutable values are shared, not copied; a dict that contains itself is copied to
    a bounded depth and still encodes."""
    text = "x" * 100
    event = eventbus.Metric(data={"t": text, "n": 3})
    assert event.data["t"] is text
    loop: dict[str, Any] = {}
    loop["self"] = loop
    assert "$truncated" in eventbus.Metric(data={"loop": loop}).to_json()


def test_a_queue_counts_the_tensor_copies_it_holds(figure: Callable[[int, str], None]) -> None:
    """Each queued event holds its own tensor copy, and the queue's byte bound counts it:
    a sink that never drains keeps at most max_bytes of copies, the rest dropped."""
    bus = Bus("snap-bytes")
    stuck = threading.Event()
    sink = QueuedSink(lambda batch: stuck.wait(30), name="stuck", max_bytes=8 * 2**20,
                      max_events=10_000, max_batch=1)
    bus.subscribe(ALL, on_event=sink)
    acc = torch.zeros(MAX_ARRAY_BYTES // 4)  # 1 MiB: copied, not summarised
    for i in range(40):
        acc += 1
        bus.record(EventType.METRIC, step=i, data={"acc": acc})
    stats = sink.stats()
    figure(23, f"queue of 1 MiB tensor snapshots, 8 MiB bound: {stats['pending']} held, "
               f"{sum(stats['dropped'].values())} dropped of 40")
    assert stats["queued_bytes"] <= 8 * 2**20
    assert sum(stats["dropped"].values()) >= 40 - 9
    stuck.set()
    sink.close(10)
