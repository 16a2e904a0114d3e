"""Row 14: the agent's SIGTERM mid-stream. The worker flushes within its budget, the
script's own SIGTERM handler still runs, and the events arrive with contiguous sequence
numbers (nothing lost, nothing doubled)."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from matrix import WORKER
from matrix import drain_until_ended
from matrix import subprocess_env

import eventbus
from eventbus import EventType

#: torchrun sends SIGKILL 30 s after SIGTERM: the flush must end well before
BUDGET_S = 30.0

SCRIPT = r"""
import faulthandler, os, signal, sys, time, traceback
mode, ready, watchdog = sys.argv[1], sys.argv[2], float(sys.argv[3])
if mode == "chained":
    def mine(signum, frame):
        import eventbus  # imported by then: the handler records its last word, as a
        eventbus.record("CHECKPOINT_SAVED", path="at-sigterm")  # preemption handler may
        # where the signal found the main thread: there the SystemExit below is raised
        open(ready + ".handler", "w").write("".join(traceback.format_stack(frame)))
        sys.exit(7)
    # the script's own handler replaces the bootstrap's; its sys.exit leaves through
    # atexit, where the forwarder flushes
    signal.signal(signal.SIGTERM, mine)
import eventbus
from eventbus import EventType
i = 0
while True:
    eventbus.record(EventType.EPOCH_END, epoch=0, data={"i": i})
    i += 1
    if i == 5_000:
        # every thread's stack on stderr if this process still lives `watchdog` s on
        # (faulthandler's own C thread: it fires in the interpreter's finalization too)
        faulthandler.dump_traceback_later(watchdog, exit=False)
        open(ready, "w").write("go")
    if i % 500 == 0:
        time.sleep(0.001)
"""


def native_stacks(pid: int) -> str:
    """Every thread's native stack (gdb's ``thread apply all bt``), where gdb is here."""
    gdb = shutil.which("gdb")
    if gdb is None:
        return "(no gdb on this machine)"
    try:
        out = subprocess.run([gdb, "-p", str(pid), "-batch", "-ex", "thread apply all bt"],
                             check=False, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return "(gdb did not finish in 120 s)"
    return out.stdout[-20000:] + out.stderr[-2000:]


def _wait_for(path: Path, proc: subprocess.Popen[str], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["default", "chained"])
def test_sigterm_mid_stream_flushes_everything_within_budget(
    store: Any, tmp_path: Path, mode: str, figure: Callable[[int, str], None],
) -> None:
    """SIGTERM while the worker records as fast as it can: it exits (by SIGTERM, or by the
    script's own handler, which ran and recorded an event) within the budget; the agent
    receives 0..N-1 with no gap, no duplicate, the sender's end marker, and the event the
    script's handler recorded."""
    from eventbus.publishers.store_receiver import StoreReceiver
    from eventbus.wire import ENV_PREFIX
    from eventbus.wire import ENV_STORE
    from eventbus.wire import worker_key

    prefix = f"eventbus/row14-{mode}/0"
    stacks = tmp_path / "stacks"
    stacks.mkdir()
    # the progress watch on, as under `eventbus run` (its heartbeats are not EPOCH_ENDs);
    # the bootstrap's stack dump armed on SIGUSR1, so a child that outlives its budget
    # leaves every thread's stack (this test once hung with nothing on stderr)
    env = subprocess_env(**{ENV_STORE: f"127.0.0.1:{store.port}", ENV_PREFIX: prefix,
                            "RANK": "1", "EVENTBUS_PROGRESS": "collectives,steps,events",
                            "EVENTBUS_STACK_DIR": str(stacks),
                            "EVENTBUS_STACK_SIGNAL": "SIGUSR1"})
    ready = tmp_path / "ready"
    proc = subprocess.Popen([*WORKER, "-c", SCRIPT, mode, str(ready), str(BUDGET_S + 10)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(ready, proc)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=BUDGET_S + 30)
        except subprocess.TimeoutExpired:
            native = native_stacks(proc.pid)
            proc.send_signal(signal.SIGUSR1)
            time.sleep(3)
            proc.kill()
            _, err = proc.communicate(timeout=30)
            dumped = "\n".join(f.read_text(errors="replace") for f in stacks.iterdir())
            handler = tmp_path / "ready.handler"
            where = handler.read_text() if handler.exists() else "(it did not run)"
            raise AssertionError(f"no exit {BUDGET_S + 30:.0f} s after SIGTERM; the script's "
                                 f"handler ran in:\n{where}\nits threads:\n"
                                 f"{dumped or '(no stack written)'}\nnative:\n{native}\n"
                                 f"stderr (faulthandler's dump at {BUDGET_S + 10:.0f} s):\n"
                                 f"{err[-20000:]}") from None
        flush_s = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    if mode == "default":
        assert proc.returncode == -signal.SIGTERM, err[-3000:]
    else:
        assert proc.returncode == 7, err[-3000:]
        assert "in <module>" in (tmp_path / "ready.handler").read_text()  # the handler ran

    bus = eventbus.Bus("row14-agent")
    got: list[eventbus.Event] = []
    bus.subscribe(eventbus.ALL, on_event=got.append)
    rx = StoreReceiver(bus=bus, client=store)
    rx.watch(worker_key(prefix, 1), kind="w", rank=1)
    ended = drain_until_ended(rx)
    indices = [e.data["i"] for e in got if e.type == EventType.EPOCH_END]
    lost = sum(e.fields()["count"] for e in got if e.type == EventType.EVENTS_LOST)
    figure(14, f"{mode} handler: flush + exit {flush_s * 1000:.0f} ms after SIGTERM "
               f"(budget {BUDGET_S:.0f} s); delivered {len(indices):,}, lost {lost}, "
               f"contiguous {indices == list(range(len(indices)))}")
    assert ended
    if mode == "chained":  # what the script's own handler recorded arrived too
        assert [e.fields()["path"] for e in got
                if e.type == EventType.CHECKPOINT_SAVED] == ["at-sigterm"]
    assert indices == list(range(len(indices)))
    assert len(indices) >= 5_000
    assert lost == 0 and rx.stats()["lost"] == {}
    assert flush_s < BUDGET_S
