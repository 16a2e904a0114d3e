"""The logging bridge's cost per event against a plain ``logging.StreamHandler`` line.

Both write the same format to ``os.devnull``: the plain row is what a user pays today for
``logger.info("WORKER_EXIT worker_id=%s exit_code=%s data=%r", ...)``; the eventbus rows
record the event on a bus whose only subscriber is an :class:`EventLoggingHandler`
(writing itself, or routed through the user's logger with ``set_logger``). The handler's
own cost is the eventbus row less ``record()`` to one no-op subscriber, measured in the
same rounds.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from benchmarks._timing import Case
from benchmarks._timing import measure

__all__ = ["FORMAT", "TARGET", "run"]

FORMAT = "%(asctime)s - %(name)s - %(levelname)s - %(message)s"

#: record() to the logging handler at most this many times a plain StreamHandler line
TARGET = 1.3


def _cases(stream: Any) -> list[Case]:
    import eventbus
    from eventbus import EventType
    from eventbus.subscribers.log_handler import EventLoggingHandler

    data = {"epoch": 10, "loss": 0.01}
    record = "bus.record(EventType.WORKER_EXIT, worker_id=0, exit_code=0, data=d)"

    plain = logging.getLogger("benchmarks.plain")
    plain.propagate = False
    plain.setLevel(logging.INFO)
    plain_handler = logging.StreamHandler(stream)
    plain_handler.setFormatter(logging.Formatter(FORMAT))
    plain.handlers[:] = [plain_handler]

    own = eventbus.Bus("bench-log-own")
    handler = EventLoggingHandler()
    handler.set_format(FORMAT)
    handler.set_stream(stream)
    handler.attach(own)

    routed = eventbus.Bus("bench-log-routed")
    user_logger = logging.getLogger("benchmarks.train")
    user_logger.propagate = False
    user_logger.setLevel(logging.INFO)
    user_handler = logging.StreamHandler(stream)
    user_handler.setFormatter(logging.Formatter(FORMAT))
    user_logger.handlers[:] = [user_handler]
    via_logger = EventLoggingHandler()
    via_logger.set_logger(user_logger)
    via_logger.attach(routed)

    noop = eventbus.Bus("bench-log-noop")
    noop.subscribe(EventType.WORKER_EXIT, on_event=lambda event: None)

    ns = {"d": data, "EventType": EventType, "plain": plain}
    # One untimed line per path first: the first WORKER_EXIT a process records generates the
    # type's code (eventbus/events.py), which would land in whichever case runs first and
    # calibrate its loop to a couple of calls per round (rounds of cold calls, 3-5x slower).
    plain.info("WORKER_EXIT worker_id=%s exit_code=%s data=%r", 0, 0, data)
    for bus in (own, routed, noop):
        bus.record(EventType.WORKER_EXIT, worker_id=0, exit_code=0, data=data)
    return [
        Case("logging.StreamHandler line",
             "plain.info('WORKER_EXIT worker_id=%s exit_code=%s data=%r', 0, 0, d)", ns),
        Case("record() -> EventLoggingHandler", record, {**ns, "bus": own}),
        Case("record() -> EventLoggingHandler -> user logger", record, {**ns, "bus": routed}),
        Case("record() -> 1 no-op subscriber", record, {**ns, "bus": noop}),
    ]


def run(*, quick: bool = False) -> dict[str, Any]:
    """Median ns per event of each way, the handler's own cost, and ratios to the plain line."""
    repeats = 3 if quick else 31
    target_s = 0.0005 if quick else 0.004
    with open(os.devnull, "w", encoding="utf-8") as stream:
        ns = measure(_cases(stream), repeats=repeats, target_s=target_s)
    plain = ns["logging.StreamHandler line"]
    base = ns["record() -> 1 no-op subscriber"]
    rows = {name: {"ns": value, "vs plain line": value / plain} for name, value in ns.items()}
    for name in ("record() -> EventLoggingHandler",
                 "record() -> EventLoggingHandler -> user logger"):
        rows[name]["handler only"] = value = ns[name] - base
        rows[name]["handler only vs plain line"] = value / plain
    ratio = rows["record() -> EventLoggingHandler"]["vs plain line"]
    targets = [{"target": f"a logged event line <= {TARGET:g}x a plain StreamHandler line",
                "ratio": ratio, "limit": TARGET, "met": ratio <= TARGET}]
    return {"rows": rows, "repeats": repeats, "targets": targets}
