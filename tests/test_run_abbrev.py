"""`eventbus run` takes torchrun's abbreviated options (any unique prefix) before SCRIPT, as
torchrun does; after SCRIPT every word is the script's, a prefix of an option included;
an ambiguous prefix before SCRIPT is a usage error that names the options it could be."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("torch")

from eventbus.app.launcher.cli import abbrev
from eventbus.app.launcher.command import build_parser


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    return build_parser()


def test_torchrun_takes_the_abbreviations_eventbus_takes() -> None:
    """The reference: torchrun's own parser reads --redirect=3 as --redirects=3."""
    from torch.distributed.run import get_args_parser

    args = get_args_parser().parse_args(["--redirect=3", "--tee", "3", "x.py"])
    assert (args.redirects, args.tee) == ("3", "3")


@pytest.mark.parametrize(("argv", "field", "value"), [
    (["--redirect=3", "x.py"], "redirects", "3"),            # torchrun's, with =
    (["--te", "3", "x.py"], "tee", "3"),                     # torchrun's, value apart
    (["--nproc", "2", "x.py"], "nproc_per_node", "2"),       # one option, two spellings
    (["--max-re=4", "x.py"], "max_restarts", 4),
    (["--stall-t", "off", "x.py"], "stall_timeout", None),    # eventbus's own
    (["--drain-e", "80", "x.py"], "drain_exit_code", 80),
    (["--log-ev", "x.py"], "log_events", True),              # a flag
])
def test_a_unique_prefix_before_script_is_the_option(
        parser: argparse.ArgumentParser, argv: list[str], field: str, value: object) -> None:
    args = parser.parse_args(argv)
    assert getattr(args, field) == value
    assert (args.training_script, args.training_script_args) == ("x.py", [])


def test_the_words_after_script_are_the_scripts_even_prefixes_of_options(
        parser: argparse.ArgumentParser) -> None:
    """--redirect (unique prefix of torchrun's --redirects), --stall and --bad-host
    (ambiguous prefixes of eventbus's), --nproc=9: all the script's, unchanged, and the
    launcher's own values stay what was given before SCRIPT."""
    script_args = ["--redirect=1", "--stall", "3", "--bad-host", "--nproc=9", "--", "-r3"]
    args = parser.parse_args(["--redirect", "3", "--nproc", "2", "train.py", *script_args])
    assert args.training_script == "train.py"
    assert args.training_script_args == script_args
    assert (args.redirects, args.nproc_per_node, args.stall_timeout) == ("3", "2", "auto")


def test_a_value_that_looks_like_an_option_name_is_not_taken_for_script(
        parser: argparse.ArgumentParser) -> None:
    """The value of an abbreviated option is skipped: SCRIPT is the word after it."""
    args = parser.parse_args(["--rdzv-i", "abc", "--monitor", "-1", "t.py", "--tee=2"])
    assert (args.rdzv_id, args.monitor_interval, args.tee) == ("abc", -1.0, "0")
    assert args.training_script_args == ["--tee=2"]


def test_after_a_double_dash_nothing_is_expanded(parser: argparse.ArgumentParser) -> None:
    assert abbrev.expand(parser, ["--te", "3", "--", "--redirect", "x"]) == [
        "--tee", "3", "--", "--redirect", "x"]


@pytest.mark.parametrize(("argv", "says"), [
    (["--bad-host", "x.py"],
     "ambiguous option: --bad-host could match --bad-host-threshold, --bad-host-exit-code"),
    (["--rdzv=c10d", "x.py"],
     "ambiguous option: --rdzv could match --rdzv-backend, --rdzv-endpoint, --rdzv-id, "
     "--rdzv-conf"),
])
def test_an_ambiguous_prefix_before_script_is_a_usage_error(
        parser: argparse.ArgumentParser, argv: list[str], says: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(argv)
    assert exc.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "usage: eventbus run [options] SCRIPT ..."
    assert lines[1] == f"eventbus run: error: {says}"
    assert "eventbus run --help" in lines[-1]


def test_an_unknown_option_is_still_unrecognized_with_a_hint(
        parser: argparse.ArgumentParser, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parser.parse_args(["--stall-timout", "5", "x.py"])
    assert "unrecognized arguments: --stall-timout (did you mean --stall-timeout?)" in (
        capsys.readouterr().err)
