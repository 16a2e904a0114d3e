"""Recovery: from a failure to the next attempt's first step, torchrun against
``eventbus run`` (``python -m benchmarks --only recovery``; PERFORMANCE.md, "Recovery").

The job is benchmarks/recovery_job.py (2 gloo ranks, a DDP MLP, a checkpoint every 20
steps; on attempt 0 rank 1 dies at step 40; ``--max-restarts 1``), run under each launcher
in turn, interleaved round by round (``ROUNDS``, at least 5 each). The figures come from the
script's own clock (its marks: the crash, then each rank's ``start``, ``import``, ``init``,
``restore`` and first ``step`` of attempt 1; the slowest rank's), so the launchers are
measured alike (torchrun as it comes, and with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``,
which ``eventbus run`` sets for it and without which its restarts connect to the old
attempt's address); a restart worked when both ranks of attempt 1 completed a step and the job
exited 0. For ``eventbus run`` the agent's ``RECOVERED`` phases are reported too (the
medians of each phase). Every job has a time limit and runs in its own session, killed
at its end with every process it started (the workers run in sessions of their own: each
carries the job's mark in its environment, and the sweep ends what carries it).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

from benchmarks.bench_detection import _BUSY
from benchmarks.bench_detection import MARK_VAR
from benchmarks.bench_detection import sweep

__all__ = ["LAUNCHERS", "ROUNDS", "run", "under_load"]

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "benchmarks" / "recovery_job.py"
ROUNDS = 5
#: a restart that works ends the job in about 15 s; torchrun's that connect to the old
#: attempt's address fail or hang (a hang is ended here and counted as a failure)
JOB_LIMIT_S = 60.0
#: torchrun as it comes; torchrun with the setting eventbus run makes for it (every
#: attempt its own worker store: docs/run.md, "Restarts that work"); eventbus run
LAUNCHERS = ("torchrun", "torchrun, store not shared", "eventbus run")
#: the script's marks after the crash, in order (the columns)
MARKS = ("start", "import", "init", "restore", "step")
TARGET_S = 1.0
TARGET_RATIO = 0.5


def _command(launcher: str, events: Path) -> list[str]:
    head = ([sys.executable, "-m", "torch.distributed.run"] if launcher.startswith("torchrun")
            else [sys.executable, "-m", "eventbus", "run", "--events-jsonl", str(events)])
    return [*head, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
            "--monitor-interval", "0.1", str(JOB)]


def one(launcher: str) -> dict[str, Any]:
    """One job: rc, seconds from the crash to each mark of attempt 1 (None: not reached),
    and the RECOVERED phases (eventbus run)."""
    with tempfile.TemporaryDirectory(prefix="bench-recovery-") as tmp:
        folder = Path(tmp)
        env = {**os.environ, "RECOVERY_OUT": tmp, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                           os.environ.get("PYTHONPATH")]))}
        token = uuid.uuid4().hex  # the sweep ends every process that carries it
        env[MARK_VAR] = token
        env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
        env.pop("EVENTBUS_WARM_SPARES", None)  # the default: on
        if launcher == "torchrun, store not shared":
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        with (folder / "job.log").open("wb") as log:
            proc = subprocess.Popen(_command(launcher, folder / "events.jsonl"), cwd=tmp,
                                    env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                rc: int | None = proc.wait(timeout=JOB_LIMIT_S)
            except subprocess.TimeoutExpired:
                rc = None
            finally:  # torch starts the workers in sessions of their own: swept by mark
                sweep(token)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        marks = [json.loads(line) for line in (folder / "marks.jsonl").read_text().splitlines()
                 if line.strip()] if (folder / "marks.jsonl").exists() else []
        crash = next((m["t"] for m in marks if m["mark"] == "crash"), None)
        out: dict[str, Any] = {"launcher": launcher, "rc": rc}
        for name in MARKS:
            seen = [m["t"] for m in marks if m["mark"] == name and m["attempt"] == 1]
            out[name] = (max(seen) - crash) if crash is not None and len(seen) == 2 else None
        out["ok"] = rc == 0 and out["step"] is not None
        recovered = []
        if (folder / "events.jsonl").exists():
            for line in (folder / "events.jsonl").read_text().splitlines():
                with contextlib.suppress(ValueError):
                    event = json.loads(line)
                    if event.get("type") == "RECOVERED":
                        recovered.append(event)
        if recovered:
            out["phases"] = recovered[0]["data"]["phases"]
        if not out["ok"]:
            text = (folder / "job.log").read_text(errors="replace").splitlines()
            out["tail"] = " | ".join(line for line in text[-4:])[-400:]
    return out


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _progress(prefix: str, job: dict[str, Any]) -> None:
    """One job's progress line on stderr: ``prefix``, then its time to recover or why not."""
    print(f"{prefix}: " + (f"first step {job['step']:.2f} s after the crash" if job["ok"]
                           else f"FAILED (rc {job['rc']}): {job.get('tail', '')}"),
          file=sys.stderr, flush=True)


def run(*, quick: bool = False) -> dict[str, Any]:
    """``ROUNDS`` rounds (2 with ``quick``), the launchers interleaved; the medians."""
    rounds = 2 if quick else ROUNDS
    jobs: list[dict[str, Any]] = []
    for index in range(rounds):
        order = LAUNCHERS if index % 2 == 0 else tuple(reversed(LAUNCHERS))
        for launcher in order:
            job = one(launcher)
            jobs.append(job)
            _progress(f"bench_recovery: round {index + 1}/{rounds} {launcher}", job)
    rows = []
    medians: dict[str, float | None] = {}
    for launcher in LAUNCHERS:
        mine = [j for j in jobs if j["launcher"] == launcher]
        worked = [j for j in mine if j["ok"]]
        row: dict[str, Any] = {"launcher": launcher,
                               "restarts worked": f"{len(worked)}/{len(mine)}"}
        for name in MARKS:
            value = _median([j[name] for j in worked if j[name] is not None])
            row[f"-> {name} (s)"] = "-" if value is None else round(value, 2)
        medians[launcher] = _median([j["step"] for j in worked])
        rows.append(row)
    ours = medians["eventbus run"]
    # torchrun's figure: its restarts that worked, in the variant that worked best
    found = [m for name, m in medians.items() if name != "eventbus run" and m is not None]
    theirs = min(found) if found else None
    result: dict[str, Any] = {"rows": rows, "rounds": rounds}
    phases = [j["phases"] for j in jobs if j["launcher"] == "eventbus run" and "phases" in j]
    if phases:
        result["eventbus RECOVERED phases, medians (s)"] = ", ".join(
            f"{name} {_median([p[name] for p in phases if p.get(name) is not None]) or 0:.2f}"
            for name in phases[0])
    if ours is not None:
        result["eventbus run: median time to recover (s)"] = round(ours, 2)
    if ours is not None and theirs is not None:
        result["eventbus run / torchrun (its faster variant)"] = round(ours / theirs, 2)
    every = all(j["ok"] for j in jobs if j["launcher"] == "eventbus run")
    result["target (<= 1.0 s, <= 0.5 x torchrun's best, every restart working)"] = (
        "met" if ours is not None and theirs is not None and every and ours <= TARGET_S
        and ours <= TARGET_RATIO * theirs else "not met")
    return result


def under_load(restarts: int = 20, launcher: str = "eventbus run") -> dict[str, Any]:
    """RELIABILITY row 44: ``restarts`` restarts of the same job under ``launcher``
    while one busy-looping process per core keeps the machine loaded (as
    bench_detection's jobs run): how many reached their first step, and the time to recover,
    p50 and max."""
    busy = [subprocess.Popen([sys.executable, "-c", _BUSY]) for _ in range(os.cpu_count() or 1)]
    jobs = []
    try:
        for index in range(restarts):
            job = one(launcher)
            jobs.append(job)
            _progress(f"bench_recovery under load: {launcher} {index + 1}/{restarts}", job)
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    times = sorted(j["step"] for j in jobs if j["ok"])
    return {"launcher": launcher, "restarts worked": f"{len(times)}/{len(jobs)}",
            "busy processes": len(busy),
            "time to recover p50 (s)": round(statistics.median(times), 2) if times else None,
            "time to recover max (s)": round(times[-1], 2) if times else None,
            "failures": [j.get("tail") for j in jobs if not j["ok"]]}


if __name__ == "__main__":
    if "--under-load" in sys.argv:
        # the launchers one after the other: eventbus run, then torchrun in the variant
        # whose restarts work, for the ratio
        print(json.dumps([under_load(20), under_load(10, "torchrun, store not shared")],
                         indent=2))
    else:
        print(json.dumps(run(quick="--quick" in sys.argv), indent=2))
