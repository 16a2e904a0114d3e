"""The agent <-> worker conversation of ``eventbus run``: what the agent tells each worker
through its environment, what it asks through files, and what the worker answers.

Both ends import this module (the agent: :mod:`eventbus.app.launcher`; the worker:
:mod:`eventbus.app.worker`), so a name, a grammar or a file rule is defined once and
``tests/test_protocol.py`` drives both ends with it. Torch-free and import-light: the
worker bootstrap reads it before the script runs.

The conversation:

* **progress** (:data:`ENV_PROGRESS`): the sources of the worker's progress watch, in the
  one grammar of :func:`parse_progress` (the command line's ``--progress`` reads the same),
  written by the agent with :func:`format_progress`. The worker's heartbeats
  (``WORKER_PROGRESS``, over the store) end with one whose ``data[EXITING_KEY]`` is true;
  any event's ``data[EXPECT_SILENCE_KEY]`` announces a quiet period; an idle heartbeat's
  ``data[ACTIVITY_KEY]`` is the evidence of what its main thread does (the keys are
  :mod:`eventbus.app.health.evidence`'s);
* **flight-recorder dumps** (:data:`ENV_FR_DUMP_DIR`): the agent writes a token to the
  folder's request file (:func:`write_fr_request`), each worker serves each new token once
  (:class:`FrRequestReader`): its trace goes to :func:`fr_dump_path`, and its next heartbeat
  carries :data:`FR_DUMP_TOKEN_KEY` with :data:`FR_DUMP_KEY` (the path) or
  :data:`FR_DUMP_ERROR_KEY` (why not);
* **stacks** (:data:`ENV_STACK_DIR`, :data:`ENV_STACK_SIGNAL`): the worker arms a signal and
  says which in :func:`stack_signal_path` (its number in decimal, written whole once the
  handler is armed); the agent reads it (:func:`read_stack_signal`), sends that signal and
  reads what the worker appended to :func:`stack_file_path`. The grammar of
  ``EVENTBUS_STACK_SIGNAL`` (set by the user, never by the agent) is the worker's:
  :func:`eventbus.app.worker.stack_dump.parse_stack_signal`.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable

__all__ = [
    "ACTIVITY_KEY",
    "BEATS_PER_S",
    "ENV_BEAT",
    "ENV_FR_BUFFER",
    "ENV_FR_DUMP_DIR",
    "ENV_PROGRESS",
    "ENV_STACK_DIR",
    "ENV_STACK_SIGNAL",
    "EXITING_KEY",
    "EXPECT_SILENCE_KEY",
    "FR_BUFFER_SIZE",
    "FR_DUMP_ERROR_KEY",
    "FR_DUMP_KEY",
    "FR_DUMP_PREFIX",
    "FR_DUMP_TOKEN_KEY",
    "FR_REQUEST_FILE",
    "FR_USER_SETTINGS",
    "MARKS_KEY",
    "MAX_BEAT_S",
    "MAX_FR_TOKEN_CHARS",
    "PROGRESS_SOURCES",
    "FrRequestReader",
    "beat_interval",
    "format_progress",
    "fr_dump_folder",
    "fr_dump_path",
    "fr_dump_root",
    "parse_beat",
    "parse_progress",
    "read_stack_signal",
    "stack_file_path",
    "stack_signal_path",
    "write_fr_request",
]

# -- the progress watch ------------------------------------------------------------------

#: the workers' progress sources, in the grammar of :func:`parse_progress`
ENV_PROGRESS = "EVENTBUS_PROGRESS"
#: the worker's heartbeat interval in seconds (:func:`beat_interval`); unset: 1 s
ENV_BEAT = "EVENTBUS_BEAT_S"
#: the heartbeats a second the agent of group rank 0 is sized for: a larger job beats less
#: often (docs/scale.md: receiving and folding ~90 us a beat, 2,048 a second ~18% of a core)
BEATS_PER_S = 2048
#: the longest heartbeat interval, whatever the job's size
MAX_BEAT_S = 10.0


def beat_interval(world_size: int, stall_timeout: float | None = None) -> float:
    """The heartbeat interval for a job of ``world_size`` ranks: 1 s up to
    :data:`BEATS_PER_S` ranks, then growing with the job so that group rank 0 receives about
    that many beats a second; never above a quarter of a numeric ``--stall-timeout`` (a rank
    that progresses beats well within it; the stall rule dates progress by the beat's
    ``idle_s`` on the rank's clock, so it stays exact) nor :data:`MAX_BEAT_S`."""
    beat = max(1.0, world_size / BEATS_PER_S)
    if stall_timeout is not None:
        beat = min(beat, max(1.0, stall_timeout / 4))
    return min(beat, MAX_BEAT_S)


def parse_beat(value: str | None) -> float:
    """``EVENTBUS_BEAT_S``'s value: seconds from 1 to :data:`MAX_BEAT_S`; unset, empty or
    anything else: 1.0."""
    try:
        beat = float(value) if value else 1.0
    except ValueError:
        return 1.0
    return beat if 1.0 <= beat <= MAX_BEAT_S else 1.0
#: every progress source, in their canonical order
PROGRESS_SOURCES = ("collectives", "steps", "events")
#: ``data[EXITING_KEY] = True`` in a worker's last heartbeat: its script has ended
EXITING_KEY = "exiting"
#: ``data[EXPECT_SILENCE_KEY] = seconds`` in any event announces a quiet period
EXPECT_SILENCE_KEY = "expect_silence_s"
#: an idle heartbeat's evidence of what the main thread does (a dict:
#: eventbus_app/health/evidence.py reads it, eventbus_app/worker/activity.py writes it)
ACTIVITY_KEY = "activity"
#: a beat's start-up marks of the worker, after its first step (eventbus_app/worker/marks.py
#: writes them, eventbus_app/launcher/recovery/anatomy.py reads them)
MARKS_KEY = "marks"

_OFF = "off"
_ALL = "all"
_ACCEPTED = (f"use {_OFF}, {_ALL}, or a comma list of {', '.join(PROGRESS_SOURCES)} "
             f"(empty: {_ALL})")


def parse_progress(text: str) -> tuple[str, ...]:
    """The progress sources ``text`` names, in :data:`PROGRESS_SOURCES` order: the one
    grammar of ``--progress`` (the agent's command line) and ``EVENTBUS_PROGRESS`` (the
    worker's environment).

    * ``""`` (blanks only, or the variable unset) and ``all``: all three sources;
    * ``off``: none;
    * a comma list of ``collectives``, ``steps``, ``events``, in any order (a repeat counts
      once).

    Case and the blanks around each item are ignored. Anything else (a word that is no
    source, an empty item as in ``steps,``, ``off`` or ``all`` inside a list) raises
    ``ValueError`` whose message names the bad item and says what is accepted; it reads
    after the value (``EVENTBUS_PROGRESS='steps,gpu' names 'gpu', which is ...``).
    """
    folded = text.strip().lower()
    if folded in ("", _ALL):
        return PROGRESS_SOURCES
    if folded == _OFF:
        return ()
    items = [item.strip() for item in folded.split(",")]
    for item in items:
        if item in (_OFF, _ALL):
            raise ValueError(f"names {item!r} in a list ({item!r} stands alone); {_ACCEPTED}")
        if item not in PROGRESS_SOURCES:
            raise ValueError(f"names {item!r}, which is no progress source; {_ACCEPTED}")
    return tuple(source for source in PROGRESS_SOURCES if source in items)


def format_progress(sources: Iterable[str]) -> str:
    """``EVENTBUS_PROGRESS``'s value for ``sources`` as the agent writes it: ``off`` for
    none, else their comma list in canonical order, which :func:`parse_progress` reads back
    to the same sources. A name that is no source raises ``ValueError``."""
    named = set(sources)
    bad = sorted(named.difference(PROGRESS_SOURCES))
    if bad:
        raise ValueError(f"names {bad[0]!r}, which is no progress source; {_ACCEPTED}")
    return ",".join(s for s in PROGRESS_SOURCES if s in named) or _OFF


# -- the flight recorder -----------------------------------------------------------------

#: the flight recorder's ring size, set for the workers unless the user set one of
#: :data:`FR_USER_SETTINGS` (torch reads it when a process group is created)
ENV_FR_BUFFER = "TORCH_FR_BUFFER_SIZE"
FR_USER_SETTINGS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
FR_BUFFER_SIZE = 64
#: the folder the agent asks for flight-recorder dumps in: absolute, created by the agent
ENV_FR_DUMP_DIR = "EVENTBUS_FR_DUMP_DIR"
#: the request file in that folder (a token, written whole: a temp file and a rename)
FR_REQUEST_FILE = "request"
#: a request's token: at most this many characters, one line
MAX_FR_TOKEN_CHARS = 200
#: each rank's dump: ``<prefix><global rank>``, as torch's ``fr_trace`` loader reads it
#: (it infers the prefix; the request file and the workers' temp files do not match it)
FR_DUMP_PREFIX = "fr_trace_rank_"
#: the heartbeat's answer to a request: the token served, and the dump's path or why none
FR_DUMP_TOKEN_KEY = "fr_dump_token"
FR_DUMP_KEY = "fr_dump"
FR_DUMP_ERROR_KEY = "fr_dump_error"


def fr_dump_root(run_id: str) -> str:
    """The run's folder of flight-recorder dumps: the same path on every node
    (``$TMPDIR/eventbus-fr/<run id>``); an attempt's folder that holds a dump is kept after
    the job, the others are removed at the agent's end."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in run_id) or "run"
    return os.path.join(tempfile.gettempdir(), "eventbus-fr", safe)


def fr_dump_folder(root: str, attempt: int) -> str:
    """One attempt's dump folder under :func:`fr_dump_root` (the workers'
    ``EVENTBUS_FR_DUMP_DIR``)."""
    return os.path.join(root, f"attempt{attempt}")


def fr_dump_path(folder: str, rank: int) -> str:
    """Where the worker of global rank ``rank`` writes its trace:
    ``<folder>/fr_trace_rank_<rank>``."""
    return os.path.join(folder, f"{FR_DUMP_PREFIX}{rank}")


def write_fr_request(folder: str, token: str) -> None:
    """The agent's request: ``token`` (1 to :data:`MAX_FR_TOKEN_CHARS` printable
    characters, else ``ValueError``) to ``<folder>/request``, the folder created if need
    be. Written to a temp file that is renamed over it, so a worker reads the token whole
    or not at all, and each request is a new file that :class:`FrRequestReader` tells from
    the last one even within one tick of the file system's clock. ``OSError`` when the
    folder cannot be written."""
    if not 0 < len(token) <= MAX_FR_TOKEN_CHARS or not token.isprintable():
        raise ValueError(f"a flight-recorder request's token is 1-{MAX_FR_TOKEN_CHARS} "
                         f"printable characters, not {token[:MAX_FR_TOKEN_CHARS]!r}")
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{FR_REQUEST_FILE}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(token + "\n")
    os.replace(tmp, os.path.join(folder, FR_REQUEST_FILE))


class FrRequestReader:
    """The worker's reader of ``<folder>/request``: :meth:`take` returns each new request's
    token once. A request older than the reader (a former attempt's) is never served. A
    request is told from the last one by the file's modification time and inode (each
    :func:`write_fr_request` makes a new file)."""

    __slots__ = ("_seen", "folder")

    def __init__(self, folder: str | None) -> None:
        self.folder = folder
        self._seen = self._stamp()

    def _stamp(self) -> tuple[int, int] | None:
        if self.folder is None:
            return None
        try:
            st = os.stat(os.path.join(self.folder, FR_REQUEST_FILE))
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_ino)

    def take(self) -> str | None:
        """A new request's token (its first line, at most :data:`MAX_FR_TOKEN_CHARS`
        characters), once; None when there is no new one, or it cannot be read."""
        stamp = self._stamp()
        if stamp is None or stamp == self._seen:
            return None
        self._seen = stamp
        try:
            with open(os.path.join(str(self.folder), FR_REQUEST_FILE), encoding="utf-8",
                      errors="replace") as f:
                text = f.read(MAX_FR_TOKEN_CHARS + 2)
        except OSError:
            return None
        lines = text.splitlines()
        return (lines[0].strip() if lines else "")[:MAX_FR_TOKEN_CHARS]


# -- the stack dump ----------------------------------------------------------------------

#: the folder the agent reads stacks from; set only when ``--stall-timeout`` is on
ENV_STACK_DIR = "EVENTBUS_STACK_DIR"
#: the signal the worker dumps its stacks on: a name (``SIGUSR2``), a number, or ``off``
#: for a script that uses the default signal itself (the agent then sends nothing)
ENV_STACK_SIGNAL = "EVENTBUS_STACK_SIGNAL"


def stack_signal_path(directory: str, pid: int) -> str:
    """``<directory>/<pid>.sig``: the signal's number (decimal) that the worker ``pid``
    dumps its stacks on, present only once the handler is armed."""
    return os.path.join(directory, f"{pid}.sig")


def stack_file_path(directory: str, pid: int) -> str:
    """``<directory>/<pid>.stack``: the worker ``pid`` appends every thread's stack here at
    each signal."""
    return os.path.join(directory, f"{pid}.stack")


def read_stack_signal(directory: str, pid: int) -> int:
    """The signal the worker ``pid`` armed, from its ``.sig`` file: ``OSError`` when it
    wrote none (not armed, opted out), ``ValueError`` when the file holds no signal
    number."""
    with open(stack_signal_path(directory, pid), encoding="utf-8") as f:
        text = f.read(16).strip()
    if not (text.isascii() and text.isdecimal() and 0 < int(text) < 1024):
        raise ValueError(f"{stack_signal_path(directory, pid)} holds no signal number")
    return int(text)
