"""Row 21: a blocking ``queue_pop`` stalls every other call on its client (measured here),
so the receiver pops without blocking on a client of its own, and the agent's store
calls (rendezvous, barriers) stay fast while it drains."""

from __future__ import annotations

import contextlib
import datetime
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

import eventbus

POP_TIMEOUT_S = 2.0


def _client(port: int, timeout: float) -> Any:
    dist = pytest.importorskip("torch.distributed")
    return dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout))


def _op_latencies(client: Any, n: int = 100) -> list[float]:
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        client.add("row21/counter", 1)
        client.set(f"row21/k{i % 4}", "v")
        out.append(time.perf_counter() - t0)
    return out


@pytest.mark.slow
def test_blocking_pop_stalls_a_shared_client_but_not_the_receivers(
    store: Any, figure: Callable[[int, str], None],
) -> None:
    """The fact: on one client, a get() issued while another thread waits in a blocking
    queue_pop takes about the pop's timeout. The receiver: its client is its own, every
    pop it makes is non-blocking, and the agent's client keeps answering at its usual
    latency while the receiver drains a busy queue."""
    from eventbus.publishers.store_receiver import StoreReceiver
    from eventbus.wire import BatchEncoder

    # -- the fact, measured: a blocking pop on a shared client -------------------------
    shared = _client(store.port, POP_TIMEOUT_S)
    shared.set("row21/x", "1")
    def blocking_pop() -> None:
        with contextlib.suppress(RuntimeError):  # times out after POP_TIMEOUT_S
            shared.queue_pop("row21/empty", block=True)

    popper = threading.Thread(target=blocking_pop)
    popper.start()
    time.sleep(0.2)
    t0 = time.perf_counter()
    shared.get("row21/x")
    stalled = time.perf_counter() - t0
    popper.join(POP_TIMEOUT_S + 30)

    # -- the receiver: own client, non-blocking pops ------------------------------------
    agent = _client(store.port, 30)
    baseline = _op_latencies(agent)
    pops: list[dict[str, Any]] = []
    bus = eventbus.Bus("row21-agent")
    got: list[eventbus.Event] = []
    bus.subscribe(eventbus.EventType.EPOCH_END, on_event=got.append)
    rx = StoreReceiver(bus=bus, host="127.0.0.1", port=store.port)
    assert rx.client is not agent and rx.client is not store

    real = rx.client

    class Spy:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def queue_pop(self, key: str, **kw: Any) -> Any:
            pops.append(kw)
            return real.queue_pop(key, **kw)

    rx.client = Spy()
    rx.watch("row21/w0", kind="w", rank=0)
    rx.watch("row21/w1-idle", kind="w", rank=1)
    enc = BatchEncoder(kind="w", rank=0)
    ctx = eventbus.JobContext(rank=0)
    for i in range(200):
        ((value, _),) = enc.encode([eventbus.EpochEnd(epoch=i, context=ctx)])
        store.queue_push("row21/w0", value)
    rx.start()
    try:
        during = _op_latencies(agent)
        deadline = time.monotonic() + 30
        while len(got) < 200 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        rx.close()

    p99 = sorted(during)[int(len(during) * 0.99)]
    figure(21, f"shared client: get() stalled {stalled:.2f} s behind a blocking pop; agent "
               f"op p99 {p99 * 1e3:.1f} ms while the receiver drains (baseline "
               f"{sorted(baseline)[98] * 1e3:.1f} ms); receiver pops non-blocking "
               f"{sum(kw == {'block': False} for kw in pops)}/{len(pops)}")
    assert stalled > POP_TIMEOUT_S / 2  # the fact the design works around
    assert pops and all(kw == {"block": False} for kw in pops)
    assert [e.fields()["epoch"] for e in got] == list(range(200))
    assert max(during) < POP_TIMEOUT_S / 2  # never behind a blocking pop
