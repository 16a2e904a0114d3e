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


def test_the_alerting_form_names_the_rank_with_its_host_and_the_default_does_not() -> None:
    """``sentence(event, host=True)`` (the webhook's and W&B's) puts the host after the
    rank, and a drain's host after its origin; without it (the console, the page) the
    sentences are as they were."""
    from eventbus.app.sentences import sentence
    from tests.sink_helpers import make_event

    failed = make_event("WORKER_EXIT", worker_id=5, exit_code=3, hostname="node-17",
                        message="RuntimeError: boom")
    assert sentence(failed) == "rank 5 failed (exit code 3: RuntimeError: boom)"
    assert sentence(failed, host=True) == \
        "rank 5 on node-17 failed (exit code 3: RuntimeError: boom)"
    assert sentence(failed, host=True, short=True) == "failed (exit code 3)"
    stalled = make_event("WORKER_STALLED", worker_id=2, silent_s=40.0, hostname="node-3",
                         data={"where": "train.py:18"})
    assert sentence(stalled, host=True) == "rank 2 on node-3 stalled for 40.0 s (train.py:18)"
    drain = make_event("PREEMPTING", deadline_s=20.0, reason="SIGTERM on node 1",
                       hostname="node-9")
    assert sentence(drain) == "drain: SIGTERM on node 1, 20 s to stop"
    assert sentence(drain, host=True) == "drain: SIGTERM on node 1 (node-9), 20 s to stop"
    assert sink_text(failed, decision="the job failed", host=True).startswith(
        "rank 5 on node-17 failed (exit code 3: RuntimeError: boom); the job failed [")
    ended = make_event("AGENT_EXIT", state="SUCCEEDED", exit_code=0, hostname="node-0")
    assert sentence(ended, host=True) == "the job succeeded"  # about no rank: no host
