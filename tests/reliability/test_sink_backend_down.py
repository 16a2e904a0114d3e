"""Row 28: sink backends down or slow. A real ``eventbus run`` job (2 gloo workers, rank 1
exits 3 on attempt 0, a restart) with ``--sink otlp:``, ``webhook:`` and ``mlflow:`` pointed
at a closed port, or at a server that answers after 10 s: the job and the agent's monitor
are unaffected (it succeeds, after its restart), every sink's losses are counted and
reported, and ``eventbus run`` ends within the sinks' budget after ``AGENT_EXIT``."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from eventbus.app.sinks import SINKS_CLOSE_TIMEOUT_S
from tests.launcher_helpers import run_command
from tests.sink_helpers import free_port
from tests.sink_helpers import receiver
from tests.test_sinks_e2e import sinks_job_command

#: after the sinks' budget: the JSONL recorder's close and the interpreter's teardown
TEARDOWN_ALLOWANCE_S = 10.0


@pytest.mark.slow
@pytest.mark.parametrize("delay", [None, 10.0], ids=["backends-down", "backends-10s"])
def test_dead_or_slow_backends_do_not_hold_the_job(
    tmp_path: Path, delay: float | None, figure: Callable[[int, str], None],
) -> None:
    """The job succeeds after its restart; each sink reports its dropped events; the
    process ends within SINKS_CLOSE_TIMEOUT_S (+ teardown) of AGENT_EXIT."""
    with receiver(delay=delay or 0.0) as slow:
        url = slow.url if delay else f"http://127.0.0.1:{free_port()}"
        cmd = sinks_job_command(tmp_path, [f"otlp:{url}", f"webhook:{url}/hook",
                                           f"mlflow:{url}"])
        done = run_command(cmd, cwd=tmp_path)
        finished = time.time()
    assert done.returncode == 0, done.stderr[-5000:]
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["attempt"] for e in events if e["type"] == "WORKER_RESTART"] == [1]
    (agent_exit,) = [e for e in events if e["type"] == "AGENT_EXIT"]
    assert agent_exit["state"] == "SUCCEEDED"
    delay_s = finished - agent_exit["timestamp"]
    lost = dict(re.findall(r"eventbus: sink (\w+):\S+ dropped (\d+) events", done.stderr))
    how = "down" if delay is None else f"answering after {delay:.0f} s"
    figure(28, f"backends {how}: agent exit delay {delay_s:.2f} s (budget "
               f"{SINKS_CLOSE_TIMEOUT_S:.0f} s + teardown); dropped {lost}")
    assert set(lost) == {"otlp", "webhook", "mlflow"}, done.stderr[-3000:]
    assert delay_s < SINKS_CLOSE_TIMEOUT_S + TEARDOWN_ALLOWANCE_S
