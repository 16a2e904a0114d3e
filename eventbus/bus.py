"""The bus: one blinker signal per event type, dispatched from a per-type snapshot.

Blinker holds the connections (a subscription is a receiver connected to its type's
signal, or to the every-type signal). Whenever a signal's receivers change, the bus
rebuilds that type's snapshot, a plain tuple of callables in subscription order, and
``record()`` walks the tuple. That keeps blinker's connection model and its public
``Signal`` objects while paying neither for ``Signal.send``'s per-receiver bookkeeping nor
for a lock on the hot path.

Delivery semantics (pinned by tests/test_bus.py):

* in the publishing thread, in subscription order, each subscriber at most once per event;
* a raising subscriber never stops the others nor makes ``record()`` raise: it is counted
  and reported on the ``eventbus`` logger with its traceback, rate-limited (``strict=True``
  re-raises instead, for tests);
* subscribe and cancel during a dispatch take effect from the next event;
* ``record()`` from inside a subscriber works (no lock is held while dispatching);
* subscribers are held strongly.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import threading
import traceback
import types
import weakref
from collections.abc import Callable
from collections.abc import Iterator
from typing import TYPE_CHECKING
from typing import Any

import attrs
import blinker

from eventbus._codegen import _on_generate
from eventbus._compiled import speedups as _speedups
from eventbus.events import _REGISTRY
from eventbus.events import Event
from eventbus.events import EventType
from eventbus.events import _on_declare
from eventbus.events import event_class

if TYPE_CHECKING:
    from eventbus._reporting import RateLimiter

__all__ = ["ALL", "Bus", "Subscription", "get_default_bus", "publish", "record"]

#: the logger that failures are reported on (logging itself is imported when one is:
#: ``import eventbus`` does not load it)
_LOGGER_NAME = "eventbus"

EventTypeLike = EventType | str | type[Event]
Handler = Callable[[Event], object]


class _All:
    """The every-type marker: ``subscribe(ALL, on_event=...)``."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "ALL"


ALL: Any = _All()

#: at most one failure report per subscriber per this many seconds
REPORT_INTERVAL_S = 10.0


def _count_value(counter: itertools.count[int]) -> int:
    # itertools.count is the one counter whose increment is atomic under the GIL;
    # its repr is the only portable way to read it without advancing it.
    return int(repr(counter)[6:-1])


def _direct_callable(on_event: Handler) -> Handler:
    """``on_event``, or, for an instance of a class with a Python ``__call__`` (a
    ``QueuedSink``, say), that method bound to the instance.

    Why: calling such an instance goes through its type's call slot, which looks the
    method up and builds an argument tuple on every event (~100 ns on 3.11, a tenth of a
    ``record()`` to a queued sink); the bound method is a direct call. Python looks
    ``__call__`` up on the class, never the instance, and so does this, once.
    """
    direct = getattr(type(on_event), "_eventbus_direct", None)
    if callable(direct):  # a queued sink's compiled enqueue (subscribers/queued.py)
        fast: Handler = direct(on_event)
        return fast
    for klass in type(on_event).__mro__:
        call = klass.__dict__.get("__call__")
        if call is not None:
            if isinstance(call, types.FunctionType):
                bound: Handler = types.MethodType(call, on_event)
                return bound
            break
    return on_event


class Subscription:
    """One subscriber of a bus. ``cancel()`` stops delivery; calling it again does nothing."""

    __slots__ = (
        "__weakref__",
        "_bus",
        "_dispatch",
        "_failed",
        "_filtered",
        "_published_at_start",
        "_reports",
        "active",
        "event_type",
        "name",
        "on_event",
        "once",
        "seq",
        "where",
    )

    def __init__(self, bus: Bus, event_type: Any, on_event: Handler, *, once: bool,
                 where: Callable[[Event], object] | None, seq: int) -> None:
        self._bus = bus
        self.event_type = event_type
        self.on_event = on_event
        self.once = once
        self.where = where
        self.seq = seq
        self.active = True
        self.name = _callable_name(on_event)
        self._failed = 0
        self._filtered = itertools.count()
        #: the failure reports' rate limit, made on the first failure (most never fail)
        self._reports: RateLimiter | None = None
        self._published_at_start = 0
        self._dispatch: Handler = self._make_dispatch()

    def _make_dispatch(self) -> Handler:
        on_event, where = _direct_callable(self.on_event), self.where
        if not self.once and where is None:
            return on_event
        filtered = self._filtered
        if not self.once and where is not None:
            def deliver_where(event: Event) -> object:
                if where(event):
                    return on_event(event)
                next(filtered)
                return None
            return deliver_where
        fired = itertools.count()

        def deliver_once(event: Event) -> object:
            if where is not None and not where(event):
                next(filtered)
                return None
            if next(fired):  # atomic: only the first caller sees 0
                next(filtered)
                return None
            self.cancel()
            return on_event(event)
        return deliver_once

    def __call__(self, event: Event) -> object:
        """Deliver ``event`` as the bus would (the blinker receiver protocol: sender=event)."""
        return self._dispatch(event)

    def cancel(self) -> None:
        """Stop delivery from the next event on. Idempotent."""
        if not self.active:
            return
        self.active = False
        self._bus._disconnect(self)

    def stats(self) -> dict[str, Any]:
        """Delivered, failed and filtered counts of this subscription."""
        return self._bus._subscription_stats(self)

    def __repr__(self) -> str:
        state = "active" if self.active else "cancelled"
        return f"<Subscription {self.name} to {self.event_type!s} ({state})>"


def _queue_stats(on_event: object) -> dict[str, Any]:
    """``dropped`` and ``pending`` of a subscriber that queues: one whose ``stats()``
    returns a mapping with ``dropped`` (reason -> count) and ``pending`` (QueuedSink,
    JsonlRecorder, ...)."""
    stats = getattr(on_event, "stats", None)
    if callable(stats) and not isinstance(on_event, Subscription):
        try:
            raw = stats()
            dropped = raw["dropped"]
            return {"dropped": {str(k): int(v) for k, v in dropped.items()},
                    "pending": int(raw["pending"]), "sink": dict(raw)}
        except Exception:  # not such a subscriber after all
            pass
    return {"dropped": {}, "pending": 0}


def _published(slot: _Slot) -> int:
    """Events published on a slot: the Python path's count plus the compiled path's."""
    view = slot.view
    return _count_value(slot.published) + (view.count if view is not None else 0)


def _callable_name(fn: object) -> str:
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if name is None:
        return repr(fn)
    module = getattr(fn, "__module__", None)
    return f"{module}.{name}" if module else str(name)


@attrs.define(slots=True)
class _Slot:
    """Everything the bus keeps for one event type: what ``record()`` reads, one attribute
    each."""

    event_cls: type[Event]
    signal: blinker.Signal
    #: the dispatch snapshot: (callables, subscriptions), rebuilt on connect/disconnect
    snapshot: tuple[tuple[Handler, ...], tuple[Any, ...]] = ((), ())
    #: ``snapshot[0]``, the tuple ``record()`` walks (replaced whole, never mutated)
    calls: tuple[Handler, ...] = ()
    #: events published; ``next()`` on an itertools.count is atomic under the GIL
    published: itertools.count[int] = attrs.field(factory=itertools.count)
    #: the event class's generated validator and builder (see eventbus._codegen._generate)
    check: Callable[[dict[str, Any]], None] = attrs.field(init=False)
    build: Callable[[dict[str, Any]], Event] = attrs.field(init=False)

    #: what the compiled record() reads of this slot (an eventbus._speedups.View: the
    #: class's compiled description and ``calls``), or None where it is not built
    view: Any = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        self.check = self.event_cls._check
        self.build = self.event_cls._build
        if _speedups is not None:
            self.view = _speedups.View(
                slot=self, spec=self.event_cls.__dict__.get("_spec"), calls=self.calls,
                published=self.published)


class Bus:
    """An event bus. Most code uses the default one through :func:`record` and
    ``eventbus.publishers.get_default_event_publisher()``; tests and embedders may make their own.
    """

    def __init__(self, name: str = "default", *, strict: bool = False) -> None:
        self.name = name
        #: re-raise subscriber exceptions out of ``record()`` (for tests)
        self.strict = strict
        self._lock = threading.RLock()
        self._seq = itertools.count()
        self._slots: dict[Any, _Slot] = {}
        #: the compiled record()'s own index: the same keys, each slot's view
        self._views: dict[Any, Any] = {}
        self._all_signal = blinker.Signal(f"eventbus.{name}.ALL")
        self._all_signal.receiver_connected.connect(self._on_all_changed, weak=False)
        self._all_signal.receiver_disconnected.connect(self._on_all_changed, weak=False)
        self._foreign_seq: dict[int, int] = {}
        self._reporting = threading.local()
        self._fallback_used = False
        # Registered before the slots are made: a type declared meanwhile reaches this bus
        # through _declared() (adding a slot twice is a no-op). The registry holds the bus
        # weakly: a bus a test makes and drops is collected (module-level lists of bound
        # methods kept every bus ever made alive).
        _all_buses.add(self)
        for cls in list(_REGISTRY.values()):
            self._add_slot(cls)
        # The compiled record() and publish(): the common case in C, anything else handed
        # to the methods below with the same arguments (so the same results and errors).
        # A subscriber's failure goes to the same handler as on the Python path, handed
        # over here (the compiled code looks up no private name). A subclass that
        # overrides record() or publish() keeps its own.
        if _speedups is not None and type(self).record is Bus.record:
            self.record = _speedups.Recorder(  # type: ignore[method-assign]
                self, self._views, Bus.record, self._failed)
        if _speedups is not None and type(self).publish is Bus.publish:
            self.publish = _speedups.Publisher(  # type: ignore[method-assign]
                self, self._views, Bus.publish, self._failed)

    # -- slots and snapshots ------------------------------------------------------------
    def _add_slot(self, cls: type[Event]) -> None:
        with self._lock:
            name = str(cls.type)
            if name in self._slots:
                return
            signal = blinker.Signal(f"eventbus.{self.name}.{name}")
            slot = _Slot(cls, signal)
            signal.receiver_connected.connect(self._on_type_changed, weak=False)
            signal.receiver_disconnected.connect(self._on_type_changed, weak=False)
            # One dict lookup serves a member, its name and the class alike. The member goes
            # in first, so that it is the stored key: record(EventType.X, ...) then hits by
            # identity instead of comparing a str subclass with a str.
            self._slots[cls.type] = slot
            self._slots[cls] = slot
            if slot.view is not None:
                self._views[cls.type] = slot.view
                self._views[cls] = slot.view
            self._refresh(slot)

    def _generated(self, cls: type[Event]) -> None:
        # An event class's code is generated on first use: call it directly from now on.
        slot = self._slots.get(cls)
        if slot is not None and slot.event_cls is cls:
            slot.check = cls._check
            slot.build = cls._build
            if slot.view is not None:
                slot.view.spec = cls.__dict__.get("_spec")

    def _slot(self, event_type: Any) -> _Slot:
        try:
            return self._slots[event_type]
        except (KeyError, TypeError):
            pass
        cls = event_class(event_type)  # raises UnknownEventTypeError
        self._add_slot(cls)
        return self._slots[cls]

    def signal(self, event_type: EventTypeLike) -> blinker.Signal:
        """The blinker signal of a type. Receivers connected to it directly are called as
        ``receiver(event)`` by ``record()`` too (and held strongly)."""
        return self._slot(event_type).signal

    def _on_type_changed(self, signal: blinker.Signal, **_: Any) -> None:
        with self._lock:
            for key, slot in self._slots.items():
                if slot.signal is signal and isinstance(key, str):
                    self._refresh(slot)

    def _on_all_changed(self, signal: blinker.Signal, **_: Any) -> None:
        with self._lock:
            for key, slot in self._slots.items():
                if isinstance(key, str):
                    self._refresh(slot)

    def _receivers(self, signal: blinker.Signal) -> Iterator[tuple[int, Any]]:
        for receiver_id, receiver in list(signal.receivers.items()):
            target = receiver() if isinstance(receiver, _weakref_types) else receiver
            if target is None:
                continue
            seq = target.seq if isinstance(target, Subscription) else \
                self._foreign_seq.setdefault(receiver_id, next(self._seq))
            yield seq, target

    def _refresh(self, slot: _Slot) -> None:
        entries = sorted([*self._receivers(slot.signal), *self._receivers(self._all_signal)],
                         key=lambda pair: pair[0])
        subs = tuple(target for _, target in entries)
        calls = tuple(t._dispatch if isinstance(t, Subscription) else t for t in subs)
        slot.snapshot = (calls, subs)
        slot.calls = calls
        if slot.view is not None:
            slot.view.calls = calls

    # -- subscribing ----------------------------------------------------------------------
    def subscribe(self, event_type: EventTypeLike, *, on_event: Handler, once: bool = False,
                  where: Callable[[Event], object] | None = None) -> Subscription:
        """Call ``on_event(event)`` for each later event of ``event_type`` (``ALL``: every
        type), in subscription order, in the publishing thread."""
        if not callable(on_event):
            raise TypeError(f"on_event must be callable, got {type(on_event).__name__}")
        if where is not None and not callable(where):
            raise TypeError(f"where must be a predicate (callable), got {type(where).__name__}")
        with self._lock:
            if event_type is ALL:
                signal = self._all_signal
                key: Any = ALL
            else:
                slot = self._slot(event_type)
                signal = slot.signal
                key = slot.event_cls.type
            sub = Subscription(self, key, on_event, once=once, where=where,
                               seq=next(self._seq))
            sub._published_at_start = self._published_for(key)
            signal.connect(sub, weak=False)
        return sub

    def _disconnect(self, sub: Subscription) -> None:
        with self._lock:
            signal = self._all_signal if sub.event_type is ALL else \
                self._slot(sub.event_type).signal
            signal.disconnect(sub)

    def subscriptions(self) -> list[Subscription]:
        """Every active subscription, in subscription order."""
        with self._lock:
            seen: dict[int, Subscription] = {}
            for signal in [self._all_signal, *(s.signal for s in self._unique_slots())]:
                for _, target in self._receivers(signal):
                    if isinstance(target, Subscription):
                        seen[id(target)] = target
            return sorted(seen.values(), key=lambda s: s.seq)

    def _unique_slots(self) -> list[_Slot]:
        return [slot for key, slot in self._slots.items() if isinstance(key, str)]

    # -- publishing ---------------------------------------------------------------------
    def record(self, event_type: EventTypeLike, /, **fields: Any) -> None:
        """Publish a typed, validated event on this bus (``eventbus.record`` is the
        default bus's).

        ``event_type`` is an :class:`EventType` member, its name, a declared type's name or
        class. An unknown field raises ``TypeError`` naming it, a wrongly typed one
        ``TypeError``/``ValueError`` naming it, an unknown type ``ValueError``; a failing
        subscriber never makes ``record()`` raise. The event is built only when someone
        listens; validation never depends on who listens.
        """
        # The hot path where eventbus/_speedups.c is not built (where it is, its Recorder
        # stands in for this method and hands it only the unusual calls).
        # ``fields`` is this call's own dict: the generated validator may coerce values in
        # it and the builder turns it into the event's __dict__, so nothing is copied twice.
        try:
            slot = self._slots[event_type]
        except (KeyError, TypeError):  # a name to resolve, or not a type at all
            slot = self._slot(event_type)
        calls = slot.calls  # the snapshot: (un)subscribing meanwhile affects the next event
        if not calls:
            slot.check(fields)  # nobody listens: validate, build nothing
            next(slot.published)
            return
        self._deliver(slot, calls, slot.build(fields))

    def publish(self, event: Event) -> None:
        """Publish an event built elsewhere (decoded from a worker, bridged from torch).

        The event is published as it is: every event is already a snapshot, since its
        constructor (like ``record()``) snapshots ``data`` (see eventbus/snapshot.py)."""
        try:
            slot = self._slots[type(event)]
        except KeyError:
            if not isinstance(event, Event):
                raise TypeError(f"publish() takes an eventbus Event, got "
                                f"{type(event).__name__}") from None
            slot = self._slot(type(event))
        self._deliver(slot, slot.calls, event)

    def _deliver(self, slot: _Slot, calls: tuple[Handler, ...], event: Event) -> None:
        """Count ``event`` and hand it to each of ``calls`` (the snapshot the caller read),
        in order: the one delivery loop of ``record()`` and ``publish()``.

        A call, not a copy written out in each: on 3.11 the call costs 1-4% of a pure-Python
        ``record()`` to 1 or 10 subscribers (interleaved medians), and the compiled path
        does not come here at all. Its compiled copy is ``deliver()`` in
        eventbus/_speedups.c; tests/test_bus.py drives both with the same subscribers.
        """
        next(slot.published)
        for call in calls:
            try:
                call(event)
            except Exception as exc:
                self._failed(slot, call, event, exc)

    def deliveries(self, event: Event) -> list[tuple[Any, Callable[[], None]]]:
        """``event``'s delivery, one call per subscriber, for a caller that runs each on a
        thread of its own (the worker's job-wide notices: a subscriber that blocks then
        delays only itself). Each item is (the subscription, or a foreign receiver; a
        function that delivers ``event`` to it alone, a failure handled as
        :meth:`publish` handles it). The event counts as published once, now."""
        try:
            slot = self._slots[type(event)]
        except KeyError:
            slot = self._slot(type(event))
        next(slot.published)
        calls, subs = slot.snapshot
        out: list[tuple[Any, Callable[[], None]]] = []
        for call, sub in zip(calls, subs, strict=False):
            def deliver(call: Handler = call) -> None:
                try:
                    call(event)
                except Exception as exc:
                    self._failed(slot, call, event, exc)
            out.append((sub, deliver))
        return out

    # -- failures -------------------------------------------------------------------------
    def _failed(self, slot: _Slot, call: Handler, event: Event, exc: Exception) -> None:
        calls, subs = slot.snapshot
        sub = None
        for c, s in zip(calls, subs, strict=False):
            if c is call:
                sub = s
                break
        if self.strict:
            raise exc
        if isinstance(sub, Subscription):
            # Imported here, not at the top: the failure path is the only user, and
            # `import eventbus` pays for every module it loads.
            from eventbus._reporting import RateLimiter

            with self._lock:
                sub._failed += 1
                if sub._reports is None:
                    sub._reports = RateLimiter()
                held = sub._reports.allow(REPORT_INTERVAL_S)
            if held is None:
                return
            suppressed, name = held, sub.name
        else:
            suppressed, name = 0, _callable_name(call)
        self._report(name, event, exc, suppressed)

    def _report(self, name: str, event: Event, exc: Exception, suppressed: int) -> None:
        # A handler on the eventbus logger may itself be broken (or may record events):
        # never recurse, and fall back to stderr once.
        if getattr(self._reporting, "active", False):
            return
        self._reporting.active = True
        try:
            more = f" ({suppressed} more failures since the last report)" if suppressed else ""
            import logging

            logging.getLogger(_LOGGER_NAME).error(
                "subscriber %s raised on %s%s; other subscribers still got it",
                name, event.type, more, exc_info=(type(exc), exc, exc.__traceback__))
        except Exception:
            if not self._fallback_used:
                self._fallback_used = True
                with contextlib.suppress(Exception):
                    sys.stderr.write(
                        f"eventbus: subscriber {name} raised on {event.type}, and reporting "
                        f"it on the 'eventbus' logger failed too:\n"
                        + "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
                    )
        finally:
            self._reporting.active = False

    # -- statistics -------------------------------------------------------------------------
    def _published_for(self, key: Any) -> int:
        if key is ALL:
            return sum(_published(s) for s in self._unique_slots())
        return _published(self._slots[key])

    def _subscription_stats(self, sub: Subscription) -> dict[str, Any]:
        seen = self._published_for(sub.event_type) - sub._published_at_start
        filtered = _count_value(sub._filtered)
        return {
            "subscriber": sub.name,
            "event_type": str(sub.event_type),
            "active": sub.active,
            "published": seen,
            "delivered": max(0, seen - sub._failed - filtered) if sub.active or sub.once
            else None,
            "failed": sub._failed,
            "filtered": filtered,
            **_queue_stats(sub.on_event),
        }

    def stats(self) -> dict[str, Any]:
        """Published counts per type, and per active subscription: ``published`` (events
        of its type since it subscribed), ``delivered``, ``failed``, ``filtered``, and for
        a subscriber that queues (``eventbus.subscribers.queued.QueuedSink``) ``dropped`` (per
        reason), ``pending`` and its own ``sink`` stats; ``{}``/``0`` otherwise.

        ``delivered`` counts events handed to the subscriber without an exception since it
        subscribed (events of its type published since, less failures and filtered ones).
        So for each subscription ``published == delivered + failed + filtered``, and for a
        queue ``delivered == sink["handled"] + sink["failed"] + pending + dropped``.
        """
        with self._lock:
            published = {str(slot.event_cls.type): _published(slot)
                         for slot in self._unique_slots()}
            subs = [self._subscription_stats(s) for s in self.subscriptions()]
        return {"published": {k: v for k, v in published.items() if v},
                "subscribers": subs}

    def _after_fork_in_child(self) -> None:
        # A lock held by another thread at fork time would never be released in the child.
        self._lock = threading.RLock()
        self._reporting = threading.local()

    def __repr__(self) -> str:
        return f"<Bus {self.name!r}>"


_weakref_types = (weakref.ref,)

#: every living bus of this process, held weakly: told of each newly declared or generated
#: event class, and reset after a fork
_all_buses: weakref.WeakSet[Bus] = weakref.WeakSet()


def _declared(cls: type[Event]) -> None:
    """A type was declared: every living bus gets its slot."""
    for bus in list(_all_buses):
        bus._add_slot(cls)


def _generated(cls: type[Event]) -> None:
    """A class's code was generated: every living bus calls it directly from now on."""
    for bus in list(_all_buses):
        bus._generated(cls)


# One hook each for all buses, registered once: the core's registries never hold a bus.
_on_declare.append(_declared)
_on_generate.append(_generated)

_default_bus = Bus("default")


def _after_fork_in_child() -> None:
    # Every bus, not only the default one: a bus an embedder made is just as likely to
    # have its lock held by another thread at fork time.
    for bus in list(_all_buses):
        bus._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def get_default_bus() -> Bus:
    """The bus that :func:`record` publishes on."""
    return _default_bus


#: Publish a typed, validated event on the default bus: ``record(event_type, /, **fields)``.
#:
#: The default bus's own ``record``, not a copy of its body: its compiled ``Recorder``
#: where eventbus/_speedups.c is built, else the bound method. The default bus is made once
#: above and never replaced (``get_default_bus()`` has no setter; tests and
#: ``eventbus.testing.strict_bus()`` change its attributes, never the object), so this
#: cannot go stale.
record = _default_bus.record


def publish(event: Event) -> None:
    """Publish an already built event on the default bus."""
    _default_bus.publish(event)
