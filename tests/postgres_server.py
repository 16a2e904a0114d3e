"""A real PostgreSQL server for the host ledger's tests: Debian's binaries, a cluster of its
own in a temporary folder, on a free port, with trust authentication.

:func:`postgres_bin_or_skip` names why a machine cannot run them (no
``/usr/lib/postgresql/*/bin/initdb``: ``make postgres`` installs Debian's ``postgresql``
package where apt-get exists; no psycopg: the ``postgres`` extra). The server refuses to run
as root, so under root every command runs as the ``postgres`` user (``runuser``) in a folder
it owns. Every wait is bounded; the fixture stops the server and removes the folder.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["PostgresServer", "postgres_bin_or_skip", "postgres_server"]

#: the longest any pg_ctl or initdb call may take
COMMAND_TIMEOUT_S = 60.0
DATABASE = "eventbus_test"


def postgres_bin_or_skip() -> Path:
    """The folder of ``initdb``, ``pg_ctl`` and ``postgres``, or skip naming why."""
    pytest.importorskip("psycopg", reason="psycopg is not installed: pip install "
                                          "'eventbus[postgres]' (make venv installs it)")
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                   key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0)
    if not found:
        pytest.skip("no PostgreSQL server: /usr/lib/postgresql/*/bin/initdb is missing "
                    "(`make postgres` installs Debian's postgresql package; CI runs these)")
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and there is no postgres user to run the server as")
    return Path(found[-1]).parent


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PostgresServer:
    """One cluster: ``url`` names its test database; ``stop()`` and ``start()`` play an
    outage."""

    def __init__(self, bin_dir: Path) -> None:
        self.bin = bin_dir
        self.root = Path(tempfile.mkdtemp(prefix="eventbus-pg-"))
        self.data = self.root / "data"
        self.sockets = self.root / "sockets"
        self.log = self.root / "server.log"
        self.port = _free_port()
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/{DATABASE}"
        self._as: list[str] = []
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            self._as = ["runuser", "-u", "postgres", "--"]
            os.chown(self.root, user.pw_uid, user.pw_gid)
        self.sockets.mkdir()
        if self._as:
            os.chown(self.sockets, pwd.getpwnam("postgres").pw_uid, -1)

    def _run(self, *args: str) -> None:
        command = [*self._as, *args]
        done = subprocess.run(command, capture_output=True, text=True,
                              timeout=COMMAND_TIMEOUT_S, check=False)
        if done.returncode != 0:
            log = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
            raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}): "
                               f"{done.stdout}{done.stderr}\n{log}")

    def init(self) -> None:
        self._run(str(self.bin / "initdb"), "-D", str(self.data), "-A", "trust",
                  "-U", "postgres", "-E", "UTF8", "--locale=C", "--no-sync")
        self.start()
        self._run(str(self.bin / "createdb"), "-h", str(self.sockets), "-p", str(self.port),
                  "-U", "postgres", DATABASE)

    def start(self) -> None:
        options = (f"-p {self.port} -k {self.sockets} -c listen_addresses=127.0.0.1 "
                   "-c fsync=off -c synchronous_commit=off -c full_page_writes=off")
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.log),
                  "-o", options, "-w", "-t", str(int(COMMAND_TIMEOUT_S)), "start")

    def stop(self, mode: str = "fast") -> None:
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w",
                  "-t", str(int(COMMAND_TIMEOUT_S)), "stop")

    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()

    def close(self) -> None:
        """Stop the server (killing it if it will not stop) and remove its folder."""
        try:
            if self.running():
                with contextlib.suppress(Exception):
                    self.stop("immediate")
            pid_file = self.data / "postmaster.pid"
            if pid_file.exists():
                with contextlib.suppress(Exception):
                    os.kill(int(pid_file.read_text().split()[0]), signal.SIGKILL)
                    time.sleep(0.2)
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="module")
def postgres_server() -> Iterator[PostgresServer]:
    """A running server with an empty database (``.url``), for the module's tests."""
    server = PostgresServer(postgres_bin_or_skip())
    try:
        server.init()
        yield server
    finally:
        server.close()
