"""How the job view shows an event: the latest problem's panel and a row of the recent-events
list, as the page's JSON (built on the reader's thread, from what :class:`JobState` keeps),
and the rows already built (:class:`RenderedEvents`).

The folding of events into the model is :mod:`eventbus.app.ui.state`; this module only
renders. Its sentences are :func:`eventbus.app.sentences.sentence`'s.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from eventbus.app.sentences import as_int as _int
from eventbus.app.sentences import as_number as _num
from eventbus.app.sentences import job_outcome
from eventbus.app.sentences import sentence
from eventbus.app.ui.record_event import as_str

__all__ = ["LINE_CHARS", "MAX_TEXT", "RenderedEvents", "clip", "event_json", "problem_json"]

#: characters of a message or a stack shown in the latest-problem panel
MAX_TEXT = 64 * 1024
#: characters of one event's line in the recent-events list
LINE_CHARS = 300


def clip(text: str | None, limit: int) -> str | None:
    if text is None or len(text) <= limit:
        return text
    return text[:limit] + f"\n... ({len(text) - limit} more characters)"


def _stack_text(value: object) -> str | None:
    """A stack as text: a string as it is; a mapping (thread or rank -> text) or a list
    joined with headings."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return "\n".join(f"--- {key} ---\n{_stack_text(text) or ''}"
                         for key, text in value.items())
    if isinstance(value, list):
        return "\n".join(_stack_text(v) or "" for v in value)
    return json.dumps(value, default=repr)


def problem_json(seq: int, kind: str, ev: Any) -> dict[str, Any]:
    """The latest failure or stall as the panel shows it (built on the reader's thread)."""
    data = ev.data if isinstance(ev.data, dict) else {}
    diagnosis = as_str(data.get("diagnosis"))
    if diagnosis is None:
        try:
            diagnosis = sentence(ev)
        except Exception:  # a record this version cannot say must not break the page
            diagnosis = None
    stack = _stack_text(data.get("stack") or data.get("traceback"))
    peers = data.get("peer_stacks")
    message = as_str(getattr(ev, "message", None))
    return {
        "seq": seq,
        "kind": kind,
        "type": "WORKER_STALLED" if kind == "stall" else "WORKER_EXIT",
        "rank": _int(getattr(ev, "worker_id", None)),
        "attempt": ev.restart_count,
        "t": ev.timestamp,
        "host": ev.hostname or None,
        "diagnosis": diagnosis,
        "exit_code": _int(getattr(ev, "exit_code", None)),
        "signal": as_str(getattr(ev, "signal", None)),
        "silent_s": _num(getattr(ev, "silent_s", None)),
        "message": clip(message, MAX_TEXT),
        "stack": clip(stack, MAX_TEXT),
        "peer_stacks": ({str(k): clip(_stack_text(v), MAX_TEXT // 4) for k, v in
                         list(peers.items())[:16]} if isinstance(peers, dict) else None),
        "culprit_ranks": data.get("culprit_ranks") if isinstance(
            data.get("culprit_ranks"), list) else None,
        "waiting_ranks": data.get("waiting_ranks") if isinstance(
            data.get("waiting_ranks"), list) else None,
        "collective": data.get("collective") if isinstance(
            data.get("collective"), dict) else None,
    }


#: data keys shown as a line count in the events list, not in full
_BULKY = ("stack", "peer_stacks", "traceback")


def event_json(seq: int, name: str, ev: Any) -> dict[str, Any]:
    """One event as a row of the recent-events list."""
    fields = ev.fields() if callable(getattr(ev, "fields", None)) else {}
    data = ev.data if isinstance(ev.data, dict) else {}
    parts = [f"{k}={_short(v)}" for k, v in fields.items() if v is not None]
    extra = []
    for key, value in data.items():
        if key in _BULKY and value:
            lines = (_stack_text(value) or "").count("\n") + 1
            extra.append(f"{key}=<{lines} lines>")
        else:
            extra.append(f"{key}={_short(value)}")
    text = " ".join(parts) + (" | " + " ".join(extra) if extra else "")
    if len(text) > LINE_CHARS:
        text = text[:LINE_CHARS] + "..."
    worker = _int(fields.get("worker_id"))
    rank = worker if worker is not None else ev.rank
    level = "info"
    if name == "WORKER_EXIT":
        if fields.get("exit_code") not in (0, None):
            # the agent stopped it, or a drain did: a warning, not a failure of its own
            level = "warn" if data.get("stopped_by_agent") is True or data.get(
                "drained") is True else "failure"
    elif name == "WORKER_STALLED" and data.get("waiting_on") == "data":
        level = "warn"  # a rank waiting for data: reported, not a verdict
    elif name in ("WORKER_STALLED", "EVENTS_LOST"):
        level = "failure"
    elif name in ("WORKER_SLOW", "WORKER_RESTART", "PREEMPTING"):
        level = "warn"
    elif name == "AGENT_EXIT" and job_outcome(ev) == "preempted":
        level = "warn"  # drained: neither a failure nor a success
    elif (name == "RENDEZVOUS" and fields.get("state") == "FAILED") or (
            name == "AGENT_EXIT" and fields.get("state") not in ("SUCCEEDED", None)):
        level = "failure"
    return {"seq": seq, "t": ev.timestamp, "type": name, "rank": rank,
            "who": "agent" if ev.rank is None else f"rank {ev.rank}",
            "host": ev.hostname or None, "attempt": ev.restart_count, "level": level,
            "text": text.replace("\n", "\\n")}


def _short(value: object) -> str:
    if isinstance(value, str):
        first = value if len(value) <= 120 else value[:117] + "..."
        return repr(first)
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (dict, list)):
        text = json.dumps(value, default=repr, separators=(",", ":"))
        return text if len(text) <= 160 else text[:157] + "..."
    return str(value)


class RenderedEvents:
    """The rows of the recent-events list built so far, by seq: each event is rendered
    once however many readers ask (any thread), and the rows of the events no longer kept
    (more than ``max_events`` behind the newest) are forgotten."""

    def __init__(self, max_events: int) -> None:
        self.max_events = max_events
        self._rows: dict[int, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def rows(self, items: list[tuple[int, float, str, Any]],
             newest: int) -> list[dict[str, Any]]:
        """The rows of ``items`` (the state's ``(seq, arrived, type name, event)``);
        ``newest``: the newest seq the state has."""
        out = []
        with self._lock:
            cache = self._rows
            for seq, _, name, ev in items:
                found = cache.get(seq)
                if found is None:
                    found = cache[seq] = event_json(seq, name, ev)
                out.append(found)
            if len(cache) > 2 * self.max_events:
                oldest = newest - self.max_events
                for key in [k for k in cache if k <= oldest]:
                    del cache[key]
        return out
