"""The worker's evidence of what its main thread does while it makes no progress.

The progress watch (eventbus_app/worker/progress.py) calls :meth:`ActivitySampler.sample`
at each tick once the rank has been idle (no step, no collective, no event) for a tick,
and puts :meth:`ActivitySampler.report` into its idle heartbeats as
``data["activity"]``; the keys and what the agent makes of them are
:mod:`eventbus.app.health.evidence`'s. A tick with progress calls :meth:`ActivitySampler.reset`:
a busy rank pays nothing for the sampler.

One sample reads the main thread's frames (``sys._current_frames()``: code and line of
every frame, at most :data:`MAX_FRAMES`), the thread's CPU clock
(``time.pthread_getcpuclockid``) and the machine's runnable threads (``/proc/loadavg``),
and keeps no frame: a frame held between samples would keep the script's locals (its
tensors) alive, with one exception below. A Python loop that calls nothing is always
sampled at its backward jump (the only place it lets another thread take the GIL), so a
spin in one line reads as one still stack.

The same code and lines are not always the same place: a loop that calls one function whose
time is all in one GIL-releasing op (a validation loop of one big matmul, a ``.item()`` that
waits for the GPU) is sampled in that op every time, in a new call each time. So once a
stack has stood still for :data:`HOLD_AFTER_S`, the sampler holds the innermost frame
object until the next sample and compares identity: a new call is a new frame object (the
held one cannot be reused meanwhile), a hung call the same one. The held frame keeps its
locals alive for at most one tick after its call ended, and only while the rank is idle
with a still stack.

A spinning thread gets a whole core only on an idle machine: with every core busy it gets
its share of them (a third of a core with three runnable threads per core). So beside the
CPU the thread used while its stack stood still (``still_cpu_s``), the sampler adds up the
CPU a thread runnable all along would have had (``still_fair_cpu_s``: at each sample, the
cores over the machine's runnable threads, at most one core, times the time since the last
sample). A thread that used most of that was runnable all along, spinning; a blocked one
used none of it, however busy the machine.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import types
from collections.abc import Callable
from typing import Any

__all__ = ["HOLD_AFTER_S", "MAX_FRAMES", "ActivitySampler", "fair_share", "frame_facts"]

#: frames of the main thread read per sample (a deeper stack is compared on these)
MAX_FRAMES = 256
#: a stack still for this long is checked by frame identity from then on
HOLD_AFTER_S = 1.0

_SEP = os.sep
#: (path ending, function names): a checkpoint save or load under way
_SAVES = (
    (f"torch{_SEP}serialization.py", frozenset({"save", "_save", "_legacy_save"})),
    (f"checkpoint{_SEP}state_dict_saver.py", frozenset({"save", "async_save",
                                                         "save_state_dict"})),
    (f"safetensors{_SEP}torch.py", frozenset({"save_file", "save_model", "save"})),
)
_LOADS = (
    (f"torch{_SEP}serialization.py", frozenset({"load", "_load", "_legacy_load"})),
    (f"checkpoint{_SEP}state_dict_loader.py", frozenset({"load", "load_state_dict"})),
    (f"safetensors{_SEP}torch.py", frozenset({"load_file", "load_model", "load"})),
)
_FETCH = (f"utils{_SEP}data{_SEP}dataloader.py", frozenset({"__next__"}))
#: torch.compile's compiler (dynamo's frame conversion, inductor's compile); a compiled
#: function that runs has none of these frames
_COMPILE = (f"_dynamo{_SEP}convert_frame.py", f"_inductor{_SEP}compile_fx.py",
            f"_inductor{_SEP}async_compile.py")
#: a frame's function name -> the phase it names; when several frames name one, the
#: first of this table wins (Lightning's validation runs in its evaluation loop)
_LABELS = (("valid", "validating"), ("test_step", "testing"), ("_test_loop", "testing"),
           ("predict", "predicting"), ("evaluat", "evaluating"), ("eval_", "evaluating"))
_RANK = {label: i for i, (_, label) in enumerate(_LABELS)}


def _kind_of(filename: str, name: str, table: tuple[tuple[str, frozenset[str]], ...]) -> str | None:
    for ending, names in table:
        if name in names and filename.endswith(ending):
            return ending
    return None


def frame_facts(frame: types.FrameType | None) -> tuple[tuple[Any, ...], dict[str, str]]:
    """The stack's signature (each frame's code and line, innermost first) and what its
    frames say: ``io`` (``save``/``load``) with ``io_kind``, ``fetch``, ``compiling``,
    ``label``."""
    signature: list[Any] = []
    facts: dict[str, str] = {}
    depth = 0
    while frame is not None and depth < MAX_FRAMES:
        code = frame.f_code
        signature.append(code)
        signature.append(frame.f_lineno)
        filename, name = code.co_filename, code.co_name
        if "io" not in facts:
            kind = _kind_of(filename, name, _SAVES)
            if kind is not None:
                facts.update(io="save", io_kind=_io_kind(kind))
            else:
                kind = _kind_of(filename, name, _LOADS)
                if kind is not None:
                    facts.update(io="load", io_kind=_io_kind(kind))
        if name == "__next__" and filename.endswith(_FETCH[0]):
            facts["fetch"] = "DataLoader"
        elif name != "<module>" and filename.endswith(_COMPILE):  # not their import
            facts["compiling"] = "torch.compile"
        lowered = name.lower()
        for needle, label in _LABELS:
            if needle in lowered:
                if _RANK[label] < _RANK.get(facts.get("label", ""), len(_LABELS)):
                    facts["label"] = label
                break
        frame = frame.f_back
        depth += 1
    return tuple(signature), facts


def _io_kind(ending: str) -> str:
    if ending.startswith("torch"):
        return "torch"
    if ending.startswith("safetensors"):
        return "safetensors"
    return "torch.distributed.checkpoint"


def _thread_cpu(ident: int | None) -> Callable[[], float] | None:
    """A reader of the thread's CPU time (seconds), where the platform has one."""
    getclock = getattr(time, "pthread_getcpuclockid", None)
    if ident is None or getclock is None:
        return None
    try:
        clock = getclock(ident)
        time.clock_gettime(clock)
    except (OSError, OverflowError, ValueError):
        return None
    return lambda: time.clock_gettime(clock)


def fair_share(loadavg: str = "/proc/loadavg") -> float | None:
    """The share of one core a runnable thread gets now: the machine's cores over its
    runnable threads (the fourth field of ``/proc/loadavg``, ``running/total``; the
    sampler's own thread, running as it reads, stands for the main thread it samples), at
    most 1. None where the file is missing or says nothing."""
    try:
        with open(loadavg, "rb") as f:
            running = int(f.read(128).split()[3].split(b"/")[0])
    except (OSError, IndexError, ValueError):
        return None
    cores = os.cpu_count() or 1
    return min(1.0, cores / max(1, running))


class ActivitySampler:
    """The main thread's evidence since the rank went idle (see the module docstring).

    ``clock``, ``frames``, ``cpu`` and ``share`` are injectable for tests: ``frames()``
    returns the main thread's innermost frame, ``cpu()`` its CPU seconds, ``share()`` the
    share of a core a runnable thread gets now (:func:`fair_share`; None: unknown)."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic,
                 frames: Callable[[], types.FrameType | None] | None = None,
                 cpu: Callable[[], float] | None = None,
                 share: Callable[[], float | None] = fair_share) -> None:
        self._clock = clock
        main = threading.main_thread().ident
        self._frames = frames if frames is not None else (
            lambda: sys._current_frames().get(main or 0))
        self._cpu = cpu if cpu is not None else _thread_cpu(main)
        self._share = share
        self.samples = 0
        #: set by a sample that saw a save, a load or a compile begin: the watch beats at
        #: once, so that the agent knows before the call may hold the GIL for long
        self.news = False
        self.reset()

    def reset(self) -> None:
        """The rank progressed: the evidence starts again at the next sample (nothing to
        do while nothing was sampled: a progressing rank's every tick calls this)."""
        if getattr(self, "_last_t", 0.0) is None:
            return
        self._signature: tuple[Any, ...] | None = None
        #: the innermost frame of a still stack, held to tell a hung call from new ones
        self._held: Any = None
        self._still_t = 0.0
        self._still_cpu = 0.0
        self._cpu_now = 0.0
        #: the CPU a runnable thread would have had since the stack stood still (None:
        #: the machine's runnable threads are unknown)
        self._fair: float | None = 0.0
        self._since: dict[str, float] = {}
        self._facts: dict[str, str] = {}
        self._last_t: float | None = None

    def sample(self) -> None:
        """One sample of the main thread."""
        now = self._clock()
        frame = self._frames()
        signature, facts = frame_facts(frame)
        cpu = self._cpu() if self._cpu is not None else 0.0
        share = self._share()
        self.samples += 1
        held, self._held = self._held, None
        if signature != self._signature or (held is not None and held is not frame):
            self._signature = signature
            self._still_t, self._still_cpu = now, cpu
            self._fair = 0.0
        else:
            if self._fair is not None and self._last_t is not None:
                self._fair = None if share is None else (
                    self._fair + max(0.0, now - self._last_t) * share)
            if now - self._still_t >= HOLD_AFTER_S:
                self._held = frame
        del held, frame
        self._cpu_now = cpu
        for key in ("io", "fetch", "compiling"):
            value = facts.get(key)
            if value is None:
                self._since.pop(key, None)
            elif self._facts.get(key) != value or key not in self._since:
                self._since[key] = now
                self.news = self.news or key != "fetch"
        self._facts = facts
        self._last_t = now

    def report(self) -> dict[str, Any] | None:
        """``data["activity"]`` for the next idle heartbeat (None before any sample)."""
        if self._last_t is None:
            return None
        self.news = False
        now = self._clock()
        out: dict[str, Any] = {
            "still_s": round(max(0.0, now - self._still_t), 3),
            "still_cpu_s": round(max(0.0, self._cpu_now - self._still_cpu), 4)}
        if self._fair is not None and self._fair > 0:
            out["still_fair_cpu_s"] = round(self._fair, 4)
        facts, since = self._facts, self._since
        if "io" in facts:
            out.update(io=facts["io"], io_kind=facts["io_kind"],
                       io_s=round(max(0.0, now - since.get("io", now)), 3))
        if "fetch" in facts:
            out["data_s"] = round(max(0.0, now - since.get("fetch", now)), 3)
        if "compiling" in facts:
            out["compiling_s"] = round(max(0.0, now - since.get("compiling", now)), 3)
        if "label" in facts:
            out["label"] = facts["label"]
        return out
