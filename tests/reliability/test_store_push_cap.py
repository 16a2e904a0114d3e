"""Row 17, the store side: huge payloads never make the forwarder push more than its cap,
and the receiver refuses values over its own cap unread."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from matrix import KEYS
from matrix import STRING_CHARS
from matrix import deep_dict

import eventbus
from eventbus import EventType
from eventbus.encoding import LIMITS


@pytest.mark.slow
def test_forwarder_pushes_stay_under_the_cap(
    store: Any, figure: Callable[[int, str], None],
) -> None:
    """A 100 MiB string (8 MiB in CI), 1e6 keys (1e5 in CI), depth 10,000, and 40 events
    of ~900 KB each: every value pushed is at most MAX_PUSH_BYTES, and every event arrives,
    decodable, with the truncation markers, or is reported dropped by the sender (the
    100 MiB one is over the forwarder queue's 64 MiB max_bytes)."""
    from eventbus.publishers.store_receiver import StoreReceiver
    from eventbus.subscribers.store_forwarder import StoreForwarder
    from eventbus.wire import MAX_PUSH_BYTES

    src = eventbus.Bus("row17-worker")
    fwd = StoreForwarder(host="127.0.0.1", port=store.port, key="row17/w0", rank=0, bus=src)
    eventbus.set_context(rank=0)
    try:
        src.record(EventType.METRIC, step=0, data={"blob": "x" * STRING_CHARS})
        src.record(EventType.METRIC, step=1, data={f"k{i}": i for i in range(KEYS)})
        src.record(EventType.METRIC, step=2, data=deep_dict(10_000))
        for i in range(40):
            src.record(EventType.METRIC, step=3 + i, data={"blob": "y" * 900_000})
        assert fwd.close(60)
    finally:
        eventbus.refresh_context()
        fwd.close(1)

    raw = store  # the test's own client: pop the raw values to measure them
    values = []
    dist = pytest.importorskip("torch.distributed")
    empty = getattr(dist, "QueueEmptyError", RuntimeError)
    while True:
        try:
            values.append(raw.queue_pop("row17/w0", block=False))
        except empty:
            break
    sizes = [len(v) for v in values]

    bus = eventbus.Bus("row17-agent")
    got: list[eventbus.Event] = []
    bus.subscribe(eventbus.ALL, on_event=got.append)
    rx = StoreReceiver(bus=bus, client=store)
    for value in values:
        rx.handle_value("row17/w0", value, kind="w", rank=0)
    by_step = {e.fields()["step"]: e for e in got if e.type == EventType.METRIC}
    reported = {e.fields()["reason"]: e.fields()["count"] for e in got
                if e.type == EventType.EVENTS_LOST}
    figure(17, f"store: max push {max(sizes):,} bytes (cap {MAX_PUSH_BYTES:,}) over "
               f"{len(sizes)} pushes; events delivered {len(by_step)}/43, reported "
               f"dropped {reported}")
    assert max(sizes) <= MAX_PUSH_BYTES
    assert len(by_step) + sum(reported.values()) == 43
    assert set(by_step) >= set(range(1, 43))
    # over the per-event limit: cut, and marked as cut (the forwarder replaces the whole
    # data of such an event by a "$truncated" summary) ...
    if 0 in by_step:
        assert "$truncated" in by_step[0].data or by_step[0].data["blob"].endswith("chars]")
    else:  # ... or, over the queue's max_bytes (the 100 MiB string), dropped and counted
        assert reported == {"dropped by sender: too large": 1}
    assert "$truncated" in by_step[1].data
    assert "truncated" in str(by_step[2].data)
    assert rx.stats()["rejected"] == {}


def test_receiver_refuses_values_over_its_cap_unread(
    store: Any, figure: Callable[[int, str], None],
) -> None:
    """A 7 MiB value (the store server itself refuses 8 MiB and more) is rejected as "value
    too large" before any decoding; the next valid value is delivered."""
    from eventbus.publishers.store_receiver import StoreReceiver
    from eventbus.wire import MAX_VALUE_BYTES
    from eventbus.wire import BatchEncoder

    bus = eventbus.Bus("row17-agent")
    got: list[eventbus.Event] = []
    bus.subscribe(EventType.EPOCH_END, on_event=got.append)
    rx = StoreReceiver(bus=bus, client=store)
    rx.watch("row17/big", kind="w", rank=0)
    store.queue_push("row17/big", b"{" + b" " * (7 << 20) + b"}")
    ctx = eventbus.JobContext(rank=0)
    ((value, _),) = BatchEncoder(kind="w", rank=0).encode(
        [eventbus.EpochEnd(epoch=1, context=ctx)])
    store.queue_push("row17/big", value)
    rx.drain(timeout=30)
    assert rx.stats()["rejected"] == {"value too large": 1}
    assert [e.fields()["epoch"] for e in got] == [1]
    assert MAX_VALUE_BYTES < 8 << 20
    assert LIMITS.max_line_bytes < MAX_VALUE_BYTES
    figure(17, f"receiver: 7 MiB value rejected unread (cap {MAX_VALUE_BYTES:,}); valid "
               "delivered 1/1")
