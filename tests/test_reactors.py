"""The restart reactors in subscribers/reactors.py, on real events and a real bus."""

from __future__ import annotations

import math

import pytest

import eventbus
from eventbus import Bus
from eventbus import Decision
from eventbus import EventType
from eventbus import JobContext
from eventbus import WorkerExit
from eventbus.subscribers.reactors import NonRetriableExitCodes
from eventbus.subscribers.reactors import RestartBudget
from eventbus.subscribers.reactors import StopOnNonFiniteLoss


def _exit(code: int, *, rank: int = 1, attempt: int = 0, signal: str | None = None,
          message: str | None = None, data: dict[str, object] | None = None) -> WorkerExit:
    return WorkerExit(worker_id=rank, exit_code=code, signal=signal, message=message,
                      data={"attempt": attempt, **(data or {})},
                      context=JobContext(run_id="job", restart_count=attempt))


def test_non_retriable_codes_stop_others_have_no_opinion() -> None:
    """Listed exit codes and signals give STOP; anything else no decision."""
    reactor = NonRetriableExitCodes({3, 4}, signals={"sigsegv"})
    assert reactor(_exit(3)) is Decision.STOP
    assert reactor(_exit(4)) is Decision.STOP
    assert reactor(_exit(-11, signal="SIGSEGV")) is Decision.STOP
    assert reactor(_exit(1)) is None
    assert reactor(_exit(-9, signal="SIGKILL")) is None


def test_non_retriable_rejects_bad_configuration() -> None:
    """Empty, non-int codes and non-signal names are errors that name the problem."""
    with pytest.raises(ValueError, match="at least one"):
        NonRetriableExitCodes()
    with pytest.raises(TypeError, match="exit_codes must be ints"):
        NonRetriableExitCodes({"3"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="SIGSEGV"):
        NonRetriableExitCodes({1}, signals={"segv"})


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_restart_budget_stops_a_crash_loop_and_backs_off() -> None:
    """2 restarts per 60 s window: the third failure inside it is a STOP; backoff doubles."""
    clock = _Clock()
    budget = RestartBudget(2, 60, backoff_s=1.0, backoff_factor=2.0, clock=clock,
                           sleep=clock.sleep)
    assert budget(_exit(1, attempt=0)) is Decision.RESTART
    assert budget(_exit(1, attempt=1)) is Decision.RESTART
    assert clock.slept == [1.0, 2.0]
    assert budget(_exit(1, attempt=2)) is Decision.STOP


def test_restart_budget_window_slides() -> None:
    """Restarts older than the window no longer count."""
    clock = _Clock()
    budget = RestartBudget(1, 10, clock=clock, sleep=clock.sleep)
    assert budget(_exit(1, attempt=0)) is Decision.RESTART
    clock.now += 10.5
    assert budget(_exit(1, attempt=1)) is Decision.RESTART
    assert budget(_exit(1, attempt=2)) is Decision.STOP
    assert clock.slept == []


def test_restart_budget_counts_a_group_failure_once() -> None:
    """Several workers failing in the same attempt use one restart, not one each."""
    clock = _Clock()
    budget = RestartBudget(1, 60, clock=clock, sleep=clock.sleep)
    assert budget(_exit(1, rank=0, attempt=0)) is Decision.RESTART
    assert budget(_exit(-15, rank=1, attempt=0, signal="SIGTERM")) is Decision.RESTART
    assert budget(_exit(1, rank=0, attempt=1)) is Decision.STOP


def test_restart_budget_backoff_is_capped() -> None:
    """The backoff grows geometrically up to max_backoff_s."""
    budget = RestartBudget(10, 60, backoff_s=1.0, backoff_factor=3.0, max_backoff_s=5.0)
    assert [budget.backoff_delay(n) for n in (1, 2, 3, 4)] == [1.0, 3.0, 5.0, 5.0]


def test_restart_budget_rejects_bad_configuration() -> None:
    """Negative budgets, empty windows and shrinking backoff are refused by name."""
    with pytest.raises(ValueError, match="max_restarts"):
        RestartBudget(-1, 60)
    with pytest.raises(ValueError, match="window_s"):
        RestartBudget(1, 0)
    with pytest.raises(ValueError, match="backoff_factor"):
        RestartBudget(1, 60, backoff_factor=0.5)


def test_non_finite_loss_reported_by_a_worker_stops() -> None:
    """A METRIC with a NaN loss seen on the bus before the failure makes the failure a STOP."""
    bus = Bus("test-loss")
    reactor = StopOnNonFiniteLoss()
    reactor.attach(bus)
    reactor.attach(bus)  # idempotent
    worker = JobContext(run_id="job", restart_count=0, rank=1)
    bus.publish(eventbus.Metric(step=1, data={"loss": 0.5}, context=worker))
    assert reactor(_exit(1, attempt=0)) is None
    bus.publish(eventbus.Metric(step=2, data={"loss": math.nan}, context=worker))
    assert reactor(_exit(1, attempt=0)) is Decision.STOP
    # Another attempt with a fine loss is not held against it.
    assert reactor(_exit(1, attempt=1)) is None
    reactor.detach()
    bus.publish(eventbus.Metric(step=3, data={"loss": math.inf},
                                context=JobContext(run_id="job", restart_count=1)))
    assert reactor(_exit(1, attempt=1)) is None


def test_non_finite_loss_in_the_exit_itself_stops() -> None:
    """The failed worker's own message or data can carry the non-finite loss."""
    reactor = StopOnNonFiniteLoss()
    assert reactor(_exit(1, data={"loss": {"$float": "Infinity"}})) is Decision.STOP
    assert reactor(_exit(1, message="FloatingPointError: loss is nan")) is Decision.STOP
    assert reactor(_exit(1, message="CUDA out of memory")) is None


def test_non_finite_loss_reads_tensor_values() -> None:
    """A 0-d tensor loss recorded as is counts."""
    torch = pytest.importorskip("torch")
    bus = Bus("test-loss-tensor")
    reactor = StopOnNonFiniteLoss()
    reactor.attach(bus)
    bus.record(EventType.EPOCH_END, epoch=1, data={"loss": torch.tensor(float("nan"))})
    ctx = eventbus.current_context()
    event = WorkerExit(worker_id=0, exit_code=1, context=ctx,
                       data={"attempt": ctx.restart_count})
    assert reactor(event) is Decision.STOP
