"""The sentence the webhook (and TensorBoard's text) says about a worker's exit names the
rank that caused the decision, never a collateral one."""

from __future__ import annotations

import eventbus
from eventbus.app.sinks.base import describe


def test_a_collateral_exit_is_not_blamed_for_the_decision() -> None:
    """Rank 0, stopped by the agent (SIGTERM) because rank 1 failed, is "stopped by the
    agent", not "killed by SIGTERM", and the STOP is not put on it."""
    collateral = eventbus.WorkerExit(worker_id=0, exit_code=-15, signal="SIGTERM",
                                     data={"attempt": 0, "stopped_by_agent": True})
    text = describe(collateral, decision="the agent stops the job")
    assert text.startswith("Rank 0 was stopped by the agent (SIGTERM) on attempt 0 because "
                           "another rank failed or stalled."), text
    assert "killed" not in text and "stops the job" not in text


def test_the_culprits_exit_carries_the_decision() -> None:
    culprit = eventbus.WorkerExit(worker_id=1, exit_code=3, data={"attempt": 0})
    assert describe(culprit, decision="the agent stops the job").startswith(
        "Rank 1 exited with code 3 on attempt 0; the agent stops the job.")
