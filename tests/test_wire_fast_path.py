"""The store wire format's orjson fast path writes and reads exactly what json would."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

import eventbus
from eventbus import wire
from eventbus.wire import BatchDecoder
from eventbus.wire import BatchEncoder


def _ctx() -> eventbus.JobContext:
    return eventbus.JobContext(rank=0, group_rank=0, run_id="t", restart_count=0,
                               hostname="h", pid=1)


def _round_trip(data: dict[str, Any]) -> eventbus.Event:
    ((value, _),) = BatchEncoder(kind="w", rank=0).encode(
        [eventbus.Metric(step=1, data=data, context=_ctx())])
    json.loads(value)  # strict JSON whichever path wrote it
    decoder = BatchDecoder()
    batch = decoder.batch(value, kind="w", rank=0)
    return decoder.event(batch.entries[0], batch.contexts)


@pytest.mark.parametrize("data", [
    {"loss": 0.25, "name": "x\u2028y", "nested": {"l": [1, 2.5, "s"]}},
    {"loss": math.nan, "inf": -math.inf},
    {"none": None, "big": 2**70, "t": (1, 2)},
    {"lone": "\ud800"},
])
def test_values_survive_the_wire_on_either_path(data: dict[str, Any]) -> None:
    """Plain data (orjson), non-finite floats and None (json, tagged), ints past 64 bits
    and lone surrogates (json) all come back as the values recorded."""
    got = _round_trip(data).data
    for key, value in data.items():
        if isinstance(value, float) and math.isnan(value):
            assert math.isnan(got[key])
        elif isinstance(value, tuple):
            assert got[key] == list(value)
        else:
            assert got[key] == value, key


def test_the_fast_path_is_taken_for_plain_data_only() -> None:
    """orjson writes a batch of plain values; a null anywhere in it sends it to json."""
    if wire._codec() is None:
        pytest.skip("orjson is not installed")
    assert wire._fast_entries([["METRIC", {"data": {"loss": 0.25}}]]) is not None
    assert wire._fast_entries([["METRIC", {"data": {"loss": math.nan}}]]) is None
    assert wire._fast_entries([["METRIC", {"data": {"big": 2**70}}]]) is None


def test_values_json_would_summarise_are_summarised_on_the_wire_too() -> None:
    """An enum, a UUID, a datetime in data reach the agent as to_json() writes them."""
    import datetime
    import enum
    import uuid

    class Color(enum.Enum):
        RED = 1

    data = {"enum": Color.RED, "uuid": uuid.UUID(int=1),
            "when": datetime.datetime(2026, 1, 1), "loss": 0.5}
    sent = eventbus.Metric(step=1, data=data, context=_ctx())
    got = _round_trip(data)
    assert json.loads(got.to_json())["data"] == json.loads(sent.to_json())["data"]


def test_the_decoder_leaves_rejections_to_json() -> None:
    """A NaN literal is refused whichever parser saw it first."""
    with pytest.raises(ValueError):
        wire._loads('{"x": NaN}')
    assert wire._loads('{"s": "\\ud800"}') == {"s": "\ud800"}
