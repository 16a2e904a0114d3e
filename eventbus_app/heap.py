"""The agent's heap: :func:`no_collection`, the pause of automatic garbage collection that
the large builds of the agent's checks and views run under."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["no_collection"]


@contextlib.contextmanager
def no_collection() -> Iterator[None]:
    """No automatic garbage collection while the body runs; as it was afterwards.

    For a build that makes tens of thousands of small objects at once on the agent: the
    judge's stall check and culprit verdict, the job view's ``/api/state`` snapshot. The
    collections such a build sets off walk the agent's whole heap, which at 8,192 ranks is
    most of its cost (the verdict 285 ms of CPU with them, 89 ms without; the snapshot
    95-104 ms when a full collection lands in it, 30-42 ms without: docs/scale.md). The
    objects are short-lived or kept, not cycles, so nothing is left for later that a
    collection would have freed. Process-wide, for the tens of milliseconds of the body;
    nested uses leave collection off until the outermost ends.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
