"""Every code example of README.md and docs/*.md runs, and prints what it promises.

How a page is read:

* each ```python block is one example. It runs alone, as a script in a fresh interpreter
  (cwd: a temporary directory, PYTHONPATH: the repository root), and must exit 0. Every
  ``# -> TEXT`` comment in it is a line it promises to print (stdout or stderr); ``...``
  in TEXT matches anything.
* an HTML comment on the line before a block tunes it: ``<!-- test: WORD ... -->`` with
  ``file=NAME`` (the block is saved as NAME; every ``file=`` block of the page is written
  into the working directory of each of the page's examples, so a later block or command
  can import it), ``slow`` (the example needs a whole torchrun job: a ``pytest.mark.slow``
  test), ``cmd='COMMAND'`` (run COMMAND instead of ``python NAME``; ``python`` is this
  interpreter) and, on a shell block, ``run`` (run its commands, each must exit 0).
* the working directory also holds a small ``train.py`` (it records an epoch) for the jobs
  the examples launch.
* ```bash, ```sh and ```console blocks document commands. Every ``eventbus`` or
  ``python -m eventbus`` command line in them must name an existing subcommand whose
  parser accepts the line, and every ``make`` target must exist in the Makefile.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any
from typing import NamedTuple

import pytest

from tests.conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(
    r"(?:<!--\s*test:(?P<marker>[^>]*?)-->\s*\n)?^```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^```",
    flags=re.S | re.M)

SHELL_LANGS = ("bash", "sh", "shell", "console")

#: the training script of the jobs the examples launch
TRAIN_PY = """\
import eventbus
eventbus.record(eventbus.EventType.EPOCH_START, epoch=0)
eventbus.record(eventbus.EventType.EPOCH_END, epoch=0)
print("trained", flush=True)
"""

#: seconds an example may take: a fresh interpreter, or a whole 2-worker torchrun job
TIMEOUT_S = 120
SLOW_TIMEOUT_S = 300


class Block(NamedTuple):
    """One fenced block of a page."""

    page: Path
    line: int
    lang: str
    body: str
    options: dict[str, str]

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _options(marker: str | None) -> dict[str, str]:
    options: dict[str, str] = {}
    for word in shlex.split(marker or ""):
        key, _, value = word.partition("=")
        options[key] = value
    return options


def _blocks(page: Path) -> list[Block]:
    text = page.read_text()
    return [Block(page, text.count("\n", 0, m.start("lang")) + 1, m["lang"], m["body"],
                  _options(m["marker"]))
            for m in FENCE.finditer(text)]


ALL_BLOCKS = [block for page in PAGES for block in _blocks(page)]
PYTHON_BLOCKS = [b for b in ALL_BLOCKS if b.lang == "python"]
RUN_BLOCKS = [b for b in ALL_BLOCKS
              if b.lang == "python" or (b.lang in SHELL_LANGS and "run" in b.options)]
SHELL_BLOCKS = [b for b in ALL_BLOCKS if b.lang in SHELL_LANGS]


def _params(blocks: list[Block]) -> list[Any]:
    return [pytest.param(b, id=b.id, marks=[pytest.mark.slow] if "slow" in b.options else [])
            for b in blocks]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("EVENTBUS_", "TORCHELASTIC_", "PYTEST_"))}
    env["PYTHONPATH"] = str(ROOT)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _commands(block: Block) -> list[str]:
    """The command lines of a shell block (continuation lines joined; in a console block,
    only the lines after a ``$`` prompt)."""
    commands: list[str] = []
    pending = ""
    for raw in block.body.splitlines():
        line = raw.strip()
        if not pending:
            if block.lang == "console":
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            if not line or line.startswith("#"):
                continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        commands.append(pending + line)
        pending = ""
    return commands


def _prepare(block: Block, cwd: Path) -> list[str]:
    """Write the page's files and train.py into cwd; the argv that runs ``block``."""
    (cwd / "train.py").write_text(TRAIN_PY)
    for other in _blocks(block.page):
        if "file" in other.options:
            (cwd / other.options["file"]).write_text(other.body)
    name = block.options.get("file") or "example.py"
    if block.lang == "python":
        (cwd / name).write_text(block.body)
    command = block.options.get("cmd") or f"python {name}"
    argv = shlex.split(command)
    return [sys.executable if argv[0] == "python" else argv[0], *argv[1:]]


def _check_promises(body: str, printed: str) -> None:
    for promised in re.findall(r"# -> (.+)", body):
        pattern = re.escape(promised.strip()).replace(r"\.\.\.", ".*")
        assert re.search(pattern, printed), f"promised {promised!r}, printed:\n{printed}"


def _run(argv: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, env=_env(), cwd=cwd,
                          timeout=timeout, check=False)


def test_every_page_has_examples() -> None:
    """README.md and every manual page are found, and the README shows runnable examples."""
    names = {p.name for p in PAGES}
    assert {"README.md", "events.md", "logging.md", "run.md", "across-processes.md",
            "seeing-the-job.md", "guarantees.md", "performance.md",
            "architecture.md"} <= names
    assert len([b for b in PYTHON_BLOCKS if b.page.name == "README.md"]) >= 3


@pytest.mark.parametrize("block", _params(RUN_BLOCKS))
def test_example_runs(block: Block, tmp_path: Path) -> None:
    """The example runs alone in a fresh interpreter, exits 0 and prints what it promises."""
    timeout = SLOW_TIMEOUT_S if "slow" in block.options else TIMEOUT_S
    if block.lang == "python":
        proc = _run(_prepare(block, tmp_path), tmp_path, timeout)
        assert proc.returncode == 0, f"{block.id}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        _check_promises(block.body, proc.stdout + proc.stderr)
        return
    _prepare(block, tmp_path)
    for command in _commands(block):
        argv = shlex.split(command, comments=True)
        if argv[0] == "python":
            argv[0] = sys.executable
        if argv[0] == "eventbus":
            argv[:1] = [sys.executable, "-m", "eventbus"]
        proc = _run(argv, tmp_path, timeout)
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


#: where each subcommand's parser is built
PARSER_MODULES = {
    "run": "eventbus.app.launcher.command",
    "trace": "eventbus.app.readers.trace",
    "plot": "eventbus.app.readers.timeline",
    "tail": "eventbus.app.readers.tail",
}


def _parser_of(subcommand: str) -> argparse.ArgumentParser | None:
    if subcommand not in PARSER_MODULES:
        return None
    module = importlib.import_module(PARSER_MODULES[subcommand])
    for name in ("build_parser", "_parser"):
        factory = getattr(module, name, None)
        if callable(factory):
            parser = factory()
            if isinstance(parser, argparse.ArgumentParser):
                return parser
    return None


def _eventbus_argv(command: str) -> list[str] | None:
    """The arguments after ``eventbus`` in a command line, or None if it runs no eventbus."""
    argv = shlex.split(command, comments=True)
    for start in range(len(argv)):
        if argv[start] == "eventbus":
            return argv[start + 1:]
        if argv[start:start + 3] in (["python", "-m", "eventbus"], ["python3", "-m", "eventbus"]):
            return argv[start + 3:]
    return None


def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([\w-]+):", text, flags=re.M))


@pytest.mark.parametrize("block", _params(SHELL_BLOCKS))
def test_command_lines_parse(block: Block) -> None:
    """Every eventbus command line in a shell block names a subcommand whose parser accepts
    it, and every make target it names exists."""
    commands = importlib.import_module("eventbus.app.cli").COMMANDS
    for command in _commands(block):
        words = shlex.split(command, comments=True)
        if words[:1] == ["make"]:
            assert set(w for w in words[1:] if "=" not in w) <= _make_targets(), command
            continue
        args = _eventbus_argv(command)
        if args is None:
            continue
        assert args and args[0] in commands, f"{block.id}: no subcommand in {command!r}"
        parser = _parser_of(args[0])
        if parser is None:  # a subcommand without a parser factory: --help must work
            proc = _run([sys.executable, "-m", "eventbus", args[0], "--help"], ROOT, TIMEOUT_S)
            assert proc.returncode == 0, proc.stderr
            continue
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            try:
                parser.parse_args(args[1:])
            except SystemExit as exc:
                assert exc.code == 0, f"{block.id}: {command!r}: {stderr.getvalue()}"


def test_no_page_names_a_file_outside_the_repository() -> None:
    """No page cites a file outside the repository nor a row of a matrix it does not hold."""
    for page in PAGES:
        text = page.read_text()
        for needle in ("shared/", "RELIABILITY", "PERFORMANCE.md", "API.md", "DESIGN.md"):
            assert needle not in text, f"{page.name} names {needle!r}"
        assert not re.search(r"\brows? \d+", text), f"{page.name} cites a matrix row"


def _resolves(dotted: str) -> bool:
    """``dotted`` is a module of ours, or an attribute reached from one."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            if not hasattr(found, name):
                return False
            found = getattr(found, name)
        return True
    return False


def test_benchmark_results_name_only_what_exists() -> None:
    """benchmarks/RESULTS.md (which `make bench` rewrites, around hand-run sections) names
    no file and no module that is gone: every `*.py` it cites is in the repository, every
    dotted `eventbus.` name imports."""
    text = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    roots = ("", "benchmarks/", "tests/", "tests/jobs/", "eventbus/", "eventbus_app/")
    files = set(re.findall(r"(?<![\w/.:-])([\w/]+\.py)\b", text))
    missing = [f for f in sorted(files)
               if f != "train.py"  # a stack's frame in a sample sentence, not a file of ours
               and not any((ROOT / (root + f)).is_file() for root in roots)]
    assert missing == []
    names = set(re.findall(r"(?<![\w.])(eventbus(?:\.[A-Za-z_]\w*)+)", text))
    assert names and [n for n in sorted(names) if not _resolves(n)] == []


def test_links_between_pages_resolve() -> None:
    """Every relative link of a page points at a file of the repository."""
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"


# -- the demo's transcript (docs/demo.md) against a real run ---------------------------------

#: the job's own events (lifecycle, epochs, checkpoints, metrics) may differ from the
#: demo page's by this many: a METRIC or two is logged, or not, before rank 1's crash stops
#: the group
OWN_EVENTS_TOLERANCE = 4
#: torch's records (one per rendezvous step and worker state, plus keep-alives) are about
#: the same in every run and grow with a longer one; the heartbeats are at most about one a
#: second per rank. Neither scales linearly (a 13 s run: 30 and 15; a 99 s one under load:
#: 66 and 46), so the check is a range: from PERIODIC_TOLERANCE of the page's count below
#: it to (1 + PERIODIC_TOLERANCE) x the page's scaled by the runs' durations above it
PERIODIC_TOLERANCE = 0.5

_FIGURES = re.compile(
    r"Of\s+those\s+(?P<total>\d+)\s+events,\s+(?P<own>\d+)\s+are\s+the\s+job's\s+own.*?"
    r"(?P<torch>\d+)\s+are\s+torch's\s+own\s+`TORCHELASTIC`\s+records.*?"
    r"(?P<beats>\d+)\s+are\s+the\s+workers'\s+`WORKER_PROGRESS`\s+heartbeats", re.S)


#: the page with the demo's transcript (the README links to it)
DEMO_PAGE = ROOT / "docs" / "demo.md"


def _readme_demo() -> dict[str, int]:
    """The figures of the demo's transcript (docs/demo.md): its event count and duration
    (from the transcript's own lines) and the breakdown stated under it."""
    section = DEMO_PAGE.read_text()
    transcript = next(b.body for b in _blocks(DEMO_PAGE)
                      if b.lang == "text" and "$ make demo" in b.body)
    total = re.search(r"^  events\.jsonl +(\d+) events", transcript, re.M)
    took = re.search(r"^demo: finished in (\d+) s", transcript, re.M)
    figures = _FIGURES.search(section)
    assert total and took and figures, "the demo's transcript lost its figures"
    out = {k: int(v) for k, v in figures.groupdict().items()}
    assert out["total"] == int(total.group(1)), "the breakdown's total is not the transcript's"
    assert out["own"] + out["torch"] + out["beats"] == out["total"], out
    assert "--sink tensorboard:demo-out/tb" in transcript
    assert re.search(r"^  tb +TensorBoard: tensorboard --logdir demo-out/tb", transcript, re.M)
    return {**out, "seconds": int(took.group(1))}


def test_readme_demo_figures_add_up() -> None:
    """The transcript's event count is the sum of the breakdown stated under it, and the
    transcript shows the TensorBoard sink and its line (a fast check of the page alone)."""
    _readme_demo()


@pytest.mark.slow
def test_readme_demo_transcript_matches_a_real_run(tmp_path: Path) -> None:
    """A real `make demo` run (examples/demo.py) against the figures of docs/demo.md: the
    job's own events within OWN_EVENTS_TOLERANCE, torch's records and the heartbeats within
    the range PERIODIC_TOLERANCE gives (see there), and the same
    lines (the command with --sink tensorboard, the tb line)."""
    from eventbus.subscribers.jsonl import read_jsonl

    readme = _readme_demo()
    out = tmp_path / "demo-out"
    proc = _run([sys.executable, str(ROOT / "examples" / "demo.py"), "--out", str(out)],
                tmp_path, SLOW_TIMEOUT_S)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    printed = proc.stdout + proc.stderr
    took = re.search(r"^demo: finished in (\d+) s", printed, re.M)
    total = re.search(r"^  events\.jsonl +(\d+) events", printed, re.M)
    assert took and total, printed[-3000:]
    assert "--sink tensorboard:" in printed and re.search(r"^  tb +TensorBoard:", printed, re.M)
    events = list(read_jsonl(out / "events.jsonl"))
    assert len(events) == int(total.group(1))
    torch_records = sum(1 for e in events if e.get("type") == "TORCHELASTIC")
    beats = sum(1 for e in events if e.get("type") == "WORKER_PROGRESS")
    own = len(events) - torch_records - beats
    print(f"demo: {len(events)} events in {took.group(1)} s ({own} own, {torch_records} "
          f"torch, {beats} heartbeats); docs/demo.md: {readme['total']} in "
          f"{readme['seconds']} s")
    assert abs(own - readme["own"]) <= OWN_EVENTS_TOLERANCE, (own, readme)
    longer = max(1.0, int(took.group(1)) / max(readme["seconds"], 1))
    top = 1 + PERIODIC_TOLERANCE
    assert (PERIODIC_TOLERANCE * readme["torch"] - 10 <= torch_records
            <= top * readme["torch"] * longer + 10), (torch_records, readme, longer)
    assert 0 < beats <= top * readme["beats"] * longer + 10, (beats, readme, longer)
