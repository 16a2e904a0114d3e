"""Row 17: huge payloads are cut to the documented limits, and say that they were cut.

The store side (the store never receives more than the cap) is in test_store_push_cap.py.
CI sizes by default; EVENTBUS_FULL_MATRIX=1 uses the matrix's 100 MiB and 1e6 keys.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from matrix import KEYS
from matrix import STRING_CHARS
from matrix import deep_dict

import eventbus
from eventbus import Bus
from eventbus import Event
from eventbus.encoding import LIMITS

DEPTH = 10_000


def _depth_of(value: Any) -> int:
    depth = 0
    while isinstance(value, dict) and "a" in value:
        value, depth = value["a"], depth + 1
    return depth


def _line_of(bus: Bus, **fields: Any) -> str:
    got: list[Event] = []
    sub = bus.subscribe("METRIC", on_event=got.append)
    bus.record("METRIC", **fields)
    sub.cancel()
    return got[0].to_json()


def _size(line: str) -> int:
    return len(line.encode("utf-8"))


def test_huge_string_is_cut_with_a_marker(bus: Bus, figure: Callable[[int, str], None]) -> None:
    """A string far over the limit keeps LIMITS.max_string characters plus a marker that
    says how many were cut."""
    line = _line_of(bus, data={"blob": "x" * STRING_CHARS})
    value = json.loads(line)["data"]["blob"]
    assert value.startswith("x" * LIMITS.max_string)
    assert value.endswith(f"...[truncated {STRING_CHARS - LIMITS.max_string} chars]")
    assert _size(line) <= LIMITS.max_line_bytes
    figure(17, f"{STRING_CHARS >> 20} MiB string -> line of {_size(line):,} bytes "
               f"(cap {LIMITS.max_line_bytes:,})")


def test_million_keys_are_cut_with_a_marker(bus: Bus, figure: Callable[[int, str], None]) -> None:
    """A mapping with far more keys than LIMITS.max_items keeps that many plus a
    '$truncated' entry counting the rest."""
    line = _line_of(bus, data={f"k{i}": i for i in range(KEYS)})
    data = json.loads(line)["data"]
    assert len(data) == LIMITS.max_items + 1
    assert data["$truncated"] == f"{KEYS - LIMITS.max_items} more keys"
    assert _size(line) <= LIMITS.max_line_bytes
    figure(17, f"{KEYS:,} keys -> line of {_size(line):,} bytes")


def test_deep_nesting_is_cut_with_a_marker(bus: Bus, figure: Callable[[int, str], None]) -> None:
    """Nesting 10,000 deep (past the interpreter's recursion limit) is kept to
    LIMITS.max_depth levels, then a '$truncated' marker; no RecursionError anywhere."""
    line = _line_of(bus, data=deep_dict(DEPTH))
    data = json.loads(line)["data"]
    depth = _depth_of(data)
    cur = data
    for _ in range(depth):
        cur = cur["a"]
    assert "$truncated" in json.dumps(cur)
    assert depth <= LIMITS.max_depth
    Event.from_json(line)
    figure(17, f"depth {DEPTH:,} -> depth {depth} + marker, line of {_size(line):,} bytes")


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(lambda: {f"k{i}": "y" * LIMITS.max_string for i in range(200)},
                     id="many-strings-at-the-limit"),
        pytest.param(lambda: {"emoji": "\U0001f525" * LIMITS.max_string,
                              "more": ["\U0001f525" * LIMITS.max_string] * 100},
                     id="four-byte-characters"),
        pytest.param(lambda: {"ctl": ["\x01" * LIMITS.max_string] * 100},
                     id="six-byte-escapes"),
        pytest.param(lambda: {"rows": [[float(i)] * 900 for i in range(900)]},
                     id="810k-floats"),
    ],
)
def test_any_payload_stays_under_the_line_cap(
    bus: Bus, payload: Callable[[], dict[str, Any]], figure: Callable[[int, str], None],
) -> None:
    """Payloads whose parts are each within the limits but whose sum (or whose UTF-8 or
    escaped size) is not: the line never exceeds LIMITS.max_line_bytes and says it was cut."""
    line = _line_of(bus, data=payload())
    assert _size(line) <= LIMITS.max_line_bytes
    assert "truncated" in line
    back = Event.from_json(line)  # the envelope is kept whole: decodable, attributable
    assert back.context == eventbus.current_context()
    assert len(back.data) > 0
    figure(17, f"max line bytes {_size(line):,} <= {LIMITS.max_line_bytes:,}")


def test_limits_are_documented_numbers() -> None:
    """The limits docs/guarantees.md documents are the ones the encoder applies."""
    assert LIMITS.max_string == 16_384
    assert LIMITS.max_items == 1_000
    assert LIMITS.max_depth == 32
    assert LIMITS.max_int_digits == 1_000
    assert LIMITS.max_line_bytes == 1 << 20


def test_huge_typed_string_field(bus: Bus, figure: Callable[[int, str], None]) -> None:
    """A huge typed str field (a checkpoint path) is cut like a data string; the event
    still decodes to its type with the cut value."""
    got: list[Event] = []
    bus.subscribe("CHECKPOINT_SAVED", on_event=got.append)
    bus.record("CHECKPOINT_SAVED", path="p" * STRING_CHARS, data={"blob": "b" * STRING_CHARS})
    line = got[0].to_json()
    back = Event.from_json(line)
    assert _size(line) <= LIMITS.max_line_bytes
    assert back.fields()["path"].endswith(f"[truncated {STRING_CHARS - LIMITS.max_string} chars]")
    figure(17, f"{STRING_CHARS >> 20} MiB typed field + data -> line of {_size(line):,} bytes")
