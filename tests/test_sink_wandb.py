"""``--sink wandb:PROJECT`` in one process, with the real W&B in offline mode (no account):
recorded events in, the offline run's own records read back (tests/wandb_helpers.py);
the run id's derivation; a missing extra; a W&B server that cannot be reached."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from eventbus.app.sinks import SinkError
from eventbus.app.sinks import make_sink
from eventbus.app.sinks.wandb import ENV_PROJECT
from eventbus.app.sinks.wandb import ENV_RUN_ID
from eventbus.app.sinks.wandb import WandbSink
from eventbus.app.sinks.wandb import wandb_run_id
from eventbus.events import Event
from tests.sink_helpers import RUN_ID
from tests.sink_helpers import free_port
from tests.sink_helpers import make_event
from tests.wandb_helpers import offline_runs

pytest.importorskip("wandb")

HOST = "node-17"


def recorded_job() -> list[Event]:
    """Two ranks on node-17: rank 1 fails on attempt 0 (rank 0 is stopped by the agent),
    attempt 1 gets stuck and moves again, the job succeeds."""
    t = 1_700_000_000.0

    def ev(kind: str, **fields: object) -> Event:
        return make_event(kind, hostname=HOST, **fields)  # type: ignore[arg-type]

    events = [ev("AGENT_START", timestamp=t, nproc_per_node=2, max_restarts=1)]
    for attempt, steps in ((0, range(0, 3)), (1, range(3, 6))):
        for rank in (0, 1):
            events.append(ev("WORKER_START", restart_count=attempt, timestamp=t + 1,
                             worker_id=rank))
        for step in steps:
            for rank in (0, 1):
                events.append(ev("METRIC", rank=rank, restart_count=attempt, step=step,
                                 timestamp=t + 2 + step, data={"loss": rank + step / 10}))
        if attempt == 0:
            events.append(ev("WORKER_EXIT", restart_count=0, timestamp=t + 6, worker_id=1,
                             exit_code=3, cause="failure",
                             message="Traceback (most recent call last):\n  ...\n"
                                     "RuntimeError: boom"))
            events.append(ev("WORKER_EXIT", restart_count=0, timestamp=t + 6, worker_id=0,
                             exit_code=-15, signal="SIGTERM", cause="failure",
                             data={"stopped_by_agent": True}))
            events.append(ev("WORKER_RESTART", restart_count=0, timestamp=t + 7, attempt=1,
                             restarts_left=0, reason="rank 1 failed", cause="failure"))
    events.append(ev("JOB_STUCK", restart_count=1, timestamp=t + 9, silent_s=61.0,
                     after_s=60.0, step=5, data={"places": [
                         {"where": "train.py:42", "ranks": [0, 1], "hosts": [HOST],
                          "step": 5, "idle_s": 61.0}], "ranks": 2}))
    events.append(ev("JOB_UNSTUCK", restart_count=1, timestamp=t + 10, stuck_s=70.0, step=6,
                     worker_id=0, data={"host": HOST}))
    for rank in (0, 1):
        events.append(ev("WORKER_EXIT", restart_count=1, timestamp=t + 11, worker_id=rank,
                         exit_code=0))
    events.append(ev("AGENT_EXIT", restart_count=1, timestamp=t + 12, state="SUCCEEDED",
                     exit_code=0))
    return events


@pytest.fixture
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    return tmp_path


def test_recorded_events_make_one_run_with_metrics_alerts_table_and_goodput(
        offline: Path) -> None:
    sink = make_sink("wandb:eventbus-test")
    assert isinstance(sink, WandbSink)
    sink.goodput_source = lambda: SimpleNamespace(
        goodput_ratio=0.75, goodput_s=9.0, wall_s=12.0,
        badput_s={"startup": 1.0, "restart": 2.0})
    for event in recorded_job():
        sink(event)
    assert sink.close(timeout=60.0)
    stats = sink.stats()
    assert not stats["dropped"] and stats["sent"] == stats["written"] > 0, stats

    (run,) = offline_runs(offline)
    assert run.run.run_id == RUN_ID == wandb_run_id(RUN_ID)
    assert run.run.project == "eventbus-test" and run.run.resume
    assert run.config["eventbus/run_id"] == RUN_ID and run.config["eventbus/ranks"] == 2
    # every rank's metrics at their steps, and the mean of the key both ranks share
    for rank in (0, 1):
        assert [(s, round(v, 4)) for s, v in run.series(f"rank{rank}/loss")] == \
            [(s, round(rank + s / 10, 4)) for s in range(6)]
    assert [(s, round(v, 4)) for s, v in run.series("loss")] == \
        [(s, round(0.5 + s / 10, 4)) for s in range(6)]
    attempts = {row["eventbus/step"]: row["eventbus/attempt"] for row in run.history
                if "rank0/loss" in row}
    assert attempts == {0: 0, 1: 0, 2: 0, 3: 1, 4: 1, 5: 1}
    # one alert per decision: the failure with its restart (not the rank the agent
    # stopped), the stuck job, its resumption, the end
    said = [(a.level, a.text) for a in run.alerts]
    assert said == [
        ("ERROR", "rank 1 on node-17 failed (exit code 3: RuntimeError: boom); the group "
                  f"restarts as attempt 1 (0 restarts left) [attempt 0, run {RUN_ID}]"),
        ("WARN", "no rank made a step for 61 s (the last at step 5; --alert-after 60 s): "
                 f"ranks 0, 1 on node-17 at train.py:42 (step 5) [attempt 1, run {RUN_ID}]"),
        ("INFO", "progress resumed: rank 0 on node-17 made step 6 after 70 s without one "
                 f"[attempt 1, run {RUN_ID}]"),
        ("INFO", f"the job succeeded [attempt 1, run {RUN_ID}]"),
    ], said
    assert run.alerts[0].title == "eventbus [attempt 0]: rank 1 failed (exit code 3)"
    # the events as a table: everything but the metrics
    table = run.tables("eventbus/events")[0]
    assert table["columns"] == ["time", "rank", "host", "type", "sentence"]
    kinds = [row[3] for row in table["data"]]
    assert kinds == [str(e.type) for e in recorded_job() if str(e.type) != "METRIC"]
    failure = table["data"][kinds.index("WORKER_EXIT")]
    assert failure[1:] == [1, HOST, "WORKER_EXIT",
                           "rank 1 failed (exit code 3: RuntimeError: boom)"]
    assert failure[0] == "2023-11-14T22:13:26.000Z"
    # goodput live, the outcome at the end
    assert run.summary["eventbus/goodput_ratio"] == 0.75
    assert run.summary["eventbus/badput_s/restart"] == 2.0
    assert run.summary["eventbus/end"] == "the job succeeded"
    assert run.exit_code == 0


def test_a_drain_marks_the_run_preempting_and_alerts(offline: Path) -> None:
    sink = WandbSink("eventbus-test")
    sink(make_event("AGENT_START", hostname=HOST))
    sink(make_event("PREEMPTING", hostname=HOST, deadline_s=20.0, reason="SIGTERM on node 0"))
    sink(make_event("AGENT_EXIT", hostname=HOST, state="PREEMPTED", exit_code=75,
                    cause="preemption"))
    assert sink.close(timeout=60.0)
    (run,) = offline_runs(offline)
    assert run.preempting == 1
    assert [(a.level, a.text.split(" [")[0]) for a in run.alerts] == [
        ("WARN", "drain: SIGTERM on node 0 (node-17), 20 s to stop"),
        ("WARN", "the job was preempted (exit code 75)"),
    ]
    assert run.exit_code == 75


@pytest.mark.parametrize(("run_id", "expected"), [
    ("8f0c2b8e-4b0a-4f3e-9a51-0c7d2f1e9b3a", "8f0c2b8e-4b0a-4f3e-9a51-0c7d2f1e9b3a"),
    ("1234567", "1234567"),
    ("llama_7b-0412", "llama_7b-0412"),
    ("job/7:a", "job-7-a-" + __import__("hashlib").sha256(b"job/7:a").hexdigest()[:16]),
])
def test_the_run_id_is_the_jobs_when_w_and_b_accepts_it(run_id: str, expected: str) -> None:
    assert wandb_run_id(run_id) == expected
    assert len(wandb_run_id("x" * 200)) == 64


def test_the_workers_get_the_run_id_and_wandb_run_id_overrides_it(
        offline: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    sink = WandbSink("p")
    assert sink.worker_env("job-42") == {ENV_RUN_ID: "job-42", ENV_PROJECT: "p"}
    assert sink.worker_env("other") == {ENV_RUN_ID: "job-42", ENV_PROJECT: "p"}  # fixed
    sink.close(timeout=5.0)
    monkeypatch.setenv("WANDB_RUN_ID", "mine")
    sink = WandbSink("p")
    assert sink.run_id_for("job-42") == "mine"
    sink.close(timeout=5.0)
    monkeypatch.delenv("WANDB_RUN_ID")
    with caplog.at_level(logging.WARNING, logger="eventbus"):
        sink = WandbSink("p")
        made = sink.run_id_for("none")  # torchrun's --rdzv-id default: no id of the job's
    sink.close(timeout=5.0)
    assert made.startswith("eventbus-") and "give --rdzv-id" in caplog.text


@pytest.mark.parametrize(("spec", "words"), [
    ("wandb:a/b", ["wandb", "not a W&B project name"]),
    ("wandb:", ["wandb", "WANDB_PROJECT"]),
])
def test_a_bad_project_names_the_fix(spec: str, words: list[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    with pytest.raises(SinkError) as info:
        make_sink(spec)
    for word in words:
        assert word in str(info.value)


def test_without_the_extra_eventbus_run_is_a_usage_error(tmp_path: Path) -> None:
    """``import wandb`` fails in the launcher's process: exit 2 before any job, naming
    the extra."""
    code = ("import sys, runpy; sys.modules['wandb'] = None; "
            "sys.argv = ['eventbus', 'run', '--sink', 'wandb:p', '--standalone', "
            "'--nproc-per-node', '1', 'never.py']; "
            "runpy.run_module('eventbus', run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, check=False,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert done.returncode == 2, done.stderr
    assert "--sink wandb: the wandb sink needs the 'wandb' extra" in done.stderr
    assert "pip install 'eventbus[wandb]'" in done.stderr
    assert not (tmp_path / "wandb").exists()


@pytest.mark.parametrize("init_timeout_s", [1.0, 60.0], ids=["init-gives-up",
                                                           "init-outlasts-the-close"])
def test_an_unreachable_server_costs_counted_drops_and_a_bounded_close(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, init_timeout_s: float) -> None:
    """Online mode against a closed port: record() is unaffected, close() ends within
    its budget, and every event is counted as dropped with the reason: W&B's own (its
    init gave up), or the close's (the writer was still trying, and was stopped). The close's
    budget is 1 s here (the rule, not the default's size), given once the writer is
    connecting."""
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    sink = WandbSink("eventbus-test", init_timeout_s=init_timeout_s)
    events = recorded_job()
    started = time.monotonic()
    for event in events:
        sink(event)
    recorded = time.monotonic() - started
    if init_timeout_s < 4:  # W&B gives up on its server before the close: wait for that
        deadline = time.monotonic() + 120
        while not str(sink.stats()["writer"]).startswith("run not started"):
            assert time.monotonic() < deadline, sink.stats()
            time.sleep(0.1)
    else:  # the writer is up and trying when the close comes
        deadline = time.monotonic() + 120
        while sink.stats()["writer"] != "connecting to W&B":
            assert time.monotonic() < deadline, sink.stats()
            time.sleep(0.02)
    closing = time.monotonic()
    delivered = sink.close(timeout=1.0)
    close_s = time.monotonic() - closing
    stats = sink.stats()
    print(f"wandb unreachable: {len(events)} events handed in {recorded * 1e3:.1f} ms, close "
          f"{close_s:.2f} s (budget 1 s), dropped {stats['dropped']}")
    assert not delivered
    assert close_s < 1.0 + 2.0  # the budget, plus scheduling slack on a shared machine
    assert sum(stats["dropped"].values()) == stats["sent"] > 0, stats
    assert stats["written"] == 0
    (reason,) = stats["dropped"]
    assert reason == ("W&B: run not started: connection refused" if init_timeout_s < 4
                      else "not written by W&B before the close (connecting to W&B)"), reason


def test_only_group_rank_0_makes_the_run_and_every_node_exports_its_id(offline: Path) -> None:
    """Under ``eventbus run`` the sink holds its events until the first rendezvous says
    which node it is on: group rank 0's writes them, the others' make no run."""
    from eventbus.app.plugins import RendezvousInfo
    from eventbus.app.sinks import SinksPlugin
    from eventbus.bus import Bus

    def rendezvous(bus: Bus, group_rank: int) -> RendezvousInfo:
        return RendezvousInfo(store_host="127.0.0.1", store_port=1, run_id=RUN_ID,
                              group_rank=group_rank, group_world_size=2, restart_count=0,
                              local_world_size=1, world_size=2, global_ranks=(group_rank,),
                              bus=bus)

    for group_rank in (1, 0):
        bus = Bus(f"node-{group_rank}")
        plugin = SinksPlugin(bus, [WandbSink("eventbus-test")])
        bus.publish(make_event("AGENT_START", hostname=HOST))
        assert plugin.sinks[0].flush(10.0)  # written, as far as the sink goes: held
        env = plugin.after_rendezvous(rendezvous(bus, group_rank))
        assert env == {ENV_RUN_ID: RUN_ID, ENV_PROJECT: "eventbus-test"}
        if group_rank == 0:
            bus.publish(make_event("WORKER_START", hostname=HOST, worker_id=0))
            bus.publish(make_event("AGENT_EXIT", hostname=HOST, state="SUCCEEDED",
                                   exit_code=0))
        assert plugin.close(timeout=30.0)
        runs = offline_runs(offline)
        assert len(runs) == (1 if group_rank == 0 else 0), runs
    (run,) = offline_runs(offline)
    table = run.tables("eventbus/events")[0]
    assert [row[3] for row in table["data"]] == ["AGENT_START", "WORKER_START", "AGENT_EXIT"]
