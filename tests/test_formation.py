"""The attempt each rendezvous forms (eventbus_app/launcher/recovery/formation.py), without torch:
the rendezvous round where the handler has rounds, so that a node whose group re-formed
without a restart of its own files its workers under the same attempt as the other
nodes; torch's restart count where it has none; and what plugins get after it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from eventbus.app.launcher.recovery.formation import Formation
from eventbus.app.launcher.recovery.formation import find_tcp_store
from eventbus.app.launcher.recovery.formation import rendezvous_info
from eventbus.bus import Bus


def _handler(round_: int | None) -> Any:
    state = SimpleNamespace(round=round_) if round_ is not None else None
    return SimpleNamespace(_state_holder=SimpleNamespace(state=state))


def test_without_rounds_the_attempt_is_torchs_restart_count() -> None:
    formation = Formation()
    assert formation.next_attempt(max_restarts=3, remaining_restarts=3) == 0
    assert formation.formed_as(_handler(None), predicted=0) is False
    assert formation.attempt == 0 and not formation.rounds
    # a restart used: the next attempt is 1, and a STOP (restarts left 0) does not
    # renumber the attempt that failed: it is read only at the next rendezvous
    assert formation.next_attempt(max_restarts=3, remaining_restarts=2) == 1
    assert formation.formed_as(_handler(None), predicted=1) is False
    assert formation.attempt == 1


def test_with_rounds_the_attempt_is_the_round_the_same_on_every_node() -> None:
    """Another node decided a restart: this node's group re-formed at round 3 while it
    predicted 1 (its own restarts unused): the attempt is 3, and the skip is told."""
    formation = Formation()
    assert formation.formed_as(_handler(0), predicted=0) is False
    assert formation.rounds and formation.next_attempt(
        max_restarts=3, remaining_restarts=3) == 1
    assert formation.formed_as(_handler(1), predicted=1) is False
    assert formation.formed_as(_handler(3), predicted=2) is True
    assert formation.attempt == 3
    assert formation.next_attempt(max_restarts=3, remaining_restarts=3) == 4


def test_the_first_formation_is_never_a_skip() -> None:
    """A node that joins a running job forms first at its round: nothing went by for it."""
    formation = Formation()
    assert formation.formed_as(_handler(5), predicted=0) is False
    assert formation.attempt == 5


def test_plugins_get_the_long_lived_store_under_the_handlers_prefix_stores() -> None:
    tcp = SimpleNamespace(host="node-a", port=29400)
    prefixed = SimpleNamespace(underlying_store=SimpleNamespace(underlying_store=tcp))
    assert find_tcp_store(prefixed) is tcp and find_tcp_store(None) is None
    handler = SimpleNamespace(_store=prefixed, get_run_id=lambda: "job-7",
                              get_backend=lambda: "c10d")
    workers = [SimpleNamespace(global_rank=r, world_size=4) for r in (2, 3)]
    group = SimpleNamespace(
        spec=SimpleNamespace(rdzv_handler=handler, local_world_size=2), store=None,
        group_rank=1, group_world_size=2, workers=workers, master_addr="node-a",
        master_port=29500)
    bus = Bus()
    info = rendezvous_info(group, attempt=2, bus=bus)
    assert (info.store_host, info.store_port, info.run_id) == ("node-a", 29400, "job-7")
    assert (info.group_rank, info.group_world_size, info.restart_count) == (1, 2, 2)
    assert info.global_ranks == (2, 3) and info.world_size == 4 and info.bus is bus
    assert (info.master_addr, info.master_port) == ("node-a", 29500)


def test_a_rendezvous_without_a_tcp_store_says_which_backends_work() -> None:
    handler = SimpleNamespace(_store=None, get_run_id=lambda: "j", get_backend=lambda: "etcd")
    group = SimpleNamespace(spec=SimpleNamespace(rdzv_handler=handler, local_world_size=1),
                            store=None, group_rank=0, group_world_size=1, workers=[],
                            master_addr=None, master_port=None)
    with pytest.raises(RuntimeError, match=r"etcd rendezvous has no TCPStore.*c10d or static"):
        rendezvous_info(group, attempt=0, bus=Bus())
