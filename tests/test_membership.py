"""membership.py: a node waiting while the rendezvous is full stays a spare. The rules run on
torch's own rendezvous state objects; the real agents' case (four nodes for ``--nnodes
2:3``) is tests/reliability/test_bad_hosts.py."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

from eventbus.app.launcher.recovery import membership


def _node(name: str) -> Any:
    return dr._NodeDesc(name, 1, 0)


def _settings(max_nodes: int = 3) -> Any:
    return dr.RendezvousSettings(
        run_id="job", min_nodes=2, max_nodes=max_nodes, timeout=dr.RendezvousTimeout(),
        keep_alive_interval=timedelta(seconds=5), keep_alive_max_attempt=3)


def _full_round_with_one_left_out() -> tuple[Any, Any]:
    """A round complete at MAX (a, b, c), and d still on the wait list: what a re-form
    leaves behind when d lost the race for the last place."""
    state = dr._RendezvousState()
    for name in ("a", "b", "c"):
        state.participants[_node(name)] = 0
    state.complete = True
    d = _node("d")
    state.wait_list.add(d)
    return state, d


def test_a_node_on_the_wait_list_of_a_full_round_leaves_it_and_torch_makes_it_a_spare() -> None:
    state, d = _full_round_with_one_left_out()
    assert membership.wait_list_action(state, d, 3) == "leave_wait_list"
    torchs = dr._RendezvousJoinOp
    with membership.patient_join():
        op = dr._RendezvousJoinOp()
        deadline = time.monotonic() + 60
        assert op(dr._RendezvousContext(d, state, _settings()), deadline) \
            == dr._Action.REMOVE_FROM_WAIT_LIST
        state.wait_list.remove(d)  # what the executor does with that action
        # torch's own join now: the round is full and d on no list, so the redundancy list
        assert op(dr._RendezvousContext(d, state, _settings()), deadline) \
            == dr._Action.ADD_TO_REDUNDANCY_LIST
    assert dr._RendezvousJoinOp is torchs, "torch's join op comes back"


def test_with_room_in_the_round_torch_decides_as_it_always_did() -> None:
    state, d = _full_round_with_one_left_out()
    del state.participants[_node("c")]  # c left (an eviction): a place is free
    assert not membership.full_round(state, 3)
    assert membership.wait_list_action(state, d, 3) is None
    with membership.patient_join():
        got = dr._RendezvousJoinOp()(dr._RendezvousContext(d, state, _settings()),
                                     time.monotonic() + 60)
    # on the wait list already, the round complete: d waits for the others to re-form
    assert got in (dr._Action.SYNC, dr._Action.KEEP_ALIVE)


def test_a_participant_and_a_closed_round_are_left_to_torch() -> None:
    state, d = _full_round_with_one_left_out()
    a = _node("a")
    state.wait_list.add(a)
    assert membership.wait_list_action(state, a, 3) is None  # a runs in the round
    state.closed = True
    assert not membership.full_round(state, 3)
    assert membership.wait_list_action(state, d, 3) is None


class _Holder:
    def __init__(self, state: Any) -> None:
        self.state = state


class _Handler:
    """The parts of torch's DynamicRendezvousHandler the rule reads."""

    def __init__(self, state: Any, max_nodes: int = 3) -> None:
        self._state_holder = _Holder(state)
        self._settings = _settings(max_nodes)
        self.polls = 0

    def num_nodes_waiting(self) -> int:
        self.polls += 1
        return len(self._state_holder.state.wait_list)


def test_running_nodes_re_form_for_a_waiting_node_only_while_there_is_room() -> None:
    state, _ = _full_round_with_one_left_out()
    handler = _Handler(state)
    assert membership.admit_only_with_room(handler)
    assert handler.num_nodes_waiting() == 0, "a full round cannot admit it: no re-form"
    del state.participants[_node("c")]
    assert handler.num_nodes_waiting() == 1, "c left: the group re-forms to admit d"
    assert not membership.admit_only_with_room(handler), "installed once"
    assert handler.polls == 2, "each poll reads torch's count (and its store) once"


def test_a_handler_that_is_not_torchs_dynamic_one_is_left_alone() -> None:
    class Static:
        def num_nodes_waiting(self) -> int:
            return 0

    handler = Static()
    assert not membership.admit_only_with_room(handler)
    assert "num_nodes_waiting" not in vars(handler)


def test_the_jobs_attempt_is_the_round_the_node_is_in() -> None:
    """membership.job_round: what the agent takes as the job's attempt (the same on every
    node of the round); None where the rendezvous keeps no rounds."""
    state, _ = _full_round_with_one_left_out()
    state.round = 3
    assert membership.job_round(_Handler(state)) == 3
    assert membership.job_round(object()) is None
