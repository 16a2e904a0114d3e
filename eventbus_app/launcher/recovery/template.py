"""The spare template: one process per agent that imports torch once and forks the warm
spares (eventbus_app/worker/spare.py, "The template").

Without it each spare imported torch itself: 2.3-2.9 s of CPU here per local rank, on the
cores the starting workers use, and again for every spare a restart used, while the new
attempt trained. The template imports once; a spare is then a fork (about 15 ms of the
template's CPU, its pages shared with the template until written).

A process forked by the template would be the template's child, not the agent's, and
torch's process context, the exit peek (``waitid``), the exit watch (pidfds) and the
worker's drain (``os.getppid()``) all take a worker to be the agent's child. So while a
request is out the agent is a child subreaper (``PR_SET_CHILD_SUBREAPER``): the template
forks each spare through a middle process that exits at once, the orphaned spare is
reparented to the agent, and the template answers with its pid only after it reaped the
middle one. The agent checks that the spare's parent is itself before it uses it, and
stops being a subreaper once no request is out, so that the orphans of its workers'
own children go to init as before (the window: the template's warm-up at the first
attempt, a few milliseconds per spare after that). :class:`Adopted` stands for the
spare's ``subprocess.Popen`` where torch keeps one.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import json
import os
import select
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

from eventbus.app.worker.spare import ENV_SPARE_LOW
from eventbus.app.worker.spare import ENV_SPARE_TEMPLATE_FD

__all__ = ["Adopted", "Answer", "Template", "adopted_by_me", "set_subreaper", "subreaper_state"]

#: prctl(2)'s options
_PR_SET_CHILD_SUBREAPER, _PR_GET_CHILD_SUBREAPER = 36, 37
#: the exit code of an adopted spare whose status was taken by another wait (never by
#: the agent's own code): a failure, never a success that did not happen
UNKNOWN_EXIT = 255


def _prctl() -> Any:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl
    except (OSError, AttributeError):
        return None


def subreaper_state() -> bool | None:
    """Whether this process is a child subreaper now (None: it cannot tell, not Linux)."""
    prctl = _prctl()
    if prctl is None:
        return None
    value = ctypes.c_int(0)
    if prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(value), 0, 0, 0) != 0:
        return None
    return bool(value.value)


def set_subreaper(on: bool) -> bool:
    """Make this process a child subreaper (``on``) or not; whether it took."""
    prctl = _prctl()
    if prctl is None:
        return False
    return bool(prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0)


def adopted_by_me(pid: int) -> bool:
    """Whether process ``pid`` is this process's child (``/proc/PID/stat``'s ppid)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid()
    except (OSError, ValueError, IndexError):
        return False


class Adopted:
    """A spare the agent adopted, with the part of ``subprocess.Popen`` that torch's
    process context and the pool use: ``pid``, ``returncode``, ``poll()``,
    ``wait(timeout)``, ``send_signal()``, ``terminate()``, ``kill()``. The exit code is
    ``Popen``'s: the code, or minus the signal's number."""

    def __init__(self, pid: int, args: Sequence[str]) -> None:
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def _reap(self, flags: int) -> int | None:
        try:
            pid, status = os.waitpid(self.pid, flags)
        except ChildProcessError:  # reaped by another wait: no status to give
            self.returncode = UNKNOWN_EXIT
            return self.returncode
        if pid == self.pid:
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        if not self._lock.acquire(blocking=False):
            return None  # another thread is waiting for it
        try:
            return self.returncode if self.returncode is not None else self._reap(os.WNOHANG)
        finally:
            self._lock.release()

    def wait(self, timeout: float | None = None) -> int:
        if timeout is None:
            with self._lock:
                while self.returncode is None:
                    self._reap(0)
            return self.returncode
        deadline = time.monotonic() + timeout
        delay = 0.0005
        while True:
            code = self.poll()
            if code is not None:
                return code
            left = deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(min(delay, left, 0.05))
            delay *= 2

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Answer(NamedTuple):
    """The template's answer to one request."""

    local_rank: int
    #: the spare's pid; -1: none was forked
    pid: int
    #: the write end of the spare's pipe
    write: int
    #: the CUDA_VISIBLE_DEVICES the spare was asked for
    visible: str | None
    #: why it forks none (its imports initialised a GPU): the spares start each by itself
    error: str | None = None


class Template:
    """The agent's end of one template process: its process, the socket, what it was
    started with (``key``: interpreter, its options, the base environment, cwd) and the
    requests not yet answered, in order (the template answers them in order)."""

    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket,
                 key: tuple[str, tuple[str, ...], dict[str, str], str]) -> None:
        self.proc = proc
        self.sock = sock
        self.key = key
        #: (local rank, the write end of the spare's pipe, the CUDA_VISIBLE_DEVICES asked)
        self.pending: collections.deque[tuple[int, int, str | None]] = collections.deque()
        #: the template closed its socket or died: it answers nothing more
        self.gone = False

    @classmethod
    def start(cls, executable: str, options: Sequence[str], base: Mapping[str, str], *,
              low: bool, spawn: Callable[..., subprocess.Popen[bytes]],
              module: str) -> Template:
        """Start one: ``python OPTIONS -m MODULE`` with the base environment, the agent's
        cwd and stdio, in a session of its own (``low``: it warms up at the lowest priority
        from its start)."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {**base, ENV_SPARE_TEMPLATE_FD: str(theirs.fileno())}
        if low:
            env[ENV_SPARE_LOW] = "1"
        try:
            proc = spawn([executable, *options, "-m", module], env=env,
                         pass_fds=(theirs.fileno(),), start_new_session=True)
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        return cls(proc, mine, (executable, tuple(options), dict(base), os.getcwd()))

    @property
    def alive(self) -> bool:
        return not self.gone and self.proc.poll() is None

    def request(self, local_rank: int, *, cuda: str | None = None,
                cuda_visible: str | None = None) -> None:
        """Ask for a spare of ``local_rank`` (``cuda``: the device index its CUDA context is
        made on, under ``cuda_visible``). Raises ``OSError`` where the template is gone."""
        read, write = os.pipe()
        try:
            message = json.dumps({"local_rank": local_rank, "cuda": cuda,
                                  "cuda_visible": cuda_visible}).encode()
            socket.send_fds(self.sock, [message], [read])
        except BaseException:
            os.close(write)
            raise
        finally:
            os.close(read)
        self.pending.append((local_rank, write, cuda_visible))

    def answers(self, timeout: float = 0.0) -> list[Answer]:
        """The answers that came within ``timeout`` seconds (0: those already there). The
        template gone: every request left is answered -1."""
        out: list[Answer] = []
        deadline = time.monotonic() + timeout
        while self.pending:
            left = max(0.0, deadline - time.monotonic())
            if not self.gone and not select.select([self.sock], [], [], left)[0]:
                break
            data = b""
            if not self.gone:
                with contextlib.suppress(OSError):
                    data = self.sock.recv(4096)
            pid, error = -1, None
            if data:
                with contextlib.suppress(ValueError, AttributeError, TypeError):
                    found = json.loads(data)
                    pid, error = int(found.get("pid", -1)), found.get("error")
            else:
                self.gone = True
            local_rank, write, visible = self.pending.popleft()
            out.append(Answer(local_rank, pid, write, visible,
                              error if isinstance(error, str) else None))
        return out

    def close(self, timeout: float = 2.0) -> None:
        """Close the socket (the template exits by itself) and every pipe not answered;
        kill it if it does not exit within ``timeout`` seconds."""
        for _rank, write, _visible in self.pending:
            with contextlib.suppress(OSError):
                os.close(write)
        self.pending.clear()
        self.gone = True
        self.sock.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=timeout)
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=2)
