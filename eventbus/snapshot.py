"""Events are snapshots: ``data`` as it was when the event was built, read-only.

``record()`` returns before any queue, file or store sees the event (they encode it later,
on their own threads), so an event must not share anything mutable with the caller: an
accumulator changed in place after ``record()`` would otherwise be written with its later
value. Every event's ``data`` is therefore made here, once, when the event is built:

* containers are copied at every depth: a ``dict`` (any mapping) becomes a read-only dict,
  a ``list`` a read-only list, a ``set`` a read-only frozenset, a ``tuple`` a tuple of
  copies; ``bytearray``/``memoryview`` become ``bytes``;
* a numpy array is copied and the copy marked not writeable;
* a torch tensor is ``detach().clone()``-d on its own device. For a CUDA tensor that is a
  device copy queued on the caller's current stream: nothing synchronises and nothing is
  read back in the caller's thread; the copy is read later, off-thread, by whoever encodes
  it;
* a tensor or array over :data:`MAX_ARRAY_BYTES` is not copied whole: it becomes its
  summary ``{"$tensor": {"shape", "dtype", "numel", "device", "head"}}`` (the form the
  encoder writes for any tensor), where ``head`` holds the first values of a contiguous CPU
  tensor or array, and is empty for a device tensor (reading it would synchronise);
* immutable values (``int``, ``float``, ``str``, ``bool``, ``None``, ``bytes``, numpy
  scalars, ...) are shared, not copied; objects of other types are shared too: the bus
  cannot know how to copy them (record their values, not live objects);
* below ``LIMITS.max_depth`` levels of nesting (where the encoder cuts data anyway) values
  are shared, not copied: that bounds the work and ends a container that contains itself.

The read-only containers are subclasses of ``dict``, ``list`` and ``frozenset``: they
compare equal to plain ones, ``json.dumps`` and ``isinstance`` treat them as such, and
``dict(event.data)`` / ``event.data.copy()`` give a plain, mutable copy. Every mutating
method raises ``TypeError`` naming the event type. Each event type has its own three
classes, so that the message can name it without a per-event attribute.

The common case costs one class check per value: a flat dict of scalars is copied by one
C-level dict copy, and an event without ``data`` shares one empty read-only dict per type.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
from typing import Any
from typing import Final
from typing import NoReturn

from eventbus.encoding import LIMITS

__all__ = ["ATOMIC", "MAX_ARRAY_BYTES", "FrozenData", "FrozenList", "FrozenSet", "snapshot_for"]

#: a tensor or array of more bytes than this is snapshotted as its summary, not copied
MAX_ARRAY_BYTES: Final = LIMITS.max_line_bytes

#: shared, never copied: the classes whose instances cannot change. The one definition:
#: the generated builders call :func:`snapshot_for`'s ``snapshot``, and the compiled one
#: (eventbus/_speedups.c, which copies the common case itself) is handed this set; it
#: refuses one that lacks ``int``, ``float``, ``str``, ``bool`` or ``NoneType``, the
#: classes it shares without a lookup
ATOMIC: Final = frozenset({int, float, str, bool, type(None), bytes, complex})


def _refusing(name: str) -> Callable[..., NoReturn]:
    def refuse(self: Any, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError(
            f"{self._event_type} event data is read-only ({self._builtin}.{name}): events "
            f"are snapshots shared by every subscriber; change a copy, e.g. "
            f"dict(event.data) or list(value)"
        )
    refuse.__name__ = name
    return refuse


class FrozenData(dict):  # type: ignore[type-arg]
    """A read-only dict: ``event.data`` and every mapping inside it."""

    __slots__ = ()
    _event_type: str = "an"
    _builtin = "dict"

    __setitem__ = _refusing("__setitem__")
    __delitem__ = _refusing("__delitem__")
    __ior__ = _refusing("__ior__")
    clear = _refusing("clear")
    pop = _refusing("pop")
    popitem = _refusing("popitem")
    setdefault = _refusing("setdefault")
    update = _refusing("update")

    def __reduce__(self) -> tuple[Any, ...]:
        # pickle and copy rebuild through the constructor, never through __setitem__
        return _rebuild, (self._event_type, 0, dict(self))


class FrozenList(list):  # type: ignore[type-arg]
    """A read-only list: every list inside ``event.data``."""

    __slots__ = ()
    _event_type: str = "an"
    _builtin = "list"

    __setitem__ = _refusing("__setitem__")
    __delitem__ = _refusing("__delitem__")
    __iadd__ = _refusing("__iadd__")
    __imul__ = _refusing("__imul__")
    append = _refusing("append")
    extend = _refusing("extend")
    insert = _refusing("insert")
    pop = _refusing("pop")
    remove = _refusing("remove")
    clear = _refusing("clear")
    sort = _refusing("sort")
    reverse = _refusing("reverse")

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (self._event_type, 1, list(self))


class FrozenSet(frozenset):  # type: ignore[type-arg]
    """A frozenset whose set-mutator names raise ``TypeError`` (a plain frozenset's raise
    ``AttributeError``): every set inside ``event.data``."""

    __slots__ = ()
    _event_type: str = "an"
    _builtin = "set"

    add = _refusing("add")
    discard = _refusing("discard")
    remove = _refusing("remove")
    pop = _refusing("pop")
    clear = _refusing("clear")
    update = _refusing("update")
    __ior__ = _refusing("__ior__")

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (self._event_type, 2, list(self))


#: type name -> its (dict, list, set) classes
_KINDS: dict[str, tuple[type[FrozenData], type[FrozenList], type[FrozenSet]]] = {}


def _kinds(type_name: str) -> tuple[type[FrozenData], type[FrozenList], type[FrozenSet]]:
    kinds = _KINDS.get(type_name)
    if kinds is None:
        # Named like the builtin, so that repr() reads as the user wrote it.
        ns = {"__slots__": (), "_event_type": type_name, "__module__": __name__}
        kinds = (type("dict", (FrozenData,), ns),
                 type("list", (FrozenList,), ns),
                 type("frozenset", (FrozenSet,), ns))
        _KINDS[type_name] = kinds
    return kinds


def _rebuild(type_name: str, kind: int, items: Any) -> Any:
    return _kinds(type_name)[kind](items)


def _array_kind(value: object) -> str | None:
    cls = type(value)
    module = cls.__module__
    if module.startswith("torch") and hasattr(value, "detach") and hasattr(value, "numel"):
        return "torch"
    if module.startswith("numpy") and any(
            base.__name__ == "ndarray" for base in cls.__mro__):  # not a numpy scalar
        return "numpy"
    return None


def _tensor(value: Any, frozen: type[FrozenData]) -> Any:
    try:
        numel = int(value.numel())
        if numel * int(value.element_size()) <= MAX_ARRAY_BYTES:
            # Queued on the tensor's device (its current stream for CUDA): no sync here.
            return value.detach().clone()
        device = value.device
        head: list[Any] = []
        if device.type == "cpu" and value.is_contiguous() and not value.is_sparse:
            head = value.detach().view(-1)[: LIMITS.tensor_head].tolist()
        return frozen({"$tensor": frozen({
            "shape": tuple(value.shape), "dtype": str(value.dtype).replace("torch.", ""),
            "numel": numel, "device": str(device), "head": tuple(head),
            "snapshot": f"summary: over {MAX_ARRAY_BYTES} bytes, not copied"})})
    except Exception as exc:  # a tensor subclass or a broken object: say what happened
        return frozen({"$repr": f"<{type(value).__qualname__}: snapshot failed: "
                                f"{type(exc).__name__}>"})


def _array(value: Any, frozen: type[FrozenData]) -> Any:
    try:
        if int(value.nbytes) <= MAX_ARRAY_BYTES:
            copy = value.copy()
            copy.flags.writeable = False
            return copy
        return frozen({"$tensor": frozen({
            "shape": tuple(value.shape), "dtype": str(value.dtype), "numel": int(value.size),
            "device": "cpu", "head": tuple(value.flat[: LIMITS.tensor_head].tolist()),
            "snapshot": f"summary: over {MAX_ARRAY_BYTES} bytes, not copied"})})
    except Exception as exc:
        return frozen({"$repr": f"<{type(value).__qualname__}: snapshot failed: "
                                f"{type(exc).__name__}>"})


def _copy(value: Any, depth: int,
          kinds: tuple[type[FrozenData], type[FrozenList], type[FrozenSet]]) -> Any:
    """A snapshot of one value (see the module docstring)."""
    cls = value.__class__
    if cls in ATOMIC:
        return value
    if depth >= LIMITS.max_depth:
        # Past the depth the encoder keeps, the rest is shared, not copied: that bounds
        # the work (and ends a container that contains itself) and leaves the encoder's
        # own truncation marker to say where data was cut.
        return value
    depth += 1
    if isinstance(value, (dict, Mapping)):
        try:
            items = list(value.items())
        except Exception as exc:
            return kinds[0]({"$repr": f"<{cls.__qualname__}: items() raised "
                                      f"{type(exc).__name__}>"})
        return kinds[0]({k: _copy(v, depth, kinds) for k, v in items})
    if isinstance(value, list):
        return kinds[1]([_copy(v, depth, kinds) for v in value])
    if isinstance(value, tuple):
        items = [_copy(v, depth, kinds) for v in value]
        make = getattr(cls, "_make", None)  # a namedtuple keeps its class
        if make is not None:
            try:
                return make(items)
            except Exception:
                pass
        return tuple(items)
    if isinstance(value, (set, frozenset)):
        return kinds[2](_copy(v, depth, kinds) for v in value)
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    kind = _array_kind(value)
    if kind == "torch":
        return _tensor(value, kinds[0])
    if kind == "numpy":
        return _array(value, kinds[0])
    return value  # immutable (numpy scalars, enums, str/int subclasses) or unknown: shared


def snapshot_for(type_name: str) -> tuple[Callable[[dict[str, Any]], dict[str, Any]],
                                          dict[str, Any]]:
    """``(snapshot, empty)`` for one event type: ``snapshot(data)`` is the read-only copy
    of a plain dict that ``data`` becomes; ``empty`` the shared ``data`` of an event
    recorded without any."""
    kinds = _kinds(type_name)
    frozen = kinds[0]
    atomic = ATOMIC

    def snapshot(data: dict[str, Any]) -> dict[str, Any]:
        for value in data.values():
            if type(value) not in atomic:
                return frozen({k: _copy(v, 1, kinds) for k, v in data.items()})
        return frozen(data)

    return snapshot, frozen()
