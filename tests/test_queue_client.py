"""eventbus.store_client.QueueClient, the forwarder's torch-free store client, against a real
c10d TCPStore (torch's own client reads what it pushed) and against servers that are not
stores (each refused within the timeout, with the reason)."""

from __future__ import annotations

import datetime
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from eventbus.store_client import QueueClient

torch_dist = pytest.importorskip("torch.distributed")


@pytest.fixture
def store() -> Iterator[Any]:
    server = torch_dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                 timeout=datetime.timedelta(seconds=10))
    yield server
    del server


def _wait_for_lengths(store: Any, lengths: dict[str, int]) -> None:
    """Wait until the store has taken every push (torch's client does not wait for it)."""
    deadline = time.monotonic() + 10
    while any(store.queue_len(k) != n for k, n in lengths.items()):
        assert time.monotonic() < deadline, {k: store.queue_len(k) for k in lengths}
        time.sleep(0.01)


def test_pushes_arrive_in_order_for_torch_s_own_client(store: Any) -> None:
    """Values pushed by the socket client are popped, in order and byte for byte, by
    torch's client, beside values torch's client pushed to the same queue."""
    client = QueueClient("127.0.0.1", store.port, timeout=5.0)
    try:
        # two connections: the order between them is the order the store takes each
        # push in, and neither client waits for that; so each waits its turn
        client.queue_push("eventbus/q", b"first")
        _wait_for_lengths(store, {"eventbus/q": 1})
        store.queue_push("eventbus/q", b"second")
        _wait_for_lengths(store, {"eventbus/q": 2})
        client.queue_push("eventbus/q", "third, with \u00e9")
        big = bytes(range(256)) * 4096  # 1 MiB: more than one send
        client.queue_push("eventbus/q", big)
        _wait_for_lengths(store, {"eventbus/q": 4})
        got = [bytes(store.queue_pop("eventbus/q", block=False)) for _ in range(4)]
    finally:
        client.close()
    assert got == [b"first", b"second", "third, with \u00e9".encode(), big]
    assert client.fileno() == -1
    with pytest.raises(ConnectionError, match="closed"):
        client.queue_push("eventbus/q", b"late")


def test_a_closed_store_fails_the_next_pushes() -> None:
    """Once the store is gone, pushes raise OSError (the first may still be taken by the
    kernel, as with torch's client), within the timeout."""
    server = torch_dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                 timeout=datetime.timedelta(seconds=10))
    # the handshake with a live store gets room (a loaded machine); the failure is what
    # the test is about
    client = QueueClient("127.0.0.1", server.port, timeout=10.0)
    del server
    with pytest.raises(OSError):
        for _ in range(50):
            client.queue_push("eventbus/q", b"x" * 1000)
            time.sleep(0.02)
    client.close()


def _serve(behaviour: str) -> tuple[socket.socket, threading.Thread, threading.Event]:
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    stop = threading.Event()
    held: list[socket.socket] = []

    def run() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            if behaviour == "speaks first":
                conn.sendall(b"SSH-2.0-OpenSSH_9.2\r\n")
                held.append(conn)
            elif behaviour == "hangs up":
                conn.close()
            else:  # silent: accepts and says nothing
                held.append(conn)
        for conn in held:
            conn.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return listener, thread, stop


@pytest.mark.parametrize(("behaviour", "error", "match"), [
    ("speaks first", ConnectionError, "did not echo"),
    ("hangs up", OSError, None),
    ("silent", TimeoutError, "did not answer the handshake within 0.5 s"),
])
def test_a_server_that_is_not_a_store_is_refused(behaviour: str, error: type[Exception],
                                                 match: str | None) -> None:
    """The handshake (VALIDATE, then a PING whose nonce a store echoes) refuses a server
    that speaks first, hangs up, or says nothing, within the timeout."""
    listener, thread, stop = _serve(behaviour)
    try:
        started = time.monotonic()
        with pytest.raises(error, match=match):
            QueueClient("127.0.0.1", listener.getsockname()[1], timeout=0.5)
        assert time.monotonic() - started < 5.0  # bounded by the timeout, not c10d's retries
    finally:
        stop.set()
        thread.join(5)
        listener.close()


def test_a_closed_port_is_refused_at_once() -> None:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        port = sock.getsockname()[1]
    with pytest.raises(ConnectionRefusedError):
        QueueClient("127.0.0.1", port, timeout=5.0)


def test_pop_many_answers_in_order_with_each_queue_s_length(store: Any) -> None:
    """One write of pops (a key repeated is popped again) and the answers in order: the
    queue's length before each pop and the value, ``(0, None)`` for an empty queue; values
    torch's client pushed come back byte for byte, a large one across many reads."""
    big = bytes(range(256)) * 4096
    for value in (b"a1", b"a2", big):
        store.queue_push("eventbus/a", value)
    store.queue_push("eventbus/b", "b1 \u00e9")
    _wait_for_lengths(store, {"eventbus/a": 3, "eventbus/b": 1})
    client = QueueClient("127.0.0.1", store.port, timeout=5.0)
    try:
        got = list(client.pop_many(["eventbus/a", "eventbus/empty", "eventbus/b", "eventbus/a",
                                    "eventbus/a", "eventbus/a", "eventbus/b"]))
        assert got == [(3, b"a1"), (0, None), (1, "b1 \u00e9".encode()), (2, b"a2"),
                       (1, big), (0, None), (0, None)]
        assert store.queue_len("eventbus/a") == 0
        # the client stays in step for the next round
        store.queue_push("eventbus/a", b"again")
        assert list(client.pop_many(["eventbus/a"])) == [(1, b"again")]
        assert list(client.pop_many([])) == []
    finally:
        client.close()


def test_pop_many_stopped_early_closes_the_client(store: Any) -> None:
    """Answers left unread would put the stream out of step: the client closes itself and
    the next call says so; what it popped is gone from the store, nothing else is."""
    for i in range(3):
        store.queue_push("eventbus/c", f"c{i}")
    _wait_for_lengths(store, {"eventbus/c": 3})
    client = QueueClient("127.0.0.1", store.port, timeout=5.0)
    answers = client.pop_many(["eventbus/c", "eventbus/c"])
    assert next(answers) == (3, b"c0")
    answers.close()
    assert client.fileno() == -1
    with pytest.raises(ConnectionError, match="closed"):
        client.pop_many(["eventbus/c"])
    deadline = time.monotonic() + 5
    while store.queue_len("eventbus/c") != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.queue_len("eventbus/c") == 1  # both pops were made; the third value stays


def test_pop_many_on_a_store_that_hangs_up_raises_and_closes() -> None:
    """A store gone between two rounds: the next round raises OSError (a hang-up, a reset)
    and the client is closed, out of step no longer."""
    server = torch_dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                 timeout=datetime.timedelta(seconds=10))
    client = QueueClient("127.0.0.1", server.port, timeout=10.0)
    assert list(client.pop_many(["eventbus/d"])) == [(0, None)]
    del server
    with pytest.raises(OSError):
        list(client.pop_many(["eventbus/d"] * 4))
    assert client.fileno() == -1


def test_lengths_answers_every_queue_in_one_write(store: Any) -> None:
    """QUEUE_LEN for many keys at once: each queue's length, 0 for one never pushed to."""
    for i in range(3):
        store.queue_push("eventbus/e", f"e{i}")
    _wait_for_lengths(store, {"eventbus/e": 3})
    client = QueueClient("127.0.0.1", store.port, timeout=5.0)
    try:
        assert client.lengths(["eventbus/e", "eventbus/none", "eventbus/e"]) == [3, 0, 3]
        assert client.lengths([]) == []
        assert list(client.pop_many(["eventbus/e"])) == [(3, b"e0")]
        assert client.lengths(["eventbus/e"]) == [2]
    finally:
        client.close()
