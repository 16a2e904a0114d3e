"""One signal's copies are one drain (eventbus/app/launcher/drain/state.py on a fake clock), a
worker's ask starts a drain but never escalates one, the job's one PREEMPTING (the notice
board's claim, drain_monitor.py), and the worker bootstrap's handler of a drain signal
(eventbus/app/worker/drain_signals.py) with real signals to this process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from eventbus import preemption
from eventbus.app.launcher.drain.notices import NoticeBoard
from eventbus.app.launcher.drain.state import Drain
from eventbus.app.protocol import drain_signals as protocol
from eventbus.app.worker import drain_signals
from tests.conftest import ROOT
from tests.test_drain import Clock


def _drain(**kw: Any) -> tuple[Drain, Clock]:
    clock = Clock()
    return Drain(grace_s=20.0, clock=clock, window_s=2.0, **kw), clock


def test_a_copy_within_the_window_is_the_same_drain_a_later_one_escalates() -> None:
    told: list[Drain] = []
    drain, clock = _drain(on_begin=told.append)
    assert drain.begin("SIGUSR1", origin=0, local=True)
    clock.now += 1.9  # another copy of SLURM's signal (a worker's, this agent's own)
    assert not drain.begin("SIGUSR1", origin=0, local=True)
    assert not drain.escalated and drain.seconds_left() == pytest.approx(18.1)
    clock.now += 0.2  # 2.1 s after the start: the scheduler insists
    assert not drain.begin("SIGUSR1", origin=0, local=True)
    assert drain.escalated and drain.due() and told == [drain]


def test_another_nodes_drain_then_this_nodes_own_copy_is_one_drain() -> None:
    """The race SLURM showed: node 0's PREEMPTING reached node 1 before node 1's copy."""
    drain, clock = _drain()
    assert drain.begin("SIGUSR1", origin=0, local=False, deadline_s=19.9)
    clock.now += 0.5
    assert not drain.begin("SIGUSR1", origin=1, local=True)
    assert not drain.escalated and drain.seconds_left() == pytest.approx(19.4)


def test_an_ask_starts_a_drain_and_never_escalates() -> None:
    told: list[Drain] = []
    drain, clock = _drain(on_begin=told.append)
    assert drain.begin("SIGUSR1", origin=0, local=True, asked=True)
    assert told == [drain] and drain.signal == "SIGUSR1"
    clock.now += 10
    assert not drain.begin("SIGUSR1", origin=0, local=True, asked=True)
    assert not drain.escalated


def test_after_an_ask_or_the_time_limit_the_schedulers_first_signal_is_not_a_second() -> None:
    """The time limit started the drain; SLURM's --signal warning comes 10 s later: the
    same drain. Only a signal after that one's window cuts the grace short."""
    drain, clock = _drain()
    assert drain.begin("the time limit", origin=0, local=True, asked=True)
    clock.now += 10
    assert not drain.begin("SIGUSR1", origin=0, local=True)
    assert not drain.escalated
    clock.now += 1.5
    assert not drain.begin("SIGUSR1", origin=0, local=True)  # its copy
    assert not drain.escalated
    clock.now += 1.0
    assert not drain.begin("SIGTERM", origin=0, local=True)
    assert drain.escalated and drain.due()


def test_the_fit_sets_a_local_drains_grace_only() -> None:
    drain, _ = _drain()
    drain.fit = lambda name, grace: 7.0 if name == "SIGTERM" else grace
    drain.begin("SIGTERM", origin=0, local=True)
    assert drain.seconds_left() == 7.0
    other, _ = _drain()
    other.fit = lambda name, grace: 7.0
    other.begin("SIGTERM", origin=1, local=False, deadline_s=12.0)
    assert other.seconds_left() == 12.0  # the announcer's deadline


def test_each_drain_signal_has_its_own_ask() -> None:
    names = ("SIGTERM", "SIGUSR1")
    asks = [protocol.ask_signal(i) for i in range(2)]
    assert None not in asks and len(set(asks)) == 2
    assert all(a not in (signal.SIGTERM, signal.SIGUSR1) for a in asks if a is not None)
    assert [protocol.asked_signal(a, names) for a in asks if a is not None] == list(names)
    assert protocol.asked_signal(int(signal.SIGTERM), names) is None


class _Client:
    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def add(self, key: str, value: int) -> int:
        self.counts[key] = self.counts.get(key, 0) + value
        return self.counts[key]


def test_the_first_agent_to_claim_the_drain_announces_it_the_others_do_not() -> None:
    client = _Client()
    boards = [NoticeBoard(), NoticeBoard()]
    for board in boards:
        board.root, board._client = "eventbus/notices/run", client
    assert [board.claim_drain() for board in boards] == [True, False]
    alone = NoticeBoard()  # no store yet: drains alone rather than not at all
    assert alone.claim_drain()


@pytest.fixture
def taken() -> Iterator[None]:
    before = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGUSR2)}
    preemption.reset()
    yield
    for signum, handler in before.items():
        signal.signal(signum, handler)
    drain_signals._after_fork_in_child()
    preemption.reset()


def test_the_bootstrap_takes_a_default_drain_signal_and_the_worker_lives(taken: None) -> None:
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # not at its default: left alone
    env = {protocol.ENV_DRAIN_SIGNALS: "SIGUSR1,SIGUSR2", protocol.ENV_DRAIN_WINDOW: "0.2",
           protocol.ENV_AGENT_PID: "1"}  # not our parent: nobody is asked
    assert drain_signals.install(env) == (signal.SIGUSR1,)
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN
    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(0.01)  # the handler runs between two bytecodes
    assert drain_signals.state().seen == [(signal.SIGUSR1, "asked")]
    preemption.begin(deadline_s=30.0, reason="SIGUSR1 on node 0", signal="SIGUSR1")
    os.kill(os.getpid(), signal.SIGUSR1)  # a copy within the window: kept
    time.sleep(0.01)
    assert drain_signals.state().seen[-1] == (signal.SIGUSR1, "kept")


def test_a_scripts_own_handler_replaces_the_bootstraps(taken: None) -> None:
    drain_signals.install({protocol.ENV_DRAIN_SIGNALS: "SIGUSR1"})
    got: list[int] = []
    signal.signal(signal.SIGUSR1, lambda signum, frame: got.append(signum))
    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(0.01)
    assert got == [signal.SIGUSR1] and drain_signals.state().seen == []


def test_nothing_is_taken_without_the_agents_variable(taken: None) -> None:
    assert drain_signals.install({}) == ()
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL


def test_the_agents_stop_is_marked_while_it_lasts_nested_or_not(tmp_path: Path) -> None:
    mark = tmp_path / "stop"
    with protocol.agent_stopping(str(mark)):
        assert mark.exists()
        with protocol.agent_stopping(str(mark)):
            assert mark.exists()
        assert mark.exists()  # the outer stop still signals
    assert not mark.exists()
    with protocol.agent_stopping(""):  # no path: nothing to mark
        pass


_WORKER = """
import os, signal, sys, time
from eventbus.app.worker import drain_signals
drain_signals.install({"EVENTBUS_DRAIN_SIGNALS": "SIGTERM", "EVENTBUS_AGENT_STOP": sys.argv[1]})
print("ready", flush=True)
deadline = time.monotonic() + 5
while not drain_signals.state().seen and time.monotonic() < deadline:
    time.sleep(0.01)
print(drain_signals.state().seen, flush=True)
"""


@pytest.mark.parametrize("marked", [True, False], ids=["agent-stops", "scheduler-signals"])
def test_a_worker_dies_of_its_agents_stop_and_lives_through_the_schedulers_signal(
        tmp_path: Path, marked: bool) -> None:
    """The agent's own SIGTERM (a stall's stop, a failure's survivors) comes while its
    stop is marked: the worker dies of it, as without the bootstrap's handler. The same
    signal unmarked is the scheduler's: the worker lives on (and would ask its agent)."""
    mark = tmp_path / "stop"
    child = subprocess.Popen([sys.executable, "-c", _WORKER, str(mark)],
                             stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        with protocol.agent_stopping(str(mark) if marked else ""):
            child.send_signal(signal.SIGTERM)
            code = child.wait(timeout=10) if marked else None
        if not marked:
            out, _ = child.communicate(timeout=10)
            assert child.returncode == 0 and "asked" in out, out
        else:
            assert code == -signal.SIGTERM
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)
