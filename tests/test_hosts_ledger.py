"""The host ledger (RELIABILITY row 45): the score, the hostlist notation, the SQLite
and PostgreSQL stores, and the writer under faults.

The faults are real: a SQLite file locked by another connection's write transaction, a
read-only bind mount and an immutable file (root ignores file modes), garbage bytes, a tiny
tmpfs filled to the last byte, 20 processes writing at once, a PostgreSQL server stopped
mid-job and one that refuses writes. Each says what the job saw (``record()``'s time, the
warnings) and the rows written against the rows expected.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from eventbus.app.launcher.hosts import score as scoring
from eventbus.app.launcher.hosts.host_ledger import DEFAULT_LEDGER_ENV
from eventbus.app.launcher.hosts.host_ledger import SPOOL_ENV
from eventbus.app.launcher.hosts.host_ledger import HostOutcome
from eventbus.app.launcher.hosts.host_ledger import LedgerError
from eventbus.app.launcher.hosts.host_ledger import LedgerWriter
from eventbus.app.launcher.hosts.host_ledger import default_ledger_path
from eventbus.app.launcher.hosts.host_ledger import default_spool_path
from eventbus.app.launcher.hosts.host_ledger import host_score
from eventbus.app.launcher.hosts.host_ledger import read_hosts
from eventbus.app.launcher.hosts.host_ledger import read_outcomes
from eventbus.app.launcher.hosts.host_ledger import spooled
from eventbus.app.launcher.hosts.host_ledger import write_outcomes
from eventbus.app.launcher.hosts.store import LedgerSpecError
from eventbus.app.launcher.hosts.store import open_store
from eventbus.app.launcher.hosts.store import parse_spec
from eventbus.app.launcher.hosts.store import redact
from eventbus.app.launcher.slurm.hostlist import HostlistError
from eventbus.app.launcher.slurm.hostlist import compress
from eventbus.app.launcher.slurm.hostlist import expand
from tests.conftest import subprocess_env
from tests.postgres_server import PostgresServer
from tests.postgres_server import postgres_server  # noqa: F401  (the fixture)

DAY = 86400.0
NOW = 1_800_000_000.0
#: the most one record() may take, on 2 shared cores
RECORD_S = 0.05


#: every test's default ledger and spool under its own tmp_path (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("own_ledger")


def _outcome(i: int, *, host: str | None = None, job: str = "job-1", attempt: int = 0,
             faults: dict[str, int] | None = None, at: float | None = None) -> HostOutcome:
    return HostOutcome(host=host or f"node{i}", job=job, attempt=attempt,
                       time=time.time() if at is None else at,
                       faults={"signal": 1} if faults is None else faults)


def _rows(path: Path) -> int:
    db = sqlite3.connect(path)
    try:
        return int(db.execute("SELECT COUNT(*) FROM eventbus_host_outcomes").fetchone()[0])
    finally:
        db.close()


def _wait(condition: Callable[[], object], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _record_all(writer: LedgerWriter, outcomes: list[HostOutcome]) -> float:
    """Record each; the longest record() in seconds."""
    longest = 0.0
    for outcome in outcomes:
        start = time.perf_counter()
        writer.record(outcome)
        longest = max(longest, time.perf_counter() - start)
    return longest


# -- the score -----------------------------------------------------------------------------

def test_decay_halves_every_half_life_and_never_grows() -> None:
    assert scoring.decay(0) == 1.0
    assert scoring.decay(7 * DAY) == pytest.approx(0.5)
    assert scoring.decay(14 * DAY) == pytest.approx(0.25)
    assert scoring.decay(-DAY) == 1.0  # a clock ahead
    assert scoring.HALF_LIFE_S == 7 * DAY


def test_the_score_on_fixed_times() -> None:
    """One fault of weight 1 today is 1.0 (not over the threshold), a week old 0.5; an ECC
    error is over it for a week; a clean finish adds nothing and erases nothing."""
    def rows(*items: tuple[float, dict[str, int]]) -> list[HostOutcome]:
        return [HostOutcome("h", f"j{i}", 0, NOW - age, faults)
                for i, (age, faults) in enumerate(items)]

    assert scoring.score(rows((0, {"signal": 1})), NOW) == pytest.approx(1.0)
    assert scoring.score(rows((7 * DAY, {"signal": 1})), NOW) == pytest.approx(0.5)
    assert scoring.score(rows((6 * DAY, {"ecc": 1})), NOW) > scoring.DEFAULT_BAD_HOST_THRESHOLD
    assert scoring.score(rows((8 * DAY, {"ecc": 1})), NOW) < scoring.DEFAULT_BAD_HOST_THRESHOLD
    two = rows((DAY, {"signal": 1}), (2 * DAY, {"cuda": 1}))
    assert scoring.score(two, NOW) == pytest.approx(0.5 ** (1 / 7) + 0.5 ** (2 / 7))
    clean = [*two, HostOutcome("h", "j9", 0, NOW, {}, clean=True)]
    assert scoring.score(clean, NOW) == scoring.score(two, NOW)
    assert scoring.score(rows((0, {"from-the-future": 2})), NOW) == 2 * scoring.DEFAULT_WEIGHT
    assert scoring.score(rows((0, {"straggler": 1, "nccl": 1})), NOW) == pytest.approx(0.75)
    assert scoring.score([], NOW) == 0.0


def test_the_weights_name_every_kind_of_host_fault() -> None:
    from eventbus.app.launcher.hosts.faults import KINDS
    from eventbus.app.launcher.hosts.faults import LOST

    assert set(scoring.WEIGHTS) == {*KINDS, LOST}


def test_summaries_count_faults_jobs_and_clean_finishes() -> None:
    rows = [HostOutcome("a", "j1", 0, NOW - DAY, {"signal": 1}),
            HostOutcome("a", "j1", 1, NOW - DAY + 60, {"signal": 1, "ecc": 1}, culprit=1),
            HostOutcome("a", "j2", 0, NOW - 2 * DAY, {}, clean=True),
            HostOutcome("b", "j1", 0, NOW, {}, clean=True, straggler=2)]
    a, b = scoring.summarize(rows, NOW)
    assert (a.host, a.faults, a.jobs_hurt, a.jobs, a.attempts, a.clean, a.culprit) == \
        ("a", {"signal": 2, "ecc": 1}, 1, 2, 3, 1, 1)
    assert a.last_seen == NOW - DAY + 60 and a.last_fault == NOW - DAY + 60
    assert (b.score, b.faults, b.jobs_hurt, b.clean, b.straggler, b.last_fault) == \
        (0.0, {}, 0, 1, 2, None)
    assert a.to_json()["faults"] == {"signal": 2, "ecc": 1}


# -- hostlists -----------------------------------------------------------------------------

@pytest.mark.parametrize(("hosts", "expected"), [
    (["node3", "node17", "node18", "gpu-a1"], "gpu-a1,node[3,17-18]"),
    (["node001", "node002", "node003", "node010"], "node[001-003,010]"),
    (["node9", "node10"], "node[9-10]"),
    (["node09", "node10"], "node[09-10]"),
    (["node1", "node01"], "node01,node1"),
    (["login", "node7"], "login,node7"),
    (["rack1-node4", "rack1-node5", "rack2-node4"], "rack1-node[4-5],rack2-node4"),
    ([], ""),
])
def test_compress_collapses_runs_of_the_same_prefix_and_padding(
        hosts: list[str], expected: str) -> None:
    assert compress(hosts) == expected
    assert sorted(expand(expected)) == sorted(set(hosts))


def test_expand_reads_slurm_hostlists() -> None:
    assert expand("node[3,17-18],gpu-a1") == ["node3", "node17", "node18", "gpu-a1"]
    assert expand("n[08-10]") == ["n08", "n09", "n10"]
    for bad in ("node[a-b]", "node[1-2]x[3]"):
        with pytest.raises(HostlistError):
            expand(bad)


@settings(max_examples=200, deadline=None)
@given(st.sets(st.tuples(st.sampled_from(["node", "gpu-a", "n", "rack1-n"]),
                         st.integers(0, 120), st.sampled_from([0, 2, 3])), max_size=30))
def test_compress_then_expand_gives_the_hosts_back(
        names: set[tuple[str, int, int]]) -> None:
    hosts = {f"{prefix}{number:0{width}d}" for prefix, number, width in names}
    expanded = expand(compress(hosts))
    assert sorted(expanded) == sorted(hosts)


# -- specs and paths -----------------------------------------------------------------------

def test_specs_and_the_default_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert default_ledger_path() == str(tmp_path / "state" / "eventbus" / "hosts.sqlite")
    monkeypatch.setenv(DEFAULT_LEDGER_ENV, "postgresql://h/db")
    assert default_ledger_path() == "postgresql://h/db"
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.delenv(DEFAULT_LEDGER_ENV)
    monkeypatch.delenv(SPOOL_ENV)
    home = Path.home() / ".local" / "state" / "eventbus"
    assert default_ledger_path() == str(home / "hosts.sqlite")
    assert default_spool_path() == str(home / "hosts-spool.jsonl")
    monkeypatch.chdir(tmp_path)
    assert parse_spec("rel.sqlite").path == tmp_path / "rel.sqlite"
    assert parse_spec("postgres://u@h/db").url == "postgres://u@h/db"
    for bad in ("", "mysql://u:pw@h/db"):
        with pytest.raises(LedgerSpecError) as info:
            parse_spec(bad)
        assert "pw" not in str(info.value)


def test_passwords_never_show() -> None:
    assert redact("postgresql://u:s3cret@h:5432/db?sslmode=require&password=x") == \
        "postgresql://u:***@h:5432/db?sslmode=require&password=***"
    assert redact("postgresql://h/db") == "postgresql://h/db"
    spec = parse_spec("postgresql://u:s3cret@h/db")
    assert "s3cret" not in spec.shown and "s3cret" not in spec.key


# -- SQLite --------------------------------------------------------------------------------

def test_sqlite_rows_are_upserted_in_wal_mode(tmp_path: Path) -> None:
    """One row per host, job and attempt: a retry rewrites it (the last write wins)."""
    path = tmp_path / "hosts.sqlite"
    assert read_hosts(str(path)) == [] and not path.exists()  # reading creates nothing
    write_outcomes(str(path), [_outcome(1, at=NOW), _outcome(2, at=NOW)])
    write_outcomes(str(path), [_outcome(1, at=NOW + 5, faults={"ecc": 1})])
    assert _rows(path) == 2
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert db.execute("SELECT version FROM eventbus_schema_version").fetchall() == [(1,)]
    db.close()
    by_host = {o.host: o for o in read_outcomes(str(path))}
    assert by_host["node1"].faults == {"ecc": 1} and by_host["node1"].time == NOW + 5
    assert host_score(str(path), "node1", now=NOW + 5) == pytest.approx(2.0)
    assert host_score(str(path), "stranger", now=NOW) == 0.0


def test_a_ledger_of_a_newer_schema_is_not_written(tmp_path: Path) -> None:
    path = tmp_path / "hosts.sqlite"
    write_outcomes(str(path), [_outcome(1)])
    db = sqlite3.connect(path)
    db.execute("UPDATE eventbus_schema_version SET version = 99")
    db.commit()
    db.close()
    with pytest.raises(LedgerError, match="newer eventbus"):
        write_outcomes(str(path), [_outcome(2)])
    assert _rows(path) == 1


def test_a_healthy_writer_writes_everything_and_says_nothing(tmp_path: Path) -> None:
    path = tmp_path / "hosts.sqlite"
    said: list[str] = []
    writer = LedgerWriter(str(path), warn=said.append)
    longest = _record_all(writer, [_outcome(i) for i in range(50)])
    writer.record(_outcome(7))  # a retry of the same row
    start = time.monotonic()
    writer.close()
    print(f"healthy: 51 records, longest record() {longest * 1e3:.2f} ms, "
          f"close {time.monotonic() - start:.3f} s, rows {_rows(path)}/50")
    assert longest < RECORD_S
    assert said == [] and _rows(path) == 50 and spooled(str(path)) == 0
    writer.record(_outcome(99))  # after close: kept, not lost
    assert spooled(str(path)) == 1


@contextlib.contextmanager
def _write_lock(path: Path) -> Iterator[sqlite3.Connection]:
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("BEGIN IMMEDIATE")
    try:
        yield db
    finally:
        if db.in_transaction:
            db.execute("ROLLBACK")
        db.close()


def test_a_locked_ledger_spools_and_the_next_writer_writes_the_spool(tmp_path: Path) -> None:
    """Another connection holds a write transaction through the whole job: record() returns
    at once, one warning, close() within its timeout, the outcomes in the spool; the next
    writer, once the lock is gone, writes them: rows exact."""
    path = tmp_path / "hosts.sqlite"
    write_outcomes(str(path), [_outcome(0)])
    said: list[str] = []
    with _write_lock(path):
        writer = LedgerWriter(str(path), warn=said.append, timeout=0.2)
        longest = _record_all(writer, [_outcome(i) for i in range(1, 11)])
        _wait(lambda: said)
        start = time.monotonic()
        writer.close(timeout=0.5)
        closed_in = time.monotonic() - start
        assert spooled(str(path)) == 10 and _rows(path) == 1
    print(f"locked: longest record() {longest * 1e3:.2f} ms, close {closed_in:.2f} s, "
          f"spooled {writer.spooled}/10, warnings {len(said)}")
    assert longest < RECORD_S and closed_in < 1.5
    assert len(said) == 1 and said[0].startswith(f"eventbus: host ledger {path}: locked")
    later = LedgerWriter(str(path), warn=said.append)
    later.close(timeout=10)
    assert _rows(path) == 11 and spooled(str(path)) == 0 and len(said) == 1


def test_a_lock_that_goes_away_is_retried_within_the_job(tmp_path: Path) -> None:
    path = tmp_path / "hosts.sqlite"
    write_outcomes(str(path), [_outcome(0)])
    said: list[str] = []
    with _write_lock(path):
        writer = LedgerWriter(str(path), warn=said.append, timeout=0.2)
        _record_all(writer, [_outcome(i) for i in range(1, 11)])
        _wait(lambda: said)
    _wait(lambda: _rows(path) == 11)
    writer.record(_outcome(11))
    writer.close(timeout=5)
    assert _rows(path) == 12 and spooled(str(path)) == 0 and len(said) == 1


def _root_or_skip(what: str) -> None:
    if os.geteuid() != 0:
        pytest.skip(f"{what} needs root (mount); CI runs as root")


@contextlib.contextmanager
def _read_only(kind: str, folder: Path) -> Iterator[Path]:
    """``folder`` read-only to root: a read-only bind mount of it over itself, or its ledger file
    made immutable (``chattr +i``). Yields the ledger's path as the writer sees it."""
    if kind == "bind mount":
        _root_or_skip("a read-only bind mount")
        subprocess.run(["mount", "--bind", str(folder), str(folder)], check=True, timeout=30)
        try:
            subprocess.run(["mount", "-o", "remount,ro,bind", str(folder)], check=True,
                           timeout=30)
            yield folder / "hosts.sqlite"
        finally:
            subprocess.run(["umount", str(folder)], check=True, timeout=30)
    else:
        path = folder / "hosts.sqlite"
        done = subprocess.run(["chattr", "+i", str(path)], capture_output=True, timeout=30,
                              check=False)
        if done.returncode != 0:
            pytest.skip(f"chattr +i does not work here: {done.stderr.decode().strip()}")
        try:
            yield path
        finally:
            subprocess.run(["chattr", "-i", str(path)], check=True, timeout=30)


@pytest.mark.parametrize("kind", ["bind mount", "immutable file"])
def test_a_read_only_ledger_spools_and_nothing_is_lost(tmp_path: Path, kind: str) -> None:
    folder = tmp_path / "ledger"
    folder.mkdir()
    write_outcomes(str(folder / "hosts.sqlite"), [_outcome(0)])
    said: list[str] = []
    with _read_only(kind, folder) as path:
        writer = LedgerWriter(str(path), warn=said.append, timeout=0.2)
        longest = _record_all(writer, [_outcome(i) for i in range(1, 6)])
        writer.close(timeout=2)
        assert spooled(str(path)) == 5
        assert host_score(str(path), "node0", now=time.time()) == pytest.approx(1.0, abs=1e-3)
    print(f"read-only ({kind}): longest record() {longest * 1e3:.2f} ms, "
          f"spooled {writer.spooled}/5, warnings {said}")
    assert longest < RECORD_S
    assert len(said) == 1 and said[0].startswith(f"eventbus: host ledger {path}: ")
    assert "read-only" in said[0]
    LedgerWriter(str(path), warn=said.append).close(timeout=10)
    assert _rows(path) == 6 and spooled(str(path)) == 0 and len(said) == 1


def test_a_corrupt_ledger_is_never_touched(tmp_path: Path) -> None:
    path = tmp_path / "hosts.sqlite"
    garbage = b"this is not a database \x00\xff" * 200
    path.write_bytes(garbage)
    said: list[str] = []
    writer = LedgerWriter(str(path), warn=said.append)
    longest = _record_all(writer, [_outcome(i) for i in range(5)])
    writer.close(timeout=2)
    assert longest < RECORD_S
    assert len(said) == 1 and "corrupt" in said[0] and "left as it is" in said[0]
    assert path.read_bytes() == garbage
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("hosts")) == \
        ["hosts.sqlite"]
    assert spooled(str(path)) == 5
    with pytest.raises(LedgerError) as info:
        read_hosts(str(path))
    assert info.value.kind == "corrupt"
    assert host_score(str(path), "node1") is None
    path.rename(tmp_path / "hosts.sqlite.corrupt")  # what a person does
    LedgerWriter(str(path), warn=said.append).close(timeout=10)
    assert _rows(path) == 5 and spooled(str(path)) == 0 and len(said) == 1


def test_a_full_disk_spools_and_the_rows_come_back(tmp_path: Path) -> None:
    """The ledger on a 256 KiB tmpfs filled to the last byte."""
    _root_or_skip("a tmpfs")
    disk = tmp_path / "disk"
    disk.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)],
                          capture_output=True, timeout=30, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        path = disk / "hosts.sqlite"
        write_outcomes(str(path), [_outcome(0)])
        with open(disk / "filler", "wb", buffering=0) as filler, \
                contextlib.suppress(OSError):
            while True:
                filler.write(b"\0" * 4096)
        said: list[str] = []
        writer = LedgerWriter(str(path), warn=said.append, timeout=0.2)
        longest = _record_all(writer, [_outcome(i) for i in range(1, 21)])
        writer.close(timeout=2)
        print(f"full disk: longest record() {longest * 1e3:.2f} ms, spooled "
              f"{writer.spooled}/20, warnings {said}")
        assert longest < RECORD_S
        assert len(said) == 1 and "full" in said[0] and spooled(str(path)) == 20
        (disk / "filler").unlink()
        LedgerWriter(str(path), warn=said.append).close(timeout=10)
        assert _rows(path) == 21 and spooled(str(path)) == 0 and len(said) == 1
    finally:
        subprocess.run(["umount", str(disk)], check=True, timeout=30)


def test_a_spool_that_cannot_be_written_is_said_and_nothing_raises(tmp_path: Path) -> None:
    """Both the ledger and the spool refuse (a corrupt ledger, the spool a folder): still no
    exception and no delay, and each trouble said once."""
    path = tmp_path / "hosts.sqlite"
    path.write_bytes(b"garbage" * 100)
    spool = tmp_path / "spool-is-a-folder"
    spool.mkdir()
    said: list[str] = []
    writer = LedgerWriter(str(path), warn=said.append, spool=spool)
    longest = _record_all(writer, [_outcome(i) for i in range(5)])
    writer.close(timeout=1)
    assert longest < RECORD_S
    assert len(said) == 2 and "corrupt" in said[0] and "cannot keep" in said[1]


def test_a_bad_spec_is_said_once_and_nothing_raises() -> None:
    said: list[str] = []
    writer = LedgerWriter("mysql://u:pw@h/db", warn=said.append)
    writer.record(_outcome(1))
    writer.close()
    assert len(said) == 1 and "mysql://" in said[0] and "pw" not in said[0]


def test_a_ledger_read_in_time_or_not_at_all(tmp_path: Path) -> None:
    """host_score answers None, and at its timeout, while the ledger is locked by a writer
    that never ends (a reader of a WAL file is not blocked by a writer: only the lock of a
    rollback-journal file blocks it)."""
    path = tmp_path / "hosts.sqlite"
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=DELETE")
    db.execute("CREATE TABLE eventbus_host_outcomes (x)")
    db.execute("BEGIN EXCLUSIVE")
    try:
        start = time.monotonic()
        assert host_score(str(path), "node1", timeout=0.3) is None
        assert time.monotonic() - start < 1.0
    finally:
        db.execute("ROLLBACK")
        db.close()


_CHILD = textwrap.dedent("""
    import os, sys, time
    from eventbus.app.launcher.hosts.host_ledger import HostOutcome, LedgerWriter
    spec, me, go = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    said = []
    time.sleep(max(0.0, go - time.time()))
    writer = LedgerWriter(spec, warn=said.append)
    for i in range(25):
        writer.record(HostOutcome(f"node{me}", "job-many", i, time.time(), {"signal": 1}))
    for i in range(5):
        writer.record(HostOutcome(f"node{me}", "job-many", i, time.time(), {"signal": 1}))
    writer.close(timeout=60)
    print(writer.written, writer.spooled, len(said))
    for line in said:
        print(line, file=sys.stderr)
""")


def _many_writers(spec: str, tmp_path: Path, processes: int = 20) -> list[str]:
    """``processes`` interpreters, each with its writer, recording 25 rows (and 5
    retries) from the same instant; their outputs."""
    go = time.time() + 5.0
    env = subprocess_env(**{SPOOL_ENV: str(tmp_path / "spool.jsonl")})
    children = [subprocess.Popen([sys.executable, "-c", _CHILD, spec, str(n), str(go)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env=env) for n in range(processes)]
    outputs = []
    for child in children:
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
        assert err == "", err
        outputs.append(out.strip())
    return outputs


@pytest.mark.slow
def test_twenty_agents_write_at_once_and_flush_one_spool(tmp_path: Path) -> None:
    """20 processes, one SQLite file: each writes its 25 rows (5 of them twice) while all
    of them also find 100 outcomes that an earlier job left in the spool. Every row once."""
    path = tmp_path / "hosts.sqlite"
    with _write_lock(tmp_path / "hosts.sqlite"):
        earlier = LedgerWriter(str(path), warn=lambda _: None, timeout=0.1)
        _record_all(earlier, [_outcome(i, host=f"old{i}", job="job-old") for i in range(100)])
        earlier.close(timeout=1)
    assert spooled(str(path)) == 100
    start = time.monotonic()
    outputs = _many_writers(str(path), tmp_path)
    written = sum(int(out.split()[0]) for out in outputs)
    print(f"20 processes: rows {_rows(path)}/600, written by the writers {written}/600 "
          f"(records, retries included), in {time.monotonic() - start:.1f} s")
    assert _rows(path) == 600 and spooled(str(path)) == 0
    assert all(out.split()[1:] == ["0", "0"] for out in outputs), outputs
    assert written == 20 * 30


# -- PostgreSQL ----------------------------------------------------------------------------

def test_postgres_rows_are_written_and_read_back(postgres_server: PostgresServer) -> None:  # noqa: F811
    url = postgres_server.url
    said: list[str] = []
    writer = LedgerWriter(url, warn=said.append)
    longest = _record_all(writer, [_outcome(i, host=f"pg{i}", job="pg-1", at=NOW)
                                   for i in range(10)])
    writer.record(_outcome(3, host="pg3", job="pg-1", at=NOW, faults={"ecc": 1}))
    writer.close(timeout=10)
    assert said == [] and longest < RECORD_S
    rows = [o for o in open_store(parse_spec(url)).read() if o.job == "pg-1"]
    assert len(rows) == 10
    assert {o.host: o for o in rows}["pg3"].faults == {"ecc": 1}
    assert host_score(url, "pg3", now=NOW) == pytest.approx(2.0)
    summaries = {s.host: s for s in read_hosts(url, now=NOW)}
    assert summaries["pg1"].faults == {"signal": 1} and summaries["pg1"].jobs_hurt == 1


def _pg_rows(url: str, job: str) -> int:
    """The rows of ``job`` in the table itself (read_outcomes adds the spool's)."""
    return sum(1 for o in open_store(parse_spec(url)).read() if o.job == job)


def test_postgres_stopped_mid_job(postgres_server: PostgresServer, tmp_path: Path) -> None:  # noqa: F811
    """The server stops during the job (pg_ctl stop): record() still returns at once, one
    warning with the password hidden, the outcomes spooled; once it is started again the
    next writer writes the spool first: rows exact."""
    url = postgres_server.url.replace("postgres@", "postgres:s3cret@")  # trust: ignored
    said: list[str] = []
    writer = LedgerWriter(url, warn=said.append)
    _record_all(writer, [_outcome(i, job="pg-down") for i in range(5)])
    _wait(lambda: writer.written == 5)
    postgres_server.stop()
    try:
        longest = _record_all(writer, [_outcome(i, job="pg-down") for i in range(5, 25)])
        _wait(lambda: said)
        start = time.monotonic()
        writer.close(timeout=2)
        closed_in = time.monotonic() - start
    finally:
        postgres_server.start()
    print(f"postgres down: longest record() {longest * 1e3:.2f} ms, close {closed_in:.2f} s, "
          f"written {writer.written}, spooled {writer.spooled}/20, warnings {said}")
    assert longest < RECORD_S and closed_in < 2.5
    assert len(said) == 1 and "cannot reach the server" in said[0]
    assert said[0].startswith("eventbus: host ledger postgresql://postgres:***@127.0.0.1:")
    assert "s3cret" not in said[0]
    assert "s3cret" not in (tmp_path / "spool.jsonl").read_text()
    assert spooled(url) == 20 and _pg_rows(url, "pg-down") == 5
    LedgerWriter(url, warn=said.append).close(timeout=10)
    assert _pg_rows(url, "pg-down") == 25 and spooled(url) == 0 and len(said) == 1


def _pg_execute(url: str, statement: str) -> None:
    import psycopg

    with psycopg.connect(url, autocommit=True, connect_timeout=10) as db:
        db.execute("SET default_transaction_read_only = off")
        db.execute(statement)


def test_postgres_refusing_writes(postgres_server: PostgresServer) -> None:  # noqa: F811
    """The database turned read-only mid-job: the writes are refused, spooled, and written
    by the next writer once it takes them again."""
    url = postgres_server.url
    write_outcomes(url, [_outcome(0, job="pg-ro")])
    _pg_execute(url, "ALTER DATABASE eventbus_test SET default_transaction_read_only = on")
    said: list[str] = []
    try:
        writer = LedgerWriter(url, warn=said.append)
        longest = _record_all(writer, [_outcome(i, job="pg-ro") for i in range(1, 11)])
        writer.close(timeout=2)
    finally:
        _pg_execute(url, "ALTER DATABASE eventbus_test SET default_transaction_read_only = off")
    assert longest < RECORD_S
    assert len(said) == 1 and "read-only" in said[0] and spooled(url) == 10
    LedgerWriter(url, warn=said.append).close(timeout=10)
    assert _pg_rows(url, "pg-ro") == 11 and spooled(url) == 0


@pytest.mark.slow
def test_twenty_agents_write_to_postgres_at_once(
        postgres_server: PostgresServer, tmp_path: Path) -> None:  # noqa: F811
    url = postgres_server.url
    outputs = _many_writers(url, tmp_path)
    rows = _pg_rows(url, "job-many")
    print(f"20 processes, postgres: rows {rows}/500")
    assert rows == 500 and all(out.split()[1:] == ["0", "0"] for out in outputs), outputs


def test_without_psycopg_the_error_names_the_extra(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "psycopg", None)
    url = "postgresql://u:pw@127.0.0.1:1/db"
    said: list[str] = []
    writer = LedgerWriter(url, warn=said.append)
    writer.record(_outcome(1))
    writer.close(timeout=2)
    assert len(said) == 1 and "pip install 'eventbus[postgres]'" in said[0]
    assert spooled(url) == 1
    with pytest.raises(LedgerError) as info:
        read_hosts(url)
    assert info.value.kind == "missing-extra"
    assert host_score(url, "node1") is None


# -- a SLURM requeue ------------------------------------------------------------------------

def _slurm_run(spec: str, monkeypatch: pytest.MonkeyPatch, *, restart: int,
               faults: int) -> None:
    """One run of SLURM job 4242 on node n3 as the agent's eviction path records it:
    ``faults`` segfaults in attempt 0, then its end (clean when there were none)."""
    from eventbus.app.launcher.hosts.eviction import Eviction
    from eventbus.bus import Bus

    monkeypatch.delenv("EVENTBUS_HOSTNAME", raising=False)
    monkeypatch.setenv("SLURMD_NODENAME", "n3")
    if restart:
        monkeypatch.setenv("SLURM_RESTART_COUNT", str(restart))
    else:
        monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    said: list[str] = []
    writer = LedgerWriter(spec, warn=said.append)
    eviction = Eviction(Bus("slurm-requeue"), evict_after=0, ledger=spec, run_id="4242",
                        local=lambda: [0], writer=writer)
    for _ in range(faults):
        assert eviction.book.worker_failed(exit_code=-11) == "signal"
    eviction.attempt_ended(0, clean=faults == 0)
    writer.close(timeout=10)
    assert said == [] and writer.written == 1


def _excluded(spec: str, capsys: pytest.CaptureFixture[str]) -> list[str]:
    """``eventbus hosts --format slurm`` as the shell splits ``$(...)`` for sbatch: one
    word, ``--exclude=`` and SLURM's hostlist (returned expanded)."""
    from eventbus.app.launcher.hosts.report import main as hosts_main

    capsys.readouterr()
    assert hosts_main(["--ledger", spec, "--format", "slurm"]) == 0
    printed = capsys.readouterr().out
    words = subprocess.run(["bash", "-c", 'printf "%s\\n" $(cat)'], input=printed,
                           capture_output=True, text=True, timeout=10, check=True,
                           cwd=tempfile.gettempdir()).stdout.splitlines()
    assert len(words) == 1 and words[0].startswith("--exclude="), words
    return expand(words[0].removeprefix("--exclude="))


def _requeue_keeps_the_faults(spec: str, monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str]) -> None:
    _slurm_run(spec, monkeypatch, restart=0, faults=2)
    assert "n3" in _excluded(spec, capsys)
    _slurm_run(spec, monkeypatch, restart=1, faults=0)  # requeued: same job, attempt 0
    rows = {o.job: o for o in read_outcomes(spec, host="n3")}
    assert sorted(rows) == ["4242", "4242+requeue1"]
    assert rows["4242"].faults == {"signal": 2} and not rows["4242"].clean
    assert rows["4242+requeue1"].faults == {} and rows["4242+requeue1"].clean
    summary = {s.host: s for s in read_hosts(spec)}["n3"]
    assert summary.faults == {"signal": 2} and summary.clean == 1
    # one word, SLURM's hostlist: straight into sbatch $(eventbus hosts --format slurm)
    assert "n3" in _excluded(spec, capsys)
    write_outcomes(spec, [_outcome(4, host="n4", job="4243", faults={"ecc": 1})])
    assert {"n3", "n4"} <= set(_excluded(spec, capsys))


def test_a_requeued_clean_run_keeps_the_first_runs_faults(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """SLURM requeues job 4242 (SLURM_RESTART_COUNT 1) after two segfaults on n3; the
    requeued run ends cleanly on n3. The first run's row stays (before, the clean row of
    the same host, job and attempt overwrote it and the --exclude vanished)."""
    spec = str(tmp_path / "hosts.sqlite")
    _requeue_keeps_the_faults(spec, monkeypatch, capsys)
    from eventbus.app.launcher.hosts.report import main as hosts_main

    assert hosts_main(["--ledger", spec, "--format", "slurm"]) == 0
    assert capsys.readouterr().out == "--exclude=n[3-4]\n"  # SLURM's hostlist notation


def test_a_requeued_clean_run_keeps_the_first_runs_faults_in_postgres(
        postgres_server: PostgresServer, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
        capsys: pytest.CaptureFixture[str]) -> None:
    _requeue_keeps_the_faults(postgres_server.url, monkeypatch, capsys)
