"""The clients of the job's c10d ``TCPStore`` that the store transport uses: torch's own
(:func:`connect_store`, for blocking waits, the doorbell and the notices) and
:class:`QueueClient`, a client written on the socket module that pushes to and pops from the
store's queues. What travels in those queues is :mod:`eventbus.wire`'s.

Importing this module does not import torch; :func:`connect_store` and
:func:`queue_empty_error` do. A sender needs no torch at all: :class:`QueueClient` speaks the
few messages of the store's protocol that pushing takes (and, for group rank 0's job
receiver, popping), so a worker's events leave before (or without) the script's
``import torch``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any

__all__ = ["QueueClient", "connect_store", "queue_empty_error"]


def connect_store(host: str, port: int, *, timeout: float) -> Any:
    """A new client of the TCPStore at ``host:port`` (raises when it cannot connect in time).

    ``timeout`` bounds the connect and every later operation of the client. Each end opens
    its own client: a blocking call on a client shared with the rendezvous would stall it.
    """
    import datetime

    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    return TCPStore(host, port, is_master=False, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=timeout))


class QueueClient:
    """A client of a c10d ``TCPStore`` that only pushes to and pops from queues, written on
    the socket module: no torch on the sender's side.

    A worker's first ``record()`` must never wait for ``import torch`` (seconds, tens of
    seconds on a loaded machine), and the forwarder's thread must not import torch either:
    an import racing the script's own ``import torch.distributed`` on the main thread can
    deadlock on the two packages' import locks (``torch/__init__`` imports
    ``torch.distributed``), and Python breaks such a cycle by raising in one of the two
    threads. So the sender speaks the store's protocol itself, the few messages of it a
    push takes (c10d's ``TCPStoreBackend.hpp`` and ``TCPStore.cpp`` as torch 2.13 has them,
    whose message types are only ever appended to; checked against a real store by
    tests/test_queue_client.py):

    * on connect, ``VALIDATE`` with the store's magic number, then a ``PING`` whose nonce the
      store echoes: what proves the peer is a c10d store and answers (a server that speaks
      first, hangs up or says nothing fails here, within ``timeout``);
    * ``QUEUE_PUSH``: the key (with the client's ``/`` prefix, as torch's own client adds)
      and the value, each as a native ``uint64`` length and its bytes; the store answers
      nothing, as to torch's client;
    * ``QUEUE_POP`` (:meth:`pop_many`, for a receiver): the key; the store answers the
      queue's length *before* the pop as a native ``int64``, then, when it was not empty,
      the value popped as a ``uint64`` length and its bytes (the libuv store's
      ``queuePop``, the only c10d store with queues). Torch's own client keeps that length
      to itself and raises on an empty queue; here it tells a receiver how many values are
      left, so that emptying a queue never costs a pop that finds it empty;
    * ``QUEUE_LEN`` (:meth:`lengths`): the key; the store answers the length, an ``int64``.

    Every socket operation is bounded by ``timeout``. Not thread-safe: the forwarder calls
    it with its client lock held, a receiver with its own.
    """

    #: c10d's QueryType values (an enum of uint8, new types appended at its end)
    VALIDATE, PING, QUEUE_PUSH, QUEUE_POP, QUEUE_LEN = 0, 13, 14, 15, 16
    #: c10d's validationMagicNumber
    MAGIC = 0x3C85F7CE
    _U32 = struct.Struct("=I")
    _U64 = struct.Struct("=Q")
    _I64 = struct.Struct("=q")
    #: pop requests kept encoded, per key, at most this many (then the cache starts again)
    _MAX_CACHED_REQUESTS = 65_536

    def __init__(self, host: str, port: int, *, timeout: float) -> None:
        self.host, self.port = host, port
        self._sock: socket.socket | None = None
        sock = socket.create_connection((host, port), timeout=timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            nonce = os.getpid() & 0xFFFFFFFF
            sock.sendall(bytes((self.VALIDATE,)) + self._U32.pack(self.MAGIC)
                         + bytes((self.PING,)) + self._U32.pack(nonce))
            answer = b""
            while len(answer) < 4:
                part = sock.recv(4 - len(answer))
                if not part:
                    raise ConnectionError("not a c10d store: it hung up after the handshake")
                answer += part
            if self._U32.unpack(answer)[0] != nonce:
                raise ConnectionError("not a c10d store: it did not echo the ping")
        except TimeoutError:
            sock.close()
            raise TimeoutError(f"the store at {host}:{port} did not answer the handshake "
                               f"within {timeout:g} s") from None
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._reader: Any = None
        #: each key's length and bytes as a request carries them
        self._encoded: dict[str, bytes] = {}

    def queue_push(self, key: str, value: bytes | str) -> None:
        """Append ``value`` to the store's queue ``key`` (raises ``OSError`` when the
        connection is gone or the send does not finish within the timeout)."""
        sock = self._sock
        if sock is None:
            raise ConnectionError("the queue client is closed")
        name = ("/" + key).encode("utf-8")
        data = value.encode("utf-8") if isinstance(value, str) else bytes(value)
        sock.sendall(b"".join((bytes((self.QUEUE_PUSH,)), self._U64.pack(len(name)), name,
                               self._U64.pack(len(data)), data)))

    def pop_many(self, keys: Sequence[str]) -> Iterator[tuple[int, bytes | None]]:
        """Pop the head of each queue of ``keys`` (a key may repeat: one pop each), every
        request sent at once, and yield, in the order of ``keys``, ``(length, value)``:
        the queue's length before that pop and the value popped, or ``(0, None)`` for a
        queue that was empty. One write and a stream of reads, not a round trip per pop.

        Each answer is read as it is consumed, so that values are held one at a time. An
        answer not read (the caller stopped early), a short read, a hang-up or a timeout
        closes the client: its stream is out of step, and the next call raises
        ``ConnectionError``; make a new client.
        """
        sock = self._sock
        if sock is None:
            raise ConnectionError("the queue client is closed")
        return self._answers(sock, self._requests(self.QUEUE_POP, keys), len(keys))

    def lengths(self, keys: Sequence[str]) -> list[int]:
        """The length of each queue of ``keys`` (``QUEUE_LEN``: the store answers a native
        ``int64``), every request sent at once: one write and one stream of 8-byte answers.
        A short read, a hang-up or a timeout closes the client (as :meth:`pop_many`)."""
        sock = self._sock
        if sock is None:
            raise ConnectionError("the queue client is closed")
        done = False
        try:
            sock.sendall(self._requests(self.QUEUE_LEN, keys))
            data = self._read(sock, 8 * len(keys))
            done = True
        finally:
            if not done:
                self.close()
        return [n for (n,) in self._I64.iter_unpack(data)]

    def _requests(self, query: int, keys: Sequence[str]) -> bytes:
        """``query`` (a pop or a length) of each key, encoded once per key and kept."""
        cache = self._encoded
        if len(cache) > self._MAX_CACHED_REQUESTS:
            cache.clear()
        parts = []
        for key in keys:
            name = cache.get(key)
            if name is None:
                raw = ("/" + key).encode("utf-8")
                name = cache[key] = self._U64.pack(len(raw)) + raw
            parts.append(name)
        if not parts:
            return b""
        head = bytes((query,))
        return head + head.join(parts)

    def _read(self, sock: socket.socket, n: int) -> bytes:
        reader = self._reader
        if reader is None:
            reader = self._reader = sock.makefile("rb")
        data: bytes = reader.read(n)
        if len(data) != n:
            raise ConnectionError("the store hung up in the middle of an answer")
        return data

    def _answers(self, sock: socket.socket, requests: bytes,
                 count: int) -> Iterator[tuple[int, bytes | None]]:
        read = 0
        try:
            if count:
                sock.sendall(requests)
            unpack_i64, unpack_u64, take = self._I64.unpack, self._U64.unpack, self._read
            while read < count:
                (length,) = unpack_i64(take(sock, 8))
                if length <= 0:
                    read += 1
                    yield 0, None
                    continue
                (n,) = unpack_u64(take(sock, 8))
                value = take(sock, n)
                read += 1
                yield length, value
        finally:
            if read < count:
                self.close()

    def fileno(self) -> int:
        """The socket's descriptor (-1 once closed)."""
        return -1 if self._sock is None else self._sock.fileno()

    def close(self) -> None:
        sock, self._sock = self._sock, None
        reader, self._reader = getattr(self, "_reader", None), None
        if reader is not None:
            with contextlib.suppress(OSError):
                reader.close()
        if sock is not None:
            sock.close()

    def __del__(self) -> None:
        self.close()


def queue_empty_error() -> type[BaseException]:
    """The exception a non-blocking ``queue_pop`` raises on an empty queue."""
    import torch.distributed as dist

    error: type[BaseException] = getattr(dist, "QueueEmptyError", RuntimeError)
    return error
