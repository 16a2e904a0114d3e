"""What the agent knows of each worker's progress: stalled workers and stragglers.

Torch-free and clock-injectable, so that the rules are unit-tested without a job; the agent
(:mod:`eventbus.app.launcher.agent`) feeds the watches every event that reaches its bus
(:func:`observer`), and the judge (:mod:`eventbus.app.health.judge`) asks them once per
monitor interval. The rules (docs/run.md, "Job health"):

* **stall**: after a worker's first progress in an attempt, none for longer than the
  timeout while its process lives. Any event type counts, and a ``WORKER_PROGRESS``
  heartbeat (the worker's progress watch, no call in the script) counts when its step,
  collective count or a group's enqueued count advanced, dated ``idle_s`` before its
  arrival. Before the first progress a worker is never stalled; nor once its last
  heartbeat says its script ended (or its process groups are gone). Who holds a stall up
  is decided by :mod:`eventbus.app.health.culprit` on the agent. An event whose
  ``data["expect_silence_s"]`` is a number announces a quiet period (a long checkpoint
  write): the worker is not stalled before that many seconds after it, even past the
  timeout;
* ``--stall-timeout auto``: per worker, ``max(AUTO_FLOOR_S, AUTO_FACTOR x`` the longest
  interval seen between two of its events in the attempt``)``: 60 s at least, and five
  times the longest quiet period the worker already came back from (the heartbeats'
  reported step and collective intervals included);
* **straggler** (``WORKER_SLOW``): a rank's recent step time (over its last ``window``
  ``METRIC`` events with a ``step``: elapsed time / steps; or the median of its
  ``data["step_time_s"]`` when the events carry it, which lock-step training needs, since
  there every rank waits for the slowest) is at least ``factor`` times the median of its
  peers' and at least ``min_step_time_s``; reported at most once per rank per
  ``report_interval_s``. Without such steps, the heartbeats' ``compute_s`` (each rank's
  time outside collectives, on its own clock) is compared the same way: in lock-step
  training the late rank's is long, its peers' short.

The agent pays for the watch per event it receives, never the worker's ``record()``: one
dict lookup and store (stall), and for ``METRIC`` events one deque append (straggler).
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Mapping
from typing import Any
from typing import Literal
from typing import NamedTuple

import attrs

from eventbus.app.protocol.agent_worker import EXITING_KEY
from eventbus.app.protocol.agent_worker import EXPECT_SILENCE_KEY
from eventbus.events import Event
from eventbus.events import Metric
from eventbus.events import WorkerProgress

__all__ = [
    "AUTO_FACTOR",
    "AUTO_FLOOR_S",
    "DEFAULT_SLOW_FACTOR",
    "Slow",
    "Stall",
    "StallWatch",
    "StragglerWatch",
    "observer",
]

#: ``--slow-factor`` default
DEFAULT_SLOW_FACTOR = 2.0
#: ``--stall-timeout auto``: never below this many seconds...
AUTO_FLOOR_S = 60.0
#: ... and this many times the longest interval the worker came back from
AUTO_FACTOR = 5.0

# -- stalls --------------------------------------------------------------------------------


@attrs.frozen
class Stall:
    """A worker found stalled: its global rank, how long it was silent, the timeout."""

    rank: int
    silent_s: float
    timeout_s: float


class _Seen:
    __slots__ = ("beat", "beat_at", "last", "longest", "marker", "quiet_until")

    def __init__(self, now: float) -> None:
        self.last = now
        self.longest = 0.0
        self.quiet_until = 0.0
        #: the rank's latest WORKER_PROGRESS heartbeat and when it arrived (agent's clock)
        self.beat: WorkerProgress | None = None
        self.beat_at = 0.0
        #: what the latest heartbeat counted (step, collectives, enqueued per group)
        self.marker: tuple[Any, ...] | None = None


def _marker(beat: WorkerProgress) -> tuple[Any, ...]:
    """What a heartbeat counts: (step, collectives, enqueued per process group)."""
    pgs = beat.data.get("pgs") if beat.data else None
    enqueued: tuple[Any, ...] = ()
    if isinstance(pgs, Mapping):
        enqueued = tuple(sorted((str(pg), info.get("enqueued")) for pg, info in pgs.items()
                                if isinstance(info, Mapping)))
    return (beat.step, beat.collectives, enqueued)


def _started(marker: tuple[Any, ...]) -> bool:
    """Whether a heartbeat shows any progress at all (a step, a collective entered)."""
    step, collectives, enqueued = marker
    return bool(step) or bool(collectives) or any(
        isinstance(e, int) and e > 0 for _, e in enqueued)


def _interval(beat: WorkerProgress) -> float:
    """The longest interval a heartbeat reports between the rank's steps or collectives
    (``step_time_s``; ``compute_s + wait_s``), for ``--stall-timeout auto``."""
    data = beat.data
    if not data:
        return 0.0
    longest = 0.0
    step = data.get("step_time_s")
    if isinstance(step, (int, float)) and not isinstance(step, bool) and math.isfinite(step):
        longest = float(step)
    compute, wait = data.get("compute_s"), data.get("wait_s")
    if isinstance(compute, (int, float)) and isinstance(wait, (int, float)):
        total = float(compute) + float(wait)
        if math.isfinite(total) and total > longest:
            longest = total
    return longest


class StallWatch:
    """Per (attempt, global rank): when the worker's latest event arrived.

    ``observe`` is the bus subscriber (any thread); ``overdue``/``stalled`` are asked by
    the agent's monitor. ``timeout`` is seconds, or ``"auto"`` (see the module docstring).
    Arrival times on the agent's clock are used, never the worker's timestamps.
    """

    def __init__(self, timeout: float | Literal["auto"], *, auto_floor_s: float = AUTO_FLOOR_S,
                 auto_factor: float = AUTO_FACTOR,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if timeout != "auto" and not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout must be seconds > 0 or 'auto', got {timeout!r}")
        self.timeout = timeout
        if not (isinstance(auto_floor_s, (int, float)) and auto_floor_s > 0):
            raise ValueError(f"auto_floor_s must be seconds > 0, got {auto_floor_s!r}")
        self.auto_floor_s = float(auto_floor_s)
        self.auto_factor = float(auto_factor)
        self._clock = clock
        self._seen: dict[tuple[int, int], _Seen] = {}
        #: the latest heartbeat of each rank that has made no progress yet, and its arrival
        self._early: dict[tuple[int, int], tuple[WorkerProgress, float]] = {}
        #: (attempt, rank) -> process group -> its members, as last sent (a heartbeat
        #: carries them only when they change, and now and then: progress.MEMBERS_EVERY_S)
        self._members: dict[tuple[int, int], dict[str, Any]] = {}
        self._reported: set[tuple[int, int]] = set()
        self._lock = threading.Lock()
        self._auto = timeout == "auto"
        #: the previous event's context and its rank's entry (see observe)
        self._hit: tuple[Any, _Seen | None] = (None, None)

    def observe(self, event: Event) -> None:
        """Note a worker's event (events without a rank, the agents' own, are skipped).

        The agent pays this for every event that reaches its bus (8 workers x 1,000
        events/s is 8,000 calls a second): a clock read and a few stores. The store
        receiver's decoder hands every event of one worker the same context object (it
        caches decoded contexts), so the previous event's entry is reused while the context
        repeats: no key built, no lookup. One tuple, replaced whole: safe with several
        receiver threads.
        """
        ctx = event.context
        cached_ctx, seen = self._hit
        now = self._clock()
        if ctx is not cached_ctx or seen is None or event.__class__ is WorkerProgress:
            rank = ctx.rank
            if rank is None:
                return
            key = (ctx.restart_count or 0, rank)
            seen = self._seen.get(key)
            if event.__class__ is WorkerProgress:
                self.observe_progress(key, event, now, seen)
                self._hit = (None, None)  # the heartbeat may have made the rank's entry
                return
            if seen is None:
                self._seen[key] = seen = _Seen(now)
            self._hit = (ctx, seen)
        if self._auto and now - seen.last > seen.longest:
            seen.longest = now - seen.last
        seen.last = now
        data = event.data
        if data and EXPECT_SILENCE_KEY in data:
            quiet = data[EXPECT_SILENCE_KEY]
            if isinstance(quiet, (int, float)) and not isinstance(quiet, bool) and quiet > 0:
                seen.quiet_until = now + float(quiet)

    def observe_progress(self, key: tuple[int, int], beat: WorkerProgress, now: float,
                         seen: _Seen | None) -> None:
        """A heartbeat: progress only when its step, collectives or a group's enqueued
        count differ from the rank's previous heartbeat (idle beats are not progress);
        its ``idle_s`` dates the rank's last progress (``now - idle_s``, on the agent's
        clock: no clock sync across nodes). Idle beats before the rank's first progress
        do not start its clock (a slow start is never a stall)."""
        pgs = beat.data.get("pgs") if beat.data else None
        if pgs and isinstance(pgs, Mapping):
            for pg, info in pgs.items():
                members = info.get("ranks") if isinstance(info, Mapping) else None
                if members is not None:
                    self._members.setdefault(key, {})[pg] = members
        marker = _marker(beat)
        idle = beat.idle_s if isinstance(beat.idle_s, (int, float)) else 0.0
        progressed_at = now - max(0.0, float(idle))
        if seen is None:
            if not _started(marker):
                # nothing done yet: the rank's clock has not started; its beat still tells
                # the culprit analysis that it has entered no collective (a slow start)
                self._early[key] = (beat, now)
                return
            self._early.pop(key, None)
            self._seen[key] = seen = _Seen(progressed_at)
        elif (self._auto and marker != seen.marker
              and progressed_at - seen.last > seen.longest):
            seen.longest = progressed_at - seen.last
        seen.last = max(seen.last, progressed_at)
        if self._auto:
            reported = _interval(beat)
            seen.longest = max(seen.longest, reported)
        ended = bool(beat.data and beat.data.get(EXITING_KEY)) or (
            # its process groups are gone (it had some): the script is ending
            beat.collectives is None and bool(seen.marker and seen.marker[2])
            and not (beat.data and beat.data.get("pgs")))
        seen.marker = marker
        seen.beat, seen.beat_at = beat, now
        if ended:
            seen.quiet_until = math.inf  # the script has ended: its exit is no stall

    def beats(self, attempt: int) -> dict[int, tuple[WorkerProgress, float]]:
        """rank -> (its latest heartbeat of ``attempt``, seconds since it arrived)."""
        now = self._clock()
        found = {rank: (beat, now - at) for (a, rank), (beat, at)
                 in list(self._early.items()) if a == attempt}
        found.update({rank: (seen.beat, now - seen.beat_at)
                      for (a, rank), seen in list(self._seen.items())
                      if a == attempt and seen.beat is not None})
        return found

    def beat(self, attempt: int, rank: int) -> tuple[WorkerProgress, float] | None:
        """The rank's latest heartbeat of ``attempt`` and its age (None: none arrived)."""
        seen = self._seen.get((attempt, rank))
        if seen is not None and seen.beat is not None:
            return seen.beat, self._clock() - seen.beat_at
        early = self._early.get((attempt, rank))
        return None if early is None else (early[0], self._clock() - early[1])

    def members(self, attempt: int, rank: int) -> Mapping[str, Any]:
        """The rank's process groups' members as its heartbeats last sent them."""
        return self._members.get((attempt, rank), {})

    def ended(self, attempt: int) -> list[int]:
        """The ranks of ``attempt`` whose scripts have ended (their last heartbeat said so,
        or their process groups are gone)."""
        return sorted(rank for (a, rank), seen in list(self._seen.items())
                      if a == attempt and seen.quiet_until == math.inf)

    def ranks(self, attempt: int) -> list[int]:
        """The ranks of ``attempt`` whose clocks have started."""
        return sorted(rank for a, rank in list(self._seen) if a == attempt)

    def silent_s(self, attempt: int, rank: int) -> float | None:
        """Seconds since the rank's last progress (None before its first)."""
        seen = self._seen.get((attempt, rank))
        return None if seen is None else self._clock() - seen.last

    def timeout_for(self, attempt: int, rank: int) -> float:
        """The timeout that applies to this worker now."""
        if self.timeout != "auto":
            return float(self.timeout)
        seen = self._seen.get((attempt, rank))
        longest = seen.longest if seen is not None else 0.0
        return max(self.auto_floor_s, self.auto_factor * longest)

    def overdue(self, attempt: int, ranks: Iterable[int]) -> list[Stall]:
        """The live workers ``ranks`` of ``attempt`` past their deadline, not yet reported."""
        now = self._clock()
        found = []
        for rank in ranks:
            key = (attempt, rank)
            seen = self._seen.get(key)
            if seen is None or key in self._reported:
                continue  # no first event yet: never stalled
            silent = now - seen.last
            timeout = self.timeout_for(attempt, rank)
            if silent > timeout and now > seen.quiet_until:
                found.append(Stall(rank, silent, timeout))
        return found

    def stalled(self, attempt: int, ranks: Iterable[int]) -> list[Stall]:
        """:meth:`overdue`, each worker reported once per attempt."""
        with self._lock:
            found = self.overdue(attempt, ranks)
            self._reported.update((attempt, s.rank) for s in found)
        return found

    def mark_reported(self, attempt: int, ranks: Iterable[int]) -> None:
        """Report no more stalls of these ranks in ``attempt`` (the culprits, and the
        ranks found waiting for them, once the agent published the stall)."""
        with self._lock:
            self._reported.update((attempt, rank) for rank in ranks)

    def forget_before(self, attempt: int) -> None:
        """Drop what older attempts left (they can no longer stall)."""
        with self._lock:
            self._hit = (None, None)
            for key in [k for k in self._seen if k[0] < attempt]:
                del self._seen[key]
            for key in [k for k in self._early if k[0] < attempt]:
                del self._early[key]
            for key in [k for k in self._members if k[0] < attempt]:
                del self._members[key]


# -- stragglers ----------------------------------------------------------------------------


@attrs.frozen
class Slow:
    """A straggler: its rank, step time, its peers' median, the ratio, its latest step.

    ``basis`` says what was compared: ``"step_time"`` (``METRIC`` steps) or
    ``"compute_s"`` (the heartbeats' time outside collectives, lock-step training);
    with ``compute_s``, ``step_time_s``/``median_step_time_s`` are those compute times."""

    rank: int
    step_time_s: float
    median_step_time_s: float
    factor: float
    step: int | None
    basis: str = "step_time"


class _Step(NamedTuple):
    """A ``METRIC`` step as the straggler watch keeps it."""

    step: int
    timestamp: float
    #: the event's own ``data["step_time_s"]``, when it carries one
    own: float | None


def _number(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) \
            and math.isfinite(value) and value >= 0:
        return float(value)
    return None


class StragglerWatch:
    """Step times per (attempt, rank) from ``METRIC`` events; see the module docstring."""

    def __init__(self, factor: float = DEFAULT_SLOW_FACTOR, *, window: int = 8,
                 min_steps: int = 4, min_step_time_s: float = 0.05, min_beats: int = 3,
                 report_interval_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not factor > 1:
            raise ValueError(f"factor must be > 1, got {factor!r}")
        if window < 2 or min_steps < 1:
            raise ValueError("window >= 2 and min_steps >= 1 are required")
        self.factor = float(factor)
        self.window = int(window)
        self.min_steps = int(min_steps)
        self.min_beats = int(min_beats)
        self.min_step_time_s = float(min_step_time_s)
        self.report_interval_s = float(report_interval_s)
        self._clock = clock
        #: (attempt, rank) -> recent steps
        self._steps: dict[tuple[int, int], deque[_Step]] = {}
        #: (attempt, rank) -> recent heartbeats' compute_s (time outside collectives) and
        #: the collective intervals each was measured over (None where a beat has none)
        self._compute: dict[tuple[int, int], deque[tuple[float, int | None]]] = {}
        self._last_report: dict[int, float] = {}
        #: the previous METRIC's context and its rank's steps (see observe)
        self._hit: tuple[Any, deque[_Step] | None] = (None, None)

    def observe_progress(self, beat: WorkerProgress) -> None:
        """Note a heartbeat's ``data["compute_s"]`` (the rank's own clock; idle beats,
        which carry none, skip) and ``data["intervals"]``, the collective intervals it was
        measured over."""
        rank = beat.context.rank
        if rank is None:
            rank = beat.worker_id
        data = beat.data
        compute = _number(data.get("compute_s")) if data else None
        if compute is None or beat.idle_s >= 1.0:
            return
        n = data.get("intervals")
        intervals = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None
        key = (beat.context.restart_count or 0, rank)
        window = self._compute.get(key)
        if window is None:
            window = self._compute[key] = deque(maxlen=self.window)
        window.append((compute, intervals))

    def observe(self, event: Event) -> None:
        """Note a ``METRIC`` event's step, or a heartbeat's compute time (others, and those
        without step or rank, skip). Like :meth:`StallWatch.observe`, it reuses the previous
        event's entry while the context object repeats."""
        cls = event.__class__
        if cls is WorkerProgress:
            self.observe_progress(event)  # type: ignore[arg-type]
            return
        if cls is not Metric and not isinstance(event, Metric):
            return
        step = event.step  # type: ignore[attr-defined]
        if step is None:
            return
        ctx = event.context
        cached_ctx, steps = self._hit
        if ctx is not cached_ctx or steps is None:
            if ctx.rank is None:
                return
            key = (ctx.restart_count or 0, ctx.rank)
            steps = self._steps.get(key)
            if steps is None:
                steps = self._steps[key] = deque(maxlen=self.window + 1)
            self._hit = (ctx, steps)
        data = event.data
        own = data.get("step_time_s") if data else None
        if own is not None:
            own = float(own) if isinstance(own, (int, float)) and not isinstance(own, bool) \
                else None
        if steps and step <= steps[-1].step:
            steps.clear()  # the step counter went back: a new epoch's numbering, say
        steps.append(_Step(step, event.timestamp, own))

    def step_time(self, attempt: int, rank: int) -> float | None:
        """The rank's recent step time, or None while it has too few steps."""
        steps = self._steps.get((attempt, rank))
        if not steps or len(steps) < 2:
            return None
        own = [s.own for s in steps if s.own is not None]
        if len(own) >= self.min_steps:
            return float(statistics.median(own))
        first, last = steps[0], steps[-1]
        done = last.step - first.step
        if done < self.min_steps:
            return None
        return max(0.0, last.timestamp - first.timestamp) / done

    def compute_time(self, attempt: int, rank: int) -> float | None:
        """The rank's recent compute time per collective interval (None with fewer than
        ``min_beats`` heartbeats): the window's beats pooled, each weighted by the
        intervals it was measured over (each beat's figure comes from a few samples of the
        rank's state, a handful a second: pooled, the window's samples count together),
        or the median of their ``compute_s`` where a beat does not say."""
        window = self._compute.get((attempt, rank))
        if not window or len(window) < self.min_beats:
            return None
        total = 0
        weighted = 0.0
        for compute, n in window:
            if n is None:
                return float(statistics.median(c for c, _ in window))
            total += n
            weighted += compute * n
        return weighted / total

    def check(self, attempt: int) -> list[Slow]:
        """The stragglers of ``attempt`` now, rate-limited per rank."""
        times: dict[int, float] = {}
        latest: dict[int, int] = {}
        for (a, rank), steps in list(self._steps.items()):
            if a != attempt:
                continue
            t = self.step_time(a, rank)
            if t is not None:
                times[rank] = t
                latest[rank] = steps[-1].step
        if len(times) < 2:
            return self._check_compute(attempt)
        return [Slow(rank, t, median, ratio, latest[rank]) for rank, t, median, ratio
                in self._late(times, lambda t, median: t >= self.min_step_time_s)]

    def _check_compute(self, attempt: int) -> list[Slow]:
        """Lock-step training without step times: every rank's interval is the slowest's,
        but the time outside collectives is each rank's own. The rank whose compute time is
        ``factor`` x its peers' median, and longer by ``min_step_time_s``, is late."""
        times = {rank: t for (a, rank) in list(self._compute) if a == attempt
                 for t in [self.compute_time(a, rank)] if t is not None}
        if len(times) < 2:
            return []
        return [Slow(rank, t, median, ratio, None, basis="compute_s")
                for rank, t, median, ratio
                in self._late(times, lambda t, median: t - median >= self.min_step_time_s)]

    def _late(self, times: dict[int, float], long_enough: Callable[[float, float], bool]
              ) -> list[tuple[int, float, float, float]]:
        """``(rank, time, peers' median, ratio)`` of each rank whose time is ``factor`` x
        its peers' median and ``long_enough(time, median)``, at most once per
        ``report_interval_s`` per rank (the one rule of both straggler checks)."""
        now = self._clock()
        late = []
        # each rank's peers' median from one sort: O(ranks log ranks), not ranks x ranks
        # (2.3 s of the monitor's CPU a second at 8,192 ranks: docs/scale.md)
        order = sorted(times, key=times.__getitem__)
        values = [times[r] for r in order]
        position = {rank: i for i, rank in enumerate(order)}
        for rank, t in sorted(times.items()):
            median = _median_without(values, position[rank])
            if not long_enough(t, median) or t < self.factor * median:
                continue
            last = self._last_report.get(rank)
            if last is not None and now - last < self.report_interval_s:
                continue
            self._last_report[rank] = now
            ratio = t / median if median > 0 else math.inf
            late.append((rank, t, median, ratio if math.isfinite(ratio) else 1e9))
        return late

    def forget_before(self, attempt: int) -> None:
        """Drop older attempts' steps."""
        self._hit = (None, None)
        for key in [k for k in self._steps if k[0] < attempt]:
            del self._steps[key]
        for key in [k for k in self._compute if k[0] < attempt]:
            del self._compute[key]


def _median_without(values: list[float], i: int) -> float:
    """The median of sorted ``values`` without the one at index ``i`` (at least two)."""
    n = len(values) - 1

    def at(j: int) -> float:
        return values[j] if j < i else values[j + 1]

    half = n // 2
    return at(half) if n % 2 else (at(half - 1) + at(half)) / 2


def observer(stall: StallWatch | None, straggler: StragglerWatch | None
             ) -> Callable[[Event], None] | None:
    """One bus subscriber (``ALL``) feeding both watches: one dispatch per event, not two.

    Each watch's ``observe`` is its own fast path (it reuses the previous event's entry
    while the context object repeats); this only routes: every event to the stall watch,
    ``METRIC`` and ``WORKER_PROGRESS`` to the straggler watch. None when neither is on.
    """
    if stall is None and straggler is None:
        return None
    if straggler is None:
        assert stall is not None
        return stall.observe
    straggler_observe = straggler.observe
    if stall is None:
        return straggler_observe
    stall_observe = stall.observe
    metric, progress = Metric, WorkerProgress

    def observe(event: Event) -> None:
        stall_observe(event)
        cls = event.__class__
        if cls is metric or cls is progress:
            straggler_observe(event)

    return observe
