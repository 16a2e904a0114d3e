"""The spare template (eventbus_app/launcher/recovery/template.py): one real process that
imports once and forks the warm spares, which the pool adopts as this process's children.
Read from the real processes: their parent and session, their exit codes, their CPU time
and priority in ``/proc``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from eventbus.app.launcher.recovery.spares import SparePool
from eventbus.app.launcher.recovery.template import Adopted
from eventbus.app.launcher.recovery.template import subreaper_state
from eventbus.app.worker.yielding import sched_of
from tests.launcher_helpers import ROOT

#: the script: what a worker can see of itself, then exit code 7
PROBE = ("import json, os, sys\n"
         "print(json.dumps({'argv': sys.argv, 'ppid': os.getppid(), 'pid': os.getpid(), "
         "'sid': os.getsid(0), 'rank': os.environ.get('RANK'), 'cwd': os.getcwd(), "
         "'draws': [__import__('random').random(), __import__('numpy').random.random()], "
         "'warm': 'torch' in sys.modules, 'sched': list(__import__('eventbus.app.worker."
         "yielding', fromlist=['x']).sched_of(os.getpid())), 'spare_env': sorted(k for k in "
         "os.environ if k.startswith('EVENTBUS_SPARE'))}), flush=True)\n"
         "sys.exit(7)\n")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EVENTBUS_")}
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return env


def _spawn(log: Path, started: list[int], modules: str | None = None) -> Any:
    def spawn(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        if modules is not None:  # a warm-up that ends at once, even on a loaded machine
            kwargs["env"] = {**kwargs["env"], "EVENTBUS_SPARE_MODULES": modules}
        proc = subprocess.Popen(*args, stdout=log.open("ab"), stderr=subprocess.STDOUT,
                                **kwargs)
        started.append(proc.pid)
        return proc
    return spawn


def _cpu_s(pid: int) -> float:
    """CPU seconds of process ``pid`` so far, every thread (``/proc/PID/stat``'s utime and
    stime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _facts(log: Path) -> dict[str, Any]:
    lines = [line for line in log.read_text().splitlines() if line.startswith("{")]
    found = json.loads(lines[-1])
    assert isinstance(found, dict)
    return found


def test_the_templates_spares_are_this_processs_children_and_become_workers(
        tmp_path: Path) -> None:
    """Two spares asked of one template: it imports torch once, each spare is a fork that
    this process adopted (its parent is this process, not the template; a session of its
    own), becomes the worker with its environment, argv and cwd, and its exit code comes
    back through the adopted process. Two spares of one template draw different numbers
    from Python's and NumPy's global generators, as two fresh workers do. No request
    out: this process is no longer a child subreaper. A spare asked after a restart is a
    fork too: its CPU time is a small part of the template's import."""
    log, started = tmp_path / "spares.log", []
    script = tmp_path / "script.py"
    script.write_text(PROBE)
    pool = SparePool(template=True, spawn=_spawn(log, started))
    env = _env(RANK="0")
    try:
        assert pool.fill({0: (sys.executable, ("-u",), env),
                          1: (sys.executable, ("-u",), env)}) == 2
        assert subreaper_state() is True  # while the requests are out
        worker = {**env, "RANK": "3", "TORCHELASTIC_RESTART_COUNT": "1"}
        spare = pool.take(0, sys.executable, worker, os.getcwd())
        assert spare is not None and isinstance(spare.proc, Adopted)
        assert len(started) == 1 and pool.started == 2 and len(pool) == 1
        assert subreaper_state() is False
        template = started[0]
        spare.assign(worker, [str(script), "--x", "1"], os.getcwd())
        assert spare.proc.wait(timeout=60) == 7
        facts = _facts(log)
        assert facts["argv"] == [str(script), "--x", "1"] and facts["rank"] == "3"
        assert facts["ppid"] == os.getpid() != template
        assert facts["sid"] == facts["pid"] == spare.proc.pid
        assert facts["warm"] and facts["cwd"] == os.getcwd() and facts["spare_env"] == []
        # the other spare, forked from the same template: its own random draws
        other = pool.take(1, sys.executable, worker, os.getcwd())
        assert other is not None
        other.assign(worker, [str(script)], os.getcwd())
        assert other.proc.wait(timeout=60) == 7
        draws = facts["draws"]
        assert all(a != b for a, b in zip(_facts(log)["draws"], draws, strict=True)), draws
        # the restart's spare: a fork, not another import
        assert pool.fill({0: (sys.executable, ("-u",), env)}) == 1
        again = pool.take(0, sys.executable, worker, os.getcwd())
        assert again is not None and len(started) == 1
        assert _cpu_s(again.proc.pid) < 0.25 * _cpu_s(template), \
            (_cpu_s(again.proc.pid), _cpu_s(template))
        again.discard(5.0)
        assert again.proc.returncode == 0  # it read the end of its pipe and exited
    finally:
        pool.close()
    with pytest.raises(ProcessLookupError):  # the template ended with the pool
        os.kill(started[0], 0)


def test_a_spare_forked_from_a_template_warming_up_low_works_at_normal_priority(
        tmp_path: Path) -> None:
    """A template started low (the workers train) and lowered by the agent: the spare it
    forks, and the worker that spare becomes, run at this process's policy and nice value,
    in a session whose autogroup is a new one's (nice 0)."""
    log, started = tmp_path / "spares.log", []
    script = tmp_path / "script.py"
    script.write_text("import json, os\nfrom eventbus.app.worker.yielding import "
                      "sched_of, _autogroup_nice\nprint(json.dumps({'main': sched_of("
                      "os.getpid()), 'group': _autogroup_nice()}), flush=True)\n")
    pool = SparePool(template=True, spawn=_spawn(log, started, modules="json"))
    env = _env()
    try:
        pool.fill({0: (sys.executable, ("-u",), env)}, low=True)
        pool.demote()
        spare = pool.take(0, sys.executable, env, os.getcwd())
        assert spare is not None
        spare.assign(env, [str(script)], os.getcwd())
        assert spare.proc.wait(timeout=60) == 0
    finally:
        pool.close()
    facts = _facts(log)
    assert tuple(facts["main"]) == sched_of(os.getpid())
    assert facts["group"] in (None, 0)  # None: no autogroup on this kernel


def test_a_template_that_dies_leaves_the_restart_to_fresh_workers(tmp_path: Path) -> None:
    """The template killed before it forked: the restart does not wait for it (no spare,
    said why), this process stops being a subreaper, and the next fill starts a new
    template whose spare is used."""
    log, started = tmp_path / "spares.log", []
    pool = SparePool(template=True, spawn=_spawn(log, started, modules="json"),
                     discard_timeout=0.2)
    env = _env()
    try:
        pool.fill({0: (sys.executable, ("-u",), env)})
        os.killpg(started[0], signal.SIGKILL)
        assert pool.take(0, sys.executable, env, os.getcwd()) is None
        assert pool.discarded == ["local rank 0: the template could not fork it"]
        assert subreaper_state() is False
        pool.fill({0: (sys.executable, ("-u",), env)})
        spare = pool.take(0, sys.executable, env, os.getcwd())
        assert spare is not None and len(started) == 2
    finally:
        pool.close()


def test_a_changed_environment_starts_a_new_template_and_ends_the_old(
        tmp_path: Path) -> None:
    """Workers whose environment changed on a variable that is not per attempt: their
    spares come from a new template; the old one ends."""
    log, started = tmp_path / "spares.log", []
    pool = SparePool(template=True, spawn=_spawn(log, started, modules="json"),
                     discard_timeout=5.0)
    try:
        pool.fill({0: (sys.executable, ("-u",), _env(PYTHONHASHSEED="1"))})
        old = pool._template
        assert old is not None
        assert pool.take(0, sys.executable, _env(PYTHONHASHSEED="1"), os.getcwd())
        pool.fill({0: (sys.executable, ("-u",), _env(PYTHONHASHSEED="2"))})
        assert len(started) == 2 and old.proc.poll() is not None
        assert pool.take(0, sys.executable, _env(PYTHONHASHSEED="2"), os.getcwd())
    finally:
        pool.close()


def test_an_adopted_process_waits_polls_and_reports_a_signal_as_popen_does() -> None:
    """``Adopted`` on a child of this process: ``poll()`` is None while it runs,
    ``wait(timeout)`` raises ``TimeoutExpired``, and a SIGKILL reads ``-9``."""
    pid = os.posix_spawn(sys.executable, [sys.executable, "-c", "import time; "
                                          "time.sleep(60)"], os.environ)
    adopted = Adopted(pid, ["sleeper"])
    try:
        assert adopted.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            adopted.wait(timeout=0.05)
        adopted.kill()
        assert adopted.wait(timeout=30) == -signal.SIGKILL
        assert adopted.poll() == -signal.SIGKILL
    finally:
        if adopted.returncode is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)



def test_a_template_that_holds_a_gpu_forks_nothing_and_the_spares_start_by_themselves(
        tmp_path: Path) -> None:
    """A template whose imports initialised a GPU (here: it holds the file its
    ``EVENTBUS_SPARE_GPU_FILES`` names, /dev/null on its stdin, where a real one holds
    /dev/nvidia*) forks no spare: a fork could not use the GPU. The pool starts each spare
    by itself from then on, and the restart takes one that is not a fork."""
    log, started = tmp_path / "spares.log", []
    spawn = _spawn(log, started, modules="json")

    def with_gpu(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        if "EVENTBUS_SPARE_TEMPLATE_FD" in kwargs["env"]:
            kwargs["env"] = {**kwargs["env"], "EVENTBUS_SPARE_GPU_FILES": "/dev/null"}
            kwargs["stdin"] = subprocess.DEVNULL
        return spawn(*args, **kwargs)

    pool = SparePool(template=True, spawn=with_gpu)
    env = _env()
    try:
        pool.fill({0: (sys.executable, ("-u",), env), 1: (sys.executable, ("-u",), env)})
        spare = pool.take(1, sys.executable, env, os.getcwd())
        assert spare is not None and not isinstance(spare.proc, Adopted)
        assert pool.template is False and len(started) == 3  # the template, 2 spares
        assert subreaper_state() is False
        spare.discard(5.0)
    finally:
        pool.close()
