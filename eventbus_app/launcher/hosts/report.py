"""``eventbus hosts``: the host ledger read for people and for schedulers.

``eventbus hosts [--ledger PATH|URL] [--from FILES...] [--since 7d]
[--format table|json|slurm|k8s] [--threshold X]``. Per host: its score, its faults by
kind, the jobs they hurt, its clean finishes, when it was last seen. ``slurm`` and ``k8s``
print only what a scheduler needs to keep away the hosts over the threshold: one
``--exclude=`` argument in hostlist notation, or the ``kubectl`` commands that cordon and
taint them; nothing when no host is over it, so their output can go straight into a
command line or a shell. ``--from`` first writes the rows of past runs' events files into
the ledger (:mod:`eventbus.app.launcher.hosts.history`). docs/hosts.md has examples of each.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from collections.abc import Sequence

from eventbus.app.launcher.hosts.history import outcomes_from_files
from eventbus.app.launcher.hosts.host_ledger import LedgerError
from eventbus.app.launcher.hosts.host_ledger import LedgerSpecError
from eventbus.app.launcher.hosts.host_ledger import default_ledger_path
from eventbus.app.launcher.hosts.host_ledger import read_outcomes
from eventbus.app.launcher.hosts.host_ledger import spooled
from eventbus.app.launcher.hosts.host_ledger import write_outcomes
from eventbus.app.launcher.hosts.score import DEFAULT_BAD_HOST_THRESHOLD
from eventbus.app.launcher.hosts.score import HALF_LIFE_S
from eventbus.app.launcher.hosts.score import HostSummary
from eventbus.app.launcher.hosts.score import summarize
from eventbus.app.launcher.hosts.store import parse_spec
from eventbus.app.launcher.slurm.hostlist import compress

__all__ = ["FORMATS", "TAINT", "main", "parse_duration", "render"]

FORMATS = ("table", "json", "slurm", "k8s")
#: the taint ``--format k8s`` puts on a bad host's node
TAINT = "eventbus.dev/bad-host=true:NoSchedule"

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([smhdw]?)\s*$")


def parse_duration(text: str) -> float:
    """``90s``, ``30m``, ``12h``, ``7d``, ``2w`` or plain seconds -> seconds."""
    match = _DURATION.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not a duration: a number and a unit, s, m, h, d or w "
                         "(30m, 12h, 7d)")
    return float(match[1]) * _UNITS[match[2] or "s"]


def _ago(seconds: float) -> str:
    if seconds < 90:
        return f"{max(0, round(seconds))} s ago"
    if seconds < 90 * 60:
        return f"{round(seconds / 60)} min ago"
    if seconds < 36 * 3600:
        return f"{round(seconds / 3600)} h ago"
    return f"{round(seconds / 86400)} d ago"


def _faults(summary: HostSummary) -> str:
    return ", ".join(f"{kind} {count}" for kind, count in summary.faults.items()) or "-"


def _table(summaries: list[HostSummary], now: float, threshold: float, ledger: str) -> str:
    if not summaries:
        return f"no hosts in the ledger {ledger}"
    head = ("HOST", "SCORE", "FAULTS", "JOBS HURT", "CLEAN", "LAST SEEN")
    rows = [head]
    for s in summaries:
        mark = " *" if s.score > threshold else ""
        seen = time.strftime("%Y-%m-%d %H:%M", time.localtime(s.last_seen))
        rows.append((s.host, f"{s.score:.2f}{mark}", _faults(s), f"{s.jobs_hurt} of {s.jobs}",
                     str(s.clean), f"{seen} ({_ago(now - s.last_seen)})"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head) - 1)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  "
             + row[-1] for row in rows]
    bad = sum(1 for s in summaries if s.score > threshold)
    half_life = HALF_LIFE_S / 86400
    lines.append(f"* over the threshold {threshold:g}: {bad} of {len(summaries)} hosts "
                 f"(score: fault weights halved every {half_life:g} days; docs/hosts.md)")
    return "\n".join(lines)


def render(summaries: list[HostSummary], fmt: str, *, now: float,
           threshold: float = DEFAULT_BAD_HOST_THRESHOLD, ledger: str = "") -> str:
    """The report in ``fmt`` (:data:`FORMATS`); empty for slurm and k8s with no bad host."""
    bad = [s.host for s in summaries if s.score > threshold]
    if fmt == "slurm":
        return f"--exclude={compress(bad)}" if bad else ""
    if fmt == "k8s":
        return "\n".join(line for host in sorted(bad) for line in (
            f"kubectl cordon {host}", f"kubectl taint nodes {host} {TAINT} --overwrite"))
    if fmt == "json":
        return json.dumps({"ledger": ledger, "now": now, "threshold": threshold,
                           "half_life_s": HALF_LIFE_S, "over_threshold": bad,
                           "hosts": [s.to_json() for s in summaries]})
    return _table(summaries, now, threshold, ledger)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eventbus hosts",
        description="The host ledger: per host, a score that decays with time, its host "
                    "faults by kind, the jobs they hurt, its clean finishes (docs/hosts.md).")
    parser.add_argument("--ledger", metavar="PATH|URL", default=None,
                        help="a SQLite file or a postgresql:// URL (default: "
                             "$EVENTBUS_HOST_LEDGER, else "
                             "$XDG_STATE_HOME/eventbus/hosts.sqlite, else "
                             "~/.local/state/eventbus/hosts.sqlite)")
    parser.add_argument("--from", dest="files", nargs="+", metavar="FILE", default=[],
                        help="write the rows of these events JSONL files (--events-jsonl) "
                             "into the ledger first")
    parser.add_argument("--since", metavar="DURATION", default=None,
                        help="only the outcomes of the last DURATION: 90s, 30m, 12h, 7d, 2w")
    parser.add_argument("--format", dest="fmt", default="table", choices=FORMATS,
                        help="table (default), json, slurm (--exclude=HOSTLIST), k8s "
                             "(kubectl cordon and taint)")
    parser.add_argument("--threshold", metavar="X", default=None,
                        help="a host is bad over this score (default "
                             f"{DEFAULT_BAD_HOST_THRESHOLD:g}, as eventbus run "
                             "--bad-host-threshold); slurm and k8s list only those")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``eventbus hosts``: 0, 1 when the ledger or a file cannot be read, 2 on bad input."""
    parser = _parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    since_s = None
    if args.since is not None:
        try:
            since_s = parse_duration(args.since)
        except ValueError as exc:
            parser.error(f"argument --since: {exc}")
    threshold = DEFAULT_BAD_HOST_THRESHOLD
    if args.threshold is not None:
        try:
            threshold = float(args.threshold)
        except ValueError:
            threshold = math.nan
        if not math.isfinite(threshold) or threshold < 0:
            parser.error(f"argument --threshold: {args.threshold!r} is not a score: a number "
                         f"0 or more (default {DEFAULT_BAD_HOST_THRESHOLD:g})")
    spec = args.ledger if args.ledger is not None else default_ledger_path()
    try:
        shown = parse_spec(spec).shown
    except LedgerSpecError as exc:
        parser.error(f"argument --ledger: {exc}")
    try:
        if args.files:
            _import(spec, shown, args.files)
        now = time.time()
        since = None if since_s is None else now - since_s
        summaries = summarize(read_outcomes(spec, since=since), now)
        waiting = spooled(spec)
    except LedgerError as exc:
        print(f"eventbus hosts: host ledger {shown}: {exc.text}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"eventbus hosts: {getattr(exc, 'filename', None) or ''}: "
              f"{exc.strerror or exc}", file=sys.stderr)
        return 1
    if waiting:
        print(f"eventbus hosts: {waiting} outcome(s) wait in the spool for this ledger "
              "(shown here; the next agent that reaches the ledger writes them)",
              file=sys.stderr)
    text = render(summaries, args.fmt, now=now, threshold=threshold, ledger=shown)
    if text:
        print(text)
    elif args.fmt in ("slurm", "k8s"):
        print(f"eventbus hosts: no host over the threshold {threshold:g}", file=sys.stderr)
    return 0


def _import(spec: str, shown: str, files: list[str]) -> None:
    outcomes, problems = outcomes_from_files(files)
    if problems:
        skipped = sum(p.count for p in problems)
        print(f"eventbus hosts: {skipped} line(s) of {', '.join(files)} are not events "
              "and were skipped", file=sys.stderr)
    write_outcomes(spec, outcomes)
    hosts = len({o.host for o in outcomes})
    print(f"eventbus hosts: {len(outcomes)} outcome(s) of {hosts} host(s) from "
          f"{len(files)} file(s) written to {shown}", file=sys.stderr)
