"""Fabricated events and local HTTP receivers for the sink tests (tests/test_sinks*.py)."""

from __future__ import annotations

import contextlib
import http.server
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

from eventbus.events import Event

RUN_ID = "sinks-test-run"


def make_event(event_type: str, *, rank: int | None = None, restart_count: int = 0,
               timestamp: float | None = None, data: dict[str, Any] | None = None,
               hostname: str = "host", pid: int | None = None, **fields: Any) -> Event:
    """An event as a worker (``rank``) or the agent (``rank=None``) recorded it, on
    ``hostname`` (process ``pid``, default ``100 + rank``)."""
    return Event.from_dict({
        "type": event_type, "timestamp": time.time() if timestamp is None else timestamp,
        **fields, "data": data or {},
        "context": {"rank": rank, "local_rank": rank, "group_rank": 0, "world_size": 2,
                    "local_world_size": 2, "role": "default", "run_id": RUN_ID,
                    "restart_count": restart_count, "hostname": hostname,
                    "pid": 100 + (rank or 0) if pid is None else pid}})


def fabricated_job() -> list[Event]:
    """Two ranks, three steps each; rank 1 fails on attempt 0; attempt 1 succeeds."""
    t = 1_700_000_000.0
    events = [make_event("AGENT_START", timestamp=t, nproc_per_node=2, max_restarts=1)]
    for attempt, steps in ((0, range(0, 3)), (1, range(3, 6))):
        for rank in (0, 1):
            events.append(make_event("WORKER_START", restart_count=attempt, timestamp=t + 1,
                                     worker_id=rank, worker_pid=200 + rank))
        for step in steps:
            for rank in (0, 1):
                events.append(make_event("METRIC", rank=rank, restart_count=attempt, step=step,
                                         timestamp=t + 2 + step,
                                         data={"loss": rank + step / 10, "note": "x"}))
        if attempt == 0:
            events.append(make_event("WORKER_EXIT", restart_count=0, timestamp=t + 6, worker_id=1,
                                     exit_code=3, worker_pid=201, message="boom"))
            events.append(make_event("WORKER_EXIT", restart_count=0, timestamp=t + 6, worker_id=0,
                                     exit_code=-15, signal="SIGTERM", worker_pid=200))
            events.append(make_event("WORKER_RESTART", restart_count=0, timestamp=t + 7, attempt=1,
                                     restarts_left=0, reason="rank 1 exited with 3"))
        else:
            for rank in (0, 1):
                events.append(make_event("WORKER_EXIT", restart_count=1, timestamp=t + 9,
                                         worker_id=rank, exit_code=0, worker_pid=200 + rank))
    events.append(make_event("AGENT_EXIT", restart_count=1, timestamp=t + 10, state="SUCCEEDED",
                             exit_code=0))
    return events


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Receiver:
    """An HTTP server on 127.0.0.1 in a thread: records (path, body) of each POST, after
    waiting ``delay`` seconds per request, answering ``status``."""

    def __init__(self, *, delay: float = 0.0, status: int = 200) -> None:
        self.requests: list[tuple[str, bytes]] = []
        self.delay = delay
        self.status = status
        self.cond = threading.Condition()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if receiver.delay:
                    time.sleep(receiver.delay)
                with receiver.cond:
                    receiver.requests.append((self.path, body))
                    receiver.cond.notify_all()
                self.send_response(receiver.status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        # a short poll: shutdown() waits for the loop's next look at its flag (0.5 s a
        # receiver at the default, paid by every test that uses one)
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,),
                                       daemon=True)

    def wait_for(self, predicate: Any, timeout: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout
        with self.cond:
            while not predicate(self.requests):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(left)
            return True


@contextlib.contextmanager
def receiver(*, delay: float = 0.0, status: int = 200) -> Iterator[Receiver]:
    """A running :class:`Receiver` answering ``status``, shut down on the way out."""
    r = Receiver(delay=delay, status=status)
    r.thread.start()
    try:
        yield r
    finally:
        r.server.shutdown()
        r.server.server_close()
