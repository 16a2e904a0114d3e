"""The rendezvous round of a restart, without torch's fixed sleeps.

A restart runs torch's whole c10d rendezvous round again (the node leaves the round it was
in and joins the next; the ranks follow from the round), and that round is kept as it is:
it is what makes every node agree on the attempt, its members and their ranks, and what
admits a waiting node or drops a lost one. What this module takes out of it are three
costs that are no part of that agreement:

- **The first run's jitter on the first restart.** ``next_rendezvous`` sleeps a random
  0-0.3 s while the round number is 0, to spread the first joins of many nodes over time.
  The round is still 0 when the first restart begins (it moves to 1 as the last node
  leaves it), so the first restart of every job slept 0.15 s on average: on one node
  this was most of the restart's rendezvous (0.1-0.39 s measured, against 0.06 s without
  it). The agent skips that sleep when it restarts (:func:`restart_round`); the first
  rendezvous keeps it.
- **The one-second poll while nodes gather.** A node whose round is not complete (it
  waits for another node to leave the old round, or to join the new one) sleeps a second
  between two looks at the shared state, and its state holder reads the store at most
  once a second (its cache): a restart of several nodes took one second or more there,
  on each node. During a restart's round, the first :data:`QUICK_WINDOW_S` of that
  polling go at :data:`QUICK_POLL_S`, each look a read of the store (the cache is off
  meanwhile); torch's one second after that, the cache as it was (a node that waits
  long, for a slow peer or a join timeout, loads the store no more than torch does). The
  price: a restart of N nodes reads the state up to N / :data:`QUICK_POLL_S` times a
  second, for :data:`QUICK_WINDOW_S` at most.
- **The records' stack walks.** Each of torch's rendezvous records names its caller with
  ``inspect.stack()``, three times (twice in ``get_method_name``, once in
  ``construct_and_record_rdzv_event``, which the agent's bridge of torch's records makes
  run), and each reads the source of every frame on the stack: about 0.5 ms each, some
  25 per round, several times that on a loaded machine. :func:`cheap_method_names` puts
  :func:`get_method_name`, a frame walk, in the place of the first, and gives torch's
  events module an ``inspect`` whose ``stack()`` is :func:`outer_frames`, the two frames
  it reads, with the same answers.

All three patch torch's private modules (``dynamic_rendezvous``, and ``events`` for the
last); where they are not there or have another shape (another torch), they change
nothing (tests/test_restart_round.py pins the code they stand in for). Torch-free to
import.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import time
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

import attrs

from eventbus.app.launcher.recovery import membership

__all__ = ["QUICK_POLL_S", "QUICK_WINDOW_S", "RoundCounts", "FrameName", "cheap_method_names",
           "get_method_name", "outer_frames", "joining", "quick_delay", "restart_round"]

#: how often a restarting node polls the rendezvous state while its round gathers
QUICK_POLL_S = 0.05
#: for how long after the restart's rendezvous began (torch's 1 s after that)
QUICK_WINDOW_S = 5.0
#: torch's poll interval while a round gathers (``_Action.SYNC``)
_TORCH_POLL_S = 1.0


@attrs.define
class RoundCounts:
    """What a restart's round left out: the jitter sleeps skipped, the polls shortened."""

    jitter_skipped: int = 0
    quick_polls: int = 0
    #: whether the round was a restart's (the counts apply)
    restarting: bool = False

    def facts(self) -> dict[str, int]:
        """The counts."""
        return {"jitter_skipped": self.jitter_skipped, "quick_polls": self.quick_polls}

    def data(self) -> dict[str, dict[str, int]]:
        """What the ``RENDEZVOUS`` event carries: ``{"restart_round": facts}`` after a
        restart's round, nothing after the first."""
        return {"restart_round": self.facts()} if self.restarting else {}


def _module() -> Any:
    try:
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    except ImportError:
        return None
    return dynamic_rendezvous


def get_method_name(depth: int = 2) -> str:
    """What torch's ``get_method_name`` says (the name of the function ``depth`` frames up
    the stack, 0 being this one), found by walking the frames, reading no source."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:
        return "no_method_name"


@attrs.frozen
class FrameName:
    """What torch's events module reads of a frame of ``inspect.stack()``."""

    filename: str
    function: str


def outer_frames() -> list[FrameName]:
    """``inspect.stack()`` as torch's ``construct_and_record_rdzv_event`` reads it: the
    caller's frame and the one above it (their file and function), read from the frames
    without their source."""
    found: list[FrameName] = []
    frame = sys._getframe(1)
    while frame is not None and len(found) < 2:
        found.append(FrameName(frame.f_code.co_filename, frame.f_code.co_name))
        frame = frame.f_back  # type: ignore[assignment]
    return found


class _Inspect:
    """``inspect`` for torch's events module: :func:`outer_frames` as ``stack()``, the
    rest the real module's."""

    stack = staticmethod(outer_frames)

    def __getattr__(self, name: str) -> Any:
        return getattr(inspect, name)


def cheap_method_names() -> bool:
    """Give torch's dynamic rendezvous :func:`get_method_name` in place of its own, and its
    events module an ``inspect`` whose ``stack()`` is :func:`outer_frames` (once; the
    records say the same). False where there is nothing to replace."""
    changed = False
    module = _module()
    original = getattr(module, "get_method_name", None)
    if original is not None and original is not get_method_name:
        setattr(module, "get_method_name", get_method_name)  # noqa: B010
        changed = True
    try:
        from torch.distributed.elastic import events
    except ImportError:
        return changed
    if getattr(events, "inspect", None) is inspect:
        setattr(events, "inspect", _Inspect())  # noqa: B010
        changed = True
    return changed


def quick_delay(delay: Callable[[Any], None], counts: RoundCounts, *,
                until: float, clock: Callable[[], float] = time.monotonic,
                window_over: Callable[[], None] = lambda: None) -> Callable[..., None]:
    """Torch's ``_delay`` for a restart's round: the random jitter (a ``(low, high)``
    tuple) skipped, the gathering poll (one second) at :data:`QUICK_POLL_S` until
    ``until`` on ``clock`` (then ``window_over()``, once); anything else passed to
    ``delay``."""
    over = [False]

    def quick(seconds: Any) -> None:
        if isinstance(seconds, tuple):
            counts.jitter_skipped += 1
            return
        if seconds == _TORCH_POLL_S:
            if clock() < until:
                counts.quick_polls += 1
                delay(QUICK_POLL_S)
                return
            if not over[0]:
                over[0] = True
                window_over()
        delay(seconds)

    return quick


@contextlib.contextmanager
def restart_round(handler: Any, *, restarting: bool) -> Iterator[RoundCounts]:
    """While the body runs (the agent's rendezvous on torch's dynamic rendezvous
    ``handler``): where ``restarting``, torch's rendezvous sleeps as :func:`quick_delay`
    says and its state holder reads the store at each look until the window is over.
    Yields the counts (zero where nothing was changed). The heartbeat thread's keep-alive
    never sleeps through ``_delay``; it may read the store once more meanwhile."""
    counts = RoundCounts(restarting=restarting)
    module = _module()
    original = getattr(module, "_delay", None)
    if not restarting or original is None:
        yield counts
        return
    holder: Any = getattr(handler, "_state_holder", None)
    cached = getattr(holder, "_cache_duration", None)
    cache = isinstance(cached, (int, float)) and not isinstance(cached, bool)

    def cache_back() -> None:
        if cache:
            holder._cache_duration = cached

    if cache:
        holder._cache_duration = 0
    setattr(module, "_delay",  # noqa: B010
            quick_delay(lambda s: original(seconds=s), counts,
                        until=time.monotonic() + QUICK_WINDOW_S, window_over=cache_back))
    try:
        yield counts
    finally:
        setattr(module, "_delay", original)  # noqa: B010
        cache_back()


@contextlib.contextmanager
def joining(handler: Any, formation: Any) -> Iterator[RoundCounts]:
    """The agent's rendezvous on ``handler``: torch's join as
    :func:`membership.patient_join
    <eventbus.app.launcher.recovery.membership.patient_join>` has it, its records named
    cheaply (:func:`cheap_method_names`), its sleeps as :func:`restart_round` has them
    where a group formed before (``formation.formed``: a restart or a re-form). Yields
    the counts."""
    cheap_method_names()
    with membership.patient_join(), \
            restart_round(handler, restarting=bool(formation.formed)) as counts:
        yield counts
