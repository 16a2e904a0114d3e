"""The exit barrier's check-in of a failed node (launcher/group/exit_barrier.py), against
torch's own barrier on a real TCPStore; the two-agent job is in
tests/reliability/test_exit_barrier_jobs.py."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest

dist = pytest.importorskip("torch.distributed")
store_util = pytest.importorskip("torch.distributed.elastic.utils.store")

from eventbus.app.launcher.group.exit_barrier import TERMINAL_STATE_PREFIX  # noqa: E402
from eventbus.app.launcher.group.exit_barrier import check_in_failed  # noqa: E402


def _store() -> Any:
    return dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10),
                         wait_for_workers=False)


def _client(server: Any) -> Any:
    """An agent's own connection to the store (one client each, as on separate nodes)."""
    return dist.TCPStore("127.0.0.1", server.port, 1, False,
                         timeout=timedelta(seconds=10))


def test_torch_agents_waiting_in_the_barrier_go_on_when_the_failed_node_checks_in() -> None:
    """Two agents SUCCEEDED wait in torch's barrier of 3 (as ``_exit_barrier`` does); the
    third, FAILED, checks in on its way out: both barriers return, well inside their 10 s."""
    server = _store()
    done: list[float] = []

    def round_store() -> Any:
        return dist.PrefixStore("torch.rendezvous.job.3", _client(server))

    def wait() -> None:
        store_util.barrier(store=round_store(), world_size=3, key_prefix=TERMINAL_STATE_PREFIX,
                           barrier_timeout=10)
        done.append(time.monotonic())

    waiters = [threading.Thread(target=wait) for _ in range(2)]
    for t in waiters:
        t.start()
    time.sleep(0.2)
    assert not done  # still waiting for the third agent
    checked_in = time.monotonic()
    prefix = round_store()
    assert check_in_failed(prefix, 3)
    for t in waiters:
        t.join(timeout=10)
    assert len(done) == 2 and all(at >= checked_in for at in done)
    assert prefix.timeout == timedelta(seconds=10)  # the store's timeout is given back


def test_the_failed_node_never_waits_in_the_barrier_itself() -> None:
    """Alone in a round of 2 whose other agent is gone, the check-in returns at once."""
    store = _store()
    started = time.monotonic()
    assert check_in_failed(store, 2)
    assert time.monotonic() - started < 5.0
    assert store.add(TERMINAL_STATE_PREFIX + "/num_members", 0) == 1


def test_a_store_that_is_gone_costs_nothing_but_a_log_line() -> None:
    class Gone:
        timeout = timedelta(seconds=1)

        def set_timeout(self, timeout: timedelta) -> None:
            pass

        def add(self, key: str, value: int) -> int:
            raise RuntimeError("Connection reset by peer")

        def set(self, key: str, value: str) -> None:
            raise AssertionError("not reached")

    assert check_in_failed(Gone(), 2) is False
    assert check_in_failed(None, 2) is False
