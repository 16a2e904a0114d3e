"""The sentence the webhook (and TensorBoard's text) says about a worker's exit names the
rank that caused the decision, never a collateral one (``sinks.base.sink_text``: the
event's sentence, the decision, the attempt and the run)."""

from __future__ import annotations

import eventbus
from eventbus.app.sinks.base import sink_text


def test_a_collateral_exit_is_not_blamed_for_the_decision() -> None:
    """Rank 0, stopped by the agent (SIGTERM) because rank 1 failed, is "stopped by the
    agent", not "failed", and the STOP is not put on it."""
    collateral = eventbus.WorkerExit(worker_id=0, exit_code=-15, signal="SIGTERM",
                                     cause="failure",
                                     data={"attempt": 0, "stopped_by_agent": True})
    text = sink_text(collateral, decision="the job was stopped (exit code 3)")
    assert text.startswith("rank 0 was stopped by the agent (SIGTERM) because another rank "
                           "failed [attempt 0"), text
    assert "failed (" not in text and "job was stopped" not in text


def test_the_culprits_exit_carries_the_decision() -> None:
    """The culprit's exit: its sentence, then the agent's decision, then the attempt."""
    culprit = eventbus.WorkerExit(worker_id=1, exit_code=3, data={"attempt": 0})
    assert sink_text(culprit, decision="the job was stopped (exit code 3)").startswith(
        "rank 1 failed (exit code 3); the job was stopped (exit code 3) [attempt 0")
