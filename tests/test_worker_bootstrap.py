"""eventbus.app.worker: the bootstrap every worker of `eventbus run` starts through runs
the script as `python SCRIPT` would, and a bad EVENTBUS_* variable is one warning."""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from eventbus.app.worker import BOOTSTRAP_MODULE
from eventbus.app.worker import bootstrap_args
from tests.conftest import WORKER
from tests.conftest import subprocess_env
from tests.launcher_helpers import run_command

#: prints what a script sees of its own start, then ends as argv[1] says
SCRIPT = textwrap.dedent("""
    import json, os, sys
    def fail():
        raise ValueError("boom from the script")
    print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "file": __file__,
                      "name": __name__, "main": sys.modules["__main__"].__dict__ is globals(),
                      "spec": __spec__ is None}))
    how = sys.argv[1] if len(sys.argv) > 1 else "ok"
    if how == "raise":
        fail()
    if how == "exit":
        sys.exit(int(sys.argv[2]))
    if how == "exit-text":
        sys.exit("a message for stderr")
    if how == "interrupt":
        raise KeyboardInterrupt
    if how == "hook":
        sys.excepthook = lambda t, v, tb: print("own hook:", t.__name__, v, file=sys.stderr)
        fail()
""")


def _both(tmp_path: Path, args: list[str], *, cwd: Path | None = None,
          env: dict[str, str] | None = None
          ) -> tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str]]:
    """The same command line run by plain python and through the bootstrap."""
    def run(prefix: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*prefix, *args], cwd=cwd or tmp_path, capture_output=True,
                              text=True, env=env or subprocess_env(), timeout=60,
                              check=False)

    return run([sys.executable]), run(list(WORKER))


@pytest.fixture
def script(tmp_path: Path) -> Path:
    """A script two folders down, so that sys.path[0] and argv[0] tell the ways apart."""
    path = tmp_path / "pkg" / "sub" / "train.py"
    path.parent.mkdir(parents=True)
    path.write_text(SCRIPT)
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "sub" / "__init__.py").write_text("")
    return path


@pytest.mark.parametrize("how", [["ok"], ["exit", "3"], ["exit", "0"], ["exit-text"],
                                 ["raise"], ["hook"], ["interrupt"]])
def test_a_script_runs_as_python_would_run_it(tmp_path: Path, script: Path,
                                              how: list[str]) -> None:
    """Through the bootstrap a script sees the same sys.argv, sys.path[0], __file__ and
    __main__, ends with the same exit code, and an uncaught exception prints the same
    traceback (the script's frames only) or goes to the script's own sys.excepthook."""
    plain, booted = _both(tmp_path, ["pkg/sub/train.py", *how])
    assert booted.stdout == plain.stdout
    assert json.loads(booted.stdout)["path0"] == str(script.parent)
    assert booted.returncode == plain.returncode
    if how[0] == "interrupt":
        assert booted.returncode == -signal.SIGINT
        assert booted.stderr.endswith("KeyboardInterrupt\n")
    else:
        assert booted.stderr == plain.stderr


def test_the_module_form_runs_as_python_dash_m(tmp_path: Path, script: Path) -> None:
    """torchrun's ``-m MODULE`` form: the same sys.argv (the module's file first), the
    same sys.path[0] (the working directory), __spec__, exit code and stderr, traceback
    included; a missing module and a package without __main__ are python's one line."""
    for how in (["ok"], ["exit", "5"], ["raise"], ["exit-text"]):
        plain, booted = _both(tmp_path, ["-m", "pkg.sub.train", *how])
        assert (booted.stdout, booted.stderr, booted.returncode) == \
            (plain.stdout, plain.stderr, plain.returncode), how
    for missing in ("pkg.nowhere", "pkg.sub"):
        plain, booted = _both(tmp_path, ["-m", missing])
        assert (booted.stderr, booted.returncode) == (plain.stderr, 1), missing
        assert booted.stderr.count("\n") == 1


def test_the_code_form_a_broken_and_a_missing_script(tmp_path: Path) -> None:
    """``-c CODE`` runs with sys.argv[0] == "-c"; a script with a syntax error prints
    python's own message, no traceback; a missing script is exit code 2 with python's
    own message, before anything is attached."""
    plain, booted = _both(tmp_path, ["-c", "import sys; print(sys.argv); sys.exit(4)", "a"])
    assert (booted.stdout, booted.returncode) == (plain.stdout, plain.returncode) == \
        ("['-c', 'a']\n", 4)
    (tmp_path / "broken.py").write_text("x = (\n")
    plain, booted = _both(tmp_path, ["broken.py"])
    assert (booted.stderr, booted.returncode) == (plain.stderr, plain.returncode)
    assert "SyntaxError" in booted.stderr and "Traceback" not in booted.stderr
    plain, booted = _both(tmp_path, ["no_such_script.py"])
    assert booted.returncode == plain.returncode == 2
    assert "can't open file" in booted.stderr and "no_such_script.py" in booted.stderr


@pytest.mark.parametrize(("args", "expected"), [
    (("-u", "train.py", "--lr", "1"), ("-u", "-m", BOOTSTRAP_MODULE, "train.py", "--lr", "1")),
    (("-u", "-m", "pkg.train", "-x"), ("-u", "-m", BOOTSTRAP_MODULE, "-m", "pkg.train", "-x")),
    (("train.py",), ("-m", BOOTSTRAP_MODULE, "train.py")),
    (("-u", "-m", BOOTSTRAP_MODULE, "t.py"), ("-u", "-m", BOOTSTRAP_MODULE, "t.py")),
    (("-W", "ignore", "t.py"), ("-W", "ignore", "-m", BOOTSTRAP_MODULE, "t.py")),
    (("-uW", "ignore", "-Xdev", "t.py"),
     ("-uW", "ignore", "-Xdev", "-m", BOOTSTRAP_MODULE, "t.py")),
    (("-X", "dev", "-u", "-m", "p"), ("-X", "dev", "-u", "-m", BOOTSTRAP_MODULE, "-m", "p")),
    (("-uc", "print(1)"), ("-u", "-m", BOOTSTRAP_MODULE, "-c", "print(1)")),
])
def test_the_agent_puts_the_bootstrap_after_the_interpreter_options(
        args: tuple[str, ...], expected: tuple[str, ...]) -> None:
    """The worker's command line: python's own options first (``-W`` and ``-X`` with
    their values, a ``-uc`` cluster split), then ``-m eventbus.app.worker``, then the
    script or ``-m MODULE`` as torchrun wrote them; a command line that already starts
    through the bootstrap is left as it is."""
    assert bootstrap_args(args) == expected


def _program(*args: str) -> str:
    return " ".join(args)


def test_the_agent_bootstraps_python_workers_and_says_what_no_python_needs(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Python entry point (torchrun's own, or `--no-python python ...`) gets the
    bootstrap; a function entry point is wrapped in run_attached; any other program is
    left as it is, with one warning that says what it needs to forward events."""
    from types import SimpleNamespace

    from eventbus.app.launcher.agent import _start_through_bootstrap
    from eventbus.app.worker import run_attached

    torchrun = SimpleNamespace(entrypoint=sys.executable, args=("-u", "train.py"))
    named = SimpleNamespace(entrypoint="python3", args=("train.py", "--lr", "1"))
    function = SimpleNamespace(entrypoint=_program, args=("a", "b"))
    other = SimpleNamespace(entrypoint="/bin/sh", args=("run.sh",))
    with caplog.at_level("WARNING", logger="eventbus"):
        for spec in (torchrun, named, function, other):
            _start_through_bootstrap(spec)
    assert named.args == ("-m", BOOTSTRAP_MODULE, "train.py", "--lr", "1")
    assert (function.entrypoint, function.args) == (run_attached, (_program, "a", "b"))
    _start_through_bootstrap(function)  # a second agent on the same spec wraps nothing more
    _start_through_bootstrap(torchrun)
    assert (function.entrypoint, function.args) == (run_attached, (_program, "a", "b"))
    assert torchrun.args == ("-u", "-m", BOOTSTRAP_MODULE, "train.py")
    for variable in ("EVENTBUS_AGENT_STORE", "EVENTBUS_STACK_DIR"):  # attach nothing here
        monkeypatch.delenv(variable, raising=False)
    assert run_attached(*function.args) == "a b"
    assert (other.entrypoint, other.args) == ("/bin/sh", ("run.sh",))
    (warning,) = caplog.records
    assert "/bin/sh" in warning.getMessage() and "attach()" in warning.getMessage()


# -- every variable the bootstrap reads, each with bad values ---------------------------


@pytest.fixture(scope="module")
def store() -> Iterator[Any]:
    """A real TCPStore for the cases whose forwarder attaches (a bad optional variable)."""
    torch_dist = pytest.importorskip("torch.distributed")
    yield torch_dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=10))


def _not_a_dir(tmp: Path) -> str:
    (tmp / "a-file").write_text("")
    return str(tmp / "a-file")


#: variable -> the bad values it is tried with (functions of a scratch folder)
BAD: dict[str, list[Callable[[Path], str]]] = {
    "EVENTBUS_AGENT_STORE": [lambda t: "bogus", lambda t: "127.0.0.1:99999",
                             lambda t: ":29500", lambda t: "127.0.0.1:http"],
    "EVENTBUS_STORE_PREFIX": [lambda t: "eventbus/../../etc", lambda t: "x" * 600,
                              lambda t: "bad\x01key"],
    "RANK": [lambda t: "x", lambda t: "-1", lambda t: str(2**40)],
    "EVENTBUS_LEDGER_DIR": [lambda t: "relative/attempt-0", lambda t: str(t / "attempt-0"),
                            lambda t: "/nonexistent/eventbus-ledgers-x/attempt-0"],
    "EVENTBUS_STORE_BELL": [lambda t: "../../x", lambda t: "x" * 600, lambda t: "a\nb"],
    "EVENTBUS_STACK_DIR": [lambda t: "stacks", lambda t: str(t / "missing"), _not_a_dir],
    "EVENTBUS_STACK_SIGNAL": [lambda t: "SIGBOGUS", lambda t: "99999", lambda t: "SIGKILL",
                              lambda t: "SIGRTMIN+x"],
}


#: a bad value of these still lets the forwarder attach to the store, so each of their
#: 3-4 processes pushes and flushes at its exit (4-8 s a variable on 2 cores): in
#: `make test-slow`; the fast loop keeps the variables whose bad value stops the attach,
#: and the in-process checks of the ledger folder, the doorbell and the stack dump
#: (test_exit_ledger.py, test_a_stack_dump_that_cannot_start_is_one_warning)
ATTACHING = {"EVENTBUS_LEDGER_DIR", "EVENTBUS_STACK_DIR", "EVENTBUS_STACK_SIGNAL",
             "EVENTBUS_STORE_BELL"}


@pytest.mark.parametrize("variable", [
    pytest.param(v, marks=pytest.mark.slow) if v in ATTACHING else v for v in sorted(BAD)])
def test_a_bad_variable_is_one_warning_and_the_script_runs(
        tmp_path: Path, store: Any, variable: str) -> None:
    """Each bad value of each variable the bootstrap reads: the script runs to its end
    with exit code 0, and stderr holds exactly one warning, which names the variable."""
    good = {"EVENTBUS_AGENT_STORE": f"127.0.0.1:{store.port}",
            "EVENTBUS_STORE_PREFIX": "eventbus/bootstrap-test/0", "RANK": "0",
            "EVENTBUS_STACK_DIR": str(tmp_path)}
    code = "import eventbus; eventbus.record('METRIC', step=1); print('ran')"
    procs = []
    for make in BAD[variable]:
        env = subprocess_env(**{**good, variable: make(tmp_path)})
        procs.append(subprocess.Popen([*WORKER, "-c", code], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert (proc.returncode, out) == (0, "ran\n"), err
        lines = err.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"eventbus: {variable}="), err
        assert "; " in lines[0]  # what is wrong; the fix


def test_a_stack_dump_that_cannot_start_is_one_warning(tmp_path: Path) -> None:
    """A stack directory that cannot be written (read-only for this user, or a file
    system that refuses) is one warning too, never an exception out of the bootstrap."""
    code = textwrap.dedent("""
        import os
        import eventbus.app.worker.stack_dump as sd
        def refuse(directory, signum):
            raise PermissionError(13, "Permission denied", directory)
        sd.arm_stack_dump = refuse
        import eventbus.app.worker as w
        w.arm_stack_dump = refuse
        side = w.attach()
        print(side.stack_file, len(side.warnings))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=subprocess_env(EVENTBUS_STACK_DIR=str(tmp_path)), timeout=60,
                          check=False)
    assert (done.returncode, done.stdout) == (0, "None 1\n"), done.stderr
    assert done.stderr.startswith("eventbus: EVENTBUS_STACK_DIR=")
    assert "Permission denied" in done.stderr


@pytest.mark.slow
def test_eventbus_run_starts_plain_scripts_and_modules_through_the_bootstrap(
        tmp_path: Path) -> None:
    """A job whose script never imports eventbus still gets the worker side (the
    forwarder is attached before the script runs); torchrun's ``-m`` form too."""
    pkg = tmp_path / "plainjob"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(textwrap.dedent("""
        import os, sys
        attached = "eventbus.subscribers.store_forwarder" in sys.modules
        rank = os.environ["RANK"]
        with open(os.path.join(sys.argv[1], f"rank{rank}.txt"), "w") as f:
            f.write(f"{attached} {__name__} {os.path.basename(sys.argv[0])}")
    """))
    for form in (["plainjob/train.py"], ["-m", "plainjob.train"]):
        out = tmp_path / ("out-m" if form[0] == "-m" else "out")
        out.mkdir()
        cmd = [sys.executable, "-m", "eventbus", "run", "--standalone", "--nproc-per-node",
               "2", "--monitor-interval", "0.1", *form, str(out)]
        done = run_command(cmd, cwd=tmp_path, env=subprocess_env(
            PYTHONPATH=os.pathsep.join([str(tmp_path), subprocess_env()["PYTHONPATH"]])))
        assert done.returncode == 0, done.stderr[-3000:]
        seen = sorted(p.read_text() for p in out.glob("rank*.txt"))
        assert seen == ["True __main__ train.py"] * 2, (form, seen)


@pytest.mark.parametrize("how", [["raise"], ["hook"], ["exit", "3"], ["ok"]])
def test_an_uncaught_exception_is_written_to_torchs_error_file(
        tmp_path: Path, script: Path, how: list[str]) -> None:
    """Under torch's agent (TORCHELASTIC_ERROR_FILE set) an uncaught exception is written
    to the error file as torch's @record writes it, and torch's own reader takes its
    message; stderr and the exit code stay plain python's. No exception, no file."""
    pytest.importorskip("torch")
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    plain_file, booted_file = tmp_path / "plain.json", tmp_path / "booted.json"
    plain = subprocess.run(
        [sys.executable, "pkg/sub/train.py", *how], cwd=tmp_path, capture_output=True,
        text=True, timeout=60, check=False,
        env={**subprocess_env(), "TORCHELASTIC_ERROR_FILE": str(plain_file)})
    booted = subprocess.run(
        [*WORKER, "pkg/sub/train.py", *how], cwd=tmp_path, capture_output=True, text=True,
        timeout=60, check=False,
        env={**subprocess_env(), "TORCHELASTIC_ERROR_FILE": str(booted_file)})
    assert (booted.stdout, booted.stderr, booted.returncode) == \
        (plain.stdout, plain.stderr, plain.returncode)
    assert not plain_file.exists()
    if how[0] not in ("raise", "hook"):
        assert not booted_file.exists()
        return
    from eventbus.app.launcher.agent import _failure_message

    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(booted_file))
    assert _failure_message(failure) == "ValueError: boom from the script"  # WORKER_EXIT's
    assert failure.timestamp > 0
    data = json.loads(booted_file.read_text())
    callstack = data["message"]["extraInfo"]["py_callstack"]
    assert "train.py" in callstack and 'in fail' in callstack
    assert "eventbus" not in callstack  # the script's frames only, as printed
    assert list(tmp_path.glob("booted.json.*")) == []  # nothing left aside


def test_a_scripts_own_record_keeps_its_error_file(tmp_path: Path) -> None:
    """A script whose @record wrote the error file keeps that file as it wrote it."""
    pytest.importorskip("torch")
    (tmp_path / "rec.py").write_text(textwrap.dedent("""
        from torch.distributed.elastic.multiprocessing.errors import record
        @record
        def main():
            raise RuntimeError("from the script's own record")
        main()
    """))
    error_file = tmp_path / "error.json"
    done = subprocess.run([*WORKER, "rec.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, check=False,
                          env={**subprocess_env(), "TORCHELASTIC_ERROR_FILE": str(error_file)})
    assert done.returncode == 1
    data = json.loads(error_file.read_text())
    assert data["message"]["message"] == "RuntimeError: from the script's own record"
    assert "record" in data["message"]["extraInfo"]["py_callstack"]  # torch's wrapper frame
