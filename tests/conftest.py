"""Shared fixtures: every test leaves the default bus as it found it."""

from __future__ import annotations

import atexit
import importlib.util
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

import eventbus

ROOT = Path(__file__).resolve().parents[1]

#: the session's temporary folder, $TMPDIR of everything the suite runs: every job's
#: agent, worker and torch temp file, every subprocess's, is made in it, and it is removed
#: at the session's end (the house rule: tests leave nothing behind in /tmp). Made once, by
#: the process that starts the session; pytest-xdist's workers and every subprocess inherit
#: it (and this module, imported again as tests.conftest or by a subprocess, makes none).
#: pytest's own tmp_path folders stay where pytest keeps them (PYTEST_DEBUG_TEMPROOT).
SESSION_TMP_ENV = "EVENTBUS_TEST_SESSION_TMP"
_OWNER_PID = os.getpid() if not os.environ.get(SESSION_TMP_ENV) else None
if _OWNER_PID is not None:
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
    _session_tmp = tempfile.mkdtemp(prefix="eventbus-tests-")
    os.chmod(_session_tmp, 0o1777)  # as /tmp: the test PostgreSQL server runs as its user
    os.environ[SESSION_TMP_ENV] = os.environ["TMPDIR"] = _session_tmp
    tempfile.tempdir = None  # gettempdir() reads $TMPDIR again
    #: every `eventbus run` of the suite records its host's outcomes in a ledger of its
    #: own, never in this machine's default one (docs/hosts.md)
    _ledger_dir = os.path.join(_session_tmp, "host-ledger")
    os.mkdir(_ledger_dir)
    os.environ.setdefault("EVENTBUS_HOST_LEDGER", os.path.join(_ledger_dir, "hosts.sqlite"))
    os.environ.setdefault("EVENTBUS_HOST_LEDGER_SPOOL",
                          os.path.join(_ledger_dir, "spool.jsonl"))
SESSION_TMP = os.environ[SESSION_TMP_ENV]


def _remove_session_tmp() -> None:
    if os.getpid() == _OWNER_PID:  # never a forked child's exit, nor a worker's
        shutil.rmtree(SESSION_TMP, ignore_errors=True)


#: where no session ends (a script that imports this module, a crash), at the exit
atexit.register(_remove_session_tmp)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _remove_session_tmp()


@pytest.fixture
def own_ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The test's default host ledger and spool under its own tmp_path (the ledger's
    default path, not the suite's $EVENTBUS_HOST_LEDGER)."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("EVENTBUS_HOST_LEDGER_SPOOL", str(tmp_path / "spool.jsonl"))
    monkeypatch.delenv("EVENTBUS_HOST_LEDGER", raising=False)


#: how `eventbus run` starts each worker: the worker bootstrap, then the script, the
#: module (-m) or the code (-c) with its arguments
WORKER = (sys.executable, "-m", "eventbus.app.worker")


#: torch is importable here. `make test-pythons` runs the suite on Pythons for which this
#: machine has no torch wheel: there, the rule below leaves out every test module that
#: needs torch (it imports torch or a torch-backed part, or starts workers and jobs that
#: do), names them in the summary, and the torch-free rest runs.
HAS_TORCH = importlib.util.find_spec("torch") is not None
_NEEDS_TORCH = re.compile(
    r"^\s*(import torch|from torch)|launcher_helpers|eventbus.app\.launcher|store_forwarder"
    r"|store_receiver|store_transport|publishers\.torchelastic|publishers import|STORE_SERVER"
    r"|eventbus\.app\.worker|from matrix import|\"run\"|torchelastic|from benchmarks", re.M)
_LEFT_OUT: list[str] = []


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Without torch, leave out the test modules that need it (see HAS_TORCH)."""
    if HAS_TORCH or collection_path.suffix != ".py" or \
            not collection_path.name.startswith("test_"):
        return None
    if _NEEDS_TORCH.search(collection_path.read_text(encoding="utf-8")):
        _LEFT_OUT.append(collection_path.name)
        return True
    return None


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Say which modules the no-torch rule left out, so a smaller run is never silent."""
    if _LEFT_OUT:
        terminalreporter.write_line(f"torch is not installed: {len(_LEFT_OUT)} test modules "
                                    f"that need it were left out: {', '.join(_LEFT_OUT)}")


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for a subprocess that must import this tree's packages."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *filter(None, [env.get("PYTHONPATH")])]
    )
    env.update(extra)
    return env


def _is_default_log_handler(sub: eventbus.Subscription) -> bool:
    owner = getattr(sub.on_event, "__self__", None)
    return type(owner).__name__ == "EventLoggingHandler"


@pytest.fixture(autouse=True)
def _clean_default_bus() -> Iterator[None]:
    """Cancel subscriptions a test left on the default bus (the default log handler stays)."""
    bus = eventbus.get_default_bus()
    before = {id(s) for s in bus.subscriptions()}
    strict = bus.strict
    yield
    bus.strict = strict
    for sub in bus.subscriptions():
        if id(sub) not in before and not _is_default_log_handler(sub):
            sub.cancel()


#: variables an in-process agent puts into os.environ for its workers
_AGENT_ENV_PREFIXES = ("EVENTBUS_", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")


#: what an EventAgent built in-process writes into os.environ for its workers
#: (eventbus_app/launcher/agent.py: _init_health, _arm_fr_dumps, reliable restarts)
AGENT_ENV_KEYS = ("EVENTBUS_STACK_DIR", "EVENTBUS_PROGRESS", "TORCH_FR_BUFFER_SIZE",
                  "EVENTBUS_FR_DUMP_DIR", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")


def keep_agent_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Have ``monkeypatch`` put back every variable an in-process EventAgent sets, as it was
    before the test (absent ones removed), so later tests do not inherit them."""
    for key in AGENT_ENV_KEYS:
        if key in os.environ:
            monkeypatch.setenv(key, os.environ[key])  # undo puts this value back
        else:
            monkeypatch.setenv(key, "")  # undo removes it again
            monkeypatch.delenv(key)


@pytest.fixture(autouse=True)
def _no_leftover_agent_environment() -> Iterator[None]:
    """An in-process agent exports its workers' settings (the store address, ...) into
    os.environ; a later test's child process must not inherit them and try to forward its
    events to a store that is gone."""
    before = {k: v for k, v in os.environ.items() if k.startswith(_AGENT_ENV_PREFIXES)}
    yield
    for key in [k for k in os.environ if k.startswith(_AGENT_ENV_PREFIXES)]:
        if key not in before:
            del os.environ[key]
    os.environ.update(before)


@pytest.fixture(autouse=True)
def _no_leftover_job_context() -> Iterator[None]:
    """An in-process agent marks its own events with its run and attempt
    (``eventbus.context.set_context``); a later test in the same process (under
    ``pytest -n``, any test may follow any other) must not inherit that context."""
    from eventbus import context

    before = context.current_context()
    yield
    context.set_context(**attrs.asdict(before, recurse=False))


@pytest.fixture(autouse=True)
def _no_leftover_torchelastic_bridges() -> Iterator[None]:
    """An in-process agent installs the torch-records bridge; later tests must find torch's
    destination registry as torch leaves it, so every bridge a test installed is removed."""
    yield
    bridge = sys.modules.get("eventbus.publishers.torchelastic")
    if bridge is not None:
        for destination in list(getattr(bridge, "_installed", {})):
            bridge.uninstall_torchelastic_bridge(destination)


@pytest.fixture
def bus() -> eventbus.Bus:
    """A private bus, so a test sees only its own subscribers."""
    return eventbus.Bus("test")


#: the session's Slurm cluster (tests/slurm_cluster.py), one per pytest session
from tests.slurm_cluster import slurm_cluster  # noqa: E402, F401
