"""The stats() view: "nothing lost" is something a user can check in production.

For every subscription ``published == delivered + failed + filtered``; for a subscriber
that queues, ``delivered == handled + failed + pending + dropped`` (per reason).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import eventbus
from eventbus import Bus
from eventbus import Event
from eventbus.subscribers.queued import QueuedSink

N = 5_000


def _broken(event: Event) -> None:
    if event.fields()["step"] % 10 == 0:
        raise RuntimeError("every tenth")


def _accounts(sub: dict[str, Any]) -> bool:
    if sub["published"] != sub["delivered"] + sub["failed"] + sub["filtered"]:
        return False
    if "sink" in sub:
        sink = sub["sink"]
        return bool(sub["delivered"] == sink["handled"] + sink["failed"] + sub["pending"]
                    + sum(sub["dropped"].values()))
    return True


def test_every_event_is_accounted_for_per_subscriber(
    bus: Bus, figure: Callable[[int | str, str], None],
) -> None:
    """A plain, a sometimes-raising, a filtering and a queued subscriber whose sink is
    stuck (so its queue overflows): stats() accounts for every published event of each."""
    kept: list[Event] = []
    bus.subscribe("METRIC", on_event=kept.append)
    bus.subscribe("METRIC", on_event=_broken)
    bus.subscribe(eventbus.ALL, on_event=kept.append,
                  where=lambda e: e.type == "METRIC" and e.fields()["step"] % 2 == 0)
    gate = threading.Event()

    def stuck(batch: Sequence[Event]) -> None:
        gate.wait(60)

    sink = QueuedSink(stuck, name="stuck", max_events=1_000, overflow="drop-oldest")
    bus.subscribe("METRIC", on_event=sink)
    for i in range(N):
        bus.record("METRIC", step=i)
    bus.record("EPOCH_END", epoch=1)

    stats = bus.stats()
    assert stats["published"] == {"METRIC": N, "EPOCH_END": 1}
    subs = stats["subscribers"]
    assert [s["failed"] for s in subs] == [0, N // 10, 0, 0]
    assert subs[2]["filtered"] == N // 2 + 1
    queued = subs[3]
    assert queued["dropped"]["queue full"] > 0
    assert queued["pending"] > 0
    assert all(_accounts(s) for s in subs), subs

    gate.set()
    assert sink.flush(timeout=30)
    after = bus.stats()["subscribers"][3]
    assert after["pending"] == 0
    assert _accounts(after)
    figure("stats", "published == delivered + failed + filtered for 4/4 subscribers; "
              f"queue: {after['sink']['handled']:,} handled + {sum(after['dropped'].values()):,}"
              f" dropped {after['dropped']} == {after['delivered']:,} delivered")
    sink.close(timeout=5)


def test_plain_subscribers_report_no_drops(bus: Bus) -> None:
    """A synchronous subscriber has dropped {} and pending 0, also when its object happens
    to have an unrelated stats attribute."""

    class HasStats:
        pending = "not a count"

        def stats(self) -> str:
            return "unrelated"

        def __call__(self, event: Event) -> None:
            pass

    bus.subscribe("METRIC", on_event=HasStats())
    bus.record("METRIC", step=1)
    (sub,) = bus.stats()["subscribers"]
    assert sub["dropped"] == {} and sub["pending"] == 0 and sub["delivered"] == 1
