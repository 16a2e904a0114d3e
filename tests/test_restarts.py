"""The restart path without torch (eventbus_app/launcher/recovery/restarts.py): the recovery's
phases fed by the agent's acts and the workers' marks, ``RECOVERED`` once, the
``WORKER_RESTART`` and its line, and when the next attempt's spares start. A bus, a fake
clock, a pool that only counts and a hand-over that only notes the launches."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from collections.abc import Mapping
from collections.abc import Sequence

import pytest

import eventbus
from eventbus.app.launcher.recovery.anatomy import Recovery
from eventbus.app.launcher.recovery.restarts import SPARES_AFTER_S
from eventbus.app.launcher.recovery.restarts import Launched
from eventbus.app.launcher.recovery.restarts import Restarts
from eventbus.app.launcher.recovery.spares import SparePool


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class CountingPool(SparePool):
    """A pool that starts no process: each fill is noted with what it was given."""

    def __init__(self, *, enabled: bool = True) -> None:
        super().__init__(enabled=enabled)
        self.fills: list[dict[int, tuple[str, Sequence[str], Mapping[str, str]]]] = []
        self.low: list[bool] = []
        self.demoted = 0
        self.closed = 0

    def fill(self, workers: Mapping[int, tuple[str, Sequence[str], Mapping[str, str]]], *,
             low: bool = False) -> int:
        self.fills.append(dict(workers))
        self.low.append(low)
        return len(workers)

    def demote(self) -> None:
        self.demoted += 1

    def close(self, timeout: float = 2.0) -> None:
        self.closed += 1


def _serve(pool: SparePool, launched: Launched) -> contextlib.AbstractContextManager[None]:
    """torch's process context stand-in: local ranks 0 and 1 launched."""
    @contextlib.contextmanager
    def serving() -> Iterator[None]:
        launched[0] = (sys.executable, ("-u",), {"RANK": "0"})
        launched[1] = (sys.executable, ("-u",), {"RANK": "1"})
        yield
    return serving()


def _beat(attempt: int, rank: int, marks: dict[str, float]) -> eventbus.WorkerProgress:
    return eventbus.WorkerProgress(worker_id=rank, step=1, data={"marks": marks},
                                   context=eventbus.JobContext(restart_count=attempt))


def _restarts(bus: eventbus.Bus, clock: Clock, pool: CountingPool | None = None) -> Restarts:
    return Restarts(bus, clock=clock, recovery=Recovery(clock),
                    spares=pool if pool is not None else CountingPool(), serve=_serve)


def _start(restarts: Restarts, attempt: int, world: int = 2) -> None:
    with restarts.starting():
        pass
    restarts.started(attempt, world)


def test_recovered_once_every_rank_of_the_new_attempt_sent_its_marks(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Failure seen, decided, rendezvous, workers started: RECOVERED (one line) once both
    ranks' marks of the new attempt came on the bus, not for an older attempt's marks,
    and once only."""
    bus, clock = eventbus.Bus("restarts"), Clock()
    recovered: list[eventbus.Event] = []
    bus.subscribe(eventbus.EventType.RECOVERED, on_event=recovered.append)
    restarts = _restarts(bus, clock)
    restarts.failed()
    clock.now += 0.1
    restarts.decided()
    restarts.rendezvous(1000.2, 1000.4)
    clock.now = 1000.5
    _start(restarts, attempt=1)
    marks = {"script": 1000.7, "torch": 1001.5, "init": 1001.6, "step": 1002.0}
    bus.publish(_beat(1, 0, marks))
    bus.publish(_beat(0, 1, marks))  # attempt 0's: not this recovery's
    restarts.recovered()
    assert recovered == []
    bus.publish(_beat(1, 1, {**marks, "step": 1002.5}))
    restarts.recovered()
    restarts.recovered()
    (event,) = recovered
    assert isinstance(event, eventbus.Recovered)
    assert event.attempt == 1 and event.total_s == 2.5
    assert event.data["phases"]["detect"] == 0.1
    lines = [line for line in capsys.readouterr().err.splitlines()
             if line.startswith("eventbus:")]
    assert len(lines) == 1 and "attempt 1 recovered in" in lines[0]


def _start_on_spares(restarts: Restarts, attempt: int, world: int = 2) -> None:
    """A start whose workers took spares (the process context's hand-over counts them)."""
    with restarts.starting():
        restarts.spares.used += world
    restarts.started(attempt, world)


def test_the_spares_start_with_fresh_workers_and_after_a_restart_on_spares_stepped() -> None:
    """The next attempt's spares start once per attempt, with the launches torch made: at
    once where the attempt's workers started fresh (they warm up while the workers start);
    where they started on spares, after this node's ranks all sent their marks (or
    SPARES_AFTER_S into the attempt), at the lowest priority from their start. Once the
    ranks stepped, the spares are put at the lowest priority, once per attempt. Never
    before a launch, nor during a drain."""
    bus, clock = eventbus.Bus("restarts"), Clock()
    pool = CountingPool()
    restarts = _restarts(bus, clock, pool)
    restarts.fill_spares(0, [0, 1], draining=False)
    assert pool.fills == []  # nothing launched yet: nothing to copy
    _start(restarts, attempt=0)
    restarts.fill_spares(0, [0, 1], draining=True)
    assert pool.fills == []  # a drain starts no new attempt
    restarts.fill_spares(0, [0, 1], draining=False)
    restarts.fill_spares(0, [0, 1], draining=False)
    assert [sorted(f) for f in pool.fills] == [[0, 1]]  # fresh workers: at once, once
    assert pool.fills[0][0][2] == {"RANK": "0"} and pool.low == [False]
    assert pool.demoted == 0  # the workers have not stepped: the spares warm up beside them
    bus.publish(_beat(0, 0, {"step": 1.0}))
    bus.publish(_beat(0, 1, {"step": 1.0}))
    restarts.fill_spares(0, [0, 1], draining=False)
    restarts.fill_spares(0, [0, 1], draining=False)
    assert pool.demoted == 1 and len(pool.fills) == 1
    _start_on_spares(restarts, attempt=1)
    restarts.fill_spares(1, [0, 1], draining=False)
    bus.publish(_beat(1, 0, {"step": 1.0}))
    restarts.fill_spares(1, [0, 1], draining=False)
    assert len(pool.fills) == 1  # rank 1 has not stepped
    bus.publish(_beat(1, 1, {"step": 1.0}))
    restarts.fill_spares(1, [0, 1], draining=False)
    assert len(pool.fills) == 2 and pool.low == [False, True] and pool.demoted == 2
    _start_on_spares(restarts, attempt=2)  # no marks this time: the clock decides
    restarts.fill_spares(2, [0, 1], draining=False)
    assert len(pool.fills) == 2
    clock.now += SPARES_AFTER_S
    restarts.fill_spares(2, [0, 1], draining=False)
    assert len(pool.fills) == 3
    restarts.close()
    assert pool.closed


def test_no_spares_where_no_later_attempt_can_start() -> None:
    """``wanted`` False (no restart left, no room in the round): no spare is started, and
    the pool (the spares and the template) is ended once."""
    bus, clock = eventbus.Bus("restarts"), Clock()
    pool = CountingPool()
    restarts = _restarts(bus, clock, pool)
    _start(restarts, attempt=0)
    restarts.fill_spares(0, [0, 1], draining=False, wanted=False)
    restarts.fill_spares(0, [0, 1], draining=False, wanted=False)
    assert pool.fills == [] and pool.closed == 1


def test_a_later_attempt_can_start_with_a_restart_left_or_room_in_the_round() -> None:
    """What decides ``wanted``: a restart left; else a round below MAX (a node that comes
    re-forms it without a restart); a rendezvous without torch's settings counts as
    room."""
    from types import SimpleNamespace

    from eventbus.app.launcher.recovery.membership import another_attempt_can_start

    def group(nodes: int, max_nodes: int | None) -> SimpleNamespace:
        settings = None if max_nodes is None else SimpleNamespace(max_nodes=max_nodes)
        return SimpleNamespace(group_world_size=nodes, spec=SimpleNamespace(
            rdzv_handler=SimpleNamespace(_settings=settings)))

    assert another_attempt_can_start(group(1, 1), restarts_left=1)
    assert not another_attempt_can_start(group(1, 1), restarts_left=0)  # --standalone
    assert not another_attempt_can_start(group(2, 2), restarts_left=0)
    assert another_attempt_can_start(group(1, 2), restarts_left=0)  # --nnodes 1:2
    assert another_attempt_can_start(group(1, None), restarts_left=0)


def test_disabled_spares_are_never_started() -> None:
    bus, clock = eventbus.Bus("restarts"), Clock()
    pool = CountingPool(enabled=False)
    restarts = _restarts(bus, clock, pool)
    _start(restarts, attempt=0)
    clock.now += SPARES_AFTER_S
    restarts.fill_spares(0, [0, 1], draining=False)
    assert pool.fills == []


def test_worker_restart_is_published_and_said_only_when_no_failure_decided_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A restart a failure decided: its line was the failure's, WORKER_RESTART only. A
    membership change (torch's decision): WORKER_RESTART and its own line."""
    bus = eventbus.Bus("restarts")
    seen: list[eventbus.Event] = []
    bus.subscribe(eventbus.EventType.WORKER_RESTART, on_event=seen.append)
    restarts = _restarts(bus, Clock())
    restarts.restarting(1, restarts_left=1, reason="rank 1 failed (exit code 3)",
                        cause=str(eventbus.Cause.FAILURE), decided=True)
    assert capsys.readouterr().err == ""
    restarts.restarting(2, restarts_left=1, reason="membership change: the group re-forms "
                        "through the rendezvous", cause=str(eventbus.Cause.MEMBERSHIP),
                        decided=False)
    assert [(e.attempt, e.cause) for e in seen if isinstance(e, eventbus.WorkerRestart)] == [
        (1, eventbus.Cause.FAILURE), (2, eventbus.Cause.MEMBERSHIP)]
    assert "re-forms through the rendezvous as attempt 2" in capsys.readouterr().err
    restarts.close()
