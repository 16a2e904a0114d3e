"""The workers' store of each attempt, hosted by the agent (eventbus_app/launcher/
worker_store.py): a real TCPStore server on the attempt's port before the workers start,
torch told (its own variable) that the workers connect to it, and each attempt's server
closed when the next one starts."""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from types import SimpleNamespace

import pytest

from eventbus.app.launcher.recovery.worker_store import SHARE_ENV
from eventbus.app.launcher.recovery.worker_store import WorkerStore


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _group(port: int, rank: int = 0) -> SimpleNamespace:
    return SimpleNamespace(group_rank=rank, master_addr="127.0.0.1", master_port=port)


def _client(port: int) -> object:
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    return TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))


def test_group_rank_0_hosts_each_attempts_store_before_its_workers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On group rank 0 a client connects at once; while the workers start, torch reads
    that the agent holds the store; the next attempt's server replaces the last one."""
    monkeypatch.setenv(SHARE_ENV, "1")
    store = WorkerStore()
    first = _free_port()
    with store.hosting(_group(first)) as hosted:

        assert hosted and os.environ[SHARE_ENV] == "0"
        client = _client(first)
        client.set("k", "v")  # type: ignore[attr-defined]
    assert os.environ[SHARE_ENV] == "1" and store.hosted == ("127.0.0.1", first)
    second = _free_port()
    with store.hosting(_group(second)):
        assert store.hosted == ("127.0.0.1", second)
        assert _client(second).check(["k"]) is False  # type: ignore[attr-defined]
    store.close()
    for port in (first, second):  # both servers are closed: nothing listens there
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))


def test_other_nodes_host_nothing_and_a_taken_port_falls_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Another node's agent hosts nothing (its workers connect to rank 0's); a port taken
    since the rendezvous leaves the workers as torch starts them; with torch's shared
    store (the variable unset or 0), nothing changes."""
    monkeypatch.setenv(SHARE_ENV, "1")
    store = WorkerStore()
    with store.hosting(_group(_free_port(), rank=1)) as hosted:
        assert hosted and store.hosted is None
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with store.hosting(_group(int(taken.getsockname()[1]))) as hosted:

            assert not hosted and os.environ[SHARE_ENV] == "1"
    monkeypatch.setenv(SHARE_ENV, "0")
    with store.hosting(_group(_free_port())) as hosted:
        assert not hosted and store.hosted is None
