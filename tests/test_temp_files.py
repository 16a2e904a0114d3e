"""Nothing left behind in $TMPDIR: what `eventbus run` makes there it removes when it ends,
keeping only what docs/run.md ("What a job leaves behind") names: the flight-recorder dumps
that hold evidence and the workers' logs asked for with --redirects/--tee without
--log-dir. And the suite itself runs in a session folder of its own (tests/conftest.py).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from eventbus.app.health.probes import FlightRecorderDumps
from eventbus.app.launcher.group import log_dir
from eventbus.app.launcher.group.log_dir import JobLogDir
from eventbus.app.launcher.group.log_dir import asks_for_logs
from eventbus.app.protocol import agent_worker as protocol
from tests.conftest import SESSION_TMP_ENV
from tests.launcher_helpers import JOB_TIMEOUT_S
from tests.launcher_helpers import job_env
from tests.launcher_helpers import run_command

# -- the flight-recorder folders -----------------------------------------------------------


def _armed(root: Path, attempts: range) -> FlightRecorderDumps:
    dumps = FlightRecorderDumps(str(root))
    for attempt in attempts:
        dumps.arm(attempt, {})
    return dumps


def test_fr_folders_without_a_dump_are_removed_at_the_end(tmp_path: Path) -> None:
    """Each armed attempt's folder, the run's and eventbus-fr go when no dump came (a
    request written and never answered included)."""
    root = tmp_path / "eventbus-fr" / "run1"
    dumps = _armed(root, range(3))
    protocol.write_fr_request(protocol.fr_dump_folder(str(root), 1), "tok")
    assert sorted(os.listdir(root)) == ["attempt0", "attempt1", "attempt2"]
    dumps.close()
    assert os.listdir(tmp_path) == []


def test_a_dump_is_evidence_and_stays(tmp_path: Path) -> None:
    """The attempt whose folder holds a dump keeps it whole (request included); the others
    go; the run's folder stays around the kept one."""
    root = tmp_path / "eventbus-fr" / "run1"
    dumps = _armed(root, range(2))
    folder = protocol.fr_dump_folder(str(root), 1)
    protocol.write_fr_request(folder, "tok")
    Path(protocol.fr_dump_path(folder, 3)).write_bytes(b"trace")
    dumps.close()
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        "eventbus-fr", "eventbus-fr/run1", "eventbus-fr/run1/attempt1",
        "eventbus-fr/run1/attempt1/fr_trace_rank_3", "eventbus-fr/run1/attempt1/request"]


def test_a_file_of_another_kind_keeps_its_folder_and_another_run_is_untouched(
        tmp_path: Path) -> None:
    """Only the protocol's own files are removed: a folder with anything else stays, and
    another run's folder (another agent's) is never touched, nor eventbus-fr while it has
    one."""
    root = tmp_path / "eventbus-fr" / "run1"
    other = tmp_path / "eventbus-fr" / "run2" / "attempt0"
    other.mkdir(parents=True)
    dumps = _armed(root, range(1))
    (root / "attempt0" / "notes.txt").write_text("mine")
    dumps.close()
    assert (root / "attempt0" / "notes.txt").exists() and other.is_dir()
    _armed(root, range(1)).close()  # closing twice, or with nothing made, never raises
    FlightRecorderDumps(None).close()


# -- the workers' log folder ---------------------------------------------------------------


@pytest.mark.parametrize(("redirects", "tee", "asks"), [
    ("0", "0", False), ("3", "0", True), ("0", "1", True), ("0:0,1:0", "0", False),
    ("0:0,1:2", "0", True), ("bad", "0", True)])
def test_which_settings_ask_for_log_files(redirects: str, tee: str, asks: bool) -> None:
    assert asks_for_logs(redirects, tee) is asks


@pytest.fixture
def temp_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def _args(**given: object) -> argparse.Namespace:
    values: dict[str, object] = {"log_dir": None, "logs_specs": None, "redirects": "0",
                                 "tee": "0"}
    values.update(given)
    return argparse.Namespace(**values)


def test_the_log_folder_is_made_handed_to_torch_and_removed(temp_root: Path) -> None:
    args = _args()
    made = JobLogDir.for_job(args)
    assert made is not None and args.log_dir == made.path and not made.keep
    assert Path(made.path).parent == temp_root
    assert Path(made.path).name.startswith(log_dir.PREFIX)
    Path(made.path, "run_x", "attempt_0", "1").mkdir(parents=True)  # no worker failed
    made.close()
    assert os.listdir(temp_root) == []


def test_a_workers_error_file_is_kept_where_the_failure_table_names_it(
        temp_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    made = JobLogDir.for_job(_args())
    assert made is not None
    error_file = Path(made.path, "run_x", "attempt_0", "1", "error.json")
    error_file.parent.mkdir(parents=True)
    error_file.write_text("{}")
    made.close()
    assert error_file.read_text() == "{}"
    assert capsys.readouterr().err == ""  # the failure table names it: no line of its own


def test_logs_asked_for_are_kept_and_named(temp_root: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    made = JobLogDir.for_job(_args(redirects="3"))
    assert made is not None and made.keep
    log = Path(made.path, "run_x", "attempt_0", "0", "stdout.log")
    log.parent.mkdir(parents=True)
    log.write_text("hi\n")
    made.close()
    assert log.read_text() == "hi\n"
    assert f"the workers' logs are kept in {made.path}" in capsys.readouterr().err
    empty = JobLogDir.for_job(_args(tee="3"))  # no worker started: nothing to keep
    assert empty is not None
    empty.close()
    assert os.listdir(temp_root) == [Path(made.path).name]


@pytest.mark.parametrize("given", [{"log_dir": "/some/where"}, {"logs_specs": "mine"}])
def test_a_folder_or_logs_specs_of_the_user_is_left_alone(
        temp_root: Path, given: dict[str, str]) -> None:
    args = _args(**given)
    assert JobLogDir.for_job(args) is None
    assert args.log_dir == given.get("log_dir") and os.listdir(temp_root) == []


# -- the suite's own temp folder ------------------------------------------------------------


def test_the_session_runs_in_a_temp_folder_of_its_own(tmp_path: Path) -> None:
    """$TMPDIR of the tests and their subprocesses is the session's folder (removed at the
    end: tests/conftest.py); pytest's tmp_path stays outside it, where pytest keeps it."""
    session = os.environ[SESSION_TMP_ENV]
    assert tempfile.gettempdir() == session == os.environ["TMPDIR"]
    assert Path(session).name.startswith("eventbus-tests-")
    assert not tmp_path.is_relative_to(session)
    child = subprocess.run([sys.executable, "-c", "import tempfile; print(tempfile.gettempdir())"],
                           capture_output=True, text=True, timeout=30, check=True)
    assert child.stdout.strip() == session


# -- the guard: real jobs ---------------------------------------------------------------------

OK = "print('done')\n"
FAIL = "import os\nif os.environ['LOCAL_RANK'] == '1':\n    raise SystemExit(3)\n"
RAISE = "import os\nif os.environ['LOCAL_RANK'] == '1':\n    raise RuntimeError('a bug')\n"
HOLD = ("import os, pathlib, time\n"
        "pathlib.Path(os.environ['READY_DIR'], os.environ['LOCAL_RANK']).touch()\n"
        "time.sleep(120)\n")


def _left(tmp: Path) -> list[str]:
    return sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*"))


@pytest.mark.slow
@pytest.mark.parametrize(("script", "extra", "code"), [
    (OK, [], 0), (FAIL, [], 1), (HOLD, ["--drain-grace", "1"], 75),
    (OK, ["--redirects", "3"], 0), (RAISE, [], 1)],
    ids=["success", "failure", "sigterm-drain", "redirects", "error-file"])
def test_a_job_leaves_its_tmpdir_as_the_docs_say(
        tmp_path: Path, script: str, extra: list[str], code: int) -> None:
    """A real two-worker `eventbus run` (the default stall watch on: its stack folder,
    flight-recorder folders and exit ledgers made) with $TMPDIR a fresh folder: empty after
    a success, a failure without an error file and a SIGTERM's drain; with --redirects only
    torch's log folder, holding the logs, and after an uncaught exception only its error
    file, each named on the console."""
    tmp = tmp_path / "tmp"
    ready = tmp_path / "ready"
    tmp.mkdir()
    ready.mkdir()
    (tmp_path / "job.py").write_text(script)
    env = {**job_env(), "TMPDIR": str(tmp), "READY_DIR": str(ready)}
    cmd = [sys.executable, "-m", "eventbus", "run", *extra, "--standalone",
           "--nproc-per-node", "2", "--monitor-interval", "0.1", "job.py"]
    if script is HOLD:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            deadline = time.monotonic() + JOB_TIMEOUT_S
            while len(os.listdir(ready)) < 2:
                assert time.monotonic() < deadline and proc.poll() is None, "no start"
                time.sleep(0.1)
            proc.send_signal(signal.SIGTERM)
            _, stderr = proc.communicate(timeout=JOB_TIMEOUT_S)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        returncode = proc.returncode
    else:
        done = run_command(cmd, cwd=tmp_path, env=env)
        returncode, stderr = done.returncode, done.stderr
    assert returncode == code, stderr[-3000:]
    left = _left(tmp)
    if script is RAISE:  # the error file the failure table names stays, and only it
        (kept,) = [name for name in left if "/" not in name]
        assert [name for name in left if name.endswith("error.json")] and all(
            Path(tmp, name).is_dir() or name.endswith("error.json") for name in left), left
        assert f"error_file: {tmp / kept}/" in stderr, stderr[-3000:]
        return
    if "--redirects" not in extra:
        assert left == [], stderr[-3000:]
        return
    (kept,) = [name for name in left if "/" not in name]
    assert kept.startswith(log_dir.PREFIX)
    assert f"the workers' logs are kept in {tmp / kept}" in stderr
    stdouts = [tmp / name for name in left if name.endswith("/stdout.log")]
    assert len(stdouts) == 2 and all(p.read_text() == "done\n" for p in stdouts)
