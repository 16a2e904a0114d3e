"""The job view in a browser: ``eventbus run --ui [HOST:]PORT`` and ``eventbus view FILE``.

* :mod:`eventbus.app.ui.state`: :class:`JobState`, the bounded model fed by the events;
* :mod:`eventbus.app.ui.server`: :class:`UIServer`, the page, ``/api/state`` and the stream;
* :mod:`eventbus.app.ui.view`: the ``eventbus view`` command;
* here: the address and token rules (:func:`parse_address`, :func:`resolve_token`) and
  :class:`UIPlugin`, the agent plugin of ``eventbus run --ui``.

docs/seeing-the-job.md describes the page; docs/run.md the options.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
import socket
import sys
from collections.abc import Mapping
from collections.abc import Sequence
from typing import IO
from typing import Any
from typing import NamedTuple

from eventbus.app.plugins import RendezvousInfo
from eventbus.app.ui.server import UIServer
from eventbus.app.ui.state import JobState
from eventbus.bus import ALL
from eventbus.bus import Bus

__all__ = [
    "DEFAULT_HOST",
    "TOKEN_ENV",
    "UIAddress",
    "UIPlugin",
    "UIServer",
    "JobState",
    "is_loopback",
    "parse_address",
    "resolve_token",
    "serve",
]

logger = logging.getLogger("eventbus")

#: the host the view binds to unless ``--ui HOST:PORT`` names one
DEFAULT_HOST = "127.0.0.1"
#: the environment variable read for the token when ``--ui-token`` is not given (keeps
#: it out of ``ps`` and the shell's history)
TOKEN_ENV = "EVENTBUS_UI_TOKEN"


class UIAddress(NamedTuple):
    """``(host, port)`` parsed from ``[HOST:]PORT``."""

    host: str
    port: int


def parse_address(text: str, *, option: str = "--ui") -> UIAddress:
    """``PORT``, ``HOST:PORT`` or ``[IPV6]:PORT`` -> ``(host, port)``; the host is
    :data:`DEFAULT_HOST` when not given, port 0 picks a free one. Raises ``ValueError``
    naming the option and the fix."""
    value = text.strip()
    example = (f"expected [HOST:]PORT, e.g. {option} 8265, {option} 0 (a free port) or "
               f"{option} 0.0.0.0:8265 (every interface, with a token)")
    host, port_text = DEFAULT_HOST, value
    if value.startswith("["):
        end = value.find("]")
        if end < 0 or value[end + 1:end + 2] != ":":
            raise ValueError(f"{option} {text!r}: {example}")
        host, port_text = value[1:end], value[end + 2:]
    elif ":" in value:
        host, _, port_text = value.rpartition(":")
        if ":" in host:
            raise ValueError(f"{option} {text!r}: an IPv6 host goes in brackets, e.g. "
                             f"{option} [::1]:8265")
        host = host or DEFAULT_HOST
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"{option} {text!r}: the port {port_text!r} is not a number; "
                         f"{example}") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"{option} {text!r}: the port must be 0-65535 (0: a free one)")
    if not host or any(c.isspace() for c in host):
        raise ValueError(f"{option} {text!r}: {example}")
    return UIAddress(host, port)


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only (``localhost``, 127.0.0.0/8,
    ``::1``). Any other name counts as reachable from elsewhere."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def resolve_token(host: str, given: str | None) -> tuple[str | None, bool]:
    """The token the view requires, and whether it was generated here.

    ``given`` (``--ui-token``) or :data:`TOKEN_ENV` wins; otherwise a loopback host needs
    none and any other host gets a fresh ``secrets.token_urlsafe`` one."""
    token = given if given is not None else os.environ.get(TOKEN_ENV) or None
    if token is not None:
        if not token.strip() or any(c.isspace() or ord(c) < 33 for c in token):
            raise ValueError("--ui-token: the token must be non-empty and hold no spaces or "
                             "control characters")
        return token, False
    if is_loopback(host):
        return None, False
    return secrets.token_urlsafe(18), True


def _shown_host(host: str) -> str:
    """The host an address line names: a wildcard bind is reached by the machine's name."""
    if host in ("0.0.0.0", "::", ""):
        return socket.gethostname()
    return host


def serve(state: JobState, address: UIAddress, token: str | None, *,
          show_token: bool = True, stream: IO[str] | None = None,
          **options: Any) -> UIServer:
    """Bind, start serving ``state`` and print the address once on ``stream`` (stderr):
    with the token when ``show_token`` (a generated one), else saying where it came from
    (the user's own stays out of the job's log)."""
    server = UIServer(state, address.host, address.port, token=token,
                      loopback=is_loopback(address.host), **options).start()
    out = sys.stderr if stream is None else stream
    url = server.url(_shown_host(address.host))
    if token is not None and not show_token:
        url = url.split("?", 1)[0] + " (add ?token= with the token --ui-token or " \
            f"${TOKEN_ENV} gave)"
    print(f"eventbus: job view at {url}", file=out, flush=True)
    return server


def _counters(bus: Bus, plugins: Sequence[Any]) -> Mapping[str, Any]:
    """The live drop counters: every queueing subscriber of ``bus`` (the sinks, the JSONL
    recorder) and the store transport's receivers."""
    sinks = []
    for sub in bus.stats()["subscribers"]:
        raw = sub.get("sink")
        if not raw:
            continue
        dropped = dict(sub.get("dropped") or {})
        if raw.get("failed"):
            dropped["backend raised"] = raw["failed"]
        sinks.append({"name": str(raw.get("name") or sub.get("name")),
                      "pending": int(sub.get("pending") or 0),
                      "handled": raw.get("handled"), "dropped": dropped})
    transport: dict[str, Any] = {}
    for plugin in plugins:
        stats = getattr(plugin, "stats", None)
        if type(plugin).__name__ != "StoreTransport" or not callable(stats):
            continue
        raw = stats()
        for part in ("workers", "nodes"):
            found = raw.get(part)
            if found:
                transport[part] = {"delivered": found.get("delivered"),
                                   "lost": found.get("lost") or {},
                                   "rejected": found.get("rejected") or {}}
        forwarder = raw.get("job_forwarder")
        if forwarder:
            transport["job_forwarder"] = {"dropped": forwarder.get("dropped") or {},
                                          "lost": forwarder.get("lost") or {}}
    return {"sinks": sinks, "transport": transport}


class UIPlugin:
    """``eventbus run --ui``: the job's state subscribed to the agent's ``bus`` from the
    start, served by the agent of group rank 0 after its first rendezvous; other nodes
    unsubscribe and serve nothing. An :class:`eventbus.app.plugins.AgentPlugin`;
    :meth:`close` (after ``AGENT_EXIT``) sends the open pages the final state.

    ``plugins``: the agent's other plugins, read for the transport's counters.
    """

    def __init__(self, bus: Bus, address: UIAddress, token: str | None, *,
                 show_token: bool = True, plugins: Sequence[Any] = (),
                 stream: IO[str] | None = None, **server_options: Any) -> None:
        self.address = address
        self.token = token
        self.show_token = show_token
        self.stream = stream
        self.server_options = server_options
        self.state = JobState(counters=lambda: _counters(bus, self.plugins))
        self.plugins = list(plugins)
        self.server: UIServer | None = None
        self._subscription: Any = bus.subscribe(ALL, on_event=self.state)
        self._decided = False

    def after_rendezvous(self, info: RendezvousInfo) -> Mapping[str, str]:
        if self._decided:
            return {}
        self._decided = True
        if info.group_rank != 0:
            logger.info("the job view is served by the agent of group rank 0; this node "
                        "(group rank %d) serves none", info.group_rank)
            self._unsubscribe()
            self.state.discard_pending()
            return {}
        try:
            self.server = serve(self.state, self.address, self.token,
                                show_token=self.show_token, stream=self.stream,
                                **self.server_options)
        except OSError as exc:
            out = sys.stderr if self.stream is None else self.stream
            print(f"eventbus: --ui {self.address.host}:{self.address.port}: cannot serve the "
                  f"job view ({exc}); the job runs without it", file=out, flush=True)
            self._unsubscribe()
            self.state.discard_pending()
        return {}

    def before_exit(self, *, timeout: float) -> None:
        """Nothing: the page shows ``AGENT_EXIT`` too (see :meth:`close`)."""

    def _unsubscribe(self) -> None:
        if self._subscription is not None:
            self._subscription.cancel()
            self._subscription = None

    def close(self, timeout: float = 1.0) -> None:
        """Unsubscribe; give the open pages the final state within ``timeout``; stop."""
        self._unsubscribe()
        if self.server is not None:
            self.server.close(timeout)
