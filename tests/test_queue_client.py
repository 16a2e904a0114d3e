"""eventbus.wire.QueueClient, the forwarder's torch-free store client, against a real
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

from eventbus.wire import QueueClient

torch_dist = pytest.importorskip("torch.distributed")


@pytest.fixture
def store() -> Iterator[Any]:
    server = torch_dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                 timeout=datetime.timedelta(seconds=10))
    yield server
    del server


def test_pushes_arrive_in_order_for_torch_s_own_client(store: Any) -> None:
    """Values pushed by the socket client are popped, in order and byte for byte, by
    torch's client, beside values torch's client pushed to the same queue."""
    client = QueueClient("127.0.0.1", store.port, timeout=5.0)
    try:
        client.queue_push("eventbus/q", b"first")
        store.queue_push("eventbus/q", b"second")
        client.queue_push("eventbus/q", "third, with \u00e9")
        big = bytes(range(256)) * 4096  # 1 MiB: more than one send
        client.queue_push("eventbus/q", big)
        deadline = time.monotonic() + 10
        while store.queue_len("eventbus/q") < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
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
    client = QueueClient("127.0.0.1", server.port, timeout=2.0)
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
