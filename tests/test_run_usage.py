"""`eventbus run --help` and its usage errors: eventbus's own options first, torchrun's
after under their own heading; a usage error is the usage line, the error and a pointer
to --help (at most 5 lines), with "did you mean" for a misspelt option or reactor."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from eventbus.app.launcher.command import build_parser
from eventbus.app.launcher.command import load_reactor
from eventbus.errors import did_you_mean
from tests.launcher_helpers import run_command


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[str]:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert 3 <= len(lines) <= 5, lines
    assert lines[0] == "usage: eventbus run [options] SCRIPT ..."
    assert lines[1].startswith("eventbus run: error: ")
    assert "eventbus run --help" in lines[-1]
    return lines


def test_help_lists_eventbus_options_first_then_torchruns() -> None:
    text = build_parser().format_help()
    assert text.startswith("usage: eventbus run [options] SCRIPT ...\n")
    ours = text.index("eventbus options:")
    theirs = text.index("torchrun options (unchanged):")
    assert ours < text.index("--events-jsonl") < text.index("--stop-exit-code") < theirs
    assert theirs < text.index("--nproc-per-node") and theirs < text.index("--max-restarts")
    assert text.index("-h, --help") < theirs
    assert "--nproc-per-node" not in text[:theirs]


@pytest.mark.parametrize(("argv", "says"), [
    ([], "no SCRIPT to run"),
    (["--stall-timeout", "0", "x.py"], "argument --stall-timeout: expected 'off', seconds > 0"),
    (["--nproc-per-node"], "argument --nproc-per-node/--nproc_per_node: expected one"),
    (["--stall-timout", "5", "x.py"], "(did you mean --stall-timeout?)"),
])
def test_a_usage_error_is_short(argv: list[str], says: str,
                                capsys: pytest.CaptureFixture[str]) -> None:
    lines = _usage_error(argv, capsys)
    assert says in lines[1]
    assert "--rdzv-backend" not in "\n".join(lines)  # no torchrun usage block


def test_a_misspelt_reactor_attribute_gets_a_suggestion() -> None:
    with pytest.raises(ValueError, match="has no attribute 'alwys_restart'") as exc:
        load_reactor("tests.jobs.reactors:alwys_restart")
    text = str(exc.value)
    assert "(did you mean 'always_restart'?)" in text
    listed = text.split("its callables: ")[1].split(", ")
    assert {"always_restart", "broken", "exit_3_is_fatal"} <= set(listed), text
    assert "Decision" not in listed and "WorkerExit" not in listed  # imported there


def test_did_you_mean() -> None:
    assert did_you_mean("stop_on_nna", ["stop_on_nan", "broken"]) == (
        " (did you mean 'stop_on_nan'?)")
    assert did_you_mean("zzz", ["stop_on_nan"]) == ""


def test_a_bad_reactor_on_the_command_line_is_three_lines(tmp_path: Path) -> None:
    """The real command: exit 2, three lines on stderr, nothing started."""
    done = run_command([sys.executable, "-m", "eventbus", "run", "--reactor",
                        "tests.jobs.reactors:alwys_restart", "--standalone", "x.py"],
                       cwd=tmp_path, timeout=120)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 3, done.stderr
    assert lines[0] == "usage: eventbus run [options] SCRIPT ..."
    assert "did you mean 'always_restart'?" in lines[1]
