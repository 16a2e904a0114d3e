"""The restart's anatomy: how long each phase of a recovery took.

Torch-free, on an injectable wall clock (``time.time``: the workers' marks are on theirs,
the same clock on one machine): the agent tells it what it does, each worker's beats bring
their start-up marks (eventbus_app/worker/marks.py, ``data["marks"]``), and once every rank
of the new attempt completed its first step, :meth:`Recovery.ready` gives the
``RECOVERED`` event, once per restart. The phases, in order:

- ``detect``: the agent saw the failure (or judged the stall) to its decision;
- ``stop``: the decision to the survivors gone (the rendezvous begins);
- ``rendezvous``: the new attempt's rendezvous;
- ``start``: the rendezvous's end to the script's first line (the slowest rank's): the
  agent's work after the round (its plugins, the attempt's workers' store), the workers
  handed to the spares or started, and each one's bootstrap;
- ``import``: to ``import torch`` done;
- ``init``: to ``init_process_group`` returned;
- ``restore``: the checkpoint loads before the first step;
- ``first_step``: the rest, to the first step completed (an optimizer step, or the first
  ``METRIC`` step the script records: eventbus_app/worker/marks.py).

The worker phases are the critical rank's: the one whose first step came last. A phase
whose ends were not both seen is None, never guessed; ``total_s`` runs from the failure
seen to the last rank's first step, and the phases follow one another without a gap, so
they add up to it. A restart whose workers take no optimizer step and
record no ``METRIC`` step gives no event (there is no first step to reach).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

from eventbus.events import Recovered

__all__ = ["PHASES", "Recovery"]

PHASES = ("detect", "stop", "rendezvous", "start", "import", "init", "restore", "first_step")


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _span(start: float | None, end: float | None) -> float | None:
    if start is None or end is None:
        return None
    return round(max(0.0, end - start), 3)


class Recovery:
    """One agent's restarts, phase by phase (see the module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._failed: float | None = None
        self._decided: float | None = None
        self._stopped: float | None = None
        self._rendezvous: tuple[float, float] | None = None
        self._spawned: float | None = None
        #: the attempt under recovery, its world size, and each rank's marks
        self._attempt: int | None = None
        self._world = 0
        self._marks: dict[int, Mapping[str, Any]] = {}
        #: RECOVERED events given
        self.recovered = 0

    def failed(self) -> None:
        """A failure was seen or a stall judged (the first of an attempt counts)."""
        if self._failed is None:
            self._failed = self._clock()

    def decided(self) -> None:
        if self._failed is not None and self._decided is None:
            self._decided = self._clock()

    def rendezvous(self, started: float, ended: float) -> None:
        """The rendezvous ran from ``started`` to ``ended``: the survivors were gone at its
        start (torch stops the group before it)."""
        if self._failed is None:
            return
        if self._stopped is None:
            self._stopped = started
        self._rendezvous = (started, ended)

    def spawned(self, attempt: int, world_size: int) -> None:
        """The workers of ``attempt`` (``world_size`` ranks in all) were started."""
        if self._failed is None:
            return
        self._spawned = self._clock()
        self._attempt, self._world, self._marks = attempt, world_size, {}

    def observe(self, attempt: int, rank: int, marks: Mapping[str, Any]) -> None:
        """A beat's marks (``data["marks"]``) of ``rank`` in ``attempt``."""
        if attempt == self._attempt and isinstance(marks, Mapping) and "step" in marks:
            self._marks.setdefault(rank, dict(marks))

    def ready(self) -> Recovered | None:
        """``RECOVERED`` once every rank of the attempt under recovery has its first step;
        None before (and after: one per restart)."""
        if self._attempt is None or self._failed is None or not self._world \
                or len(self._marks) < self._world:
            return None
        event = self._event(self._attempt)
        self._failed = self._decided = self._stopped = self._spawned = None
        self._rendezvous, self._attempt, self._marks = None, None, {}
        self.recovered += 1
        return event

    def _event(self, attempt: int) -> Recovered:
        critical = max(self._marks.values(), key=lambda m: _num(m.get("step")) or 0.0)
        script, torch_at = _num(critical.get("script")), _num(critical.get("torch"))
        init, step = _num(critical.get("init")), _num(critical.get("step"))
        restore = _num(critical.get("restore_s"))
        rendezvous = self._rendezvous
        phases: dict[str, float | None] = {
            "detect": _span(self._failed, self._decided),
            "stop": _span(self._decided, self._stopped),
            "rendezvous": _span(*rendezvous) if rendezvous else None,
            # from the round's end (the workers started where there was none)
            "start": _span(rendezvous[1] if rendezvous else self._spawned, script),
            # torch imported before the script's first line (a warm process): no import
            "import": _span(script, torch_at) if torch_at is None or script is None
            or torch_at >= script else 0.0,
            "init": _span(torch_at if torch_at is not None and script is not None
                          and torch_at >= script else script, init),
            "restore": round(restore, 3) if restore is not None else None,
            "first_step": None,
        }
        after = _span(init, step)
        if after is not None:
            phases["first_step"] = round(max(0.0, after - (restore or 0.0)), 3)
        total = _span(self._failed, step) or 0.0
        return Recovered(attempt=attempt, total_s=total,
                         data={"phases": phases, "ranks": len(self._marks)})
