"""`eventbus plot` / eventbus.app.readers.timeline: events JSONL -> a timeline picture."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from eventbus.app.cli import main as cli_main
from eventbus.app.readers.jobview import JobView
from eventbus.app.readers.records import Record
from eventbus.app.readers.records import read_records
from eventbus.app.readers.timeline import PlotUnavailableError
from eventbus.app.readers.timeline import plot_timeline

FIXTURES = Path(__file__).resolve().parent / "fixtures"
NODE0 = FIXTURES / "job_node0.jsonl"
NODE1 = FIXTURES / "job_node1.jsonl"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _red_pixels(path: Path) -> int:
    """Pixels of the failure colour (#d62728), give or take antialiasing."""
    from matplotlib.image import imread

    img = imread(path)
    r, g, b = img[..., 0], img[..., 1], img[..., 2]
    return int(((abs(r - 0xD6 / 255) < 0.06) & (abs(g - 0x27 / 255) < 0.06)
                & (abs(b - 0x28 / 255) < 0.06)).sum())


def test_plot_writes_a_non_empty_png(tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Two node files -> one PNG of a sensible size; stdout says what it drew."""
    out = tmp_path / "timeline.png"
    assert cli_main(["plot", str(NODE0), str(NODE1), "-o", str(out)]) == 0
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 20_000
    from matplotlib.image import imread

    height, width = imread(out).shape[:2]
    assert width >= 1200 and height >= 400
    captured = capsys.readouterr()
    assert "4 rank(s) on 2 node(s), 2 attempt(s), job SUCCEEDED" in captured.out
    assert "torn line" in captured.err and "foreign line" in captured.err


def test_failures_and_restarts_are_drawn_in_red(tmp_path: Path) -> None:
    """The failure marks (red X, red outline, red restart line) are in the picture of the
    job with a crash and absent from the picture of its clean second attempt alone."""
    records = read_records(NODE0)[0]
    crashed = plot_timeline(JobView.from_records(records), tmp_path / "crash.png")
    restart_at = next(r.timestamp for r in records if r.type == "WORKER_RESTART")
    clean_records = [r for r in records if r.timestamp > restart_at]
    clean = plot_timeline(JobView.from_records(clean_records), tmp_path / "clean.png")
    assert _red_pixels(crashed) > 300
    assert _red_pixels(clean) < 20


def test_suffix_picks_the_format(tmp_path: Path) -> None:
    """-o timeline.svg writes SVG."""
    out = tmp_path / "timeline.svg"
    assert cli_main(["plot", str(NODE1), "-o", str(out)]) == 0
    assert out.read_text().lstrip().startswith("<?xml")
    assert "<svg" in out.read_text()


def test_missing_matplotlib_is_a_clear_message(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Without matplotlib: exit 1, the message names the extra to install, no file."""
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    out = tmp_path / "timeline.png"
    assert cli_main(["plot", str(NODE0), "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert "needs matplotlib" in err and "pip install 'eventbus[plot]'" in err
    assert not out.exists()
    with pytest.raises(PlotUnavailableError, match=r"eventbus\[plot\]"):
        plot_timeline(JobView.from_files([NODE0]), out)


def test_cli_errors_name_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A missing input is exit 2 naming it; nothing to draw is exit 1."""
    assert cli_main(["plot", str(tmp_path / "gone.jsonl")]) == 2
    assert "gone.jsonl: no such file" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert cli_main(["plot", str(empty), "-o", str(tmp_path / "x.png")]) == 1
    assert "no events in" in capsys.readouterr().err


def test_readme_embeds_the_demo_picture() -> None:
    """The README's quick start shows docs/timeline.png, and that file is a real PNG."""
    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    assert "](docs/timeline.png)" in readme
    assert (root / "docs" / "timeline.png").read_bytes().startswith(PNG_MAGIC)


def _pixels_of(path: Path, colour: str) -> int:
    """Pixels of ``colour`` (#rrggbb), give or take antialiasing."""
    from matplotlib.image import imread

    img = imread(path)
    r, g, b = (int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5))
    return int(((abs(img[..., 0] - r) < 0.06) & (abs(img[..., 1] - g) < 0.06)
                & (abs(img[..., 2] - b) < 0.06)).sum())


def _stalled_job() -> list[Record]:
    """Two ranks; rank 1 makes no progress after t0+5; the agent reports the stall at t0+25
    (silent 20 s) and stops both; heartbeats every second on rank 0."""
    t0 = 1_764_410_000.0

    def rec(type_: str, t: float, rank: int | None = None, **fields: object) -> Record:
        return Record(type_, t0 + t, dict(fields), {}, {
            "rank": rank, "group_rank": 0, "run_id": "stall", "restart_count": 0,
            "hostname": "node-a", "pid": 100 if rank is None else 200 + rank})

    records = [rec("AGENT_START", 0.0, max_restarts=0, nproc_per_node=2)]
    records += [rec("WORKER_START", 1.0, worker_id=r, worker_pid=200 + r) for r in (0, 1)]
    records += [rec("EPOCH_START", 2.0, r, epoch=0) for r in (0, 1)]
    records += [rec("METRIC", 5.0, 1, step=1)]
    records += [rec("WORKER_PROGRESS", float(t), 0, worker_id=0, step=t) for t in range(3, 25)]
    records += [rec("WORKER_STALLED", 25.0, worker_id=1, silent_s=20.0)]
    records += [rec("WORKER_EXIT", 27.0, worker_id=r, exit_code=-15, signal="SIGTERM")
                for r in (0, 1)]
    records += [rec("AGENT_EXIT", 27.5, state="FAILED", exit_code=1)]
    return records


def test_a_stalled_period_is_drawn_as_stalled(tmp_path: Path) -> None:
    """The hung period (silent_s before WORKER_STALLED to the process's end) is hatched
    amber, with its legend entry; the same job without the stall report has none, and the
    heartbeats are not drawn as dots."""
    from eventbus.app.readers import timeline

    records = _stalled_job()
    stalled = plot_timeline(JobView.from_records(records), tmp_path / "stalled.png")
    calm = plot_timeline(JobView.from_records(
        [r for r in records if r.type != "WORKER_STALLED"]), tmp_path / "calm.png")
    assert timeline._stalled_periods(JobView.from_records(records)) == [
        ("node 0", 1, 1_764_410_005.0, 1_764_410_027.0)]
    assert _pixels_of(stalled, timeline._STALLED) > 2000
    assert _pixels_of(calm, timeline._STALLED) < 20


def test_marks_are_labelled_with_the_events_short_sentences(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The labels next to a failure's and a stall's marks are their events' sentences in
    the short form (eventbus.app.sentences), not words of the plot's own."""
    matplotlib = pytest.importorskip("matplotlib")
    monkeypatch.setitem(matplotlib.rcParams, "svg.fonttype", "none")  # text kept as text
    svg = plot_timeline(JobView.from_records(_stalled_job()), tmp_path / "job.svg")
    text = svg.read_text()
    assert "stalled for 20.0 s" in text
    assert text.count("failed (signal SIGTERM)") == 2


def test_a_drain_is_shaded_and_labelled_with_its_sentences(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A drain is shaded teal from its PREEMPTING to the job's AGENT_EXIT, labelled with
    the PREEMPTING's sentence and how the drain ended; the rank that did not stop in time
    is marked (its short sentence); the heading says PREEMPTED, and nothing of it is red."""
    from eventbus.app.readers import timeline
    from tests.test_jobview import drained_job

    matplotlib = pytest.importorskip("matplotlib")
    view = JobView.from_records(drained_job())
    png = plot_timeline(view, tmp_path / "drained.png")
    undrained = plot_timeline(JobView.from_records(
        [r for r in drained_job() if r.type not in ("PREEMPTING", "AGENT_EXIT")]),
        tmp_path / "undrained.png")
    assert _pixels_of(png, timeline._DRAIN) > 300
    assert _pixels_of(undrained, timeline._DRAIN) < 20
    assert _pixels_of(png, timeline._LATE) > 30
    assert _red_pixels(png) < 20
    monkeypatch.setitem(matplotlib.rcParams, "svg.fonttype", "none")  # text kept as text
    text = plot_timeline(view, tmp_path / "drained.svg").read_text()
    assert "drain: SIGTERM on node 0, 3 s to stop" in text
    assert ("preempted: the other ranks stopped at step 34; rank 1 did not stop in time"
            in text)
    assert "did not stop in time (SIGTERM)" in text
    assert "PREEMPTED, 1 attempt(s), 2 rank(s) on 1 node(s)" in text
    assert "drain (preemption)" in text  # its legend entry
