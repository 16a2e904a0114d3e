"""Where host outcomes are kept: a SQLite file, or a PostgreSQL database, one table shape.

One row per host, job and attempt (the primary key), written as an upsert: the last write
of a row wins and a retry never doubles it. Both stores create their schema on first
write: ``eventbus_host_outcomes`` and ``eventbus_schema_version`` (one row, the
version; a ledger of a newer version is never written).

SQLite is the default, for one machine: WAL mode, so readers never wait for the writer
and many agents write in turn (a busy timeout, one short ``BEGIN IMMEDIATE`` transaction
per batch). A file that is not a SQLite database is never opened for writing: a corrupt
ledger is left as it is for a person to look at. PostgreSQL (``postgresql://...``) is for
a cluster; psycopg 3 is imported only when one is used (the ``postgres`` extra).

Every failure is a :class:`LedgerError` whose ``kind`` says what is wrong (``locked``,
``read-only``, ``corrupt``, ``full``, ``unreachable``, ``missing-extra``, ``error``) and
whose text says it with the spec, its password hidden.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import sqlite3
import urllib.parse
from collections.abc import Iterable
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from typing import Protocol

import attrs

__all__ = [
    "SCHEMA_VERSION",
    "HostOutcome",
    "LedgerError",
    "LedgerSpec",
    "LedgerSpecError",
    "PostgresStore",
    "SqliteStore",
    "Store",
    "open_store",
    "outcome_from_json",
    "parse_spec",
    "redact",
]

SCHEMA_VERSION = 1
TABLE = "eventbus_host_outcomes"
VERSION_TABLE = "eventbus_schema_version"
_SQLITE_MAGIC = b"SQLite format 3\x00"
_SCHEMES = ("postgresql://", "postgres://")
_COLUMNS = "host, job, attempt, time, faults, culprit, straggler, clean"


@attrs.frozen
class HostOutcome:
    """A host's outcome in one attempt of one job: one row of the ledger."""

    host: str
    #: the job's run id
    job: str
    attempt: int
    #: unix seconds, the attempt's end
    time: float
    #: host faults by kind: ``signal``, ``oom``, ``cuda``, ``nccl``, ``ecc``, ``hang``,
    #: ``straggler``, ``reactor``
    faults: dict[str, int]
    #: times a rank on this host was the culprit of a hang
    culprit: int = 0
    #: times a rank on this host was a persistent straggler
    straggler: int = 0
    #: the attempt finished cleanly on this host
    clean: bool = False

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.host, self.job, self.attempt)

    def to_json(self) -> dict[str, Any]:
        return {"host": self.host, "job": self.job, "attempt": self.attempt,
                "time": self.time, "faults": dict(self.faults), "culprit": self.culprit,
                "straggler": self.straggler, "clean": self.clean}

    def _row(self) -> tuple[str, str, int, float, str, int, int, int]:
        faults = json.dumps({str(k): int(v) for k, v in self.faults.items()}, sort_keys=True)
        return (self.host, self.job, int(self.attempt), float(self.time), faults,
                int(self.culprit), int(self.straggler), int(bool(self.clean)))


def _count(value: object) -> int | None:
    return value if type(value) is int and value >= 0 else None


def outcome_from_json(raw: object) -> HostOutcome | None:
    """An outcome from its JSON object (a spool line, a row's columns); None when it is
    not one."""
    if not isinstance(raw, dict):
        return None
    host, job = raw.get("host"), raw.get("job")
    attempt, time = _count(raw.get("attempt")), raw.get("time")
    faults = raw.get("faults")
    if isinstance(faults, str):
        try:
            faults = json.loads(faults)
        except ValueError:
            return None
    if not (isinstance(host, str) and host and isinstance(job, str) and attempt is not None
            and isinstance(time, (int, float)) and not isinstance(time, bool)
            and math.isfinite(time) and isinstance(faults, dict)):
        return None
    counts = {k: _count(v) for k, v in faults.items()}
    culprit, straggler = _count(raw.get("culprit", 0)), _count(raw.get("straggler", 0))
    if culprit is None or straggler is None or any(
            not isinstance(k, str) or v is None for k, v in counts.items()):
        return None
    return HostOutcome(host=host, job=job, attempt=attempt, time=float(time),
                       faults={k: v for k, v in counts.items() if v is not None},
                       culprit=culprit, straggler=straggler, clean=bool(raw.get("clean")))


# -- specs ---------------------------------------------------------------------------------

class LedgerSpecError(ValueError):
    """A ``--host-ledger`` / ``--ledger`` value that is neither a path nor a URL we know."""


@attrs.frozen
class LedgerSpec:
    """Where the ledger is: a SQLite file (``path``) or a PostgreSQL URL (``url``)."""

    path: Path | None = None
    url: str | None = None

    @property
    def shown(self) -> str:
        """The spec for people and logs: the path, or the URL with its password hidden."""
        return redact(self.url) if self.url is not None else str(self.path)

    @property
    def key(self) -> str:
        """Names this ledger in the spool, without its password in clear."""
        text = self.url if self.url is not None else f"sqlite:{self.path}"
        return hashlib.sha256(text.encode()).hexdigest()[:24]


def parse_spec(spec: str) -> LedgerSpec:
    """``postgresql://...`` (or ``postgres://``) is PostgreSQL; anything else without a
    ``scheme://`` is a SQLite file (``~`` expanded, made absolute)."""
    text = spec.strip()
    if not text:
        raise LedgerSpecError("the host ledger is empty: give a file path or a "
                              "postgresql:// URL")
    if text.startswith(_SCHEMES):
        return LedgerSpec(url=text)
    if "://" in text:
        scheme = text.split("://", 1)[0]
        raise LedgerSpecError(f"host ledger {redact(text)}: {scheme}:// is not supported; "
                              "give a SQLite file path or a postgresql:// URL")
    return LedgerSpec(path=Path(os.path.abspath(os.path.expanduser(text))))


def redact(url: str) -> str:
    """The URL with its password (in the authority or a ``password=`` parameter) hidden."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return "<a URL that does not parse>"
    netloc = parts.netloc
    if "@" in netloc:
        user, _, host = netloc.rpartition("@")
        if ":" in user:
            user = user.split(":", 1)[0] + ":***"
        netloc = f"{user}@{host}"
    query = "&".join(f"{item.partition('=')[0]}=***"
                     if item.partition("=")[0].lower() == "password" else item
                     for item in parts.query.split("&") if item)
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


# -- errors --------------------------------------------------------------------------------

class LedgerError(Exception):
    """The ledger could not be read or written; ``kind`` says why in one word."""

    def __init__(self, kind: str, text: str) -> None:
        super().__init__(text)
        self.kind = kind
        self.text = text


def _sqlite_error(path: Path, exc: BaseException) -> LedgerError:
    text = str(exc)
    lowered = text.lower()
    if isinstance(exc, OSError):
        if exc.errno == errno.ENOSPC:
            return LedgerError("full", f"the disk is full ({exc.strerror})")
        if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            return LedgerError("read-only", f"cannot write there ({exc.strerror})")
        return LedgerError("error", exc.strerror or text)
    name = str(getattr(exc, "sqlite_errorname", ""))
    if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")) or "locked" in lowered:
        return LedgerError("locked", f"locked by another process ({text})")
    if name.startswith("SQLITE_READONLY") or "readonly" in lowered:
        return LedgerError("read-only", f"read-only ({text})")
    io_error = name.startswith("SQLITE_IOERR") or "i/o error" in lowered
    if name == "SQLITE_FULL" or "disk is full" in lowered or (io_error and _no_space(path)):
        return LedgerError("full", f"the disk is full ({text})")
    if name.startswith(("SQLITE_NOTADB", "SQLITE_CORRUPT")) or "not a database" in lowered \
            or "malformed" in lowered:
        return _corrupt(text)
    if "unable to open" in lowered and _read_only_fs(path):
        return LedgerError("read-only", f"on a read-only file system ({text})")
    return LedgerError("error", text)


def _corrupt(why: str) -> LedgerError:
    return LedgerError("corrupt", f"not a SQLite database, corrupt? ({why}); the file is "
                                  "left as it is: move it away to start a new ledger")


def _no_space(path: Path) -> bool:
    """Less than 64 KiB free where the file is (SQLite reports a full disk under its
    shared-memory file as an I/O error)."""
    try:
        stat = os.statvfs(path.parent)
    except OSError:
        return False
    return stat.f_bavail * stat.f_frsize < 64 * 1024


def _read_only_fs(path: Path) -> bool:
    for candidate in (path, *path.parents):
        try:
            return bool(os.statvfs(candidate).f_flag & os.ST_RDONLY)
        except OSError:
            continue
    return False


# -- the stores ----------------------------------------------------------------------------

class Store(Protocol):
    """One ledger's table, written and read."""

    spec: LedgerSpec

    def write(self, outcomes: Sequence[HostOutcome]) -> None: ...

    def read(self, *, host: str | None = None, since: float | None = None
             ) -> list[HostOutcome]: ...


def _where(host: str | None, since: float | None, mark: str) -> tuple[str, list[Any]]:
    clauses: list[str] = []
    args: list[Any] = []
    if host is not None:
        clauses.append(f"host = {mark}")
        args.append(host)
    if since is not None:
        clauses.append(f"time >= {mark}")
        args.append(since)
    return (" WHERE " + " AND ".join(clauses) if clauses else ""), args


def _outcomes(rows: Iterable[Sequence[Any]]) -> list[HostOutcome]:
    found = []
    for row in rows:
        outcome = outcome_from_json(dict(zip(_COLUMNS.split(", "), row, strict=True)))
        if outcome is not None:
            found.append(outcome)
    return found


def _schema(real: str) -> list[str]:
    return [
        f"CREATE TABLE IF NOT EXISTS {VERSION_TABLE} (version INTEGER NOT NULL)",
        f"CREATE TABLE IF NOT EXISTS {TABLE} (host TEXT NOT NULL, job TEXT NOT NULL, "
        f"attempt INTEGER NOT NULL, time {real} NOT NULL, faults TEXT NOT NULL, "
        "culprit INTEGER NOT NULL DEFAULT 0, straggler INTEGER NOT NULL DEFAULT 0, "
        "clean INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (host, job, attempt))",
        f"CREATE INDEX IF NOT EXISTS {TABLE}_time ON {TABLE} (time)",
    ]


def _upsert(mark: str) -> str:
    marks = ", ".join([mark] * 8)
    return (f"INSERT INTO {TABLE} ({_COLUMNS}) VALUES ({marks}) "
            "ON CONFLICT (host, job, attempt) DO UPDATE SET time = excluded.time, "
            "faults = excluded.faults, culprit = excluded.culprit, "
            "straggler = excluded.straggler, clean = excluded.clean")


def _newer(version: int) -> LedgerError:
    return LedgerError("error", f"written by a newer eventbus (schema {version}, this one "
                                f"knows {SCHEMA_VERSION}); upgrade eventbus to write it")


class SqliteStore:
    """A SQLite file in WAL mode."""

    def __init__(self, spec: LedgerSpec, *, busy_timeout: float = 5.0) -> None:
        assert spec.path is not None
        self.spec = spec
        self.path = spec.path
        self.busy_timeout = busy_timeout

    def _check_header(self) -> bool:
        """True when the file exists; a file that is not SQLite's is corrupt."""
        try:
            with open(self.path, "rb") as f:
                head = f.read(len(_SQLITE_MAGIC))
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise _sqlite_error(self.path, exc) from exc
        if head and head != _SQLITE_MAGIC:
            raise _corrupt("its first bytes are not SQLite's header")
        return True

    def write(self, outcomes: Sequence[HostOutcome]) -> None:
        if not outcomes:
            return
        try:
            self._check_header()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, timeout=self.busy_timeout, isolation_level=None)
        except LedgerError:
            raise
        except (OSError, sqlite3.Error) as exc:
            raise _sqlite_error(self.path, exc) from exc
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("BEGIN IMMEDIATE")
            try:
                for statement in _schema("REAL"):
                    db.execute(statement)
                version = db.execute(f"SELECT MAX(version) FROM {VERSION_TABLE}").fetchone()[0]
                if version is None:
                    db.execute(f"INSERT INTO {VERSION_TABLE} VALUES (?)", (SCHEMA_VERSION,))
                elif version > SCHEMA_VERSION:
                    raise _newer(version)
                db.executemany(_upsert("?"), [o._row() for o in outcomes])
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise
        except LedgerError:
            raise
        except (OSError, sqlite3.Error) as exc:
            raise _sqlite_error(self.path, exc) from exc
        finally:
            db.close()

    def read(self, *, host: str | None = None, since: float | None = None
             ) -> list[HostOutcome]:
        """The rows (none when the file does not exist yet); read-only, never creates."""
        try:
            if not self._check_header():
                return []
            uri = "file:" + urllib.parse.quote(str(self.path)) + "?mode=ro"
            if _read_only_fs(self.path):
                uri += "&immutable=1"
            db = sqlite3.connect(uri, uri=True, timeout=self.busy_timeout)
        except LedgerError:
            raise
        except (OSError, sqlite3.Error) as exc:
            raise _sqlite_error(self.path, exc) from exc
        try:
            tables = {name for (name,) in db.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table'")}
            if TABLE not in tables:
                return []
            where, args = _where(host, since, "?")
            return _outcomes(db.execute(f"SELECT {_COLUMNS} FROM {TABLE}{where}", args))
        except sqlite3.Error as exc:
            raise _sqlite_error(self.path, exc) from exc
        finally:
            db.close()


def _psycopg(spec: LedgerSpec) -> Any:
    try:
        import psycopg
    except ImportError as exc:
        raise LedgerError("missing-extra", "a PostgreSQL ledger needs psycopg, which is not "
                                           "installed: pip install 'eventbus[postgres]'"
                          ) from exc
    return psycopg


def _pg_error(psycopg: Any, exc: BaseException) -> LedgerError:
    text = " ".join(str(exc).split()) or type(exc).__name__
    state = getattr(exc, "sqlstate", None) or ""
    if state.startswith("53"):
        return LedgerError("full", f"the server is out of resources ({text})")
    if state == "25006":
        return LedgerError("read-only", f"read-only ({text})")
    if state.startswith(("08", "57")) or (not state and isinstance(exc, (
            psycopg.OperationalError, OSError))):
        return LedgerError("unreachable", f"cannot reach the server ({text})")
    return LedgerError("error", text)


class PostgresStore:
    """A PostgreSQL table, through psycopg 3."""

    def __init__(self, spec: LedgerSpec, *, timeout: float = 5.0) -> None:
        assert spec.url is not None
        self.spec = spec
        self.url = spec.url
        self.timeout = timeout

    def _connect(self) -> Any:
        psycopg = _psycopg(self.spec)
        return psycopg.connect(self.url, connect_timeout=max(1, math.ceil(self.timeout)))

    def write(self, outcomes: Sequence[HostOutcome]) -> None:
        if not outcomes:
            return
        psycopg = _psycopg(self.spec)
        try:
            with self._connect() as db, db.cursor() as cur:
                cur.execute(f"SET LOCAL statement_timeout = {int(self.timeout * 1000)}")
                cur.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (TABLE,))
                for statement in _schema("DOUBLE PRECISION"):
                    cur.execute(statement)
                cur.execute(f"SELECT MAX(version) FROM {VERSION_TABLE}")
                version = cur.fetchone()[0]
                if version is None:
                    cur.execute(f"INSERT INTO {VERSION_TABLE} VALUES (%s)", (SCHEMA_VERSION,))
                elif version > SCHEMA_VERSION:
                    raise _newer(version)
                cur.executemany(_upsert("%s"), [o._row() for o in outcomes])
        except LedgerError:
            raise
        except (psycopg.Error, OSError) as exc:
            raise _pg_error(psycopg, exc) from exc

    def read(self, *, host: str | None = None, since: float | None = None
             ) -> list[HostOutcome]:
        psycopg = _psycopg(self.spec)
        try:
            with self._connect() as db, db.cursor() as cur:
                cur.execute(f"SET LOCAL statement_timeout = {int(self.timeout * 1000)}")
                cur.execute("SELECT to_regclass(%s)", (TABLE,))
                if cur.fetchone()[0] is None:
                    return []
                where, args = _where(host, since, "%s")
                cur.execute(f"SELECT {_COLUMNS} FROM {TABLE}{where}", args)
                return _outcomes(cur.fetchall())
        except (psycopg.Error, OSError) as exc:
            raise _pg_error(psycopg, exc) from exc


def open_store(spec: LedgerSpec, *, timeout: float = 5.0) -> Store:
    """The store of ``spec``; ``timeout`` bounds a lock wait or a connection."""
    if spec.url is not None:
        return PostgresStore(spec, timeout=timeout)
    return SqliteStore(spec, busy_timeout=timeout)
