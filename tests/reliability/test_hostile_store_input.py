"""Row 19: hostile values in a worker's store queue. Each is rejected and counted per
reason, the receiver's thread keeps running, every valid event is delivered, and nothing
is ever unpickled."""

from __future__ import annotations

import datetime
import json
import pickle
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import eventbus
from eventbus import EventType

KEY = "row19/w0"


class _Exploit:
    marker = Path("/nonexistent")

    def __reduce__(self) -> Any:
        return (open, (str(_Exploit.marker), "w"))


def _valid(seq: int) -> bytes:
    from eventbus.wire import BatchEncoder

    enc = BatchEncoder(kind="w", rank=0, sender="w0:valid")
    enc.seq = seq
    ((value, _),) = enc.encode([eventbus.EpochEnd(epoch=seq,
                                                  context=eventbus.JobContext(rank=0))])
    return value


def _batch(n: int, **overrides: Any) -> bytes:
    batch: dict[str, Any] = {
        "v": 1, "src": f"w0:hostile{n}", "kind": "w", "rank": 0, "seq": 0, "drop": {},
        "ctx": [eventbus.JobContext(rank=0).to_dict()], "end": False,
        "ev": [["EPOCH_END", {"epoch": 1, "timestamp": 1.0, "data": {}, "context": 0}]]}
    batch.update(overrides)
    return json.dumps(batch).encode()


def _hostile() -> dict[str, bytes]:
    ev = "EPOCH_END"
    return {
        "garbage": b"\x00\x01\x02garbage",
        "invalid UTF-8": b"\xff\xfe\xfa\xc3\x28",
        "pickle": pickle.dumps(_Exploit()),
        "empty": b"",
        "JSON but not an object": b"[1, 2, 3]",
        "NaN literal": b'{"v": 1, "src": "w0:x", "kind": "w", "rank": 0, "seq": NaN}',
        "deep nesting": b"[" * 200_000 + b"]" * 200_000,
        "data not an object (a deep list)": _batch(1, ev=[[ev, {
            "epoch": 1, "timestamp": 1.0, "context": 0,
                                         "data": json.loads("[" * 500 + "]" * 500)}]]),
        "unknown wire version": _batch(2, v=99),
        "unknown type": _batch(3, ev=[["NO_SUCH_TYPE", {"timestamp": 1.0, "context": 0}]]),
        "wrong field type": _batch(4, ev=[[ev, {"epoch": "one", "timestamp": 1.0,
                                               "context": 0}]]),
        "unknown field": _batch(5, ev=[[ev, {"epoch": 1, "bogus": 1, "timestamp": 1.0,
                                            "context": 0}]]),
        "bool for int": _batch(6, ev=[[ev, {"epoch": True, "timestamp": 1.0, "context": 0}]]),
        "bad timestamp": _batch(8, ev=[[ev, {"epoch": 1, "timestamp": "noon", "context": 0}]]),
        "spoofed rank (header)": _batch(9, rank=1),
        "spoofed rank (context)": _batch(10, ctx=[eventbus.JobContext(rank=5).to_dict()]),
        "bad context": _batch(11, ctx=[{"rank": "zero"}]),
        "negative seq": _batch(12, seq=-1),
        "bad drop counts": _batch(13, drop={"x": -1}),
        "6+ MiB value": b'{"v": 1, "pad": "' + b"x" * (7 << 20) + b'"}',
    }


@pytest.mark.slow
def test_hostile_values_rejected_counted_receiver_keeps_running(
    store: Any, tmp_path: Path, figure: Callable[[int, str], None],
) -> None:
    """Each hostile value between two valid ones, drained by the receiver's own thread:
    the thread is alive at the end, valid events 100% delivered in order, each hostile
    value counted once under a reason and published as EVENTS_LOST, the pickle never ran;
    a 16 MiB value is refused by the store server itself."""
    from eventbus.publishers.store_receiver import StoreReceiver

    _Exploit.marker = tmp_path / "unpickled"
    hostile = _hostile()
    bus = eventbus.Bus("row19-agent")
    got: list[eventbus.Event] = []
    bus.subscribe(eventbus.ALL, on_event=got.append)
    rx = StoreReceiver(bus=bus, host="127.0.0.1", port=store.port, report_interval=0.0)
    rx.watch(KEY, kind="w", rank=0)
    rx.start()
    try:
        for seq, value in enumerate(hostile.values()):
            store.queue_push(KEY, _valid(seq))
            store.queue_push(KEY, value)
        dist = pytest.importorskip("torch.distributed")
        other = dist.TCPStore("127.0.0.1", store.port, is_master=False,
                              timeout=datetime.timedelta(seconds=10))
        with pytest.raises(RuntimeError):
            other.queue_push(KEY, b"x" * (16 << 20))
        store.queue_push(KEY, _valid(len(hostile)))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and rx.stats()["values"] < 2 * len(hostile) + 1:
            time.sleep(0.05)
        alive = rx._thread is not None and rx._thread.is_alive()
    finally:
        rx.close()

    valid = [e.fields()["epoch"] for e in got if e.type == EventType.EPOCH_END]
    rejected = rx.stats()["rejected"]
    reported = sum(e.fields()["count"] for e in got if e.type == EventType.EVENTS_LOST
                   and e.fields()["reason"].startswith("rejected"))
    figure(19, f"valid delivered {len(valid)}/{len(hostile) + 1} (100%); rejected "
               f"{sum(rejected.values())}/{len(hostile)} by reason {rejected}; receiver "
               f"alive {alive}; unpickled {_Exploit.marker.exists()}")
    assert alive
    assert valid == list(range(len(hostile) + 1))
    assert sum(rejected.values()) == len(hostile)
    assert reported == len(hostile)
    assert not _Exploit.marker.exists()
    assert rejected["value too large"] == 1
    assert rejected["spoofed sender"] == 1 and rejected["spoofed rank"] == 1
