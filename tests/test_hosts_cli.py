"""``eventbus hosts``: the report in each format, the threshold, bad input, and ``--from``
(ledger rows built from events files, imported twice without doubling)."""

from __future__ import annotations

import json
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from eventbus.app.cli import main as eventbus_main
from eventbus.app.launcher.hosts.history import outcomes_from_files
from eventbus.app.launcher.hosts.host_ledger import HostOutcome
from eventbus.app.launcher.hosts.host_ledger import write_outcomes
from eventbus.app.launcher.hosts.report import main
from eventbus.app.launcher.hosts.report import parse_duration
from tests.conftest import ROOT

DAY = 86400.0


#: every test's default ledger and spool under its own tmp_path (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("own_ledger")


@pytest.fixture
def ledger(tmp_path: Path) -> str:
    """Four hosts over the threshold, one under it (its fault 10 days old), one clean."""
    now = time.time()
    path = str(tmp_path / "hosts.sqlite")
    write_outcomes(path, [
        HostOutcome("node3", "job-1", 0, now - 3600, {"signal": 1, "ecc": 1}),
        HostOutcome("node17", "job-1", 0, now - 60, {"signal": 2}),
        HostOutcome("node18", "job-2", 1, now - 60, {"cuda": 1, "signal": 1}),
        HostOutcome("gpu-a1", "job-2", 0, now - 60, {"ecc": 1}, clean=False),
        HostOutcome("node5", "job-0", 0, now - 10 * DAY, {"signal": 1}),
        HostOutcome("node6", "job-1", 0, now - 60, {}, clean=True),
        HostOutcome("node6", "job-2", 0, now - 60, {}, clean=True),
    ])
    return path


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def _json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    code, out, _ = _run(capsys, *args, "--format", "json")
    assert code == 0
    result: dict[str, Any] = json.loads(out)
    return result


def test_the_table(ledger: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "--ledger", ledger)
    lines = out.splitlines()
    print(out)
    assert code == 0
    assert lines[0].split() == ["HOST", "SCORE", "FAULTS", "JOBS", "HURT", "CLEAN", "LAST",
                                "SEEN"]
    assert lines[1].startswith("node3 ") and "2.99 *" in lines[1]  # 3, an hour decayed
    assert "ecc 1, signal 1" in lines[1]
    assert "1 of 1" in lines[1] and "(60 min ago)" in lines[1]
    node6 = next(line for line in lines if line.startswith("node6"))
    assert "0.00 " in node6 and " - " in node6 and "0 of 2" in node6 and " 2 " in node6
    assert lines[-1].startswith("* over the threshold 1: 4 of 6 hosts")


def test_json_holds_every_host_with_its_counts(ledger: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    report = _json(capsys, "--ledger", ledger)
    hosts = {h["host"]: h for h in report["hosts"]}
    assert [h["host"] for h in report["hosts"]][:1] == ["node3"]
    assert sorted(report["over_threshold"]) == ["gpu-a1", "node17", "node18", "node3"]
    assert hosts["node3"]["faults"] == {"ecc": 1, "signal": 1}
    assert hosts["node5"]["score"] == pytest.approx(0.5 ** (10 / 7), abs=1e-3)
    assert hosts["node6"]["clean"] == 2 and hosts["node6"]["jobs"] == 2
    assert report["threshold"] == 1.0 and report["half_life_s"] == 7 * DAY


def test_slurm_and_k8s_name_the_hosts_over_the_threshold(
        ledger: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(capsys, "--ledger", ledger, "--format", "slurm")[1] == \
        "--exclude=gpu-a1,node[3,17-18]\n"
    code, out, _ = _run(capsys, "--ledger", ledger, "--format", "k8s", "--threshold", "2.5")
    assert code == 0 and out.splitlines() == [
        "kubectl cordon node3",
        "kubectl taint nodes node3 eventbus.dev/bad-host=true:NoSchedule --overwrite"]
    code, out, _ = _run(capsys, "--ledger", ledger, "--format", "k8s")
    assert len(out.splitlines()) == 8
    code, out, err = _run(capsys, "--ledger", ledger, "--format", "slurm", "--threshold", "9")
    assert (code, out) == (0, "") and "no host over the threshold 9" in err


def test_since_keeps_only_recent_outcomes(ledger: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert "node5" in {h["host"] for h in _json(capsys, "--ledger", ledger)["hosts"]}
    recent = {h["host"] for h in _json(capsys, "--ledger", ledger, "--since", "7d")["hosts"]}
    assert "node5" not in recent and "node3" in recent
    assert {h["host"] for h in _json(capsys, "--ledger", ledger, "--since", "30m")["hosts"]} \
        == {"node17", "node18", "gpu-a1", "node6"}


@pytest.mark.parametrize(("args", "named"), [
    (["--format", "xml"], "--format"),
    (["--since", "7x"], "--since"),
    (["--since", ""], "--since"),
    (["--threshold", "-1"], "--threshold"),
    (["--threshold", "many"], "--threshold"),
    (["--ledger", "mysql://u:pw@h/db"], "--ledger"),
])
def test_bad_input_exits_2_naming_the_option(
        args: list[str], named: str, ledger: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--ledger", ledger, *args])
    err = capsys.readouterr().err
    assert info.value.code == 2 and f"argument {named}" in err, err
    assert "pw@" not in err


def test_durations() -> None:
    assert [parse_duration(t) for t in ("90", "90s", "30m", "12h", "7d", "2w", "1.5d")] == \
        [90, 90, 1800, 43200, 7 * DAY, 14 * DAY, 1.5 * DAY]
    with pytest.raises(ValueError, match="30m, 12h, 7d"):
        parse_duration("7x")


def test_the_command_is_wired(ledger: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert eventbus_main(["hosts", "--ledger", ledger, "--format", "slurm"]) == 0
    assert capsys.readouterr().out.startswith("--exclude=")
    assert eventbus_main(["--help"]) == 0
    assert "hosts" in capsys.readouterr().out


def test_an_empty_or_missing_ledger(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "none.sqlite"
    code, out, _ = _run(capsys, "--ledger", str(missing))
    assert code == 0 and out.strip() == f"no hosts in the ledger {missing}"
    assert not missing.exists()


def test_a_ledger_that_cannot_be_read_exits_1(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    corrupt = tmp_path / "hosts.sqlite"
    corrupt.write_bytes(b"garbage" * 50)
    code, out, err = _run(capsys, "--ledger", str(corrupt))
    assert code == 1 and out == "" and "corrupt" in err and str(corrupt) in err


def test_without_psycopg_the_command_names_the_extra(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "psycopg", None)
    code, _, err = _run(capsys, "--ledger", "postgresql://u:pw@127.0.0.1:1/db")
    assert code == 1 and "pip install 'eventbus[postgres]'" in err
    assert "postgresql://u:***@127.0.0.1:1/db" in err


# -- --from --------------------------------------------------------------------------------

def _event(kind: str, ts: float, hostname: str, attempt: int | None, *, run: str = "job-a",
           data: dict[str, Any] | None = None, rank: int | None = None,
           **fields: Any) -> dict[str, Any]:
    context = {"rank": rank, "local_rank": None, "group_rank": 0, "world_size": None,
               "local_world_size": None, "role": None, "run_id": run,
               "restart_count": attempt, "hostname": hostname, "pid": 100}
    return {"type": kind, "timestamp": ts, **fields, "data": data or {}, "context": context}


def _events(t0: float) -> list[dict[str, Any]]:
    """A job on node3 and node4: a SIGSEGV on node3, then a hang it is the culprit of and
    its eviction; node4 a straggler, then a clean last attempt."""
    return [
        _event("AGENT_START", t0, "node3", None, entrypoint="train.py"),
        _event("WORKER_START", t0 + 1, "node3", 0, worker_id=0),
        _event("WORKER_START", t0 + 1, "node4", 0, worker_id=1),
        _event("WORKER_EXIT", t0 + 5, "node3", 0, worker_id=0, exit_code=-11,
               signal="SIGSEGV", cause="failure", data={"host_fault": "signal"}),
        _event("WORKER_EXIT", t0 + 6, "node4", 0, worker_id=1, exit_code=-15,
               signal="SIGTERM", cause="failure", data={"stopped_by_agent": True}),
        _event("WORKER_STALLED", t0 + 20, "node3", 1, worker_id=0, silent_s=30.0,
               data={"host_fault": "hang", "culprit_ranks": [0]}),
        _event("WORKER_STALLED", t0 + 20, "node4", 1, worker_id=1, silent_s=30.0,
               data={"culprit_ranks": [0]}),
        *[_event("WORKER_SLOW", t0 + 10 + i, "node4", 1, worker_id=1, factor=2.0)
          for i in range(3)],
        _event("HOST_EVICTED", t0 + 21, "node3", 1, host="node3", faults=2,
               reason="2 host faults"),
        _event("WORKER_EXIT", t0 + 40, "node4", 2, worker_id=1, exit_code=0),
        _event("AGENT_EXIT", t0 + 41, "node4", 2, state="SUCCEEDED", exit_code=0),
    ]


def _write(path: Path, events: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(e, separators=(",", ":")) + "\n" for e in events))
    return path


def test_rows_from_events(tmp_path: Path) -> None:
    t0 = time.time() - 3600
    outcomes, problems = outcomes_from_files([_write(tmp_path / "e.jsonl", _events(t0))])
    rows = {(o.host, o.attempt): o for o in outcomes}
    assert problems == [] and sorted(rows) == [("node3", 0), ("node3", 1), ("node4", 0),
                                               ("node4", 1), ("node4", 2)]
    assert rows["node3", 0].faults == {"signal": 1} and not rows["node3", 0].clean
    assert rows["node3", 1].faults == {"hang": 1} and rows["node3", 1].culprit == 1
    assert rows["node4", 0].faults == {} and not rows["node4", 0].clean
    assert rows["node4", 1].faults == {"straggler": 1} and rows["node4", 1].straggler == 1
    assert rows["node4", 1].culprit == 0
    assert rows["node4", 2].clean and rows["node4", 2].time == t0 + 41
    assert {o.job for o in outcomes} == {"job-a"}


def _ledger_rows(path: Path) -> list[tuple[Any, ...]]:
    db = sqlite3.connect(path)
    try:
        return db.execute("SELECT * FROM eventbus_host_outcomes ORDER BY host, attempt"
                          ).fetchall()
    finally:
        db.close()


def test_from_files_into_the_default_ledger_twice_doubles_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--from without --ledger: the default ledger, then the report. The same file again,
    and a second file holding the same events (a node's own file beside the job-wide one),
    change no row."""
    events = _events(time.time() - 3600)
    job_wide = _write(tmp_path / "job.jsonl", events)
    node3 = _write(tmp_path / "node3.jsonl", [e for e in events
                                              if e["context"]["hostname"] == "node3"])
    code, out, err = _run(capsys, "--from", str(job_wide))
    default = tmp_path / "state" / "eventbus" / "hosts.sqlite"
    assert code == 0 and "5 outcome(s) of 2 host(s) from 1 file(s) written to" in err
    assert out.splitlines()[1].startswith("node3 ") and "hang 1, signal 1" in out
    first = _ledger_rows(default)
    assert len(first) == 5
    assert _run(capsys, "--from", str(job_wide), str(node3), str(job_wide))[0] == 0
    assert _run(capsys, "--from", str(node3), "--format", "json")[0] == 0
    assert _ledger_rows(default) == first
    report = _json(capsys)
    node3_summary = next(h for h in report["hosts"] if h["host"] == "node3")
    assert node3_summary["faults"] == {"hang": 1, "signal": 1}
    assert node3_summary["culprit"] == 1 and node3_summary["jobs_hurt"] == 1


def test_from_the_fixture_job(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A real job's two node files: a script's RuntimeError is no host fault; the attempt
    after it finished cleanly on both hosts."""
    ledger = str(tmp_path / "fixture.sqlite")
    files = [str(ROOT / "tests" / "fixtures" / name)
             for name in ("job_node0.jsonl", "job_node1.jsonl")]
    report = _json(capsys, "--ledger", ledger, "--from", *files)
    assert report["hosts"] and report["over_threshold"] == []
    for host in report["hosts"]:
        assert host["faults"] == {} and host["score"] == 0.0
        assert host["clean"] >= 1 and host["attempts"] >= 2, host


def test_from_a_missing_file_exits_1(tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "--ledger", str(tmp_path / "l.sqlite"),
                        "--from", str(tmp_path / "nope.jsonl"))
    assert code == 1 and "nope.jsonl" in err


def test_a_requeued_slurm_job_keeps_each_runs_rows(tmp_path: Path) -> None:
    """A requeued SLURM job runs again with the same run id and attempts, into the same
    file: its AGENT_START names the run's ledger key (JOB+requeue1, as the agent's own
    rows), and the first run's fault is kept in a row of its own."""
    t0 = time.time() - 3600
    requeued = {"ledger_job": "4242+requeue1"}
    events = [
        _event("AGENT_START", t0, "n1", 0, run="4242", entrypoint="train.py"),
        _event("WORKER_EXIT", t0 + 5, "n1", 0, run="4242", worker_id=0, exit_code=-11,
               signal="SIGSEGV", cause="failure", data={"host_fault": "signal"}),
        _event("AGENT_START", t0 + 60, "n1", 0, run="4242", data=requeued,
               entrypoint="train.py"),
        _event("WORKER_EXIT", t0 + 70, "n1", 0, run="4242", worker_id=0, exit_code=0),
        _event("AGENT_EXIT", t0 + 71, "n1", 0, run="4242", state="SUCCEEDED", exit_code=0),
    ]
    outcomes, _ = outcomes_from_files([_write(tmp_path / "e.jsonl", events)])
    rows = {(o.job, o.attempt): o for o in outcomes}
    assert sorted(rows) == [("4242", 0), ("4242+requeue1", 0)], rows
    assert rows["4242", 0].faults == {"signal": 1} and not rows["4242", 0].clean
    assert rows["4242+requeue1", 0].faults == {} and rows["4242+requeue1", 0].clean
