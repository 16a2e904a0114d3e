"""The worker's progress watch: heartbeats with no call in the training script.

Armed by the bootstrap (:func:`eventbus.app.worker.attach`) under ``eventbus run``, or
wherever ``EVENTBUS_PROGRESS`` names sources. A daemon thread (``eventbus-progress``) ticks
about every :data:`TICK_S` (jittered, so it does not alias with a steady step rhythm) and
reads:

- ``steps``: optimizer steps, counted by torch's global optimizer step post hook
  (``torch.optim.optimizer.register_optimizer_step_post_hook``), registered once the
  script has imported torch; the hook adds one and reads the clock, nothing more;
- ``collectives``: torch's flight recorder, sampled with
  ``torch._C._distributed_c10d._dump_fr_trace_json(includeCollectives=False)`` (tens of
  microseconds) once ``torch.distributed`` is initialised: per process group the last
  enqueued and the last completed collective. A group whose enqueued is above its
  completed means the rank is inside that collective;
- ``events``: events the script records on the default bus (counted by a subscriber,
  the heartbeats left out) keep ``idle_s`` at zero. Alone it starts no thread: the agent
  counts those events itself.

torch is never imported here: the thread looks into ``sys.modules`` for what the script
imported. It records ``WORKER_PROGRESS`` (:class:`eventbus.events.WorkerProgress`) on the
default bus, which the store forwarder carries to the agent: a heartbeat when progress
changed and at least :data:`BEAT_S` passed since the last one, and an idle beat every
:data:`IDLE_BEAT_S` while nothing changes (both longer in a large job: the agent sets
``EVENTBUS_BEAT_S``, :func:`eventbus.app.protocol.agent_worker.beat_interval`), with
``data["where"]`` (the main thread's innermost frame in the user's code) and, once idle
for :data:`STACK_AFTER_S`, ``data["stack"]`` (every thread, the main one first, eventbus's
own last and marked).
``data["compute_s"]``/``data["wait_s"]``: the window's time outside/inside collectives
(from the samples, on the rank's own clock) per collective completed in it, and
``data["intervals"]``, how many completed (the agent pools windows by it).
``data["pending"]``: the collective each group is inside of, read from one full flight
recorder dump, only in a beat while a collective has been pending for at least
:data:`PENDING_AFTER_S` (so healthy training never pays for full dumps).
A beat is sent at once when the process groups go away (``destroy_process_group``: the
beat has no ``pgs`` and ``collectives`` is None), and a last one with
``data["exiting"] = True`` at the interpreter's exit (before the forwarder's flush): the
silence after it is the process ending (torch's teardown can take seconds), not a stall.

Flight-recorder dump on request (the names, files and rules are
:mod:`eventbus.app.protocol.agent_worker`'s, which the agent uses too):

1. the agent sets ``EVENTBUS_FR_DUMP_DIR`` to an existing absolute folder (per attempt)
   in each worker's environment;
2. at a stall it writes a token (a short line, e.g. ``stall-1``; at most 200 characters)
   to ``<dir>/request``, whole (``write_fr_request``). Each new token is served once by
   each worker (``FrRequestReader``), and one written before the worker started never;
3. within a tick each worker writes its whole trace, in the pickle format torch's
   ``fr_trace`` tool reads (``torch._C._distributed_c10d._dump_fr_trace(True, True,
   False)``), to ``<dir>/fr_trace_rank_<global rank>`` (``fr_dump_path``; written under a
   temporary name and renamed), then records a heartbeat with ``data["fr_dump"]`` (the
   path) and ``data["fr_dump_token"]``; where it cannot (no flight recorder, not
   initialised, an OS error) the beat carries ``data["fr_dump_error"]`` instead.
   ``fr_trace <dir>`` (``python -m torch.distributed.flight_recorder.fr_trace``) infers
   the prefix ``fr_trace_rank_``; the ``request`` file does not match it.

A rank blocked in C code while holding the GIL answers nothing: the agent bounds its wait.

``EVENTBUS_PROGRESS``: ``off``, ``all``, or a comma list of ``collectives``, ``steps``,
``events``; empty or unset: all three (``agent_worker.parse_progress``, the grammar of
``--progress`` too). A bad value is one warning naming the variable; the watch then uses
all three.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import logging
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from collections.abc import Iterable
from typing import Any

from eventbus.app.protocol.agent_worker import ACTIVITY_KEY
from eventbus.app.protocol.agent_worker import ENV_BEAT
from eventbus.app.protocol.agent_worker import EXITING_KEY
from eventbus.app.protocol.agent_worker import FR_DUMP_ERROR_KEY
from eventbus.app.protocol.agent_worker import FR_DUMP_KEY
from eventbus.app.protocol.agent_worker import FR_DUMP_TOKEN_KEY
from eventbus.app.protocol.agent_worker import MARKS_KEY
from eventbus.app.protocol.agent_worker import PROGRESS_SOURCES
from eventbus.app.protocol.agent_worker import FrRequestReader
from eventbus.app.protocol.agent_worker import fr_dump_path
from eventbus.app.protocol.agent_worker import parse_beat
from eventbus.app.worker import notices
from eventbus.app.worker.activity import ActivitySampler
from eventbus.app.worker.marks import worker_marks
from eventbus.app.worker.saves import SaveWatch
from eventbus.app.worker.where import format_stacks
from eventbus.app.worker.where import user_frame

__all__ = [
    "BEAT_S",
    "BUSY_COLLECTIVES_PER_TICK",
    "IDLE_BEAT_S",
    "MEMBERS_EVERY_S",
    "PENDING_AFTER_S",
    "SLOW_TICK_S",
    "STACK_AFTER_S",
    "THREAD_NAME",
    "TICK_S",
    "ProgressWatch",
    "StepCounter",
    "start_progress_watch",
]

THREAD_NAME = "eventbus-progress"

#: The tick. Each wake-up of a Python thread costs a busy worker ~50 us of CPU (measured in
#: a tight 2-rank gloo loop: the GIL taken from the training thread, cold caches) and a tick
#: ~150 us more, so the rate is what the watch costs (benchmarks/bench_health.py). The
#: samples classify each tick's interval as inside or outside a collective, which the
#: straggler rule needs precisely only when a collective interval can be long: see
#: :data:`BUSY_COLLECTIVES_PER_TICK`. The agent pools a window's beats
#: (``data["intervals"]``).
TICK_S = 0.25
#: ...and while collectives complete at least this often (per tick), the tick stretches to
#: :data:`SLOW_TICK_S`: the rank's compute time between two of them is then a few tens of
#: milliseconds at most, below what the straggler rule can report (its
#: ``min_step_time_s``, 50 ms, over the median), so a finer split buys nothing
BUSY_COLLECTIVES_PER_TICK = 10
SLOW_TICK_S = 0.5
#: a group's members (``data["pgs"][pg]["ranks"]``) are sent when they change and at least
#: this often; the agent keeps the last it got (StallWatch.members)
MEMBERS_EVERY_S = 30.0
#: how long the exit waits for the watch's thread before the final beat (a tick's dump
#: on a loaded machine); the beat is skipped past it rather than raced
FINAL_JOIN_S = 5.0
BEAT_S = 1.0
IDLE_BEAT_S = 2.0
STACK_AFTER_S = 1.0
PENDING_AFTER_S = 0.2


class StepCounter:
    """Optimizer steps of this process, counted by torch's global step post hook."""

    __slots__ = ("count", "handle", "last_t")

    def __init__(self) -> None:
        self.count = 0
        #: monotonic time of the last step
        self.last_t = 0.0
        self.handle: Any = None

    def __call__(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.count += 1
        self.last_t = time.monotonic()

    def register(self) -> bool:
        """Register the hook if the script imported torch.optim; True once registered."""
        if self.handle is None:
            module = sys.modules.get("torch.optim.optimizer")
            register = getattr(module, "register_optimizer_step_post_hook", None)
            if register is None:
                return False
            self.handle = register(self)
        return True

    def remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


# -- the watch ----------------------------------------------------------------------------

def _fr_sampler() -> Callable[..., bytes] | None:
    """torch's cheap flight-recorder sample, once the script initialised torch.distributed."""
    dist = sys.modules.get("torch.distributed")
    is_initialized = getattr(dist, "is_initialized", None)
    if is_initialized is None or not is_initialized():
        return None
    c10d = sys.modules.get("torch._C._distributed_c10d")
    sample = getattr(c10d, "_dump_fr_trace_json", None)
    return sample if callable(sample) else None


def _pg_ranks() -> dict[str, list[int]]:
    """Process group name -> its members' global ranks (torch.distributed's own books)."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    world = getattr(c10d, "_world", None)
    names = getattr(world, "pg_names", None) or {}
    ranks = getattr(world, "pg_group_ranks", None) or {}
    return {str(names[pg]): sorted(int(r) for r in members)
            for pg, members in list(ranks.items()) if pg in names}


class ProgressWatch:
    """The sampling thread (see the module docstring); :meth:`tick` is one sample."""

    def __init__(self, sources: Iterable[str], *, dump_dir: str | None = None,
                 rank: int | None = None, record: Callable[..., None] | None = None,
                 bus: Any = None) -> None:
        self.sources = frozenset(sources)
        self.dump_dir = dump_dir
        self._rank = rank
        #: whether the beats go to the bus whose events are counted
        self._beats_on_bus = record is None
        if record is None or bus is None:
            from eventbus.bus import get_default_bus

            bus = bus if bus is not None else get_default_bus()
            record = record if record is not None else bus.record
        self._record = record
        self._bus = bus
        self.steps = StepCounter()
        #: checkpoint saves (torch.save, DCP) noticed with no call in the script
        self.saves = SaveWatch(step=self._step_count)
        #: what the main thread does while the rank is idle (data["activity"])
        self.activity = ActivitySampler()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sample: Callable[..., bytes] | None = None
        #: held around each flight-recorder call of this thread; ``_closing`` set under it
        #: ends them (see :meth:`_native_sample`)
        self._native = threading.Lock()
        self._closing = False
        self._ranks: dict[str, list[int]] = {}
        self.armed = False
        self.beats = 0
        #: ticks so far (each one wake-up of the thread)
        self.ticks = 0
        # the state at the last tick and at the last beat
        now = time.monotonic()
        self._progress_t = now
        self._beat_t = -1e9
        self._changed = False
        self._key: tuple[Any, ...] = ()
        self._pgs: dict[str, tuple[int, int]] = {}
        self._pending_since: dict[str, tuple[int, float]] = {}
        self._events = 0
        self._tick_t = now
        self._inside_s = self._outside_s = 0.0
        self._beat_completed = 0
        self._beat_steps = (0, 0.0)
        self._failed = False
        # a request older than this worker is not for it (a former attempt's)
        self._requests = FrRequestReader(dump_dir)
        self._counter = itertools.count()
        self._subscription: Any = None
        #: heartbeats recorded on the counted bus
        self._own = 0
        self._pid = os.getpid()
        self._final_sent = False
        #: the heartbeat interval: BEAT_S, or what the agent set for a large job
        self.beat_s = parse_beat(os.environ.get(ENV_BEAT))
        #: each group's members as last sent, and when they were last all sent
        self._members_sent: dict[str, list[int]] = {}
        self._members_at = -1e9
        #: the wait before the next tick: TICK_S, or SLOW_TICK_S while collectives are busy
        self._next_tick = TICK_S
        self._tick_completed = 0

    def _step_count(self) -> int | None:
        """The optimizer steps so far, once the step hook is registered (else None)."""
        return self.steps.count if self.steps.handle is not None else None

    # -- lifecycle
    def start(self) -> None:
        self._pid = os.getpid()
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._thread.start()
        atexit.register(self.stop, FINAL_JOIN_S, final=True)

    def stop(self, timeout: float = 1.0, *, final: bool = False) -> None:
        """End the thread; ``final`` (at the interpreter's exit, before the forwarder's
        flush): one last beat with ``data["exiting"]``, so that the agent knows the silence
        that follows is the process ending, not a stall. Once per watch; nothing in a
        forked child (the watch, its rank and its thread are the parent's)."""
        if os.getpid() != self._pid or (final and self._final_sent):
            return
        self._final_sent = self._final_sent or final
        with self._native:  # waits out a flight-recorder call in flight (milliseconds)
            self._closing = True
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        if final and self.armed and not (thread is not None and thread.is_alive()):
            with contextlib.suppress(Exception):
                self._beat(time.monotonic(), idle=False, extra={EXITING_KEY: True}, final=True)
        self.steps.remove()
        if self._subscription is not None:
            self._subscription.cancel()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.wait(self._next_tick * random.uniform(0.8, 1.2)):
            try:
                self.tick()
            except Exception as exc:  # a sample that fails must not end the watch
                if not self._failed:
                    self._failed = True
                    logging.getLogger("eventbus").warning(
                        "eventbus: the progress watch failed to sample (%s: %s); it goes on "
                        "trying", type(exc).__name__, exc)
                time.sleep(TICK_S)

    # -- one tick
    def _arm(self) -> None:
        self.saves.arm()
        if "steps" in self.sources:
            self.steps.register()
        if "collectives" in self.sources:
            sample = _fr_sampler()
            if sample is not None and self._sample is None:
                self._ranks = _pg_ranks()
            self._sample = sample
        live = self.steps.handle is not None or self._sample is not None
        if live and not self.armed:
            self.armed = True
            self._progress_t = self._tick_t = time.monotonic()

    def _native_sample(self, **kwargs: Any) -> bytes | None:
        """The flight recorder's sample; None on the watch's own thread once the watch is
        closing. Why: the sample is C++ that releases the GIL, and a thread that re-takes
        the GIL after the interpreter's finalization began is ended by ``pthread_exit``
        (Python 3.11), whose unwinding through a ``noexcept`` frame aborts the worker
        (``terminate called without an active exception``, SIGABRT) after a healthy run. A
        join that timed out under load let that happen; now :meth:`stop` waits for the call
        in flight, and none starts after it."""
        sample = self._sample
        if sample is None:
            return None
        with self._native:
            if self._closing and threading.current_thread() is self._thread:
                return None
            return sample(**kwargs)

    def _worker_id(self) -> int | None:
        if self._rank is None:
            dist = sys.modules.get("torch.distributed")
            if self._sample is not None and dist is not None:
                self._rank = int(dist.get_rank())
        return self._rank

    def _read_pgs(self) -> dict[str, tuple[int, int]]:
        if self._sample is None:
            return {}
        blob = self._native_sample(includeCollectives=False)
        if blob is None:
            return self._pgs
        status = json.loads(blob).get("pg_status", {})
        return {str(pg): (int(s.get("last_enqueued_collective", -1)),
                          int(s.get("last_completed_collective", -1)))
                for pg, s in status.items()}

    def _published(self) -> int:
        """Events recorded in this process since the watch armed, its own beats left out:
        counted by a subscriber (one call per event), read as the counter's value."""
        if "events" not in self.sources or self._bus is None:
            return 0
        if self._subscription is None:
            from eventbus.bus import ALL

            counter = self._counter

            def count(event: Any) -> None:
                next(counter)

            count._eventbus_local_only = True  # type: ignore[attr-defined]  # notices.local_only

            self._subscription = self._bus.subscribe(ALL, on_event=count)
        return int(repr(self._counter)[6:-1]) - self._own

    def tick(self) -> None:
        """Sample once; record a heartbeat when one is due."""
        self.ticks += 1
        had_sample = self._sample is not None
        if notices.waiting():  # the notices' ear starts once the script imported torch
            notices.start_if_ready()
        self._arm()
        if not self.armed:
            return
        gone = had_sample and self._sample is None  # the process groups were destroyed
        now = time.monotonic()
        pgs = self._read_pgs()
        events = self._published()
        key = (self.steps.count, tuple(sorted(pgs.items())), events)
        if key != self._key:
            if self._key:
                self._progress_t = now
                self._changed = True
            self._key = key
            self.activity.reset()
        elif now - self._progress_t >= TICK_S:  # idle: the evidence of what it does
            self.activity.sample()
        inside = False
        for pg, (enqueued, completed) in pgs.items():
            if enqueued > completed:
                inside = True
                if self._pending_since.get(pg, (None,))[0] != enqueued:
                    self._pending_since[pg] = (enqueued, now)
            else:
                self._pending_since.pop(pg, None)
        if len(pgs) != len(self._pgs):
            self._ranks = _pg_ranks()
        self._pgs = pgs
        completed = sum(max(0, c) for _, c in pgs.values())
        self._next_tick = SLOW_TICK_S if (
            completed - self._tick_completed >= BUSY_COLLECTIVES_PER_TICK) else TICK_S
        self._tick_completed = completed
        elapsed, self._tick_t = now - self._tick_t, now
        if inside:
            self._inside_s += elapsed
        else:
            self._outside_s += elapsed
        since = now - self._beat_t
        # the agent's dump requests come at a stall: looked for at every tick while this
        # rank is idle, else with each heartbeat (a stat() is a system call each time)
        served = self._serve_request() if (
            now - self._progress_t >= TICK_S or since >= self.beat_s) else None
        if served is not None or gone or (self._changed and since >= self.beat_s) \
                or since >= IDLE_BEAT_S * self.beat_s / BEAT_S or self.saves.waiting \
                or self.activity.news:
            self._beat(now, idle=not self._changed, extra=served)

    def _beat(self, now: float, *, idle: bool, extra: dict[str, Any] | None,
              final: bool = False) -> None:
        worker_id = self._worker_id()
        if worker_id is None:
            return
        idle_s = max(0.0, now - self._progress_t)
        data: dict[str, Any] = {"sources": [s for s in PROGRESS_SOURCES if self._live(s)]}
        completed = sum(max(0, c) for _, c in self._pgs.values())  # -1: none yet
        if self._pgs:
            data["pgs"] = pgs = {pg: {"enqueued": e, "completed": c, "name": pg}
                                 for pg, (e, c) in self._pgs.items()}
            # a group's members ride in the first beat that has them, when they change,
            # and every MEMBERS_EVERY_S (an agent that missed them learns them again):
            # every beat of 8,192 ranks carrying the world's member list was 320 MB/s
            # into rank 0's store and most of its agent's CPU (docs/scale.md)
            resend = now - self._members_at >= MEMBERS_EVERY_S
            for pg, entry in pgs.items():
                members = self._ranks.get(pg, [])
                if resend or self._members_sent.get(pg) != members:
                    entry["ranks"] = members
                    self._members_sent[pg] = members
            if resend:
                self._members_at = now
            intervals = completed - self._beat_completed
            if intervals > 0 and self._beat_completed > 0:  # not the start-up's window
                data["compute_s"] = round(self._outside_s / intervals, 6)
                data["wait_s"] = round(self._inside_s / intervals, 6)
                data["intervals"] = intervals
            pending = {} if final else self._pending(now)
            if pending:
                data["pending"] = pending
        steps, step_t = self.steps.count, self.steps.last_t
        if steps > self._beat_steps[0] > 0:  # steps in this window, and a start to count from
            data["step_time_s"] = round((step_t - self._beat_steps[1])
                                        / (steps - self._beat_steps[0]), 6)
        if idle:
            main = sys._current_frames().get(threading.main_thread().ident or 0)
            where = user_frame(main)
            if where:
                data["where"] = where
            if idle_s >= STACK_AFTER_S:
                data["stack"] = format_stacks()
            activity = self.activity.report()
            if activity is not None:
                data[ACTIVITY_KEY] = activity
        saves = self.saves.take()
        if saves:
            data["saves"] = saves
        ready = worker_marks.as_data()  # the restart anatomy's marks, after the first step
        if ready is not None:
            data[MARKS_KEY] = ready
        if extra:
            data.update(extra)
        self._record("WORKER_PROGRESS", worker_id=worker_id,
                     step=steps if self.steps.handle is not None else None,
                     collectives=completed if self._sample is not None else None,
                     idle_s=round(idle_s, 3), data=data)
        self.beats += 1
        if self._subscription is not None and self._beats_on_bus:
            self._own += 1
        self._beat_t = now
        self._changed = False
        self._inside_s = self._outside_s = 0.0
        self._beat_completed = completed
        if steps != self._beat_steps[0]:
            self._beat_steps = (steps, step_t)

    def _live(self, source: str) -> bool:
        if source not in self.sources:
            return False
        if source == "steps":
            return self.steps.handle is not None
        if source == "collectives":
            return self._sample is not None
        return self._bus is not None

    def _pending(self, now: float) -> dict[str, Any]:
        """The collective each group has been inside of for PENDING_AFTER_S, from one full
        flight-recorder dump (only the sequence number where the ring is off)."""
        late = {pg: seq for pg, (seq, since) in self._pending_since.items()
                if now - since >= PENDING_AFTER_S}
        if not late or self._sample is None:
            return {}
        out: dict[str, Any] = {pg: {"seq": seq} for pg, seq in late.items()}
        blob = self._native_sample(includeCollectives=True)
        entries = json.loads(blob).get("entries", []) if blob is not None else []
        for entry in reversed(entries):
            pg = str(entry.get("pg_id"))
            if pg in late and entry.get("collective_seq_id") == late[pg] \
                    and "op" not in out[pg] and not entry.get("is_p2p"):
                name = str(entry.get("profiling_name", ""))
                out[pg].update(op=name.rpartition(":")[2], sizes=entry.get("input_sizes"),
                               dtypes=entry.get("input_dtypes"), state=entry.get("state"))
        return out

    # -- the agent's dump requests
    def _serve_request(self) -> dict[str, Any] | None:
        token = self._requests.take()
        if token is None:
            return None
        return {FR_DUMP_TOKEN_KEY: token, **self.write_dump()}

    def write_dump(self) -> dict[str, str]:
        """Write the whole flight-recorder trace to ``<dump_dir>/fr_trace_rank_<rank>``;
        ``{"fr_dump": path}``, or ``{"fr_dump_error": why}``."""
        c10d = sys.modules.get("torch._C._distributed_c10d")
        dump = getattr(c10d, "_dump_fr_trace", None)
        rank = self._worker_id()
        if dump is None or rank is None or self.dump_dir is None:
            return {FR_DUMP_ERROR_KEY: "torch.distributed is not initialised in this worker, "
                                       "or its torch has no flight recorder"}
        path = fr_dump_path(self.dump_dir, rank)
        partial = os.path.join(self.dump_dir, f"partial.{rank}.tmp")
        try:
            with self._native:
                if self._closing and threading.current_thread() is self._thread:
                    return {FR_DUMP_ERROR_KEY: "the worker is exiting"}
                blob = dump(True, True, False)
            with open(partial, "wb") as out:
                out.write(blob)
            os.replace(partial, path)
        except Exception as exc:
            with contextlib.suppress(OSError):
                os.unlink(partial)
            return {FR_DUMP_ERROR_KEY: f"{type(exc).__name__}: {exc}"}
        return {FR_DUMP_KEY: path}


_watch: ProgressWatch | None = None
_lock = threading.Lock()


def end_progress_watch() -> None:
    """Send the running watch's final ``exiting`` beat now and stop it (at exit, before
    anything that may wait: :func:`eventbus.app.worker.process_groups.end_process_groups`
    calls it first). Its own exit hook then does nothing more."""
    watch = _watch
    if watch is not None:
        watch.stop(FINAL_JOIN_S, final=True)


def start_progress_watch(sources: Iterable[str], *, dump_dir: str | None = None,
                         rank: int | None = None) -> ProgressWatch | None:
    """Start this process's one watch (None for no sources); again: the running one."""
    global _watch
    sources = frozenset(sources)
    if not sources - {"events"}:
        return None  # events alone: nothing to sample (the agent counts them itself)
    with _lock:
        if _watch is None or not _watch.alive:
            _watch = ProgressWatch(sources, dump_dir=dump_dir, rank=rank)
            _watch.start()
        return _watch
