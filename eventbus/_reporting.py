"""Rate-limited error reports: at most one per interval, and a count of what was held back.

A failing subscriber, a torch record the bridge cannot publish, a sink that drops events,
a store that is down: each can fail thousands of times a second, and a log line per failure
would bury the first one (and cost more than the work that failed). Every such site asks
one :class:`RateLimiter` "may I report now?" and, when it may, says in its one report how
much it held back since the previous one.

The limiter holds no lock: each caller already serialises its failure path with its own
lock (the bus's, the bridge's counter lock, the forwarder's client lock, the sink's thread).
It is only touched on a failure path, never on a hot path.
"""

from __future__ import annotations

import math
import time

__all__ = ["RateLimiter"]


class RateLimiter:
    """At most one report per interval; what happens in between is counted, not reported.

    Each occurrence (one failure; ``n`` events lost at once) asks :meth:`allow`::

        held = limiter.allow(REPORT_INTERVAL_S)      # or allow(interval, n)
        if held is None:
            return                                    # held back, and counted
        log(f"... ({held} more since the last report)")

    The interval is passed on every call, not fixed at construction, so a caller may read it
    from a setting that changes at run time (tests set ``eventbus.bus.REPORT_INTERVAL_S``).
    The first occurrence is always reported.
    """

    __slots__ = ("_last", "held")

    def __init__(self) -> None:
        #: when the last report went out (``time.monotonic()``); -inf: never
        self._last = -math.inf
        #: the amount held back since the last report (occurrences, or their ``n``)
        self.held = 0

    def allow(self, interval: float, n: int = 1, *, force: bool = False,
              now: float | None = None) -> int | None:
        """May the occurrence (worth ``n``) be reported now?

        Yes when ``interval`` seconds have passed since the last report (or ``force``):
        starts a new interval and returns the amount held back since the last report, not
        counting this ``n`` (0 when nothing was; compare with ``is None``). No: adds ``n``
        to the held-back amount and returns None.
        """
        if now is None:
            now = time.monotonic()
        if not force and now - self._last < interval:
            self.held += n
            return None
        held, self.held = self.held, 0
        self._last = now
        return held

    def __repr__(self) -> str:
        return f"<RateLimiter held={self.held}>"
