"""A worker's start-up marks: when each phase of its way to the first step ended.

The agent's restart anatomy (eventbus_app/launcher/recovery/anatomy.py) needs, for each worker of
a new attempt, when it reached the script, when torch was imported, when its process
group was ready, how long it spent loading checkpoints, and when its first step
completed. The bootstrap notes them with no call in the script, on the worker's wall clock
(``time.time()``, comparable with the agent's on one machine):

- ``bootstrap``: the bootstrap's first line (the interpreter is up);
- ``script``: just before the script runs as ``__main__``;
- ``torch``: ``import torch`` completed (a finder on ``sys.meta_path`` wraps the module's
  execution, then leaves);
- ``init_called``, ``init``: ``torch.distributed.init_process_group`` called and returned
  (the function is wrapped as its module finishes executing, before
  ``torch.distributed`` re-exports it);
- ``restore_s``: seconds spent in ``torch.load`` and ``torch.distributed.checkpoint``'s
  ``load`` before the first step (the save watch times them);
- ``step``: the first step completed: the first optimizer step (torch's global step post
  hook), or the first ``METRIC`` with a step that the script records, whichever comes
  first. A script that updates its weights by hand (no ``torch.optim``, as the demo's
  does) and reports its steps has a first step too.

The progress watch sends them as ``data["marks"]`` in its beats from the first step on,
until :data:`SEND_BEATS` beats carried them (the store is at-most-once). A mark not seen
is absent, never guessed.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
import threading
import time
import types
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

from eventbus.bus import Bus
from eventbus.bus import Subscription
from eventbus.events import Event
from eventbus.events import EventType

__all__ = ["SEND_BEATS", "Marks", "worker_marks"]

#: beats that carry the marks after the first step
SEND_BEATS = 3

_C10D = "torch.distributed.distributed_c10d"
_OPTIMIZER = "torch.optim.optimizer"
_DCP_LOADER = "torch.distributed.checkpoint.state_dict_loader"


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a hook when a named module has executed; removes itself once all have."""

    def __init__(self, hooks: dict[str, Callable[[types.ModuleType], None]]) -> None:
        self.hooks = hooks

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        hook = self.hooks.pop(fullname, None)
        if hook is None:
            return None
        if not self.hooks:
            self.remove()
        spec = None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        loader = getattr(spec, "loader", None)
        execute = getattr(loader, "exec_module", None)
        if spec is None or execute is None:
            return spec

        def exec_module(module: types.ModuleType) -> None:
            execute(module)
            with contextlib.suppress(Exception):  # a mark never costs the script its import
                hook(module)

        loader.exec_module = exec_module  # type: ignore[union-attr]
        found: importlib.machinery.ModuleSpec = spec
        return found

    def remove(self) -> None:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)


class Marks:
    """The marks of this worker (see the module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.at: dict[str, float] = {}
        self.restore_s = 0.0
        self.sent = 0
        self._lock = threading.Lock()
        self._finder: _AfterImport | None = None

    def note(self, name: str, at: float | None = None) -> None:
        """Mark ``name`` now (or at ``at``); a mark is kept the first time only."""
        self.at.setdefault(name, self.clock() if at is None else at)

    def loaded(self, seconds: float) -> None:
        """A checkpoint load took ``seconds`` (counted until the first step)."""
        if "step" not in self.at:
            with self._lock:
                self.restore_s += max(0.0, seconds)

    def install(self) -> None:
        """Watch for torch's import and wrap ``init_process_group``, the checkpoint loads
        and the first optimizer step (before the script: each as its module finishes
        executing, or at once where the module is already there)."""
        hooks: dict[str, Callable[[types.ModuleType], None]] = {
            "torch": self._torch, _C10D: self._wrap_init, _OPTIMIZER: self._first_step,
            _DCP_LOADER: lambda module: self._wrap_load(module, "load")}
        for name in list(hooks):
            module = sys.modules.get(name)
            if module is not None:
                hooks.pop(name)(module)
        if hooks:
            self._finder = _AfterImport(hooks)
            sys.meta_path.insert(0, self._finder)

    def _torch(self, module: types.ModuleType) -> None:
        self.note("torch")
        self._wrap_load(module, "load")

    def _wrap_load(self, module: types.ModuleType, name: str) -> None:
        original = getattr(module, name, None)
        if not callable(original) or getattr(original, "_eventbus_marks", False):
            return
        clock, loaded = time.perf_counter, self.loaded

        def load(*args: Any, **kwargs: Any) -> Any:
            began = clock()
            try:
                return original(*args, **kwargs)
            finally:
                loaded(clock() - began)

        _like(load, original)
        setattr(module, name, load)

    def _first_step(self, module: types.ModuleType) -> None:
        register = getattr(module, "register_optimizer_step_post_hook", None)
        if register is None:
            return
        at = self.at
        clock = self.clock

        # It stays registered: removing it from inside the hook (or from another thread)
        # mutates the hooks' dict while torch iterates it. After the first step it is one
        # dict lookup per step.
        def first_step(optimizer: Any, args: Any, kwargs: Any) -> None:
            if "step" not in at:
                at["step"] = clock()

        register(first_step)

    def watch_metric_steps(self, bus: Bus) -> Subscription:
        """Note ``step`` at the first ``METRIC`` with a step that the script records on
        ``bus`` (unless an optimizer step came first). One subscription that ends at that
        event: the script's later records pay nothing for it."""
        note = self.note

        def first_metric_step(event: Event) -> None:
            note("step")

        return bus.subscribe(EventType.METRIC, on_event=first_metric_step, once=True,
                             where=_has_step)

    def uninstall(self) -> None:
        if self._finder is not None:
            self._finder.remove()

    def _wrap_init(self, module: types.ModuleType) -> None:
        original = getattr(module, "init_process_group", None)
        if not callable(original) or getattr(original, "_eventbus_marks", False):
            return
        note = self.note

        def init_process_group(*args: Any, **kwargs: Any) -> Any:
            note("init_called")
            result = original(*args, **kwargs)
            note("init")
            return result

        _like(init_process_group, original)
        module.init_process_group = init_process_group  # type: ignore[attr-defined]
        # torch.distributed re-exports it: already imported (a warm spare), it holds the
        # original
        package = sys.modules.get("torch.distributed")
        if package is not None and getattr(package, "init_process_group", None) is original:
            setattr(package, "init_process_group", init_process_group)  # noqa: B010

    def as_data(self) -> dict[str, float] | None:
        """``data["marks"]`` for a beat, from the first step on, :data:`SEND_BEATS` times;
        None otherwise."""
        if "step" not in self.at or self.sent >= SEND_BEATS:
            return None
        self.sent += 1
        out = {name: round(t, 6) for name, t in self.at.items()}
        out["restore_s"] = round(self.restore_s, 6)
        return out


def _has_step(event: Event) -> bool:
    return getattr(event, "step", None) is not None


def _like(wrapper: Any, original: Any) -> None:
    """``wrapper`` says what ``original`` says (name, doc, module), and is marked ours."""
    for attr in ("__doc__", "__name__", "__qualname__", "__module__"):
        with contextlib.suppress(AttributeError, TypeError):
            setattr(wrapper, attr, getattr(original, attr))
    wrapper.__wrapped__ = original
    wrapper._eventbus_marks = True


#: this process's marks (the bootstrap notes ``bootstrap`` at import)
worker_marks = Marks()
worker_marks.note("bootstrap")
