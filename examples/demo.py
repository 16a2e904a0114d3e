"""``make demo``: a real elastic training job on CPU, a crash, a restart, and the pictures.

Runs ``examples/train.py`` (2 workers, DDP over gloo, a small MLP on synthetic data)
under ``python -m eventbus run`` with:

* ``--events-jsonl OUT/events.jsonl``: every event of the job, one JSON line each;
* ``--reactor examples.reactor:restart_on_crash``: rank 1 crashes on attempt 0, the
  reactor restarts the group, attempt 1 resumes from the last checkpoint and finishes;
* ``--log-events``: the agent prints each event on the console as it happens;
* ``--sink tensorboard:OUT/tb``: every rank's loss curve, the restart and the failure in
  TensorBoard (``tensorboard --logdir OUT/tb``; docs/sinks.md).

Then writes ``OUT/trace.json`` (open it at https://ui.perfetto.dev) and
``OUT/timeline.png``, and says where they are. ``OUT`` is ``./demo-out`` unless
``--out`` says otherwise; the previous run's files there are replaced.

Exit code 0 when the job succeeded after its restart and every file was written.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python examples/demo.py` from anywhere
    sys.path.insert(0, str(ROOT))

from eventbus.app.readers.jobview import JobView  # noqa: E402
from eventbus.app.readers.trace import chrome_trace  # noqa: E402
from eventbus.app.readers.trace import write_trace  # noqa: E402

#: the job's own budget; the demo normally takes 15-30 s on 2 cores
JOB_TIMEOUT_S = 150.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("demo-out"),
                        help="folder for events.jsonl, trace.json, timeline.png "
                             "(default: ./demo-out)")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--no-plot", action="store_true",
                        help="skip timeline.png (no matplotlib needed)")
    return parser.parse_args(argv)


def _arg(path: Path) -> str:
    """``path`` as the job (run in the repository root) can take it: relative when under
    the root, so the console and the events show short paths."""
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


def job_command(out: Path, epochs: int) -> list[str]:
    return [
        sys.executable, "-m", "eventbus", "run",
        "--events-jsonl", _arg(out / "events.jsonl"),
        "--reactor", "examples.reactor:restart_on_crash",
        "--log-events",
        "--sink", f"tensorboard:{_arg(out / 'tb')}",
        # torchrun's own options, unchanged
        "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
        "--monitor-interval", "0.1",
        _arg(ROOT / "examples" / "train.py"),
        "--epochs", str(epochs), "--checkpoint-dir", _arg(out / "checkpoints"),
    ]


def job_env() -> dict[str, str]:
    env = dict(os.environ)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + path if path else "")
    env.setdefault("OMP_NUM_THREADS", "1")  # 2 workers on a small machine; also hushes torchrun
    return env


def run_job(out: Path, epochs: int) -> int:
    """The job, its output streaming to this console; returns its exit code."""
    cmd = job_command(out, epochs)
    print("demo: $ python " + " ".join(cmd[1:]), flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=job_env(), start_new_session=True)
    try:
        return proc.wait(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        print(f"demo: the job did not finish within {JOB_TIMEOUT_S:.0f} s; stopping it",
              file=sys.stderr)
        os.killpg(proc.pid, 9)
        proc.wait(timeout=30)
        return 1
    except KeyboardInterrupt:
        os.killpg(proc.pid, 2)
        proc.wait(timeout=30)
        raise


def summarise(view: JobView) -> list[str]:
    """What happened, from the events: one line per failure and restart, then the outcome."""
    lines = []
    for run in view.runs:
        if run.failed and not run.stopped_by_agent:
            why = f": {run.message}" if run.message else ""
            lines.append(f"rank {run.rank} failed on attempt {run.attempt} "
                         f"(exit {run.exit_code}){why}")
    for attempt in view.attempts:
        if attempt.restart is not None:
            # the reason is "<the failure>; RESTART from <reactor>": the failure is above
            reason = str(attempt.restart.fields.get("reason") or "").rpartition("; ")[2]
            lines.append(f"the agent restarted the workers: attempt {attempt.index}"
                         + (f" ({reason})" if reason else ""))
    epochs = sorted({e.epoch for e in view.epochs if e.finished})
    lines.append(f"job {view.outcome()} after {view.attempt_count()} attempt(s); "
                 f"epochs completed: {', '.join(map(str, epochs)) or 'none'}")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("events.jsonl", "trace.json", "timeline.png"):
        (out / stale).unlink(missing_ok=True)  # the recorder appends: start clean
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    shutil.rmtree(out / "tb", ignore_errors=True)

    began = time.monotonic()
    code = run_job(out, args.epochs)
    events = out / "events.jsonl"
    if not events.is_file():
        print(f"demo: the job wrote no {events} (exit code {code})", file=sys.stderr)
        return 1
    view = JobView.from_files([events])
    trace_path = out / "trace.json"
    write_trace(chrome_trace(view, sources=[str(events)]), trace_path)
    written = [(events, f"{len(view.records)} events  (eventbus tail {_show(events)})"),
               (trace_path, "open https://ui.perfetto.dev and drop the file on it")]
    if (out / "tb").is_dir():
        written.append((out / "tb", f"TensorBoard: tensorboard --logdir {_show(out / 'tb')}"))
    if not args.no_plot:
        from eventbus.app.readers.timeline import PlotUnavailableError
        from eventbus.app.readers.timeline import plot_timeline

        try:
            plot_timeline(view, out / "timeline.png")
            written.append((out / "timeline.png", "the timeline picture"))
        except PlotUnavailableError as exc:
            print(f"demo: no timeline.png: {exc}", file=sys.stderr)

    print(f"\ndemo: finished in {time.monotonic() - began:.0f} s; eventbus run exited "
          f"with {code}")
    for line in summarise(view):
        print(f"demo: {line}")
    print(f"demo: the files are in {_show(out)}/")
    width = max(len(p.name) for p, _ in written)
    for path, what in written:
        print(f"  {path.name:<{width}}  {what}")
    from eventbus.app.readers.goodput import goodput

    figure = goodput(view.records)  # eventbus goodput demo-out/events.jsonl: the table
    print(f"demo: {figure.sentence()}  (eventbus goodput {_show(events)})")
    ok = code == 0 and view.outcome() == "SUCCEEDED" and view.attempt_count() >= 2
    if not ok:
        print("demo: expected a crash on attempt 0 and a successful restart; "
              "see the output above", file=sys.stderr)
    return 0 if ok else 1


def _show(path: Path) -> str:
    """``path`` relative to the working directory when it is under it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


if __name__ == "__main__":
    sys.exit(main())
