"""The code of each event class, generated: its validators, its builder and its ``__init__``.

An event class's ``_check`` (validate), ``_build`` (validate and construct), ``_decode``
(the same with the sender's timestamp and context) and ``__init__`` are Python source
written for its own fields, compiled on the class's first use and registered in
``linecache``, so that a traceback through them quotes the generated line (as for attrs'
own generated methods). ``print(WorkerExit._source)`` shows one.

This module writes and compiles that code, and holds the slow paths it calls (coercion,
the errors that name a field). ``eventbus.events`` declares the classes and asks for their
code here; the rule that makes ``data`` a snapshot is eventbus/snapshot.py's, called from
the generated code, and the compiled common case (eventbus/_speedups.c) gets its
description of each class (a ``Spec``) from here too.
"""

from __future__ import annotations

import linecache
import math
import os
import time
from collections.abc import Callable
from collections.abc import Mapping
from typing import TYPE_CHECKING
from typing import Any

from eventbus._compiled import speedups as _speedups
from eventbus.context import JobContext
from eventbus.context import _holder
from eventbus.errors import FieldTypeError
from eventbus.errors import MissingFieldError
from eventbus.errors import UnknownFieldError
from eventbus.snapshot import ATOMIC
from eventbus.snapshot import snapshot_for

if TYPE_CHECKING:
    from eventbus.events import Event

#: the value of a field that was not given
_MISSING: Any = type("_Missing", (), {"__repr__": lambda self: "MISSING"})()
#: the typed fields' Python types, and how an error names each
_KINDS: dict[type, str] = {int: "an int", float: "a float", str: "a string", bool: "a bool"}

#: called with each class whose code was just generated (the bus refreshes its slot)
_on_generate: list[Callable[[type[Event]], None]] = []


def _dict_descriptor(cls: type) -> Any:
    """The ``__dict__`` descriptor of ``cls``'s instances (Event's, for every event class):
    its setter installs a whole ``__dict__``, which a frozen class's setattr refuses."""
    for klass in cls.__mro__:
        descriptor = klass.__dict__.get("__dict__")
        if descriptor is not None and hasattr(descriptor, "__set__"):
            return descriptor
    raise TypeError(f"{cls.__qualname__} instances have no __dict__")


# -- coercion: the slow paths of the generated validators -----------------------------------


def _coerce(event_type: str, name: str, kind: type, value: Any,
            given: Mapping[str, Any] | None = None, allowed: frozenset[str] = frozenset()) -> Any:
    """``value`` as ``kind`` when it is an unambiguous stand-in, else a FieldTypeError."""
    if value is _MISSING:
        if given is not None:
            # A missing field next to an unknown one is most likely a typo: name the typo.
            _unknown_field(event_type, given, allowed)
        raise MissingFieldError(event_type, name, _KINDS[kind])
    if kind is int:
        if isinstance(value, (bool, float)):
            raise FieldTypeError(event_type, name, "an int", value)
        if isinstance(value, int):
            return int(value)
        index = getattr(type(value), "__index__", None)
        if index is not None:  # numpy integers, 0-d integer tensors
            try:
                return int(index(value))
            except Exception:
                pass
    elif kind is float:
        if isinstance(value, bool):
            raise FieldTypeError(event_type, name, "a float", value)
        if isinstance(value, (int, float)):
            return float(value)
        if hasattr(type(value), "__float__") and not isinstance(value, (str, bytes)):
            try:  # numpy floats, 0-d tensors
                return float(value)
            except Exception:
                pass
    elif kind is str:
        if isinstance(value, str):
            return str(value)
        if isinstance(value, os.PathLike):
            path = os.fspath(value)
            if isinstance(path, str):
                return path
    elif kind is bool and type(value).__name__ == "bool_":  # numpy.bool_
        return bool(value)
    raise FieldTypeError(event_type, name, _KINDS[kind], value)


def _coerce_data(event_type: str, value: Any) -> dict[str, Any]:
    if isinstance(value, Mapping):
        return dict(value)
    raise FieldTypeError(
        event_type, "data", "a dict of free-form values (or None)", value
    )


def _unknown_field(event_type: str, given: Mapping[str, Any], allowed: frozenset[str]) -> None:
    for key in given:
        if key not in allowed:
            raise UnknownFieldError(event_type, str(key), sorted(allowed))


def _bad_timestamp(event_type: str, value: Any) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    raise FieldTypeError(event_type, "timestamp", "a finite float (seconds since the epoch)",
                         value)


def _bad_context(event_type: str, value: Any) -> JobContext:
    if isinstance(value, JobContext):
        return value
    raise FieldTypeError(event_type, "context", "an eventbus.JobContext", value)


# -- code generation -----------------------------------------------------------------------
#
# record() hands the generated functions its own ``**fields`` dict ``f``: a fresh dict that
# nobody else holds. ``_check(f)`` validates it (no subscriber: nothing is built);
# ``_build(f)`` validates it and then turns it into the event's ``__dict__``, adding only
# ``timestamp`` and ``context`` (and the read-only snapshot of ``data``: see
# eventbus/snapshot.py). Optional fields that were not given stay out of the dict: their
# defaults are class attributes, so ``event.signal`` still reads ``None``. The common call
# (required fields, maybe ``data``) costs one ``len()`` to prove that no other name was
# given; anything else goes to ``_check_rest``, which is plain Python.


def _check_rest(event_type: str, f: dict[str, Any], optional: dict[str, tuple[type, bool]],
                allowed: frozenset[str]) -> None:
    """The slow path: ``f`` has names besides the required ones and ``data``.

    Unknown names raise first (they are the likeliest typo); then each optional field given
    is checked and, if it is an unambiguous stand-in (a numpy int, a Path), coerced in place.
    """
    _unknown_field(event_type, f, allowed)
    for name, (kind, nullable) in optional.items():
        value = f.get(name, _MISSING)
        if value is _MISSING or value.__class__ is kind or (nullable and value is None):
            continue
        f[name] = _coerce(event_type, name, kind, value)


def _missing(event_type: str, f: dict[str, Any], required: dict[str, type],
             allowed: frozenset[str]) -> None:
    """A required field is not in ``f``: name a typo if there is one, else the missing field."""
    _unknown_field(event_type, f, allowed)
    for name, kind in required.items():
        if name not in f:
            raise MissingFieldError(event_type, name, _KINDS[kind])


#: event types with at most this many optional fields check them inline (else _check_rest)
_INLINE_OPTIONAL = 4


def _generate(cls: type[Event], type_name: str, fields: dict[str, tuple[type, bool]],
              defaults: dict[str, Any]) -> None:
    """Compile ``_check``, ``_build`` and ``__init__`` for one event class.

    For ``WorkerExit`` (required ``worker_id``, ``exit_code``), ``_build`` reads::

        def _build(f):
            try:
                worker_id = f['worker_id']
                exit_code = f['exit_code']
            except KeyError:
                _missing(_T, f, _REQUIRED, _ALLOWED)
            if worker_id.__class__ is not int:
                f['worker_id'] = _coerce(_T, 'worker_id', int, worker_id)
            if exit_code.__class__ is not int:
                f['exit_code'] = _coerce(_T, 'exit_code', int, exit_code)
            others = len(f) - 2
            data = f.get('data')
            if data is None:
                f['data'] = _EMPTY
            else:
                others -= 1
                if data.__class__ is not dict:
                    data = _coerce_data(_T, data)
                f['data'] = _snap(data)
            if others:
                _check_rest(_T, f, _OPTIONAL, _ALLOWED)
            f['timestamp'] = _time()
            f['context'] = _holder.value
            self = _new(_cls)
            _set_dict(self, f)
            return self

    Print ``cls._source`` for any class to see its own.
    """
    allowed = frozenset([*fields, "data"])
    required = {name: kind for name, (kind, _) in fields.items() if name not in defaults}
    optional = {name: spec for name, spec in fields.items() if name in defaults}
    snap, empty = snapshot_for(type_name)
    set_dict = _dict_descriptor(cls)
    env: dict[str, Any] = {
        "_snap": snap,
        "_EMPTY": empty,
        "_T": type_name,
        "_REQUIRED": required,
        "_OPTIONAL": optional,
        "_ALLOWED": allowed,
        "_MISSING": _MISSING,
        "_coerce": _coerce,
        "_coerce_data": _coerce_data,
        "_check_rest": _check_rest,
        "_missing": _missing,
        "_unknown_field": _unknown_field,
        "_bad_timestamp": _bad_timestamp,
        "_bad_context": _bad_context,
        "_holder": _holder,
        "_time": time.time,
        "_new": object.__new__,
        # The __dict__ descriptor's own setter: a frozen class refuses setattr, and this
        # is cheaper than object.__setattr__(self, "__dict__", ...).
        "_set_dict": set_dict.__set__,
        "_JobContext": JobContext,
        "_cls": cls,
        "int": int, "float": float, "str": str, "bool": bool, "dict": dict,
    }
    for name, value in defaults.items():
        env[f"_d_{name}"] = value

    def read_required() -> list[str]:
        if not required:
            return []
        return ["    try:",
                *(f"        {name} = f[{name!r}]" for name in required),
                "    except KeyError:",
                "        _missing(_T, f, _REQUIRED, _ALLOWED)"]

    def check_required(store: bool) -> list[str]:
        lines = []
        for name, kind in required.items():
            target = f"f[{name!r}] = " if store else ""
            lines += [f"    if {name}.__class__ is not {kind.__name__}:",
                      f"        {target}_coerce(_T, {name!r}, {kind.__name__}, {name})"]
        return lines

    rest = ["    if others:"]
    if 0 < len(optional) <= _INLINE_OPTIONAL:
        # Optional fields given (a METRIC's ``step``): checked inline. The count of known
        # names proves that nothing else was given; else _unknown_field names the stranger
        # first, as _check_rest does.
        known = " + ".join(f"({name!r} in f)" for name in optional)
        rest += [f"        if others != {known}:",
                 "            _unknown_field(_T, f, _ALLOWED)"]
        for name, (kind, nullable) in optional.items():
            if nullable:
                rest += [f"        value = f.get({name!r})",
                         f"        if value is not None and value.__class__ is not "
                         f"{kind.__name__}:"]
            else:
                rest += [f"        value = f.get({name!r}, _MISSING)",
                         f"        if value is not _MISSING and value.__class__ is not "
                         f"{kind.__name__}:"]
            rest += [f"            f[{name!r}] = _coerce(_T, {name!r}, {kind.__name__}, value)"]
    else:
        rest += ["        _check_rest(_T, f, _OPTIONAL, _ALLOWED)"]
    check = ["def _check(f):",
             *read_required(),
             *check_required(store=False),
             f"    others = len(f) - {len(required)}",
             "    data = f.get('data')",
             "    if data is not None:",
             "        others -= 1",
             "        if data.__class__ is not dict:",
             "            _coerce_data(_T, data)",
             *rest]
    body = [*read_required(),
             *check_required(store=True),
             f"    others = len(f) - {len(required)}",
             "    data = f.get('data')",
             "    if data is None:",
             "        f['data'] = _EMPTY",
             "    else:",
             "        others -= 1",
             # The snapshot is eventbus/snapshot.py's, called rather than written out
             # here: on 3.11 the call is within the noise of a pure-Python record()
             # (measured), and the compiled path builds the common case itself.
             "        if data.__class__ is not dict:",
             "            data = _coerce_data(_T, data)",
             "        f['data'] = _snap(data)",
             *rest]
    tail = ["    self = _new(_cls)",
            "    _set_dict(self, f)",
            "    return self"]
    build = ["def _build(f):", *body,
             "    f['timestamp'] = _time()",
             "    f['context'] = _holder.value",
             *tail]
    # _decode: the same, with the sender's timestamp and context (a receiver's decoder)
    decode = ["def _decode(f, timestamp, context):", *body,
              "    f['timestamp'] = timestamp",
              "    f['context'] = context",
              *tail]

    # __init__: direct construction and decoding (from_dict), keyword binding, every field.
    params = ", ".join(
        f"{name}=" + (f"_d_{name}" if name in defaults else "_MISSING") for name in fields
    )
    params = (params + ", ") if params else ""
    kw_checks = []
    for name, (kind, nullable) in fields.items():
        test = f"{name} is not None and " if nullable else ""
        kw_checks += [f"    if {test}{name}.__class__ is not {kind.__name__}:",
                      f"        {name} = _coerce(_T, {name!r}, {kind.__name__}, {name}, "
                      "unknown, _ALLOWED)"]
    store = "".join(f"{name!r}: {name}, " for name in fields)
    init = [f"def __init__(self, *, {params}data=None, timestamp=None, context=None, "
            "**unknown):",
            "    if unknown:",
            "        _unknown_field(_T, unknown, _ALLOWED)",
            *kw_checks,
            "    if data is None:",
            "        data = _EMPTY",
            "    elif data.__class__ is not dict:",
            "        data = _snap(_coerce_data(_T, data))",
            "    else:",
            "        data = _snap(data)",
            "    if timestamp is None:",
            "        timestamp = _time()",
            "    elif timestamp.__class__ is not float or timestamp != timestamp:",
            "        timestamp = _bad_timestamp(_T, timestamp)",
            "    if context is None:",
            "        context = _holder.value",
            "    elif context.__class__ is not _JobContext:",
            "        context = _bad_context(_T, context)",
            f"    _set_dict(self, {{{store}'timestamp': timestamp, 'data': data, "
            "'context': context})"]
    lines = [line + "\n" for line in (*check, "", *build, "", *decode, "", *init)]
    source = "".join(lines)
    filename = _generated_filename(cls, type_name, source)
    code = compile(source, filename, "exec")
    exec(code, env)
    # A traceback through _check/_build/__init__ (every validation error passes one)
    # shows the generated line, as for attrs' own generated methods. The entry reuses the
    # lines the source is joined from (about 1% of compile()'s time; no I/O), and mtime
    # None tells linecache.checkcache() to keep it: there is no file to go stale.
    linecache.cache[filename] = (len(source), None, lines, filename)
    cls._source = source
    cls._check = staticmethod(env["_check"])
    cls._build = staticmethod(env["_build"])
    cls._decode = staticmethod(env["_decode"])
    # The compiled common case of _build and _decode (eventbus/_speedups.c), read by the
    # buses' record() and the receiver's decoder; anything else still goes to the above.
    if _speedups is not None:
        cls._spec = _speedups.Spec(
            cls=cls, names=(*required, *optional),
            kinds=(*required.values(), *(kind for kind, _ in optional.values())),
            nullable=(*(False for _ in required), *(null for _, null in optional.values())),
            n_required=len(required), empty=empty, snap=snap, atomic=ATOMIC, time=time.time,
            holder=_holder, set_dict=set_dict)
    env["__init__"].__qualname__ = f"{cls.__qualname__}.__init__"
    cls.__init__ = env["__init__"]  # type: ignore[method-assign]
    # Defaults live on the class, so an event built without an optional field reads it.
    for name, value in defaults.items():
        setattr(cls, name, value)


def _generate_lazily(cls: type[Event], type_name: str, fields: dict[str, tuple[type, bool]],
                     defaults: dict[str, Any]) -> None:
    """Install stubs that run :func:`_generate` on the class's first use.

    Compiling the generated code was a large part of ``import eventbus``, and most
    processes use a few of the built-in types. The first ``_check``, ``_build`` or
    ``__init__`` call (or a read of ``_source``) generates the real ones, replaces the
    stubs and tells the buses (``_on_generate``), so that ``record()`` calls the generated
    function directly from then on. Two threads racing to generate produce the same code:
    no lock is needed (and none can be left held across a fork).
    """
    for name, value in defaults.items():  # readable before the code exists
        setattr(cls, name, value)

    def generate() -> None:
        if cls.__dict__.get("_generate_now") is generate:
            _generate(cls, type_name, fields, defaults)
            type.__setattr__(cls, "_generate_now", None)
            for hook in list(_on_generate):
                hook(cls)

    def _check(f: dict[str, Any]) -> None:
        generate()
        cls._check(f)

    def _build(f: dict[str, Any]) -> Event:
        generate()
        return cls._build(f)

    def _decode(f: dict[str, Any], timestamp: float, context: JobContext) -> Event:
        generate()
        return cls._decode(f, timestamp, context)

    def __init__(self: Event, **fields: Any) -> None:
        generate()
        cls.__init__(self, **fields)

    cls._check = staticmethod(_check)
    cls._build = staticmethod(_build)
    cls._decode = staticmethod(_decode)
    __init__.__qualname__ = f"{cls.__qualname__}.__init__"
    cls.__init__ = __init__  # type: ignore[method-assign]
    type.__setattr__(cls, "_generate_now", generate)


def _ensure_generated(cls: type) -> None:
    """Generate ``cls``'s code now if it is still waiting for its first use."""
    generate = cls.__dict__.get("_generate_now")
    if generate is not None:
        generate()


def _generated_filename(cls: type[Event], type_name: str, source: str) -> str:
    """``<eventbus generated WORKER_EXIT eventbus.events.WorkerExit>``: the pseudo file
    name of a class's generated code, unique in ``linecache`` (a second class with the
    same name and type, e.g. after a test re-declares it, gets ``-2``, ...)."""
    base = f"<eventbus generated {type_name} {cls.__module__}.{cls.__qualname__}"
    filename = base + ">"
    count = 1
    while True:
        entry = linecache.cache.get(filename)
        if entry is None or (len(entry) == 4 and "".join(entry[2]) == source):
            return filename
        count += 1
        filename = f"{base}-{count}>"
