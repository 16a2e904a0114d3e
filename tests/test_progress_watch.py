"""The worker's progress watch (eventbus_app/worker/progress.py): heartbeats from
torch's optimizer step hook and flight recorder with no call in the script, idle beats that
say where the main thread is, flight-recorder dumps on the agent's request, and the
EVENTBUS_PROGRESS option."""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import eventbus
from eventbus.app.protocol import agent_worker
from eventbus.app.worker import progress
from eventbus.app.worker.progress import TICK_S
from eventbus.app.worker.progress import ProgressWatch
from eventbus.app.worker.progress import StepCounter
from tests.conftest import ROOT
from tests.conftest import WORKER
from tests.conftest import subprocess_env

JOBS = ROOT / "tests" / "jobs"
PLAIN = JOBS / "plain_train.py"
PROBE = JOBS / "progress_probe.py"


def test_the_step_hook_counts_optimizer_steps_in_process() -> None:
    """torch's global optimizer step post hook counts every step of every optimizer, and
    the watch's heartbeat carries the count and the mean step time; removed, it counts
    no more."""
    torch = pytest.importorskip("torch")
    beats: list[dict[str, Any]] = []
    watch = ProgressWatch(frozenset({"steps"}), rank=7, bus=eventbus.Bus("progress-test"),
                          record=lambda _type, **fields: beats.append(fields))
    watch.tick()  # arms: registers the hook (torch.optim is imported)
    assert watch.armed and watch.steps.handle is not None
    param = torch.nn.Parameter(torch.ones(3))
    optimizers = [torch.optim.SGD([param], lr=0.1), torch.optim.Adam([param], lr=0.1)]
    try:
        for _ in range(3):
            for opt in optimizers:
                param.grad = torch.ones(3)
                opt.step()
        watch._beat_t -= progress.BEAT_S  # the next beat is due
        watch.tick()
        assert beats[-1]["step"] == 6 and beats[-1]["worker_id"] == 7
        assert beats[-1]["data"]["sources"] == ["steps"]
        for _ in range(4):
            time.sleep(0.01)
            optimizers[0].step()
        watch._beat_t -= progress.BEAT_S  # the next beat is due
        watch.tick()
        assert beats[-1]["step"] == 10 and beats[-1]["idle_s"] < 1.0
        assert 0.005 < beats[-1]["data"]["step_time_s"] < 1.0
    finally:
        watch.stop()
    optimizers[0].step()
    assert watch.steps.count == 10


def test_recorded_events_count_as_progress() -> None:
    """An event the script records resets idle_s (the beat is not an idle one); with no
    step and no event the beat is idle and says where the main thread is."""
    pytest.importorskip("torch")
    bus = eventbus.Bus("progress-events")
    beats: list[dict[str, Any]] = []
    watch = ProgressWatch(frozenset({"steps", "events"}), rank=0, bus=bus,
                          record=lambda _type, **fields: beats.append(fields))
    try:
        watch.tick()
        time.sleep(0.3)
        bus.record(eventbus.EventType.METRIC, step=1, data={"loss": 1.0})
        watch._beat_t -= progress.IDLE_BEAT_S
        watch.tick()
        assert beats[-1]["idle_s"] < 0.3 and "where" not in beats[-1]["data"]
        time.sleep(0.3)
        watch._beat_t -= progress.IDLE_BEAT_S
        watch.tick()
        assert beats[-1]["idle_s"] >= 0.3
        assert beats[-1]["data"]["where"].startswith("test_progress_watch.py:")
    finally:
        watch.stop()
    assert progress.start_progress_watch(frozenset({"events"})) is None


def test_a_dump_request_is_served_once_and_an_older_one_never(tmp_path: Path) -> None:
    """A request file that predates the watch (a former attempt's) is not served; a new
    token is served at the next tick of an idle rank (a progressing one looks with its
    next heartbeat), once: a beat with fr_dump_token and the dump's path (or why there is
    none)."""
    pytest.importorskip("torch")
    agent_worker.write_fr_request(str(tmp_path), "old")
    beats: list[dict[str, Any]] = []
    watch = ProgressWatch(frozenset({"steps"}), rank=3, dump_dir=str(tmp_path),
                          bus=eventbus.Bus("progress-dump"),
                          record=lambda _type, **fields: beats.append(fields))
    try:
        watch.tick()
        watch.tick()
        assert not any("fr_dump_token" in b["data"] for b in beats)
        agent_worker.write_fr_request(str(tmp_path), "stall-2")
        watch._progress_t -= progress.TICK_S  # idle since a tick: it looks at every tick
        watch.tick()
        watch.tick()
    finally:
        watch.stop()
    served = [b["data"] for b in beats if "fr_dump_token" in b["data"]]
    assert len(served) == 1 and served[0]["fr_dump_token"] == "stall-2"
    assert served[0].get("fr_dump") == str(tmp_path / "fr_trace_rank_3") \
        or served[0]["fr_dump_error"]


def test_a_step_counter_waits_for_the_script_to_import_torch(monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    """Before torch.optim is in sys.modules the counter registers nothing (and imports
    nothing)."""
    monkeypatch.delitem(sys.modules, "torch.optim.optimizer", raising=False)
    counter = StepCounter()
    assert counter.register() is False and counter.handle is None


def _bootstrap(code: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*WORKER, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, env=subprocess_env(**env), timeout=120, check=False)


_THREADS = ("import sys, threading, time; time.sleep(0.3); "
            "print(sorted(t.name for t in threading.enumerate()), 'torch' in sys.modules)")


def test_off_starts_no_thread_and_the_watch_never_imports_torch(tmp_path: Path) -> None:
    """EVENTBUS_PROGRESS=off: no eventbus-progress thread; with sources named, the thread
    runs and torch stays unimported while the script does not import it."""
    off = _bootstrap(_THREADS, tmp_path, EVENTBUS_PROGRESS="off")
    on = _bootstrap(_THREADS, tmp_path, EVENTBUS_PROGRESS="steps,collectives")
    assert off.returncode == on.returncode == 0, off.stderr + on.stderr
    assert "eventbus-progress" not in off.stdout
    assert "'eventbus-progress'" in on.stdout and on.stdout.rstrip().endswith("False")
    assert off.stderr == on.stderr == ""


def test_the_watch_wakes_only_at_its_tick() -> None:
    """What the watch costs a worker is its wake-ups (benchmarks/bench_health.py): its thread
    wakes once per tick (TICK_S, jittered by at most a fifth), never more often. Counted:
    a loaded machine can only make it fewer."""
    watch = ProgressWatch(frozenset({"steps", "collectives"}), rank=0,
                          bus=eventbus.Bus("progress-ticks"), record=lambda *_a, **_k: None)
    watch.start()
    try:
        deadline = time.monotonic() + 30.0
        while watch.ticks == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert watch.ticks > 0, "the watch never ticked"
        first, began = watch.ticks, time.monotonic()
        time.sleep(0.75)  # three ticks: waking twice as often would be six
        woke, window = watch.ticks - first, time.monotonic() - began
    finally:
        watch.stop()
    assert woke <= window / (0.8 * TICK_S) + 1, (woke, window)


def test_the_final_stop_records_one_exiting_beat_after_the_last_step() -> None:
    """stop(final=True), the exit hook's call, records one beat with data["exiting"]."""
    torch = pytest.importorskip("torch")
    beats: list[dict[str, Any]] = []
    watch = ProgressWatch(frozenset({"steps"}), rank=2, bus=eventbus.Bus("progress-final"),
                          record=lambda _type, **fields: beats.append(fields))
    try:
        watch.tick()  # arms: registers the step hook (torch.optim is imported)
        param = torch.nn.Parameter(torch.ones(2))
        param.grad = torch.ones(2)
        opt = torch.optim.SGD([param], lr=0.1)
        for _ in range(3):
            opt.step()
    finally:
        watch.stop(final=True)
    watch.stop(final=True)  # once per watch
    assert beats and all(b["worker_id"] == 2 for b in beats)
    assert beats[-1]["data"].get(agent_worker.EXITING_KEY) is True and beats[-1]["step"] == 3
    assert sum(bool(b["data"].get(agent_worker.EXITING_KEY)) for b in beats) == 1


def test_stop_waits_for_a_flight_recorder_call_and_the_thread_starts_none_after() -> None:
    """The flight-recorder sample is C++ that releases the GIL: a watch thread still inside
    one when the interpreter finalizes aborts a healthy worker (SIGABRT at exit, seen in
    CI). stop() waits for the call in flight, and the watch's thread makes none after it
    (its samples read as None); the exit hook's own thread still may."""
    inside, release, calls = threading.Event(), threading.Event(), []

    def sample(**kwargs: Any) -> bytes:
        calls.append(threading.current_thread().name)
        inside.set()
        release.wait(5)
        return b'{"pg_status": {}}'

    watch = ProgressWatch(frozenset({"collectives"}), rank=0, bus=eventbus.Bus("progress-fr"),
                          record=lambda _type, **fields: None)
    watch._sample = sample
    seen: list[bytes | None] = []
    thread = threading.Thread(target=lambda: seen.append(
        watch._native_sample(includeCollectives=False)), name="fake-watch")
    watch._thread = thread
    thread.start()
    assert inside.wait(5)
    stopper = threading.Thread(target=watch.stop, kwargs={"timeout": 5})
    stopper.start()
    time.sleep(0.2)
    assert stopper.is_alive(), "stop() returned while a sample was in flight"
    release.set()
    stopper.join(5)
    thread.join(5)
    assert seen == [b'{"pg_status": {}}'] and not stopper.is_alive()
    after = threading.Thread(target=lambda: seen.append(
        watch._native_sample(includeCollectives=False)), name="fake-watch-2")
    watch._thread = after
    after.start()
    after.join(5)
    assert seen[-1] is None and calls == ["fake-watch"]
    assert watch._native_sample(includeCollectives=False) is not None  # the exit hook's thread


@pytest.mark.slow  # a worker that imports torch, in a subprocess: ~5 s on 2 cores
def test_the_last_beat_says_the_process_is_exiting(tmp_path: Path) -> None:
    """At the interpreter's exit the watch records one last beat with data["exiting"]
    (after the script's last step), so the agent tells an ending rank from a stalled one."""
    pytest.importorskip("torch")
    code = ("import eventbus, torch\n"
            "eventbus.get_default_bus().subscribe('WORKER_PROGRESS', on_event=lambda e: "
            "print(e.to_json(), flush=True))\n"
            "import time; time.sleep(0.3)\n"
            "p = torch.nn.Parameter(torch.ones(2)); p.grad = torch.ones(2)\n"
            "opt = torch.optim.SGD([p], lr=0.1)\n"
            "for _ in range(3): opt.step()\n")
    run = _bootstrap(code, tmp_path, EVENTBUS_PROGRESS="steps", RANK="2")
    assert run.returncode == 0, run.stderr
    beats = [json.loads(line) for line in run.stdout.splitlines()]
    assert beats and all(b["worker_id"] == 2 for b in beats)
    assert beats[-1]["data"].get(agent_worker.EXITING_KEY) is True and beats[-1]["step"] == 3
    assert not any(b["data"].get(agent_worker.EXITING_KEY) for b in beats[:-1])


def test_a_bad_value_is_one_warning_and_the_script_runs(tmp_path: Path) -> None:
    """A bad EVENTBUS_PROGRESS is one warning naming the variable and the fix; the watch
    uses all three sources and the script runs. A bad EVENTBUS_FR_DUMP_DIR: one warning."""
    run = _bootstrap(_THREADS, tmp_path, EVENTBUS_PROGRESS="steps,colectives",
                     EVENTBUS_FR_DUMP_DIR="relative/dir")
    assert run.returncode == 0 and "'eventbus-progress'" in run.stdout
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 2, run.stderr
    assert "EVENTBUS_PROGRESS='steps,colectives'" in lines[0]
    assert "'colectives'" in lines[0] and "collectives, steps, events" in lines[0]
    assert "EVENTBUS_FR_DUMP_DIR='relative/dir'" in lines[1]
    assert "absolute" in lines[1]


# -- a real 2-process gloo group ------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Job:
    """``torchrun --nproc-per-node 2 progress_probe.py plain_train.py`` with PLAIN_* env;
    each rank's heartbeats land in ``out/rank<R>.jsonl``."""

    def __init__(self, tmp_path: Path, **env: str) -> None:
        self.out = tmp_path / "beats"
        self.out.mkdir()
        torchrun = str(Path(sys.executable).with_name("torchrun"))
        self.proc = subprocess.Popen(
            [torchrun, "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
             "--master-port", str(_free_port()), str(PROBE), str(PLAIN)],
            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
            env=subprocess_env(PROBE_OUT=str(self.out), OMP_NUM_THREADS="1",
                               TORCH_FR_BUFFER_SIZE="64", **env))

    def beats(self, rank: int) -> list[dict[str, Any]]:
        path = self.out / f"rank{rank}.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines()
                if line.endswith("}")]

    def wait_for(self, what: Callable[[], Any], timeout: float, why: str) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = what()
            if found:
                return found
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise AssertionError(f"{why}: not seen in {timeout} s (rc={self.proc.poll()})\n"
                             + self.output())

    def output(self) -> str:
        if self.proc.poll() is None:
            return ""
        return (self.proc.stdout.read() if self.proc.stdout else "")[-4000:]

    def kill(self) -> None:
        """End the job and every worker it started. torchrun starts each worker in a
        session of its own, so killing torchrun's group alone orphans a worker that spins
        (the hang test's culprit): torchrun gets SIGTERM first (it stops its workers), and
        any process still carrying this job's PROBE_OUT is killed after."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        mark = f"PROBE_OUT={self.out}".encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                carries = mark in (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if carries:
                with contextlib.suppress(OSError):
                    os.kill(int(entry.name), signal.SIGKILL)
        if self.proc.stdout:
            self.proc.stdout.close()


@pytest.fixture
def job_factory(tmp_path: Path) -> Iterator[Callable[..., Job]]:
    jobs: list[Job] = []

    def make(**env: str) -> Job:
        jobs.append(Job(tmp_path, **env))
        return jobs[-1]

    yield make
    for job in jobs:
        job.kill()


@pytest.mark.slow
def test_a_healthy_gloo_job_sends_heartbeats_with_groups_and_compute_time(
        job_factory: Callable[..., Job]) -> None:
    """2 ranks, gloo, no eventbus in the script: each rank's heartbeats carry its steps,
    its collectives (process group 0 with both ranks), the compute/wait split and the
    step time, at most about one per second."""
    pytest.importorskip("torch")
    job = job_factory(PLAIN_MODE="healthy", PLAIN_STEPS="120", PLAIN_STEP_S="0.03",
                      EVENTBUS_PROGRESS="collectives,steps,events")
    assert job.proc.wait(timeout=150) == 0, job.output()
    for rank in (0, 1):
        beats = job.beats(rank)
        assert {b["worker_id"] for b in beats} == {rank}
        busy = [b for b in beats if b["idle_s"] == 0.0 and b["data"].get("compute_s")]
        assert busy, beats
        last = busy[-1]
        assert last["data"]["sources"] == ["collectives", "steps", "events"]
        pg = last["data"]["pgs"]["0"]
        assert pg["completed"] == last["collectives"] > 0
        # the members ride in the first beat that has the group (and when they change,
        # and every MEMBERS_EVERY_S), not in every beat
        sent = [b["data"]["pgs"]["0"]["ranks"] for b in beats
                if "ranks" in b["data"].get("pgs", {}).get("0", {})]
        assert sent and all(members == [0, 1] for members in sent)
        assert len(sent) < len([b for b in beats if "0" in b["data"].get("pgs", {})])
        assert 0 < last["step"] <= 120
        # PLAIN_STEP_S of sleep outside the collective per step
        assert 0.02 < last["data"]["compute_s"] < 1.0
        assert last["data"]["wait_s"] >= 0.0 and 0.02 < last["data"]["step_time_s"] < 1.0
        stamps = [b["timestamp"] for b in busy]
        assert all(b - a > 0.8 for a, b in itertools.pairwise(stamps)), stamps


@pytest.mark.slow
def test_a_hang_gives_idle_beats_where_the_peer_waits_and_fr_dumps_on_request(
        job_factory: Callable[..., Job], tmp_path: Path) -> None:
    """Rank 1 spins in Python before step 5's all_reduce: its idle beats name the spinning
    line (plain_train.py:<line> in spin) with every thread's stack, the main thread's
    first; rank 0's beats show all_reduce pending in group 0. A request file makes both
    ranks write their flight-recorder traces, which torch's own fr_trace loader reads."""
    pytest.importorskip("torch")
    loader = pytest.importorskip("torch.distributed.flight_recorder.components.loader")
    dumps = tmp_path / "fr"
    dumps.mkdir()
    line = next(i for i, text in enumerate(PLAIN.read_text().splitlines(), 1)
                if text.rstrip().endswith("the hang"))
    job = job_factory(PLAIN_MODE="hang", PLAIN_STEP="5", PLAIN_STEPS="1000",
                      EVENTBUS_PROGRESS="collectives,steps", EVENTBUS_FR_DUMP_DIR=str(dumps))

    def stuck() -> dict[str, Any] | None:
        return next((b for b in job.beats(1) if b["idle_s"] >= 1.0 and "stack" in b["data"]
                     and b["step"] == 5), None)

    beat = job.wait_for(stuck, 120, "rank 1's idle beat with its stack")
    assert beat["data"]["where"] == f"plain_train.py:{line} in spin"
    stack = beat["data"]["stack"]
    assert stack.startswith('Thread ') and '"MainThread" (main)' in stack.splitlines()[0]
    assert '"eventbus-progress" (eventbus\'s own)' in stack
    assert stack.index("(main)") < stack.index("(eventbus's own)")

    def waiting() -> dict[str, Any] | None:
        return next((b for b in job.beats(0) if b["idle_s"] >= 0.5
                     and "pending" in b["data"]), None)

    beat = job.wait_for(waiting, 30, "rank 0's beat with the pending all_reduce")
    pending = beat["data"]["pending"]["0"]
    assert pending["op"] == "all_reduce" and pending["seq"] == beat["data"]["pgs"]["0"][
        "enqueued"] == beat["data"]["pgs"]["0"]["completed"] + 1
    assert pending["dtypes"] == ["Float"] and len(pending["sizes"]) == 1

    agent_worker.write_fr_request(str(dumps), "stall-1")

    def dumped() -> list[dict[str, Any]] | None:
        found = [b for r in (0, 1) for b in job.beats(r) if "fr_dump_token" in b["data"]]
        return found if len(found) == 2 else None

    for beat in job.wait_for(dumped, 30, "both ranks' fr_dump beats"):
        assert beat["data"]["fr_dump_token"] == "stall-1"
        assert beat["data"]["fr_dump"] == str(dumps / f"fr_trace_rank_{beat['worker_id']}")
    details, version = loader.read_dir(argparse.Namespace(trace_dir=str(dumps), prefix=None))
    assert sorted(d["rank"] for d in details.values()) == [0, 1] and version
    for detail in details.values():
        ops = {e["profiling_name"] for e in detail["entries"]}
        assert "gloo:all_reduce" in ops, ops


@pytest.mark.slow
def test_a_straggler_has_the_compute_time_its_peer_waits(job_factory: Callable[..., Job]
                                                         ) -> None:
    """Lock-step training, rank 1 0.25 s slower per step: both ranks step at the same
    rate, but rank 1's compute_s (outside collectives) is the larger and rank 0's wait_s
    (inside them) the larger: the split a straggler is named by."""
    pytest.importorskip("torch")
    job = job_factory(PLAIN_MODE="straggler", PLAIN_STEP="0", PLAIN_STEPS="25",
                      PLAIN_STEP_S="0.02", EVENTBUS_PROGRESS="collectives,steps")
    assert job.proc.wait(timeout=150) == 0, job.output()

    def mean(rank: int, key: str) -> float:
        values = [b["data"][key] for b in job.beats(rank) if key in b["data"]]
        assert values, job.beats(rank)
        return sum(values) / len(values)

    assert mean(1, "compute_s") > mean(0, "compute_s") + 0.1
    assert mean(0, "wait_s") > mean(1, "wait_s") + 0.1


@pytest.mark.slow
def test_a_collective_mismatch_shows_in_both_ranks_pending_collective(
        job_factory: Callable[..., Job]) -> None:
    """Rank 1 calls broadcast where rank 0 calls all_reduce (gloo hangs both): each
    rank's beat names its own pending collective, same group and sequence number,
    different op."""
    pytest.importorskip("torch")
    job = job_factory(PLAIN_MODE="mismatch", PLAIN_STEP="3", PLAIN_STEPS="1000",
                      EVENTBUS_PROGRESS="collectives,steps")

    def pending(rank: int) -> Callable[[], dict[str, Any] | None]:
        return lambda: next((b["data"]["pending"]["0"] for b in job.beats(rank)
                             if "op" in b["data"].get("pending", {}).get("0", {})), None)

    mine, peer = job.wait_for(pending(0), 120, "rank 0's pending"), \
        job.wait_for(pending(1), 30, "rank 1's pending")
    assert (mine["op"], peer["op"]) == ("all_reduce", "broadcast")
    assert mine["seq"] == peer["seq"] and mine["sizes"] == peer["sizes"]
