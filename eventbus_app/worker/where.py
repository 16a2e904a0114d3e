"""Where a worker's script is, for its heartbeats (:mod:`eventbus.app.worker.progress`):
:func:`user_frame`, the main thread's innermost frame in the user's code (outside torch,
eventbus and the standard library), and :func:`format_stacks`, every thread's stack in the
order the agent reads it (:mod:`eventbus.app.health.stacks`)."""

from __future__ import annotations

import contextlib
import os
import sys
import sysconfig
import threading
import traceback
import types

__all__ = ["MAX_STACK_CHARS", "format_stacks", "user_frame"]

#: characters of ``data["stack"]`` kept (the event's string limit is 16,384)
MAX_STACK_CHARS = 12_000


def _skipped_roots() -> tuple[str, ...]:
    roots = {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}  # the app
    for name in ("eventbus", "eventbus.publishers", "eventbus.subscribers"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None):
            roots.add(os.path.dirname(os.path.abspath(str(module.__file__))))
    for key in ("stdlib", "platstdlib"):
        with contextlib.suppress(KeyError):
            roots.add(sysconfig.get_paths()[key])
    roots = {os.path.realpath(r) for r in roots} | roots
    return tuple(r.rstrip(os.sep) + os.sep for r in roots)


_SKIP: tuple[str, ...] | None = None
_torch_root: str | None = None


def _is_library(filename: str) -> bool:
    global _SKIP, _torch_root
    if _SKIP is None:
        _SKIP = _skipped_roots()
    if _torch_root is None:
        torch = sys.modules.get("torch")
        if torch is not None and getattr(torch, "__file__", None):
            _torch_root = os.path.dirname(os.path.abspath(str(torch.__file__))) + os.sep
    if filename.startswith("<") or filename.startswith(_SKIP):
        return True
    return _torch_root is not None and filename.startswith(_torch_root)


def user_frame(frame: types.FrameType | None) -> str | None:
    """``"train.py:18 in main"``: the innermost frame of ``frame``'s stack outside torch,
    eventbus and the standard library (the innermost one if every frame is)."""
    innermost = frame
    while frame is not None:
        code = frame.f_code
        if not _is_library(code.co_filename):
            return f"{os.path.basename(code.co_filename)}:{frame.f_lineno} in {code.co_name}"
        frame = frame.f_back
    if innermost is None:
        return None
    code = innermost.f_code
    return f"{os.path.basename(code.co_filename)}:{innermost.f_lineno} in {code.co_name}"


def format_stacks(limit: int = 40) -> str:
    """Every thread's Python stack, innermost call last: the main thread first, then the
    others, eventbus's own threads (named ``eventbus-*``) last and marked so."""
    frames = sys._current_frames()
    names = {t.ident: t.name for t in threading.enumerate()}
    main_ident = threading.main_thread().ident
    me = threading.get_ident()

    def order(ident: int) -> tuple[int, int]:
        own = names.get(ident, "").startswith("eventbus") or ident == me
        return (0 if ident == main_ident else 2 if own else 1, ident)

    parts = []
    for ident in sorted(frames, key=order):
        name = names.get(ident, "?")
        mark = " (main)" if ident == main_ident else \
            " (eventbus's own)" if order(ident)[0] == 2 else ""
        stack = "".join(traceback.format_stack(frames[ident], limit=limit))
        parts.append(f'Thread {ident:#x} "{name}"{mark}, most recent call last:\n{stack}')
    text = "\n".join(parts)
    if len(text) > MAX_STACK_CHARS:
        text = text[:MAX_STACK_CHARS] + "\n... (cut)"
    return text
