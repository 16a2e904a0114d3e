"""Job health's detection error rates, measured on real jobs under load.

Every figure comes from real ``python -m eventbus run --standalone --nproc-per-node 2``
jobs (gloo on CPU) run while this script keeps every core busy: it starts one
busy-looping process per core (``os.cpu_count()``) before the first job and kills them
after the last, on an error or Ctrl-C too (and each one ends by itself when this process
is gone). Two measurements:

1. **Stall-to-verdict latency** over ``--hangs`` jobs (default 20):
   tests/reliability/jobs/quiet_job.py's hangs (rank 1 before a step's collective: blocked
   on a lock, in a sleep, spinning in one line, or skipping the collective its peer waits
   in, in turn), under ``--stall-timeout 4 --max-restarts 0``. The latency is the
   ``WORKER_STALLED`` event's timestamp (for the culprit, in the job's
   ``--events-jsonl``) less the time the script wrote when it hung; target: within the
   timeout + 1 s. A job with no verdict for rank 1 is a miss, counted and named with its
   reason; each verdict's ``waiting_on`` is tabulated.
2. **False stalls and false stragglers** over ``--healthy`` runs (default 5 of each kind)
   that never hang, under ``--stall-timeout auto``: :data:`KINDS` taken in turn. A plain
   gloo loop, a Lightning DDP run and a Hugging Face ``Trainer`` run with no quiet phase
   (tests/jobs/, tiny models built from a config, nothing downloaded), and the quiet phases
   of row 41 (tests/reliability/jobs/quiet_job.py: every rank validating, rank 0 saving
   to slow storage, rank 0 evaluating alone, a ``torch.compile`` recompile, a late batch,
   Lightning's validation, a transformers ``Trainer`` evaluation of one long batch and
   rank 0 writing samples alone after it), each lasting 3 x the floor. Lightning
   and transformers are optional, and a kind whose trainer does not import is skipped and
   named. Every script runs unchanged, with no eventbus call (the trainer scripts with
   ``EVENTBUS_CALLBACK=off``): what the heartbeats alone tell the agent. Every
   ``WORKER_STALLED`` of a run is a false one (target: 0), and every ``WORKER_SLOW`` a
   false straggler report (no restart follows one); each run's exit is noted. ``auto``
   never stalls a rank below its floor (``--stall-auto-floor``, 60 s by default), so the
   runs use ``--auto-floor`` (default 5 s): a lower floor can only add stalls, so none at
   5 s means none at 60 s. Each run's worker events are also replayed through the stall
   watch on their own timestamps, to give the longest silence a rank came back from and
   the largest share of its timeout it reached: how close the run came to a false stall.

Every job has a timeout, runs in a temporary folder that is removed, and is swept after
it ends: every process that carries the job's marker in its environment is killed. One
progress line per job goes to stderr. The output is a markdown section (stdout; ``--json``
prints the raw figures instead); ``--write`` puts it into benchmarks/RESULTS.md, after the
hand-run marker, and into docs/run.md's "Job health", each time between the markers
``<!-- detection:begin -->`` and ``<!-- detection:end -->`` (a rerun replaces it).

    python -m benchmarks.bench_detection --quick   # 2 hangs, one healthy run per kind
    python -m benchmarks.bench_detection --write   # 20 + 55 jobs (about 40 minutes)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from collections.abc import Sequence
from dataclasses import asdict
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from types import FrameType
from typing import Any

from benchmarks.__main__ import HAND_RUN_MARKER
from eventbus.app.health.watches import StallWatch
from eventbus.subscribers.jsonl import read_jsonl

__all__ = ["BEGIN", "END", "KINDS", "Hang", "Healthy", "Load", "main", "percentile",
           "render", "replace_section"]

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
DOC = ROOT / "docs" / "run.md"
#: where the section goes in docs/run.md the first time: the end of "Job health"
DOC_ANCHOR = "\n## Restarts that work"
BEGIN, END = "<!-- detection:begin -->", "<!-- detection:end -->"

HANG_TIMEOUT_S = 4.0
#: the target: a verdict within the timeout + this
TARGET_OVER_S = 1.0
DEFAULT_AUTO_FLOOR_S = 5.0
#: each job's wall-clock limit: two ranks import torch (and a trainer) on busy cores
HANG_JOB_LIMIT_S = 240.0
HEALTHY_JOB_LIMIT_S = 480.0
#: set in each job's environment, unique per job: the sweep kills what carries it
MARK_VAR = "EVENTBUS_BENCH_DETECTION"

# A busy loop that ends when its parent (this script) is gone, whatever killed it.
_BUSY = ("import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n"
         "    for _ in range(200000):\n        pass\n")


@dataclass(frozen=True)
class Kind:
    """A healthy job: its script, the trainer it needs, its environment (full, quick)."""

    name: str
    script: str
    needs: str  # the import that must work, "" for none
    label: str  # what the table says of the script
    env: dict[str, str]
    quick_env: dict[str, str]


#: a quiet phase lasts this many times the auto floor: past the timeout, so silence
#: alone would stall it; the evidence must not
QUIET_X = 3.0
QUIET = "reliability/jobs/quiet_job.py"
#: the hangs of row 42, taken in turn (tests/reliability/jobs/quiet_job.py's modes)
HANG_KINDS = ("lock", "sleep", "spin", "skip")

KINDS: tuple[Kind, ...] = (
    Kind("plain", "jobs/plain_train.py", "",
         "plain gloo loop, no eventbus call (tests/jobs/plain_train.py)",
         {"PLAIN_MODE": "healthy", "PLAIN_STEPS": "400", "PLAIN_STEP_S": "0.05"},
         {"PLAIN_MODE": "healthy", "PLAIN_STEPS": "100", "PLAIN_STEP_S": "0.05"}),
    Kind("lightning", "jobs/lightning_train.py", "lightning.pytorch",
         "Lightning DDP, tiny Linear, the script unchanged: no eventbus callback "
         "(tests/jobs/lightning_train.py, `EVENTBUS_CALLBACK=off`)",
         {"MAX_STEPS": "400", "STEP_S": "0.05", "EVENTBUS_CALLBACK": "off"},
         {"MAX_STEPS": "100", "STEP_S": "0.05", "EVENTBUS_CALLBACK": "off"}),
    Kind("transformers", "jobs/hf_train.py", "transformers, accelerate",
         "transformers Trainer, tiny GPT-2 from a config, the script unchanged: no eventbus "
         "callback (tests/jobs/hf_train.py, `EVENTBUS_CALLBACK=off`)",
         {"MAX_STEPS": "300", "STEP_S": "0.05", "EVENTBUS_CALLBACK": "off"},
         {"MAX_STEPS": "80", "STEP_S": "0.05", "EVENTBUS_CALLBACK": "off"}),
    # row 41: quiet phases that outlast the timeout ({quiet}: QUIET_X x the auto floor)
    *(Kind(mode, QUIET, "", label, {"QUIET_MODE": mode, "QUIET_S": "{quiet}"},
           {"QUIET_MODE": mode, "QUIET_S": "{quiet}"}) for mode, label in (
        ("validate", "every rank validating (no_grad forward passes, no collective)"),
        ("save", "rank 0 in `torch.save` to slow storage, rank 1 in a barrier"),
        ("evaluate", "rank 0 evaluating alone, rank 1 in a barrier"),
        ("compile", "a `torch.compile` recompile whose compiler takes the quiet phase"),
        ("data", "rank 1's batch late from its DataLoader worker (reported, not a stall)"))),
    Kind("lightning-val", "jobs/lightning_train.py", "lightning.pytorch",
         "Lightning DDP with a validation epoch of the quiet phase, unchanged script",
         {"MAX_STEPS": "60", "STEP_S": "0.05", "EVENTBUS_CALLBACK": "off",
          "VAL_S": "{quiet}", "VAL_EVERY": "30"},
         {"MAX_STEPS": "40", "STEP_S": "0.05", "EVENTBUS_CALLBACK": "off",
          "VAL_S": "{quiet}", "VAL_EVERY": "20"}),
    # one evaluation batch of the quiet phase: the Trainer gathers the loss after each
    # batch, so with short batches its ranks are never silent
    Kind("transformers-eval", "jobs/hf_train.py", "transformers, accelerate",
         "transformers `Trainer` whose evaluation is one batch of the quiet phase (every "
         "rank), unchanged script",
         {"MAX_STEPS": "60", "STEP_S": "0.05", "EVENTBUS_CALLBACK": "off",
          "EVAL_S": "{quiet}", "EVAL_BATCHES": "1", "EVAL_EVERY": "30"},
         {"MAX_STEPS": "40", "STEP_S": "0.05", "EVENTBUS_CALLBACK": "off",
          "EVAL_S": "{quiet}", "EVAL_BATCHES": "1", "EVAL_EVERY": "20"}),
    Kind("transformers-samples", "jobs/hf_train.py", "transformers, accelerate",
         "transformers `Trainer`, rank 0 alone writing samples for the quiet phase after "
         "each evaluation (an `on_evaluate` callback), rank 1 in the next step's all_reduce",
         {"MAX_STEPS": "60", "STEP_S": "0.05", "EVENTBUS_CALLBACK": "off", "EVAL_S": "1",
          "EVAL_BATCHES": "1", "SAMPLE_S": "{quiet}", "EVAL_EVERY": "30"},
         {"MAX_STEPS": "40", "STEP_S": "0.05", "EVENTBUS_CALLBACK": "off", "EVAL_S": "1",
          "EVAL_BATCHES": "1", "SAMPLE_S": "{quiet}", "EVAL_EVERY": "20"}),
)


@dataclass
class Hang:
    """One hang job: the verdict's latency (None: a miss, ``note`` says why)."""

    index: int
    seconds: float
    exit_code: int | None  # None: killed at its limit
    latency_s: float | None = None
    note: str = ""
    other_stalls: list[dict[str, Any]] = field(default_factory=list)
    kind: str = "spin"
    #: what the verdict said rank 1 waits on
    waiting_on: str | None = None


@dataclass
class Healthy:
    """One healthy run: what the watches said (each event's fields), and how it ended."""

    kind: str
    index: int
    seconds: float
    exit_code: int | None  # None: killed at its limit
    agent_exit: str = ""  # AGENT_EXIT's state and exit code, "" when none was recorded
    stalls: list[dict[str, Any]] = field(default_factory=list)
    slows: list[dict[str, Any]] = field(default_factory=list)
    #: WORKER_STALLED reports of a rank waiting for data (no verdict: not false stalls)
    data_waits: list[dict[str, Any]] = field(default_factory=list)
    longest_silence_s: float = 0.0
    timeout_share: float = 0.0
    note: str = ""

    @property
    def failed(self) -> bool:
        return self.exit_code != 0


# -- pure parts: percentiles, the section, its place in a file ------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, linear between the closest ranks (as
    numpy's default); NaN for no values."""
    if not values:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"q must be within 0-100, got {q!r}")
    ordered = sorted(values)
    position = q / 100 * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def replace_section(text: str, section: str, *, after: str) -> str:
    """``text`` with ``section`` between :data:`BEGIN` and :data:`END`: in place of the
    previous one where the markers are there, else inserted after the first line that
    contains ``after`` (or, where ``after`` starts with a newline, just before it: a
    heading to end the section before). ValueError when neither is found, or the markers
    are out of order."""
    block = f"{BEGIN}\n{section.strip()}\n{END}"
    begin, end = text.find(BEGIN), text.find(END)
    if begin >= 0 or end >= 0:
        if not 0 <= begin < end:
            raise ValueError(f"{BEGIN} and {END} are not both there, in that order")
        return text[:begin] + block + text[end + len(END):]
    at = text.find(after)
    if at < 0:
        raise ValueError(f"found neither the markers nor {after.strip()!r}")
    if after.startswith("\n"):
        return f"{text[:at].rstrip()}\n\n{block}\n{text[at:]}"
    line_end = text.find("\n", at)
    if line_end < 0:
        return f"{text}\n\n{block}\n"
    return f"{text[:line_end + 1]}\n{block}\n{text[line_end + 1:]}"


def _s(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f} s"


def latency_figures(hangs: Sequence[Hang], timeout_s: float) -> dict[str, Any]:
    """p50, p95, max of the latencies and of latency - timeout; the misses."""
    found = [h.latency_s for h in hangs if h.latency_s is not None]
    figures: dict[str, Any] = {"hangs": len(hangs), "verdicts": len(found),
                               "misses": len(hangs) - len(found), "timeout_s": timeout_s}
    for name, q in (("p50", 50), ("p95", 95), ("max", 100)):
        value = percentile(found, q)
        figures[f"{name}_s"] = value
        figures[f"{name}_over_timeout_s"] = value - timeout_s
    over = figures["max_over_timeout_s"]
    figures["met"] = not figures["misses"] and bool(found) and over <= TARGET_OVER_S
    return figures


def render(result: dict[str, Any], *, heading: str = "##") -> str:
    """The markdown section of a run's ``result`` (see :func:`measure`)."""
    lat = latency_figures([Hang(**h) for h in result["hangs"]], result["timeout_s"])
    healthy = [Healthy(**h) for h in result["healthy"]]
    load = (f"{min(result['load']):.1f}-{max(result['load']):.1f}" if result["load"]
            else "not read")
    lines = [
        f"{heading} Detection under load (`python -m benchmarks.bench_detection`)",
        "",
        f"Real `python -m eventbus run --standalone --nproc-per-node 2` jobs, gloo on CPU, "
        f"while {result['busy']} busy-looping processes kept the {result['cores']} cores "
        f"busy (1-minute load average {load}, read after each job): {lat['hangs']} hangs "
        f"(tests/reliability/jobs/quiet_job.py, rank 1 before a step's collective: "
        f"{', '.join(HANG_KINDS)} in turn) with "
        f"`--stall-timeout {result['timeout_s']:g} --max-restarts 0`, and "
        f"{len(healthy)} healthy runs with `--stall-timeout auto --stall-auto-floor "
        f"{result['auto_floor_s']:g}` (a floor below the default 60 s can only add "
        f"stalls; each quiet phase lasts {QUIET_X:g} x the floor, past the timeout, so "
        f"silence alone would stall it); {result['seconds'] / 60:.0f} minutes in all. "
        f"Commit {result['commit']}, "
        f"{result['date']}, torch {result['torch']}, Python {result['python']}"
        f"{' (`--quick`: proves it runs, the figures mean little)' if result['quick'] else ''}.",
        "",
        "| hangs | misses | p50 | p95 | max | max - timeout (target <= "
        f"{TARGET_OVER_S:g} s) |",
        "|---|---|---|---|---|---|",
    ]
    cells = [f"{_s(lat[f'{name}_s'])} (+{lat[f'{name}_over_timeout_s']:.2f})"
             if not math.isnan(lat[f"{name}_s"]) else "-" for name in ("p50", "p95", "max")]
    over = lat["max_over_timeout_s"]
    lines.append(f"| {lat['hangs']} | {lat['misses']} | {' | '.join(cells)} | "
                 f"**{'-' if math.isnan(over) else f'{over:.2f} s'}** "
                 f"({'met' if lat['met'] else 'not met'}) |")
    said: dict[str, list[str]] = {}
    for h in (Hang(**h) for h in result["hangs"]):
        said.setdefault(h.kind, []).append(h.waiting_on or "no verdict")
    lines += ["", "| hang | verdicts | `waiting_on` |", "|---|---|---|"]
    for kind, values in said.items():
        tally = ", ".join(f"{v} x{values.count(v)}" for v in sorted(set(values)))
        lines.append(f"| {kind} | {sum(v != 'no verdict' for v in values)}/{len(values)} | "
                     f"{tally} |")
    misses = [h for h in (Hang(**h) for h in result["hangs"]) if h.latency_s is None]
    extra = [h for h in (Hang(**h) for h in result["hangs"]) if h.other_stalls]
    if misses or extra:
        lines.append("")
    for h in misses:
        lines.append(f"- miss, hang {h.index}: {h.note}")
    for h in extra:
        lines.append(f"- hang {h.index}: a stall of another rank too: "
                     f"{json.dumps(h.other_stalls)}")
    lines += [
        "",
        "| kind | runs | false stalls | false stragglers | reported waiting for data | "
        "failures | longest silence (share of its timeout) | median run |",
        "|---|---|---|---|---|---|---|---|",
    ]
    by_kind = {kind.name: kind for kind in KINDS}
    for name in [k.name for k in KINDS]:
        runs = [h for h in healthy if h.kind == name]
        if not runs:
            if name in result["skipped"]:
                lines.append(f"| {by_kind[name].label} | skipped: "
                             f"{result['skipped'][name]} | | | | | | |")
            continue
        failures = [h for h in runs if h.failed]
        failed = f"{len(failures)}" + (
            f" ({', '.join(f'run {h.index}: {_exit(h)}' for h in failures)})"
            if failures else "")
        longest = max(runs, key=lambda h: h.longest_silence_s)
        lines.append(
            f"| {by_kind[name].label} | {len(runs)} | "
            f"{sum(len(h.stalls) for h in runs)} | {sum(len(h.slows) for h in runs)} | "
            f"{sum(len(h.data_waits) for h in runs)} | {failed} | "
            f"{longest.longest_silence_s:.1f} s ({longest.timeout_share:.0%}) | "
            f"{statistics.median(h.seconds for h in runs):.0f} s |")
    seen = [h for h in healthy if h.stalls or h.slows]
    if seen:
        lines.append("")
    for run in seen:
        for event in run.stalls + run.slows:
            lines.append(f"- {run.kind} run {run.index}: {event['type']} {json.dumps(event)}")
    lines += ["", "Longest silence: the stall watch replayed on each run's worker events "
              "(their own timestamps); the longest a rank was silent before its progress "
              "came back, and the largest share of the timeout that applied then."]
    return "\n".join(lines) + "\n"


def _exit(h: Healthy) -> str:
    if h.exit_code is None:
        return "killed at its time limit"
    return f"exit code {h.exit_code}" + (f", {h.agent_exit}" if h.agent_exit else "")


# -- load, jobs, the sweep -------------------------------------------------------------


class Load:
    """``count`` busy-looping child processes, from ``start`` to ``stop`` (idempotent)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        for _ in range(self.count):
            # own session: Ctrl-C reaches this script alone, which then stops them
            self.procs.append(subprocess.Popen([sys.executable, "-c", _BUSY],
                                               start_new_session=True))

    def stop(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
        self.procs = []

    def __enter__(self) -> Load:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _marked(token: str) -> list[int]:
    """The pids of the processes whose environment carries ``MARK_VAR=token``."""
    needle = f"{MARK_VAR}={token}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue  # gone, or not ours to read
        if needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def sweep(token: str) -> int:
    """Kill every process of the job ``token`` still alive (the agent, the workers, who
    torch made session leaders of their own); how many there were."""
    pids = _marked(token)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return len(pids)


def _env(token: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep)
    env["OMP_NUM_THREADS"] = "1"
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "EVENTBUS_PROGRESS",
                 "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"):
        env.pop(name, None)
    env[MARK_VAR] = token
    env.update(extra)
    return env


@dataclass
class JobRun:
    exit_code: int | None
    seconds: float
    leftovers: int
    stderr_tail: str
    events: list[dict[str, Any]]


def run_job(folder: Path, script: str, options: list[str], limit_s: float,
            **env: str) -> JobRun:
    """One ``eventbus run`` job of 2 ranks of tests/jobs/``script`` in ``folder``: its exit
    code (None when killed at ``limit_s``), wall time, the processes left to sweep, the
    end of its stderr and its events."""
    token = uuid.uuid4().hex
    events = folder / "events.jsonl"
    cmd = [sys.executable, "-m", "eventbus", "run", "--events-jsonl", str(events),
           *options, "--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.1",
           "--max-restarts", "0", str(TESTS / script)]
    log = folder / "job.log"
    started = time.monotonic()
    with log.open("wb") as sink:
        proc = subprocess.Popen(cmd, cwd=folder, env=_env(token, **env), stdout=sink,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            exit_code: int | None = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            exit_code = None
        finally:  # a timeout, Ctrl-C: nothing of the job stays
            leftovers = sweep(token)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    seconds = time.monotonic() - started
    lines = [line for line in log.read_text(errors="replace").splitlines()
             if not line.startswith(("frame #", "<omitting"))]  # c10d's C++ stacks
    found = list(read_jsonl(events)) if events.exists() else []
    return JobRun(exit_code, seconds, leftovers, "\n".join(lines[-15:]), found)


def _worker_event(event: dict[str, Any]) -> dict[str, Any]:
    """An event's fields worth a table note (the stacks left out)."""
    data = {k: v for k, v in (event.get("data") or {}).items()
            if k not in ("stack", "peer_stacks", "pgs", "pending")}
    keep: dict[str, Any] = {k: event.get(k) for k in ("type", "timestamp", "worker_id", "silent_s",
                                      "timeout_s", "factor", "step_time_s",
                                      "median_step_time_s", "step") if k in event}
    return {**keep, "data": data}


def hang_job(index: int, timeout_s: float) -> Hang:
    kind = HANG_KINDS[(index - 1) % len(HANG_KINDS)]
    with tempfile.TemporaryDirectory(prefix="bench-detection-") as tmp:
        folder = Path(tmp)
        job = run_job(folder, QUIET, ["--stall-timeout", f"{timeout_s:g}"],
                      HANG_JOB_LIMIT_S, QUIET_MODE=kind, QUIET_STEP="10",
                      QUIET_STEPS="100000", QUIET_OUT=tmp)
        hang = Hang(index=index, seconds=job.seconds, exit_code=job.exit_code, kind=kind)
        stalls = [e for e in job.events if e["type"] == "WORKER_STALLED"]
        mine = [e for e in stalls if e.get("worker_id") == 1]
        hang.other_stalls = [_worker_event(e) for e in stalls if e.get("worker_id") != 1]
        bad = folder / "attempt0_rank1.bad"
        if not bad.exists():
            hang.note = (f"rank 1 never hung (exit code {job.exit_code}): "
                         f"{job.stderr_tail[-600:]!r}")
        elif not mine:
            hang.note = (("killed at the job's limit" if job.exit_code is None
                          else f"exit code {job.exit_code}") + ", no WORKER_STALLED of rank 1"
                         + (f" (of rank(s) {[e.get('worker_id') for e in stalls]})"
                            if stalls else ""))
        else:
            hang.latency_s = float(mine[0]["timestamp"]) - float(bad.read_text())
            hang.waiting_on = (mine[0].get("data") or {}).get("waiting_on")
        if job.leftovers and job.exit_code is not None:
            hang.note += f"{'; ' if hang.note else ''}{job.leftovers} process(es) left behind"
    return hang


def healthy_job(kind: Kind, index: int, floor_s: float, *, quick: bool) -> Healthy:
    with tempfile.TemporaryDirectory(prefix="bench-detection-") as tmp:
        folder = Path(tmp)
        out = folder / "out"
        out.mkdir()
        quiet = f"{QUIET_X * floor_s:g}"
        env = {**{k: v.replace("{quiet}", quiet)
                  for k, v in (kind.quick_env if quick else kind.env).items()},
               "OUT": str(out), "QUIET_OUT": str(out),
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_HOME": str(folder / "hf_home")}
        job = run_job(folder, kind.script,
                      ["--stall-timeout", "auto", "--stall-auto-floor", f"{floor_s:g}"],
                      HEALTHY_JOB_LIMIT_S, **env)
        run = Healthy(kind=kind.name, index=index, seconds=job.seconds,
                      exit_code=job.exit_code)
        stalled = [_worker_event(e) for e in job.events if e["type"] == "WORKER_STALLED"]
        run.stalls = [e for e in stalled if e["data"].get("waiting_on") != "data"]
        run.data_waits = [e for e in stalled if e["data"].get("waiting_on") == "data"]
        run.slows = [_worker_event(e) for e in job.events if e["type"] == "WORKER_SLOW"]
        exits = [e for e in job.events if e["type"] == "AGENT_EXIT"]
        if exits:
            run.agent_exit = f"{exits[-1].get('state')} ({exits[-1].get('exit_code')})"
        run.longest_silence_s, run.timeout_share = closest_call(folder / "events.jsonl",
                                                                floor_s)
        if job.exit_code != 0:
            run.note = job.stderr_tail[-600:]
        if job.leftovers and job.exit_code is not None:
            run.note += f"{'; ' if run.note else ''}{job.leftovers} process(es) left behind"
    return run


def closest_call(events_path: Path, floor_s: float) -> tuple[float, float]:
    """Replay a run's worker events through ``StallWatch("auto")`` on their timestamps:
    the longest silence of a rank before an event of it arrived, and the largest share
    of the timeout that applied then (1.0 or more: the watch would have called it)."""
    if not events_path.exists():
        return 0.0, 0.0
    now = 0.0

    def clock() -> float:
        return now

    watch = StallWatch("auto", auto_floor_s=floor_s, clock=clock)
    events = sorted((e for e in read_jsonl(events_path, decode="event")
                     if e.context is not None and e.context.rank is not None),
                    key=lambda e: e.timestamp)
    longest = share = 0.0
    for event in events:
        now = event.timestamp
        attempt, rank = event.context.restart_count or 0, event.context.rank
        assert rank is not None
        silent = watch.silent_s(attempt, rank)
        if silent is not None and rank not in watch.ended(attempt):
            longest = max(longest, silent)
            share = max(share, silent / watch.timeout_for(attempt, rank))
        watch.observe(event)
    return longest, share


# -- the measurement -------------------------------------------------------------------


def available_kinds(only: Sequence[str] = ()) -> tuple[list[Kind], dict[str, str]]:
    """The kinds (of ``only``, or all) whose trainer imports here, and why each other one
    is skipped."""
    found, skipped = [], {}
    for kind in KINDS:
        if only and kind.name not in only:
            continue
        if not kind.needs:
            found.append(kind)
            continue
        code = "; ".join(f"import {name.strip()}" for name in kind.needs.split(","))
        try:
            done = subprocess.run([sys.executable, "-c", code], capture_output=True,
                                  text=True, timeout=180, check=False)
        except subprocess.TimeoutExpired:
            skipped[kind.name] = f"`{code}` took over 180 s"
            continue
        if done.returncode == 0:
            found.append(kind)
        else:
            last = (done.stderr.strip().splitlines() or ["?"])[-1]
            skipped[kind.name] = f"`{code}` failed: {last}"
    return found, skipped


def _git(*args: str) -> str:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def _progress(text: str) -> None:
    print(f"bench_detection: {text}", file=sys.stderr, flush=True)


def measure(*, hangs: int, healthy: int, quick: bool, floor_s: float,
            timeout_s: float = HANG_TIMEOUT_S, only: Sequence[str] = ()) -> dict[str, Any]:
    """Run the jobs under load; the raw figures (what :func:`render` tabulates).
    ``only``: the names of the healthy kinds to run (all when empty)."""
    kinds, skipped = available_kinds(only)
    for name, why in skipped.items():
        _progress(f"{name} runs skipped: {why}")
    if quick:
        healthy = len(kinds)
    commit = _git("rev-parse", "--short", "HEAD") or "unknown"
    if _git("status", "--porcelain", "--untracked-files=no"):
        commit += " (with uncommitted changes)"
    import torch  # only for its version, once the jobs' own imports are not measured

    started = time.monotonic()
    cores = os.cpu_count() or 1
    result: dict[str, Any] = {
        "quick": quick, "commit": commit, "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cores": cores, "busy": cores, "timeout_s": timeout_s, "auto_floor_s": floor_s,
        "skipped": skipped, "hangs": [], "healthy": [],
    }
    with Load(cores):
        result["load"] = []  # the 1-minute load average after each job
        time.sleep(2)  # let the load settle in
        for i in range(1, hangs + 1):
            hang = hang_job(i, timeout_s)
            result["hangs"].append(asdict(hang))
            result["load"].append(os.getloadavg()[0])
            _progress(f"hang {i}/{hangs}: " + (
                f"verdict {hang.latency_s:.2f} s after the hang (timeout "
                f"+ {hang.latency_s - timeout_s:.2f} s)" if hang.latency_s is not None
                else f"MISS: {hang.note}") + f", exit code {hang.exit_code}, "
                f"{hang.seconds:.1f} s")
        for i in range(1, healthy + 1):
            kind = kinds[(i - 1) % len(kinds)]
            run = healthy_job(kind, i, floor_s, quick=quick)
            result["healthy"].append(asdict(run))
            result["load"].append(os.getloadavg()[0])
            _progress(f"healthy {i}/{healthy} {kind.name}: exit code {run.exit_code}"
                      f"{f' {run.agent_exit}' if run.agent_exit else ''}, "
                      f"{len(run.stalls)} stall(s), {len(run.slows)} slow, longest silence "
                      f"{run.longest_silence_s:.1f} s ({run.timeout_share:.0%} of its "
                      f"timeout), {run.seconds:.1f} s")
            for event in run.stalls + run.slows:
                _progress(f"  {event['type']}: {json.dumps(event)}")
            if run.failed:
                _progress(f"  {run.note}")
    result["seconds"] = time.monotonic() - started
    result["latency"] = latency_figures([Hang(**h) for h in result["hangs"]], timeout_s)
    return result


def write(section_results: str, section_doc: str) -> None:
    """The section into benchmarks/RESULTS.md (after the hand-run marker) and docs/run.md
    (at the end of "Job health"), in place of the previous one."""
    for path, section, after in ((RESULTS, section_results, HAND_RUN_MARKER),
                                 (DOC, section_doc, DOC_ANCHOR)):
        text = path.read_text(encoding="utf-8")
        path.write_text(replace_section(text, section, after=after), encoding="utf-8")
        _progress(f"wrote {path.relative_to(ROOT)}")


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds: the job in flight and the load are stopped


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_detection",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hangs", type=int, default=20, help="hang jobs (default 20)")
    parser.add_argument("--healthy", type=int, default=None,
                        help="healthy runs, the kinds in turn (default 5 of each kind)")
    parser.add_argument("--kinds", default="", metavar="NAME,...",
                        help="the healthy kinds to run (default all: "
                             f"{', '.join(k.name for k in KINDS)})")
    parser.add_argument("--auto-floor", type=float, default=DEFAULT_AUTO_FLOOR_S,
                        metavar="SECONDS", help="the healthy runs' --stall-auto-floor "
                        f"(default {DEFAULT_AUTO_FLOOR_S:g})")
    parser.add_argument("--quick", action="store_true",
                        help="2 hangs and one shorter healthy run of each kind")
    parser.add_argument("--json", action="store_true",
                        help="print the raw figures (JSON) instead of the markdown")
    parser.add_argument("--write", action="store_true",
                        help="write the section into benchmarks/RESULTS.md and docs/run.md")
    args = parser.parse_args(argv)
    if args.quick and args.write:
        parser.error("--write takes a full run's figures; --quick only proves it runs")
    names = [n.strip() for n in args.kinds.split(",") if n.strip()]
    unknown = sorted(set(names) - {k.name for k in KINDS})
    if unknown:
        parser.error(f"--kinds: unknown {', '.join(unknown)}; the kinds are "
                     f"{', '.join(k.name for k in KINDS)}")
    healthy = args.healthy if args.healthy is not None else 5 * (len(names) or len(KINDS))
    if args.hangs < 0 or healthy < 0 or not args.auto_floor > 0:
        parser.error("--hangs and --healthy are counts >= 0, --auto-floor seconds > 0")
    try:
        with _sigterm_unwinds():
            result = measure(hangs=2 if args.quick else args.hangs, healthy=healthy,
                             quick=args.quick, floor_s=args.auto_floor, only=names)
    except KeyboardInterrupt:
        _progress("interrupted: the job in flight and the busy processes were stopped")
        return 130
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(render(result))
    if args.write:
        write(render(result, heading="##"), render(result, heading="###"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
