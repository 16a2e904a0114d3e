"""The worker side in real child processes: the worker bootstrap attaches the forwarder
from the launcher's environment, and exits of every kind flush it (reliability rows 12-14,
20).

Each test runs a child python with ``EVENTBUS_AGENT_STORE``/``EVENTBUS_STORE_PREFIX``/
``RANK`` set, against a real TCPStore, and drains the queue with a real StoreReceiver.
"""

from __future__ import annotations

import datetime
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from typing import NoReturn

import pytest

import eventbus
from eventbus import ALL
from eventbus import EventType
from eventbus.publishers.store_receiver import StoreReceiver
from eventbus.wire import ENV_PREFIX
from eventbus.wire import ENV_STORE
from eventbus.wire import worker_key
from tests.conftest import WORKER
from tests.conftest import subprocess_env

torch_dist = pytest.importorskip("torch.distributed")

PREFIX = "eventbus/worker-test/0"
RANK = 3
KEY = worker_key(PREFIX, RANK)

# The child: records `n` EPOCH_END events with data {"i": i}, then ends as `mode` says.
CHILD = textwrap.dedent("""
    import faulthandler, os, signal, sys, time
    # every thread's stack on stderr when a test finds the child stuck (_communicate)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    mode, n, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    if mode == "sigterm-chained":
        def mine(signum, frame):
            open(out + ".handler", "w").write("ran")
            sys.exit(7)
        signal.signal(signal.SIGTERM, mine)  # replaces the bootstrap's handler
    import eventbus
    from eventbus import EventType
    # the bootstrap imports no torch before the script's first line, and neither record()
    # nor the forwarder's thread does: its store client is eventbus.store_client.QueueClient
    assert "torch" not in sys.modules
    for i in range(n):
        eventbus.record(EventType.EPOCH_END, epoch=0, data={"i": i})
    assert "torch" not in sys.modules
    if mode == "exit":
        pass
    elif mode == "sys-exit":
        sys.exit(3)
    elif mode == "raise":
        raise RuntimeError("training failed")
    elif mode == "os-exit":
        os._exit(3)
    elif mode.startswith("sigterm"):
        open(out + ".ready", "w").write(str(n))
        i = n
        while True:  # keep recording until the agent's SIGTERM
            eventbus.record(EventType.EPOCH_END, epoch=1, data={"i": i})
            i += 1
            if i % 100 == 0:
                time.sleep(0.001)
    elif mode == "store-down":
        # pace the events so that the store dies mid-stream; report the slowest record()
        worst = 0.0
        for i in range(n, n + 20_000):
            t = time.perf_counter()
            eventbus.record(EventType.EPOCH_END, epoch=1, data={"i": i})
            worst = max(worst, time.perf_counter() - t)
            if i % 200 == 0:
                time.sleep(0.02)
                if i == n + 4_000:
                    open(out + ".ready", "w").write("1")
        print("worst-record-s", worst, flush=True)
    elif mode == "no-env":
        pass
""")


@pytest.fixture
def store() -> Iterator[Any]:
    """A real TCPStore server on a free port."""
    server = torch_dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                 timeout=datetime.timedelta(seconds=10))
    yield server


def _env(port: int, **extra: str) -> dict[str, str]:
    # The progress watch off: its heartbeats would be counted among the child's events.
    return subprocess_env(**{ENV_STORE: f"127.0.0.1:{port}", ENV_PREFIX: PREFIX,
                             "RANK": str(RANK), "EVENTBUS_PROGRESS": "off", **extra})


def _child(tmp_path: Path, mode: str, n: int, env: dict[str, str]) -> subprocess.Popen[str]:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    return subprocess.Popen([*WORKER, str(script), mode, str(n),
                             str(tmp_path / "out")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _drain(port: int, *, until_end: bool = True,
           timeout: float = 30.0) -> tuple[list[eventbus.Event], StoreReceiver]:
    bus = eventbus.Bus("agent")
    got: list[eventbus.Event] = []
    bus.subscribe(ALL, on_event=got.append)
    rx = StoreReceiver(bus=bus, host="127.0.0.1", port=port, connect_timeout=10)
    rx.watch(KEY, kind="w", rank=RANK)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rx.drain_once()
        senders = rx.stats()["senders"]
        if senders and (not until_end or all(s["ended"] for s in senders.values())):
            rx.drain(timeout=5)
            break
        time.sleep(0.02)
    rx.close()
    return got, rx


def _indices(events: list[eventbus.Event]) -> list[int]:
    return [e.data["i"] for e in events if e.type == EventType.EPOCH_END]


def _communicate(proc: subprocess.Popen[str], timeout: float) -> tuple[str, str]:
    """``proc.communicate(timeout)``; a child still running after it fails the test with
    every thread's stack (the child's faulthandler, on SIGUSR1) and what it wrote, and is
    killed: a hang explains itself instead of ending the test with nothing on stderr."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _fail_with_stacks(proc, f"the child did not exit within {timeout:g} s")


def _fail_with_stacks(proc: subprocess.Popen[str], reason: str) -> NoReturn:
    proc.send_signal(signal.SIGUSR1)
    time.sleep(2.0)
    proc.kill()
    out, err = proc.communicate(timeout=30)
    raise AssertionError(f"{reason}; its threads and output:\n{err[-12_000:]}\n"
                         f"{out[-2_000:]}")


def _wait_for(path: Path, proc: subprocess.Popen[str], timeout: float = 60.0) -> None:
    """Wait for the child to create ``path``; past ``timeout``, fail with its stacks."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"child ended early: {proc.communicate()}")
        if time.monotonic() > deadline:
            _fail_with_stacks(proc, f"{path} never appeared within {timeout:g} s")
        time.sleep(0.02)


def test_the_bootstrap_stays_torch_free_without_the_launcher_env(tmp_path: Path) -> None:
    """Without EVENTBUS_AGENT_STORE, the worker bootstrap attaches nothing and imports no
    torch (the child asserts it)."""
    env = subprocess_env()
    env.pop(ENV_STORE, None)
    proc = _child(tmp_path, "no-env", 10, env)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "code", "n"),
                         [("exit", 0, 10_000), ("sys-exit", 3, 2_000), ("raise", 1, 2_000),
                          ("os-exit", 3, 2_000)])
def test_every_event_arrives_when_the_worker_exits(store: Any, tmp_path: Path, mode: str,
                                                   code: int, n: int) -> None:
    """Every event recorded by a worker that exits normally (10,000), by sys.exit, by an
    exception or by os._exit reaches the agent, numbered without gaps, with the end marker
    (row 13)."""
    proc = _child(tmp_path, mode, n, _env(store.port))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    got, rx = _drain(store.port)
    assert _indices(got) == list(range(n))
    assert rx.stats()["lost"] == {} and rx.stats()["rejected"] == {}
    (sender,) = rx.stats()["senders"].values()
    assert sender["ended"] and sender["next_seq"] == n


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sigterm", "sigterm-chained"])
def test_sigterm_flushes_and_chains_the_scripts_handler(store: Any, tmp_path: Path,
                                                        mode: str) -> None:
    """The agent's SIGTERM mid-stream: every event recorded before it arrives, contiguous,
    with the end marker; with no handler of its own the worker still dies by SIGTERM, with
    one the script's handler still runs (row 14)."""
    proc = _child(tmp_path, mode, 2_000, _env(store.port))
    _wait_for(tmp_path / "out.ready", proc)
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = _communicate(proc, timeout=60)
    if mode == "sigterm":
        assert proc.returncode == -signal.SIGTERM, err
    else:
        assert proc.returncode == 7, err
        assert (tmp_path / "out.handler").read_text() == "ran"
    got, rx = _drain(store.port)
    indices = _indices(got)
    assert len(indices) > 2_000
    assert indices == list(range(len(indices))), "contiguous, nothing doubled"
    (sender,) = rx.stats()["senders"].values()
    assert sender["ended"] and sender["next_seq"] == len(indices)
    assert rx.stats()["lost"] == {}


DATALOADER = textwrap.dedent("""
    import sys
    import torch
    import eventbus
    from eventbus import EventType

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 400
        def __getitem__(self, i):
            eventbus.record(EventType.METRIC, step=i, data={"i": i})
            return i

    if __name__ == "__main__":
        for i in range(100):
            eventbus.record(EventType.EPOCH_START, epoch=i)
        loader = torch.utils.data.DataLoader(Data(), batch_size=10, num_workers=4,
                                             multiprocessing_context="fork")
        seen = sorted(int(x) for batch in loader for x in batch)
        assert seen == list(range(400)), seen
""")


@pytest.mark.slow
def test_dataloader_workers_forward_their_own_events(store: Any, tmp_path: Path) -> None:
    """DataLoader workers (fork, num_workers=4) recording in __getitem__: every event
    arrives once, from a sender per worker process; none of the parent's is doubled
    (row 12: published = delivered + reported lost, here lost 0)."""
    script = tmp_path / "loader.py"
    script.write_text(DATALOADER)
    proc = subprocess.run([*WORKER, str(script)], env=_env(store.port), check=False,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    got, rx = _drain(store.port)
    steps = sorted(e.step for e in got if e.type == EventType.METRIC)
    assert steps == list(range(400))
    epochs = [e.epoch for e in got if e.type == EventType.EPOCH_START]
    assert epochs == list(range(100))
    pids = {e.pid for e in got if e.type == EventType.METRIC}
    assert len(pids) == 4
    assert len(rx.stats()["senders"]) == 5
    assert rx.stats()["lost"] == {}


SERVER = textwrap.dedent("""
    import datetime, sys, time
    from torch.distributed import TCPStore
    s = TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True, wait_for_workers=False,
                 timeout=datetime.timedelta(seconds=30))
    print("up", flush=True)
    time.sleep(3600)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _server(tmp_path: Path, port: int) -> subprocess.Popen[str]:
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    proc = subprocess.Popen([sys.executable, str(script), str(port)], env=subprocess_env(),
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "up"
    return proc


@pytest.mark.slow
def test_store_going_away_never_blocks_record_and_the_gap_equals_the_loss(
        tmp_path: Path) -> None:
    """The store server is killed mid-stream and a new one comes up on its port: the
    worker's record() never raises or hangs, the worker reports the loss, and the gap the
    receiver finds by sequence numbers equals the events that never arrived (row 20)."""
    port = _free_port()
    server = _server(tmp_path, port)
    bus = eventbus.Bus("agent")
    got: list[eventbus.Event] = []
    bus.subscribe(ALL, on_event=got.append)
    rx = StoreReceiver(bus=bus, host="127.0.0.1", port=port, connect_timeout=10,
                       reconnect_interval=0.2)
    rx.watch(KEY, kind="w", rank=RANK)
    rx.start()
    worker = None
    second = None
    try:
        worker = _child(tmp_path, "store-down", 0,
                        _env(port))
        _wait_for(tmp_path / "out.ready", worker)
        # Mid-stream: the worker's first pushes have arrived (its first connect, probe
        # included, takes a few tens of ms after it starts recording).
        deadline = time.monotonic() + 30
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
        server.kill()
        server.wait(10)
        time.sleep(1.0)
        second = _server(tmp_path, port)
        _out, err = worker.communicate(timeout=180)
        assert worker.returncode == 0, err
        assert "events lost" in err
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            senders = rx.stats()["senders"]
            if senders and all(s["ended"] for s in senders.values()):
                break
            time.sleep(0.05)
        rx.stop()
        rx.drain(timeout=10)
    finally:
        rx.close()
        for proc in (worker, server, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)
    recorded = 20_000
    delivered = len(_indices(got))
    gaps = sum(e.count for e in got if e.type == EventType.EVENTS_LOST)
    assert 0 < delivered < recorded
    assert delivered + gaps == recorded, (delivered, gaps, rx.stats()["lost"])
    assert rx.stats()["lost"].keys() <= {"gap", "dropped by sender"}


FORKS = textwrap.dedent("""
    import os, sys, threading, time
    import eventbus
    from eventbus import EventType
    import eventbus.subscribers.store_forwarder as sf

    fwd = sf._worker_forwarder
    bus = eventbus.get_default_bus()
    parent_sender = fwd.sender
    hold, release = threading.Event(), threading.Event()

    def holder():
        with bus._lock:
            hold.set()
            release.wait(30)

    children = []
    with fwd._client_lock:  # the parent's events stay queued across the forks
        for i in range(100):
            eventbus.record(EventType.EPOCH_END, epoch=0, data={"i": i})
        thread = threading.Thread(target=holder)
        thread.start()
        hold.wait(10)
        for n in range(5):
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    assert fwd.sender != parent_sender and fwd.sink.pending == 0
                    for i in range(50):
                        eventbus.record(EventType.EPOCH_START, epoch=1000 * (n + 1) + i)
                    code = 0 if fwd.close(20.0) else 2
                finally:
                    os._exit(code)
            children.append(pid)
        release.set()
        thread.join()
    codes = []
    deadline = time.monotonic() + 60
    for pid in children:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes.append(os.waitstatus_to_exitcode(status))
                break
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                codes.append("hung")
                break
            time.sleep(0.01)
    print(" ".join(str(p) for p in children), flush=True)
    assert codes == [0] * 5, codes
""")


@pytest.mark.slow
def test_forked_children_send_as_new_senders_and_never_duplicate_the_parent_queue(
        store: Any, tmp_path: Path) -> None:
    """Forks taken while another thread holds the bus lock and the parent's forwarder has
    100 events queued: each child numbers its own events from 0 under a new sender id on
    its own client, and the parent's queued events arrive once, from the parent (row 11)."""
    script = tmp_path / "forks.py"
    script.write_text(FORKS)
    proc = subprocess.run([*WORKER, str(script)], env=_env(store.port), check=False,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    children = {int(p) for p in proc.stdout.split()}
    got, rx = _drain(store.port)
    assert _indices(got) == list(range(100))
    by_pid: dict[int, list[int]] = {}
    for e in got:
        if e.type == EventType.EPOCH_START:
            by_pid.setdefault(e.pid, []).append(e.epoch)
    assert set(by_pid) == children
    for epochs in by_pid.values():
        assert len(epochs) == 50 and epochs == sorted(epochs)
    senders = rx.stats()["senders"]
    assert len(senders) == 6 and all(s["ended"] for s in senders.values())
    assert rx.stats()["lost"] == {}


IDLE = r"""
import sys, time
import eventbus
from eventbus.subscribers.store_forwarder import worker_forwarder
eventbus.record("EPOCH_END", epoch=0)       # before the script's own import torch
assert "torch" not in sys.modules
forwarder = worker_forwarder()
assert forwarder.flush(30), forwarder.stats()
time.sleep(0.2)                             # the queue's thread settles into its wait
woken = forwarder.sink.wakeups
time.sleep(1.0)
print("idle-wakeups", forwarder.sink.wakeups - woken, flush=True)
eventbus.record("EPOCH_END", epoch=1)       # and the next event still leaves at once
deadline = time.monotonic() + 30
while forwarder.stats()["pushed"] < 2 and time.monotonic() < deadline:
    time.sleep(0.01)
print("pushed", forwarder.stats()["pushed"], "torch", "torch" in sys.modules, flush=True)
"""


def test_a_worker_forwarder_with_nothing_queued_never_wakes(store: Any) -> None:
    """Counted, not timed: in a real worker (the bootstrap, a real TCPStore), the
    forwarder's thread comes back from no wait at all over a second with nothing queued,
    the next event still reaches the store with no flush, and nothing imported torch."""
    done = subprocess.run([*WORKER, "-c", IDLE], env=_env(store.port), capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    words = done.stdout.split()
    assert int(words[words.index("idle-wakeups") + 1]) == 0, done.stdout
    assert int(words[words.index("pushed") + 1]) == 2, done.stdout
    assert words[words.index("torch") + 1] == "False", done.stdout
    got, _ = _drain(store.port, until_end=True)
    assert [e.epoch for e in got if e.type == EventType.EPOCH_END] == [0, 1]
