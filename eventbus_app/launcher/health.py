"""Job health on the agent: stalled workers, stragglers, and the stacks of a stalled node.

Torch-free and clock-injectable, so that the rules are unit-tested without a job; the agent
(:mod:`eventbus.app.launcher.agent`) feeds the watches the events that reach its bus and
asks them once per monitor interval. The rules (docs/run.md, "Job health"):

* **stall**: after a worker's first progress in an attempt, none for longer than the
  timeout while its process lives. Any event type counts, and a ``WORKER_PROGRESS``
  heartbeat (the worker's progress watch, no call in the script) counts when its step,
  collective count or a group's enqueued count advanced, dated ``idle_s`` before its
  arrival. Before the first progress a worker is never stalled; nor once its last
  heartbeat says its script ended (or its process groups are gone). Who holds a stall up
  is decided by :mod:`eventbus.app.launcher.culprit` on the agent. An event whose
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

import argparse
import contextlib
import math
import os
import signal
import statistics
import tempfile
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

from eventbus.events import Event
from eventbus.events import Metric
from eventbus.events import WorkerProgress

__all__ = [
    "AUTO_FACTOR",
    "AUTO_FLOOR_S",
    "DEFAULT_SLOW_FACTOR",
    "DEFAULT_STOP_EXIT_CODE",
    "EXPECT_SILENCE_KEY",
    "MAX_STACK_CHARS",
    "STALL_STOP_GRACE_S",
    "Slow",
    "StackDumper",
    "Stall",
    "StallWatch",
    "StragglerWatch",
    "observer",
    "parse_slow_factor",
    "parse_stall_auto_floor",
    "parse_stall_timeout",
    "parse_stop_exit_code",
    "stop_processes",
]

#: ``--stop-exit-code`` default: not 1 (torchrun's ordinary failure, which schedulers
#: retry), not 2 (a usage error), below 126 (the shell's) and 128 (killed by a signal);
#: Kubeflow's ``restartPolicy: ExitCode`` treats 1-127 as permanent: "do not retry"
DEFAULT_STOP_EXIT_CODE = 3
#: ``--slow-factor`` default
DEFAULT_SLOW_FACTOR = 2.0
#: ``--stall-timeout auto``: never below this many seconds...
AUTO_FLOOR_S = 60.0
#: ... and this many times the longest interval the worker came back from
AUTO_FACTOR = 5.0
#: ``data[EXPECT_SILENCE_KEY] = seconds`` in any event announces a quiet period
EXPECT_SILENCE_KEY = "expect_silence_s"
#: ``data[EXITING_KEY] = True`` in a worker's last heartbeat: its script has ended
EXITING_KEY = "exiting"
#: a stalled group is stopped by SIGTERM, then SIGKILL after this many seconds (a worker
#: blocked in a C call, a collective say, never runs its Python SIGTERM handler)
STALL_STOP_GRACE_S = 5.0
#: each stack in an event is cut to this many characters (its end, the innermost frames
#: of the last thread, is kept whole by faulthandler's "most recent call first" order)
MAX_STACK_CHARS = 32_000


#: ``--progress`` sources, and the default (all of them)
PROGRESS_SOURCES = ("collectives", "steps", "events")
DEFAULT_PROGRESS = ",".join(PROGRESS_SOURCES)
#: the workers' environment: their progress sources (eventbus_app/worker/progress.py)
ENV_PROGRESS = "EVENTBUS_PROGRESS"
#: the flight recorder's ring size, set for the workers unless the user set one of
#: :data:`FR_USER_SETTINGS` (torch reads it when a process group is created)
ENV_FR_BUFFER = "TORCH_FR_BUFFER_SIZE"
FR_USER_SETTINGS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
FR_BUFFER_SIZE = 64
#: the workers' environment: the run's folder of flight-recorder dumps
ENV_FR_DUMP_DIR = "EVENTBUS_FR_DUMP_DIR"
#: the request file in that folder, and how long the agent waits for the dumps
FR_REQUEST_FILE = "request"
FR_DUMP_WAIT_S = 2.0
#: the file name prefix of each rank's dump (``fr_trace`` infers it)
FR_DUMP_PREFIX = "fr_trace_rank_"
#: a node other than group rank 0 acts on its own stalled ranks only this many seconds
#: after their timeout (group rank 0 judges the job; its restart normally comes first)
JUDGE_GRACE_S = 15.0
#: a rank whose latest heartbeat is older than this has stopped sending them (its progress
#: thread sends an idle beat every 2 s while it lives): its script is likely ending
BEATS_STOPPED_S = 3.5


# -- the command line ----------------------------------------------------------------------


def _number_or(text: str, keyword: str | None, *, above: float, what: str) -> float | None:
    """A finite number > ``above``, or None for ``keyword``; anything else is a usage error
    that says what is expected."""
    if keyword is not None and text.strip().lower() == keyword:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= above:
        expected = what if keyword is None else f"{what} or {keyword!r}"
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def parse_stall_timeout(text: str) -> float | Literal["auto"]:
    """``--stall-timeout``: seconds > 0 (finite) or ``auto``."""
    value = _number_or(text, "auto", above=0, what="seconds > 0")
    return "auto" if value is None else value


def parse_stall_auto_floor(text: str) -> float:
    """``--stall-auto-floor``: seconds > 0 (finite)."""
    value = _number_or(text, None, above=0, what="seconds > 0")
    assert value is not None  # no keyword: a number or a usage error
    return value


def parse_slow_factor(text: str) -> float | None:
    """``--slow-factor``: a number > 1, or ``off`` (None)."""
    return _number_or(text, "off", above=1, what="a factor > 1")


def parse_progress(text: str) -> tuple[str, ...]:
    """``--progress``: ``off``, or a comma list of ``collectives``, ``steps``, ``events``
    (``all``: the three). Returns the sources in their canonical order."""
    tokens = [t.strip().lower() for t in text.split(",") if t.strip()]
    valid = f"off, or a comma list of {', '.join(PROGRESS_SOURCES)} (default: all three)"
    if tokens == ["off"]:
        return ()
    if tokens == ["all"]:
        return PROGRESS_SOURCES
    bad = [t for t in tokens if t not in PROGRESS_SOURCES]
    if not tokens or bad:
        raise argparse.ArgumentTypeError(
            f"expected {valid}, got {text!r}" + (f" ({', '.join(map(repr, bad))} is not a "
                                                  "source)" if bad else ""))
    return tuple(src for src in PROGRESS_SOURCES if src in tokens)


def parse_stop_exit_code(text: str) -> int:
    """``--stop-exit-code``: an int from 1 to 125 (0 would say "succeeded")."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an exit code 1-125, got {text!r}") from None
    if not 1 <= value <= 125:
        raise argparse.ArgumentTypeError(f"expected an exit code 1-125, got {text!r}")
    return value


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
        self._reported: set[tuple[int, int]] = set()
        self._lock = threading.Lock()
        self._auto = timeout == "auto"

    def observe(self, event: Event) -> None:
        """Note a worker's event (events without a rank, the agents' own, are skipped).

        The agent pays this per event: kept to a clock read, a dict lookup and stores.
        """
        ctx = event.context
        rank = ctx.rank
        if rank is None:
            return
        key = (ctx.restart_count or 0, rank)
        now = self._clock()
        seen = self._seen.get(key)
        if isinstance(event, WorkerProgress):
            self.observe_progress(key, event, now, seen)
            return
        if seen is None:
            self._seen[key] = seen = _Seen(now)
        else:
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
            for key in [k for k in self._seen if k[0] < attempt]:
                del self._seen[key]
            for key in [k for k in self._early if k[0] < attempt]:
                del self._early[key]


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
        #: (attempt, rank) -> recent heartbeats' compute_s (time outside collectives)
        self._compute: dict[tuple[int, int], deque[float]] = {}
        self._last_report: dict[int, float] = {}

    def observe_progress(self, beat: WorkerProgress) -> None:
        """Note a heartbeat's ``data["compute_s"]`` (the rank's own clock; idle beats,
        which carry none, skip)."""
        rank = beat.context.rank
        if rank is None:
            rank = beat.worker_id
        compute = _number(beat.data.get("compute_s")) if beat.data else None
        if compute is None or beat.idle_s >= 1.0:
            return
        key = (beat.context.restart_count or 0, rank)
        window = self._compute.get(key)
        if window is None:
            window = self._compute[key] = deque(maxlen=self.window)
        window.append(compute)

    def observe(self, event: Event) -> None:
        """Note a ``METRIC`` event's step, or a heartbeat's compute time (others, and those
        without step or rank, skip)."""
        if isinstance(event, WorkerProgress):
            self.observe_progress(event)
            return
        if not isinstance(event, Metric) or event.step is None:
            return
        ctx = event.context
        if ctx.rank is None:
            return
        key = (ctx.restart_count or 0, ctx.rank)
        own = event.data.get("step_time_s") if event.data else None
        if not isinstance(own, (int, float)) or isinstance(own, bool):
            own = None
        steps = self._steps.get(key)
        if steps is None:
            steps = self._steps[key] = deque(maxlen=self.window + 1)
        elif steps and event.step <= steps[-1].step:
            steps.clear()  # the step counter went back: a new epoch's numbering, say
        steps.append(_Step(event.step, event.timestamp, None if own is None else float(own)))

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
        """The median of the rank's recent heartbeats' ``compute_s`` (None with fewer than
        ``min_beats``)."""
        window = self._compute.get((attempt, rank))
        if not window or len(window) < self.min_beats:
            return None
        return float(statistics.median(window))

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
        for rank, t in sorted(times.items()):
            median = statistics.median([v for r, v in times.items() if r != rank])
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
        for key in [k for k in self._steps if k[0] < attempt]:
            del self._steps[key]
        for key in [k for k in self._compute if k[0] < attempt]:
            del self._compute[key]


def observer(stall: StallWatch | None, straggler: StragglerWatch | None
             ) -> Callable[[Event], None] | None:
    """One bus subscriber (``ALL``) feeding both watches: one dispatch per event, not two.

    The agent pays it for every event that reaches its bus (8 workers x 1,000 events/s is
    8,000 calls a second), so it is the two ``observe`` methods fused into one function with
    everything it touches bound once: per worker event one clock read, one dict lookup and
    a few stores; per ``METRIC`` with a ``step`` one more lookup and a deque append. It
    writes exactly what :meth:`StallWatch.observe` and :meth:`StragglerWatch.observe`
    write (``tests/test_health.py`` feeds both the same events and compares).
    """
    if stall is None and straggler is None:
        return None
    if stall is not None:
        seen_map = stall._seen
        clock = stall._clock
        auto = stall._auto
        new_seen = _Seen
    if straggler is not None:
        steps_map = straggler._steps
        maxlen = straggler.window + 1
    watch_stalls = stall is not None
    watch_steps = straggler is not None
    metric_class = Metric
    quiet_key = EXPECT_SILENCE_KEY

    # The store receiver's decoder hands every event of one worker the same context object
    # (it caches decoded contexts): the entries of the previous event's context are reused,
    # no key built, no lookup. One tuple, replaced whole: safe with several receiver threads.
    hit: list[tuple[Any, Any, _Seen | None, Any]] = [(None, None, None, None)]

    progress_class = WorkerProgress

    def observe(event: Event) -> None:
        if event.__class__ is progress_class:  # about one a second per worker
            if stall is not None:
                stall.observe(event)
            if straggler is not None:
                straggler.observe(event)
            hit[0] = (None, None, None, None)  # the heartbeat may have made the rank's entry
            return
        ctx = event.context
        cached_ctx, key, seen, steps = hit[0]
        if ctx is not cached_ctx:
            rank = ctx.rank
            if rank is None:
                return  # the agents' own events
            key = (ctx.restart_count or 0, rank)
            seen = seen_map.get(key) if watch_stalls else None
            steps = steps_map.get(key) if watch_steps else None
            miss = True
        else:
            miss = False
        data = event.data
        if watch_stalls:
            now = clock()
            if seen is None:
                seen_map[key] = seen = new_seen(now)
                miss = True
            else:
                if auto and now - seen.last > seen.longest:
                    seen.longest = now - seen.last
                seen.last = now
            if data and quiet_key in data:
                quiet = data[quiet_key]
                if isinstance(quiet, (int, float)) and not isinstance(quiet, bool) \
                        and quiet > 0:
                    seen.quiet_until = now + float(quiet)
        if watch_steps and event.__class__ is metric_class:
            step = event.step
            if step is not None:
                own = data.get("step_time_s") if data else None
                if own is not None:
                    own = (float(own) if isinstance(own, (int, float))
                           and not isinstance(own, bool) else None)
                if steps is None:
                    steps = steps_map.get(key)
                    if steps is None:
                        steps = steps_map[key] = deque(maxlen=maxlen)
                    miss = True
                elif steps and step <= steps[-1].step:
                    steps.clear()  # the step counter went back: a new epoch's numbering
                steps.append(_Step(step, event.timestamp, own))
        if miss:
            hit[0] = (ctx, key, seen, steps)

    return observe


# -- stacks --------------------------------------------------------------------------------


class StackDumper:
    """Ask workers for their Python stacks through the files of ``directory``.

    A worker of ``eventbus run`` with ``EVENTBUS_STACK_DIR`` set arms ``faulthandler`` on
    a signal and writes the signal's number to ``<dir>/<pid>.sig``
    (:func:`eventbus.app.worker.stack_dump.arm_stack_dump`); this sends that signal and reads
    what the worker's C handler appended to ``<dir>/<pid>.stack``. A worker without the
    ``.sig`` file (opted out, or not started through the worker bootstrap) is never
    signalled.
    """

    def __init__(self, directory: str, *, wait_s: float = 1.0) -> None:
        self.directory = directory
        self.wait_s = wait_s

    def _path(self, pid: int, suffix: str) -> str:
        return os.path.join(self.directory, f"{pid}.{suffix}")

    def capture(self, pids: Iterable[int]) -> dict[int, str]:
        """pid -> the stack text each armed, live worker wrote (others: a note why not)."""
        offsets: dict[int, int] = {}
        result: dict[int, str] = {}
        for pid in pids:
            try:
                with open(self._path(pid, "sig"), encoding="utf-8") as f:
                    signum = int(f.read().strip())
            except (OSError, ValueError):
                result[pid] = ("(no stack: the worker did not arm the stack dump; "
                               "EVENTBUS_STACK_SIGNAL=off, or it did not start through the worker "
                               "bootstrap: a --no-python program)")
                continue
            try:
                offsets[pid] = os.path.getsize(self._path(pid, "stack"))
                os.kill(pid, signum)
            except OSError as exc:
                result[pid] = f"(no stack: {exc})"
                offsets.pop(pid, None)
        deadline = time.monotonic() + self.wait_s
        sizes = {pid: -1 for pid in offsets}
        stable = 0
        while offsets and time.monotonic() < deadline:
            time.sleep(0.05)
            now = {pid: _size(self._path(pid, "stack")) for pid in offsets}
            grown = all(now[pid] > offsets[pid] for pid in offsets)
            if grown and now == sizes:
                stable += 1
                if stable >= 2:
                    break
            else:
                stable = 0
            sizes = now
        for pid, offset in offsets.items():
            try:
                with open(self._path(pid, "stack"), encoding="utf-8",
                          errors="replace") as f:
                    f.seek(offset)
                    text = f.read()
            except OSError as exc:
                text = f"(no stack: {exc})"
            if not text:
                text = "(no stack: the worker wrote nothing within the wait)"
            result[pid] = text[-MAX_STACK_CHARS:]
        return result


# -- flight-recorder dumps -----------------------------------------------------------------


def fr_dump_root(run_id: str) -> str:
    """The run's folder of flight-recorder dumps: the same path on every node, kept after
    the job (``$TMPDIR/eventbus-fr/<run id>``); each attempt's dumps go to its
    ``attempt<A>`` folder, which the agent names in the workers' ``EVENTBUS_FR_DUMP_DIR``."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in run_id) or "run"
    return os.path.join(tempfile.gettempdir(), "eventbus-fr", safe)


def ask_fr_dumps(folder: str, token: str) -> int:
    """Ask the workers whose ``EVENTBUS_FR_DUMP_DIR`` is ``folder`` for their traces:
    ``token`` goes to ``<folder>/request`` whole (a temp file and a rename); each worker
    serves a new token once (eventbus_app/worker/progress.py). Returns when it asked
    (``time.time_ns()``, less a second for coarse file times), for :func:`wait_fr_dumps`."""
    os.makedirs(folder, exist_ok=True)
    asked = time.time_ns() - 1_000_000_000
    tmp = os.path.join(folder, f".{FR_REQUEST_FILE}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(token + "\n")
    os.replace(tmp, os.path.join(folder, FR_REQUEST_FILE))
    return asked


def wait_fr_dumps(folder: str, ranks: Iterable[int], asked: int, *,
                  wait_s: float = FR_DUMP_WAIT_S) -> bool:
    """Wait up to ``wait_s`` for a ``fr_trace_rank_<r>`` newer than ``asked`` of each of
    ``ranks``; whether at least one came."""
    want = [os.path.join(folder, f"{FR_DUMP_PREFIX}{r}") for r in ranks]

    def fresh(path: str) -> bool:
        try:
            return os.stat(path).st_mtime_ns >= asked
        except OSError:
            return False

    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and not all(fresh(p) for p in want):
        time.sleep(0.05)
    return any(fresh(p) for p in want)


def request_fr_dumps(folder: str, token: str, ranks: Iterable[int], *,
                     wait_s: float = FR_DUMP_WAIT_S) -> str | None:
    """:func:`ask_fr_dumps` and :func:`wait_fr_dumps`: ``folder`` when at least one dump
    came, else None (workers without the progress watch, or opted out)."""
    asked = ask_fr_dumps(folder, token)
    return folder if wait_fr_dumps(folder, ranks, asked, wait_s=wait_s) else None


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return -1


def stop_processes(pids: Mapping[int, Any], *, grace_s: float,
                   alive: Callable[[int], bool]) -> None:
    """SIGTERM each pid, and SIGKILL those still ``alive`` after ``grace_s`` seconds."""
    for pid in pids:
        if alive(pid):
            _kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(alive(pid) for pid in pids):
        time.sleep(0.05)
    for pid in pids:
        if alive(pid):
            _kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and any(alive(pid) for pid in pids):
        time.sleep(0.05)


def _kill(pid: int, signum: int) -> None:
    with contextlib.suppress(OSError):
        os.kill(pid, signum)
