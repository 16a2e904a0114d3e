"""The goodput of the job view's model: the job's wall time split into goodput and badput as
its events are folded (:class:`~eventbus.app.readers.goodput.GoodputTracker`,
docs/goodput.md), and ``/api/state``'s ``goodput`` figure, recomputed only as often as its
cost allows.

:class:`GoodputFigure` is a part of :class:`~eventbus.app.ui.state.JobState`: the state
feeds :attr:`GoodputFigure.tracker` every event it folds (under its lock); the figure is
computed by the state's folder thread, or by a snapshot when none runs.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from eventbus.app.readers.goodput import GoodputTracker

__all__ = ["GOODPUT_COST_FACTOR", "GOODPUT_IDLE_S", "GoodputFigure"]

#: the goodput figure is recomputed no more often than this many times what it last cost
#: (a second at least): at most about 1/20 of a core, whatever the job's size
GOODPUT_COST_FACTOR = 20.0
#: the folder thread keeps the goodput figure fresh while someone read the state within
#: this many seconds (an open page's stream reads it every 5 s at least)
GOODPUT_IDLE_S = 10.0

logger = logging.getLogger("eventbus")


class GoodputFigure:
    """The job's goodput as its events are folded, and its latest figure."""

    def __init__(self) -> None:
        #: fed every folded event (under the state's lock)
        self.tracker = GoodputTracker()
        #: (when, at which seq, the figure, the CPU seconds it took)
        self._json: tuple[float, int, dict[str, Any] | None, float] = (0.0, -1, None, 0.0)
        #: when a reader last asked for the figure (time.monotonic)
        self._asked = -math.inf

    def figure(self, seq: int, until: float | None, *, folding: bool,
               reader: bool = True) -> dict[str, Any] | None:
        """``/api/state``'s ``goodput``: the object of ``eventbus goodput --json`` plus
        ``sentence``, recomputed when events arrived (``seq``: the events folded) and a
        second passed (a live job's wall time runs ``until`` now), or
        :data:`GOODPUT_COST_FACTOR` times its last computation's CPU time when that is
        longer (a large job's figure).

        A large job's figure takes a tenth of a second or more, so with the folder thread
        running (``folding``) it is recomputed there (``reader`` False), and only while
        someone read the state in the last :data:`GOODPUT_IDLE_S`; a reader then gets the
        figure there is, and computes it only when there is none, or none that recent."""
        at, seen, figure, cost = self._json
        mono = time.monotonic()
        every = max(1.0, GOODPUT_COST_FACTOR * cost)
        if reader:
            self._asked = mono
        if seen == seq and (until is None or mono - at < every):
            return figure
        if seen != -1 and mono - at < every:
            return figure
        if reader:
            if folding and seen != -1 and mono - at < every + GOODPUT_IDLE_S:
                return figure  # due: the folder thread recomputes it at its next turn
        elif mono - self._asked > GOODPUT_IDLE_S:
            return figure  # nobody reads the state: nobody would see a new figure
        began = time.thread_time()
        try:
            result = self.tracker.result(until=until)
        except Exception:
            logger.exception("eventbus: the job view's goodput figure failed")
            result = None
        figure = None if result is None else {**result.to_json(),
                                              "sentence": result.sentence()}
        self._json = (mono, seq, figure, time.thread_time() - began)
        return figure
