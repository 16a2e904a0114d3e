"""`eventbus trace` / eventbus.app.readers.trace: events JSONL -> Chrome Trace Event Format JSON."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from eventbus.app.cli import main as cli_main
from eventbus.app.readers.trace import export_trace

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
#: generous: two agents and four worker processes on a shared 2-core machine
TWO_NODE_TIMEOUT_S = 240.0
NODE0 = FIXTURES / "job_node0.jsonl"
NODE1 = FIXTURES / "job_node1.jsonl"

# What each phase must carry (Chrome Trace Event Format, the subset Perfetto reads).
_REQUIRED = {
    "M": {"name", "ph", "pid", "tid", "args"},
    "X": {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"},
    "i": {"name", "cat", "ph", "ts", "s", "pid", "tid", "args"},
    "C": {"name", "cat", "ph", "ts", "pid", "args"},
}


def _strict_load(path: Path) -> dict[str, Any]:
    def no_constants(name: str) -> None:
        raise AssertionError(f"non-standard JSON constant {name} in the trace")

    loaded: dict[str, Any] = json.loads(path.read_text(), parse_constant=no_constants)
    return loaded


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("trace") / "trace.json"
    assert cli_main(["trace", str(NODE0), str(NODE1), "-o", str(out)]) == 0
    return _strict_load(out)


def _threads(trace: dict[str, Any]) -> dict[tuple[int, int], str]:
    return {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
            if e["ph"] == "M" and e["name"] == "thread_name"}


def _track(trace: dict[str, Any], name: str, process: str) -> tuple[int, int]:
    pids = {e["args"]["name"]: e["pid"] for e in trace["traceEvents"]
            if e["ph"] == "M" and e["name"] == "process_name"}
    pid = pids[process]
    return next(k for k, v in _threads(trace).items() if k[0] == pid and v == name)


def test_trace_is_strict_json_in_the_documented_format(trace: dict[str, Any]) -> None:
    """Top-level object, known phases with their required keys, numeric ts/dur >= 0,
    int pid/tid, events in time order."""
    assert set(trace) == {"traceEvents", "displayTimeUnit", "otherData"}
    assert trace["displayTimeUnit"] == "ms"
    last = -1.0
    for event in trace["traceEvents"]:
        assert event["ph"] in _REQUIRED, event
        assert _REQUIRED[event["ph"]] <= set(event), event
        assert type(event["pid"]) is int
        if event["ph"] == "M":
            continue
        assert type(event["tid"]) is int
        assert isinstance(event["ts"], (int, float)) and event["ts"] >= 0
        assert event["ts"] >= last
        last = event["ts"]
        if event["ph"] == "X":
            assert event["dur"] >= 0
        if event["ph"] == "i":
            assert event["s"] in ("t", "p", "g")
    other = trace["otherData"]
    assert other["t0_unix_s"] == pytest.approx(1_764_410_000.0)
    assert other["run_id"] == "fixture-run" and other["outcome"] == "SUCCEEDED"
    assert len(other["skipped_lines"]) == 2


def test_one_track_per_node_and_rank(trace: dict[str, Any]) -> None:
    """A process per node (named with its host), an agent thread and a thread per rank."""
    processes = sorted(e["args"]["name"] for e in trace["traceEvents"]
                       if e["ph"] == "M" and e["name"] == "process_name")
    assert processes == ["node 0 (node-a)", "node 1 (node-b)"]
    assert sorted(_threads(trace).values()) == ["agent", "agent", "rank 0", "rank 1",
                                                "rank 2", "rank 3"]
    assert _track(trace, "rank 2", "node 1 (node-b)")[1] == 3


def test_worker_attempts_are_spans_with_exit_codes(trace: dict[str, Any]) -> None:
    """One 'worker' span per rank and attempt; the failed one says exit 3 in its name and
    args; the ones stopped for the restart say so."""
    spans = {e["name"]: e for e in trace["traceEvents"]
             if e["ph"] == "X" and e["cat"] == "worker"}
    assert sorted(spans) == sorted(
        [f"rank {r} attempt {a}" for r in (0, 2, 3) for a in (0, 1)]
        + ["rank 1 attempt 0 (exit 3)", "rank 1 attempt 1"])
    failed = spans["rank 1 attempt 0 (exit 3)"]
    assert failed["args"]["exit_code"] == 3 and failed["args"]["pid"] == 4102
    assert (failed["pid"], failed["tid"]) == _track(trace, "rank 1", "node 0 (node-a)")
    assert failed["ts"] == pytest.approx(1.31e6) and failed["dur"] == pytest.approx(2.29e6)
    assert spans["rank 0 attempt 0"]["args"]["ended_by"] == "attempt end"
    assert spans["rank 3 attempt 1"]["args"]["exit_code"] == 0


def test_attempts_and_rendezvous_are_spans_on_the_agent_track(trace: dict[str, Any]) -> None:
    """Two attempts per node; four rendezvous rounds whose duration is duration_s."""
    agent0 = _track(trace, "agent", "node 0 (node-a)")
    on_agent0 = [e for e in trace["traceEvents"]
                 if e["ph"] == "X" and (e["pid"], e["tid"]) == agent0]
    assert [e["name"] for e in on_agent0 if e["cat"] == "attempt"] == ["attempt 0", "attempt 1"]
    rdzv = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "rendezvous"]
    assert sorted(round(e["dur"] / 1e6, 2) for e in rdzv) == [0.8, 1.0, 1.15, 1.15]
    assert all(e["args"]["state"] == "SUCCEEDED" for e in rdzv)


def test_failures_restarts_checkpoints_and_user_types_are_instants(
        trace: dict[str, Any]) -> None:
    """Point events are instants with their fields (and data) as args."""
    instants = [e for e in trace["traceEvents"] if e["ph"] == "i"]
    failure = next(e for e in instants if e["cat"] == "failure")
    assert failure["name"] == "rank 1 failed (exit 3)"
    assert failure["args"]["exit_code"] == 3
    assert (failure["pid"], failure["tid"]) == _track(trace, "rank 1", "node 0 (node-a)")
    restarts = [e for e in instants if e["cat"] == "restart"]
    assert len(restarts) == 2 and {e["s"] for e in restarts} == {"p"}
    assert {e["args"]["reason"] for e in restarts} == {
        "worker 1 exited with code 3", "membership change: 1 node waiting"}
    checkpoints = sorted(e["args"]["path"] for e in instants if e["cat"] == "checkpoint")
    assert checkpoints == ["ckpt/epoch-0.pt", "ckpt/epoch-2.pt"]
    user = next(e for e in instants if e["name"] == "DATA_SHARD_LOADED")
    assert user["cat"] == "user"
    assert user["args"]["shard"] == 3 and user["args"]["data"] == {"rows": 4096}


def test_epochs_nest_inside_their_worker_span(trace: dict[str, Any]) -> None:
    """On every thread, spans nest (no partial overlap), which Perfetto needs to stack
    them; epochs sit inside worker spans."""
    by_thread: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            by_thread.setdefault((e["pid"], e["tid"]), []).append(e)
    for spans in by_thread.values():
        stack: list[float] = []
        for e in spans:  # already sorted by (ts, -dur)
            end = e["ts"] + e["dur"]
            while stack and stack[-1] <= e["ts"]:
                stack.pop()
            assert not stack or end <= stack[-1] + 0.2, e
            stack.append(end)
    epochs = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "epoch"]
    assert len(epochs) == 20
    assert sum(not e["args"]["finished"] for e in epochs) == 4


def test_metrics_become_counters_and_nan_stays_valid_json(trace: dict[str, Any]) -> None:
    """Finite METRIC values are counter samples per rank; a NaN loss is kept as the text
    'NaN' in an instant's args, so the file stays strict JSON."""
    counters = [e for e in trace["traceEvents"] if e["ph"] == "C" and e["name"] == "loss"]
    assert len(counters) == 16
    assert {next(iter(e["args"])) for e in counters} == {f"rank {r}" for r in range(4)}
    nan = next(e for e in trace["traceEvents"] if e["ph"] == "i" and e["cat"] == "metric")
    assert nan["args"]["data"] == {"loss": "NaN"}


def test_export_trace_merges_per_node_and_job_wide_files(tmp_path: Path) -> None:
    """A job-wide file plus per-node files give the same trace as the per-node files."""
    job_wide = tmp_path / "job.jsonl"
    job_wide.write_text(NODE0.read_text() + "\n" + NODE1.read_text())
    a = export_trace([NODE0, NODE1], tmp_path / "a.json")
    b = export_trace([job_wide, NODE0, NODE1], tmp_path / "b.json")
    assert a["traceEvents"] == b["traceEvents"]
    assert _strict_load(tmp_path / "b.json")["traceEvents"] == b["traceEvents"]


def test_cli_reports_skipped_lines_and_where_it_wrote(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """stdout names the output and what is in it; stderr lists each skipped line."""
    out = tmp_path / "t.json"
    assert cli_main(["trace", str(NODE0), "-o", str(out)]) == 0
    captured = capsys.readouterr()
    assert f"{out}: 42 events, 1 node(s), 2 rank(s), 2 attempt(s)" in captured.out
    assert "ui.perfetto.dev" in captured.out
    assert "job_node0.jsonl: 1 torn line(s) skipped" in captured.err


def test_cli_errors_name_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A missing input is exit 2 naming it; a file with no events is exit 1."""
    assert cli_main(["trace", str(tmp_path / "nope.jsonl")]) == 2
    assert "nope.jsonl: no such file" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("not an event\n")
    assert cli_main(["trace", str(empty), "-o", str(tmp_path / "x.json")]) == 1
    assert "no events in" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_a_directory_is_read_as_its_events_files(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """trace DIR traces the *.jsonl files in it (into DIR/trace.json) and says which; a
    directory without one is exit 2 saying so, not 'no such file'."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "node0.jsonl").write_text(NODE0.read_text())
    (run / "node1.jsonl").write_text(NODE1.read_text())
    assert cli_main(["trace", str(run)]) == 0
    err = capsys.readouterr().err
    assert "is a directory; reading its events files: node0.jsonl, node1.jsonl" in err
    both = _strict_load(run / "trace.json")
    assert both["otherData"]["events"] > 37
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli_main(["trace", str(empty)]) == 2
    err = capsys.readouterr().err
    assert "is a directory with no *.jsonl file" in err and "no such file" not in err


def test_heartbeats_are_counters_and_a_stall_an_instant() -> None:
    """WORKER_PROGRESS heartbeats become 'progress idle_s' / 'progress step' counter samples
    on their rank (not one instant a second); the stall is an instant on the stalled rank."""
    from eventbus.app.readers.jobview import JobView
    from eventbus.app.readers.trace import chrome_trace
    from tests.test_timeline import _stalled_job

    events = chrome_trace(JobView.from_records(_stalled_job()))["traceEvents"]
    progress = [e for e in events if e.get("cat") == "progress"]
    assert progress and all(e["ph"] == "C" for e in progress)
    assert {e["name"] for e in progress} == {"progress step"}
    assert not [e for e in events if e["ph"] == "i" and "WORKER_PROGRESS" in json.dumps(e)]
    (stall,) = [e for e in events if e.get("cat") == "stall"]
    assert stall["name"] == "rank 1 stalled (silent 20.0 s)" and stall["tid"] == 2


def test_a_drain_is_a_span_and_its_late_rank_not_a_failure() -> None:
    """A drain is a span on the agent track from PREEMPTING to the job's end, named with
    its sentence, the drain's facts in its args; the preempted attempt is yellow, not
    "terrible"; the rank that did not stop in time is a drain instant; the outcome is
    PREEMPTED."""
    from eventbus.app.readers.jobview import JobView
    from eventbus.app.readers.trace import chrome_trace
    from tests.test_jobview import DRAIN_FACTS
    from tests.test_jobview import drained_job

    trace = chrome_trace(JobView.from_records(drained_job()))
    events = trace["traceEvents"]
    (drain,) = [e for e in events if e.get("cat") == "drain" and e["ph"] == "X"]
    assert drain["name"] == "drain: SIGTERM on node 0, 3 s to stop"
    assert drain["tid"] == 0 and drain["cname"] == "yellow"
    assert drain["dur"] == pytest.approx(3.05e6)
    assert drain["args"]["drain"] == DRAIN_FACTS
    assert drain["args"]["end"].startswith("the job was preempted by SIGTERM on node 0")
    (attempt,) = [e for e in events if e.get("cat") == "attempt"]
    assert attempt["args"]["outcome"] == "preempted" and attempt["cname"] == "yellow"
    (late,) = [e for e in events if e["ph"] == "i" and e["args"].get("type") == "WORKER_EXIT"]
    assert late["name"] == "rank 1 did not stop in time (SIGTERM)"
    assert late["cat"] == "drain" and late["tid"] == 2
    assert not [e for e in events if e.get("cname") == "terrible"]
    assert trace["otherData"]["outcome"] == "PREEMPTED"


def test_default_output_is_next_to_the_first_input(tmp_path: Path) -> None:
    """Without -o the trace is trace.json beside the events file."""
    events = tmp_path / "events.jsonl"
    events.write_text(NODE1.read_text())
    assert cli_main(["trace", str(events)]) == 0
    assert _strict_load(tmp_path / "trace.json")["otherData"]["events"] == 37


def test_startup_and_unfinished_epochs_are_named(trace: dict[str, Any]) -> None:
    """Each worker span starts with a 'starting' span up to the worker's first own event;
    an epoch the crash cut short is named '(unfinished)'."""
    starting = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "startup"]
    assert len(starting) == 8
    rank1 = next(e for e in starting if e["args"]["rank"] == 1 and e["args"]["attempt"] == 0)
    assert rank1["args"]["seconds"] == pytest.approx(0.70)  # WORKER_START 1.31 -> epoch 2.01
    cut = sorted(e["name"] for e in trace["traceEvents"]
                 if e["ph"] == "X" and e["cat"] == "epoch" and not e["args"]["finished"])
    assert cut == ["epoch 1 (unfinished)"] * 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_trace_of_a_real_two_node_job(tmp_path: Path) -> None:
    """Two `eventbus run` agents (2 nodes x 1 worker, c10d rendezvous) each write their
    events file; rank 1 (node 1) crashes on attempt 0. Merged, the trace puts each rank on
    its node, shows the failure on node 1, a restart on each node (node 0's for the
    membership change), each worker process once, and the job's success."""
    port = _free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "eventbus", "run",
               "--events-jsonl", str(tmp_path / f"node{node}.jsonl"),
               "--reactor", "examples.reactor:restart_on_crash",
               "--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", "viz-two-nodes", "--monitor-interval", "0.1",
               str(ROOT / "examples" / "train.py"), "--epochs", "2", "--steps", "20",
               "--checkpoint-dir", str(tmp_path / "ckpt")]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=TWO_NODE_TIMEOUT_S)
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate(timeout=30)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-4000:] for o in outputs)

    trace = export_trace([tmp_path / "node0.jsonl", tmp_path / "node1.jsonl"],
                         tmp_path / "trace.json")
    assert _strict_load(tmp_path / "trace.json")["traceEvents"] == trace["traceEvents"]
    assert trace["otherData"]["outcome"] == "SUCCEEDED"
    processes = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
                 if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(name.split(" (")[0] for name in processes.values()) == ["node 0", "node 1"]
    workers = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "worker"]
    where = {(e["args"]["rank"], e["args"]["attempt"]): processes[e["pid"]].split(" (")[0]
             for e in workers}
    assert where == {(0, 0): "node 0", (0, 1): "node 0", (1, 0): "node 1", (1, 1): "node 1"}
    assert len(workers) == 4  # the job-wide copies in group rank 0's file counted once
    failed = {(e["args"]["rank"], e["args"]["attempt"]) for e in workers
              if e["args"].get("exit_code") not in (0, None)}
    # rank 0 may also die of the broken gloo connection before its agent restarts it
    assert (1, 0) in failed and failed <= {(1, 0), (0, 0)}
    restarts = {processes[e["pid"]].split(" (")[0] for e in trace["traceEvents"]
                if e["ph"] == "i" and e["cat"] == "restart"}
    assert restarts == {"node 0", "node 1"}
