"""Events JSONL -> a static timeline picture (PNG, or any format matplotlib writes).

``eventbus plot EVENTS.jsonl [MORE.jsonl ...] -o timeline.png``; in code,
:func:`plot_timeline`. One row per agent and per rank, grouped by node; time on the x axis
in seconds since the job's first event; each node's attempts shaded; each worker process a
bar coloured by its attempt (lighter before its first and after its last own event:
start-up and shut-down), with its epochs ticked inside it; a stalled worker's hung period
(from its last progress, ``silent_s`` before the agent's ``WORKER_STALLED``, to the end of
the process) hatched amber; failures, restarts, rendezvous and checkpoints marked; a drain
(preemption) shaded teal across every row from its ``PREEMPTING`` to the job's
``AGENT_EXIT``, labelled with its sentence and how it ended, the ranks that did not stop in
time marked. The workers' heartbeats (``WORKER_PROGRESS``) are not drawn.

matplotlib is an optional extra (``pip install 'eventbus[plot]'``), imported only here,
only when a picture is drawn.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from collections.abc import Callable
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from typing import Literal

from eventbus.app.readers.goodput import CAUSES
from eventbus.app.readers.jobview import AGENT
from eventbus.app.readers.jobview import JobView
from eventbus.app.readers.jobview import expand_inputs
from eventbus.app.readers.jobview import iter_tracks
from eventbus.app.readers.jobview import load_for_command
from eventbus.app.sentences import drain_banner
from eventbus.app.sentences import job_outcome
from eventbus.app.sentences import sentence
from eventbus.events import Cause

__all__ = ["PlotUnavailableError", "main", "plot_timeline"]

_INSTALL_HINT = "pip install 'eventbus[plot]'"

#: attempt colours (matplotlib's tab10, without its red: red means failure here)
_ATTEMPT_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2",
                    "#7f7f7f", "#bcbd22", "#17becf")
_FAILURE = "#d62728"
_RESTART = "#d62728"
_CHECKPOINT = "#2ca02c"
_RENDEZVOUS = "#6a3d9a"
_STOPPED = "#555555"
_SLOW = "#ff7f0e"
#: a stalled worker's hung period, from its last progress to its end (amber, hatched)
_STALLED = "#e6ab02"
#: a drain (preemption): neither a failure (red) nor a success
_DRAIN = "#00838f"
#: a rank that did not stop within the drain's grace
_LATE = "#c2255c"
#: event types with a mark of their own (everything else is an "other event" dot)
_DRAWN_APART = frozenset({"WORKER_START", "WORKER_EXIT", "WORKER_RESTART", "RENDEZVOUS",
                          "AGENT_START", "AGENT_EXIT", "EPOCH_START", "EPOCH_END",
                          "CHECKPOINT_SAVED", "METRIC", "TORCHELASTIC",
                          "WORKER_STALLED", "WORKER_SLOW", "WORKER_PROGRESS",
                          "PREEMPTING"})
#: above this many failures, stops and stalls, their labels are left to the trace
_MAX_EXIT_LABELS = 40


class PlotUnavailableError(ImportError):
    """matplotlib is not installed; the message says how to install it."""


def _matplotlib() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise PlotUnavailableError(
            f"eventbus plot needs matplotlib, which is not installed ({exc}). Install the "
            f"optional extra: {_INSTALL_HINT}") from None
    return Figure


def _colour(attempt: int) -> str:
    return _ATTEMPT_COLOURS[attempt % len(_ATTEMPT_COLOURS)]


def _stalled_periods(view: JobView) -> list[tuple[str, int, float, float]]:
    """``(node, rank, start, end)`` of each stalled period: a ``WORKER_STALLED`` about a
    worker run (the process alive when it was reported) covers ``silent_s`` before it up
    to the end of that process (the agent stops a stalled group)."""
    periods: list[tuple[str, int, float, float]] = []
    for m in view.markers:
        r = m.record
        silent = r.fields.get("silent_s")
        if r.type != "WORKER_STALLED" or not isinstance(m.track, int) \
                or not isinstance(silent, (int, float)) or isinstance(silent, bool) \
                or not silent >= 0:
            continue
        for w in view.runs:
            if w.node == m.node and w.rank == m.track and w.start <= m.timestamp <= w.end:
                start = max(w.start, m.timestamp - float(silent))
                periods.append((m.node, m.track, start, max(w.end, m.timestamp)))
                break
    return periods


def plot_timeline(view: JobView, output: str | Path, *, title: str | None = None,
                  dpi: int = 120) -> Path:
    """Draw ``view`` to ``output`` (format from its suffix) and return the path.

    Raises :class:`PlotUnavailableError` when matplotlib is missing.
    """
    figure_cls = _matplotlib()
    from matplotlib.collections import LineCollection
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    rows: dict[tuple[str, int | Literal["agent"]], int] = {}
    labels: list[str] = []
    for node, track in iter_tracks(view):
        rows[(node.label, track)] = len(rows)
        labels.append(f"{node.label} agent" if track == AGENT else f"rank {track}")
    n_rows = max(len(rows), 1)
    t0 = view.t0

    def x(t: float) -> float:
        return t - t0

    span = max(view.t1 - t0, 1e-3)
    fig = figure_cls(figsize=(12, 2.0 + 0.55 * n_rows), dpi=dpi, layout="constrained")
    grid = fig.add_gridspec(2, 1, height_ratios=[n_rows, 0.7])
    ax = fig.add_subplot(grid[0])
    strip = fig.add_subplot(grid[1], sharex=ax)
    ax.set_ylim(n_rows - 0.5, -0.5)
    ax.set_xlim(-0.01 * span, span * 1.02)
    ax.set_yticks(range(len(labels)), labels)
    ax.set_xlabel("seconds since the job's first event ("
                  + datetime.datetime.fromtimestamp(t0, datetime.timezone.utc)
                  .strftime("%Y-%m-%d %H:%M:%S UTC") + ")")
    ax.grid(axis="x", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)

    # attempts: a shaded band over each node's rows, labelled in its agent row
    for a in view.attempts:
        node_rows = [row for (label, _), row in rows.items() if label == a.node]
        top, bottom = min(node_rows) - 0.5, max(node_rows) + 0.5
        ax.fill_between([x(a.start), x(a.end)], top, bottom, color=_colour(a.index),
                        alpha=0.10, linewidth=0, zorder=0)
        ax.text(x(a.start) + 0.005 * span, top + 0.08, f"attempt {a.index}", fontsize=8,
                va="top", ha="left", color=_colour(a.index), zorder=5)
    # node separators
    for node in view.nodes[1:]:
        ax.axhline(rows[(node.label, AGENT)] - 0.5, color="#888888", linewidth=0.8)
    # rendezvous rounds on the agent rows
    for z in view.rendezvous:
        row = rows[(z.node, AGENT)]
        failed = z.record.is_failure
        ax.barh(row, max(x(z.end) - x(z.start), span * 0.002), left=x(z.start), height=0.35,
                color="white", edgecolor=_FAILURE if failed else _RENDEZVOUS,
                hatch="////", linewidth=0.8, zorder=2)
    # worker processes, coloured by attempt, with their epochs ticked inside
    for w in view.runs:
        wrow = rows.get((w.node, w.rank if w.rank is not None else AGENT))
        if wrow is None:
            continue
        own_failure = w.failed and not w.stopped_by_agent
        # the whole process, light; the part between its first and last own event, solid
        width = max(x(w.end) - x(w.start), span * 0.002)
        ax.barh(wrow, width, left=x(w.start), height=0.5, color=_colour(w.attempt),
                alpha=0.35 if w.first_event is not None else 0.85, linewidth=0, zorder=2)
        if w.first_event is not None and w.last_event is not None:
            ax.barh(wrow, max(x(w.last_event) - x(w.first_event), span * 0.002),
                    left=x(w.first_event), height=0.5, color=_colour(w.attempt), alpha=0.9,
                    linewidth=0, zorder=2)
        if own_failure:  # the worker that failed by itself: outlined in red
            ax.barh(wrow, width, left=x(w.start), height=0.5, fill=False,
                    edgecolor=_FAILURE, linewidth=2, zorder=3)
    # stalled periods: from the worker's last progress to the end of its process
    stalled = _stalled_periods(view)
    for node_label, rank, start, end in stalled:
        srow = rows.get((node_label, rank))
        if srow is None:
            continue
        ax.barh(srow, max(x(end) - x(start), span * 0.002), left=x(start), height=0.5,
                color=_STALLED, edgecolor="white", hatch="xx", linewidth=0, zorder=3)
    # drains: shaded across every row from the signal to the job's end, with their sentence
    for d in view.drains:
        ax.axvspan(x(d.start), max(x(d.end), x(d.start) + span * 0.002), color=_DRAIN,
                   alpha=0.12, linewidth=0, zorder=1)
        ax.axvspan(x(d.start), max(x(d.end), x(d.start) + span * 0.002), facecolor="none",
                   edgecolor=_DRAIN, hatch="\\\\", alpha=0.35, linewidth=0, zorder=1)
        ax.axvline(x(d.start), color=_DRAIN, linewidth=1.5, zorder=5)
        label = sentence(d.preempting)
        if d.exit is not None and job_outcome(d.exit) == "preempted":
            label += "\n" + drain_banner(facts=d.facts, ended=True)
        ax.text(x(d.end), -0.45, label, fontsize=8, color=_DRAIN, ha="right", va="top",
                zorder=7, bbox={"facecolor": "white", "edgecolor": _DRAIN, "alpha": 0.85,
                                "boxstyle": "round,pad=0.25", "linewidth": 0.6})
    # Epoch ticks and point events are drawn in batches (one collection per kind): a long
    # job has tens of thousands of them, and one artist each would take minutes.
    ticks: list[list[tuple[float, float]]] = []
    for e in view.epochs:
        erow = rows.get((e.node, e.rank if e.rank is not None else AGENT))
        if erow is None:
            continue
        for t in (e.start, e.end) if e.finished else (e.start,):
            ticks.append([(x(t), erow - 0.25), (x(t), erow + 0.25)])
        # an epoch its worker never finished (it failed or was stopped) says so
        label = str(e.epoch) if e.finished else f"{e.epoch} (cut)"
        if (e.end - e.start) > (0.006 + 0.004 * len(label)) * span:  # when the label fits
            ax.text(x((e.start + e.end) / 2), erow, label, fontsize=7,
                    color="white" if e.finished else "#333333", ha="center", va="center",
                    zorder=4)
    if ticks:
        ax.add_collection(LineCollection(ticks, colors="white", linewidths=1.2, zorder=3))
    # point events, by kind: (xs, ys)
    points: dict[str, tuple[list[float], list[float]]] = {}
    restarts: list[list[tuple[float, float]]] = []
    labelled: list[tuple[float, float, str, str]] = []  # x, row, text, colour

    def point(kind: str, t: float, y: float) -> None:
        xs, ys = points.setdefault(kind, ([], []))
        xs.append(t)
        ys.append(y)

    for m in view.markers:
        r = m.record
        found = rows.get((m.node, m.track))
        if found is None:
            continue
        row, t = found, x(m.timestamp)
        # the labels are the events' sentences in their short form (the row names the rank)
        if r.stopped_by_agent and r.fields.get("cause") == Cause.PREEMPTION.value \
                and r.data.get("drained") is not True:
            point("late", t, row)  # it did not stop within the drain's grace
            labelled.append((t, row, sentence(r, short=True), _LATE))
        elif r.stopped_by_agent:
            point("stopped", t, row)
            labelled.append((t, row, sentence(r, short=True), _STOPPED))
        elif r.type == "WORKER_EXIT" and r.is_failure:
            point("failure", t, row)
            labelled.append((t, row, sentence(r, short=True), _FAILURE))
        elif r.type == "WORKER_RESTART":
            # across the node's rows; the attempt band's label names what follows
            node_rows = [rw for (label, _), rw in rows.items() if label == m.node]
            restarts.append([(t, min(node_rows) - 0.45), (t, max(node_rows) + 0.45)])
        elif r.type == "CHECKPOINT_SAVED":
            point("checkpoint", t, row - 0.32)
        elif r.type == "WORKER_STALLED":  # job health
            point("stall", t, row - 0.3)  # above the row: the stop mark follows it
            labelled.append((t, row - 0.3, sentence(r, short=True), _FAILURE))
        elif r.type == "WORKER_SLOW":
            point("slow", t, row + 0.3)
        elif r.type in ("METRIC", "WORKER_PROGRESS"):
            continue  # numbers and heartbeats, not moments: the trace's counters have them
        elif r.type == "PREEMPTING":
            point("drain", t, row)
        elif r.type == "AGENT_EXIT" and job_outcome(r) == "preempted":
            point("agent drain", t, row)  # drained: neither a failure nor a success
        elif r.type in ("AGENT_START", "AGENT_EXIT"):
            point("agent failure" if r.is_failure else "agent", t, row)
        elif r.type == "TORCHELASTIC":  # torch's own bookkeeping: small, in the background
            point("torch", t, row + 0.3)
        else:  # everything else (lost events, user-declared types): a dot
            point("other failure" if r.is_failure else "other", t, row)
    if restarts:
        ax.add_collection(LineCollection(restarts, colors=_RESTART, linestyles="--",
                                         linewidths=1.2, zorder=5))
    styles: dict[str, dict[str, Any]] = {
        "stopped": {"marker": "s", "markersize": 7, "color": _STOPPED,
                    "markeredgecolor": "white"},
        "failure": {"marker": "X", "markersize": 11, "color": _FAILURE,
                    "markeredgecolor": "white"},
        "late": {"marker": "s", "markersize": 8, "color": _LATE, "markeredgecolor": "white"},
        "drain": {"marker": "D", "markersize": 8, "color": _DRAIN, "markeredgecolor": "white"},
        "agent drain": {"marker": "|", "markersize": 14, "markeredgewidth": 2,
                        "color": _DRAIN},
        "checkpoint": {"marker": "v", "markersize": 7, "color": _CHECKPOINT},
        "stall": {"marker": "*", "markersize": 13, "color": _FAILURE,
                  "markeredgecolor": "white"},
        "slow": {"marker": ">", "markersize": 6, "color": _SLOW},
        "agent": {"marker": "|", "markersize": 14, "markeredgewidth": 2, "color": "#333333"},
        "agent failure": {"marker": "|", "markersize": 14, "markeredgewidth": 2,
                          "color": _FAILURE},
        "torch": {"marker": "|", "markersize": 5, "color": "#aaaaaa"},
        "other": {"marker": "o", "markersize": 4, "color": "#555555"},
        "other failure": {"marker": "o", "markersize": 4, "color": _FAILURE},
    }
    for kind, (xs, ys) in points.items():
        # a drain's mark above its label's box
        ax.plot(xs, ys, linestyle="none", zorder=8 if kind == "drain" else 6, **styles[kind])
    # the short sentences next to their marks, while there are few enough to read
    if len(labelled) <= _MAX_EXIT_LABELS:
        for t, y, text, colour in labelled:
            ax.annotate(text, (t, y), xytext=(6, -9), textcoords="offset points",
                        fontsize=8, color=colour, zorder=6)

    n_ranks = sum(len(n.ranks) for n in view.nodes)
    heading = title or (f"{view.run_id or 'job'}: {view.outcome()}, "
                        f"{view.attempt_count()} attempt(s), {n_ranks} rank(s) on "
                        f"{len(view.nodes)} node(s)")
    ax.set_title(heading, fontsize=11, loc="left")
    # a legend of what is in this picture only
    kinds = {m.record.type for m in view.markers}
    handles: list[Any] = [Patch(facecolor=_colour(i), alpha=0.85, label=f"worker, attempt {i}")
                          for i in range(max(view.attempt_count(), 1))]
    if view.rendezvous:
        handles.append(Patch(facecolor="white", edgecolor=_RENDEZVOUS, hatch="////",
                             label="rendezvous"))
    if any(m.record.type == "WORKER_EXIT" and m.record.is_own_failure for m in view.markers):
        handles.append(Line2D([], [], color="white", marker="X", markerfacecolor=_FAILURE,
                              markersize=10, label="worker failure"))
    if "late" in points:
        handles.append(Line2D([], [], color="white", marker="s", markerfacecolor=_LATE,
                              markersize=8, label="did not stop in the drain's grace"))
    if "stopped" in points:
        handles.append(Line2D([], [], color="white", marker="s", markerfacecolor=_STOPPED,
                              markersize=8, label="stopped by its agent"))
    if view.drains:
        handles.append(Patch(facecolor=_DRAIN, alpha=0.3, edgecolor=_DRAIN, hatch="\\\\",
                             label="drain (preemption): signal to the job's end"))
    if "WORKER_STALLED" in kinds:
        handles.append(Line2D([], [], color="white", marker="*", markerfacecolor=_FAILURE,
                              markersize=12, label="stalled worker"))
    if stalled:
        handles.append(Patch(facecolor=_STALLED, edgecolor="white", hatch="xx",
                             label="stalled: no progress until stopped"))
    if "WORKER_SLOW" in kinds:
        handles.append(Line2D([], [], color="white", marker=">", markerfacecolor=_SLOW,
                              markersize=8, label="slow rank (straggler)"))
    if "WORKER_RESTART" in kinds:
        handles.append(Line2D([], [], color=_RESTART, linestyle="--", label="restart"))
    if "CHECKPOINT_SAVED" in kinds:
        handles.append(Line2D([], [], color="white", marker="v", markerfacecolor=_CHECKPOINT,
                              markersize=8, label="checkpoint"))
    if kinds & {"AGENT_START", "AGENT_EXIT"}:
        handles.append(Line2D([], [], color="#333333", marker="|", linestyle="none",
                              markersize=12, markeredgewidth=2, label="agent start / exit"))
    if "TORCHELASTIC" in kinds:
        handles.append(Line2D([], [], color="#aaaaaa", marker="|", linestyle="none",
                              markersize=8, label="torch's own records"))
    if kinds - _DRAWN_APART:
        handles.append(Line2D([], [], color="#555555", marker="o", linestyle="none",
                              markersize=5, label="other events"))
    if any(w.first_event is not None for w in view.runs):
        handles.append(Patch(facecolor=_colour(0), alpha=0.35,
                             label="process start-up / shut-down"))
    if view.epochs:
        handles.append(Patch(facecolor="#999999", label="epochs: numbered, ticked in white"))
    _goodput_strip(strip, view, x, handles)
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 6),
               fontsize=8, frameon=False)
    out = Path(output)
    fig.savefig(out)
    return out


#: the goodput strip's colours, per cause (docs/goodput.md)
_CAUSE_COLOURS = {"goodput": "#4caf50", "startup": "#b0bec5", "checkpoint": "#26a69a",
                  "stall": "#ef6c00", "restart": "#e53935", "wasted": "#f48fb1",
                  "drain": _DRAIN, "other": "#e0e0e0"}


def _goodput_strip(strip: Any, view: JobView, x: Callable[[float], float],
                   handles: list[Any]) -> None:
    """The job's time by cause under the rows (docs/goodput.md), titled with its sentence;
    the causes it shows join the legend."""
    from matplotlib.patches import Patch

    from eventbus.app.readers.goodput import GoodputError
    from eventbus.app.readers.goodput import goodput

    strip.set_yticks([])
    strip.tick_params(axis="x", labelbottom=False)
    try:
        result = goodput(view.records, per_node=False)
    except GoodputError:
        strip.set_axis_off()
        return
    shown: list[str] = []
    for start, end, cause in result.spans:
        strip.barh(0, x(end) - x(start), left=x(start), height=0.8,
                   color=_CAUSE_COLOURS.get(cause, "#999999"), linewidth=0)
        if cause not in shown:
            shown.append(cause)
    strip.set_ylim(-0.5, 0.5)
    strip.set_title(result.sentence(), fontsize=8, loc="left", pad=2)
    order = ("goodput", *CAUSES)
    for cause in sorted(shown, key=order.index):
        handles.append(Patch(facecolor=_CAUSE_COLOURS.get(cause, "#999999"),
                             label=f"time: {cause}"))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eventbus plot",
        description="Events JSONL -> a timeline picture: ranks by time, attempts shaded, "
                    f"failures and restarts marked. Needs matplotlib ({_INSTALL_HINT}).")
    parser.add_argument("inputs", nargs="+", metavar="EVENTS.jsonl",
                        help="events files (several, e.g. one per node, merge into one picture)")
    parser.add_argument("-o", "--output", default=None, metavar="TIMELINE.png",
                        help="where to write the picture; the suffix picks the format "
                             "(default: timeline.png next to the first input)")
    parser.add_argument("--title", default=None, help="the picture's title")
    parser.add_argument("--dpi", type=int, default=120, help="resolution (default 120)")
    return parser


def main(argv: Sequence[str]) -> int:
    """``eventbus plot``: 0 on success, 1 when there is nothing to draw or matplotlib is
    missing, 2 on a usage error."""
    args = _parser().parse_args(list(argv))
    inputs = expand_inputs("plot", args.inputs)
    if inputs is None:
        return 2
    try:
        _matplotlib()
    except PlotUnavailableError as exc:
        print(f"eventbus plot: {exc}", file=sys.stderr)
        return 1
    first = Path(args.inputs[0])
    output = Path(args.output) if args.output else (
        first / "timeline.png" if first.is_dir() else first.with_name("timeline.png"))
    view = load_for_command("plot", inputs)
    if view is None:
        return 1
    try:
        plot_timeline(view, output, title=args.title, dpi=args.dpi)
    except (OSError, ValueError) as exc:
        print(f"eventbus plot: cannot write {output}: {exc}", file=sys.stderr)
        return 2
    print(f"{output}: {sum(len(n.ranks) for n in view.nodes)} rank(s) on {len(view.nodes)} "
          f"node(s), {view.attempt_count()} attempt(s), job {view.outcome()}")
    return 0
