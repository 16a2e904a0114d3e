"""Fuzz: Event.from_json with random and mutated input raises only the documented
exceptions (ValueError, TypeError and their eventbus subclasses), never hangs, never
unpickles; whatever it accepts encodes back to a valid line.

The store receiver's fuzz (which needs subscribers' store transport) is at the end.
"""

from __future__ import annotations

import json
import logging
import math
import os
import pickle
import random
from typing import Any

import pytest
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import eventbus
from eventbus import Event
from eventbus.encoding import LIMITS

DOCUMENTED = (ValueError, TypeError)

#: examples per hypothesis test; CI default, raise it for a deeper run
EXAMPLES = int(os.environ.get("EVENTBUS_FUZZ_EXAMPLES", "150"))

_SETTINGS = settings(max_examples=EXAMPLES, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow,
                                            HealthCheck.filter_too_much])

_json_scalar = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(-(10**1200), 10**1200),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=30),
    st.sampled_from([{"$float": "NaN"}, {"$float": "Infinity"}, {"$float": "nope"},
                     {"$int": "x"}, {"$truncated": "x"}]),
)
_json_value = st.recursive(
    _json_scalar,
    lambda inner: st.one_of(st.lists(inner, max_size=5),
                            st.dictionaries(st.text(max_size=10), inner, max_size=5)),
    max_leaves=30,
)


def _valid_lines() -> list[str]:
    """One real line per built-in type, with a busy payload."""
    lines = []
    fields: dict[str, dict[str, Any]] = {
        "WORKER_START": {"worker_id": 1}, "WORKER_EXIT": {"worker_id": 1, "exit_code": 3},
        "WORKER_RESTART": {"attempt": 1}, "RENDEZVOUS": {"duration_s": 0.5},
        "AGENT_START": {}, "AGENT_EXIT": {"state": "FAILED"}, "EPOCH_START": {"epoch": 1},
        "EPOCH_END": {"epoch": 1}, "CHECKPOINT_SAVED": {"path": "/ckpt/1.pt"},
        "METRIC": {"step": 3}, "TORCHELASTIC": {"name": "x"},
        "EVENTS_LOST": {"source": "rank1", "count": 2, "reason": "gap"},
    }
    bus = eventbus.Bus("fuzz")
    got: list[Event] = []
    bus.subscribe(eventbus.ALL, on_event=got.append)
    for name, kw in fields.items():
        bus.record(name, **kw, data={"loss": math.nan, "list": [1, "a\n", {"k": None}]})
    lines = [e.to_json() for e in got]
    return lines


VALID = _valid_lines()


def _decode(text: Any) -> Event | None:
    """from_json(text): the event, or None after a documented exception."""
    try:
        return Event.from_json(text)
    except DOCUMENTED:
        return None


def _accepted_round_trips(event: Event) -> None:
    """An accepted event encodes to one strict line that decodes to the same line."""
    line = event.to_json()
    assert len(line.splitlines()) == 1
    assert len(line.encode("utf-8")) <= LIMITS.max_line_bytes
    json.loads(line, parse_constant=lambda c: pytest.fail(f"constant {c} in {line[:200]}"))
    assert Event.from_json(line).to_json() == line


def test_valid_lines_decode() -> None:
    """The mutation seeds themselves are valid and round-trip."""
    for line in VALID:
        _accepted_round_trips(Event.from_json(line))


@pytest.mark.timeout(240)
@_SETTINGS
@given(st.one_of(st.text(max_size=200), st.binary(max_size=200)))
def test_random_text_and_bytes(text: str | bytes) -> None:
    """Arbitrary text or bytes: an event or a documented exception."""
    event = _decode(text)
    if event is not None:
        _accepted_round_trips(event)


@pytest.mark.timeout(240)
@_SETTINGS
@given(_json_value)
def test_random_json_documents(value: Any) -> None:
    """Arbitrary JSON documents: an event or a documented exception."""
    event = _decode(json.dumps(value))
    if event is not None:
        _accepted_round_trips(event)


@pytest.mark.timeout(240)
@_SETTINGS
@given(st.sampled_from(VALID), st.data())
def test_mutated_fields(line: str, data: st.DataObject) -> None:
    """A valid event with fields replaced by random JSON, removed or added (including
    type, timestamp, context and its fields): an event or a documented exception."""
    raw = json.loads(line)
    for _ in range(data.draw(st.integers(1, 4))):
        action = data.draw(st.sampled_from(["replace", "delete", "add", "context"]))
        keys = sorted(raw)
        if action == "replace" and keys:
            raw[data.draw(st.sampled_from(keys))] = data.draw(_json_value)
        elif action == "delete" and keys:
            raw.pop(data.draw(st.sampled_from(keys)))
        elif action == "add":
            raw[data.draw(st.text(max_size=12))] = data.draw(_json_value)
        elif isinstance(raw.get("context"), dict):
            ctx = raw["context"]
            ctx[data.draw(st.sampled_from([*sorted(ctx), "extra"]))] = data.draw(_json_value)
    event = _decode(json.dumps(raw))
    if event is not None:
        _accepted_round_trips(event)


@pytest.mark.timeout(240)
@_SETTINGS
@given(st.sampled_from(VALID), st.data())
def test_mutated_bytes(line: str, data: st.DataObject) -> None:
    """A valid line with bytes flipped, inserted, deleted or cut off: an event or a
    documented exception."""
    buf = bytearray(line.encode("utf-8"))
    for _ in range(data.draw(st.integers(1, 8))):
        pos = data.draw(st.integers(0, len(buf)))
        action = data.draw(st.sampled_from(["flip", "insert", "delete", "cut"]))
        if action == "flip" and pos < len(buf):
            buf[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif action == "insert":
            buf[pos:pos] = data.draw(st.binary(min_size=1, max_size=8))
        elif action == "delete":
            del buf[pos:pos + data.draw(st.integers(1, 8))]
        else:
            del buf[pos:]
    as_bytes = bytes(buf)
    for text in (as_bytes, as_bytes.decode("utf-8", "replace")):
        event = _decode(text)
        if event is not None:
            _accepted_round_trips(event)


@pytest.mark.parametrize("text", [
    "[" * 100_000, "{\"a\":" * 100_000, "[" * 100_000 + "]" * 100_000,
    '{"type": "METRIC", "timestamp": 1, "data": ' + '{"a":' * 50_000 + "1" + "}" * 50_001,
    "1" * 5_000, '{"type":"METRIC","timestamp":1e999}', '{"type":"METRIC","timestamp":NaN}',
    '{"type":"METRIC","timestamp":Infinity}', '{"type":"METRIC","timestamp":-Infinity}',
    "\ufeff{}", "", " ", "null", "true", "[]", '"METRIC"', "\x00",
    '{"type":"METRIC","timestamp":1,"data":{"s":"' + "x" * (LIMITS.max_decode_chars + 1) + '"}}',
    '{"type":"__init__","timestamp":1}', '{"type":"Event","timestamp":1}',
    '{"type":"METRIC","timestamp":1,"__class__":1}',
    '{"type":"METRIC","timestamp":1,"context":{"pid":"1"}}',
    '{"type":"WORKER_EXIT","timestamp":1,"worker_id":true,"exit_code":0}',
    '{"type":"WORKER_EXIT","timestamp":1,"worker_id":1.0,"exit_code":0}',
    '{"type":"WORKER_EXIT","timestamp":1,"worker_id":"1","exit_code":0}',
    '{"type":"WORKER_EXIT","timestamp":1,"exit_code":0}',
    '{"type":"EPOCH_END","timestamp":1,"epoch":' + "9" * 1_200 + "}",
    '{"type":"EPOCH_END","timestamp":1,"epoch":1,"context":{"rank":' + "9" * 30 + "}}",
], ids=lambda t: repr(t[:30]))
def test_hostile_classics(text: str) -> None:
    """Deep nesting, huge numbers, non-standard constants, a BOM, oversize input, wrong
    types, missing fields: each raises a documented exception (never RecursionError)."""
    with pytest.raises(DOCUMENTED):
        Event.from_json(text)


def test_pickle_is_never_unpickled(tmp_path: Any) -> None:
    """A pickle whose loading would create a file: rejected, and the file never appears."""
    marker = tmp_path / "unpickled"

    class Exploit:
        def __reduce__(self) -> Any:
            return (open, (str(marker), "w"))

    payload = pickle.dumps(Exploit())
    for text in (payload, payload.decode("latin-1")):
        with pytest.raises(DOCUMENTED):
            Event.from_json(text)
    assert not marker.exists()


def test_non_text_input_types() -> None:
    """Inputs that are neither str nor bytes raise TypeError."""
    for value in (None, 1, 1.5, [], {}, memoryview(b"{}"), object()):
        with pytest.raises(DOCUMENTED):
            Event.from_json(value)  # type: ignore[arg-type]


def test_seeded_mutation_storm() -> None:
    """10,000 seeded random byte mutations of valid lines (a cheap, deterministic
    complement to hypothesis): only documented exceptions."""
    rng = random.Random(8)
    accepted = 0
    for i in range(10_000):
        buf = bytearray(VALID[i % len(VALID)].encode("utf-8"))
        for _ in range(rng.randint(1, 4)):
            pos = rng.randrange(len(buf))
            buf[pos] = rng.randrange(256)
        event = _decode(bytes(buf))
        if event is not None:
            accepted += 1
            _accepted_round_trips(event)
    assert accepted > 0  # some mutations land in data values and stay valid


# -- the store receiver ------------------------------------------------------------------

_RECEIVER_STATE: dict[str, Any] = {}


def _receiver() -> tuple[Any, list[Event]]:
    """One StoreReceiver (on a real TCPStore) for all examples; handle_value is what is
    fuzzed, so the store itself is never touched per example."""
    if "rx" not in _RECEIVER_STATE:
        import datetime

        dist = pytest.importorskip("torch.distributed")
        from eventbus.publishers.store_receiver import StoreReceiver

        server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                               timeout=datetime.timedelta(seconds=10))
        bus = eventbus.Bus("fuzz-receiver")
        got: list[Event] = []
        bus.subscribe(eventbus.ALL, on_event=got.append)
        _RECEIVER_STATE.update(server=server, got=got,
                               rx=StoreReceiver(bus=bus, client=server))
    return _RECEIVER_STATE["rx"], _RECEIVER_STATE["got"]


def _valid_batches() -> list[bytes]:
    from eventbus.wire import BatchEncoder

    ctx = eventbus.JobContext(rank=0, run_id="fuzz", restart_count=0)
    bus = eventbus.Bus("fuzz-batches")
    got: list[Event] = []
    bus.subscribe(eventbus.ALL, on_event=got.append)
    bus.record("METRIC", step=1, data={"loss": math.nan, "s": "a\nb"})
    bus.record("WORKER_EXIT", worker_id=0, exit_code=1, message="x")
    events = [type(e)(**e.fields(), data=e.data, timestamp=e.timestamp, context=ctx)
              for e in got]
    enc = BatchEncoder(kind="w", rank=0, sender="w0:fuzz")
    return [value for value, _ in enc.encode(events, dropped={"queue full": 1})]


def _handle(value: bytes) -> None:
    """handle_value never raises; what it does not deliver, it counts."""
    rx, got = _receiver()
    before_rejected = sum(rx.stats()["rejected"].values())
    before_got = len(got)
    log = logging.getLogger("eventbus")
    level, log.level = log.level, logging.ERROR  # gap/duplicate warnings by the thousand
    try:
        delivered = rx.handle_value("fuzz/w0", value, kind="w", rank=0)
    finally:
        log.level = level
    after = rx.stats()
    assert delivered >= 0
    assert delivered > 0 or sum(after["rejected"].values()) > before_rejected or \
        b'"ev":[]' in value.replace(b" ", b"") or len(got) >= before_got
    for event in got[before_got:]:
        if event.type == "EVENTS_LOST":
            continue
        assert event.rank in (None, 0), "an event from another rank's queue got through"
        _accepted_round_trips(event)


@pytest.mark.timeout(240)
@_SETTINGS
@given(st.binary(max_size=300))
def test_receiver_random_bytes(value: bytes) -> None:
    """Arbitrary bytes popped from a worker queue: never an exception, never a hang."""
    _handle(value)


@pytest.mark.timeout(240)
@_SETTINGS
@given(st.sampled_from(_valid_batches()), st.data())
def test_receiver_mutated_batches(value: bytes, data: st.DataObject) -> None:
    """Real batches with their header and event fields replaced, removed or added, or
    with bytes flipped, inserted or cut: never an exception; accepted events are valid
    and from the queue's own rank."""
    if data.draw(st.booleans()):
        raw = json.loads(value)
        for _ in range(data.draw(st.integers(1, 4))):
            target = raw
            if isinstance(raw.get("ev"), list) and raw["ev"] and data.draw(st.booleans()):
                entry = raw["ev"][0]
                target = entry[1] if isinstance(entry, list) and len(entry) == 2 and \
                    isinstance(entry[1], dict) else raw
            keys = sorted(target)
            action = data.draw(st.sampled_from(["replace", "delete", "add"]))
            if action == "replace" and keys:
                target[data.draw(st.sampled_from(keys))] = data.draw(_json_value)
            elif action == "delete" and keys:
                target.pop(data.draw(st.sampled_from(keys)))
            else:
                target[data.draw(st.text(max_size=8))] = data.draw(_json_value)
        mutated = json.dumps(raw).encode()
    else:
        buf = bytearray(value)
        for _ in range(data.draw(st.integers(1, 8))):
            pos = data.draw(st.integers(0, len(buf)))
            if data.draw(st.booleans()) and pos < len(buf):
                buf[pos] ^= 1 << data.draw(st.integers(0, 7))
            else:
                buf[pos:pos] = data.draw(st.binary(min_size=1, max_size=4))
        mutated = bytes(buf)
    _handle(mutated)
