"""The agent of group rank 0 at 1,024 to 8,192 ranks: a simulated job, the real agent parts.

    python benchmarks/bench_scale.py [--quick] [--json]

Nothing here can run 8,192 workers: :mod:`benchmarks.scale_job` simulates them (a
process pushing every other node's heartbeats as its agent would, in the real wire
format), and everything the agent of group rank 0 runs is real:

* a ``torch.distributed.TCPStore`` master on a free port, in the agent's process (as on
  the rendezvous host), closed at the end;
* the :class:`~eventbus.app.launcher.transport.store.StoreTransport`, started by its
  ``after_rendezvous`` with group rank 0's :class:`~eventbus.app.plugins.RendezvousInfo`:
  its worker receiver (8 worker queues, with the doorbell) and its job receiver (one queue
  per other node, polled with pipelined pops), both
  :class:`~eventbus.publishers.store_receiver.StoreReceiver`;
* a :class:`~eventbus.bus.Bus` with what the agent subscribes to it: the job view's
  :class:`~eventbus.app.ui.state.JobState` (its folder thread running, as ``--ui`` runs it)
  and the health watches' one observer (:func:`~eventbus.app.health.watches.observer` of a
  ``StallWatch("auto")`` and a ``StragglerWatch``), plus a probe that notes each heartbeat's
  arrival (one ``list.append``).

One agent process per size with the beats as the workers send them, and one per size whose
beats carry ``ranks: []`` instead of the world group's member list (what the list costs,
and the transport's own curve). Measured over a window of seconds after a warm-up (every
rank has beaten), or less where the agent falls :data:`MAX_BEHIND_S` of beats behind (the
store keeps that backlog in the agent's memory):

* receiving: the CPU time of the receivers' threads (``eventbus-store-receiver``, both,
  and ``eventbus-store-bell``), read from ``/proc/self/task/<tid>/schedstat``, as a share of
  one core: decoding, validating and publishing, the subscribers' share included; folding:
  the job view's folder thread (``eventbus-ui-fold``). CPU time, not wall time: robust to
  the simulator and other processes sharing the cores. Also per beat that reached the bus
  in the window, and what that comes to at the job's beat rate: where the agent
  fell behind (its thread given less CPU than it needs on a shared machine) that is what
  the job's rate would cost. The store's server thread (a native thread of the agent's
  process) is given apart;
* heartbeat-to-bus latency: the beat's timestamp (taken in the simulator when the rank
  beats) to its arrival on the agent's bus, p50 and p99 over every beat of the window;
  a beat not arrived within :data:`LATE_S` of the window's end counts as infinitely late.
  The hop from a worker to its own node's agent is not simulated: add its ~20 ms flush;
* the agent process's resident memory after the window (the per-rank state it keeps).

Then, in the calling thread's CPU time (the garbage collections it triggers included;
wall time on a shared machine would time the other processes too):

* the culprit analysis at a stall, as the agent's monitor calls it at group rank 0:
  ``Judge.overdue`` and ``Judge.verdict`` (which runs ``culprit.progress_of`` over each
  rank's latest beat and ``culprit.analyze``), over a fresh ``StallWatch`` holding every
  rank's decoded beat: every rank waits in all_reduce #K+1 of the world group, except one
  rank on another node that has not entered it;
* the monitor's other per-second work at group rank 0: the straggler check
  (``StragglerWatch.check``) and the stall watch's scan (``StallWatch.overdue``), once each
  over the live watches after the window;
* ``/api/state``: ``dumps(state.snapshot())`` as the server builds it, its size and time.

Memory over time: an hour of heartbeats at 8,192 ranks is 29.5 M events, too many to
push; instead a sample of ranks is folded for a simulated hour at accelerated time (see
:func:`hour`), reading the resident memory and the interpreter's allocated blocks every
simulated five minutes.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script (the agent and simulator processes)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.scale_job import COLLECTIVES_PER_S
from benchmarks.scale_job import HOST
from benchmarks.scale_job import NODE_FLUSH_S
from benchmarks.scale_job import RANKS_PER_NODE
from benchmarks.scale_job import RUN_ID
from benchmarks.scale_job import STEPS_PER_S
from benchmarks.scale_job import live_template
from benchmarks.scale_job import simulate
from benchmarks.scale_job import stalled_beats

__all__ = ["SIZES", "culprit_cost", "hour", "run"]

ROOT = Path(__file__).resolve().parents[1]

#: the rank counts simulated, and those of a quick run
SIZES = (1024, 2048, 4096, 8192)
QUICK_SIZES = (1024,)
#: seconds measured per size after the warm-up, beats with the member list and without
#: (quick: a smoke run)
WINDOW_S, BARE_WINDOW_S, QUICK_WINDOW_S = 6.0, 5.0, 2.0
WARMUP_S, QUICK_WARMUP_S = 1.5, 1.0
#: a beat of the window not on the bus this long after the window is counted as lost
LATE_S = 2.0
#: the agent this many seconds of beats behind ends the window early: the store keeps the
#: backlog in the agent's memory (40 KB a beat at 8,192 ranks), and the run is answered
MAX_BEHIND_S = 3.0
#: the memory run: ranks of a job of HOUR_WORLD ranks, simulated seconds, a reading every
HOUR_WORLD = 1024
HOUR_RANKS, QUICK_HOUR_RANKS = 16, 8
HOUR_S, QUICK_HOUR_S = 3600, 600
HOUR_READ_EVERY_S = 300
#: the targets of PERFORMANCE.md ("Scale"), at 8,192 ranks
TARGET_RECEIVING_PCT = 25.0
TARGET_P99_MS = 1000.0
TARGET_CULPRIT_MS = 100.0
TARGET_STATE_BYTES = 2 * 1024 * 1024
TARGET_STATE_MS = 100.0
#: an hour's growth (last reading over the first after the warm-up) counted as flat
FLAT_GROWTH = 1.05


# -- the agent process ---------------------------------------------------------------------

def _tasks() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def _cpu_s(tid: int) -> float:
    """CPU seconds of one thread of this process (ns precision where schedstat exists)."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat", encoding="ascii") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(f"/proc/self/task/{tid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def _threads_by_role(store_tids: set[int]) -> dict[str, list[int]]:
    """The agent's threads that receive, fold and serve the store, by role."""
    roles: dict[str, list[int]] = {"receiving": [], "folding": [], "store": sorted(store_tids)}
    for thread in threading.enumerate():
        tid = thread.native_id
        if tid is None:
            continue
        if thread.name in ("eventbus-store-receiver", "eventbus-store-bell"):
            roles["receiving"].append(tid)
        elif thread.name == "eventbus-ui-fold":
            roles["folding"].append(tid)
    return roles


def _cpu_by_role(roles: dict[str, list[int]]) -> dict[str, float]:
    return {role: sum(_cpu_s(t) for t in tids) for role, tids in roles.items()}


def _rss_mib() -> float:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile of sorted ``values`` (nearest rank)."""
    if not values:
        return math.nan
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


def culprit_cost(ranks: int, *, repeats: int = 3, members: bool = True) -> dict[str, Any]:
    """The agent's stall check at a stall over ``ranks`` ranks (median ms of ``repeats``):
    ``Judge.overdue`` + ``Judge.verdict`` (the culprit analysis included) and, apart,
    ``culprit.progress_of`` over every rank's beat and ``culprit.analyze``."""
    from eventbus.app.health import culprit
    from eventbus.app.health.judge import Judge
    from eventbus.app.health.watches import StallWatch

    events, expected = stalled_beats(ranks, members=members)
    now = [1_000.0]
    watch = StallWatch("auto", clock=lambda: now[0])
    for event in events:
        watch.observe(event)
    now[0] += 120.0  # the auto timeout's floor is 60 s
    judge = Judge(watch, None, clock=lambda: now[0])
    everyone = judge.ranks_to_watch(0, range(RANKS_PER_NODE), is_judge=True)
    verdicts, progress_ms, analyze_ms = [], [], []
    verdict = None
    for _ in range(repeats):
        t = time.thread_time()
        overdue = judge.overdue(0, everyone)
        verdict = judge.verdict(0, overdue, is_judge=True, ranks=everyone)
        verdicts.append((time.thread_time() - t) * 1e3)
        beats = watch.beats(0)
        t = time.thread_time()
        progress = [p for beat, age in beats.values()
                    for p in [culprit.progress_of(beat, age_s=age)] if p is not None]
        progress_ms.append((time.thread_time() - t) * 1e3)
        t = time.thread_time()
        culprit.analyze(progress)
        analyze_ms.append((time.thread_time() - t) * 1e3)
    if verdict is None or verdict.analysis.culprit_ranks != (expected,):
        raise RuntimeError(f"the culprit analysis named {verdict and verdict.analysis} at "
                           f"{ranks} ranks, not rank {expected}")
    return {"verdict ms": statistics.median(verdicts),
            "progress_of ms": statistics.median(progress_ms),
            "analyze ms": statistics.median(analyze_ms),
            "diagnosis": verdict.analysis.diagnosis}


def agent(ranks: int, window: float, warmup: float, members: bool) -> dict[str, Any]:
    """(see _agent) The beats as sent now come at the interval the agent sets for the
    job's size (protocol.beat_interval); with the member list, as before, once a second."""
    from eventbus.app.protocol.agent_worker import beat_interval

    return _agent(ranks, window, warmup, members, 1.0 if members else beat_interval(ranks))


def _agent(ranks: int, window: float, warmup: float, members: bool,
           period: float) -> dict[str, Any]:
    """The agent process: store, transport, bus and subscribers; the simulator as a child;
    the figures of one size."""
    import datetime
    import logging

    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    from eventbus.app.health.watches import StallWatch
    from eventbus.app.health.watches import StragglerWatch
    from eventbus.app.health.watches import observer
    from eventbus.app.launcher.cli.options import DEFAULT_SLOW_FACTOR
    from eventbus.app.launcher.transport.store import StoreTransport
    from eventbus.app.plugins import RendezvousInfo
    from eventbus.app.ui.server import dumps
    from eventbus.app.ui.state import JobState
    from eventbus.bus import ALL
    from eventbus.bus import Bus
    from eventbus.events import EventType
    from eventbus.wire import ENV_BELL
    from eventbus.wire import ENV_PREFIX
    from eventbus.wire import namespace

    nodes = ranks // RANKS_PER_NODE
    before = _tasks()
    master = TCPStore(HOST, 0, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=60))
    store_tids = _tasks() - before - {threading.get_native_id()}
    # every rank beats within the warm-up, and at least twice in the window
    warmup, window = max(warmup, period + 1.0), max(window, 2 * period)
    seconds = warmup + window
    # the simulator imports torch and checks its pushes while this process sets up
    sim = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--simulate", json.dumps(
            {"port": int(master.port), "ranks": ranks, "seconds": seconds, "warmup": warmup,
             "members": members, "period": period})],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_child_env(), cwd=ROOT)
    bus = Bus("scale-agent")
    # as the agent subscribes them: the job view (--ui) and the health watches' observer
    state = JobState()
    bus.subscribe(ALL, on_event=state)
    state.start()
    stall, straggler = StallWatch("auto"), StragglerWatch(DEFAULT_SLOW_FACTOR)
    observe = observer(stall, straggler)
    assert observe is not None
    bus.subscribe(ALL, on_event=observe)
    arrivals: list[tuple[float, float]] = []
    note, clock = arrivals.append, time.time

    def probe(event: Any) -> None:
        note((event.timestamp, clock()))

    bus.subscribe(EventType.WORKER_PROGRESS, on_event=probe)
    transport = StoreTransport()
    info = RendezvousInfo(store_host=HOST, store_port=int(master.port), run_id=RUN_ID,
                          group_rank=0, group_world_size=nodes, restart_count=0,
                          local_world_size=RANKS_PER_NODE, world_size=ranks,
                          global_ranks=tuple(range(RANKS_PER_NODE)), bus=bus)
    env = transport.after_rendezvous(info)
    if env[ENV_PREFIX] != namespace(RUN_ID, 0):
        raise RuntimeError(f"the transport's key prefix is {env[ENV_PREFIX]!r}")
    gc.freeze()  # as the agent does after its first rendezvous
    roles = _threads_by_role(store_tids)
    rss_before = _rss_mib()
    try:
        master.wait(["scale/ready"], datetime.timedelta(seconds=120))
        master.set("scale/bell", env[ENV_BELL])
        t0 = time.time() + 0.3
        master.set("scale/go", repr(t0))
        time.sleep(max(0.0, t0 + warmup - time.time()))
        cpu0, proc0, wall0 = _cpu_by_role(roles), time.process_time(), time.perf_counter()
        began = time.time()
        stopped = False
        while time.time() < t0 + seconds:
            time.sleep(min(0.25, max(0.0, t0 + seconds - time.time())))
            # beats due by now (each rank beats once an interval, pushed within 50 ms)
            behind = ranks / period * (time.time() - t0 - NODE_FLUSH_S) - len(arrivals)
            if behind > MAX_BEHIND_S * ranks / period:
                master.set("scale/stop", repr(time.time()))
                stopped = True
                break
        cpu1, proc1, wall1 = _cpu_by_role(roles), time.process_time(), time.perf_counter()
        ended = time.time()
        out, err = sim.communicate(timeout=120)
    finally:
        if sim.poll() is None:
            sim.kill()
            sim.wait()
    if sim.returncode != 0 or not out.strip():
        raise RuntimeError(f"the simulator failed ({sim.returncode}): {err[-3000:]}")
    pushed = json.loads(out.strip().splitlines()[-1])
    lo, hi = t0 + warmup, pushed["window end"]
    expected = pushed["beats in window"]
    deadline = time.time() + (0.0 if stopped else LATE_S)  # behind: it will not catch up
    while time.time() < deadline and sum(1 for s, _ in arrivals if lo <= s < hi) < expected:
        time.sleep(0.05)
    got = sorted(at - stamp for stamp, at in list(arrivals) if lo <= stamp < hi)
    delivered = len(got)
    latencies = got + [math.inf] * max(0, expected - delivered)
    span = wall1 - wall0
    share = {role: (cpu1[role] - cpu0[role]) / span * 100 for role in cpu0}
    # per beat that reached the bus while the CPU was measured (backlog included): what
    # the rate the job sends (one beat per rank per interval) costs, however loaded the
    # machine
    handled = sum(1 for _, at in list(arrivals) if began <= at < ended)
    per_beat = {role: (cpu1[role] - cpu0[role]) / handled * 1e6 if handled else math.nan
                for role in ("receiving", "folding")}
    rss_after = _rss_mib()
    # /api/state as the server builds it (the server folds first; so does snapshot())
    state.fold()
    sizes, builds = [], []
    for _ in range(3):
        t = time.thread_time()
        body = dumps(state.snapshot())
        builds.append((time.thread_time() - t) * 1e3)
        sizes.append(len(body))
    # the monitor's per-second checks at group rank 0, over the live watches
    t = time.thread_time()
    slow = straggler.check(0)
    straggler_ms = (time.thread_time() - t) * 1e3
    t = time.thread_time()
    stall.overdue(0, stall.ranks(0))
    scan_ms = (time.thread_time() - t) * 1e3
    ranks_seen = len(stall.beats(0))
    logging.getLogger("eventbus").setLevel(logging.ERROR)  # the teardown's leftovers
    stats = transport.stats()
    if delivered >= 0.99 * expected:
        transport.before_exit(timeout=2.0)
    else:
        # far behind: the exit's drain would work through the whole backlog (one round of
        # drain_once pops up to 64 values of each of the 1,023 node queues whatever the
        # budget), so the receivers are only stopped
        for receiver in (transport.receiver, transport.job_receiver):
            if receiver is not None:
                receiver.stop()
        if transport.ledger_root is not None:
            shutil.rmtree(transport.ledger_root, ignore_errors=True)
    state.stop()
    del master
    cost = culprit_cost(ranks, repeats=1 if ranks >= 8192 and members else 3,
                        members=members)
    lost = sum(sum((part or {}).get("lost", {}).values()) for part in
               (stats["workers"], stats["nodes"]))
    rejected = sum(sum((part or {}).get("rejected", {}).values()) for part in
                   (stats["workers"], stats["nodes"]))
    return {
        "ranks": ranks, "nodes": nodes, "members": members,
        "beats/s": round(pushed["beats/s"]),
        "pushes/s": round(pushed["pushes/s"]),
        "wire KiB/beat": pushed["entry bytes"] / 1024,
        "receiving % of a core": share["receiving"],
        "folding % of a core": share["folding"],
        "receiving + folding % of a core": share["receiving"] + share["folding"],
        "receiving us/beat": per_beat["receiving"],
        "folding us/beat": per_beat["folding"],
        "beat interval s": period,
        "receiving + folding at the job's beat rate, % of a core": (
            (per_beat["receiving"] + per_beat["folding"]) * ranks / period / 1e4),
        "store server % of a core": share["store"],
        "agent process % of a core": (proc1 - proc0) / span * 100,
        "simulator % of a core": pushed["cpu %"],
        "window s": hi - lo,
        "stopped behind": stopped,
        "beats in window": expected,
        "delivered %": delivered / expected * 100 if expected else math.nan,
        "p50 ms": _percentile(latencies, 0.50) * 1e3,
        "p99 ms": _percentile(latencies, 0.99) * 1e3,
        "simulator lag p99 ms": pushed["lag p99 ms"],
        "ranks in the stall watch": ranks_seen,
        "lost or rejected": lost + rejected,
        "straggler check ms": straggler_ms, "stragglers found": len(slow),
        "stall scan ms": scan_ms,
        "/api/state KiB": statistics.median(sizes) / 1024,
        "/api/state ms": statistics.median(builds),
        "culprit verdict ms": cost["verdict ms"],
        "culprit progress_of ms": cost["progress_of ms"],
        "culprit analyze ms": cost["analyze ms"],
        "diagnosis": cost["diagnosis"],
        "rss MiB before": rss_before, "rss MiB after": rss_after,
    }


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("LOGLEVEL", "WARNING")
    return env


def _in_child(flag: str, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), flag,
                           json.dumps(payload)], env=_child_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0 or not proc.stdout.strip():
        raise RuntimeError(f"bench_scale {flag} failed ({proc.returncode}): "
                           f"{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


# -- memory over a simulated hour ----------------------------------------------------------

def hour(world: int, sample: int, seconds: int, every: int) -> dict[str, Any]:
    """Fold ``seconds`` of heartbeats of ``sample`` ranks (whole nodes, spread over a job
    of ``world`` ranks, the world group's member list in each beat) at accelerated time:
    each simulated second, every sampled node's push is decoded by the real receiver
    (``StoreReceiver.handle_value``, no store), published on a bus with the job view and
    the watches subscribed (their clocks: the simulated time), and the view folds. Reads
    the resident memory and the interpreter's allocated blocks every ``every`` simulated
    seconds."""
    from eventbus.app.health.watches import StallWatch
    from eventbus.app.health.watches import StragglerWatch
    from eventbus.app.health.watches import observer
    from eventbus.app.launcher.cli.options import DEFAULT_SLOW_FACTOR
    from eventbus.app.ui.state import JobState
    from eventbus.bus import ALL
    from eventbus.bus import Bus
    from eventbus.publishers.store_receiver import StoreReceiver
    from eventbus.wire import BatchEncoder
    from eventbus.wire import node_key

    start = 1.7e9
    now = [start]

    def sim_clock() -> float:
        return now[0]

    bus = Bus("scale-hour")
    state = JobState(clock=sim_clock)
    bus.subscribe(ALL, on_event=state)
    observe = observer(StallWatch("auto", clock=sim_clock),
                       StragglerWatch(DEFAULT_SLOW_FACTOR, clock=sim_clock))
    assert observe is not None
    bus.subscribe(ALL, on_event=observe)
    receiver = StoreReceiver(bus=bus, client=object())
    template = live_template(world, members=True)
    nodes = list(range(1, world // RANKS_PER_NODE, (world // RANKS_PER_NODE) //
                       max(1, sample // RANKS_PER_NODE)))[:max(1, sample // RANKS_PER_NODE)]
    encoders = {node: BatchEncoder(kind="n", rank=node) for node in nodes}
    keys = {node: node_key("eventbus/scale/0", node) for node in nodes}
    readings: list[dict[str, Any]] = []
    gc.freeze()  # as the agent does after its first rendezvous
    cpu0 = time.process_time()
    try:
        for second in range(seconds + 1):
            if second % every == 0:
                gc.collect()
                readings.append({"simulated min": second // 60, "rss MiB": _rss_mib(),
                                 "allocated blocks": sys.getallocatedblocks(),
                                 "events folded": state.events})
            if second == seconds:
                break
            now[0] = start + second
            step, done = STEPS_PER_S * (second + 1), COLLECTIVES_PER_S * (second + 1)
            for node in nodes:
                beats = [(r, now[0] + 0.1 * (r % RANKS_PER_NODE), step, done, done, done)
                         for r in range(node * RANKS_PER_NODE, (node + 1) * RANKS_PER_NODE)]
                receiver.handle_value(keys[node], template.push(encoders[node], beats),
                                      kind="n", rank=node)
            now[0] += 1.0
            state.fold()
    finally:
        gc.unfreeze()  # (a test calls this in its own process)
    return {"world": world, "ranks": len(nodes) * RANKS_PER_NODE,
            "simulated s": seconds, "events": receiver.delivered,
            "cpu s": time.process_time() - cpu0, "readings": readings}


# -- the benchmark -------------------------------------------------------------------------

def _growth(rows: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """``key`` at each size and the exponent of the power law fitted to it (1: linear in
    ranks, 2: quadratic); sizes where it is not a finite positive number are left out of
    the fit (a window that fell behind has no finite p99)."""
    row: dict[str, Any] = {"cost": key}
    points = []
    for r in rows:
        value = r.get(key)
        row[f"{r['ranks']:,}"] = value
        if isinstance(value, (int, float)) and math.isfinite(value) and value > 0:
            points.append((math.log(r["ranks"]), math.log(value)))
    if len(points) < 2:
        row["grows as ranks^"] = "-"
        return row
    mx = statistics.fmean(x for x, _ in points)
    my = statistics.fmean(y for _, y in points)
    row["grows as ranks^"] = (sum((x - mx) * (y - my) for x, y in points)
                              / sum((x - mx) ** 2 for x, _ in points))
    return row


def _target(what: str, value: float, limit: float) -> dict[str, Any]:
    return {"target": what, "value": value, "limit": limit, "met": value <= limit}


GROWTH_KEYS = ("wire KiB/beat", "receiving + folding % of a core", "receiving us/beat",
               "folding us/beat", "receiving + folding at the job's beat rate, % of a core",
               "store server % of a core", "p50 ms", "p99 ms", "delivered %",
               "culprit verdict ms", "straggler check ms", "/api/state KiB",
               "/api/state ms", "rss MiB after")
FULL_RATE = "receiving + folding at the job's beat rate, % of a core"


def _cost_at_rate(row: dict[str, Any]) -> float:
    """Receiving and folding at the job's rate: what was measured, or where the agent fell
    behind (the machine's cores shared, the receiver given less than it needs) what its
    CPU time per beat comes to at the job's beat rate, whichever is larger."""
    share = float(row["receiving + folding % of a core"])
    estimate = float(row[FULL_RATE])
    return max(share, estimate) if math.isfinite(estimate) else share


def run(*, quick: bool = False) -> dict[str, Any]:
    """One agent process per size with the beats as the workers send them (the world
    group's member list in each), one per size without the list, the growth of each cost,
    the simulated hour, the targets."""
    from benchmarks.bench_store import calibration

    sizes = QUICK_SIZES if quick else SIZES
    warmup = QUICK_WARMUP_S if quick else WARMUP_S
    load_before = os.getloadavg()[0]
    rows: list[dict[str, Any]] = []
    bare: list[dict[str, Any]] = []
    for members, window, out in ((True, WINDOW_S, rows), (False, BARE_WINDOW_S, bare)):
        for n in sizes:
            began = time.perf_counter()
            out.append(_in_child("--agent", {
                "ranks": n, "window": QUICK_WINDOW_S if quick else window,
                "warmup": warmup, "members": members}, timeout=300))
            print(f"bench_scale: {n:,} ranks, {'with' if members else 'without'} the member "
                  f"list: {time.perf_counter() - began:.0f} s", file=sys.stderr, flush=True)
    growth = [_growth(rows, key) for key in GROWTH_KEYS]
    bare_growth = [_growth(bare, key) for key in GROWTH_KEYS if key != "wire KiB/beat"]
    calm = calibration()
    mem = _in_child("--hour", {"world": HOUR_WORLD,
                               "sample": QUICK_HOUR_RANKS if quick else HOUR_RANKS,
                               "seconds": QUICK_HOUR_S if quick else HOUR_S,
                               "every": HOUR_READ_EVERY_S}, timeout=300)
    readings = mem["readings"]
    settled = readings[1] if len(readings) > 2 else readings[0]
    last = readings[-1]
    mem["rss growth"] = last["rss MiB"] / settled["rss MiB"]
    mem["blocks growth"] = last["allocated blocks"] / settled["allocated blocks"]
    targets = []
    for row, how in ((bare[-1], "beats as sent (members when they change)"),):
        at = f"at {row['ranks']:,} ranks, {how}"
        targets += [
            _target(f"receiving + folding <= {TARGET_RECEIVING_PCT:g}% of a core {at}",
                    _cost_at_rate(row), TARGET_RECEIVING_PCT),
            _target(f"heartbeat to bus p99 <= {TARGET_P99_MS:,.0f} ms {at}", row["p99 ms"],
                    TARGET_P99_MS),
            _target(f"culprit verdict <= {TARGET_CULPRIT_MS:g} ms {at}",
                    row["culprit verdict ms"], TARGET_CULPRIT_MS)]
    every = bare[-1]  # every rank known (the view of a run that fell behind is not)
    targets += [
        _target(f"/api/state <= {TARGET_STATE_BYTES // 1024:,} KiB at {every['ranks']:,} "
                "ranks", every["/api/state KiB"], TARGET_STATE_BYTES / 1024),
        _target(f"/api/state built in <= {TARGET_STATE_MS:g} ms at {every['ranks']:,} "
                "ranks", every["/api/state ms"], TARGET_STATE_MS),
        _target("lost or rejected events (every run) == 0",
                sum(r["lost or rejected"] for r in rows + bare), 0),
        _target(f"memory flat over {mem['simulated s'] // 60} simulated minutes (last / "
                f"first reading after the first {HOUR_READ_EVERY_S // 60} min) <= "
                f"{FLAT_GROWTH}", max(mem["rss growth"], mem["blocks growth"]), FLAT_GROWTH),
    ]
    return {"rows": rows, "bare rows": bare, "growth": growth, "bare growth": bare_growth,
            "hour": mem, "targets": targets,
            "window s": QUICK_WINDOW_S if quick else WINDOW_S,
            "bare window s": QUICK_WINDOW_S if quick else BARE_WINDOW_S, "warm-up s": warmup,
            "behind s": MAX_BEHIND_S, "late s": LATE_S,
            "calibration: sum(range(1000)) us (idle core ~8-10)": calm,
            "load average (1 min) at the start and the end": (load_before,
                                                              os.getloadavg()[0])}


def main(argv: list[str] | None = None) -> int:
    args_list = sys.argv[1:] if argv is None else argv
    if args_list and args_list[0] in ("--agent", "--simulate", "--hour"):
        payload = json.loads(args_list[1])
        if args_list[0] == "--agent":
            result = agent(payload["ranks"], payload["window"], payload["warmup"],
                           payload["members"])
        elif args_list[0] == "--simulate":
            result = simulate(**payload)
        else:
            result = hour(**payload)
        print(json.dumps(result))
        sys.stdout.flush()
        os._exit(0)  # the store's and torch's threads: nothing left to finalize
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one small size (smoke run)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(args_list)
    result = run(quick=args.quick)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for row in result["rows"] + result["bare rows"]:
            print("  ".join(f"{k}={_fmt(v)}" for k, v in row.items() if k != "diagnosis"))
        for g in result["growth"] + result["bare growth"]:
            print("  ".join(f"{k}={_fmt(v)}" for k, v in g.items()))
        for reading in result["hour"]["readings"]:
            print(reading)
        for t in result["targets"]:
            print(f"{t['target']}: {_fmt(t['value'])} ({'met' if t['met'] else 'NOT met'})")
    return 0


def _fmt(value: Any) -> str:
    return f"{value:,.2f}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    sys.exit(main())
