"""Events JSONL -> Chrome Trace Event Format JSON, the format ``torch.profiler`` writes and
https://ui.perfetto.dev (or ``chrome://tracing``) opens.

``eventbus trace EVENTS.jsonl [MORE.jsonl ...] -o trace.json``; in code,
:func:`export_trace` (files in, file out) or :func:`chrome_trace` (a
:class:`~eventbus.subscribers._jobview.JobView` in, the trace dict out).

The layout (see docs/seeing-the-job.md for the whole format):

* one *process* per node (``pid`` 1, 2, ... in node order, named ``node 0 (hostname)``),
  with one *thread* per track: ``agent`` (``tid`` 0) and ``rank N`` (``tid`` N + 1);
* spans (``"ph": "X"``): ``attempt N``, ``rendezvous`` and a drain (``drain: SIGTERM on
  node 1, 20 s to stop``, ``"cat": "drain"``: from its ``PREEMPTING`` to the job's
  ``AGENT_EXIT``, its facts as ``args``) on the agent track; on each rank
  track, the worker process of each attempt (``rank 1 attempt 0``, ``"cat": "worker"``)
  with its epochs nested inside (``epoch 2``, ``"cat": "epoch"``; ``epoch 1 (unfinished)``
  when the worker died in it) and its start-up (``starting``, ``"cat": "startup"``: from
  the agent starting it to its first own event);
* instants (``"ph": "i"``): failures, restarts (process-wide), checkpoints, agent start and
  exit, lost events, torchelastic records and user-declared types, their fields as ``args``;
* counters (``"ph": "C"``): the numeric values of ``METRIC`` events, one counter per value
  name and node, one series per rank;
* ``ts``/``dur`` in microseconds since the job's first event, whose wall-clock time is in
  ``otherData.t0_unix_s``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from typing import Literal

from eventbus.app.readers.jobview import AGENT
from eventbus.app.readers.jobview import JobView
from eventbus.app.readers.jobview import expand_inputs
from eventbus.app.readers.jobview import iter_tracks
from eventbus.app.readers.jobview import load_for_command
from eventbus.app.readers.records import Record
from eventbus.app.sentences import sentence
from eventbus.events import Cause

__all__ = ["chrome_trace", "export_trace", "main", "write_trace"]

_US = 1_000_000.0


def _jsonable(value: Any) -> Any:
    """Strict-JSON-safe: non-finite floats as their names (Perfetto shows args as text)."""
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value


def _args(record: Record) -> dict[str, Any]:
    args: dict[str, Any] = {k: v for k, v in record.fields.items() if v is not None}
    if record.data:
        args["data"] = record.data
    ctx = {k: v for k, v in record.context.items() if v is not None}
    if ctx:
        args["context"] = ctx
    return args


_INSTANT_SCOPE: dict[str, Literal["t", "p", "g"]] = {
    "WORKER_RESTART": "p",
    "PREEMPTING": "p",
    "AGENT_START": "p",
    "AGENT_EXIT": "p",
}
_CATEGORY = {
    "WORKER_EXIT": "failure",
    "WORKER_RESTART": "restart",
    "CHECKPOINT_SAVED": "checkpoint",
    "AGENT_START": "agent",
    "AGENT_EXIT": "agent",
    "RENDEZVOUS": "rendezvous",
    "EVENTS_LOST": "lost",
    "TORCHELASTIC": "torchelastic",
    "METRIC": "metric",
    "WORKER_START": "worker",
    "EPOCH_START": "epoch",
    "EPOCH_END": "epoch",
    "WORKER_STALLED": "stall",
    "WORKER_SLOW": "slow",
    "PREEMPTING": "drain",
}

#: Perfetto's colour names (``cname``) of how an attempt ended
_OUTCOME_COLOUR = {"failed": "terrible", "stopped": "terrible", "preempted": "yellow"}


#: the fields of a WORKER_PROGRESS heartbeat drawn as counters (``progress idle_s``, ...)
_PROGRESS_COUNTERS = ("idle_s", "step", "collectives")


def _instant_name(record: Record) -> str:
    f = record.fields
    if record.type == "WORKER_EXIT":
        if record.data.get("drained") is True:
            return f"rank {f.get('worker_id')} {sentence(record, short=True)}"
        if record.stopped_by_agent and f.get("cause") == Cause.PREEMPTION.value:
            how = f.get("signal") or f"exit {f.get('exit_code')}"
            return f"rank {f.get('worker_id')} did not stop in time ({how})"
        if record.stopped_by_agent:
            how = f.get("signal") or f"exit {f.get('exit_code')}"
            return f"rank {f.get('worker_id')} stopped by the agent ({how})"
        if record.is_failure:
            return f"rank {f.get('worker_id')} failed (exit {f.get('exit_code')})"
        return f"rank {f.get('worker_id')} exited"
    if record.type == "WORKER_RESTART":
        # not "-> attempt N": a node restarting for a membership change keeps torch's
        # restart count, so the field can repeat; the attempt spans carry the order
        return "restart"
    if record.type == "CHECKPOINT_SAVED":
        return f"checkpoint {f.get('path')}"
    if record.type == "AGENT_EXIT":
        return f"agent exit {f.get('state')}"
    if record.type == "RENDEZVOUS":
        return f"rendezvous {f.get('state')}"
    if record.type == "TORCHELASTIC":
        return f"torchelastic {f.get('name')}"
    if record.type == "EVENTS_LOST":
        return f"{f.get('count')} events lost"
    if record.type == "WORKER_STALLED":  # job health: the stack is in args.data.stack
        return f"rank {f.get('worker_id')} stalled (silent {f.get('silent_s')} s)"
    if record.type == "WORKER_SLOW":
        return f"rank {f.get('worker_id')} slow (x{f.get('factor')} its peers' median)"
    if record.type == "PREEMPTING":
        return sentence(record)
    return record.type


def chrome_trace(view: JobView, *, sources: Sequence[str] = ()) -> dict[str, Any]:
    """The job as a Chrome Trace Event Format object (``{"traceEvents": [...], ...}``)."""
    t0 = view.t0

    def us(t: float) -> float:
        # 0.1 us: finer than the float precision of a wall-clock timestamp in seconds.
        return round((t - t0) * _US, 1)

    pids = {node.label: i + 1 for i, node in enumerate(view.nodes)}

    def tid(track: int | Literal["agent"]) -> int:
        return 0 if track == AGENT else int(track) + 1

    meta: list[dict[str, Any]] = []
    for node in view.nodes:
        pid = pids[node.label]
        name = node.label if not node.hostname or node.hostname == node.label else (
            f"{node.label} ({node.hostname})")
        meta.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                     "args": {"name": name}})
        meta.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                     "args": {"sort_index": pid}})
    for order, (node, track) in enumerate(iter_tracks(view)):
        pid = pids[node.label]
        label = "agent" if track == AGENT else f"rank {track}"
        meta.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid(track),
                     "args": {"name": label}})
        meta.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid(track),
                     "args": {"sort_index": order}})

    events: list[dict[str, Any]] = []

    def span(name: str, cat: str, node: str, track: int | Literal["agent"], start: float,
             end: float, args: dict[str, Any], cname: str | None = None) -> None:
        event: dict[str, Any] = {"name": name, "cat": cat, "ph": "X", "ts": us(start),
                                 "dur": round(max(us(end) - us(start), 0.0), 1),
                                 "pid": pids[node], "tid": tid(track), "args": args}
        if cname:
            event["cname"] = cname
        events.append(event)

    for a in view.attempts:
        args: dict[str, Any] = {"attempt": a.index, "outcome": a.outcome}
        if a.restart is not None:
            args["restart"] = _args(a.restart)
        span(f"attempt {a.index}", "attempt", a.node, AGENT, a.start, a.end, args,
             _OUTCOME_COLOUR.get(a.outcome))
    for d in view.drains:
        # on the agent track of the node whose agent recorded the PREEMPTING
        drain_node = next((m.node for m in view.markers if m.record is d.preempting),
                          view.nodes[0].label)
        drain_args: dict[str, Any] = {k: v for k, v in d.preempting.fields.items()
                                      if v is not None}
        if d.exit is not None:
            drain_args["end"] = sentence(d.exit)
            if d.facts is not None:
                drain_args["drain"] = d.facts
        # nested in the attempt it began in
        holder = [a for a in view.attempts if a.node == drain_node
                  and a.start <= d.start <= a.end]
        end = min(d.end, holder[-1].end) if holder else d.end
        span(sentence(d.preempting), "drain", drain_node, AGENT, d.start, end, drain_args,
             "yellow")
    for z in view.rendezvous:
        # Nest inside its attempt: clamp to the attempt that holds its end.
        holder = [a for a in view.attempts if a.node == z.node and a.start <= z.end <= a.end]
        start = max(z.start, holder[-1].start) if holder else z.start
        span("rendezvous", "rendezvous", z.node, AGENT, start, z.end, _args(z.record),
             "terrible" if z.record.is_failure else None)
    for w in view.runs:
        where: int | Literal["agent"] = w.rank if w.rank is not None else AGENT
        args = {"rank": w.rank, "attempt": w.attempt, "hostname": w.hostname, "pid": w.pid,
                "local_rank": w.local_rank, "exit_code": w.exit_code, "ended_by": w.ended_by,
                "signal": w.signal, "message": w.message}
        label = f"rank {w.rank} attempt {w.attempt}"
        own_failure = w.failed and not w.stopped_by_agent
        if own_failure:
            label += f" (exit {w.exit_code})"
        elif w.stopped_by_agent:
            label += f" (stopped: {w.signal or f'exit {w.exit_code}'})"
            args["stopped_by_agent"] = True
        span(label, "worker", w.node, where, w.start, w.end,
             {k: v for k, v in args.items() if v is not None},
             "terrible" if own_failure else None)
        if w.first_event is not None and w.first_event > w.start:
            # from the agent's start to the worker's first own event: importing torch,
            # joining the process group, loading a checkpoint
            span("starting", "startup", w.node, where, w.start, min(w.first_event, w.end),
                 {"rank": w.rank, "attempt": w.attempt, "seconds": w.first_event - w.start})
    for e in view.epochs:
        run = next((w for w in view.runs if w.node == e.node and w.rank == e.rank
                    and w.start <= e.start <= w.end), None)
        start, end = e.start, e.end
        if run is not None:  # keep it nested in its worker span
            start, end = max(start, run.start), min(end, run.end)
        name = f"epoch {e.epoch}" + ("" if e.finished else " (unfinished)")
        span(name, "epoch", e.node, e.rank if e.rank is not None else AGENT, start, end,
             {"epoch": e.epoch, "attempt": e.attempt, "finished": e.finished})
    for m in view.markers:
        r = m.record
        if r.type == "METRIC":
            values = {k: v for k, v in r.data.items()
                      if type(v) in (int, float) and math.isfinite(v)}
            series = f"rank {m.track}" if m.track != AGENT else "agent"
            for key, value in values.items():
                events.append({"name": key, "cat": "metric", "ph": "C", "ts": us(r.timestamp),
                               "pid": pids[m.node], "tid": tid(m.track),
                               "args": {series: value}})
            if values and len(values) == len(r.data):
                continue  # fully shown by its counters
        if r.type == "WORKER_PROGRESS":
            # a heartbeat a second per rank: counters (how idle, how far), not instants
            series = f"rank {m.track}" if m.track != AGENT else "agent"
            for key in _PROGRESS_COUNTERS:
                value = r.fields.get(key)
                if isinstance(value, (int, float)) and not isinstance(value, bool) \
                        and math.isfinite(value):
                    events.append({"name": f"progress {key}", "cat": "progress", "ph": "C",
                                   "ts": us(r.timestamp), "pid": pids[m.node],
                                   "tid": tid(m.track), "args": {series: value}})
            continue
        if r.type == "WORKER_EXIT" and r.fields.get("cause") == Cause.PREEMPTION.value:
            category = "drain"  # a drain's exit: not a failure of its own
        else:
            category = "stopped" if r.stopped_by_agent else _CATEGORY.get(r.type, "user")
        events.append({"name": _instant_name(r), "cat": category,
                       "ph": "i", "s": _INSTANT_SCOPE.get(r.type, "t"), "ts": us(r.timestamp),
                       "pid": pids[m.node], "tid": tid(m.track),
                       "args": {"type": r.type, **_args(r)}})
    events.sort(key=lambda e: (e["ts"], -e.get("dur", 0.0)))
    other: dict[str, Any] = {
        "generator": "eventbus trace",
        "t0_unix_s": t0,
        "run_id": view.run_id,
        "outcome": view.outcome(),
        "events": len(view.records),
        "skipped_lines": [p.describe() for p in view.problems],
    }
    if sources:
        other["sources"] = list(sources)
    return {"traceEvents": _jsonable(meta + events), "displayTimeUnit": "ms",
            "otherData": _jsonable(other)}


def export_trace(inputs: Sequence[str | Path], output: str | Path) -> dict[str, Any]:
    """Read ``inputs`` (one JSONL file per node, merged; duplicates kept once), write the
    trace to ``output`` and return it."""
    view = JobView.from_files(inputs)
    trace = chrome_trace(view, sources=[str(p) for p in inputs])
    write_trace(trace, Path(output))
    return trace


def write_trace(trace: dict[str, Any], output: str | Path) -> None:
    """Write ``trace`` (from :func:`chrome_trace`) as strict JSON."""
    text = json.dumps(trace, allow_nan=False, separators=(",", ":"))
    Path(output).write_text(text + "\n", encoding="utf-8")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eventbus trace",
        description="Events JSONL -> Chrome Trace Event Format JSON. Open the result at "
                    "https://ui.perfetto.dev (or chrome://tracing).")
    parser.add_argument("inputs", nargs="+", metavar="EVENTS.jsonl",
                        help="events files (several, e.g. one per node, merge into one "
                             "trace), or a folder: its *.jsonl files")
    parser.add_argument("-o", "--output", default=None, metavar="TRACE.json",
                        help="where to write the trace (default: trace.json next to the "
                             "first input)")
    return parser


def _default_output(first: str, name: str) -> Path:
    """``name`` next to the first input, or inside it when it is a directory."""
    path = Path(first)
    return path / name if path.is_dir() else path.with_name(name)


def main(argv: list[str]) -> int:
    """``eventbus trace``: returns 0 on success, 1 when the inputs hold no events, 2 on a
    usage error."""
    args = _parser().parse_args(argv)
    inputs = expand_inputs("trace", args.inputs)
    if inputs is None:
        return 2
    output = Path(args.output) if args.output else _default_output(args.inputs[0],
                                                                    "trace.json")
    view = load_for_command("trace", inputs)
    if view is None:
        return 1
    trace = chrome_trace(view, sources=inputs)
    try:
        write_trace(trace, output)
    except OSError as exc:
        print(f"eventbus trace: cannot write {output}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    n_spans = sum(1 for e in trace["traceEvents"] if e["ph"] == "X")
    print(f"{output}: {len(view.records)} events, {len(view.nodes)} node(s), "
          f"{sum(len(n.ranks) for n in view.nodes)} rank(s), {view.attempt_count()} "
          f"attempt(s), {n_spans} spans; open it at https://ui.perfetto.dev")
    return 0
