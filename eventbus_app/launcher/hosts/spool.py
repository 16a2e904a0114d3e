"""The spool: outcomes that could not reach their ledger, kept on the local disk until a
later writer can.

One JSONL file (``hosts-spool.jsonl`` next to the default ledger, or
``$EVENTBUS_HOST_LEDGER_SPOOL``), one outcome a line with the key of its ledger
(:attr:`LedgerSpec.key`, a hash: no password is written) and the ledger as people see it.
Several ledgers may share it: a writer takes only its own ledger's lines and leaves the
others.

Many agents of one machine append and flush at once, so every change is made under an
exclusive ``flock`` of ``<spool>.lock``: an append adds its lines; a flush reads the lines
of its ledger, writes them to the ledger and only then rewrites the file without them (a
new file renamed over the old). A flush that fails leaves the file as it was; a flush that
dies between the ledger's commit and the rewrite leaves lines that the next flush writes
again, which the ledger's upsert makes harmless: no outcome is lost or doubled. An append
that cannot take the lock in its time (a flush holds it while it writes to a slow ledger)
writes a side file (``<spool>.<pid>-<n>.side``, renamed into place whole), which the next
flush takes too.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import os
import time
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Sequence
from pathlib import Path

from eventbus.app.launcher.hosts.store import HostOutcome
from eventbus.app.launcher.hosts.store import LedgerSpec
from eventbus.app.launcher.hosts.store import outcome_from_json

__all__ = ["Spool", "SpoolBusy"]

_SIDE = itertools.count()


class SpoolBusy(TimeoutError):
    """The spool's lock was not taken in time."""


class Spool:
    """The spool file at ``path``."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.lock_path = self.path.with_name(self.path.name + ".lock")

    @contextlib.contextmanager
    def _locked(self, deadline: float) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise SpoolBusy(f"{self.lock_path} is held by another "
                                        "process") from None
                    time.sleep(0.005)
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    @staticmethod
    def _lines(spec: LedgerSpec, outcomes: Sequence[HostOutcome]) -> bytes:
        return b"".join(
            json.dumps({"ledger": spec.key, "spec": spec.shown, "outcome": o.to_json()},
                       separators=(",", ":"), sort_keys=True).encode() + b"\n"
            for o in outcomes)

    def append(self, spec: LedgerSpec, outcomes: Sequence[HostOutcome], *,
               deadline: float) -> None:
        """Keep ``outcomes`` for ``spec``'s ledger; raises OSError when the disk refuses."""
        if not outcomes:
            return
        data = self._lines(spec, outcomes)
        try:
            with self._locked(deadline):
                with open(self.path, "ab") as f:
                    if f.tell() > 0 and not _ends_with_newline(self.path):
                        f.write(b"\n")
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                return
        except SpoolBusy:
            pass
        side = self.path.with_name(f"{self.path.name}.{os.getpid()}-{next(_SIDE)}")
        with open(side.with_name(side.name + ".tmp"), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(side.with_name(side.name + ".tmp"), side.with_name(side.name + ".side"))

    def _files(self) -> list[Path]:
        sides = sorted(self.path.parent.glob(self.path.name + ".*.side"))
        return ([self.path] if self.path.is_file() else []) + sides

    def pending(self, spec: LedgerSpec) -> list[HostOutcome]:
        """The outcomes kept for ``spec``'s ledger (read without the lock: a line being
        written is skipped)."""
        mine, _, _ = self._read(spec, self._files())
        return list(mine.values())

    @staticmethod
    def _read(spec: LedgerSpec, files: list[Path]
              ) -> tuple[dict[tuple[str, str, int], HostOutcome], list[bytes], int]:
        """This ledger's outcomes (the last line of a key wins), the other ledgers' lines,
        and the count of lines that are not a spooled outcome."""
        mine: dict[tuple[str, str, int], HostOutcome] = {}
        others: list[bytes] = []
        bad = 0
        for path in files:
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                continue
            for line in data.splitlines():
                if not line.strip():
                    continue
                try:
                    raw = json.loads(line)
                except ValueError:
                    bad += 1
                    continue
                if not isinstance(raw, dict) or not isinstance(raw.get("ledger"), str):
                    bad += 1
                elif raw["ledger"] != spec.key:
                    others.append(line + b"\n")
                elif (outcome := outcome_from_json(raw.get("outcome"))) is not None:
                    mine[outcome.key] = outcome
                else:
                    bad += 1
        return mine, others, bad

    def flush(self, spec: LedgerSpec, write: Callable[[list[HostOutcome]], None], *,
              deadline: float) -> int:
        """Write this ledger's kept outcomes with ``write`` and drop them from the spool;
        the number written. Whatever ``write`` raises leaves the spool as it was."""
        if not self._files():
            return 0
        with self._locked(deadline):
            files = self._files()
            mine, others, _ = self._read(spec, files)
            if not mine:
                return 0
            write(list(mine.values()))
            if others:
                tmp = self.path.with_name(self.path.name + f".{os.getpid()}.tmp")
                with open(tmp, "wb") as f:
                    f.writelines(others)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path)
            else:
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
            for path in files:
                if path != self.path:
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
            return len(mine)


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"
