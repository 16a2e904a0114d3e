"""The W&B sink's child process (:mod:`eventbus.app.sinks.wandb_writer`), seen from the
agent: started on the first batch, fed JSON lines through its stdin, read for its reports
(delivered, lost, status, the run it opened) on one thread and for its stderr's tail on
another, and ended within the sink's close budget, stopped past it.

What goes in the run is :class:`~eventbus.app.sinks.wandb.WandbSink`'s; this is only the
pipe, the process and their counts (events handed on, written, reported lost).
"""

from __future__ import annotations

import collections
import json
import logging
import subprocess
import threading
import time
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

__all__ = ["WriterProcess"]

logger = logging.getLogger("eventbus")


def _lines(ops: Sequence[Mapping[str, Any]]) -> bytes:
    return b"".join(json.dumps(op, default=str).encode() + b"\n" for op in ops)


class WriterProcess:
    """``python -m eventbus.app.sinks.wandb_writer`` for the sink named ``name``.
    ``failed(reason, n)`` is told of events that will not be written (the writer could
    not start or is gone, or it reported them lost)."""

    def __init__(self, python: str, *, name: str,
                 failed: Callable[[str, int], None]) -> None:
        self.python = python
        self.name = name
        self._failed = failed
        #: what the writer said of the run once it started: id, url, dir, resumed, offline
        self.run_info: dict[str, Any] = {}
        #: the writer's state, in words ("not started", "starting", "writing", its reports)
        self.status = "not started"
        #: events handed to the writer, ... that it wrote, ... that it reported lost
        self.sent = 0
        self.delivered = 0
        self.lost = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._dead = False
        self._pipe_lock = threading.Lock()
        self._counts_lock = threading.Lock()
        self._readers: list[threading.Thread] = []
        self._stderr_tail: collections.deque[str] = collections.deque(maxlen=20)

    @property
    def started(self) -> bool:
        """Whether a start was tried (it may have failed: the writer is then dead)."""
        return self._proc is not None or self._dead

    @property
    def spawned(self) -> bool:
        """Whether the writer process exists (it was started, and may have ended since)."""
        return self._proc is not None

    def counts(self) -> tuple[int, int, int]:
        """(sent, written, lost), read together."""
        with self._counts_lock:
            return self.sent, self.delivered, self.lost

    def _start(self) -> bool:
        """Start the writer (once); False when it cannot be started."""
        if self._proc is not None or self._dead:
            return not self._dead
        try:
            self._proc = subprocess.Popen(
                [self.python, "-m", "eventbus.app.sinks.wandb_writer"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                close_fds=True)
        except OSError as exc:
            self._dead = True
            self.status = f"the W&B writer could not start ({exc})"
            return False
        self.status = "starting"
        for target, name in ((self._read_reports, "reports"), (self._read_stderr, "stderr")):
            thread = threading.Thread(target=target, name=f"eventbus-wandb-{name}",
                                      daemon=True)
            thread.start()
            self._readers.append(thread)
        return True

    def send(self, ops: Sequence[Mapping[str, Any]]) -> None:
        """Hand ``ops`` to the writer, starting it first if need be (blocks while its pipe
        is full: the sink's queue thread is the one that waits, never the agent)."""
        if not ops:
            return
        n = sum(int(op.get("n", 0)) for op in ops)
        if not self._start():
            self._failed(self.status, n)
            return
        assert self._proc is not None and self._proc.stdin is not None
        data = _lines(ops)
        with self._pipe_lock:
            try:
                self._proc.stdin.write(data)
                self._proc.stdin.flush()
            except (OSError, ValueError):
                self._dead = True
                self._failed(self._gone(), n)
                return
        with self._counts_lock:
            self.sent += n

    def _gone(self) -> str:
        proc = self._proc
        code = proc.poll() if proc is not None else None
        tail = next((line for line in reversed(self._stderr_tail) if line.strip()), "")
        return f"the W&B writer exited (code {code})" + (f": {tail.strip()[:200]}"
                                                          if tail else "")

    def _read_reports(self) -> None:
        proc = self._proc
        assert proc is not None and proc.stdout is not None
        for raw in proc.stdout:
            try:
                report = json.loads(raw)
            except ValueError:
                continue
            if not isinstance(report, dict):
                continue
            if "delivered" in report:
                with self._counts_lock:
                    self.delivered += int(report["delivered"])
            if "lost" in report:
                n = int(report["lost"])
                with self._counts_lock:
                    self.lost += n
                self._failed(str(report.get("reason") or "unknown"), n)
            if "status" in report:
                self.status = str(report["status"])
            if isinstance(report.get("started"), dict):
                self.run_info = dict(report["started"])
                self.status = "writing"
                where = self.run_info.get("url") or self.run_info.get("dir")
                logger.info("sink %s: W&B run %s%s (%s)", self.name, self.run_info.get("id"),
                            " resumed" if self.run_info.get("resumed") else "", where)

    def _read_stderr(self) -> None:
        proc = self._proc
        assert proc is not None and proc.stderr is not None
        for raw in proc.stderr:
            self._stderr_tail.append(raw.decode(errors="replace"))

    def finish(self, ops: Sequence[Mapping[str, Any]], deadline: float) -> int:
        """Hand the last ``ops`` and close the pipe, then wait for the writer until
        ``deadline`` (monotonic) and stop it past that. Returns how many events it was
        handed and neither wrote nor reported lost (0 when it never started)."""
        proc = self._proc
        if proc is None:
            return 0
        if not self._dead:
            data = _lines(ops)
            if self._pipe_lock.acquire(timeout=max(0.0, deadline - time.monotonic() - 0.5)):
                try:
                    assert proc.stdin is not None
                    proc.stdin.write(data)
                    proc.stdin.close()
                except (OSError, ValueError):
                    pass
                finally:
                    self._pipe_lock.release()
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic() - 0.3))
        except subprocess.TimeoutExpired:
            status = self.status
            proc.kill()
            proc.wait()
            logger.warning("sink %s: the W&B writer did not finish within the close budget "
                           "(%s); stopped (its run's files are left for `wandb sync`)",
                           self.name, status)
        for thread in self._readers:  # the writer's last reports (EOF once it is gone)
            thread.join(timeout=max(0.2, deadline - time.monotonic()))
        with self._counts_lock:
            missing = self.sent - self.delivered - self.lost
            if missing > 0:
                self.lost += missing
        return max(0, missing)
