"""``eventbus run --alert-after SECONDS``: a person hears of a job that makes no progress
even when no verdict says why, and hears again when it moves.

The stall verdicts (``--stall-timeout``, docs/run.md) stop a group only on evidence of a
wait, and rightly so; a job can still sit for hours with no verdict: detection turned off,
a hang the judge cannot call (a rank spinning in Python, every rank waiting on storage),
a reporting-only verdict (waiting for data). People watching W&B or a chat channel write
their own watchdog for that, again and again. :class:`StuckWatch` is that watchdog, once:
it decides nothing and restarts nothing, it tells.

It runs on the agent of group rank 0 (the job-wide view; :class:`eventbus.app.sinks.
SinksPlugin` starts it) and reads only what that bus already carries:

* progress: a rank's ``WORKER_PROGRESS`` heartbeat whose ``step`` (optimizer steps) or
  ``collectives`` count went up, a ``RECOVERED``, a ``METRIC`` whose ``step`` the rank had
  not reported yet;
* silence that a verdict or a change explains, which starts the clock again:
  ``WORKER_STALLED``, ``WORKER_EXIT``, ``WORKER_RESTART``, ``RENDEZVOUS``,
  ``WORKER_START``, ``HOST_EVICTED``, ``AGENT_START``;
* ``PREEMPTING`` (a drain silences the job on purpose) and ``AGENT_EXIT`` end the watch.

When ``after_s`` passed with neither, it publishes one ``JOB_STUCK`` on the bus (every
sink hears it: the webhook posts it, W&B alerts it, the events file keeps it) with the
ranks' last known places, from their last heartbeats (``data["where"]``, or the top of
``data["stack"]``, the host, the step). The first progress after it publishes one
``JOB_UNSTUCK``; a stuck job alerts once, however long it stays stuck.

Time is the watch's own clock (``clock``, ``time.monotonic`` by default), read when an
event arrives: the tests drive it with a fake one and call :meth:`StuckWatch.check`
themselves (``start=False``); under ``eventbus run`` a daemon thread calls it about every
second, and at once when progress resumes. Events are published from that thread (or
:meth:`StuckWatch.close`, which tells a resume the thread had no time to tell before the
job ended), never from inside a delivery.
"""

from __future__ import annotations

import argparse
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from eventbus.app.health.stacks import where_of
from eventbus.app.sentences import as_int
from eventbus.app.sentences import as_number
from eventbus.bus import ALL
from eventbus.bus import Bus
from eventbus.events import Event
from eventbus.events import EventType
from eventbus.events import event_class

__all__ = ["MAX_PLACES", "StuckWatch", "parse_alert_after"]

logger = logging.getLogger("eventbus")

#: groups of ranks (one per place) a ``JOB_STUCK`` carries at most
MAX_PLACES = 16

#: what restarts the clock: a verdict, a change of the group, the agent's start
_EXPLAINED = frozenset({"WORKER_STALLED", "WORKER_EXIT", "WORKER_RESTART", "RENDEZVOUS",
                        "WORKER_START", "HOST_EVICTED", "AGENT_START"})


def parse_alert_after(text: str) -> float | None:
    """``--alert-after``: seconds > 0 (finite), or ``off`` (None, the default)."""
    if text.strip().lower() == "off":
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0 (e.g. 1800) or 'off', got "
                                         f"{text!r}")
    return value


class _Rank:
    """What the watch knows of one rank: its process, counters and last place."""

    __slots__ = ("at", "collectives", "host", "idle_s", "metric_step", "pid", "step", "where")

    def __init__(self) -> None:
        self.pid: int | None = None
        self.step: int | None = None
        self.collectives: int | None = None
        self.metric_step: int | None = None
        self.where: str | None = None
        self.host: str | None = None
        self.idle_s: float | None = None
        self.at: float | None = None  # the watch's clock when its last heartbeat came


class StuckWatch:
    """``StuckWatch(bus, after_s)``: see the module docstring. ``observe`` is the bus
    subscriber (cheap: a few dict writes under a lock); :meth:`check` publishes what is
    due and returns it; :meth:`close` unsubscribes and stops the thread."""

    def __init__(self, bus: Bus, after_s: float, *,
                 clock: Callable[[], float] = time.monotonic, start: bool = True) -> None:
        if not after_s > 0:
            raise ValueError(f"after_s must be > 0, got {after_s!r}")
        self.bus = bus
        self.after_s = float(after_s)
        self.clock = clock
        self._lock = threading.Lock()
        self._ranks: dict[int, _Rank] = {}
        self._last_progress = clock()
        # the highest step seen: the script's own (METRIC), else the optimizer's count
        self._top_metric: int | None = None
        self._top_beat: int | None = None
        #: when the progress before the stuck alert was made (None: not stuck)
        self._stuck_from: float | None = None
        self._resumed: tuple[int | None, int | None, str | None, float] | None = None
        self._over = False  # a drain or the end: no more alerts
        #: the events this watch published (JOB_STUCK, JOB_UNSTUCK), in order
        self.published: list[Event] = []
        self._subscription = bus.subscribe(ALL, on_event=self.observe)
        self._stop = threading.Event()
        self._wake = threading.Event()  # set when progress resumes: tell it at once
        self._thread: threading.Thread | None = None
        if start:
            self._thread = threading.Thread(target=self._run, name="eventbus-stuck-watch",
                                            daemon=True)
            self._thread.start()

    # -- fed by the bus ---------------------------------------------------------------------
    def observe(self, event: Event) -> None:
        kind = str(event.type)
        if kind == "WORKER_PROGRESS":
            self._beat(event)
        elif kind == "METRIC":
            self._metric(event)
        elif kind == "RECOVERED":
            with self._lock:
                self._progressed(None, None, None, self.clock())
        elif kind in _EXPLAINED:
            with self._lock:
                self._last_progress = self.clock()
                if kind in ("WORKER_RESTART", "RENDEZVOUS"):
                    self._ranks.clear()  # the old attempt's places say nothing now
        elif kind in ("PREEMPTING", "AGENT_EXIT"):
            with self._lock:
                self._over = True

    def _rank(self, event: Event) -> tuple[int, _Rank] | None:
        worker = as_int(getattr(event, "worker_id", None))
        rank = worker if worker is not None else event.context.rank
        if rank is None:
            return None
        found = self._ranks.get(rank)
        if found is None:
            found = self._ranks[rank] = _Rank()
        return rank, found

    def _beat(self, event: Event) -> None:
        now = self.clock()
        step = as_int(getattr(event, "step", None))
        collectives = as_int(getattr(event, "collectives", None))
        data = event.data
        where = data.get("where") if isinstance(data.get("where"), str) else None
        if where is None and isinstance(data.get("stack"), str):
            where = where_of(data["stack"])
        with self._lock:
            found = self._rank(event)
            if found is None:
                return
            rank, state = found
            pid = event.context.pid
            if pid != state.pid:  # a new process: its counters start from zero
                moved = bool(step) or bool(collectives)
                state.pid, state.step, state.collectives = pid, None, None
            else:
                moved = (step is not None and step > (state.step or 0)) or \
                    (collectives is not None and collectives > (state.collectives or 0))
            state.step = step if step is not None else state.step
            state.collectives = collectives if collectives is not None else state.collectives
            state.where = where
            state.host = event.context.hostname
            state.idle_s = as_number(getattr(event, "idle_s", None))
            state.at = now
            if step and (self._top_beat is None or step > self._top_beat):
                self._top_beat = step
            if moved:  # the optimizer's count, when it counts (0: none taken, or none hooked)
                self._progressed(rank, step or None, state.host, now)

    def _metric(self, event: Event) -> None:
        step = as_int(getattr(event, "step", None))
        if step is None:
            return
        now = self.clock()
        with self._lock:
            found = self._rank(event)
            if found is None:
                return
            rank, state = found
            if state.metric_step == step:
                return
            state.metric_step = step
            if self._top_metric is None or step > self._top_metric:
                self._top_metric = step
            self._progressed(rank, step, event.context.hostname, now)

    def _progressed(self, rank: int | None, step: int | None, host: str | None,
                    now: float) -> None:
        """A step was made (the lock is held)."""
        self._last_progress = now
        if self._stuck_from is not None and self._resumed is None:
            self._resumed = (rank, step, host, now - self._stuck_from)
            self._wake.set()

    # -- the clock --------------------------------------------------------------------------
    def check(self, now: float | None = None) -> Event | None:
        """Publish ``JOB_UNSTUCK`` if progress resumed, else ``JOB_STUCK`` if ``after_s``
        passed without progress and the job is not already stuck; returns it (or None).
        After a drain or the end, only a resume seen before it is still told (a job that
        moved again and then finished must not stay "stuck" in the channel)."""
        now = self.clock() if now is None else now
        with self._lock:
            if self._resumed is not None:
                rank, step, host, stuck_s = self._resumed
                self._resumed = None
                self._stuck_from = None
                kwargs: dict[str, Any] = {"stuck_s": round(stuck_s, 3), "step": step,
                                          "worker_id": rank,
                                          "data": {"host": host} if host else {}}
                kind = EventType.JOB_UNSTUCK
            elif self._over:
                return None
            elif self._stuck_from is None and now - self._last_progress >= self.after_s:
                self._stuck_from = self._last_progress
                places = self._places(now)
                kwargs = {"silent_s": round(now - self._last_progress, 3),
                          "after_s": self.after_s,
                          "step": self._top_metric if self._top_metric is not None
                          else self._top_beat,
                          "data": {"places": places[:MAX_PLACES], "ranks": len(self._ranks)}}
                kind = EventType.JOB_STUCK
            else:
                return None
        event = event_class(kind)(**kwargs)
        self.published.append(event)
        self.bus.publish(event)
        return event

    def _places(self, now: float) -> list[dict[str, Any]]:
        """The ranks grouped by their last known place, the smallest groups first (the
        odd rank out is the likeliest culprit)."""
        groups: dict[str | None, dict[str, Any]] = {}
        for rank in sorted(self._ranks):
            state = self._ranks[rank]
            group = groups.setdefault(state.where, {"where": state.where, "ranks": [],
                                                    "hosts": [], "step": None,
                                                    "idle_s": None})
            group["ranks"].append(rank)
            if state.host and state.host not in group["hosts"]:
                group["hosts"].append(state.host)
            step = state.metric_step if state.metric_step is not None else state.step or None
            if step is not None and (group["step"] is None or step > group["step"]):
                group["step"] = step
            if state.idle_s is not None and state.at is not None:
                idle = round(state.idle_s + (now - state.at), 1)
                group["idle_s"] = idle if group["idle_s"] is None else max(group["idle_s"], idle)
        return sorted(groups.values(), key=lambda g: (len(g["ranks"]), g["ranks"][0]))

    def _run(self) -> None:
        tick = min(1.0, max(0.05, self.after_s / 4))
        while not self._stop.is_set():
            self._wake.wait(tick)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self.check()
            except Exception:  # a watchdog's bug must never end the job
                logger.exception("eventbus: the --alert-after watch failed a check")

    def close(self) -> None:
        """Stop watching: end the thread, tell a resume it had not told yet (the
        sinks still hear it: they close after this), and unsubscribe."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)
        with self._lock:
            pending = self._resumed is not None
        if pending:
            try:
                self.check()
            except Exception:
                logger.exception("eventbus: the --alert-after watch failed its last check")
        self._subscription.cancel()
