"""The bootstrap's save watch: checkpoint saves noticed with no call in the script.

Once the script has imported torch (the progress watch's tick looks), ``torch.save`` is
wrapped, and so are ``torch.distributed.checkpoint``'s ``save`` and ``async_save`` once the
script has imported that module. A wrapped call notes its start, its end and, for a file
path, the file's size, then returns what the original returned (and raises what it
raised: a failed save is noted as such). An asynchronous save ends when its future
completes. The progress watch puts the saves noted since its last heartbeat in the next
one (``data["saves"]``: a list of ``{"start", "end", "bytes", "path", "kind", "ok"}``,
wall-clock seconds), and beats soon after a save; the goodput counts them as
``checkpoint`` (docs/goodput.md).

Nothing runs while the script does not save: the wrappers are the only cost, and only on
a save. A script that bound the function before the watch armed (``from torch import
save`` before ``import eventbus``'s bootstrap saw torch) keeps the original; its saves
count only when it records ``CHECKPOINT_SAVED`` itself (or a trainer callback does).
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["MAX_PENDING", "SaveWatch"]

#: saves kept between two heartbeats at most (more are counted, not listed)
MAX_PENDING = 64

_WRAPPED = "_eventbus_save_watch"
#: set while a wrapped save runs on this thread: the saves it makes itself are its own
_inside = threading.local()
#: the watch the wrappers note to: the one armed last
_active: SaveWatch | None = None


class SaveWatch:
    """Wraps the save functions once they exist; hands the saves noted to the heartbeat."""

    def __init__(self, clock: Callable[[], float] = time.time,
                 step: Callable[[], int | None] | None = None) -> None:
        self.clock = clock
        #: the optimizer steps taken so far (the progress watch's counter), read as a save
        #: ends: the save's step, exact, whenever the heartbeat that carries it goes out
        self.step = step
        self._lock = threading.Lock()
        self._pending: list[dict[str, Any]] = []
        #: saves noted in all, and those beyond MAX_PENDING between two heartbeats
        self.noted = 0
        self.overflow = 0
        self._done: set[str] = set()
        self._claimed = False

    def arm(self) -> None:
        """Wrap what the script has imported so far (cheap when done: a set lookup). The
        wrappers note each save to the watch whose first arm() came last (one per worker: its
        progress watch's), so a function wrapped once serves every later watch of the
        process; a watch's later calls (each tick) do not take it back from a newer one."""
        global _active
        if not self._claimed:  # once: a watch's later ticks take nothing from a newer one
            self._claimed = True
            _active = self
        if "torch" not in self._done:
            torch = _ready("torch")
            if torch is not None and self._wrap(torch, "save", "torch.save"):
                self._done.add("torch")
        if "dcp" not in self._done:
            dcp = _ready("torch.distributed.checkpoint")
            if dcp is not None:
                self._wrap(dcp, "save", "dcp.save")
                self._wrap(dcp, "async_save", "dcp.async_save", asynchronous=True)
                self._done.add("dcp")

    @property
    def armed(self) -> bool:
        return "torch" in self._done

    def take(self) -> list[dict[str, Any]]:
        """The saves noted since the last call (for the next heartbeat)."""
        with self._lock:
            out, self._pending = self._pending, []
        return out

    @property
    def waiting(self) -> bool:
        return bool(self._pending)

    def _wrap(self, module: Any, name: str, kind: str, *, asynchronous: bool = False) -> bool:
        original = getattr(module, name, None)
        if not callable(original):
            return False
        if getattr(original, _WRAPPED, False):
            return True

        @functools.wraps(original)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            watch = _active
            if watch is None or getattr(_inside, "save", False):
                return original(*args, **kwargs)  # DCP's own torch.save calls: one save
            start = watch.clock()
            path = _path_of(args, kwargs)
            _inside.save = True
            try:
                result = original(*args, **kwargs)
            except BaseException:
                watch._note(kind, start, watch.clock(), path, ok=False)
                raise
            finally:
                _inside.save = False
            if asynchronous and callable(getattr(result, "add_done_callback", None)):
                noting = watch
                result.add_done_callback(
                    lambda future: noting._note(kind, start, noting.clock(), path,
                                                ok=future.exception() is None))
            else:
                watch._note(kind, start, watch.clock(), path, ok=True)
            return result

        setattr(wrapped, _WRAPPED, True)
        setattr(module, name, wrapped)
        return True

    def _note(self, kind: str, start: float, end: float, path: str | None, *,
              ok: bool) -> None:
        size = None
        if path is not None and ok:
            try:
                if os.path.isfile(path):
                    size = os.path.getsize(path)
                elif os.path.isdir(path):  # a DCP checkpoint: the files of its folder
                    size = sum(e.stat().st_size for e in os.scandir(path) if e.is_file())
            except OSError:
                size = None
        save = {"kind": kind, "start": round(start, 6), "end": round(end, 6), "ok": ok,
                "path": path[-300:] if path else None, "bytes": size}
        step = self.step() if self.step is not None else None
        if step is not None:
            save["step"] = step
        with self._lock:
            self.noted += 1
            if len(self._pending) < MAX_PENDING:
                self._pending.append(save)
            else:
                self.overflow += 1


def _ready(name: str) -> Any:
    """The module ``name`` if the script imported it whole (not while it is importing)."""
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    if module is None or getattr(spec, "_initializing", False):
        return None
    return module


def _path_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The file or folder a save writes to: torch.save's ``f``, DCP's ``checkpoint_id``."""
    for candidate in (kwargs.get("f"), kwargs.get("checkpoint_id"),
                      args[1] if len(args) > 1 else None):
        if isinstance(candidate, (str, os.PathLike)):
            return str(os.fspath(candidate))
    return None
