"""Row 22: a real ``python -m eventbus run`` job (2 gloo workers, --max-restarts 1) whose
rank 1 exits 3 on attempt 0. The agent publishes WORKER_EXIT(rank 1, exit 3) within 1 s,
the reactor decides, attempt 1 runs, and no worker event is lost or doubled; every event
carries the attempt it was recorded in."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.launcher_helpers import run_job

JOB = Path(__file__).resolve().parent / "jobs" / "restart_worker.py"
EVENTS = 2_000


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_torchrun_restart_loses_and_doubles_nothing(
    tmp_path: Path, figure: Callable[[int, str], None],
) -> None:
    """WORKER_EXIT(worker_id=1, exit_code=3, attempt 0) within 1 s of the exit; one
    WORKER_RESTART decided by the reactor; both ranks' 2,000 METRIC events of both
    attempts, and rank 0's stream until the agent stopped it, exactly once and without a
    hole, each marked with its attempt (also those drained after the restart); attempt 1
    ends with EPOCH_END from both ranks; the JSONL has no torn or foreign line and no
    EVENTS_LOST."""
    run = run_job(tmp_path,
                  eventbus_args=["--reactor", "tests.jobs.reactors:always_restart"],
                  torchrun_args=["--max-restarts", "1"], job=str(JOB))
    assert run.returncode == 0, run.describe()

    (exit_event,) = run.of("WORKER_EXIT", worker_id=1, exit_code=3)
    failed_at = float((run.out / "attempt0_rank1.exit").read_text())
    detection_s = exit_event["timestamp"] - failed_at
    (restart,) = run.of("WORKER_RESTART")
    starts_1 = [e["timestamp"] for e in run.of("WORKER_START", restart_count=1)]
    restart_s = min(starts_1) - exit_event["timestamp"]

    metrics = Counter((e["data"]["rank"], e["data"]["attempt"], e["step"])
                      for e in run.events if e["type"] == "METRIC")
    # rank 0 of attempt 0 records until it is stopped: 0..K-1 for its last K
    last = max(s for (r, a, s) in metrics if (r, a) == (0, 0))
    expected = Counter((r, a, s) for r in (0, 1) for a in (0, 1) for s in range(EVENTS))
    expected.update((0, 0, s) for s in range(EVENTS, last + 1))
    lost = sum((expected - metrics).values())
    doubled = sum((metrics - expected).values())
    mismarked = [e for e in run.events if e["type"] == "METRIC"
                 and e["context"]["restart_count"] != e["data"]["attempt"]]
    # attempt-0 events the agent drained after it had started the restart keep attempt 0
    restart_at = run.events.index(restart)
    late_attempt0 = [e for e in run.events[restart_at:] if e["type"] == "METRIC"
                     and e["data"]["attempt"] == 0]
    losses = run.of("EVENTS_LOST")

    figure(22, f"detection {detection_s * 1000:.0f} ms, restart {restart_s:.1f} s; worker "
               f"events lost {lost}, doubled {doubled}, mismarked {len(mismarked)} of "
               f"{sum(expected.values()):,} (attempt-0 events after the restart: "
               f"{len(late_attempt0)}, all marked 0)")
    assert exit_event["context"]["restart_count"] == 0
    assert 0 <= detection_s < 1.0, detection_s
    assert restart["attempt"] == 1 and "always_restart" in (restart["reason"] or "")
    assert sorted(e["worker_id"] for e in run.of("WORKER_START", restart_count=1)) == [0, 1]
    assert lost == 0 and doubled == 0
    assert mismarked == []
    assert sorted(e["context"]["rank"] for e in run.of("EPOCH_END")) == [0, 1]
    assert all(e["context"]["restart_count"] == 1 for e in run.of("EPOCH_END"))
    assert losses == [], losses
    assert run.torn == 0 and run.foreign == 0
    assert [e["state"] for e in run.of("AGENT_EXIT")] == ["SUCCEEDED"]
