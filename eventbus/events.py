"""Typed, immutable events: the built-in types and the way users declare their own.

Every event class is an attrs frozen class whose ``__init__`` is generated from its field
declarations (the way attrs generates its own), so that validation is a handful of
``type(x) is int`` checks and building an event sets one ``__dict__``. ``record()`` calls
the generated ``_build`` (validate + construct) or, when nobody listens, ``_check``
(validate only): validation never depends on who listens. Both work on ``record()``'s own
``**fields`` dict, which becomes the event's ``__dict__``; read fields with
``getattr``/``fields()``, as optional fields not given live on the class. The code itself
is written and compiled by eventbus/_codegen.py.
"""

from __future__ import annotations

import builtins
import inspect
import math
import re
import sys
import types
import typing
from collections.abc import Callable
from collections.abc import Mapping
from enum import Enum
from typing import Any
from typing import ClassVar
from typing import TypeVar

import attrs

from eventbus._codegen import _KINDS
from eventbus._codegen import _MISSING
from eventbus._codegen import _ensure_generated
from eventbus._codegen import _generate_lazily
from eventbus.context import JobContext
from eventbus.context import context_from_dict
from eventbus.encoding import LIMITS
from eventbus.encoding import decode_json
from eventbus.encoding import event_line
from eventbus.errors import EventDecodeError
from eventbus.errors import FieldTypeError
from eventbus.errors import FieldValueError
from eventbus.errors import UnknownEventTypeError

__all__ = [
    "AgentExit",
    "AgentStart",
    "Cause",
    "CheckpointSaved",
    "Decision",
    "EpochEnd",
    "EpochStart",
    "Event",
    "EventType",
    "EventsLost",
    "HostEvicted",
    "JobStuck",
    "JobUnstuck",
    "Metric",
    "Preempting",
    "Recovered",
    "Rendezvous",
    "TorchelasticRecord",
    "WorkerExit",
    "WorkerProgress",
    "WorkerRestart",
    "WorkerSlow",
    "WorkerStalled",
    "WorkerStart",
    "event_class",
    "event_type",
    "event_types",
    "signal_name",
]


class EventType(str, Enum):
    """The built-in event types. Members compare and hash equal to their names."""

    WORKER_START = "WORKER_START"
    WORKER_EXIT = "WORKER_EXIT"
    WORKER_RESTART = "WORKER_RESTART"
    RENDEZVOUS = "RENDEZVOUS"
    AGENT_START = "AGENT_START"
    AGENT_EXIT = "AGENT_EXIT"
    EPOCH_START = "EPOCH_START"
    EPOCH_END = "EPOCH_END"
    CHECKPOINT_SAVED = "CHECKPOINT_SAVED"
    #: free-form training metrics (loss, throughput) in ``data``, optionally with a step
    METRIC = "METRIC"
    #: a torchelastic record whose name has no typed counterpart, kept rather than dropped
    TORCHELASTIC = "TORCHELASTIC"
    #: events known to be lost, duplicated or dropped on the way (gaps, full queues)
    EVENTS_LOST = "EVENTS_LOST"
    #: a live worker recorded nothing for longer than the stall timeout
    WORKER_STALLED = "WORKER_STALLED"
    #: a rank's recent steps are much slower than its peers'
    WORKER_SLOW = "WORKER_SLOW"
    #: a worker's progress heartbeat (steps, collectives), sent by the worker bootstrap
    WORKER_PROGRESS = "WORKER_PROGRESS"
    #: a drain started: every rank should save and stop before ``deadline_s`` (preemption)
    PREEMPTING = "PREEMPTING"
    #: a restart is over: every rank of the new attempt completed its first step
    RECOVERED = "RECOVERED"
    #: a node left the job: its host had too many host faults (``--evict-after``)
    HOST_EVICTED = "HOST_EVICTED"
    #: no rank made a step for ``--alert-after`` seconds and no verdict explains it
    JOB_STUCK = "JOB_STUCK"
    #: a rank made a step again after ``JOB_STUCK``
    JOB_UNSTUCK = "JOB_UNSTUCK"

    __str__ = str.__str__
    __format__ = str.__format__  # type: ignore[assignment]


class Decision(str, Enum):
    """What a restart reactor decides about a failed worker group."""

    RESTART = "RESTART"
    STOP = "STOP"

    __str__ = str.__str__
    __format__ = str.__format__  # type: ignore[assignment]


class Cause(str, Enum):
    """Why a worker exited, the group restarted or the job ended: the ``cause`` field of
    ``WORKER_EXIT``, ``WORKER_RESTART`` and ``AGENT_EXIT``, a fact that readers match on
    (the page, ``eventbus tail``, the sinks), never the prose of ``reason`` or ``message``.

    The field is a plain ``str`` (a file written by a newer eventbus may hold a cause this
    one does not know: readers treat an unknown one as ``FAILURE``).
    """

    #: a worker failed by itself (non-zero exit code, or a signal the agent did not send)
    FAILURE = "failure"
    #: the agent judged the group stalled (``WORKER_STALLED``) and stopped it
    STALL = "stall"
    #: a reactor on this node answered ``Decision.STOP``
    STOP = "stop"
    #: a reactor on another node answered ``Decision.STOP`` (the job-wide STOP key)
    REMOTE_STOP = "remote_stop"
    #: the group re-formed through the rendezvous: another node restarted, or nodes joined
    MEMBERSHIP = "membership"
    #: the agent itself raised (torch's agent loop, a rendezvous that failed)
    ERROR = "error"
    #: a drain signal (a scheduler's preemption) drained the job: ``AGENT_EXIT`` state
    #: ``PREEMPTED``, and the workers that did not stop within the grace
    PREEMPTION = "preemption"

    __str__ = str.__str__
    __format__ = str.__format__  # type: ignore[assignment]


_RESERVED = frozenset({"type", "timestamp", "data", "context"})
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:\-]{0,127}$")

#: name -> event class, for built-in and declared types
_REGISTRY: dict[str, type[Event]] = {}
#: called with each newly declared class (the bus adds a signal for it)
_on_declare: list[Callable[[type[Event]], None]] = []


class _GeneratedSource:
    """``cls._source``: reading it generates the class's code if nothing has yet."""

    def __get__(self, obj: object, owner: type[Event]) -> str:
        _ensure_generated(owner)
        source = owner.__dict__.get("_source", "")
        return source if isinstance(source, str) else ""


@attrs.frozen(init=False, slots=False)
class Event:
    """Base class of every event.

    ``type`` (class-level), ``timestamp`` (seconds since the epoch), ``data`` (a dict of
    free-form values: a read-only snapshot, copied at every depth when the event is built;
    see :mod:`eventbus.snapshot`), ``context`` (the :class:`~eventbus.context.JobContext`), plus the
    typed fields of the concrete class. Immutable: assigning an attribute raises
    ``attrs.exceptions.FrozenInstanceError``.
    """

    type: ClassVar[EventType | str]
    #: the typed fields: name -> (python type, optional?)
    _fields: ClassVar[dict[str, tuple[builtins.type, bool]]] = {}
    _failure: ClassVar[Callable[[Any], bool] | None] = None
    # The generated validators (see eventbus._codegen); set on every concrete class.
    _check: ClassVar[Callable[[dict[str, Any]], None]]
    _build: ClassVar[Callable[[dict[str, Any]], Event]]
    #: _build with the sender's timestamp and context (what a receiver decodes)
    _decode: ClassVar[Callable[[dict[str, Any], float, JobContext], Event]]
    #: the generated source of the four, for the curious and for debugging
    _source: ClassVar[str] = _GeneratedSource()  # type: ignore[assignment]
    #: the compiled fast path's description of the class (None: not generated yet, or
    #: eventbus._speedups not built); set by eventbus._codegen on the class itself
    _spec: ClassVar[Any] = None

    timestamp: float
    data: dict[str, Any]
    context: JobContext = attrs.field(repr=False)

    def __init__(self, **fields: Any) -> None:  # replaced on every concrete class
        raise TypeError(
            "Event is abstract: record a concrete type, e.g. "
            "eventbus.record(EventType.WORKER_EXIT, worker_id=0, exit_code=0)"
        )

    # -- the job context, one attribute away ----------------------------------------------
    @property
    def rank(self) -> int | None:
        """Global rank of the process that recorded the event."""
        return self.context.rank

    @property
    def local_rank(self) -> int | None:
        """Local rank of the process that recorded the event."""
        return self.context.local_rank

    @property
    def group_rank(self) -> int | None:
        """Group (node) rank of the process that recorded the event."""
        return self.context.group_rank

    @property
    def world_size(self) -> int | None:
        """World size of the job, as the recording process saw it."""
        return self.context.world_size

    @property
    def run_id(self) -> str | None:
        """The torchelastic run id."""
        return self.context.run_id

    @property
    def restart_count(self) -> int | None:
        """The attempt (restart count) the recording process belongs to."""
        return self.context.restart_count

    @property
    def hostname(self) -> str:
        """Host of the recording process."""
        return self.context.hostname

    @property
    def pid(self) -> int:
        """Pid of the recording process."""
        return self.context.pid

    @property
    def is_failure(self) -> bool:
        """True for events that report a failure (non-zero exit, failed rendezvous, ...)."""
        failure = type(self)._failure
        return bool(failure(self)) if failure is not None else False

    # -- encoding ---------------------------------------------------------------------------
    def fields(self) -> dict[str, Any]:
        """The typed fields of this event, name -> value."""
        # getattr, not __dict__: an optional field not given reads its class-level default
        return {name: getattr(self, name) for name in type(self)._fields}

    def to_dict(self) -> dict[str, Any]:
        """The event as a dict: type, timestamp, typed fields, data, context."""
        out: dict[str, Any] = {"type": str(self.type), "timestamp": self.timestamp}
        for name in type(self)._fields:
            out[name] = getattr(self, name)
        out["data"] = self.data
        out["context"] = self.context.to_dict()
        return out

    def to_json(self) -> str:
        """One line of strict JSON (see :mod:`eventbus.encoding` for limits)."""
        return event_line(self.to_dict())

    @classmethod
    def from_json(cls, text: str | bytes | bytearray) -> Event:
        """The typed event encoded in ``text``, validated.

        Raises ``ValueError`` for malformed JSON or an unknown type and ``TypeError`` for a
        field of the wrong type. Never unpickles, never raises ``RecursionError``.
        """
        try:
            raw = decode_json(text)
        except ValueError as exc:
            raise EventDecodeError(f"not an event: {exc}") from None
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: object) -> Event:
        """The typed event described by a dict as :meth:`to_dict` makes it, validated."""
        if not isinstance(raw, dict):
            raise EventDecodeError(f"an event is a JSON object, got {type(raw).__name__}")
        name = raw.get("type")
        if type(name) is not str:
            raise EventDecodeError("an event needs a string 'type'")
        target = _REGISTRY.get(name)
        if target is None:
            raise UnknownEventTypeError(name, sorted(_REGISTRY))
        if cls is not Event and not issubclass(target, cls):
            raise EventDecodeError(f"expected a {cls.__name__} event, got {name}")
        fields = {k: v for k, v in raw.items() if k != "type"}
        for key, value in fields.items():
            # to_json() writes such an int as a summary, which could not decode back
            if type(value) is int and value.bit_length() > LIMITS.max_int_digits * 3.33:
                raise FieldValueError(name, str(key), f"an int of more than "
                                      f"{LIMITS.max_int_digits} digits is not accepted")
        timestamp = fields.pop("timestamp", _MISSING)
        if timestamp is _MISSING:
            raise EventDecodeError(f"{name} event has no 'timestamp'")
        if type(timestamp) not in (int, float) or not math.isfinite(timestamp):
            raise FieldTypeError(name, "timestamp", "a finite number", timestamp)
        context = context_from_dict(fields.pop("context", {}))
        data = fields.pop("data", None)
        if data is not None and type(data) is not dict:
            raise FieldTypeError(name, "data", "an object", data)
        return target(**fields, data=data, timestamp=float(timestamp), context=context)


E = TypeVar("E", bound=type[Event])




def _field_kind(type_name: str, name: str, hint: Any) -> tuple[type, bool]:
    optional = False
    args = typing.get_args(hint)
    origin = typing.get_origin(hint)
    if origin is typing.Union or (hasattr(types, "UnionType") and origin is types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and len(args) == 2:
            hint, optional = rest[0], True
    if hint in _KINDS:
        return hint, optional
    raise TypeError(
        f"{type_name}.{name}: field type {hint!r} is not supported; typed fields are int, "
        f"float, str, bool or one of them | None. Put structured values in data={{...}}"
    )


#: annotation strings read without ``typing.get_type_hints`` (see _simple_hints)
_SIMPLE_HINTS: dict[str, Any] = {
    **{kind.__name__: kind for kind in _KINDS},
    **{f"{kind.__name__} | None": kind | None for kind in _KINDS},
}


def _simple_hints(cls: type, own: dict[str, Any]) -> dict[str, Any] | None:
    """The hints of ``own`` when each is one of the typed-field spellings (``int``,
    ``str | None``, ...) naming the builtins, else None (use ``typing.get_type_hints``).

    ``get_type_hints`` walks the whole class hierarchy and compiles every string
    annotation it meets, Event's own included: for the built-in types that was most of
    ``import eventbus``. A name the class's module rebinds (``int = ...``) takes the slow
    path, so the result is always what ``get_type_hints`` would say.
    """
    module = sys.modules.get(cls.__module__)
    scope = vars(module) if module is not None else {}
    hints: dict[str, Any] = {}
    for name, annotation in own.items():
        if type(annotation) is not str:
            return None
        hint = _SIMPLE_HINTS.get(annotation)
        if hint is None:
            return None
        base = annotation.split(" ", 1)[0]
        if scope.get(base, _MISSING) is not _MISSING or base in vars(cls):
            return None
        hints[name] = hint
    return hints


def event_type(
    name: str | EventType,
    *,
    failure: Callable[[Any], bool] | None = None,
) -> Callable[[E], E]:
    """Declare an event type from a class of annotated fields.

    >>> @event_type("LOSS_SPIKE")
    ... class LossSpike(Event):
    ...     step: int
    ...     loss: float
    ...     note: str | None = None

    Then ``record("LOSS_SPIKE", step=3, loss=9.5)`` (or ``record(LossSpike, ...)``) and
    ``subscribe("LOSS_SPIKE", on_event=...)`` work exactly as for the built-ins. Typed
    fields are ``int``, ``float``, ``str``, ``bool`` or ``X | None``; ``failure`` is a
    predicate that makes the logging bridge report the event at ERROR.
    """
    type_name = str(name)
    if not isinstance(name, EventType) and type_name in EventType.__members__:
        name = EventType(type_name)
    if not _NAME_RE.match(type_name):
        raise ValueError(
            f"event type name {type_name!r} must start with a letter or '_' and contain only "
            "letters, digits and _.:- (at most 128 characters)"
        )

    def declare(cls: E) -> E:
        if not (isinstance(cls, type) and issubclass(cls, Event)):
            raise TypeError(f"@event_type({type_name!r}) decorates a subclass of eventbus.Event")
        existing = _REGISTRY.get(type_name)
        if existing is not None:
            raise ValueError(
                f"event type {type_name!r} is already declared by "
                f"{existing.__module__}.{existing.__qualname__}; pick another name"
            )
        own = inspect.get_annotations(cls)
        hints = _simple_hints(cls, own)
        if hints is None:
            hints = typing.get_type_hints(cls)
        fields: dict[str, tuple[type, bool]] = {}
        defaults: dict[str, Any] = {}
        for fname in own:
            hint = hints[fname]
            if typing.get_origin(hint) is ClassVar or hint is ClassVar:
                continue
            if fname in _RESERVED or fname.startswith("_"):
                raise TypeError(
                    f"{type_name}.{fname}: the name is reserved; pick another field name"
                )
            if hasattr(Event, fname):
                raise TypeError(f"{type_name}.{fname}: the name is taken by Event.{fname}")
            fields[fname] = _field_kind(type_name, fname, hint)
            if fname in cls.__dict__:
                defaults[fname] = cls.__dict__[fname]
            elif defaults:
                raise TypeError(f"{type_name}.{fname}: a field without a default follows one "
                                "with a default")
        new_cls = attrs.frozen(init=False, slots=False)(cls)
        new_cls.type = name
        new_cls._fields = fields
        if failure is not None:
            new_cls._failure = staticmethod(failure)
        _generate_lazily(new_cls, type_name, fields, defaults)
        _REGISTRY[type_name] = new_cls
        for hook in list(_on_declare):
            hook(new_cls)
        return new_cls

    return declare


def event_class(event_type: EventType | str | type[Event]) -> type[Event]:
    """The event class of a type (a member, its name, or the class itself)."""
    if isinstance(event_type, type):
        if issubclass(event_type, Event) and event_type in _REGISTRY.values():
            return event_type
        raise UnknownEventTypeError(event_type, sorted(_REGISTRY))
    try:
        return _REGISTRY[event_type]
    except (KeyError, TypeError):
        raise UnknownEventTypeError(event_type, sorted(_REGISTRY)) from None


def event_types() -> dict[str, type[Event]]:
    """Every known event type, name -> class (built-ins first, then declared ones)."""
    return dict(_REGISTRY)


# -- the built-in types --------------------------------------------------------------------


@event_type(EventType.WORKER_START)
class WorkerStart(Event):
    """A worker process started. ``worker_id`` is its global rank."""

    worker_id: int
    worker_local_rank: int | None = None
    worker_pid: int | None = None


@event_type(EventType.WORKER_EXIT, failure=lambda e: e.exit_code != 0)
class WorkerExit(Event):
    """A worker process ended. ``worker_id`` is its global rank; non-zero exit = failure."""

    worker_id: int
    exit_code: int
    worker_local_rank: int | None = None
    worker_pid: int | None = None
    #: the signal that ended the worker (e.g. "SIGKILL"), if one did: see signal_name()
    signal: str | None = None
    #: the error message from the worker's error file, when there is one
    message: str | None = None
    #: why it ended, a :class:`Cause` value: ``"failure"`` for its own failure; for a
    #: worker the agent stopped (``data["stopped_by_agent"]``), what made it stop the group
    #: (``"failure"`` of another rank, ``"stall"``, ``"remote_stop"``); None when it
    #: succeeded
    cause: str | None = None


def signal_name(exit_code: int) -> str | None:
    """The name of the signal that ended a process, from its exit code; None if none did.

    A negative exit code ``-n`` means "killed by signal ``n``" (the convention of
    ``subprocess``, ``multiprocessing`` and torch's elastic agent), named as the ``signal``
    module names it: ``signal_name(-9) == "SIGKILL"``. A signal number with no name on this
    platform (a real-time signal, say) is ``"SIG<n>"``, e.g. ``signal_name(-40) == "SIG40"``,
    so that ``WorkerExit.signal`` is always either None or a string starting with ``SIG``,
    whichever path (the launcher's agent, the torchelastic bridge) recorded it. Zero and
    positive exit codes are None.
    """
    if exit_code >= 0:
        return None
    # Imported here: `import eventbus` does not load `signal`; only exits need it.
    import signal

    number = -exit_code
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"SIG{number}"


@event_type(EventType.WORKER_RESTART)
class WorkerRestart(Event):
    """The agent restarts its worker group; ``attempt`` is the new attempt's number."""

    attempt: int
    restarts_left: int | None = None
    #: the sentence of what caused it, for people (:class:`Cause` is the fact to match on)
    reason: str | None = None
    #: a :class:`Cause` value: ``"failure"``, ``"stall"`` or ``"membership"``
    cause: str | None = None


@event_type(EventType.RENDEZVOUS, failure=lambda e: e.state == "FAILED")
class Rendezvous(Event):
    """A rendezvous round finished (or failed), with how long it took."""

    state: str = "SUCCEEDED"
    name: str | None = None
    duration_s: float | None = None
    message: str | None = None


@event_type(EventType.AGENT_START)
class AgentStart(Event):
    """The elastic agent started."""

    entrypoint: str | None = None
    max_restarts: int | None = None
    nproc_per_node: int | None = None


@event_type(EventType.AGENT_EXIT, failure=lambda e: e.state != "SUCCEEDED")
class AgentExit(Event):
    """The elastic agent finished; ``state`` is the worker group's final state."""

    state: str
    exit_code: int | None = None
    #: the sentence of why the job ended so, for people (:class:`Cause` is the fact)
    reason: str | None = None
    #: a :class:`Cause` value when the job did not succeed: ``"failure"``, ``"stall"``
    #: (restarts used up), ``"stop"``, ``"remote_stop"`` (a reactor's STOP), ``"error"``
    cause: str | None = None


@event_type(EventType.EPOCH_START)
class EpochStart(Event):
    """A training epoch started."""

    epoch: int


@event_type(EventType.EPOCH_END)
class EpochEnd(Event):
    """A training epoch ended."""

    epoch: int


@event_type(EventType.CHECKPOINT_SAVED)
class CheckpointSaved(Event):
    """A checkpoint was written to ``path``."""

    path: str
    epoch: int | None = None
    step: int | None = None
    #: seconds the save took (the goodput's checkpoint time)
    duration_s: float | None = None


@event_type(EventType.METRIC)
class Metric(Event):
    """Training metrics (loss, throughput, ...) in ``data``, at an optional step."""

    step: int | None = None


@event_type(EventType.TORCHELASTIC)
class TorchelasticRecord(Event):
    """A torchelastic event record with no typed counterpart; its metadata is in ``data``."""

    name: str
    source: str | None = None


@event_type(EventType.EVENTS_LOST, failure=lambda e: True)
class EventsLost(Event):
    """Events lost, duplicated or dropped on the way, found by a sequence gap or a full queue."""

    source: str
    count: int
    reason: str


# -- the agent's job-health reports: stalls and stragglers --------------------------------


@event_type(EventType.WORKER_STALLED, failure=lambda e: True)
class WorkerStalled(Event):
    """A live worker recorded no event for longer than the stall timeout.

    ``worker_id`` is its global rank, ``silent_s`` how long it had been silent when the
    agent noticed. The agent puts every thread's Python stack of the worker in
    ``data["stack"]`` (and its node peers' in ``data["peer_stacks"]``, rank -> text).
    """

    worker_id: int
    silent_s: float
    #: the timeout that was exceeded (the learned one with ``--stall-timeout auto``)
    timeout_s: float | None = None
    worker_local_rank: int | None = None
    worker_pid: int | None = None


@event_type(EventType.WORKER_SLOW)
class WorkerSlow(Event):
    """A rank's recent step time is ``factor`` times its peers' median (a straggler).

    Reporting only: the job goes on; reactors may act on it.
    """

    worker_id: int
    #: the rank's step time over its peers' median step time
    factor: float
    step_time_s: float | None = None
    median_step_time_s: float | None = None
    step: int | None = None


@event_type(EventType.PREEMPTING)
class Preempting(Event):
    """A drain of the whole job started (``eventbus run``'s drain signals: a scheduler is
    about to take a node). Every rank should save its checkpoint and stop within
    ``deadline_s`` seconds (the time left of the grace when the event was made); after
    that the agents forward the signal to the workers still running, then kill them.

    ``reason`` says why, for people ("SIGTERM on node 1"); ``signal`` is the signal's name,
    ``node`` the group rank of the agent that received it, ``grace_s`` the whole grace.
    Training code hears it on its default bus (``eventbus.preemption.should_stop()`` is
    the way to act on it at the same step on every rank).
    """

    deadline_s: float
    reason: str
    signal: str | None = None
    node: int | None = None
    grace_s: float | None = None


@event_type(EventType.RECOVERED)
class Recovered(Event):
    """A restart is over: every rank of attempt ``attempt`` completed its first step,
    ``total_s`` seconds after the failure (or the stall verdict) that caused it.

    ``phases`` (``data["phases"]``): seconds per phase of the restart, in order:
    ``detect`` (the failure seen to the decision), ``stop`` (the survivors gone),
    ``rendezvous``, ``start`` (the new processes to the script's first line), ``import``
    (to ``import torch`` done), ``init`` (to the process group ready), ``restore``
    (checkpoint loads), ``first_step``; None for a phase that could not be seen.
    """

    attempt: int
    total_s: float

    @property
    def phases(self) -> dict[str, float | None]:
        """``data["phases"]``: seconds per phase (None: not seen)."""
        found = self.data.get("phases")
        return dict(found) if isinstance(found, Mapping) else {}


@event_type(EventType.HOST_EVICTED)
class HostEvicted(Event):
    """A node leaves the job because its host is bad: ``faults`` host faults (a kind each:
    ``signal``, ``oom``, ``cuda``, ``nccl``, ``ecc``, ``hang``, ``straggler``, ``reactor``)
    were counted against ``host`` in this job, at least ``--evict-after``. ``reason`` says
    it for people ("2 host faults: SIGSEGV, NCCL error"). Published by that node's agent
    and forwarded to every node; its agent then exits with the bad-host exit code.
    """

    host: str
    faults: int
    reason: str


@event_type(EventType.JOB_STUCK)
class JobStuck(Event):
    """No rank made a step (an optimizer step, a collective, a ``METRIC`` step) for
    ``silent_s`` seconds, at least ``after_s`` (``eventbus run --alert-after``), and no
    verdict explains it: no stall, failure, restart or drain in that time. ``step``: the
    highest step seen (the script's own ``METRIC`` steps, else the optimizer steps the
    heartbeats counted). ``data["places"]``: the ranks' last known places from their
    heartbeats, grouped: a list of ``{"where", "ranks", "hosts", "step", "idle_s"}``
    (``where`` is ``FILE:LINE`` or null), the smallest groups first; ``data["ranks"]``:
    how many ranks that covers. Published by group rank 0's agent (docs/sinks.md).
    """

    silent_s: float
    after_s: float
    step: int | None = None


@event_type(EventType.JOB_UNSTUCK)
class JobUnstuck(Event):
    """A rank made a step again after ``JOB_STUCK``: ``stuck_s`` seconds without one in
    all; ``step``: the step it made, ``worker_id``: the rank that made it (when known)."""

    stuck_s: float
    step: int | None = None
    worker_id: int | None = None


@event_type(EventType.WORKER_PROGRESS)
class WorkerProgress(Event):
    """A worker's progress heartbeat, recorded by the bootstrap's progress watch
    (eventbus_app/worker/progress.py) with no call in the training script.

    ``worker_id`` is the global rank; ``step`` the optimizer steps taken in the process
    (torch's global optimizer step hook); ``collectives`` the sum over process groups of the
    last completed collective (torch's flight recorder; ``None`` when it is off); ``idle_s``
    the seconds, on the worker's own clock, since the rank last made progress. ``data``
    may hold ``pgs``, ``pending``, ``compute_s``, ``wait_s``, ``step_time_s``, ``where``,
    ``stack``, ``sources`` and ``fr_dump`` (docs/events.md). Logged at DEBUG: a heartbeat
    prints no console line unless asked for (subscribers/log_handler.py).
    """

    worker_id: int
    step: int | None = None
    collectives: int | None = None
    idle_s: float = 0.0
