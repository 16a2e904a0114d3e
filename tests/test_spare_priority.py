"""A warm spare's priority (eventbus_app/worker/yielding.py): while it warms up, its
imports run at the lowest priority (a ``SCHED_IDLE`` nice-19 thread, its session's
autogroup at nice 19); the worker it becomes runs at the agent's policy and nice value,
every thread of it, whether it was assigned while warming up or after. Read from
``/proc/PID/stat`` and ``/proc/PID/autogroup`` of the real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from eventbus.app.launcher.recovery.spares import SparePool
from eventbus.app.worker import yielding
from eventbus.app.worker.yielding import GroupNice
from eventbus.app.worker.yielding import sched_of
from tests.launcher_helpers import ROOT

SCHED_OTHER, SCHED_IDLE = 0, 5

#: the script: the policy and nice value of each of its threads, its autogroup's nice
PROBE = ("import json, os\n"
         "from eventbus.app.worker.yielding import sched_of, _autogroup_nice\n"
         "pid = os.getpid()\n"
         "print(json.dumps({'main': sched_of(pid), 'group': _autogroup_nice(), 'threads': "
         "[sched_of(pid, int(t)) for t in os.listdir(f'/proc/{pid}/task')]}))\n")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EVENTBUS_")}
    env["PYTHONPATH"] = str(ROOT)
    return env


def _spawn(log: Path, modules: str | None = None) -> Any:
    def spawn(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        if modules is not None:  # a warm-up that ends at once, even on a loaded machine
            kwargs["env"] = {**kwargs["env"], "EVENTBUS_SPARE_MODULES": modules}
        return subprocess.Popen(*args, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                                **kwargs)
    return spawn


def _state(pid: int) -> tuple[list[tuple[int, int]], int | None]:
    """Each thread's (policy, nice) of ``pid`` but its main thread's, its group's nice."""
    threads = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        if int(tid) != pid:
            try:
                threads.append(sched_of(pid, int(tid)))
            except OSError:  # it ended meanwhile
                continue
    return threads, yielding._autogroup_nice(f"/proc/{pid}/autogroup")


def _until(check: Any, timeout: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.02)
    raise AssertionError("not seen in time")


def test_the_group_nice_is_lowered_and_put_back(tmp_path: Path) -> None:
    """GroupNice writes 19 to the autogroup file and puts the value it read back, once;
    without the file (no autogroup) it does nothing."""
    path = tmp_path / "autogroup"
    path.write_text("/autogroup-7 nice 3\n")
    group = GroupNice(str(path))
    group.lower()
    assert path.read_text() == "19" and group.lowered
    group.restore()
    assert path.read_text() == "3" and not group.lowered
    path.write_text("/autogroup-7 nice 5\n")
    group.restore()  # once only
    assert path.read_text() == "/autogroup-7 nice 5\n"
    missing = GroupNice(str(tmp_path / "none"))
    missing.lower()
    missing.restore()
    assert missing.original is None and not (tmp_path / "none").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("when", ["while it warms up", "once warm"])
def test_a_spare_warms_up_low_and_becomes_a_worker_at_normal_priority(
        tmp_path: Path, when: str) -> None:
    """While the spare imports torch, its main thread keeps this process's policy and
    nice value, its warm-up thread runs at SCHED_IDLE and nice 19 (where the process may
    put it back) and its session's autogroup at nice 19 (where there is autogroup). The
    worker it becomes, assigned then or once warm, runs every thread at this process's
    policy and nice value, its autogroup at a fresh session's nice (0). (Once warm: the
    spare imports json alone, since at the lowest priority its torch import may wait for
    minutes on a loaded machine.)"""
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    log = tmp_path / "spare.log"
    pool = SparePool(spawn=_spawn(log, None if when == "while it warms up" else "json"))
    env = _env()
    assert pool.fill({0: (sys.executable, ("-u",), env)}, low=True) == 1
    pid = pool._spares[0].proc.pid
    has_group = yielding._autogroup_nice(f"/proc/{pid}/autogroup") is not None
    lowers = yielding.can_raise(nice)

    def warming() -> bool:
        threads, group = _state(pid)
        return ((not lowers or (SCHED_IDLE, 19) in threads)
                and (not has_group or group == 19))

    def warm() -> bool:
        threads, group = _state(pid)
        return all(t[0] == SCHED_OTHER for t in threads) and group in (0, None)

    if when == "once warm":
        _until(warm)
    else:
        _until(warming)
    assert sched_of(pid) == (SCHED_OTHER, nice)  # the thread that becomes the worker
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    spare = pool.take(0, sys.executable, env, os.getcwd())
    assert spare is not None
    spare.assign(env, [str(script)], os.getcwd())
    assert spare.proc.wait(timeout=120) == 0, log.read_text()
    facts = json.loads(log.read_text().strip().splitlines()[-1])
    assert facts["main"] == [SCHED_OTHER, nice]
    assert all(t == [SCHED_OTHER, nice] for t in facts["threads"]), facts
    assert facts["group"] == (0 if has_group else None)
    pool.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_agent_lowers_a_warming_spare_and_puts_it_back_at_the_workers_priority(
        tmp_path: Path) -> None:
    """A spare started beside starting workers warms up at their priority; the pool's
    demote (the workers' first step) lowers its warm-up thread and autogroup, its main
    thread kept; promote(pid), which the agent calls as it hands a spare its worker,
    raises them from outside: the spare's own main thread needs the GIL to do it, which
    its starved warm-up thread may hold."""
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    pool = SparePool(spawn=_spawn(tmp_path / "spare.log"))
    assert pool.fill({0: (sys.executable, ("-u",), _env())}) == 1  # at normal priority
    pid = pool._spares[0].proc.pid
    lowers = yielding.can_raise(nice)
    _until(lambda: len(_state(pid)[0]) >= 1)  # its warm-up thread runs
    threads, group = _state(pid)
    assert all(t == (SCHED_OTHER, nice) for t in threads) and group in (0, None)
    pool.demote()  # the workers took their first step
    threads, group = _state(pid)
    assert (not lowers or (SCHED_IDLE, 19) in threads) and group in (19, None), threads
    assert sched_of(pid) == (SCHED_OTHER, nice)
    yielding.promote(pid)
    threads, group = _state(pid)
    assert all(t == (SCHED_OTHER, nice) for t in threads), threads
    assert group in (0, None)
    pool.close()
