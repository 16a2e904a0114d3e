"""Property: any mix of subscribe, cancel and record calls from several threads delivers
exactly what a simple sequential model predicts.

Each thread runs its own generated program against one shared bus. Subscriptions to the
thread's own event type need no filter; subscriptions to the shared METRIC type and to
ALL carry a ``where`` that keeps the thread's own events, so what each subscriber must
get does not depend on how the threads interleave, while the threads still race on the
same bus: on the shared METRIC and ALL signals, on every snapshot rebuild, on the lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import attrs
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import eventbus
from eventbus import Bus
from eventbus import Event

THREADS = 3

# one event type per thread, recorded only by that thread
_OWN: list[type[Event]] = []
for _t in range(THREADS):
    _name = f"PROPERTY_T{_t}"
    _cls = eventbus.event_types().get(_name)
    if _cls is None:
        _cls = eventbus.event_type(_name)(type(f"PropertyT{_t}", (Event,), {
            "__annotations__": {"v": "int"}, "__module__": __name__}))
    _OWN.append(_cls)


@attrs.define
class _ModelSub:
    kind: str  # "own", "METRIC" or "ALL"
    once: bool
    mod: int | None
    active: bool = True


# -- the programs ---------------------------------------------------------------------------

_subscribe = st.tuples(st.just("sub"), st.sampled_from(["own", "METRIC", "ALL"]),
                       st.booleans(), st.sampled_from([None, 2, 3]))
_cancel = st.tuples(st.just("cancel"), st.integers(0, 20))
_record = st.tuples(st.just("record"), st.sampled_from(["own", "METRIC"]),
                    st.integers(0, 1_000))
_program = st.lists(st.one_of(_subscribe, _cancel, _record, _record), max_size=40)


def _model(program: list[tuple[Any, ...]]) -> list[tuple[int, str, int]]:
    """What the thread's subscribers receive, in order: (subscription index, kind, v)."""
    subs: list[_ModelSub] = []
    out: list[tuple[int, str, int]] = []
    for op in program:
        if op[0] == "sub":
            subs.append(_ModelSub(op[1], op[2], op[3]))
        elif op[0] == "cancel":
            if subs:
                subs[op[1] % len(subs)].active = False
        else:
            _, kind, v = op
            for i, s in enumerate(subs):
                if not s.active or s.kind not in (kind, "ALL"):
                    continue
                if s.mod is not None and v % s.mod:
                    continue
                out.append((i, kind, v))
                if s.once:
                    s.active = False
    return out


def _where(tid: int, kind: str, mod: int | None) -> Callable[[Event], bool] | None:
    """The thread's own events (not needed for its own type), divisible by ``mod``."""
    if mod is None and kind == "own":
        return None

    def where(event: Event) -> bool:
        if event.data.get("t") != tid:
            return False
        value = event.fields()["step" if event.type == "METRIC" else "v"]
        return mod is None or value % mod == 0

    return where


def _run(bus: Bus, tid: int, program: list[tuple[Any, ...]], start: threading.Barrier,
         log: list[tuple[int, str, int]], subs: list[eventbus.Subscription]) -> None:
    own = _OWN[tid]

    def on_event(index: int) -> Callable[[Event], None]:
        def receive(event: Event) -> None:
            kind = "METRIC" if event.type == "METRIC" else "own"
            value = event.fields()["step" if kind == "METRIC" else "v"]
            log.append((index, kind, value))
        return receive

    start.wait(30)
    for op in program:
        if op[0] == "sub":
            _, kind, once, mod = op
            where = _where(tid, kind, mod)
            target: Any = {"own": own, "METRIC": "METRIC", "ALL": eventbus.ALL}[kind]
            subs.append(bus.subscribe(target, on_event=on_event(len(subs)), once=once,
                                      where=where))
        elif op[0] == "cancel":
            if subs:
                subs[op[1] % len(subs)].cancel()
        elif op[1] == "own":
            bus.record(own, v=op[2], data={"t": tid})
        else:
            bus.record("METRIC", step=op[2], data={"t": tid})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_program, min_size=THREADS, max_size=THREADS))
def test_concurrent_subscribe_cancel_record_match_the_model(
    programs: list[list[tuple[Any, ...]]],
) -> None:
    """Several threads subscribing (to one type, a shared type, ALL; once; where),
    cancelling and recording on one bus: each thread's subscribers receive exactly the
    sequence the sequential model of that thread's program predicts."""
    bus = Bus("property", strict=True)
    start = threading.Barrier(THREADS)
    logs: list[list[tuple[int, str, int]]] = [[] for _ in range(THREADS)]
    subs: list[list[eventbus.Subscription]] = [[] for _ in range(THREADS)]
    errors: list[BaseException] = []

    def guarded(tid: int) -> None:
        try:
            _run(bus, tid, programs[tid], start, logs[tid], subs[tid])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(t,)) for t in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive()
    assert errors == []
    for tid in range(THREADS):
        assert logs[tid] == _model(programs[tid]), f"thread {tid}"
        # stats() of the thread's own-type subscriptions (no other thread records that
        # type, so the count is exact): delivered = what the model says it got
        model_subs = [op for op in programs[tid] if op[0] == "sub"]
        for index, (sub, op) in enumerate(zip(subs[tid], model_subs, strict=True)):
            if op[1] != "own" or not sub.active:
                continue
            expected = sum(1 for i, _, _ in logs[tid] if i == index)
            assert sub.stats()["delivered"] == expected
