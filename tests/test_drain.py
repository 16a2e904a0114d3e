"""The drain's rules (eventbus/app/launcher/drain/state.py) on a fake clock, its signals with real
signals to this process, and how the decider ends a drained job; the options' parsers."""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
from typing import Any

import pytest

from eventbus import Bus
from eventbus import Cause
from eventbus.app.launcher.cli import options
from eventbus.app.launcher.cli.options import DEFAULT_DRAIN_EXIT_CODE
from eventbus.app.launcher.cli.options import drain_signal_names as parse_drain_signals
from eventbus.app.launcher.decisions.decider import Decider
from eventbus.app.launcher.drain.state import Drain
from eventbus.events import WorkerExit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _drain(**kw: Any) -> tuple[Drain, Clock]:
    clock = Clock()
    return Drain(grace_s=20.0, clock=clock, **kw), clock


def test_the_default_code_is_none_of_success_failure_or_stop() -> None:
    assert DEFAULT_DRAIN_EXIT_CODE not in (0, 1, options.DEFAULT_STOP_EXIT_CODE)
    assert options.DEFAULT_DRAIN_SIGNALS == ("SIGTERM", "SIGUSR1")


def test_signal_names_are_parsed_and_bad_ones_named() -> None:
    assert parse_drain_signals("SIGTERM,SIGUSR1") == ("SIGTERM", "SIGUSR1")
    assert parse_drain_signals("term, usr2 ,TERM") == ("SIGTERM", "SIGUSR2")
    assert parse_drain_signals("off") == ()
    with pytest.raises(ValueError, match="'SIGNOPE' is not a signal name"):
        parse_drain_signals("SIGTERM,SIGNOPE")
    with pytest.raises(ValueError, match="cannot be caught"):
        parse_drain_signals("KILL")
    with pytest.raises(argparse.ArgumentTypeError, match="not a signal name"):
        options.parse_drain_signals("SIG_DFL")
    assert options.parse_drain_grace("90.5") == 90.5
    for bad in ("0", "-1", "nan", "soon"):
        with pytest.raises(argparse.ArgumentTypeError, match="seconds"):
            options.parse_drain_grace(bad)
    assert options.parse_drain_exit_code("143") == 143
    for bad in ("0", "1", "256", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match="exit code 2-255"):
            options.parse_drain_exit_code(bad)


def test_a_signal_starts_the_drain_with_the_grace_a_second_one_cuts_it_short() -> None:
    told: list[Drain] = []
    drain, clock = _drain(on_begin=told.append)
    drain.node = 1
    assert not drain.active and not drain.due()
    assert drain.begin("SIGTERM", origin=1, local=True)
    assert told == [drain] and drain.reason() == "SIGTERM on node 1"
    assert drain.seconds_left() == 20.0 and not drain.due()
    clock.now += 5
    assert not drain.begin("SIGUSR1", origin=1, local=True)  # the second: now
    assert drain.escalated and drain.due() and drain.signal == "SIGTERM"
    assert len(told) == 1  # one PREEMPTING per drain


def test_another_nodes_drain_keeps_its_deadline_and_is_not_announced_again() -> None:
    told: list[Drain] = []
    drain, clock = _drain(on_begin=told.append)
    assert drain.begin("SIGUSR1", origin=2, local=False, deadline_s=7.5)
    assert not told and drain.seconds_left() == 7.5 and drain.reason() == "SIGUSR1 on node 2"
    assert not drain.begin("SIGUSR1", origin=2, local=False, deadline_s=1.0)
    assert not drain.escalated and drain.seconds_left() == 7.5
    clock.now += 7.5
    assert drain.due()


def test_the_line_says_signal_node_step_grace_and_who_did_not_stop() -> None:
    drain, clock = _drain()
    drain.begin("SIGTERM", origin=0, local=True)
    clock.now += 3.25
    drain.ended_at = clock.now
    drain.stop_step = 412
    assert drain.summary_line() == (
        "SIGTERM on node 0: the job drained (every rank stopped at step 412; 3.2 s of the "
        "20 s grace used); exit code 75")
    drain.late_ranks.add(3)
    drain.failed_ranks.update({5: 1, 6: -15})
    drain.forwarded_at = 120.0
    line = drain.summary_line()
    assert "the other ranks stopped at step 412; 20.0 s of the 20 s grace used" in line
    assert "rank 6 ended on SIGTERM at once (the script does not act on drains)" in line
    assert "rank 5 ended with exit code 1" in line
    assert "rank 3 did not stop in time (SIGTERM, then SIGKILL)" in line
    facts = drain.facts()
    assert facts["late_ranks"] == [3] and facts["stop_step"] == 412
    assert facts["failed_ranks"] == {"5": 1, "6": -15}


def test_the_decider_ends_a_drained_job_preempted_with_the_drain_code() -> None:
    drain, _ = _drain(exit_code=42)
    decider = Decider(Bus("t"), max_restarts=3, stop_exit_code=3, drain=drain)
    assert decider.ending(succeeded=True, state="SUCCEEDED").state == "SUCCEEDED"
    drain.begin("SIGTERM", origin=0, local=True)
    for ending in (decider.ending(succeeded=True, state="SUCCEEDED"),
                   decider.ending(succeeded=False),
                   decider.ending(succeeded=None, error=RuntimeError("rendezvous closed"))):
        assert (ending.state, ending.exit_code, ending.cause) == (
            "PREEMPTED", 42, str(Cause.PREEMPTION))
        assert ending.reason is not None and ending.reason.startswith("SIGTERM on node 0")
    # a failure during a drain restarts nothing, and says why
    outcome = decider.decide([WorkerExit(worker_id=1, exit_code=1)], restarts_left=3,
                             next_attempt=2)
    assert outcome.action == "fail"
    assert outcome.line.endswith("the job is draining (SIGTERM on node 0): no restart")


def test_the_handler_only_writes_a_byte_the_thread_starts_the_drain() -> None:
    """A real SIGUSR1 to this process: the drain starts on the drain thread (not in the
    handler), the previous handler is back after uninstall."""
    begun: list[str] = []
    drain = Drain(signals_=("SIGUSR1",), grace_s=5.0,
                  on_begin=lambda d: begun.append(threading.current_thread().name))
    previous = signal.getsignal(signal.SIGUSR1)
    assert drain.install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 5
        while not begun and time.monotonic() < deadline:
            time.sleep(0.01)
        assert begun == ["eventbus-drain-signals"]
        assert drain.active and drain.signal == "SIGUSR1" and drain.local
    finally:
        drain.uninstall()
    assert signal.getsignal(signal.SIGUSR1) == previous


def test_off_installs_nothing() -> None:
    drain = Drain(signals_=())
    before = signal.getsignal(signal.SIGTERM)
    assert not drain.install()
    assert signal.getsignal(signal.SIGTERM) == before


def test_the_command_refuses_one_code_for_drain_and_stop() -> None:
    pytest.importorskip("torch.distributed.run")
    from eventbus.app.launcher.command import main

    with pytest.raises(SystemExit) as exc:
        main(["--drain-exit-code", "3", "--stop-exit-code", "3", "--standalone", "x.py"])
    assert exc.value.code == 2
