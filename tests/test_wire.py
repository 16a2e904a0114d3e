"""The store wire format (eventbus/wire.py): what one end encodes, the other decodes."""

from __future__ import annotations

import json
import math

import pytest

import eventbus
from eventbus.context import JobContext
from eventbus.wire import WIRE_VERSION
from eventbus.wire import BatchDecoder
from eventbus.wire import BatchEncoder
from eventbus.wire import WireError
from eventbus.wire import ack_key
from eventbus.wire import namespace
from eventbus.wire import node_key
from eventbus.wire import worker_key


def _events(rank: int) -> list[eventbus.Event]:
    ctx = JobContext(rank=rank, group_rank=0, run_id="job")
    return [eventbus.EpochEnd(epoch=1, context=ctx),
            eventbus.Metric(step=2, data={"loss": math.nan}, context=ctx)]


def test_keys_are_namespaced_by_run_and_attempt() -> None:
    """Each attempt of each job has its own queues (the store keeps them across attempts)."""
    prefix = namespace("job", 2)
    assert worker_key(prefix, 3) == "eventbus/job/2/w3"
    assert node_key(prefix, 1) == "eventbus/job/2/n1"
    assert ack_key(node_key(prefix, 1), "n1:h:9:ab") == "eventbus/job/2/n1/ack/n1:h:9:ab"


def test_what_the_encoder_pushes_the_decoder_reads_back() -> None:
    """Typed events, their context, their numbering and NaN survive the trip."""
    encoder = BatchEncoder(kind="w", rank=1)
    sent = _events(1)
    (value, count), = encoder.encode(sent, dropped={"queue full": 2}, end=True)
    assert count == 2 and encoder.seq == 2
    assert json.loads(value)["v"] == WIRE_VERSION
    decoder = BatchDecoder()
    batch = decoder.batch(value, kind="w", rank=1)
    assert (batch.sender, batch.first, batch.end, batch.dropped) == (
        encoder.sender, 0, True, {"queue full": 2})
    got = [decoder.event(entry, batch.contexts) for entry in batch.entries]
    assert [type(e) for e in got] == [eventbus.EpochEnd, eventbus.Metric]
    assert got[0].epoch == 1 and got[0].context == sent[0].context
    assert math.isnan(got[1].data["loss"])


def test_a_batch_from_another_queue_owner_is_refused_whole() -> None:
    """A worker cannot push into another rank's queue: the batch counts as spoofed."""
    (value, _), = BatchEncoder(kind="w", rank=1).encode(_events(1))
    with pytest.raises(WireError) as info:
        BatchDecoder().batch(value, kind="w", rank=2)
    assert info.value.reason == "spoofed sender" and info.value.count == 2


def test_an_event_whose_context_claims_another_rank_is_refused_alone() -> None:
    """A context naming another rank marks its events spoofed; the batch itself is read."""
    (value, _), = BatchEncoder(kind="w", rank=1).encode(_events(0))
    decoder = BatchDecoder()
    batch = decoder.batch(value, kind="w", rank=1)
    assert batch.contexts == [None]
    with pytest.raises(WireError, match="spoofed rank"):
        decoder.event(batch.entries[0], batch.contexts)


@pytest.mark.parametrize(("raw", "reason"), [
    ("text", "not bytes"),
    (b"\xff\xfe", "not UTF-8"),
    (b'{"v": NaN}', "not JSON"),
    (b"[]", "bad header: not an object"),
    (b'{"v": 99}', "bad header: unknown wire version"),
])
def test_garbage_names_its_reason(raw: object, reason: str) -> None:
    """Whatever is wrong is a WireError (a ValueError) with the reason it is counted under."""
    with pytest.raises(WireError) as info:
        BatchDecoder().batch(raw, kind="w", rank=0)
    assert info.value.reason == reason
    assert isinstance(info.value, ValueError)
