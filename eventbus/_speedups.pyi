from collections.abc import Callable
from typing import Any

class Spec:
    def __init__(self, *, cls: type, names: tuple[str, ...], kinds: tuple[type, ...],
                 nullable: tuple[bool, ...], n_required: int, empty: dict[str, Any],
                 snap: Callable[[dict[str, Any]], dict[str, Any]],
                 atomic: frozenset[type], time: Callable[[], float], holder: Any,
                 set_dict: Any) -> None: ...
    def decode(self, fields: dict[str, Any], timestamp: float, context: Any) -> Any: ...

class View:
    def __init__(self, *, slot: Any, spec: Spec | None, calls: tuple[Any, ...],
                 published: Any) -> None: ...
    slot: Any
    spec: Spec | None
    calls: tuple[Any, ...]
    published: Any
    count: int

class Recorder:
    def __init__(self, bus: Any, views: dict[Any, Any], fallback: Callable[..., None],
                 failed: Callable[[Any, Any, Any, BaseException], None]) -> None: ...
    def __call__(self, event_type: Any, /, **fields: Any) -> None: ...
    __self__: Any
    __func__: Callable[..., None]

class Enqueuer:
    def __init__(self, sink: Any, fallback: Callable[[Any, Any], None],
                 value_size: Callable[[Any], int], base_size: int, per_key: int,
                 free_types: tuple[type, ...], kick: Callable[[], None],
                 overflow: Callable[[Any, int], None]) -> None: ...
    def __call__(self, event: Any, /) -> None: ...
    def sync(self, queue: Any, sizes: Any, lock: Any, limit: int, max_bytes: int,
             kick_at: int, /) -> None: ...
    __self__: Any

class Publisher:
    def __init__(self, bus: Any, views: dict[Any, Any], fallback: Callable[..., None],
                 failed: Callable[[Any, Any, Any, BaseException], None]) -> None: ...
    def __call__(self, event: Any, /) -> None: ...
    __self__: Any
    __func__: Callable[..., None]
