"""Soak: run the reliability tests N times under CPU load, and tabulate every outcome.

``make soak`` (``N=10``, ``SOAK_K=EXPR`` for a selection) runs::

    python tests/soak.py -n N [-k EXPR] [--doc docs/guarantees.md] [pytest args...]

What runs: every test under ``tests/reliability`` (the fault matrix of RELIABILITY.md, slow
and fast), or the paths and options given after the soak's own (``--slow`` keeps only the
tests marked slow, the whole suite's included when no path is given:
``python tests/soak.py --slow tests``).

* Load: one busy process per core (``--load``, default ``os.cpu_count()``), started before
  the first round and stopped after the last; they also end by themselves when this process
  dies (each polls its parent), so an interrupted soak leaves none behind.
* Rounds: pytest once per round, each with its own ``--junitxml`` file, and with
  faulthandler's traceback dump after ``--hang-dump`` seconds in a test (pytest's
  ``faulthandler_timeout``): a hang leaves its stacks in the round's output file. Every
  test keeps its own timeout (pytest-timeout's, 300 s unless the test says otherwise).
* Leftovers: each round's pytest runs with a variable of its own in its environment
  (``EVENTBUS_SOAK_ROUND``), which every process a test starts inherits, whatever session
  it moves to. When the round has ended, and after up to :data:`LEFTOVER_GRACE_S` for
  processes on their way out, any process still carrying it was left behind by a test:
  the round fails for it (the table names each process), and the soak kills it.
* The table: per test, runs, passed, failed, skipped, the slowest run, and the first line
  of each distinct failure. Exit status 1 when any run failed (or a round failed without
  a test to blame: a collection error, a crash), else 0.
* ``--doc FILE`` writes the table, its date, N and the selection between the markers
  ``<!-- soak:begin -->`` and ``<!-- soak:end -->`` of FILE.
* Stopped early (SIGTERM, Ctrl-C): the round in flight is killed with everything it
  started and counts for nothing; the table of the rounds done is printed (and written)
  as usual, its N the rounds done, "of N planned: stopped early". Exit status 1 when a run
  failed, else the signal's (128 + its number).

Outputs of each round (stdout, junit XML) stay in ``--out`` (default a temporary folder,
named on the last line).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import uuid
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from types import FrameType
from typing import IO

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- soak:begin -->", "<!-- soak:end -->"
#: what a soak runs when given no path: the fault matrix (RELIABILITY.md)
DEFAULT_PATHS = ("tests/reliability",)
#: the variable that marks a round's processes (see the module docstring)
ROUND_VAR = "EVENTBUS_SOAK_ROUND"
#: how long a round's processes may take to exit after its pytest did
LEFTOVER_GRACE_S = 5.0

# A busy loop that ends when its parent (this script) is gone, whatever killed it.
_BUSY = ("import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n"
         "    for _ in range(200000):\n        pass\n")


@dataclass
class Outcome:
    """One test's runs."""

    runs: int = 0
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    slowest: float = 0.0
    #: first line of each distinct failure -> how many runs failed so
    failures: dict[str, int] = field(default_factory=dict)


def start_load(n: int) -> list[subprocess.Popen[bytes]]:
    """``n`` busy processes, each in a session of its own (stopped by stop_load)."""
    return [subprocess.Popen([sys.executable, "-c", _BUSY], start_new_session=True,
                             stdin=subprocess.DEVNULL) for _ in range(n)]


def stop_load(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)


def first_line(text: str | None) -> str:
    for line in (text or "").splitlines():
        if line.strip():
            return line.strip()[:160]
    return "(no message)"


def read_junit(path: Path, table: dict[str, Outcome]) -> int:
    """Add one round's results to ``table``; returns the test cases found."""
    cases = 0
    for case in ET.parse(path).getroot().iter("testcase"):
        cases += 1
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        out = table.setdefault(name, Outcome())
        out.runs += 1
        out.slowest = max(out.slowest, float(case.get("time") or 0.0))
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        if bad is not None:
            out.failed += 1
            key = first_line(bad.get("message") or bad.text)
            out.failures[key] = out.failures.get(key, 0) + 1
        elif case.find("skipped") is not None:
            out.skipped += 1
        else:
            out.passed += 1
    return cases


def render(table: dict[str, Outcome], round_errors: list[str]) -> str:
    rows = ["| test | runs | passed | failed | skipped | slowest (s) "
            "| failures (first line, runs) |", "|---|---|---|---|---|---|---|"]
    for name, out in sorted(table.items()):
        fails = "; ".join(f"`{line}` ({n})" for line, n in sorted(out.failures.items()))
        rows.append(f"| {name} | {out.runs} | {out.passed} | {out.failed} | {out.skipped} "
                    f"| {out.slowest:.1f} | {fails or '-'} |")
    for err in round_errors:
        rows.append(f"| (round) | - | - | 1 | - | - | `{err}` |")
    return "\n".join(rows)


def write_doc(doc: Path, text: str) -> None:
    content = doc.read_text(encoding="utf-8")
    if BEGIN not in content or END not in content:
        raise SystemExit(f"soak: {doc} has no {BEGIN} ... {END} section to write the table "
                         "into; add the two markers where it belongs")
    head, rest = content.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}", encoding="utf-8")


def marked(mark: str) -> dict[int, str]:
    """The live processes whose environment holds ``ROUND_VAR=mark``: pid -> command line
    (Linux's /proc; empty elsewhere). Zombies are gone already and not listed."""
    needle = f"{ROUND_VAR}={mark}".encode()
    found: dict[int, str] = {}
    try:
        pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return found
    for pid in pids:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[-1].split()[0] == b"Z":
                    continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
        except (OSError, IndexError):
            continue  # gone meanwhile, or not ours to read
        found[pid] = cmdline[:200]
    return found


def sweep(mark: str, grace: float = LEFTOVER_GRACE_S) -> dict[int, str]:
    """The processes of a round (``mark``) still alive ``grace`` seconds after it ended,
    each SIGKILLed: pid -> command line."""
    deadline = time.monotonic() + grace
    left = marked(mark)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = marked(mark)
    for pid in left:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return left


def run_round(cmd: list[str], sink: IO[bytes], timeout: float,
              mark: str | None = None) -> int | None:
    """Run one round's pytest in its own process group, with ``ROUND_VAR=mark`` in its
    environment; its exit status, or None when it ran past ``timeout`` (the whole group,
    jobs and workers included, is killed then)."""
    env = dict(os.environ)
    if mark is not None:
        env[ROUND_VAR] = mark
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT,
                            start_new_session=True, env=env)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # what it left behind, or all of it
        proc.wait()


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # the finally below stops the load


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("-n", type=int, default=10, help="rounds (default 10)")
    parser.add_argument("-k", default="", help="pytest -k selection")
    parser.add_argument("--slow", action="store_true",
                        help="only the tests marked slow (of the paths given, else of the "
                             "whole suite)")
    parser.add_argument("--load", type=int, default=os.cpu_count() or 1,
                        help="busy processes (default: one per core; 0: none)")
    parser.add_argument("--hang-dump", type=float, default=120.0,
                        help="dump every thread's stack after this many seconds in one test")
    parser.add_argument("--round-timeout", type=float, default=3600.0,
                        help="seconds one round may run before it is killed and counted as a "
                             "round error (default 3600)")
    parser.add_argument("--out", default="", help="folder for each round's output")
    parser.add_argument("--doc", default="", help="write the table into this Markdown file")
    args, extra = parser.parse_known_args(argv)
    if args.n < 1:
        parser.error(f"-n must be at least 1 (got {args.n})")
    if args.round_timeout <= 0:
        parser.error(f"--round-timeout must be more than 0 (got {args.round_timeout:g})")
    if args.load < 0:
        parser.error(f"--load must be 0 or more (got {args.load})")
    out_dir = Path(args.out or tempfile.mkdtemp(prefix="eventbus-soak-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _terminate)
    table: dict[str, Outcome] = {}
    round_errors: list[str] = []
    started = datetime.datetime.now(datetime.timezone.utc)
    t0 = time.monotonic()
    load = start_load(args.load)
    rounds = 0
    #: the exit status of the signal that stopped the soak early, if one did
    interrupted = 0
    paths = [a for a in extra if not a.startswith("-")]
    if not paths and not args.slow:
        extra = [*extra, *DEFAULT_PATHS]
    marker = ["-m", "slow"] if args.slow else ["-m", "slow or not slow"]
    try:
        for i in range(1, args.n + 1):
            xml = out_dir / f"round-{i}.xml"
            cmd = [sys.executable, "-m", "pytest", *marker, "-q", "-p", "no:cacheprovider",
                   f"--junitxml={xml}", "-o", f"faulthandler_timeout={args.hang_dump:g}",
                   *(["-k", args.k] if args.k else []), *extra]
            log = out_dir / f"round-{i}.out"
            r0 = time.monotonic()
            mark = uuid.uuid4().hex
            with open(log, "wb") as sink:
                rc = run_round(cmd, sink, args.round_timeout, mark)
            left = sweep(mark)
            if left:
                round_errors.append(
                    f"round {i}: {len(left)} process(es) left behind, killed: " + "; ".join(
                        f"{pid} {cmdline[:100]}" for pid, cmdline in sorted(left.items())))
            rounds = i
            cases = read_junit(xml, table) if xml.exists() else 0
            failed_now = sum(o.failed for o in table.values())
            print(f"soak: round {i}/{args.n}: pytest exit {rc}, {cases} tests, "
                  f"{time.monotonic() - r0:.0f} s, failures so far {failed_now}", flush=True)
            if rc is None:
                round_errors.append(f"round {i}: killed after {args.round_timeout:g} s "
                                    f"(see {log})")
                rc = -1
            elif rc not in (0, 1) or (rc == 1 and cases == 0):
                # 1 with failing tests is theirs; anything else is the round's own failure
                round_errors.append(f"round {i}: pytest exit {rc} (see {log})")
            if rc == 5:
                print(f"soak: no test selected by {shlex.join([*marker, *extra])} -k "
                      f"{args.k!r}", file=sys.stderr)
                break
    except (SystemExit, KeyboardInterrupt) as exc:
        # Stopped early (SIGTERM, Ctrl-C): the round in flight was killed with its group
        # (run_round's finally) and counts for nothing; the rounds done make the table.
        interrupted = exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, int) \
            else 128 + signal.SIGINT
        print(f"soak: stopped during round {rounds + 1}; the table has the {rounds} rounds "
              "done", flush=True)
    finally:
        stop_load(load)
    failed = sum(o.failed for o in table.values()) + len(round_errors)
    table_text = render(table, round_errors)
    selection = shlex.join([*marker, *(["-k", args.k] if args.k else []), *extra])
    planned = f" (of {args.n} planned: stopped early)" if interrupted else ""
    summary = (f"Soak of {started:%Y-%m-%d %H:%M} UTC: N = {rounds} rounds{planned} of "
               f"`pytest {selection}`, under {args.load} busy processes "
               f"({os.cpu_count()} cores), {time.monotonic() - t0:.0f} s in all; "
               f"{sum(o.runs for o in table.values())} test runs, {failed} failed.")
    print()
    print(summary)
    print(table_text)
    print(f"soak: each round's output and junit XML in {out_dir}")
    if args.doc:
        write_doc(Path(args.doc), f"{summary}\n\n{table_text}")
    return 1 if failed else interrupted


if __name__ == "__main__":
    sys.exit(main())
