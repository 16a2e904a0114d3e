"""Nodes that wait while the rendezvous is full: a spare node stays a spare.

Torch's dynamic rendezvous (2.13) has two lists for a node that is not in the running
round: the *wait list* (the running nodes see it through ``num_nodes_waiting()`` and
re-form the group to admit it) and the *redundancy list* (the round is full at MAX: the
node waits, with no join timeout, until a place is free). Every re-form moves nodes
through the wait list: a participant that leaves its round while the others have not yet
left finds the old round complete with room, and adds itself there. When the new round
fills up at MAX without it, it stays on the wait list, so the running nodes see a waiting
node and re-form again, and one node is left out again: measured with three nodes of
``--nnodes 2:3`` running and a fourth waiting, the group re-formed 13 times in 40 s and
lost all its progress until the evicted node left.

Two rules stop that, one on each side:

- :func:`admit_only_with_room`: a running node re-forms for waiting nodes only while the
  round has fewer than MAX participants. At MAX a waiting node cannot be admitted, so the
  re-form would only leave another node out.
- :func:`patient_join`: a node that finds the round complete and full while it is on the
  wait list takes itself off it; torch's own join then puts it on the redundancy list,
  where it waits with no join timeout until a node leaves (an eviction, a node's end),
  and then joins the next round as torch has it.

Both read torch's rendezvous state, which is private: where the handler is not torch's
dynamic one, or its state is not the expected shape (torch older than the redundancy
list), both leave torch's behaviour as it is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

__all__ = ["admit_only_with_room", "another_attempt_can_start", "full_round", "job_round",
           "patient_join", "wait_list_action"]


def another_attempt_can_start(worker_group: Any, *, restarts_left: int) -> bool:
    """Whether a later attempt of this node's workers can start (for the warm spares): a
    restart is left, or the round has room for a node that comes (a re-form for it uses
    no restart). Where the rendezvous has no torch settings to read: yes. So a node of a
    full round at torchrun's default ``--max-restarts 0`` (a ``--standalone`` job, say)
    keeps no spares."""
    if restarts_left > 0:
        return True
    settings = getattr(getattr(worker_group.spec, "rdzv_handler", None), "_settings", None)
    max_nodes = getattr(settings, "max_nodes", None)
    nodes = getattr(worker_group, "group_world_size", None)
    return not (isinstance(max_nodes, int) and isinstance(nodes, int) and nodes >= max_nodes)

def full_round(state: Any, max_nodes: int) -> bool:
    """Whether the rendezvous ``state`` (torch's ``_RendezvousState``) is a complete round
    with no place left: a waiting node cannot join it."""
    return bool(state.complete) and not state.closed and len(state.participants) >= max_nodes


def wait_list_action(state: Any, node: Any, max_nodes: int) -> str | None:
    """What a joining ``node`` does first, torch's join aside: ``"leave_wait_list"`` when it
    is on the wait list of a full round it is not in (it would keep the running nodes
    re-forming); None otherwise (torch's own join decides)."""
    if node in state.participants or node not in state.wait_list:
        return None
    return "leave_wait_list" if full_round(state, max_nodes) else None


def _state(handler: Any) -> Any:
    return getattr(getattr(handler, "_state_holder", None), "state", None)


def _state_and_max(handler: Any) -> tuple[Any, int] | None:
    state = _state(handler)
    max_nodes = getattr(getattr(handler, "_settings", None), "max_nodes", None)
    if state is None or not isinstance(max_nodes, int):
        return None
    if not all(hasattr(state, name) for name in ("participants", "wait_list", "complete",
                                                 "closed", "redundancy_list")):
        return None
    return state, max_nodes


def job_round(handler: Any) -> int | None:
    """The round of torch's dynamic rendezvous ``handler`` that this node is in, read right
    after its rendezvous: the same on every node of the group, one more at every re-form,
    whichever node decided it (the job's attempt, see the agent). None where the handler
    has no such state (the static backend, another handler)."""
    value = getattr(_state(handler), "round", None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def admit_only_with_room(handler: Any) -> bool:
    """Make ``handler.num_nodes_waiting()`` (what torch's agent polls to re-form the group)
    count waiting nodes only while the round has room for them. False (nothing changed)
    where the handler is not torch's dynamic rendezvous of the expected shape."""
    if _state_and_max(handler) is None or getattr(handler, "_eventbus_room", False):
        return False
    counted: Callable[[], int] = handler.num_nodes_waiting

    def num_nodes_waiting() -> int:
        waiting = counted()  # syncs the state from the store
        found = _state_and_max(handler)
        if waiting and found is not None and full_round(*found):
            return 0
        return waiting

    handler.num_nodes_waiting = num_nodes_waiting
    handler._eventbus_room = True
    return True


def _join_op_class(base: type, action: Any) -> type:
    class PatientJoinOp(base):  # type: ignore[misc]
        """Torch's join, except that a node on the wait list of a full round it is not in
        leaves the wait list first (see the module docstring)."""

        def __call__(self, ctx: Any, deadline: float) -> Any:
            if wait_list_action(ctx.state, ctx.node, ctx.settings.max_nodes):
                return action.REMOVE_FROM_WAIT_LIST
            return super().__call__(ctx, deadline)

    return PatientJoinOp


@contextlib.contextmanager
def patient_join() -> Iterator[None]:
    """While the body runs (the agent's ``next_rendezvous``), torch's dynamic rendezvous
    joins with :class:`PatientJoinOp`. Only the agent's main thread joins; the handler's
    heartbeat thread runs its keep-alive operation, which this leaves alone."""
    try:
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
    except ImportError:
        yield
        return
    base = getattr(dr, "_RendezvousJoinOp", None)
    action = getattr(dr, "_Action", None)
    if base is None or action is None or not hasattr(action, "ADD_TO_REDUNDANCY_LIST"):
        yield
        return
    setattr(dr, "_RendezvousJoinOp", _join_op_class(base, action))  # noqa: B010
    try:
        yield
    finally:
        setattr(dr, "_RendezvousJoinOp", base)  # noqa: B010
