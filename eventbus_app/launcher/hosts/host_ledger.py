"""The host ledger: every agent's host outcomes, per job and attempt, kept across jobs.

A bad machine fails job after job; only a record that outlives the job can say so. Each
agent records its host's outcome at the end of each attempt (:class:`LedgerWriter`),
``eventbus run --exclude-bad-hosts`` asks for its host's score before the rendezvous
(:func:`host_score`), ``eventbus hosts`` reads them all (:func:`read_hosts`).

Where (``--host-ledger``, ``eventbus hosts --ledger``): a SQLite file, by default
:func:`default_ledger_path`, or ``postgresql://...`` for a cluster
(:mod:`eventbus.app.launcher.hosts.store`).

The ledger is a bystander of the job: it must never fail it nor delay it. ``record()``
puts the outcome on a queue and returns; one daemon thread writes. When the ledger cannot
be written (locked, read-only, corrupt, on a full disk, a server down or refusing) the
thread says so once per kind of trouble, through ``warn``, keeps the outcomes in the spool
(:mod:`eventbus.app.launcher.hosts.spool`) and tries again with a growing backoff; ``close()``
waits at most its timeout and spools what is left. The next writer that reaches the
ledger writes the spool first. A row is keyed by host, job and attempt and written as an
upsert, so writing it again never doubles it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from collections.abc import Iterable
from pathlib import Path

from eventbus.app.launcher.hosts.score import HostSummary
from eventbus.app.launcher.hosts.score import score
from eventbus.app.launcher.hosts.score import summarize
from eventbus.app.launcher.hosts.spool import Spool
from eventbus.app.launcher.hosts.store import HostOutcome
from eventbus.app.launcher.hosts.store import LedgerError
from eventbus.app.launcher.hosts.store import LedgerSpec
from eventbus.app.launcher.hosts.store import LedgerSpecError
from eventbus.app.launcher.hosts.store import open_store
from eventbus.app.launcher.hosts.store import parse_spec

__all__ = [
    "DEFAULT_LEDGER_ENV",
    "SPOOL_ENV",
    "HostOutcome",
    "HostSummary",
    "LedgerError",
    "LedgerSpecError",
    "LedgerWriter",
    "default_ledger_path",
    "default_spool_path",
    "host_score",
    "read_hosts",
    "read_outcomes",
    "spooled",
    "write_outcomes",
]

#: the variable that names the ledger when ``--host-ledger`` does not
DEFAULT_LEDGER_ENV = "EVENTBUS_HOST_LEDGER"
#: the variable that names the spool file
SPOOL_ENV = "EVENTBUS_HOST_LEDGER_SPOOL"

#: the writer's first wait after a failure, and its longest
BACKOFF_FIRST_S = 0.25
BACKOFF_MAX_S = 30.0
#: the longest wait for the spool's lock (the writer's thread; close() waits less)
SPOOL_LOCK_S = 10.0

_STOP = -1


def _state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or ""
    root = Path(base) if os.path.isabs(base) else Path.home() / ".local" / "state"
    return root / "eventbus"


def default_ledger_path() -> str:
    """``$EVENTBUS_HOST_LEDGER``, else ``$XDG_STATE_HOME/eventbus/hosts.sqlite``, else
    ``~/.local/state/eventbus/hosts.sqlite``."""
    return os.environ.get(DEFAULT_LEDGER_ENV) or str(_state_dir() / "hosts.sqlite")


def default_spool_path() -> str:
    """``$EVENTBUS_HOST_LEDGER_SPOOL``, else ``hosts-spool.jsonl`` in the state folder of
    :func:`default_ledger_path` (``$XDG_STATE_HOME/eventbus``, ``~/.local/state/eventbus``)."""
    return os.environ.get(SPOOL_ENV) or str(_state_dir() / "hosts-spool.jsonl")


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _spec(spec: str | None) -> LedgerSpec:
    return parse_spec(default_ledger_path() if spec is None else spec)


class LedgerWriter:
    """Records outcomes into one ledger without ever failing or delaying the caller.

    ``spec``: a SQLite path or a ``postgresql://`` URL (None: :func:`default_ledger_path`).
    ``warn`` gets one line per kind of trouble, ``eventbus: host ledger <spec>: <cause>...``.
    ``spool`` (default :func:`default_spool_path`) and ``timeout`` (a lock wait or a
    connection, in the writer's thread) are for tests and special set-ups.
    """

    def __init__(self, spec: str | None, *, warn: Callable[[str], None] = _stderr,
                 spool: str | Path | None = None, timeout: float = 5.0) -> None:
        self._warn = warn
        self._said: set[str] = set()
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._pending: dict[int, HostOutcome] = {}
        self._seq = itertools.count()
        self._closed = False
        self._quiet = False
        self.spool = Spool(spool if spool is not None else default_spool_path())
        #: outcomes written to the ledger, and kept in the spool, by this writer
        self.written = 0
        self.spooled = 0
        self.spec: LedgerSpec | None = None
        try:
            self.spec = _spec(spec)
            self._store = open_store(self.spec, timeout=timeout)
            self._thread: threading.Thread | None = threading.Thread(
                target=self._run, name="eventbus-host-ledger", daemon=True)
            self._thread.start()
        except LedgerSpecError as exc:
            self._say("spec", f"eventbus: {exc}; host outcomes are not recorded")
            self._thread = None
        except Exception as exc:
            self._say("start", f"eventbus: host ledger: cannot start its writer ({exc}); "
                               "host outcomes are not recorded")
            self._thread = None

    # -- the caller's side -----------------------------------------------------------------
    def record(self, outcome: HostOutcome) -> None:
        """Queue ``outcome`` for the ledger; returns at once, never raises."""
        try:
            if self._thread is None:
                return
            with self._lock:
                seq = next(self._seq)
                self._pending[seq] = outcome
            if self._closed:
                self._keep([seq], time.monotonic() + 0.5)
            else:
                self._queue.put(seq)
        except Exception:
            return

    def close(self, timeout: float = 2.0) -> None:
        """Let the thread write what it can within ``timeout`` seconds; spool the rest.
        Never raises."""
        try:
            if self._closed or self._thread is None:
                return
            self._closed = True
            deadline = time.monotonic() + max(0.0, timeout)
            self._queue.put(_STOP)
            self._thread.join(max(0.0, timeout))
            with self._lock:
                left = sorted(self._pending)
            if left:
                self._keep(left, max(deadline, time.monotonic() + 0.1))
            self._quiet = True
        except Exception:
            return

    def __enter__(self) -> LedgerWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what is said ----------------------------------------------------------------------
    def _say(self, kind: str, line: str) -> None:
        if kind in self._said or self._quiet:
            return
        self._said.add(kind)
        with contextlib.suppress(Exception):
            self._warn(line)

    def _trouble(self, exc: LedgerError) -> None:
        assert self.spec is not None
        self._say(exc.kind, f"eventbus: host ledger {self.spec.shown}: {exc.text}; its "
                            f"outcomes are kept in {self.spool.path} and written when it "
                            "can be (the job goes on)")

    # -- the writer's thread ---------------------------------------------------------------
    def _done(self, seqs: Iterable[int], *, spooled: bool) -> None:
        with self._lock:
            for seq in seqs:
                if self._pending.pop(seq, None) is not None:
                    if spooled:
                        self.spooled += 1
                    else:
                        self.written += 1

    def _keep(self, seqs: list[int], deadline: float) -> bool:
        """Append these outcomes to the spool; False (said once) when the disk refuses."""
        assert self.spec is not None
        with self._lock:
            outcomes = [self._pending[s] for s in seqs if s in self._pending]
        try:
            self.spool.append(self.spec, outcomes, deadline=deadline)
        except OSError as exc:
            self._say("spool", f"eventbus: host ledger {self.spec.shown}: cannot keep "
                               f"{len(outcomes)} outcome(s) in {self.spool.path} "
                               f"({exc.strerror or exc}); they are lost if it cannot be "
                               "written before the agent ends")
            return False
        self._done(seqs, spooled=True)
        return True

    def _write(self, seqs: list[int]) -> None:
        with self._lock:
            outcomes = [self._pending[s] for s in seqs if s in self._pending]
        self._store.write(outcomes)
        self._done(seqs, spooled=False)

    def _flush_spool(self) -> None:
        assert self.spec is not None
        try:
            self.spool.flush(self.spec, self._store.write,
                             deadline=time.monotonic() + SPOOL_LOCK_S)
        except (OSError, TimeoutError) as exc:
            raise LedgerError("spool", f"cannot use its spool {self.spool.path} "
                                       f"({getattr(exc, 'strerror', None) or exc})") from exc

    def _run(self) -> None:
        spool_due = True
        backlog: list[int] = []
        backoff = BACKOFF_FIRST_S
        next_try = 0.0
        stop = False
        while True:
            wait = None if not (spool_due or backlog) else max(0.0,
                                                                 next_try - time.monotonic())
            try:
                seq = self._queue.get(timeout=wait)
                while True:
                    if seq == _STOP:
                        stop = True
                    else:
                        backlog.append(seq)
                    seq = self._queue.get_nowait()
            except queue.Empty:
                pass
            if time.monotonic() >= next_try or stop:
                try:
                    if spool_due:
                        self._flush_spool()
                        spool_due = False
                    if backlog:
                        self._write(backlog)
                        backlog = []
                    backoff, next_try = BACKOFF_FIRST_S, 0.0
                except LedgerError as exc:
                    self._trouble(exc)
                    next_try = time.monotonic() + backoff
                    backoff = min(backoff * 2, BACKOFF_MAX_S)
                except Exception as exc:
                    self._trouble(LedgerError("error", f"{type(exc).__name__}: {exc}"))
                    next_try = time.monotonic() + backoff
                    backoff = min(backoff * 2, BACKOFF_MAX_S)
            if backlog and next_try > 0.0 and self._keep(
                    backlog, time.monotonic() + SPOOL_LOCK_S):
                backlog = []
                spool_due = True
            if stop:
                return


# -- reading -------------------------------------------------------------------------------

def read_outcomes(spec: str | None, *, host: str | None = None, since: float | None = None,
                  timeout: float = 5.0) -> list[HostOutcome]:
    """The ledger's rows (of ``host``, from ``since``), with the spool's outcomes for it
    that are not written yet. Raises :class:`LedgerError` or :class:`LedgerSpecError`."""
    parsed = _spec(spec)
    rows = {o.key: o for o in open_store(parsed, timeout=timeout).read(host=host, since=since)}
    for outcome in Spool(default_spool_path()).pending(parsed):
        if (host is None or outcome.host == host) and (since is None or outcome.time >= since):
            rows[outcome.key] = outcome
    return list(rows.values())


def spooled(spec: str | None) -> int:
    """How many outcomes for this ledger wait in the spool."""
    return len(Spool(default_spool_path()).pending(_spec(spec)))


def read_hosts(spec: str | None, *, since_s: float | None = None,
               now: float | None = None) -> list[HostSummary]:
    """Every host of the ledger, the highest score first; ``since_s``: only the outcomes
    of the last so many seconds. Raises :class:`LedgerError`, :class:`LedgerSpecError`."""
    at = time.time() if now is None else now
    since = None if since_s is None else at - since_s
    return summarize(read_outcomes(spec, since=since), at)


def host_score(spec: str | None, host: str, *, now: float | None = None,
               timeout: float = 2.0) -> float | None:
    """``host``'s score (0.0 for a host the ledger never saw); None when the ledger
    cannot be read within ``timeout`` seconds. Never raises."""
    at = time.time() if now is None else now
    result: list[float] = []

    def read() -> None:
        try:
            result.append(score(read_outcomes(spec, host=host, timeout=timeout), at))
        except Exception:
            return

    try:
        reader = threading.Thread(target=read, name="eventbus-host-score", daemon=True)
        reader.start()
        reader.join(max(0.0, timeout))
    except Exception:
        return None
    return result[0] if result else None


def write_outcomes(spec: str | None, outcomes: list[HostOutcome], *,
                   timeout: float = 5.0) -> None:
    """Write ``outcomes`` now, in one transaction (``eventbus hosts --from``). Raises
    :class:`LedgerError` or :class:`LedgerSpecError`."""
    open_store(_spec(spec), timeout=timeout).write(outcomes)
