"""The sinks on a real ``eventbus run`` job: 2 workers, rank 1 fails on attempt 0, a restart."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.launcher_helpers import JOB_TIMEOUT_S
from tests.launcher_helpers import JOBS
from tests.launcher_helpers import job_env
from tests.sink_helpers import free_port
from tests.sink_helpers import receiver

pytestmark = pytest.mark.slow


def sinks_job_command(tmp_path: Path, sinks: list[str], *, hold: float = 0.0) -> list[str]:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    args = [a for spec in sinks for a in ("--sink", spec)]
    return [sys.executable, "-m", "eventbus", "run", "--events-jsonl",
            str(tmp_path / "events.jsonl"), *args, "--standalone", "--nproc-per-node", "2",
            "--monitor-interval", "0.1", "--max-restarts", "1",
            str(JOBS / "sinks_job.py"), "--out", str(out), "--hold", str(hold)]


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_one_job_feeds_every_sink(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failing-then-restarted job reaches TensorBoard, OTLP, Prometheus, webhook, MLflow."""
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.test_sinks import _attrs
    from tests.test_sinks import _decode_otlp

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    port = free_port()
    mlruns = (tmp_path / "mlruns").as_uri()
    with receiver() as otlp, receiver() as hook:
        cmd = sinks_job_command(tmp_path, [f"tensorboard:{tmp_path / 'tb'}", f"otlp:{otlp.url}",
                              f"prometheus:{port}", f"webhook:{hook.url}/hook",
                              f"mlflow:{mlruns}"], hold=60.0)
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=job_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            # Scraped while the job runs: attempt 1 holds until released.
            deadline = time.monotonic() + JOB_TIMEOUT_S
            scraped: dict = {}
            while time.monotonic() < deadline and proc.poll() is None:
                started = list((tmp_path / "out").glob("attempt1_rank*.started"))
                if len(started) == 2:
                    scraped = _scrape(port)
                    # Each rank's forwarder sends on its own clock: wait for both ranks.
                    if all(scraped.get(("eventbus_last_step", (("rank", r),))) == 5
                           for r in ("0", "1")) and \
                            scraped.get(("eventbus_events_total", (("type", "METRIC"),))) == 12:
                        break
                time.sleep(0.2)
            (tmp_path / "out" / "release").write_text("")
            _, stderr = proc.communicate(timeout=JOB_TIMEOUT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode == 0, stderr[-5000:]
        spans, sums = _decode_otlp(otlp.requests)
        posts = [json.loads(body) for path, body in hook.requests if path == "/hook"]

    # Prometheus, scraped during the job
    assert scraped[("eventbus_events_total", (("type", "METRIC"),))] == 12, scraped
    assert scraped[("eventbus_worker_exits_total", (("exit_code", "3"),))] == 1
    assert scraped[("eventbus_restarts_total", ())] == 1
    assert scraped[("eventbus_last_step", (("rank", "0"),))] == 5
    # TensorBoard: every rank's steps and values, the restart as the attempt curve
    for rank in (0, 1):
        acc = EventAccumulator(str(tmp_path / "tb" / f"rank{rank}"),
                               size_guidance={"scalars": 0})
        acc.Reload()
        assert [(s.step, round(s.value, 4)) for s in acc.Scalars("loss")] == \
            [(step, round(rank + step / 10, 4)) for step in range(6)]
        assert [(s.step, s.value) for s in acc.Scalars("eventbus/attempt")] == \
            [(0, 0.0), (3, 1.0)]
    # OTLP: a span per worker per attempt, the failed one ERROR, counters
    workers = {(_attrs(s)["eventbus.attempt"], _attrs(s)["eventbus.rank"]): s
               for s in spans if s.name.startswith("eventbus worker")}
    assert sorted(workers) == [(0, 0), (0, 1), (1, 0), (1, 1)], [s.name for s in spans]
    assert workers[(0, 1)].status.code == 2  # STATUS_CODE_ERROR
    assert _attrs(workers[(0, 1)])["eventbus.exit_code"] == 3
    assert workers[(1, 1)].status.code != 2
    assert sums["eventbus.worker.exits{exit_code=3}"] == 1
    assert sums["eventbus.restarts{}"] == 1
    # Webhook: the failure with the agent's decision
    # the rank named with its host (the agent's, as EVENTBUS_HOSTNAME or the machine says)
    assert posts and posts[0]["text"].startswith(
        f"rank 1 on {posts[0]['event']['context']['hostname']} failed (exit code 3"), posts
    assert "; the group restarts as attempt 1 (" in posts[0]["text"]
    # MLflow: one run, every rank's metrics, FINISHED
    client = MlflowClient(tracking_uri=mlruns)
    (run,) = client.search_runs([client.get_experiment_by_name("eventbus").experiment_id])
    assert run.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "rank0/loss")) \
        == list(range(6))
