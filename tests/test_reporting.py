"""The rate limiter behind every failure report (eventbus/_reporting.py)."""

from __future__ import annotations

from eventbus._reporting import RateLimiter


def test_the_first_occurrence_is_reported_with_nothing_held() -> None:
    """A new limiter lets the first occurrence through, with 0 held back, at any clock."""
    assert RateLimiter().allow(10.0, now=0.0) == 0
    assert RateLimiter().allow(1e9, now=-1e6) == 0


def test_within_the_interval_occurrences_are_held_and_counted() -> None:
    """Inside the interval allow() says None and counts; the next report gets the count."""
    limiter = RateLimiter()
    assert limiter.allow(10.0, now=100.0) == 0
    assert [limiter.allow(10.0, now=100.0 + t) for t in (1, 2, 9.9)] == [None] * 3
    assert limiter.held == 3
    assert limiter.allow(10.0, now=110.0) == 3  # 10 s after the last report
    assert limiter.held == 0
    assert limiter.allow(10.0, now=115.0) is None  # a new interval started at 110


def test_amounts_are_held_and_returned_without_the_current_one() -> None:
    """allow(interval, n) holds back n (events lost at once); a report gets what was held
    before it, so the caller's "since the last report" figure is held + n."""
    limiter = RateLimiter()
    assert limiter.allow(10.0, 5, now=0.0) == 0
    assert limiter.allow(10.0, 7, now=1.0) is None
    assert limiter.allow(10.0, 0, now=2.0) is None  # e.g. a connect failure, nothing lost
    held = limiter.allow(10.0, 4, now=10.0)
    assert (held, limiter.held) == (7, 0)


def test_force_reports_inside_the_interval() -> None:
    """force=True (a final report at close) goes out at once and restarts the interval."""
    limiter = RateLimiter()
    limiter.allow(10.0, now=0.0)
    limiter.allow(10.0, now=1.0)
    assert limiter.allow(10.0, force=True, now=2.0) == 1
    assert limiter.allow(10.0, now=3.0) is None


def test_the_interval_is_read_on_every_call() -> None:
    """A changed interval applies at once (tests patch eventbus.bus.REPORT_INTERVAL_S)."""
    limiter = RateLimiter()
    limiter.allow(1e9, now=0.0)
    assert limiter.allow(1e9, now=5.0) is None
    assert limiter.allow(0.0, now=5.0) == 1


def test_the_store_forwarders_loss_report_fits() -> None:
    """The forwarder's _note_loss shape: count per reason, report new-since-last-report."""
    limiter = RateLimiter()
    lost: dict[str, int] = {}
    reports: list[tuple[str, int, int]] = []

    def note_loss(n: int, reason: str, now: float) -> None:
        if n:
            lost[reason] = lost.get(reason, 0) + n
        held = limiter.allow(10.0, n, now=now)
        if held is None:
            return
        reports.append((reason, held + n, sum(lost.values())))

    note_loss(3, "store unreachable", 0.0)
    note_loss(2, "store unreachable", 1.0)
    note_loss(0, "cannot connect", 2.0)
    note_loss(4, "queue_push failed", 12.0)
    assert reports == [("store unreachable", 3, 3), ("queue_push failed", 6, 9)]
