"""exit_watch.py and restart_round.py: the monitor's tick woken by a worker's exit, and a
restart's rendezvous round without torch's fixed sleeps. Real child processes and torch's
own rendezvous on a real TCPStore; the agents' case (two nodes restarting, a node waiting
to join) is tests/test_restart_round_e2e.py."""

from __future__ import annotations

import inspect
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

from eventbus.app.launcher.recovery import restart_round
from eventbus.app.launcher.recovery.exit_watch import ExitWatch
from eventbus.app.launcher.recovery.exit_watch import QuickWaits

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="pidfds are Linux's")


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(int(input()))"],
                            stdin=subprocess.PIPE)
    yield proc
    proc.kill()
    proc.wait()


def test_a_workers_exit_ends_the_wait_at_once_and_only_once(
        child: subprocess.Popen[bytes]) -> None:
    watch = ExitWatch(5.0)
    watch.watch([child.pid])
    assert child.stdin is not None
    child.stdin.write(b"3\n")
    child.stdin.close()
    started = time.monotonic()
    assert watch.wait() == [child.pid]
    assert time.monotonic() - started < 4.0  # the exit, not the interval, ended it
    # the child is a zombie until reaped (torch reaps it): its exit wakes the loop once
    watch.interval = 0.05
    started = time.monotonic()
    assert watch.wait() == []
    assert time.monotonic() - started >= 0.04
    assert (watch.ticks, watch.woken) == (2, 1)
    assert child.wait(timeout=5) == 3  # not reaped by the watch


def test_a_live_worker_waits_the_interval(child: subprocess.Popen[bytes]) -> None:
    slept: list[float] = []
    watch = ExitWatch(0.05, sleep=slept.append)
    watch.watch([child.pid])
    started = time.monotonic()
    assert watch.wait() == []
    assert time.monotonic() - started >= 0.04 and slept == []  # polled, did not sleep
    watch.close()
    assert watch.wait() == [] and slept == [0.05]  # nothing watched: torch's sleep


def test_without_pidfds_the_wait_is_torchs_sleep(monkeypatch: pytest.MonkeyPatch,
                                                 child: subprocess.Popen[bytes]) -> None:
    def refused(pid: int) -> int:
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr("os.pidfd_open", refused)
    slept: list[float] = []
    watch = ExitWatch(0.1, sleep=slept.append)
    watch.watch([child.pid])
    assert watch.wait() == [] and slept == [0.1] and not watch.usable


def test_torchs_wait_for_a_stopped_worker_ends_with_its_exit(
        child: subprocess.Popen[bytes]) -> None:
    """Torch's process context waits for each worker with ``handler.proc.wait(timeout)``:
    the wait installed ends at the exit (no 50 ms poll), reaps as Popen does, and keeps
    its timeout."""
    handler = type("Handler", (), {"proc": child})()
    waits = QuickWaits()
    waits.install(type("Context", (), {"subprocess_handlers": {0: handler}})())
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.05)  # alive: the timeout holds
    assert child.stdin is not None
    child.stdin.write(b"4\n")
    child.stdin.close()
    assert child.wait(5.0) == 4 and child.returncode == 4 and waits.ended == 1
    assert child.wait(1.0) == 4  # reaped: as Popen says


def test_the_restart_round_skips_the_jitter_and_polls_quickly_for_a_while() -> None:
    delays: list[Any] = []
    now = [0.0]
    counts = restart_round.RoundCounts()
    over: list[bool] = []
    delay = restart_round.quick_delay(delays.append, counts, until=5.0,
                                      clock=lambda: now[0], window_over=lambda: over.append(True))
    delay(seconds=(0, 0.3))  # the first run's jitter
    delay(seconds=1)  # a round that gathers
    delay(seconds=0.5)  # anything else: torch's
    now[0] = 5.0
    assert over == []
    delay(seconds=1)  # past the window: torch's second, and torch's cache back
    delay(seconds=1)
    assert delays == [restart_round.QUICK_POLL_S, 0.5, 1, 1] and over == [True]
    assert counts.facts() == {"jitter_skipped": 1, "quick_polls": 1}


def _handler(store: Any, run_id: str) -> Any:
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend

    params = RendezvousParameters(backend="c10d", endpoint="localhost:0", run_id=run_id,
                                  min_nodes=1, max_nodes=1)
    backend, _ = create_backend(params)
    return dr.create_handler(store, backend, params)


def test_torchs_first_restart_sleeps_the_jitter_and_the_restart_round_does_not() -> None:
    """The round is still 0 when the first restart begins: torch's ``next_rendezvous``
    sleeps its first-run jitter there. The restart round takes it out and nothing else:
    the node joins round 1 with rank 0 as before."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    handler = _handler(store, "restart-round")
    original = dr._delay  # type: ignore[attr-defined]
    try:
        with restart_round.restart_round(handler, restarting=False) as first:
            handler.next_rendezvous()
        assert handler._state_holder.state.round == 0 and first.facts()["jitter_skipped"] == 0
        with restart_round.restart_round(handler, restarting=True) as counts:
            assert handler._state_holder._cache_duration == 0  # each look reads the store
            info = handler.next_rendezvous()
        assert handler._state_holder._cache_duration == 1  # torch's, back
        assert counts.facts() == {"jitter_skipped": 1, "quick_polls": 0}
        assert (handler._state_holder.state.round, info.rank, info.world_size) == (1, 0, 1)
        assert dr._delay is original  # type: ignore[attr-defined]
        assert "_delay(seconds=(0, 0.3))" in inspect.getsource(
            dr.DynamicRendezvousHandler.next_rendezvous)
        assert "_delay(seconds=1)" in inspect.getsource(
            dr._DistributedRendezvousOpExecutor.run)
    finally:
        handler.shutdown()


def test_the_records_name_the_same_caller_without_reading_the_stack(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.elastic import events

    monkeypatch.setattr(dr, "get_method_name", lambda depth=2: "torch's")  # put back after
    monkeypatch.setattr(events, "inspect", inspect)
    assert "inspect.stack()[depth].function" in inspect.getsource(dr)  # torch's ways
    assert "callstack = inspect.stack()" in inspect.getsource(events)
    restart_round.cheap_method_names()

    def caller() -> tuple[Any, ...]:
        def record() -> tuple[Any, ...]:  # torch's _record calls get_method_name()
            real, cheap = inspect.stack()[1], events.inspect.stack()[1]
            return (real.function, dr.get_method_name(),  # type: ignore[no-untyped-call]
                    (real.filename, real.function), (cheap.filename, cheap.function))
        return record()

    got = caller()
    assert got[:2] == ("caller", "caller") and got[2] == got[3]
    assert events.inspect.getsource is inspect.getsource  # the rest is the real module
    assert restart_round.cheap_method_names() is False  # once
    assert dr.get_method_name is restart_round.get_method_name


def test_the_look_for_a_stop_ends_once_every_other_node_decided_to_restart() -> None:
    """Before a restart each node looks for another node's STOP for up to
    RESTART_GRACE_S (stop_signal.py). A node that decided to restart the same attempt sets
    its restart key: once every other node's is there, no STOP can come for that attempt
    and the look ends; a node whose peer set none (it STOPs, or decided nothing) looks
    its whole grace, and sees a STOP set meanwhile."""
    import datetime

    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    from eventbus.app.launcher.drain.stop_signal import StopSignal

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=10))
    a, b = (StopSignal(host="127.0.0.1", port=store.port, run_id="agree", group_rank=rank,
                       group_world_size=2) for rank in (0, 1))
    try:
        started = time.monotonic()
        assert a.wait_remote(0.1, attempt=3) is None and a.agreed == 0  # b decided nothing
        assert time.monotonic() - started >= 0.1
        assert b.wait_remote(30.0, attempt=3) is None and b.agreed == 1  # a's key: at once
        assert time.monotonic() - started < 20.0
        assert a.wait_remote(30.0, attempt=3) is None and a.agreed == 1
        store.set(a.key, "rank 2 exited 3")  # a STOP, attempt 4: b set no key for it
        assert a.wait_remote(30.0, attempt=4) == "rank 2 exited 3" and a.agreed == 1
    finally:
        a.close()
        b.close()


def test_the_torch_code_the_waits_stand_in_for_is_there() -> None:
    """ExitWatch.ticking: torch's loop reads the interval once, before its loop, and sleeps
    it before each tick. QuickWaits: torch's process context waits for each worker it
    stopped with ``handler.proc.wait(timeout)``."""
    from torch.distributed.elastic.agent.server import api as agent_api
    from torch.distributed.elastic.multiprocessing import api as mp_api

    loop = inspect.getsource(agent_api.SimpleElasticAgent._invoke_run)
    assert loop.index("monitor_interval = spec.monitor_interval") < loop.index("while True")
    assert "time.sleep(monitor_interval)" in loop
    assert "handler.proc.wait(time_to_wait)" in inspect.getsource(
        mp_api.SubprocessContext._close)
