"""Row 16: values JSON cannot hold, in data and in typed fields."""

from __future__ import annotations

import datetime
import decimal
import enum
import json
import math
import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from eventbus import Bus
from eventbus import Event
from eventbus.encoding import LIMITS


class _FailingRepr:
    def __repr__(self) -> str:
        raise RuntimeError("__repr__ is broken")


class _ReprNotStr:
    def __repr__(self) -> Any:
        return 42


class _FailingFloat:
    def __float__(self) -> float:
        raise ValueError("no float for you")

    def __repr__(self) -> str:
        raise RuntimeError("nor a repr")


class _FailingMapping(dict):  # type: ignore[type-arg]
    def items(self) -> Any:
        raise RuntimeError("items() is broken")


class _Color(enum.Enum):
    RED = 1


def _self_referencing() -> list[Any]:
    loop: list[Any] = [1]
    loop.append(loop)
    return loop


def _values() -> dict[str, Any]:
    return {
        "tensor_0d_float": torch.tensor(1.5),
        "tensor_0d_int": torch.tensor(7),
        "tensor_0d_bool": torch.tensor(True),
        "tensor_0d_nan": torch.tensor(float("nan")),
        "tensor_nd": torch.arange(12.0).reshape(3, 4),
        "tensor_large": torch.zeros(1_000_000),
        "tensor_grad": torch.ones(3, requires_grad=True),
        "tensor_bf16": torch.ones(2, 2, dtype=torch.bfloat16),
        "tensor_noncontig": torch.arange(16).reshape(4, 4).t(),
        "tensor_meta": torch.empty(3, device="meta"),
        "tensor_sparse": torch.eye(3).to_sparse(),
        "tensor_complex": torch.tensor([1 + 2j]),
        "numpy_scalar": np.float32(2.5),
        "numpy_nan": np.float64("nan"),
        "numpy_array": np.arange(20).reshape(4, 5),
        "bytes": b"\x00\xff\n\r" * 100,
        "bytearray": bytearray(b"abc"),
        "memoryview": memoryview(b"xyz"),
        "set": {3, 1, 2},
        "frozenset": frozenset({"a"}),
        "tuple": (1, (2, 3)),
        "failing_repr": _FailingRepr(),
        "repr_not_str": _ReprNotStr(),
        "failing_float": _FailingFloat(),
        "failing_mapping": _FailingMapping(a=1),
        "nan": float("nan"),
        "inf": float("inf"),
        "-inf": float("-inf"),
        "int_5000_digits": 10**4999,
        "negative_int_5000_digits": -(10**4999),
        "complex": 1 + 2j,
        "decimal": decimal.Decimal("1.1"),
        "datetime": datetime.datetime(2026, 11, 29, tzinfo=datetime.timezone.utc),
        "path": pathlib.Path("/tmp/x"),
        "enum": _Color.RED,
        "non_str_keys": {1: "a", (2, 3): "b", None: "c", 1.5: "d"},
        "self_referencing": _self_referencing(),
        "generator": (i for i in range(3)),
        "type": int,
        "function": print,
        "lone_surrogate": "bad \udcff name",
        "ellipsis": ...,
    }


def _strict_loads(line: str) -> Any:
    def no_constants(name: str) -> Any:
        raise ValueError(f"non-standard constant {name}")
    return json.loads(line, parse_constant=no_constants)


def _check_line(line: str) -> str | None:
    """Why ``line`` is not one valid strict-JSON UTF-8 line, or None."""
    try:
        line.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"not UTF-8: {exc}"
    if len(line.splitlines()) != 1:
        return "not one line"
    try:
        _strict_loads(line)
    except ValueError as exc:
        return f"not strict JSON: {exc}"
    if len(line.encode("utf-8")) > LIMITS.max_line_bytes:
        return "over the line limit"
    return None


def test_every_non_json_value_records_and_encodes(
    bus: Bus, figure: Callable[[int, str], None],
) -> None:
    """Each hostile value, alone and all together in one event: record() does not raise,
    to_json() is one strict-JSON UTF-8 line that from_json() reads back."""
    got: list[Event] = []
    bus.subscribe("METRIC", on_event=got.append)
    values = _values()
    for name, value in values.items():
        bus.record("METRIC", step=0, data={name: value})
    bus.record("METRIC", step=1, data=values)
    bus.record("METRIC", step=2, data={"nested": [values, {"again": values}]})
    assert len(got) == len(values) + 2

    invalid = {}
    for event in got:
        line = event.to_json()
        problem = _check_line(line)
        if problem is None:
            Event.from_json(line)
        else:
            invalid[next(iter(event.data))] = problem
    figure(16, f"invalid lines 0 of {len(got)}" if not invalid else f"invalid {invalid}")
    assert invalid == {}


def test_nan_and_infinities_survive_a_round_trip(bus: Bus) -> None:
    """NaN, inf and -inf (Python, numpy, 0-d tensors) come back as floats from from_json,
    while the line itself holds no NaN/Infinity literal."""
    got: list[Event] = []
    bus.subscribe("METRIC", on_event=got.append)
    bus.record("METRIC", data={"nan": float("nan"), "inf": math.inf, "-inf": -math.inf,
                               "np": np.float64("nan"), "t": torch.tensor(float("inf")),
                               "deep": [{"x": float("nan")}]})
    line = got[0].to_json()
    _strict_loads(line)
    back = Event.from_json(line).data
    assert math.isnan(back["nan"]) and math.isnan(back["np"])
    assert back["inf"] == math.inf and back["-inf"] == -math.inf and back["t"] == math.inf
    assert math.isnan(back["deep"][0]["x"])


def test_tensor_summaries_are_bounded(bus: Bus) -> None:
    """A 0-d tensor becomes its number; a large one a summary of shape, dtype, numel and at
    most LIMITS.tensor_head values."""
    got: list[Event] = []
    bus.subscribe("METRIC", on_event=got.append)
    bus.record("METRIC", data={"scalar": torch.tensor(3.0), "big": torch.zeros(1000, 1000)})
    raw = _strict_loads(got[0].to_json())["data"]
    assert raw["scalar"] == 3.0
    summary = raw["big"]["$tensor"]
    assert summary["shape"] == [1000, 1000]
    assert summary["numel"] == 1_000_000
    assert len(summary["head"]) == LIMITS.tensor_head


@pytest.mark.parametrize("value", [torch.tensor(3), np.int64(3)], ids=["tensor", "numpy"])
def test_typed_int_field_takes_integer_scalars(bus: Bus, value: Any) -> None:
    """A 0-d integer tensor or a numpy integer in an int field is stored as a plain int."""
    got: list[Event] = []
    bus.subscribe("EPOCH_END", on_event=got.append)
    bus.record("EPOCH_END", epoch=value)
    assert type(got[0].fields()["epoch"]) is int
    assert _strict_loads(got[0].to_json())["epoch"] == 3


def test_record_without_subscribers_accepts_the_same_values(bus: Bus) -> None:
    """Validation does not depend on who listens: with nobody subscribed, the same
    payloads are accepted (and nothing is encoded)."""
    for name, value in _values().items():
        bus.record("METRIC", step=0, data={name: value})


def test_jsonl_recorder_writes_every_hostile_value_as_a_valid_line(
    tmp_path: Any, figure: Callable[[int, str], None],
) -> None:
    """Through the JSONL recorder (real file, its own thread): one strict-JSON line per
    event, none invalid, NaN back as NaN through read_jsonl."""
    from eventbus.subscribers.jsonl import JsonlRecorder
    from eventbus.subscribers.jsonl import read_jsonl

    bus = Bus("row16-jsonl")
    path = tmp_path / "values.jsonl"
    recorder = JsonlRecorder(path)
    bus.subscribe("METRIC", on_event=recorder)
    values = _values()
    for name, value in values.items():
        bus.record("METRIC", step=0, data={name: value})
    bus.record("METRIC", step=1, data=values)
    assert recorder.close(timeout=30)
    raw_lines = path.read_bytes().split(b"\n")
    assert raw_lines[-1] == b""
    lines = [line.decode("utf-8") for line in raw_lines[:-1]]
    invalid = [line[:80] for line in lines if _check_line(line) is not None]
    assert len(lines) == len(values) + 1
    assert invalid == []
    events = list(read_jsonl(path, decode="event"))
    assert math.isnan(next(e for e in events if "nan" in e.data).data["nan"])
    assert math.isnan(next(e for e in events if "tensor_0d_nan" in e.data).data["tensor_0d_nan"])
    figure(16, f"JSONL recorder: invalid lines {len(invalid)} of {len(lines)}")
