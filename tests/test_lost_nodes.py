"""A node lost without a word (eventbus_app/launcher/hosts/lost.py): from torch's
rendezvous state of two rounds and the names the nodes wrote into each round's store.
The real case, a node killed in a SLURM cluster, is tests/test_slurm_e2e.py's."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from eventbus.app.launcher.hosts.lost import KEY
from eventbus.app.launcher.hosts.lost import LostNodes


class Node:
    """torch's _NodeDesc as the state holds it: ``addr_pid_localid``."""

    def __init__(self, addr: str, pid: int = 1) -> None:
        self.text = f"{addr}_{pid}_0"

    def __repr__(self) -> str:
        return self.text


class Store:
    def __init__(self) -> None:
        self.keys: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.keys[key] = value.encode()

    def check(self, keys: list[str]) -> bool:
        return all(k in self.keys for k in keys)

    def get(self, key: str) -> bytes:
        return self.keys[key]


def _handler(this: Node, participants: list[Node], waiting: list[Node] = ()) -> Any:
    state = SimpleNamespace(participants={n: i for i, n in enumerate(participants)},
                            wait_list=set(waiting), redundancy_list=set())
    return SimpleNamespace(_state_holder=SimpleNamespace(state=state), _this_node=this)


def test_a_participant_gone_from_every_list_is_named_by_the_name_it_wrote() -> None:
    a, b, c, d = Node("10.0.0.1"), Node("10.0.0.2"), Node("10.0.0.3"), Node("10.0.0.4")
    first = Store()
    nodes = {"n1": LostNodes("n1"), "n2": LostNodes("n2"), "n3": LostNodes("n3")}
    for agent, node in zip(nodes.values(), (a, b, c), strict=True):
        assert agent.formed(_handler(node, [a, b, c]), first) == []
    assert first.keys[KEY + repr(c)] == b"n3"
    second = Store()
    # n3 gone; a fourth node waits (alive, not lost); n2 said why it left
    assert nodes["n1"].formed(_handler(a, [a], waiting=[d]), second,
                              gone_by_word={"n2"}) == ["n3"]
    third = Store()
    assert nodes["n1"].formed(_handler(a, [a, d]), third) == []  # nothing lost since


def test_a_node_that_wrote_no_name_is_named_by_its_address() -> None:
    a, b = Node("10.0.0.1"), Node("10.0.0.2")
    agent = LostNodes("n1")
    agent.formed(_handler(a, [a, b]), Store())
    assert agent.formed(_handler(a, [a]), Store()) == ["10.0.0.2"]


def test_without_torchs_state_nothing_is_lost() -> None:
    agent = LostNodes("n1")
    assert agent.formed(SimpleNamespace(), Store()) == []
    assert agent.formed(_handler(Node("x"), []), None) == []
