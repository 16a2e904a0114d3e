"""`make demo` end to end: a real 2-worker gloo job under `python -m eventbus run`, a crash
on attempt 0, a reactor's restart, and events.jsonl, trace.json and timeline.png."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from eventbus.subscribers.jsonl import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
#: generous: the machine is shared; the demo takes 15-30 s on an idle 2-core machine
DEMO_TIMEOUT_S = 280.0


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str],
                                                          Path]:
    out = tmp_path_factory.mktemp("demo") / "out"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "demo.py"), "--out", str(out)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    try:
        stdout, _ = proc.communicate(timeout=DEMO_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, _ = proc.communicate(timeout=30)
        raise AssertionError(f"the demo timed out:\n{stdout[-6000:]}") from None
    result = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, "")
    assert result.returncode == 0, stdout[-8000:]
    return result, out


def _events(out: Path) -> list[dict[str, Any]]:
    read = read_jsonl(out / "events.jsonl")
    events = list(read)
    assert read.torn == 0 and read.foreign == 0
    return events


@pytest.mark.slow
def test_demo_tells_the_user_what_happened_and_what_to_open(
        demo: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    """The console shows the events as they happen (the logging handler) and, at the end,
    the crash, the restart, the outcome and the three files."""
    result, out = demo
    text = result.stdout
    assert "WORKER_EXIT worker_id=1" in text and "WORKER_RESTART attempt=1" in text
    assert "demo: rank 1 failed on attempt 0" in text and "injected failure" in text
    assert "demo: the agent restarted the workers: attempt 1" in text
    assert "demo: job SUCCEEDED after 2 attempt(s); epochs completed: 0, 1, 2, 3" in text
    assert f"demo: the files are in {out}/" in text
    for name in ("events.jsonl", "trace.json", "timeline.png"):
        assert f"  {name}" in text
    assert f"tensorboard --logdir {out / 'tb'}" in text


@pytest.mark.slow
def test_demo_writes_each_ranks_curve_to_tensorboard(
        demo: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    """The TensorBoard sink wrote rank0/ and rank1/ runs with the loss of both attempts."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, out = demo
    for rank in (0, 1):
        acc = EventAccumulator(str(out / "tb" / f"rank{rank}"), size_guidance={"scalars": 0})
        acc.Reload()
        assert acc.Scalars("loss")
        assert [s.value for s in acc.Scalars("eventbus/attempt")][-1] == 1.0


@pytest.mark.slow
def test_demo_records_the_whole_elastic_job(
        demo: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    """events.jsonl holds the agent's lifecycle and the workers' own events: rank 1's
    failure on attempt 0 with its message, the restart, all epochs of both ranks,
    checkpoints, metrics, and a successful end."""
    _, out = demo
    events = _events(out)

    def of(type_: str) -> list[dict[str, Any]]:
        return [e for e in events if e["type"] == type_]

    crash = [e for e in of("WORKER_EXIT") if e["worker_id"] == 1 and e["exit_code"] != 0]
    assert len(crash) == 1 and crash[0]["context"]["restart_count"] == 0
    assert "injected failure: rank 1" in crash[0]["message"]
    assert [e["attempt"] for e in of("WORKER_RESTART")] == [1]
    assert "examples.reactor.restart_on_crash" in of("WORKER_RESTART")[0]["reason"]
    assert [e["state"] for e in of("AGENT_EXIT")] == ["SUCCEEDED"]
    ended = {(e["context"]["rank"], e["epoch"]) for e in of("EPOCH_END")}
    assert ended == {(r, epoch) for r in (0, 1) for epoch in range(4)}
    attempt1 = {e["context"]["restart_count"] for e in of("EPOCH_START")
                if e["epoch"] >= 2}
    assert attempt1 == {1}  # attempt 1 resumed from the checkpoint of epoch 0 or 1
    assert {e["epoch"] for e in of("CHECKPOINT_SAVED")} == {0, 1, 2, 3}
    assert of("METRIC") and all("loss" in e["data"] for e in of("METRIC"))


@pytest.mark.slow
def test_demo_writes_the_trace_and_the_picture(
        demo: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    """trace.json is strict Chrome trace JSON with both attempts of both ranks as spans and
    the failure marked; timeline.png is a real PNG."""
    _, out = demo
    trace = json.loads((out / "trace.json").read_text(),
                       parse_constant=lambda name: pytest.fail(f"{name} in trace.json"))
    workers = {e["name"] for e in trace["traceEvents"]
               if e["ph"] == "X" and e["cat"] == "worker"}
    assert {"rank 0 attempt 1", "rank 1 attempt 1"} <= workers
    assert any(name.startswith("rank 1 attempt 0 (exit ") for name in workers)
    assert any(e["ph"] == "i" and e["cat"] == "failure" for e in trace["traceEvents"])
    assert any(e["ph"] == "i" and e["cat"] == "restart" for e in trace["traceEvents"])
    epochs = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "epoch"]
    assert {e["args"]["epoch"] for e in epochs if e["args"]["finished"]} == {0, 1, 2, 3}
    png = (out / "timeline.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 20_000


@pytest.mark.slow
def test_the_demos_restart_is_recovered_phase_by_phase(
        demo: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    """The demo's script updates its weights by hand (no torch.optim) and records METRIC
    steps: its restart still gets RECOVERED (the first METRIC step is each rank's first
    step), with the worker's phases measured, and the agent's console line."""
    result, out = demo
    (recovered,) = [e for e in _events(out) if e["type"] == "RECOVERED"]
    assert recovered["attempt"] == 1 and recovered["total_s"] > 0
    phases = recovered["data"]["phases"]
    for phase in ("rendezvous", "start", "init", "first_step"):
        assert isinstance(phases[phase], float), phases
    assert "eventbus: attempt 1 recovered in" in result.stdout
