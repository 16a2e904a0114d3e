"""The restart path as the agent runs it: what happens between a failure and the next
attempt's first step.

The failure seen and decided, the rendezvous, the workers started (on the warm spares
where they can be), each rank's start-up marks, then ``RECOVERED`` with the restart's
phases (:class:`~eventbus.app.launcher.recovery.anatomy.Recovery`); the ``WORKER_RESTART`` that
opens the new attempt; the spares of the next attempt
(:class:`~eventbus.app.launcher.recovery.spares.SparePool`), started with the workers of an attempt
that started fresh (they warm up while the workers start, not while they train), and once
this attempt's workers took their first step where it started on spares (its way to that
step has the CPU alone); from the workers' first step on, at the lowest priority
(eventbus_app/worker/yielding.py).

Why a module of its own: that bookkeeping is one concern with its own state (the launches
the spares copy, the ranks that took their step, the attempt the spares were started for),
apart from the torch hooks that call it. Torch-free, on an injectable clock, and the
hand-over to torch's process context is injectable too (``serve``, default
:func:`~eventbus.app.launcher.recovery.spares.serving`, which imports torch when used), so a unit
test drives it with a bus and events alone (tests/test_restarts.py).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Iterator
from collections.abc import Mapping
from contextlib import AbstractContextManager

from eventbus.app.launcher.cli import console
from eventbus.app.launcher.recovery.anatomy import Recovery
from eventbus.app.launcher.recovery.exit_watch import ExitWatch
from eventbus.app.launcher.recovery.exit_watch import QuickWaits
from eventbus.app.launcher.recovery.spares import SparePool
from eventbus.app.launcher.recovery.spares import serving
from eventbus.app.protocol import agent_worker as protocol
from eventbus.app.sentences import sentence
from eventbus.bus import Bus
from eventbus.events import Event
from eventbus.events import EventType
from eventbus.events import WorkerRestart

__all__ = ["SPARES_AFTER_S", "Launched", "Restarts"]

#: the warm spares start this long into an attempt at the latest (spares.py)
SPARES_AFTER_S = 30.0

#: local rank -> (interpreter, its options, environment) each worker was started with
Launched = dict[int, tuple[str, tuple[str, ...], dict[str, str]]]


class Restarts:
    """One agent's recoveries and warm spares (see the module docstring).

    ``clock``: monotonic seconds (when the spares start); ``serve``: the hand-over of the
    spares to torch's process context while it starts the workers.
    """

    def __init__(self, bus: Bus, *, warm_spares: bool | str = True,
                 clock: Callable[[], float] = time.monotonic,
                 recovery: Recovery | None = None, spares: SparePool | None = None,
                 serve: Callable[[SparePool, Launched], AbstractContextManager[None]] = serving
                 ) -> None:
        self._bus = bus
        self._clock = clock
        self._serve = serve
        #: the restart's anatomy (anatomy.py): RECOVERED once a restart reached its step
        self.recovery = recovery if recovery is not None else Recovery()
        #: one waiting worker per local rank for the next attempt (spares.py)
        self.spares = spares if spares is not None else SparePool(
            enabled=warm_spares not in (False, "off"), cuda=warm_spares == "cuda",
            template=True)
        self._launched: Launched = {}
        #: the monitor's wait, woken by a worker's exit (exit_watch.py); its interval is
        #: set while the agent runs (0 before: no wait)
        self.exit_watch = ExitWatch(0.0)
        #: torch's wait for the workers it stopped, ended by their exit (exit_watch.py)
        self.quick_waits = QuickWaits()
        #: (attempt, rank) of the ranks whose first step is done (their marks came): the
        #: spares start once this node's workers all took theirs
        self._stepped: set[tuple[int, int]] = set()
        self._spares_for = -1
        #: whether the attempt last started took a spare (its own spares wait for its step)
        self._on_spares = False
        #: the attempt whose workers' first step put the spares at the lowest priority
        self._demoted_for = -1
        self._started_at = clock()
        self._marks_sub = bus.subscribe(EventType.WORKER_PROGRESS,
                                        on_event=self.observe_marks)

    # -- the recovery's phases -------------------------------------------------------------
    def failed(self) -> None:
        """A failure was seen or a stall judged (the first of an attempt counts)."""
        self.recovery.failed()

    def decided(self) -> None:
        """The failure was decided on: the group restarts."""
        self.recovery.decided()

    def rendezvous(self, started: float, ended: float) -> None:
        """The new attempt's rendezvous ran from ``started`` to ``ended`` (wall clock)."""
        self.recovery.rendezvous(started, ended)

    def restarting(self, attempt: int, *, restarts_left: int, reason: str, cause: str,
                   decided: bool) -> WorkerRestart:
        """``WORKER_RESTART`` of ``attempt``, published; its line on the console when no
        failure decided it (torch's decision: the failure's line said the rest)."""
        restart = WorkerRestart(attempt=attempt, restarts_left=restarts_left,
                                reason=reason, cause=cause)
        self._bus.publish(restart)
        if not decided:
            console.write(sentence(restart))
        return restart

    @contextlib.contextmanager
    def starting(self) -> Iterator[None]:
        """While torch's process context starts the workers: each takes its local rank's
        spare where it can, and each launch is noted for the next spares."""
        self._launched = {}
        used = self.spares.used
        with self._serve(self.spares, self._launched):
            yield
        self._on_spares = self.spares.used > used

    def started(self, attempt: int, world_size: int,
                pids: Mapping[int, object] | None = None) -> None:
        """The workers of ``attempt`` (``world_size`` ranks in all) were started, this
        node's with ``pids`` (local rank -> pid): the exit watch watches them."""
        self._started_at = self._clock()
        self.recovery.spawned(attempt, world_size)
        self.exit_watch.watch(pid for pid in (pids or {}).values() if isinstance(pid, int))

    def observe_marks(self, event: Event) -> None:
        """A worker's start-up marks (a beat's ``data["marks"]``), for the anatomy."""
        found = event.data.get(protocol.MARKS_KEY)
        rank = getattr(event, "worker_id", None)
        attempt = event.context.restart_count if event.context is not None else None
        if found is not None and isinstance(rank, int) and isinstance(attempt, int):
            self._stepped.add((attempt, rank))
            self.recovery.observe(attempt, rank, found)

    def tick(self) -> None:
        """The monitor's tick: the wait torch's loop would sleep (one interval, ended by a
        worker's exit: :class:`ExitWatch`), then :meth:`recovered`."""
        self.exit_watch.wait()
        self.recovered()

    def recovered(self) -> None:
        """Publish RECOVERED (and its console line) once the restart reached its step."""
        event = self.recovery.ready()
        if event is not None:
            self._bus.publish(event)
            console.write(sentence(event))

    # -- the warm spares -------------------------------------------------------------------
    def fill_spares(self, attempt: int, ranks: Iterable[int], *, draining: bool,
                    wanted: bool = True) -> None:
        """Start the spares of the next attempt: at once where this attempt's workers
        started fresh, so that they warm up while the workers start, not while they train;
        where they started on spares, once this node's workers (``ranks``) all took their
        first step (or :data:`SPARES_AFTER_S` into the attempt), so that the restart's way
        to its step has the CPU alone. From that step on, every spare still warming up
        does so at the lowest priority (eventbus_app/worker/yielding.py). None during a
        drain (it starts no new attempt). ``wanted`` False: no later attempt can start
        (no restart left, and no room in the round for a node that comes): no spare is
        started, and those there are ended."""
        pool = self.spares
        if not wanted:
            if self._spares_for != -2:  # once: the spares and the template ended
                self._spares_for = -2
                pool.close()
            return
        if not pool.enabled or not self._launched or draining:
            return
        pool.service()  # the spares the template forked since the last tick
        mine = set(ranks)
        stepped = mine <= {r for a, r in self._stepped if a == attempt} or \
            self._clock() - self._started_at >= SPARES_AFTER_S
        if self._spares_for != attempt and (stepped or not self._on_spares):
            self._spares_for = attempt
            pool.fill(self._launched, low=stepped)
        if stepped and self._demoted_for != attempt:
            self._demoted_for = attempt
            pool.demote()

    def close(self) -> None:
        """The agent's end: every spare ended, the marks no longer observed."""
        self.spares.close()
        self.exit_watch.close()
        self._marks_sub.cancel()
