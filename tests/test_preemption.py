"""``eventbus.preemption.should_stop()``: False without a drain, and the same step on every
rank once one started, by construction: ranks that step at different speeds, each its own
process with the worker's real ear on a real TCPStore, all stop at the agreed step, which
is at or after the step each was at when it heard the drain. A script that does not act
on drains gets the signal at once."""

from __future__ import annotations

import datetime
import json
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from eventbus import preemption
from eventbus.app.protocol import notices as log
from eventbus.events import Preempting
from eventbus.testing import drain
from tests.conftest import subprocess_env

ROOT = "eventbus/notices/agree"

RANK = textwrap.dedent('''
    import json, os, sys, time
    import torch.distributed  # noqa: F401  (the script's own import: the ear may start)
    from eventbus import preemption
    from eventbus.app.worker.notices import NoticeReader

    port, rank, world, delay, out, mode = (int(sys.argv[1]), int(sys.argv[2]),
        int(sys.argv[3]), float(sys.argv[4]), sys.argv[5], sys.argv[6])
    reader = NoticeReader(host="127.0.0.1", port=port, root=ROOT, start_after=0,
                          rank=rank, world_size=world, attempt=0)
    if mode == "aware":
        for _ in range(1 + 40 * rank):  # each rank at its own step when the drain comes
            preemption.should_stop()
    reader.start()
    open(os.path.join(out, f"ready{rank}"), "w").close()
    seen = None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(delay)
        if mode != "aware":
            continue
        if seen is None and preemption.draining():
            seen = preemption.position()
        if preemption.should_stop():
            with open(os.path.join(out, f"stop{rank}.json"), "w") as f:
                json.dump({"stop": preemption.position(), "seen": seen,
                           "agreement": reader.agreement}, f)
            break
''').replace("ROOT,", repr(ROOT) + ",", 1)


@pytest.fixture(autouse=True)
def _forget() -> Iterator[None]:
    preemption.reset()
    yield
    preemption.reset()


def test_no_drain_no_stop_and_no_wait() -> None:
    assert not any(preemption.should_stop() for _ in range(1000))
    assert preemption.position() == 1000 and not preemption.draining()
    assert preemption.deadline_s() is None and preemption.stop_step() is None


def test_a_drain_stops_at_its_step_and_stays_stopped() -> None:
    with drain(stop_at=5) as state:
        answers = [preemption.should_stop() for _ in range(7)]
        assert answers == [False] * 4 + [True] * 3
        assert state.stopped_at == 5 and preemption.stop_step() == 5
        left = preemption.deadline_s()
        assert left is not None and 0 < left <= 60
    assert not preemption.should_stop()


def test_the_callers_step_counts_not_the_calls() -> None:
    with drain(stop_at=40):
        assert not preemption.should_stop(step=10)
        assert not preemption.should_stop(step=39)
        assert preemption.should_stop(step=40)


def test_a_rank_at_its_promise_waits_for_the_agreement_then_stops_there() -> None:
    """The promise is never passed without the stop step: the loop waits at it, and goes
    on (to the stop step) once the agreement is known."""
    for _ in range(10):
        preemption.should_stop()
    state = preemption.begin(deadline_s=30.0, reason="test")
    promise = state.make_promise(preemption.position(), 2)
    assert promise == 12
    assert not preemption.should_stop()  # 11
    threading.Timer(0.3, lambda: state.settle(14)).start()
    started = time.monotonic()
    assert not preemption.should_stop()  # 12: waits here for the agreement
    waited = time.monotonic() - started
    assert waited >= 0.2, waited
    assert not preemption.should_stop()  # 13
    assert preemption.should_stop()  # 14


def test_no_agreement_stops_the_rank_where_it_is() -> None:
    for _ in range(3):
        preemption.should_stop()
    state = preemption.begin(deadline_s=30.0, reason="test")
    state.settle(None, failed="the store is gone")
    assert preemption.should_stop()
    assert state.failed == "the store is gone"


def test_the_lead_follows_the_step_rate() -> None:
    for _ in range(128):
        preemption.should_stop()
    assert preemption.lead() >= preemption.MIN_LEAD
    time.sleep(0.05)
    assert preemption.lead() <= preemption.MAX_LEAD


@pytest.fixture
def store() -> Iterator[Any]:
    dist = pytest.importorskip("torch.distributed")
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=30))
    yield server


def _ranks(store: Any, out: Path, modes: list[tuple[str, float]]) -> list[subprocess.Popen[str]]:
    procs = [subprocess.Popen(
        [sys.executable, "-c", RANK, str(store.port), str(rank), str(len(modes)),
         str(delay), str(out), mode], env=subprocess_env(), text=True,
        stderr=subprocess.PIPE, start_new_session=True)
        for rank, (mode, delay) in enumerate(modes)]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(
            (out / f"ready{r}").exists() for r in range(len(modes))):
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.05)
    time.sleep(0.5)  # every ear in its wait, every loop stepping
    return procs


def _finish(procs: list[subprocess.Popen[str]]) -> list[str]:
    errors = []
    for proc in procs:
        try:
            errors.append(proc.communicate(timeout=60)[1][-3000:])
        except subprocess.TimeoutExpired:
            proc.kill()
            errors.append(proc.communicate(timeout=10)[1][-3000:])
    return errors


def test_ranks_at_different_speeds_stop_at_the_same_step(store: Any, tmp_path: Path) -> None:
    """Four ranks 40 steps apart and at different speeds (2 to 6 ms a step), so each at its
    own step when the drain comes: every one stops at the same step, at or after the step
    it had reached."""
    modes = [("aware", 0.002), ("aware", 0.004), ("aware", 0.006), ("aware", 0.003)]
    procs = _ranks(store, tmp_path, modes)
    try:
        client = log_client(store)
        log.append(client, ROOT, Preempting(deadline_s=30.0, reason="SIGTERM on node 0",
                                            signal="SIGTERM", node=0))
        errors = _finish(procs)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert [p.returncode for p in procs] == [0] * 4, errors
    results = [json.loads((tmp_path / f"stop{r}.json").read_text()) for r in range(4)]
    stops = {r["stop"] for r in results}
    assert len(stops) == 1, results
    (stop,) = stops
    assert all(r["seen"] is not None and r["seen"] <= stop for r in results), results
    assert all(r["agreement"]["stop"] == stop for r in results), results
    assert stop >= max(r["agreement"]["promise"] for r in results)


def test_a_script_that_does_not_act_on_drains_gets_the_signal_at_once(
        store: Any, tmp_path: Path) -> None:
    """Rank 1 never calls should_stop() nor subscribes: its ear sends it SIGTERM (the
    default action ends it); rank 0 still agrees on a step, with rank 1's "no promise"."""
    procs = _ranks(store, tmp_path, [("aware", 0.005), ("plain", 0.005)])
    try:
        sent = time.monotonic()
        log.append(log_client(store), ROOT, Preempting(deadline_s=30.0, reason="x",
                                                       signal="SIGTERM", node=0))
        procs[1].wait(timeout=30)
        took = time.monotonic() - sent
        errors = _finish(procs)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert procs[1].returncode == -signal.SIGTERM, errors
    assert took < 5.0
    assert procs[0].returncode == 0, errors
    result = json.loads((tmp_path / "stop0.json").read_text())
    assert result["agreement"]["stop"] == result["stop"]


def log_client(store: Any) -> Any:
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=30))
