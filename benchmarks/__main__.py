"""``python -m benchmarks``: run every benchmark in one process, write ``RESULTS.md``.

    python -m benchmarks                  # full run (a few minutes), writes benchmarks/RESULTS.md
    python -m benchmarks --quick          # smoke run: tiny repeats, prints the report only
    python -m benchmarks --only dispatch  # some areas: dispatch, import, logging, store,
                                          # memory, sinks, ui, preemption, scale, health,
                                          # recovery
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import sys
import time
from pathlib import Path
from typing import Any

import eventbus  # noqa: F401  (its version goes into the report)
from benchmarks._timing import machine
from benchmarks._timing import versions
from benchmarks.report import render

AREAS = ("dispatch", "import", "logging", "store", "memory", "sinks", "ui", "preemption",
         "scale", "health", "recovery")
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
#: what follows this line in RESULTS.md was measured by hand (or printed by tests) and is
#: kept as it is when the report is written again
HAND_RUN_MARKER = "<!-- hand-run figures below: `make bench` keeps this part as it is -->"


def _with_hand_run_part(report: str, output: Path) -> str:
    """``report`` followed by the hand-run part of the file it replaces, if any."""
    try:
        old = output.read_text(encoding="utf-8")
    except OSError:
        return report
    _, marker, kept = old.partition(HAND_RUN_MARKER)
    return f"{report.rstrip()}\n\n{marker}{kept}" if marker else report


def _run_area(area: str, *, quick: bool) -> dict[str, Any]:
    module = importlib.import_module(f"benchmarks.bench_{area}")
    result: dict[str, Any] = module.run(quick=quick)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="tiny repeat counts and sizes: proves the benchmarks run, "
                             "figures mean nothing")
    parser.add_argument("--only", default=",".join(AREAS),
                        help=f"comma-separated areas to run (default: all of {','.join(AREAS)})")
    parser.add_argument("--output", type=Path, default=None,
                        help=f"where to write the report (default: {RESULTS.name} next to this "
                             "file; with --quick, nowhere)")
    args = parser.parse_args(argv)
    areas = [a.strip() for a in args.only.split(",") if a.strip()]
    unknown = sorted(set(areas) - set(AREAS))
    if unknown:
        parser.error(f"unknown area(s) {unknown}; pick from {', '.join(AREAS)}")

    results: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    for area in areas:
        print(f"benchmarks: {area} ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        results[area] = _run_area(area, quick=args.quick)
        seconds[area] = time.perf_counter() - start
    report = render(
        results,
        machine=machine(),
        versions=versions("eventbus", "torch", "blinker", "psygnal", "pyee", "attrs"),
        when=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        quick=args.quick,
        seconds=seconds,
    )
    output = args.output if args.output is not None else (None if args.quick else RESULTS)
    if output is not None:
        output.write_text(_with_hand_run_part(report, output), encoding="utf-8")
        print(f"benchmarks: wrote {output}", file=sys.stderr)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
