"""``--alert-after``'s watch (eventbus_app/sinks/stuck.py) on a real bus with a fake clock:
one ``JOB_STUCK`` when no rank stepped for the time and nothing explains it, with the
ranks' last places and hosts; one ``JOB_UNSTUCK`` when a rank steps again; a verdict,
a restart, a drain or the end keep it quiet; the webhook posts both."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from eventbus.app.sentences import sentence
from eventbus.app.sinks import SinksPlugin
from eventbus.app.sinks.stuck import StuckWatch
from eventbus.app.sinks.stuck import parse_alert_after
from eventbus.bus import ALL
from eventbus.bus import Bus
from eventbus.events import Event
from tests.sink_helpers import make_event
from tests.sink_helpers import receiver


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def beat(rank: int, *, step: int | None = None, collectives: int | None = None,
         idle_s: float = 0.0, where: str | None = None, host: str = "node-1",
         pid: int | None = None) -> Event:
    return make_event("WORKER_PROGRESS", rank=rank, worker_id=rank, step=step,
                      collectives=collectives, idle_s=idle_s, hostname=host,
                      pid=pid or 500 + rank, data={"where": where} if where else {})


def watch_on(clock: Clock, after_s: float = 60.0) -> tuple[Bus, StuckWatch, list[Event]]:
    bus = Bus("stuck-test")
    heard: list[Event] = []
    bus.subscribe(ALL, on_event=lambda e: heard.append(e)
                  if str(e.type) in ("JOB_STUCK", "JOB_UNSTUCK") else None)
    return bus, StuckWatch(bus, after_s, clock=clock, start=False), heard


def test_a_job_with_no_step_alerts_once_with_the_ranks_places_then_once_when_it_moves() -> None:
    clock = Clock()
    bus, watch, heard = watch_on(clock)
    bus.publish(make_event("AGENT_START"))
    for rank in (0, 1, 2):
        bus.publish(beat(rank, step=10, collectives=30))
    clock.now += 5
    # everyone stops: ranks 0 and 2 wait in train.py:42 on node-1, rank 1 on node-2 elsewhere
    bus.publish(beat(0, step=10, collectives=30, idle_s=3.0, where="train.py:42"))
    bus.publish(beat(1, step=10, collectives=30, idle_s=3.0, where="data.py:7", host="node-2"))
    bus.publish(beat(2, step=10, collectives=30, idle_s=3.0, where="train.py:42"))
    clock.now += 54.0
    assert watch.check() is None and not heard  # 59 s since the last step: not yet
    clock.now += 1.0
    stuck = watch.check()
    assert stuck is not None and [str(e.type) for e in heard] == ["JOB_STUCK"]
    assert stuck.silent_s == pytest.approx(60.0) and stuck.after_s == 60.0
    assert stuck.step == 10
    places = stuck.data["places"]
    assert [(p["where"], p["ranks"], p["hosts"]) for p in places] == [
        ("data.py:7", [1], ["node-2"]), ("train.py:42", [0, 2], ["node-1"])]
    assert places[0]["idle_s"] == pytest.approx(58.0)  # 3 s at the beat, 55 s since
    text = sentence(stuck, host=True)
    assert text.startswith("no rank made a step for 60 s (the last at step 10; "
                           "--alert-after 60 s): rank 1 on node-2 at data.py:7"), text
    assert "ranks 0, 2 on node-1 at train.py:42" in text
    clock.now += 600
    assert watch.check() is None and len(heard) == 1  # stuck for long: still one alert
    bus.publish(beat(2, step=11, collectives=31, host="node-1"))
    resumed = watch.check()
    assert resumed is not None and str(resumed.type) == "JOB_UNSTUCK"
    assert resumed.worker_id == 2 and resumed.step == 11
    assert resumed.stuck_s == pytest.approx(660.0)
    assert sentence(resumed) == "progress resumed: rank 2 on node-1 made step 11 after " \
        "660 s without one"
    clock.now += 59
    assert watch.check() is None
    clock.now += 1
    again = watch.check()  # stuck again: a new alert
    assert again is not None and str(again.type) == "JOB_STUCK"
    assert [str(e.type) for e in heard] == ["JOB_STUCK", "JOB_UNSTUCK", "JOB_STUCK"]
    watch.close()


def test_steps_collectives_and_metric_steps_are_progress_and_heartbeats_alone_are_not() -> None:
    clock = Clock()
    bus, watch, heard = watch_on(clock, after_s=10.0)
    bus.publish(beat(0, step=1, collectives=5))
    for _ in range(3):  # idle beats, same counters: no progress
        clock.now += 4
        bus.publish(beat(0, step=1, collectives=5, idle_s=4.0))
    assert watch.check() is not None  # 12 s since the last progress
    clock.now += 1
    bus.publish(beat(0, step=1, collectives=6))  # a collective completed: progress
    assert str(watch.check().type) == "JOB_UNSTUCK"  # type: ignore[union-attr]
    clock.now += 9
    bus.publish(make_event("METRIC", rank=0, step=7, data={"loss": 1.0}))  # a new step
    clock.now += 9
    assert watch.check() is None
    bus.publish(make_event("METRIC", rank=0, step=7, data={"acc": 1.0}))  # the same step
    clock.now += 2
    assert str(watch.check().type) == "JOB_STUCK"  # type: ignore[union-attr]
    assert [str(e.type) for e in heard] == ["JOB_STUCK", "JOB_UNSTUCK", "JOB_STUCK"]


@pytest.mark.parametrize("kind, fields", [
    ("WORKER_STALLED", {"worker_id": 0, "silent_s": 30.0}),
    ("WORKER_EXIT", {"worker_id": 0, "exit_code": 1}),
    ("WORKER_RESTART", {"attempt": 1}),
    ("HOST_EVICTED", {"host": "node-3", "faults": 2, "reason": "2 host faults"}),
], ids=["stall-verdict", "failure", "restart", "eviction"])
def test_a_verdict_or_a_change_of_the_group_restarts_the_clock(kind: str,
                                                               fields: dict[str, Any]) -> None:
    clock = Clock()
    bus, watch, heard = watch_on(clock, after_s=10.0)
    bus.publish(beat(0, step=1))
    clock.now += 8
    bus.publish(make_event(kind, **fields))  # explains the silence so far
    clock.now += 8
    assert watch.check() is None
    clock.now += 2
    assert watch.check() is not None  # 10 s after the verdict: stuck after all
    assert len(heard) == 1


@pytest.mark.parametrize("kind, fields", [
    ("PREEMPTING", {"deadline_s": 30.0, "reason": "SIGTERM on node 0"}),
    ("AGENT_EXIT", {"state": "SUCCEEDED", "exit_code": 0}),
], ids=["drain", "end"])
def test_a_drain_or_the_end_silences_the_watch(kind: str, fields: dict[str, Any]) -> None:
    clock = Clock()
    bus, watch, heard = watch_on(clock, after_s=10.0)
    bus.publish(beat(0, step=1))
    bus.publish(make_event(kind, **fields))
    clock.now += 1000
    assert watch.check() is None and not heard


def test_a_resume_just_before_the_end_is_still_told() -> None:
    """The job moves again and ends before the watch's next tick (CI saw it: steps 5-7
    and the exit inside one second): ``JOB_UNSTUCK`` still goes out, once, after the
    ``AGENT_EXIT``; nothing else does."""
    clock = Clock()
    bus, watch, heard = watch_on(clock, after_s=10.0)
    bus.publish(make_event("METRIC", rank=0, step=4, data={"loss": 1.0}))
    clock.now += 12
    assert str(watch.check().type) == "JOB_STUCK"  # type: ignore[union-attr]
    bus.publish(make_event("METRIC", rank=0, step=5, data={"loss": 1.0}))
    bus.publish(make_event("AGENT_EXIT", state="SUCCEEDED", exit_code=0))
    unstuck = watch.check()
    assert unstuck is not None and str(unstuck.type) == "JOB_UNSTUCK"
    assert unstuck.step == 5 and unstuck.stuck_s == 12.0  # type: ignore[attr-defined]
    clock.now += 1000
    assert watch.check() is None
    assert [str(e.type) for e in heard] == ["JOB_STUCK", "JOB_UNSTUCK"]


def test_closing_the_watch_tells_a_resume_it_had_not_told() -> None:
    clock = Clock()
    bus, watch, heard = watch_on(clock, after_s=10.0)
    bus.publish(beat(0, step=1))
    clock.now += 11
    assert watch.check() is not None
    bus.publish(beat(0, step=2))
    watch.close()  # the sinks close next: they hear it
    assert [str(e.type) for e in heard] == ["JOB_STUCK", "JOB_UNSTUCK"]
    watch.close()
    assert len(heard) == 2


def test_the_watch_on_its_own_thread_alerts_and_is_closed_by_the_sinks_plugin() -> None:
    """Under ``eventbus run``: the SinksPlugin starts it with its thread (the real clock:
    0.2 s here), and closing the plugin stops it."""
    bus = Bus("stuck-thread-test")
    heard: list[Event] = []
    done = __import__("threading").Event()

    def hear(event: Event) -> None:
        if str(event.type) == "JOB_STUCK":
            heard.append(event)
            done.set()

    bus.subscribe(ALL, on_event=hear)
    plugin = SinksPlugin(bus, [], alert_after=0.2)
    assert plugin.watch is not None
    assert done.wait(30.0), "no JOB_STUCK from the watch's thread"
    plugin.close()
    assert plugin.watch._thread is not None and not plugin.watch._thread.is_alive()
    assert len(heard) == 1


def test_the_webhook_posts_the_stuck_job_and_its_resumption() -> None:
    from eventbus.app.sinks.webhook import WebhookSink

    clock = Clock()
    bus, watch, _ = watch_on(clock, after_s=30.0)
    with receiver() as r:
        sink = WebhookSink(f"{r.url}/hook")
        bus.subscribe(ALL, on_event=sink)
        bus.publish(beat(0, step=3, where="train.py:9", idle_s=1.0, host="node-17"))
        clock.now += 31
        watch.check()
        bus.publish(beat(0, step=4, host="node-17"))
        watch.check()
        assert sink.close(timeout=10.0)
        texts = [json.loads(body)["text"] for path, body in r.requests if path == "/hook"]
    assert len(texts) == 2, texts
    assert texts[0].startswith("no rank made a step for 31 s (the last at step 3; "
                               "--alert-after 30 s): rank 0 on node-17 at train.py:9"), texts
    assert texts[1].startswith("progress resumed: rank 0 on node-17 made step 4 after 31 s "
                               "without one"), texts


@pytest.mark.parametrize("text, expected", [("off", None), ("1800", 1800.0), ("0.5", 0.5)])
def test_alert_after_parses_seconds_or_off(text: str, expected: float | None) -> None:
    assert parse_alert_after(text) == expected


@pytest.mark.parametrize("text", ["0", "-5", "nan", "inf", "soon"])
def test_alert_after_rejects_what_is_not_seconds(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="expected seconds > 0"):
        parse_alert_after(text)


def test_run_says_a_bad_alert_after_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    from eventbus.app.launcher.command import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--alert-after", "-1", "--standalone", "--nproc-per-node", "1", "x.py"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--alert-after" in err and "expected seconds > 0" in err, err


@pytest.mark.slow
def test_a_real_job_that_stops_stepping_alerts_on_the_webhook_and_w_and_b(
        tmp_path: Path) -> None:
    """A real 2-rank job, stall detection off, quiet for 12 s in one line: with
    ``--alert-after 4`` the webhook gets ``JOB_STUCK`` naming both ranks, their host and
    that line, then ``JOB_UNSTUCK``; the W&B run has the same two alerts."""
    pytest.importorskip("wandb")
    from tests.launcher_helpers import JOBS
    from tests.launcher_helpers import job_env
    from tests.launcher_helpers import run_command
    from tests.wandb_helpers import offline_runs

    script = JOBS / "stuck_job.py"
    quiet_line = next(n for n, line in enumerate(script.read_text().splitlines(), 1)
                      if line.rstrip().endswith("# QUIET"))
    env = {**job_env(), "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path),
           "EVENTBUS_HOSTNAME": "node-17"}
    (tmp_path / "out").mkdir()
    with receiver() as hook:
        done = run_command(
            [sys.executable, "-m", "eventbus", "run", "--events-jsonl",
             str(tmp_path / "events.jsonl"), "--alert-after", "4", "--stall-timeout", "off",
             "--sink", f"webhook:{hook.url}/hook", "--sink", "wandb:eventbus-test",
             "--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.1",
             str(script), "--out", str(tmp_path / "out"), "--quiet", "12"],
            cwd=tmp_path, env=env)
        posts = [json.loads(body) for path, body in hook.requests if path == "/hook"]
    assert done.returncode == 0, done.stderr[-5000:]
    kinds = [p["event"]["type"] for p in posts]
    # a loaded machine may take more than 4 s to the first step: a stuck/unstuck pair then
    # comes first; the quiet line's pair is the one that names the line
    stuck = [p for p in posts if p["event"]["type"] == "JOB_STUCK"
             and f"stuck_job.py:{quiet_line}" in p["text"]]
    assert len(stuck) == 1, posts
    text = stuck[0]["text"]
    assert text.startswith("no rank made a step for "), text
    assert f"ranks 0, 1 on node-17 at stuck_job.py:{quiet_line}" in text, text
    # the next alert is the resume (told at once; a resume that only the end's flush told
    # comes after the AGENT_EXIT post)
    after = posts[posts.index(stuck[0]) + 1:]
    alerts_after = [p for p in after if p["event"]["type"] in ("JOB_STUCK", "JOB_UNSTUCK")]
    assert [p["event"]["type"] for p in alerts_after][:1] == ["JOB_UNSTUCK"], kinds
    unstuck = alerts_after[0]["text"]
    assert unstuck.startswith("progress resumed: rank "), unstuck
    # the step's all_reduce (a collective: progress) may be heard before its METRIC
    assert re.search(r"on node-17 made (step 5|a step) after ", unstuck), unstuck
    print(f"webhook: {text}\nwebhook: {unstuck}")
    (run,) = offline_runs(tmp_path)
    alerts = [a.text for a in run.alerts]
    assert any(a.startswith(text.split(" [")[0]) for a in alerts), alerts
    assert any(a.startswith(unstuck.split(" [")[0]) for a in alerts), alerts
