"""The job view's HTTP server: the page, ``/api/state`` and a server-sent-events stream.

The standard library's :class:`http.server.ThreadingHTTPServer`, one daemon thread per
connection, in the process that owns the :class:`~eventbus.app.ui.state.JobState` (the
agent of group rank 0, or ``eventbus view``). Nothing here runs on the bus's threads: the
state is read through its snapshots, so a slow, stuck or absent browser costs the job
nothing (docs/seeing-the-job.md):

* each stream polls the state's ``version`` every ``poll_interval`` seconds on its own
  thread and sends what changed; the bus never waits for, nor wakes, a stream;
* the state's JSON is built at most once per ``poll_interval`` and shared by every
  stream (50 open pages cost one snapshot, not 50), and no more often than
  :data:`STREAM_COST_FACTOR` times its last build's CPU time (a large job's state is
  pushed less often, not at a larger share of a core);
* every socket has a timeout (``io_timeout``): a client that reads nothing fills its
  socket buffer, its write times out and its thread ends; at most ``max_streams``
  streams are open at once (more get 503).

Routes: ``/`` (the page), ``/static/app.js``, ``/static/app.css``, ``/api/state``
(``?recent=N`` events too; ``?ranks=``, ``?state=``, ``?offset=``, ``?limit=`` and
``?detail=`` page and select the ranks: :func:`state_options`), ``/api/events?since=SEQ``,
``/api/stream`` (``text/event-stream``: ``events`` messages with the new events, ``state``
messages with the state, ``end`` when the server closes). With a token, every route
answers 401 unless the request carries it: ``?token=``, the cookie the page gets with it,
``X-Eventbus-Token`` or ``Authorization: Bearer``.
"""

from __future__ import annotations

import hmac
import http.server
import importlib.resources
import ipaddress
import json
import logging
import math
import re
import socket
import threading
import time
import urllib.parse
from typing import Any

from eventbus.app.ui.ranks import RANK_STATES
from eventbus.app.ui.state import JobState

__all__ = ["STATIC_FILES", "UIServer", "dumps", "loopback_name", "parse_ranks",
           "state_options"]

logger = logging.getLogger("eventbus")

#: the page's assets, shipped in the package (eventbus/app/ui/static/): name -> type
STATIC_FILES = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "app.css": "text/css; charset=utf-8",
}

#: the streams' shared state is rebuilt no more often than this many times what its last
#: build cost (at most about 1/20 of a core, whatever the job's size)
STREAM_COST_FACTOR = 20.0

_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def loopback_name(host: str) -> bool:
    """Whether ``host`` (a bind address, or a ``Host`` header's value with or without its
    port and IPv6 brackets) names this machine only: exactly ``localhost``, or an IP
    address in 127.0.0.0/8 or ``::1``. ``127.0.0.1.evil.example`` is not one."""
    name = host.strip()
    if name.startswith("["):
        name = name[1:].partition("]")[0]
    elif name.count(":") == 1:
        name = name.partition(":")[0]
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


_QUERY = re.compile(r"\?[^\s'\"]*")


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def dumps(value: Any) -> bytes:
    """Strict JSON (what a browser's ``JSON.parse`` reads): NaN and infinities become
    null, anything else JSON cannot say becomes its ``repr``."""
    try:
        text = json.dumps(value, default=repr, allow_nan=False, separators=(",", ":"))
    except ValueError:
        text = json.dumps(_finite(value), default=repr, allow_nan=False,
                          separators=(",", ":"))
    return text.encode("utf-8")


def _load_static() -> dict[str, bytes]:
    folder = importlib.resources.files("eventbus.app.ui").joinpath("static")
    return {name: folder.joinpath(name).read_bytes() for name in STATIC_FILES}


class _HTTPServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    ui: UIServer

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that went away mid-answer is no error worth a traceback on the console.
        logger.debug("job view: request from %s failed", client_address, exc_info=True)


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _HTTPServer
    server_version = "eventbus-ui"
    sys_version = ""
    #: seconds any read or write of the connection may block (a stuck client's thread ends)
    timeout = 10.0

    def log_message(self, format: str, *args: Any) -> None:
        # the request line's query may hold ?token=: never in a log
        logger.debug("job view: %s %s", self.address_string(),
                     _QUERY.sub("", format % args))

    # -- helpers ----------------------------------------------------------------------------
    def _send(self, status: int, body: bytes, content_type: str,
              headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self._common_headers()
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def _common_headers(self) -> None:
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        self.send_header("Content-Security-Policy", _CSP)

    def _text(self, status: int, text: str) -> None:
        self._send(status, (text + "\n").encode(), "text/plain; charset=utf-8")

    def _host_allowed(self) -> bool:
        """Without a token the server answers only to its loopback names: a web page
        elsewhere cannot read the job through a name that resolves to 127.0.0.1."""
        ui = self.server.ui
        if ui.token is not None or not ui.loopback:
            return True
        host = self.headers.get("Host")
        if not host:
            return True
        return loopback_name(host)

    def _given_token(self, query: dict[str, list[str]]) -> tuple[str | None, bool]:
        """The token the request carries, and whether it came in the query."""
        if query.get("token"):
            return query["token"][0], True
        header = self.headers.get("X-Eventbus-Token")
        if header:
            return header.strip(), False
        auth = self.headers.get("Authorization") or ""
        if auth.lower().startswith("bearer "):
            return auth[7:].strip(), False
        cookie_name = self.server.ui.cookie_name
        for part in (self.headers.get("Cookie") or "").split(";"):
            key, _, value = part.strip().partition("=")
            if key == cookie_name:
                return value, False
        return None, False

    # -- routes ---------------------------------------------------------------------------
    def do_GET(self) -> None:
        ui = self.server.ui
        url = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(url.query)
        if not self._host_allowed():
            self._text(403, "eventbus job view: this server answers to 127.0.0.1 or "
                            "localhost only (start it with a host and a token to reach it "
                            "by another name)")
            return
        cookie: dict[str, str] = {}
        if ui.token is not None:
            given, in_query = self._given_token(query)
            if given is None or not hmac.compare_digest(given.encode("utf-8", "replace"),
                                                        ui.token.encode("utf-8")):
                self._text(401, "eventbus job view: a token is required: open the address "
                                "eventbus printed (it ends in ?token=...), or send the "
                                "X-Eventbus-Token header")
                return
            if in_query:
                cookie["Set-Cookie"] = (f"{ui.cookie_name}={ui.token}; Path=/; HttpOnly; "
                                        "SameSite=Strict")
        path = url.path
        if path in ("/", "/index.html"):
            self._send(200, ui.static["index.html"], STATIC_FILES["index.html"], cookie)
        elif path.startswith("/static/") and path[8:] in ui.static:
            name = path[8:]
            self._send(200, ui.static[name], STATIC_FILES[name], cookie)
        elif path == "/api/state":
            if set(query) <= {"token"}:
                # the state the streams share: a poller costs no snapshot of its own
                self._send(200, ui.current_snapshot(), "application/json", cookie)
                return
            try:
                options = state_options(query)
            except ValueError as exc:
                self._text(400, f"eventbus job view: {exc}")
                return
            recent = _int_arg(query, "recent", 0, 0, ui.state.max_events)
            self._send(200, dumps(ui.state.snapshot(recent=recent, **options)),
                       "application/json", cookie)
        elif path == "/api/events":
            since = _int_arg(query, "since", 0, 0, 1 << 62)
            limit = _int_arg(query, "limit", 500, 1, ui.state.max_events)
            events, gap, newest = ui.state.events_since(since, limit)
            self._send(200, dumps({"events": events, "gap": gap, "newest": newest}),
                       "application/json", cookie)
        elif path == "/api/stream":
            self._stream(query)
        elif path == "/favicon.ico":
            self.send_response(204)
            self._common_headers()
            self.end_headers()
        else:
            self._text(404, f"eventbus job view: no such page {path!r}; the page is at /, "
                            "the state at /api/state")

    def _stream(self, query: dict[str, list[str]]) -> None:
        ui = self.server.ui
        if not ui._enter_stream():
            self._text(503, f"eventbus job view: {ui.max_streams} streams are open already")
            return
        try:
            last_id = self.headers.get("Last-Event-ID")
            since = _int_arg({"since": [last_id]} if last_id else query, "since", 0, 0,
                             1 << 62)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream; charset=utf-8")
            self._common_headers()
            self.send_header("X-Accel-Buffering", "no")
            self.end_headers()
            self.wfile.write(b"retry: 2000\n\n")
            self._stream_loop(ui, since)
        except OSError:
            pass  # the client went away, or stopped reading (the write timed out)
        finally:
            ui._leave_stream()

    def _stream_loop(self, ui: UIServer, since: int) -> None:
        state = ui.state
        sent_version = -1  # the version of the state last sent
        sent_at = 0.0
        closing = False
        while True:
            closing = ui._closing.is_set()
            version = state.version
            now = time.monotonic()
            keepalive = now - sent_at >= ui.keepalive_s
            if version != sent_version or closing or keepalive:
                chunks = []
                events, gap, newest = state.events_since(since, ui.batch_events)
                if events or gap:
                    chunks.append(b"id: %d\nevent: events\ndata: %s\n\n" % (
                        newest, dumps({"events": events, "gap": gap})))
                    since = newest
                snapshot, shown = ui.snapshot_bytes(force=closing)
                # the shared state is rebuilt at its own pace (snapshot_bytes): a state
                # this stream has sent already is not sent again, but as the keepalive
                if shown != sent_version or closing or keepalive:
                    chunks.append(b"event: state\ndata: " + snapshot + b"\n\n")
                    sent_version, sent_at = shown, now
                if closing:
                    chunks.append(b"event: end\ndata: {}\n\n")
                if chunks:
                    self.wfile.write(b"".join(chunks))
                    ui._count_push()
            if closing:
                return
            ui._closing.wait(ui.poll_interval)


#: ranges one ``?ranks=`` may name at most
MAX_RANK_RANGES = 1024
_RANGE = re.compile(r"\s*([0-9]{1,18})\s*(?:-\s*([0-9]{1,18})\s*)?")


def parse_ranks(text: str) -> list[tuple[int, int]] | None:
    """``?ranks=``'s value: ``all`` (None), or ranks and inclusive ranges separated by
    commas (``0-255,4242``) as ``(first, last)`` pairs. ValueError naming what is wrong."""
    if text.strip().lower() == "all":
        return None
    items = [item for item in text.split(",") if item.strip()]
    if not items:
        raise ValueError("?ranks= is empty: give ranks and ranges, e.g. ?ranks=0-255,4242")
    if len(items) > MAX_RANK_RANGES:
        raise ValueError(f"?ranks= names {len(items)} ranks or ranges; at most "
                         f"{MAX_RANK_RANGES} (give ranges: 0-1023)")
    out = []
    for item in items:
        match = _RANGE.fullmatch(item)
        if match is None:
            raise ValueError(f"?ranks={text[:80]!r}: {item.strip()[:40]!r} is not a rank nor "
                             "a range; give e.g. ?ranks=0-255,4242")
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else first
        if last < first:
            raise ValueError(f"?ranks=: the range {first}-{last} ends before it starts")
        out.append((first, last))
    return out


def state_options(query: dict[str, list[str]]) -> dict[str, Any]:
    """``/api/state``'s paging parameters as :meth:`JobState.snapshot`'s keywords:
    ``ranks`` (:func:`parse_ranks`), ``state`` (names separated by commas), ``offset``,
    ``limit`` and ``detail`` (docs/seeing-the-job.md). ValueError naming what is wrong."""
    options: dict[str, Any] = {}
    if query.get("ranks"):
        ranks = parse_ranks(query["ranks"][0])
        if ranks is None:  # ?ranks=all: every rank, each in full unless ?detail= says
            options["detail"] = "full"
        else:
            options["ranks"] = ranks
    if query.get("state"):
        names = [name.strip() for name in query["state"][0].split(",") if name.strip()]
        unknown = [name for name in names if name not in RANK_STATES]
        if unknown or not names:
            raise ValueError(f"?state={query['state'][0][:80]!r}: a rank's state is one of "
                             f"{', '.join(RANK_STATES)} (several separated by commas)")
        options["states"] = names
    for name in ("offset", "limit"):
        if query.get(name):
            value = query[name][0].strip()
            if not re.fullmatch(r"[0-9]{1,18}", value):
                raise ValueError(f"?{name}={value[:40]!r}: give a whole number >= 0")
            options[name] = int(value)
    if query.get("detail"):
        detail = query["detail"][0].strip()
        if detail not in ("full", "compact"):
            raise ValueError(f"?detail={detail[:40]!r}: give full or compact")
        options["detail"] = detail
    return options


def _int_arg(query: dict[str, list[str]], name: str, default: int, low: int,
             high: int) -> int:
    values = query.get(name)
    if not values:
        return default
    try:
        return max(low, min(high, int(values[0])))
    except ValueError:
        return default


class UIServer:
    """Serves ``state`` at ``http://host:port/``. The socket is bound here (``OSError``
    when the address cannot be used); :meth:`start` serves on a daemon thread,
    :meth:`close` ends it."""

    def __init__(self, state: JobState, host: str = "127.0.0.1", port: int = 0, *,
                 token: str | None = None, loopback: bool = True,
                 poll_interval: float = 0.25, io_timeout: float = 10.0,
                 max_streams: int = 128, keepalive_s: float = 5.0,
                 batch_events: int = 500) -> None:
        if token is None and not loopback_name(host):
            raise ValueError(f"job view host {host!r}: a host other than loopback (127.0.0.1, "
                             "::1, localhost) requires a token; pass token= (--ui-token)")
        self.state = state
        self.token = token
        self.loopback = loopback
        self.poll_interval = poll_interval
        self.io_timeout = io_timeout
        self.max_streams = max_streams
        self.keepalive_s = keepalive_s
        self.batch_events = batch_events
        self.static = _load_static()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        server_class = type("_Server", (_HTTPServer,), {"address_family": family})
        handler = type("_Handler", (_Handler,), {"timeout": io_timeout})
        self._httpd: _HTTPServer = server_class((host, port), handler)
        self._httpd.ui = self
        self.host = host
        self.port = int(self._httpd.server_address[1])
        self.cookie_name = f"eventbus_ui_{self.port}"
        self._closing = threading.Event()
        self._streams = 0
        self._streams_lock = threading.Lock()
        self._idle = threading.Condition(self._streams_lock)
        self._snap_lock = threading.Lock()
        self._snap: bytes | None = None
        self._snap_version = -1
        self._snap_at = 0.0
        #: CPU seconds the last build of the shared state took (see snapshot_bytes)
        self._snap_cost = 0.0
        #: pushes sent to streams, all together (for tests and the curious)
        self.pushes = 0
        self._thread: threading.Thread | None = None

    @property
    def streams(self) -> int:
        """Streams open now."""
        return self._streams

    def url(self, host: str | None = None) -> str:
        """The page's address (with ``?token=`` when there is one)."""
        name = host or self.host
        if ":" in name and not name.startswith("["):
            name = f"[{name}]"
        query = f"?token={urllib.parse.quote(self.token)}" if self.token else ""
        return f"http://{name}:{self.port}/{query}"

    def start(self) -> UIServer:
        """Serve on a daemon thread, and start the state's folder thread; returns self."""
        self.state.start()
        self._thread = threading.Thread(target=self._httpd.serve_forever,
                                        kwargs={"poll_interval": 0.2}, daemon=True,
                                        name=f"eventbus-ui:{self.port}")
        self._thread.start()
        return self

    def snapshot_bytes(self, *, force: bool = False) -> tuple[bytes, int]:
        """The state as JSON and the state version it shows: built at most once per
        ``poll_interval`` whatever the number of streams, and no more often than
        :data:`STREAM_COST_FACTOR` times what the last build cost in CPU time (a large
        job's state: 8,192 ranks take some 30 ms, so its streams get it about every
        0.6 s); ``force``: now, if it changed."""
        if force:
            self.state.fold()
        with self._snap_lock:
            now = time.monotonic()
            version = self.state.version
            age = now - self._snap_at
            changed = version != self._snap_version
            every = max(self.poll_interval, STREAM_COST_FACTOR * self._snap_cost)
            snap = self._snap
            if (snap is None or (changed and (force or age >= every))
                    or age >= self.keepalive_s):
                snap = self._build(version)
            return snap, self._snap_version

    def _build(self, version: int) -> bytes:
        # under _snap_lock: the shared state's JSON, and what it cost this thread
        began = time.thread_time()
        self._snap = snap = dumps(self.state.snapshot())
        self._snap_cost = time.thread_time() - began
        self._snap_version, self._snap_at = version, time.monotonic()
        return snap

    def current_snapshot(self) -> bytes:
        """The state as JSON, counting every event published before the call, from the
        shared snapshot: built anew only when the state changed since, and then at most
        once per ``poll_interval`` (a caller arriving sooner waits for that turn)."""
        self.state.fold()
        wanted = self.state.version
        with self._snap_lock:
            if (self._snap is not None and self._snap_version >= wanted
                    and time.monotonic() - self._snap_at < self.keepalive_s):
                return self._snap
            wait = self._snap_at + self.poll_interval - time.monotonic()
            if wait > 0:
                time.sleep(wait)  # the lock held: the callers behind get this one's build
            return self._build(self.state.version)

    def _enter_stream(self) -> bool:
        with self._streams_lock:
            if self._streams >= self.max_streams or self._closing.is_set():
                return False
            self._streams += 1
            return True

    def _leave_stream(self) -> None:
        with self._streams_lock:
            self._streams -= 1
            self._idle.notify_all()

    def _count_push(self) -> None:
        with self._streams_lock:
            self.pushes += 1

    def close(self, timeout: float = 1.0) -> None:
        """Send every open stream the final state (within ``timeout``), then stop
        serving. Idempotent."""
        if self._closing.is_set():
            return
        self.state.fold()  # the last events (AGENT_EXIT) are in the final state
        self._closing.set()
        deadline = time.monotonic() + timeout
        with self._streams_lock:
            while self._streams > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._idle.wait(left)
        if self._thread is not None:
            self._httpd.shutdown()
        self._httpd.server_close()
        self.state.stop(timeout)
