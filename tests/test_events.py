"""Typed events: the built-in types, validation, immutability, declared types."""

from __future__ import annotations

import math
import pathlib
from typing import Any

import attrs
import numpy as np
import pytest

import eventbus
from eventbus import Event
from eventbus import EventType
from eventbus.events import CheckpointSaved
from eventbus.events import EpochEnd
from eventbus.events import WorkerExit
from eventbus.events import WorkerStart

BUILT_INS = ["WORKER_START", "WORKER_EXIT", "WORKER_RESTART", "RENDEZVOUS", "AGENT_START",
             "AGENT_EXIT", "EPOCH_START", "EPOCH_END", "CHECKPOINT_SAVED"]


def capture(bus: eventbus.Bus, event_type: Any = eventbus.ALL) -> list[Event]:
    got: list[Event] = []
    bus.subscribe(event_type, on_event=got.append)
    return got


def test_event_type_is_a_str_enum_with_the_built_ins() -> None:
    """EventType members are strings equal to their names, and every promised built-in exists."""
    for name in BUILT_INS:
        member = EventType[name]
        assert isinstance(member, str)
        assert member == name
        assert str(member) == name
        assert f"{member}" == name
        assert EventType(name) is member


def test_decision_has_restart_and_stop() -> None:
    """Decision offers RESTART and STOP, usable as strings."""
    assert {d.name for d in eventbus.Decision} == {"RESTART", "STOP"}
    assert eventbus.Decision.STOP == "STOP"


def test_record_builds_the_typed_event(bus: eventbus.Bus) -> None:
    """record() delivers an event of the type's class with its typed fields and data."""
    got = capture(bus, EventType.WORKER_EXIT)
    bus.record(EventType.WORKER_EXIT, worker_id=1, exit_code=3, data={"epoch": 10})
    (event,) = got
    assert type(event) is WorkerExit
    assert event.type is EventType.WORKER_EXIT
    assert (event.worker_id, event.exit_code) == (1, 3)
    assert event.data == {"epoch": 10}
    assert event.signal is None
    assert isinstance(event.timestamp, float)
    assert isinstance(event.context, eventbus.JobContext)


def test_record_accepts_the_type_name_and_class(bus: eventbus.Bus) -> None:
    """The event type may be given as a member, its name, or the event class."""
    got = capture(bus, EventType.EPOCH_END)
    bus.record(EventType.EPOCH_END, epoch=1)
    bus.record("EPOCH_END", epoch=2)
    bus.record(EpochEnd, epoch=3)
    assert [e.epoch for e in got] == [1, 2, 3]


def test_data_defaults_to_an_empty_dict_and_is_copied(bus: eventbus.Bus) -> None:
    """data is a dict, empty by default, and the caller mutating theirs changes no event."""
    got = capture(bus, EventType.EPOCH_END)
    bus.record(EventType.EPOCH_END, epoch=1)
    mine = {"loss": 1.0}
    bus.record(EventType.EPOCH_END, epoch=2, data=mine)
    mine["loss"] = 99.0
    assert got[0].data == {}
    assert isinstance(got[0].data, dict)  # a read-only dict: see test_data_snapshots.py
    assert got[1].data == {"loss": 1.0}


def test_events_are_immutable() -> None:
    """Assigning an attribute of an event raises."""
    event = WorkerExit(worker_id=0, exit_code=0)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        event.exit_code = 1  # type: ignore[misc]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        event.timestamp = 0.0  # type: ignore[misc]


@pytest.mark.parametrize("listening", [False, True], ids=["no-subscriber", "subscriber"])
def test_unknown_field_raises_type_error_naming_it(bus: eventbus.Bus, listening: bool) -> None:
    """An unknown field raises TypeError naming it, whether or not anyone listens."""
    if listening:
        capture(bus)
    with pytest.raises(TypeError, match="'exit_cod'"):
        bus.record(EventType.WORKER_EXIT, worker_id=0, exit_cod=0)
    with pytest.raises(eventbus.UnknownFieldError) as info:
        bus.record(EventType.WORKER_EXIT, worker_id=0, exit_code=0, bogus=1)
    assert info.value.field == "bogus"
    assert "data=" in str(info.value)


@pytest.mark.parametrize("listening", [False, True], ids=["no-subscriber", "subscriber"])
@pytest.mark.parametrize(
    ("field", "value"),
    [("worker_id", "zero"), ("worker_id", 1.5), ("worker_id", True), ("exit_code", None),
     ("worker_pid", "12"), ("signal", 9)],
)
def test_wrongly_typed_field_raises_naming_it(bus: eventbus.Bus, listening: bool, field: str,
                                              value: object) -> None:
    """A wrongly typed field raises TypeError naming the field and the expected type."""
    if listening:
        capture(bus)
    fields: dict[str, Any] = {"worker_id": 0, "exit_code": 0, field: value}
    with pytest.raises(TypeError, match=rf"WORKER_EXIT\.{field} must be"):
        bus.record(EventType.WORKER_EXIT, **fields)


@pytest.mark.parametrize("listening", [False, True], ids=["no-subscriber", "subscriber"])
def test_missing_field_raises_naming_it(bus: eventbus.Bus, listening: bool) -> None:
    """A missing required field raises TypeError naming it."""
    if listening:
        capture(bus)
    with pytest.raises(TypeError, match="'exit_code'"):
        bus.record(EventType.WORKER_EXIT, worker_id=0)


@pytest.mark.parametrize("listening", [False, True], ids=["no-subscriber", "subscriber"])
def test_unknown_type_raises_value_error_naming_it(bus: eventbus.Bus, listening: bool) -> None:
    """An unknown event type raises ValueError naming it."""
    if listening:
        capture(bus)
    with pytest.raises(ValueError, match="'WORKER_EXPLODED'"):
        bus.record("WORKER_EXPLODED", worker_id=0)
    with pytest.raises(ValueError, match="unknown event type"):
        bus.record(42)  # type: ignore[arg-type]


def test_a_misspelt_event_type_gets_a_did_you_mean(bus: eventbus.Bus) -> None:
    """record("METRC") names the closest type, the way a misspelt field does."""
    with pytest.raises(ValueError, match=r"'METRC' \(did you mean 'METRIC'\?\)"):
        bus.record("METRC")
    with pytest.raises(ValueError, match=r"'WORKER_EXPLODED': use"):  # nothing close enough
        bus.record("WORKER_EXPLODED")


def test_data_must_be_a_mapping(bus: eventbus.Bus) -> None:
    """data that is not a mapping raises TypeError naming data; a Mapping is copied to a dict."""
    with pytest.raises(TypeError, match=r"EPOCH_END\.data must be"):
        bus.record(EventType.EPOCH_END, epoch=1, data=[1, 2])
    got = capture(bus)
    import types

    bus.record(EventType.EPOCH_END, epoch=1, data=types.MappingProxyType({"a": 1}))
    assert isinstance(got[0].data, dict)  # read-only: see test_data_snapshots.py
    assert got[0].data == {"a": 1}


def test_unambiguous_stand_ins_are_converted(bus: eventbus.Bus) -> None:
    """numpy ints become int, ints become float for float fields, paths become str."""
    got = capture(bus)
    bus.record(EventType.WORKER_EXIT, worker_id=np.int64(3), exit_code=0)
    bus.record(EventType.RENDEZVOUS, duration_s=2)
    bus.record(EventType.CHECKPOINT_SAVED, path=pathlib.Path("/tmp/ckpt.pt"))
    assert type(got[0].worker_id) is int and got[0].worker_id == 3
    assert type(got[1].duration_s) is float and got[1].duration_s == 2.0
    assert got[2].path == "/tmp/ckpt.pt" and type(got[2].path) is str


def test_direct_construction_validates_too() -> None:
    """Building an event class directly runs the same validation as record()."""
    with pytest.raises(TypeError, match=r"WORKER_START\.worker_id must be an int"):
        WorkerStart(worker_id="0")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="'nope'"):
        WorkerStart(worker_id=0, nope=1)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="abstract"):
        Event()
    with pytest.raises(TypeError, match="timestamp"):
        WorkerStart(worker_id=0, timestamp="yesterday")  # type: ignore[arg-type]


def test_is_failure_follows_the_type() -> None:
    """A non-zero exit, a failed rendezvous and a failed agent are failures; the rest not."""
    assert WorkerExit(worker_id=0, exit_code=1).is_failure
    assert not WorkerExit(worker_id=0, exit_code=0).is_failure
    assert eventbus.Rendezvous(state="FAILED").is_failure
    assert not eventbus.Rendezvous().is_failure
    assert eventbus.AgentExit(state="FAILED").is_failure
    assert not eventbus.AgentExit(state="SUCCEEDED").is_failure
    assert not EpochEnd(epoch=1).is_failure


def test_context_comes_from_the_torchelastic_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The job context reads RANK, LOCAL_RANK, ... TORCHELASTIC_RESTART_COUNT, host and pid."""
    env = {"RANK": "5", "LOCAL_RANK": "1", "GROUP_RANK": "2", "WORLD_SIZE": "8",
           "LOCAL_WORLD_SIZE": "4", "ROLE_NAME": "trainer", "TORCHELASTIC_RUN_ID": "job-7",
           "TORCHELASTIC_RESTART_COUNT": "3"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    try:
        eventbus.refresh_context()
        event = EpochEnd(epoch=1)
        ctx = event.context
        assert (ctx.rank, ctx.local_rank, ctx.group_rank, ctx.world_size) == (5, 1, 2, 8)
        assert (ctx.local_world_size, ctx.role, ctx.run_id, ctx.restart_count) == \
            (4, "trainer", "job-7", 3)
        assert ctx.hostname and ctx.pid > 0
        assert (event.rank, event.run_id, event.restart_count) == (5, "job-7", 3)
    finally:
        monkeypatch.undo()
        eventbus.refresh_context()
    assert EpochEnd(epoch=1).context.rank is None


def test_set_context_overrides_fields() -> None:
    """set_context() replaces fields of the context later events carry."""
    before = eventbus.current_context()
    try:
        eventbus.set_context(restart_count=4, run_id="r")
        assert EpochEnd(epoch=1).context.restart_count == 4
        assert EpochEnd(epoch=1).run_id == "r"
    finally:
        eventbus.refresh_context()
    assert eventbus.current_context().restart_count == before.restart_count


# -- user-declared types ---------------------------------------------------------------------


@eventbus.event_type("TEST_LOSS_SPIKE", failure=lambda e: e.loss > 100)
class LossSpike(Event):
    """A declared type used by these tests."""

    step: int
    loss: float
    note: str | None = None


def test_declared_type_records_and_subscribes_like_a_built_in(bus: eventbus.Bus) -> None:
    """A declared type is recorded and subscribed by name or class, validated, round-trips."""
    by_name = capture(bus, "TEST_LOSS_SPIKE")
    by_class = capture(bus, LossSpike)
    bus.record("TEST_LOSS_SPIKE", step=3, loss=9.5)
    bus.record(LossSpike, step=4, loss=500, note="boom")
    assert [e.step for e in by_name] == [3, 4] == [e.step for e in by_class]
    assert by_name[1].loss == 500.0 and by_name[1].is_failure
    assert by_name[0].type == "TEST_LOSS_SPIKE"
    with pytest.raises(TypeError, match=r"TEST_LOSS_SPIKE\.loss must be a float"):
        bus.record("TEST_LOSS_SPIKE", step=1, loss="high")
    with pytest.raises(TypeError, match="'lr'"):
        bus.record("TEST_LOSS_SPIKE", step=1, loss=1.0, lr=0.1)
    back = Event.from_json(by_name[1].to_json())
    assert isinstance(back, LossSpike) and back.note == "boom"


def test_declaring_a_taken_name_fails() -> None:
    """Declaring a name twice, or a built-in's name, raises ValueError naming it."""
    with pytest.raises(ValueError, match="TEST_LOSS_SPIKE"):
        @eventbus.event_type("TEST_LOSS_SPIKE")
        class Again(Event):
            step: int
    with pytest.raises(ValueError, match="WORKER_EXIT"):
        @eventbus.event_type("WORKER_EXIT")
        class Clash(Event):
            step: int


def test_declaring_unsupported_fields_fails() -> None:
    """Field types other than int/float/str/bool (optional) and reserved names are refused."""
    with pytest.raises(TypeError, match="not supported"):
        @eventbus.event_type("TEST_BAD_FIELD")
        class Bad(Event):
            values: list[int]
    with pytest.raises(TypeError, match="reserved"):
        @eventbus.event_type("TEST_RESERVED")
        class Reserved(Event):
            data: int  # type: ignore[assignment]
    with pytest.raises(ValueError, match="must start with"):
        eventbus.event_type("has space")
    assert "TEST_BAD_FIELD" not in eventbus.event_types()


def test_event_types_lists_built_ins_and_declared() -> None:
    """event_types() maps every known name to its class."""
    types = eventbus.event_types()
    assert types["WORKER_EXIT"] is WorkerExit
    assert types["CHECKPOINT_SAVED"] is CheckpointSaved
    assert types["TEST_LOSS_SPIKE"] is LossSpike
    assert eventbus.event_class("EPOCH_END") is EpochEnd
    assert math.isfinite(EpochEnd(epoch=0).timestamp)


def test_signal_name_names_negative_exit_codes_and_numbers_unnamed_ones() -> None:
    """signal_name: -9 -> "SIGKILL"; a number with no name -> "SIG<n>"; >= 0 -> None."""
    import signal

    assert eventbus.signal_name(-9) == "SIGKILL"
    assert eventbus.signal_name(-int(signal.SIGTERM)) == "SIGTERM"
    unnamed = next(n for n in range(1, 1000) if n not in set(signal.Signals))
    assert eventbus.signal_name(-unnamed) == f"SIG{unnamed}"
    assert eventbus.signal_name(-1000) == "SIG1000"
    assert [eventbus.signal_name(code) for code in (0, 1, 137)] == [None, None, None]


def test_a_validation_error_traceback_shows_the_generated_source_line() -> None:
    """The generated validator/builder/__init__ are in linecache: tracebacks quote them."""
    import traceback

    for attempt in (lambda: eventbus.Bus("tb").record("WORKER_EXIT", worker_id="x",
                                                      exit_code=0),
                    lambda: WorkerExit(worker_id=0, exit_code="1")):
        with pytest.raises(TypeError) as info:
            attempt()
        text = "".join(traceback.format_exception(info.value))
        assert 'File "<eventbus generated WORKER_EXIT eventbus.events.WorkerExit>"' in text
        generated = text.split("eventbus.events.WorkerExit>", 1)[1].splitlines()[1]
        assert "_coerce(_T, " in generated, text
