"""eventbus.app.heap.no_collection, and the agent's large builds that run under it: the
judge's stall check and verdict, the job view's snapshot."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest

from eventbus.app.health.watches import StallWatch
from eventbus.app.heap import no_collection
from eventbus.app.ui.state import JobState
from tests.test_judge import Clock
from tests.test_judge import _hung_rank_1


@pytest.fixture(autouse=True)
def _collecting() -> Iterator[None]:
    """Each test starts with automatic collection on, and leaves it as it found it."""
    enabled = gc.isenabled()
    gc.enable()
    yield
    if not enabled:
        gc.disable()


def test_collection_is_off_inside_and_back_on_after() -> None:
    with no_collection():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_an_exception_turns_collection_back_on() -> None:
    with pytest.raises(KeyError), no_collection():
        raise KeyError("x")
    assert gc.isenabled()


def test_nested_pauses_end_with_the_outermost() -> None:
    with no_collection():
        with no_collection():
            pass
        assert not gc.isenabled()
    assert gc.isenabled()


def test_collection_left_off_by_the_caller_stays_off() -> None:
    gc.disable()
    with no_collection():
        pass
    assert not gc.isenabled()


def test_the_judge_checks_and_judges_with_collection_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The stall check and the culprit analysis (tens of thousands of objects at 8,192
    ranks) both run with collection off, and it is back on after each."""
    seen: list[tuple[str, bool]] = []
    judge, _ = _hung_rank_1(Clock())
    real_overdue, real_analyze = StallWatch.overdue, judge._analyze

    def overdue(self: StallWatch, *args: Any) -> Any:
        seen.append(("overdue", gc.isenabled()))
        return real_overdue(self, *args)

    def analyze(*args: Any, **kwargs: Any) -> Any:
        seen.append(("analyze", gc.isenabled()))
        return real_analyze(*args, **kwargs)

    monkeypatch.setattr(StallWatch, "overdue", overdue)
    monkeypatch.setattr(judge, "_analyze", analyze)
    late = judge.overdue(0, [0, 1])
    assert gc.isenabled()
    assert judge.verdict(0, late, is_judge=True, ranks=[0, 1]) is not None
    assert gc.isenabled()
    assert seen == [("overdue", False), ("analyze", False)]


def test_the_job_views_snapshot_is_built_with_collection_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    state = JobState(live=False)
    seen: list[bool] = []
    real = state._snapshot

    def build(**kwargs: Any) -> dict[str, Any]:
        seen.append(gc.isenabled())
        return real(**kwargs)

    monkeypatch.setattr(state, "_snapshot", build)
    assert state.snapshot()["ranks_total"] == 0
    assert seen == [False] and gc.isenabled()
