"""`eventbus plot` / eventbus.app.readers.timeline: events JSONL -> a timeline picture."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from eventbus.app.cli import main as cli_main
from eventbus.app.readers.jobview import JobView
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
