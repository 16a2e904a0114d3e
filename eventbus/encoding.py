"""Strict, bounded, one-line JSON for events.

Events are encoded only when a subscriber asks (the JSONL recorder, the store forwarder,
the trace exporter), never on the ``record()`` path.

What the encoder promises:

* Strict JSON: no ``NaN``/``Infinity`` literals. Non-finite floats are written as
  ``{"$float": "NaN"}`` (or ``"Infinity"``/``"-Infinity"``) and decoded back to floats.
* One line: control characters, U+0085, U+2028 and U+2029 are escaped.
* Anything goes in ``data``: a 0-d tensor (torch or numpy) becomes its number, a larger one
  a bounded summary, bytes/sets/tuples/unknown objects a summary or list. A value whose
  ``__repr__`` raises is still encoded.
* Bounded: see :data:`LIMITS`. What is cut says so (``"...[truncated N chars]"``,
  ``{"$truncated": ...}``), so a reader never mistakes a cut value for a whole one.

What the decoder promises: only JSON (never pickle), a size cap, no ``RecursionError``,
``ValueError``/``TypeError`` for anything malformed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any
from typing import Final

__all__ = ["LIMITS", "Limits", "bounded_line", "decode_json", "dumps_line", "event_line",
           "reject_constant", "sanitize"]


class Limits:
    """Documented payload limits (per event)."""

    __slots__ = ()
    #: characters kept of one string value
    max_string: Final = 16_384
    #: keys kept of one mapping, items kept of one list
    max_items: Final = 1_000
    #: nesting depth kept; deeper values are summarised
    max_depth: Final = 32
    #: digits of an int kept as a number; longer ints become a string summary
    max_int_digits: Final = 1_000
    #: bytes of one encoded event; a larger ``data`` is replaced by a summary
    max_line_bytes: Final = 1_048_576
    #: values shown in a tensor summary
    tensor_head: Final = 8
    #: characters accepted by the decoder for one event
    max_decode_chars: Final = 4 * 1_048_576


LIMITS: Final = Limits()

_LINE_BREAKS = ("\u0085", "\\u0085"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029")


def dumps_line(obj: Any) -> str:
    """``obj`` (already sanitized, or plain JSON types) as one line of strict JSON."""
    text = json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            # A lone surrogate (os.fsdecode of a bad file name, a decoded "\\ud800") has no
            # UTF-8 form, so no file or store could take the line: escape all non-ASCII.
            return json.dumps(obj, ensure_ascii=True, allow_nan=False, separators=(",", ":"))
        for raw, escaped in _LINE_BREAKS:
            if raw in text:
                text = text.replace(raw, escaped)
    return text


def _float_tag(value: float) -> dict[str, str]:
    if math.isnan(value):
        return {"$float": "NaN"}
    return {"$float": "Infinity" if value > 0 else "-Infinity"}


class _Budget:
    __slots__ = ("left",)

    def __init__(self, left: int) -> None:
        self.left = left


def _safe_repr(value: object) -> str:
    try:
        text = repr(value)
    except Exception:
        return f"<{type(value).__qualname__} with a failing __repr__>"
    if not isinstance(text, str):
        return f"<{type(value).__qualname__}>"
    return text


def _cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"...[truncated {len(text) - limit} chars]"


def _tensor_summary(value: Any, kind: str) -> Any:
    try:
        if kind == "torch":
            if value.dim() == 0:
                return sanitize(value.item())
            flat = value.detach().reshape(-1)[: LIMITS.tensor_head].tolist()
            shape = list(value.shape)
            dtype = str(value.dtype).replace("torch.", "")
            numel = int(value.numel())
        else:  # numpy
            if value.ndim == 0:
                return sanitize(value.item())
            flat = value.reshape(-1)[: LIMITS.tensor_head].tolist()
            shape = list(value.shape)
            dtype = str(value.dtype)
            numel = int(value.size)
    except Exception:
        return {"$repr": _cut(_safe_repr(value), 200)}
    return {
        "$tensor": {
            "shape": shape,
            "dtype": dtype,
            "numel": numel,
            "head": [sanitize(v) for v in flat],
        }
    }


def _array_kind(value: object) -> str | None:
    module = type(value).__module__
    if module.startswith("torch") and hasattr(value, "dim") and hasattr(value, "item"):
        return "torch"
    if module.startswith("numpy") and hasattr(value, "ndim") and hasattr(value, "item"):
        return "numpy"
    return None


def sanitize(value: Any, *, _depth: int = 0, _budget: _Budget | None = None) -> Any:
    """A JSON-able copy of ``value`` within :data:`LIMITS` (see the module docstring)."""
    budget = _budget if _budget is not None else _Budget(LIMITS.max_line_bytes)
    if budget.left <= 0:
        return {"$truncated": "event size limit reached"}
    if value is None or value is True or value is False:
        return value
    cls = type(value)
    if cls is str or isinstance(value, str):
        text = _cut(str(value), LIMITS.max_string)
        budget.left -= len(text) + 2
        return text
    if cls is int or (isinstance(value, int) and not isinstance(value, bool)):
        n = int(value)
        # int -> str refuses (ValueError) past sys.get_int_max_str_digits(); check first.
        if n.bit_length() > LIMITS.max_int_digits * 3.33:
            return {"$int": f"<int of about {int(n.bit_length() * 0.30103)} digits>"}
        budget.left -= 8
        return n
    if cls is float or isinstance(value, float):
        f = float(value)
        budget.left -= 8
        return f if math.isfinite(f) else _float_tag(f)
    if _depth >= LIMITS.max_depth:
        budget.left -= 40
        return {"$truncated": f"nesting deeper than {LIMITS.max_depth}"}
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        try:
            items = list(value.items())
        except Exception:
            return {"$repr": _cut(_safe_repr(value), 200)}
        for i, (k, v) in enumerate(items):
            if i >= LIMITS.max_items:
                out["$truncated"] = f"{len(items) - i} more keys"
                break
            if budget.left <= 0:
                out["$truncated"] = f"{len(items) - i} more keys (event size limit)"
                break
            key = k if type(k) is str else _safe_repr(k)
            key = _cut(key, 256)
            budget.left -= len(key) + 3
            out[key] = sanitize(v, _depth=_depth + 1, _budget=budget)
        return out
    kind = _array_kind(value)
    if kind is not None:
        return _tensor_summary(value, kind)
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        budget.left -= 64
        return {"$bytes": len(raw), "head": raw[:32].hex()}
    if isinstance(value, (list, tuple, set, frozenset)):
        seq = list(value)
        result: list[Any] = []
        for i, v in enumerate(seq):
            if i >= LIMITS.max_items or budget.left <= 0:
                result.append({"$truncated": f"{len(seq) - i} more items"})
                break
            result.append(sanitize(v, _depth=_depth + 1, _budget=budget))
        return result
    if hasattr(value, "__float__"):
        try:
            return sanitize(float(value), _depth=_depth, _budget=budget)
        except Exception:
            pass
    text = _cut(_safe_repr(value), 1_024)
    budget.left -= len(text) + 12
    return {"$repr": text}


def bounded_line(event: Mapping[str, Any]) -> str:
    """An event's dict (as ``Event.to_dict()`` makes it) as one strict-JSON line of at most
    ``LIMITS.max_line_bytes`` bytes that ``Event.from_json`` reads back.

    The envelope (type, timestamp, typed fields, context) is sanitized field by field and
    always kept whole, so the event stays decodable and attributable; only ``data`` is cut
    to the room the envelope leaves. The character budget of :func:`sanitize` underestimates
    multi-byte and escaped text, so the room shrinks until the line fits; past three tries
    ``data`` becomes a ``{"$truncated": ...}`` summary.
    """
    cap = LIMITS.max_line_bytes
    safe = {key: None if key == "data" else sanitize(value) for key, value in event.items()}
    room = cap - len(dumps_line(safe).encode("utf-8")) - 64
    data = event.get("data")
    for _ in range(3):
        if room <= 0:
            break
        safe["data"] = sanitize(data, _budget=_Budget(room))
        line = dumps_line(safe)
        size = len(line.encode("utf-8"))
        if size <= cap:
            return line
        room = int(room * (cap / size) * 0.9)
    safe["data"] = {"$truncated": "data over the event size limit"}
    return dumps_line(safe)


#: Nodes the pre-scan of :func:`event_line` visits before it hands the event to the bounded
#: encoder anyway: a small event is checked whole in microseconds, a huge one is cut by
#: :func:`sanitize`, whose cost is bounded by the line limit.
_SCAN_NODES: Final = 4_096
_MAX_KEY: Final = 256


def _within_limits(values: Any) -> bool:
    """True when every value in ``values`` is plain JSON that :func:`sanitize` would leave
    unchanged.

    Exact types only (a ``str`` subclass, a tuple or a tensor go the bounded way), so the
    answer never depends on how an interpreter's ``json.dumps`` treats them. Iterative, with
    scalars checked inline: this runs on every ``to_json()``.
    """
    max_string = LIMITS.max_string
    max_items = LIMITS.max_items
    max_depth = LIMITS.max_depth
    max_bits = LIMITS.max_int_digits * 3
    nodes = _SCAN_NODES
    stack: list[tuple[Any, int]] = [(values, -1)]
    while stack:
        container, depth = stack.pop()
        if len(container) > max_items:
            return False
        nodes -= len(container)
        if nodes < 0:
            return False
        if type(container) is dict:
            for key in container:
                if type(key) is not str or len(key) > _MAX_KEY:
                    return False
            items = container.values()
        else:
            items = container
        for item in items:
            cls = type(item)
            if cls is str:
                if len(item) > max_string:
                    return False
            elif cls is float or cls is bool or item is None:
                continue
            elif cls is int:
                if item.bit_length() > max_bits:
                    return False
            elif cls is dict or cls is list:
                if depth + 1 >= max_depth:
                    return False
                stack.append((item, depth + 1))
            else:
                return False
    return True


def event_line(event: Mapping[str, Any]) -> str:
    """An event's dict (as ``Event.to_dict()`` makes it) as one line of strict JSON within
    :data:`LIMITS`, the same on every interpreter.

    The fast path (plain JSON within the limits, found by a pre-scan bounded to
    ``_SCAN_NODES`` nodes) is one ``json.dumps``; anything else (a long string, too many
    items, deep nesting, a tensor, a float that is not finite, a line over
    ``LIMITS.max_line_bytes``) goes through :func:`bounded_line`, which cuts and says so.
    The limits used to be applied only when ``json.dumps`` raised, and Python 3.12's no
    longer raises at depth 2,000, so the promise depended on the interpreter.
    """
    if not _within_limits(list(event.values())):
        return bounded_line(event)
    try:
        line = dumps_line(event)
    except Exception:  # a non-finite float (allow_nan=False), anything else odd
        return bounded_line(event)
    if len(line) <= LIMITS.max_line_bytes // 4 or \
            len(line.encode("utf-8")) <= LIMITS.max_line_bytes:
        return line
    return bounded_line(event)


# -- decoding -----------------------------------------------------------------------------

_FLOATS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _revive(obj: dict[str, Any]) -> Any:
    if len(obj) == 1 and "$float" in obj:
        tag = obj["$float"]
        if type(tag) is str and tag in _FLOATS:
            return _FLOATS[tag]
    return obj


def reject_constant(name: str) -> Any:
    """A ``parse_constant`` for ``json.loads`` that refuses NaN and Infinity literals."""
    raise ValueError(f"non-standard JSON constant {name} (NaN/Infinity are written as tags)")


def decode_json(text: str | bytes | bytearray, *, max_chars: int | None = None) -> Any:
    """Strict JSON -> Python, with non-finite float tags revived.

    Raises ``ValueError`` (``json.JSONDecodeError`` is one) for anything that is not one
    bounded JSON document; never ``RecursionError``.
    """
    limit = LIMITS.max_decode_chars if max_chars is None else max_chars
    if isinstance(text, (bytes, bytearray)):
        if len(text) > limit * 4:
            raise ValueError(f"input of {len(text)} bytes is over the {limit} limit")
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"input is not UTF-8: {exc}") from None
    if not isinstance(text, str):
        raise TypeError(f"expected str or bytes, got {type(text).__name__}")
    if len(text) > limit:
        raise ValueError(f"input of {len(text)} characters is over the {limit} limit")
    try:
        return json.loads(text, object_hook=_revive, parse_constant=reject_constant)
    except RecursionError:
        raise ValueError("input nests too deeply") from None
