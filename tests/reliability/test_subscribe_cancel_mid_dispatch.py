"""Row 7: subscribe and cancel from inside a dispatch take effect from the next event."""

from __future__ import annotations

import random
from collections.abc import Callable

import eventbus
from eventbus import Bus
from eventbus import Event

RUNS = 1_000
EVENTS = 6


def _one_run(rng: random.Random) -> list[str]:
    """One randomized run; returns the violations found (empty when the bus is right)."""
    bus = Bus("row7")
    n = rng.randint(2, 8)
    got: dict[str, list[int]] = {}
    subs: dict[str, eventbus.Subscription] = {}

    def collector(name: str) -> Callable[[Event], None]:
        got[name] = []
        return lambda e: got[name].append(e.fields()["step"])

    actor = rng.randrange(n)
    victim = rng.randrange(n)  # may be before the actor, after it, or the actor itself
    trigger = rng.randrange(EVENTS - 1)
    new_kind = rng.choice(["METRIC", eventbus.ALL])

    def make(i: int) -> Callable[[Event], None]:
        inner = collector(f"s{i}")
        if i != actor:
            return inner

        def act(event: Event) -> None:
            inner(event)
            if event.fields()["step"] == trigger:
                subs["B"] = bus.subscribe(new_kind, on_event=collector("B"))
                subs[f"s{victim}"].cancel()
                subs[f"s{victim}"].cancel()  # idempotent
        return act

    for i in range(n):
        subs[f"s{i}"] = bus.subscribe("METRIC", on_event=make(i))
    for step in range(EVENTS):
        bus.record("METRIC", step=step)

    everything = list(range(EVENTS))
    expected = {f"s{i}": everything for i in range(n)}
    # the victim still gets the event being dispatched (the snapshot), none after it
    expected[f"s{victim}"] = list(range(trigger + 1))
    # the newcomer starts with the next event
    expected["B"] = list(range(trigger + 1, EVENTS))
    return [f"{name}: got {got.get(name)} expected {want} (n={n} actor={actor} "
            f"victim={victim} trigger={trigger} kind={new_kind})"
            for name, want in expected.items() if got.get(name) != want]


def test_subscribe_and_cancel_mid_dispatch_randomized(
    figure: Callable[[int, str], None],
) -> None:
    """1,000 randomized runs: a subscriber subscribes B and cancels C while an event is
    being dispatched; B gets events from the next one on, C gets the current one and no
    later one; every other subscriber gets every event."""
    rng = random.Random(20261129)
    violations: list[str] = []
    for _ in range(RUNS):
        violations += _one_run(rng)
    figure(7, f"violations {len(violations)} in {RUNS:,} randomized runs")
    assert violations == [], violations[:5]
