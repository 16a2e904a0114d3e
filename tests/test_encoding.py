"""to_json / from_json / to_dict: strict, one line, bounded, lossless where it matters."""

from __future__ import annotations

import json
import math
import pickle
from typing import Any

import numpy as np
import pytest

import eventbus
from eventbus import LIMITS
from eventbus import Event
from eventbus.events import EpochEnd
from eventbus.events import WorkerExit


def strict_loads(line: str) -> Any:
    """json.loads that refuses NaN/Infinity literals."""
    def refuse(name: str) -> Any:
        raise AssertionError(f"non-strict JSON constant {name}")
    return json.loads(line, parse_constant=refuse)


def test_to_dict_has_type_timestamp_fields_data_context() -> None:
    """to_dict() holds the type name, timestamp, typed fields, data and the job context."""
    event = WorkerExit(worker_id=1, exit_code=3, data={"epoch": 2}, timestamp=10.0)
    d = event.to_dict()
    assert d["type"] == "WORKER_EXIT" and d["timestamp"] == 10.0
    assert (d["worker_id"], d["exit_code"], d["signal"]) == (1, 3, None)
    assert d["data"] == {"epoch": 2}
    assert set(d["context"]) == {"rank", "local_rank", "group_rank", "world_size",
                                 "local_world_size", "role", "run_id", "restart_count",
                                 "hostname", "pid"}


def test_to_json_round_trips() -> None:
    """from_json(to_json()) gives back an equal typed event."""
    event = WorkerExit(worker_id=1, exit_code=3, signal="SIGKILL", data={"a": [1, "x"]})
    back = Event.from_json(event.to_json())
    assert back == event
    assert type(back) is WorkerExit
    assert WorkerExit.from_json(event.to_json()) == event


def test_non_finite_floats_survive_in_strict_json() -> None:
    """NaN and +/-inf are written as tags (strict JSON) and come back as floats."""
    event = EpochEnd(epoch=1, data={"loss": math.nan, "hi": math.inf, "lo": -math.inf,
                                    "nested": [math.nan]})
    line = event.to_json()
    strict_loads(line)
    back = Event.from_json(line)
    assert math.isnan(back.data["loss"]) and math.isnan(back.data["nested"][0])
    assert back.data["hi"] == math.inf and back.data["lo"] == -math.inf


def test_one_event_is_one_line() -> None:
    """Newlines, CR, U+0085, U+2028, U+2029 and ESC in any field stay escaped on one line."""
    nasty = "a\nb\rc\u0085d\u2028e\u2029f\x1b[31mred"
    event = WorkerExit(worker_id=0, exit_code=1, message=nasty, data={nasty: nasty})
    line = event.to_json()
    assert len(line.splitlines()) == 1
    assert "\x1b" not in line
    back = Event.from_json(line)
    assert back.message == nasty and back.data == {nasty: nasty}


def test_tensors_in_data() -> None:
    """A 0-d tensor becomes its number; larger tensors a bounded summary; numpy likewise."""
    torch = pytest.importorskip("torch")  # the rest of this module is torch-free
    event = EpochEnd(epoch=1, data={
        "loss": torch.tensor(0.25), "grad": torch.arange(1000.0).reshape(10, 100),
        "acc": np.float32(0.5), "hist": np.zeros((3, 3)), "nan": torch.tensor(float("nan")),
    })
    d = strict_loads(event.to_json())["data"]
    assert d["loss"] == 0.25 and d["acc"] == 0.5
    assert d["grad"]["$tensor"]["shape"] == [10, 100]
    assert d["grad"]["$tensor"]["numel"] == 1000
    assert len(d["grad"]["$tensor"]["head"]) == LIMITS.tensor_head
    assert d["hist"]["$tensor"]["shape"] == [3, 3]
    assert math.isnan(Event.from_json(event.to_json()).data["nan"])


def test_awkward_values_still_encode() -> None:
    """bytes, sets, a failing __repr__, huge ints and odd keys encode as strict JSON."""
    class Ugly:
        def __repr__(self) -> str:
            raise RuntimeError("no repr")

    event = EpochEnd(epoch=1, data={"b": b"\x00\xff", "s": {3}, "u": Ugly(),
                                    "big": 10**5000, "t": (1, 2), 7: "int key"})
    d = strict_loads(event.to_json())["data"]
    assert d["b"]["$bytes"] == 2
    assert d["s"] == [3] and d["t"] == [1, 2]
    assert "failing __repr__" in d["u"]["$repr"]
    assert "digits" in d["big"]["$int"]
    assert d["7"] == "int key"


def test_payload_limits_truncate_and_say_so() -> None:
    """Huge strings, many keys and deep nesting are cut within LIMITS and marked as cut."""
    deep: Any = "bottom"
    for _ in range(2000):
        deep = [deep]
    event = EpochEnd(epoch=1, data={"s": "x" * (LIMITS.max_string + 10),
                                    "many": {str(i): i for i in range(LIMITS.max_items + 5)},
                                    "deep": deep})
    line = event.to_json()
    assert len(line.encode()) <= LIMITS.max_line_bytes
    d = strict_loads(line)["data"]
    assert d["s"].endswith("[truncated 10 chars]")
    assert d["many"]["$truncated"] == "5 more keys"
    assert "$truncated" in json.dumps(d["deep"])


def test_a_huge_payload_stays_under_the_line_limit() -> None:
    """Even 1,000 strings at the string limit fit in one line of at most max_line_bytes."""
    event = EpochEnd(epoch=1, data={str(i): "y" * LIMITS.max_string for i in range(1000)})
    line = event.to_json()
    assert len(line.encode()) <= LIMITS.max_line_bytes
    assert "$truncated" in line
    assert Event.from_json(line).epoch == 1


@pytest.mark.parametrize("text", [
    "", "{", '{"type": "EPOCH_END"', "[]", "null", "42", '"str"',
    '{"type": 5, "timestamp": 1}',
    '{"type": "NO_SUCH", "timestamp": 1}',
    '{"type": "EPOCH_END", "timestamp": 1, "epoch": "one"}',
    '{"type": "EPOCH_END", "timestamp": "now", "epoch": 1}',
    '{"type": "EPOCH_END", "epoch": 1}',
    '{"type": "EPOCH_END", "timestamp": 1, "epoch": 1, "extra": 1}',
    '{"type": "EPOCH_END", "timestamp": 1, "epoch": 1, "data": [1]}',
    '{"type": "EPOCH_END", "timestamp": 1, "epoch": 1, "context": {"rank": "0"}}',
    '{"type": "EPOCH_END", "timestamp": 1, "epoch": 1, "context": {"evil": 1}}',
    '{"type": "EPOCH_END", "timestamp": NaN, "epoch": 1}',
    '{"type": "EPOCH_END", "timestamp": 1, "epoch": ' + "9" * 5000 + "}",
    "[" * 100_000 + "]" * 100_000,
    '{"a":' * 50_000 + "1" + "}" * 50_000,
])
def test_hostile_json_raises_value_or_type_error(text: str) -> None:
    """Malformed, mistyped, unknown, huge or deeply nested input: ValueError or TypeError."""
    with pytest.raises((ValueError, TypeError)):
        Event.from_json(text)


def test_from_json_rejects_bytes_that_are_not_utf8_or_json() -> None:
    """Invalid UTF-8 and a pickle are rejected with ValueError; nothing is unpickled."""
    with pytest.raises(ValueError, match="UTF-8"):
        Event.from_json(b"\xff\xfe{}")
    payload = pickle.dumps(WorkerExit(worker_id=0, exit_code=0))
    with pytest.raises(ValueError):
        Event.from_json(payload)


def test_from_json_refuses_oversized_input() -> None:
    """Input past the decoder's size cap is refused before parsing."""
    with pytest.raises(ValueError, match="limit"):
        Event.from_json('{"x": "' + "a" * (LIMITS.max_decode_chars + 1) + '"}')


def test_from_json_of_a_subclass_checks_the_type() -> None:
    """WorkerExit.from_json refuses an EPOCH_END line."""
    with pytest.raises(ValueError, match="expected a WorkerExit"):
        WorkerExit.from_json(EpochEnd(epoch=1).to_json())
    assert isinstance(eventbus.EpochEnd.from_json(EpochEnd(epoch=1).to_json()), EpochEnd)


def test_a_string_just_over_the_limit_alone_in_data_is_cut() -> None:
    """A 16,394-character string, the only value in data, is cut to 16,384 and says so."""
    line = EpochEnd(epoch=1, data={"s": "x" * (LIMITS.max_string + 10)}).to_json()
    s = strict_loads(line)["data"]["s"]
    assert s == "x" * LIMITS.max_string + "...[truncated 10 chars]"


def test_items_and_depth_limits_hold_without_json_raising() -> None:
    """1,001 keys, 1,001 list items and depth 33 are cut even where json.dumps copes."""
    deep: Any = "bottom"
    for _ in range(LIMITS.max_depth + 1):
        deep = [deep]
    event = EpochEnd(epoch=1, data={"keys": {str(i): i for i in range(LIMITS.max_items + 1)},
                                    "items": list(range(LIMITS.max_items + 1)),
                                    "deep": deep})
    d = strict_loads(event.to_json())["data"]
    assert d["keys"]["$truncated"] == "1 more keys"
    assert d["items"][-1] == {"$truncated": "1 more items"}
    assert "$truncated" in json.dumps(d["deep"])


def test_plain_data_within_the_limits_is_written_as_given() -> None:
    """The fast path keeps plain JSON at the limits exactly (no cut, no marker)."""
    data = {"s": "y" * LIMITS.max_string, "items": list(range(LIMITS.max_items)),
            "f": 0.5, "n": None, "b": True}
    line = EpochEnd(epoch=1, data=data).to_json()
    assert strict_loads(line)["data"] == data
    assert "$truncated" not in line
