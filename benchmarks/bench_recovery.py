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
medians of each phase).

Three figures side by side, each round interleaving torchrun (store not shared: the variant
whose restarts work) and ``eventbus run`` under its default options (warm spares on):

- a late crash (``LATE_STEP``: 6 s after the first step, the spares warm);
- an early crash (``EARLY_STEP``: 1 s after the first step, the spares started with the
  workers of attempt 0);
- steps/s over the first 3,000 steps after the first step of a tiny 2-rank gloo loop
  (benchmarks/health_loop.py, about 1 ms a step), under torchrun, ``eventbus run`` and
  ``eventbus run`` with ``EVENTBUS_WARM_SPARES=off``: what the spares' warm-up costs
  the workers while the job trains. Each case runs ``RATE_PER_ROUND`` times a round (a
  job's rate moves by up to 10% from one run to the next on this 2-core machine, whole
  runs at once, so only many runs give a median to compare within a few percent), and
  each run also gives the seconds from the launch to the end of the first step: what
  the spares' warm-up costs the job's start.

Torchrun as it comes (``LAUNCHERS[0]``) is in ``one()`` and in the under-load run, not in
the rounds: most of its restarts hang until the job's limit.

Every job has a time limit and runs in its own session, killed at its end with every
process it started (the workers run in sessions of their own: each carries the job's mark
in its environment, and the sweep ends what carries it).
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
import time
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
#: a restart that works ends the job in about 15 s on an idle machine, a minute and more
#: on a loaded one; torchrun's that connect to the old attempt's address fail or hang (a
#: hang is ended here and counted as a failure)
JOB_LIMIT_S = 180.0
#: torchrun as it comes; torchrun with the setting eventbus run makes for it (every
#: attempt its own worker store: docs/run.md, "Restarts that work"); eventbus run
LAUNCHERS = ("torchrun", "torchrun, store not shared", "eventbus run")
#: the script's marks after the crash, in order (the columns)
MARKS = ("start", "import", "init", "restore", "step")
TARGET_S = 1.0
TARGET_RATIO = 0.5
#: the steps rank 1 dies at (0.1 s a step): 6 s and 1 s after the first step
LATE_STEP, EARLY_STEP = 60, 10
#: what the rounds interleave
ROUND_LAUNCHERS = ("torchrun, store not shared", "eventbus run")
LATE_TARGET_S = 0.3
#: the steps/s cases: launcher, environment
RATE_CASES = ("torchrun", "eventbus run", "eventbus run, spares off")
RATE_STEPS = 3000
#: the steps/s jobs of each case per round
RATE_PER_ROUND = 2
RATE_TARGET = 0.97
LOOP = ROOT / "benchmarks" / "health_loop.py"


def _command(launcher: str, events: Path) -> list[str]:
    head = ([sys.executable, "-m", "torch.distributed.run"] if launcher.startswith("torchrun")
            else [sys.executable, "-m", "eventbus", "run", "--events-jsonl", str(events)])
    return [*head, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
            "--monitor-interval", "0.1", str(JOB)]


def one(launcher: str, crash_at: int = 40) -> dict[str, Any]:
    """One job whose rank 1 dies at step ``crash_at``: rc, seconds from the crash to each
    mark of attempt 1 (None: not reached), and the RECOVERED phases (eventbus run)."""
    with tempfile.TemporaryDirectory(prefix="bench-recovery-") as tmp:
        folder = Path(tmp)
        env = {**os.environ, "RECOVERY_OUT": tmp, "OMP_NUM_THREADS": "1",
               "RECOVERY_CRASH_AT": str(crash_at), "RECOVERY_STEPS": str(crash_at + 20),
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
        recovered, exits = [], []
        if (folder / "events.jsonl").exists():
            for line in (folder / "events.jsonl").read_text().splitlines():
                with contextlib.suppress(ValueError):
                    event = json.loads(line)
                    if event.get("type") == "RECOVERED":
                        recovered.append(event)
                    if event.get("type") == "WORKER_EXIT" and crash is not None:
                        exits.append(float(event["timestamp"]) - crash)
        if recovered:
            # "seen": the crash to the agent's first WORKER_EXIT (before RECOVERED's
            # "detect", which starts there), on the same clock as the script's marks
            seen = min((t for t in exits if t >= 0), default=None)
            out["phases"] = {"seen": None if seen is None else round(seen, 3),
                             **recovered[0]["data"]["phases"]}
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


def rate(case: str, steps: int = RATE_STEPS) -> float:
    """Steps/s of benchmarks/health_loop.py over ``steps`` steps after its first step, under
    ``case`` (:data:`RATE_CASES`), each option its default but the spares' in the last."""
    return rate_and_start(case, steps)[0]


def rate_and_start(case: str, steps: int = RATE_STEPS) -> tuple[float, float | None]:
    """:func:`rate`, and the seconds from the launcher's start to the end of the job's first
    step (the start's cost: with spares on, their imports share the cores with the
    workers' own start)."""
    launcher = ([sys.executable, "-m", "torch.distributed.run"] if case == "torchrun"
                else [sys.executable, "-m", "eventbus", "run"])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "BENCH_STEPS": str(steps),
           "BENCH_WARMUP": "1", "PYTHONPATH": os.pathsep.join(
               filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("EVENTBUS_WARM_SPARES", None)
    if case.endswith("spares off"):
        env["EVENTBUS_WARM_SPARES"] = "off"
    token = uuid.uuid4().hex
    env[MARK_VAR] = token
    # --max-restarts 1: a job that can restart (at torchrun's default 0, a --standalone
    # job keeps no spares, and "spares on" would be spares off)
    cmd = [*launcher, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
           "--monitor-interval", "0.1", str(LOOP)]
    with tempfile.TemporaryDirectory(prefix="bench-rate-") as tmp:
        launched = time.time()
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tmp,
                                  timeout=JOB_LIMIT_S * 2, check=False)
        finally:
            sweep(token)
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            found = json.loads(line)
            first = found.get("first_step_unix")
            return float(found["steps_per_s"]), (float(first) - launched if first else None)
    raise RuntimeError(f"{case}: no rate (rc {done.returncode}): {done.stderr[-2000:]}")


def _crash_rows(jobs: list[dict[str, Any]], name: str) -> tuple[list[dict[str, Any]],
                                                               dict[str, float | None]]:
    rows, medians = [], {}
    for launcher in ROUND_LAUNCHERS:
        mine = [j for j in jobs if j["launcher"] == launcher]
        worked = [j for j in mine if j["ok"]]
        row: dict[str, Any] = {"crash": name, "launcher": launcher,
                               "restarts worked": f"{len(worked)}/{len(mine)}"}
        for mark in MARKS:
            value = _median([j[mark] for j in worked if j[mark] is not None])
            row[f"-> {mark} (s)"] = "-" if value is None else round(value, 2)
        medians[launcher] = _median([j["step"] for j in worked]) if worked else None
        rows.append(row)
    return rows, medians


def run(*, quick: bool = False) -> dict[str, Any]:
    """``ROUNDS`` rounds (2 with ``quick``), each a late crash, an early crash and the
    steps/s cases, the launchers interleaved (their order reversed every other round);
    the medians side by side."""
    rounds = 2 if quick else ROUNDS
    load = os.getloadavg()[0]
    crashes = {"late": LATE_STEP, "early": EARLY_STEP}
    jobs: dict[str, list[dict[str, Any]]] = {name: [] for name in crashes}
    rates: dict[str, list[float]] = {case: [] for case in RATE_CASES}
    starts: dict[str, list[float]] = {case: [] for case in RATE_CASES}
    for index in range(rounds):
        flip = index % 2 == 1
        for name, step in crashes.items():
            for launcher in reversed(ROUND_LAUNCHERS) if flip else ROUND_LAUNCHERS:
                job = one(launcher, step)
                jobs[name].append(job)
                _progress(f"bench_recovery: round {index + 1}/{rounds} {name} crash, "
                          f"{launcher}", job)
        for repeat in range(1 if quick else RATE_PER_ROUND):
            turn = flip != (repeat % 2 == 1)
            for case in tuple(reversed(RATE_CASES)) if turn else RATE_CASES:
                steps_per_s, start_s = rate_and_start(case, 300 if quick else RATE_STEPS)
                rates[case].append(steps_per_s)
                if start_s is not None:
                    starts[case].append(start_s)
                print(f"bench_recovery: round {index + 1}/{rounds} {case}: "
                      f"{rates[case][-1]:.0f} steps/s", file=sys.stderr, flush=True)
    result: dict[str, Any] = {"rows": [], "rounds": rounds,
                              "1-minute load average, start / end": (
                                  f"{load:.1f} / {os.getloadavg()[0]:.1f}")}
    figures: dict[str, Any] = {}
    for name, step in crashes.items():
        rows, medians = _crash_rows(jobs[name], f"{name} ({step / 10:.0f} s)")
        result["rows"] += rows
        ours, theirs = medians["eventbus run"], medians["torchrun, store not shared"]
        every = all(j["ok"] for j in jobs[name] if j["launcher"] == "eventbus run")
        figures[f"{name} crash: eventbus run / torchrun, median s to recover"] = (
            f"{_fmt(ours)} / {_fmt(theirs)}"
            + (f" = {ours / theirs:.2f}x" if ours is not None and theirs else "")
            + ("" if every else " (a restart failed)"))
        phases = [j["phases"] for j in jobs[name]
                  if j["launcher"] == "eventbus run" and "phases" in j]
        if phases:
            figures[f"{name} crash: eventbus RECOVERED phases, medians (s)"] = ", ".join(
                f"{p} {_median([x[p] for x in phases if x.get(p) is not None]) or 0:.2f}"
                for p in phases[0])
        met = ours is not None and theirs is not None and every and (
            ours <= LATE_TARGET_S if name == "late"
            else ours <= TARGET_S and ours <= TARGET_RATIO * theirs)
        figures[f"{name} crash target ("
                + ("<= 0.3 s" if name == "late" else "<= 1.0 s, <= 0.5x torchrun")
                + ", every restart working)"] = "met" if met else "not met"
    median_rate = {case: statistics.median(v) for case, v in rates.items()}
    plain = median_rate["torchrun"]
    figures["steps/s, first 3,000 steps: torchrun / eventbus run / spares off"] = (
        " / ".join(f"{median_rate[c]:.0f}" for c in RATE_CASES))
    figures["steps/s vs torchrun: spares on (default) / spares off"] = (
        f"{median_rate['eventbus run'] / plain:.2f}x / "
        f"{median_rate['eventbus run, spares off'] / plain:.2f}x")
    figures["steps/s target (spares on >= 0.97x torchrun)"] = (
        "met" if median_rate["eventbus run"] >= RATE_TARGET * plain else "not met")
    figures["launch to the first step's end, median s: torchrun / eventbus run / spares off"] = (
        " / ".join(_fmt(_median(starts[c])) for c in RATE_CASES))
    figures["steps/s, every run (torchrun; on; off)"] = "; ".join(
        ", ".join(f"{r:.0f}" for r in rates[c]) for c in RATE_CASES)
    result.update(figures)
    return result


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


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
