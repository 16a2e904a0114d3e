"""The worker bootstrap's exit hooks (eventbus_app/worker/process_groups.py, progress.py):
the process-group destroy at exit works when no thread can start any more (Python 3.12+),
does nothing in a forked child, and comes after the progress watch's final beat.

The torch-free tests stand in a module for ``torch.distributed`` (its four calls the hook
uses), so that they also run on the interpreters of ``make test-pythons``."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import types
import weakref
from pathlib import Path
from typing import Any

import pytest

import eventbus
from eventbus.app.protocol.agent_worker import EXITING_KEY
from eventbus.app.worker import process_groups
from eventbus.app.worker import progress
from eventbus.app.worker.progress import ProgressWatch
from tests.conftest import subprocess_env

#: a stand-in torch.distributed that prints where and in which process it is destroyed
FAKE_DIST = textwrap.dedent("""
    import os, sys, threading, types
    fake = types.ModuleType("torch.distributed")
    up = [True]
    fake.is_available = lambda: True
    fake.is_initialized = lambda: up[0]
    def _destroy():
        up[0] = False
        print(f"destroyed pid={os.getpid()} on={threading.current_thread().name}", flush=True)
    fake.destroy_process_group = _destroy
    sys.modules["torch.distributed"] = fake
""")


def _fake_dist(calls: list[str]) -> types.ModuleType:
    fake = types.ModuleType("torch.distributed")
    up = [True]
    fake.is_available = lambda: True  # type: ignore[attr-defined]
    fake.is_initialized = lambda: up[0]  # type: ignore[attr-defined]

    def destroy() -> None:
        up[0] = False
        calls.append(f"destroy on {threading.current_thread().name}")

    fake.destroy_process_group = destroy  # type: ignore[attr-defined]
    return fake


def test_after_the_destroy_the_scripts_globals_holding_a_group_are_dropped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """gloo joins its threads only when a group's last reference goes; the destroy drops
    only torch's. So __main__'s names bound to a process group (or a DDP module) are
    dropped after it, and the group is freed then; other names stay."""
    calls: list[str] = []
    fake = _fake_dist(calls)

    class ProcessGroup:
        def __init__(self) -> None:
            self.me = self  # a cycle: only the collection frees it

    fake.ProcessGroup = ProcessGroup  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch.distributed", fake)
    monkeypatch.setattr(process_groups, "_pid", None)
    main = types.ModuleType("__main__")
    main.g = ProcessGroup()  # type: ignore[attr-defined]
    main.kept = [1]  # type: ignore[attr-defined]
    freed = weakref.ref(main.g)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "__main__", main)
    assert process_groups.end_process_groups(timeout=5) is True
    assert len(calls) == 1 and not hasattr(main, "g") and freed() is None
    assert main.kept == [1]  # type: ignore[attr-defined]


def _python(code: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "script.py"
    script.write_text(FAKE_DIST + textwrap.dedent(code))
    # 3.12+ warns of os.fork() in a process with threads (the helper is one)
    return subprocess.run([sys.executable, "-W", "ignore::DeprecationWarning", str(script)],
                          check=False, capture_output=True,
                          text=True, env=subprocess_env(), timeout=60)


def test_without_a_helper_and_no_new_thread_the_destroy_runs_inline(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """At shutdown (3.12+) Thread.start() raises RuntimeError; with no helper running the
    destroy runs inline instead of the hook failing with the group up."""
    calls: list[str] = []
    monkeypatch.setitem(sys.modules, "torch.distributed", _fake_dist(calls))
    monkeypatch.setattr(process_groups, "_helper", None)
    monkeypatch.setattr(process_groups, "_pid", None)

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    assert process_groups.end_process_groups(timeout=5) is True
    assert calls == [f"destroy on {threading.current_thread().name}"]


def test_at_shutdown_the_destroy_runs_on_the_helper_started_at_install(
        tmp_path: Path) -> None:
    """The real exit: a hook that runs before ours makes Thread.start() raise as 3.12's
    shutdown does (on 3.12+ it already does). The destroy runs on the helper that install()
    started, and nothing reaches stderr ("Exception ignored in atexit callback")."""
    run = _python("""
        import atexit, threading
        from eventbus.app.worker import process_groups
        process_groups.install()
        def _no_threads(self):
            raise RuntimeError("can't create new thread at interpreter shutdown")
        atexit.register(lambda: setattr(threading.Thread, "start", _no_threads))
        print("script done", flush=True)
    """, tmp_path)
    assert run.returncode == 0 and run.stderr == "", run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "script done"
    assert len(lines) == 2 and lines[1].endswith("on=eventbus-destroy-process-group"), lines


def test_a_forked_child_does_not_destroy_its_parents_groups(tmp_path: Path) -> None:
    """A child forked after install() inherits the exit hook; ending with sys.exit(0) it
    exits 0 and leaves the groups alone: only the parent destroys, once."""
    run = _python("""
        import os, sys
        from eventbus.app.worker import process_groups
        process_groups.install()
        pid = os.fork()
        if pid == 0:
            sys.exit(0)
        _, status = os.waitpid(pid, 0)
        print(f"parent={os.getpid()} child_exit={os.waitstatus_to_exitcode(status)}",
              flush=True)
    """, tmp_path)
    assert run.returncode == 0 and run.stderr == "", run.stderr
    first, *rest = run.stdout.splitlines()
    parent = first.split()[0].split("=")[1]
    assert first.endswith("child_exit=0")
    assert rest == [f"destroyed pid={parent} on=eventbus-destroy-process-group"], rest


def _armed_watch(beats: list[Any], rank: int) -> ProgressWatch:
    torch = pytest.importorskip("torch")
    watch = ProgressWatch(frozenset({"steps"}), rank=rank, bus=eventbus.Bus("exit-hooks"),
                          record=lambda _type, **fields: beats.append(fields))
    watch.tick()  # arms (torch.optim is imported)
    assert watch.armed and torch is not None
    return watch


def test_the_exiting_beat_comes_before_the_destroy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The exit hook sends the watch's final ``exiting`` beat first, then destroys (which
    may wait up to DESTROY_TIMEOUT_S); the watch's own exit hook then sends no second."""
    order: list[Any] = []
    watch = _armed_watch(order, rank=4)
    watch.start()
    monkeypatch.setattr(progress, "_watch", watch)
    monkeypatch.setitem(sys.modules, "torch.distributed", _fake_dist(order))
    monkeypatch.setattr(process_groups, "_pid", None)
    assert process_groups.end_process_groups(timeout=5) is True
    exiting = [i for i, o in enumerate(order)
               if isinstance(o, dict) and o["data"].get(EXITING_KEY)]
    destroys = [i for i, o in enumerate(order) if isinstance(o, str)]
    assert len(exiting) == 1 and len(destroys) == 1 and exiting[0] < destroys[0], order
    assert not watch.alive
    watch.stop(progress.FINAL_JOIN_S, final=True)  # the atexit call: nothing more
    assert sum(1 for o in order if isinstance(o, dict) and o["data"].get(EXITING_KEY)) == 1


def test_a_forked_child_sends_no_exiting_beat_for_its_parent() -> None:
    """The watch's exit hook in a forked child: no beat with the parent's rank."""
    import os

    beats: list[Any] = []
    watch = _armed_watch(beats, rank=5)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(r)
            watch.stop(progress.FINAL_JOIN_S, final=True)
            os.write(w, str(sum(1 for b in beats if b["data"].get(EXITING_KEY))).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        child = f.read()
    os.waitpid(pid, 0)
    assert child == "0"
    watch.stop(progress.FINAL_JOIN_S, final=True)
    assert sum(1 for b in beats if b["data"].get(EXITING_KEY)) == 1
