"""A warm spare worker: a process that has done what a worker does before its script
(the interpreter, the bootstrap's imports, ``import torch``), then waits to become the
worker of the next attempt.

The agent starts it as ``python -u -m eventbus.app.worker.spare`` with the next worker's
environment less what changes per attempt, the agent's cwd and stdio, in a session of its
own, and the read end of a pipe whose number is in ``EVENTBUS_SPARE_FD``. The spare
imports :data:`WARM_MODULES` on a thread of its own, lowered to the lowest priority once
the workers train (by the agent at their first step, or at once with
``EVENTBUS_SPARE_LOW=1``: eventbus_app/worker/yielding.py), while its main thread, at the
worker's priority, blocks on the pipe. The agent writes one JSON line,
``{"env": {...}, "argv": [...], "cwd": "..."}``: the spare closes the pipe, drops the
variable, puts the worker's environment in place of its own (``os.environ`` cleared and
refilled), changes to the cwd, and runs the bootstrap's :func:`eventbus.app.worker.main`
with ``argv`` as ``python -u -m eventbus.app.worker ARGV`` would: the script runs as
``__main__``, with its ``sys.argv``, ``__file__`` and ``sys.path[0]``, and the spare exits
with its exit code. An assignment that comes before the warm-up ended puts the spare back
at the worker's priority first, then waits for the imports to end. An end of file on the
pipe (the agent is gone, or it threw the spare
away) ends the spare with exit code 0 and nothing run.

**The template.** Started with ``EVENTBUS_SPARE_TEMPLATE_FD`` (a Unix socket) instead of
the pipe, the process warms up the same way once, then forks the node's spares: for each
request (a JSON object with the read end of a spare's pipe attached) it forks a spare
through a middle process that exits at once, so that the spare is adopted by the agent
(a child subreaper meanwhile) and is the agent's child as a spare it started would be;
the spare makes its own session, makes its CUDA context if asked, and waits on its pipe
as above. So a node of 8 local ranks imports torch once, not 8 times, and a restart's
spares are replaced by a fork (milliseconds), not by an import during the training
(eventbus_app/launcher/recovery/template.py). The template answers each request with the
spare's pid and ends at its socket's end of file.

The script can tell a spare by what is already imported (``sys.modules`` holds torch and
:data:`WARM_MODULES`) and by the process's start time; nothing else differs: its
environment, argv, cwd, stdio, signal dispositions and open files are a fresh worker's.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import socket
import sys
import threading
import warnings
from typing import Any

from eventbus.app.worker import yielding

__all__ = ["ENV_SPARE_CUDA_DEVICE", "ENV_SPARE_FD", "ENV_SPARE_GPU_FILES", "ENV_SPARE_LOW",
           "ENV_SPARE_MODULES", "ENV_SPARE_TEMPLATE_FD", "GPU_FILES", "WARM_MODULES",
           "main"]

ENV_SPARE_FD = "EVENTBUS_SPARE_FD"
#: set instead of :data:`ENV_SPARE_FD` for the template: the number of its end of a Unix
#: socket on which the agent asks for spares (eventbus_app/launcher/recovery/template.py)
ENV_SPARE_TEMPLATE_FD = "EVENTBUS_SPARE_TEMPLATE_FD"
#: the files a process that initialised a GPU holds open (NVIDIA's, AMD's), by path
#: prefix: the template forks nothing while it holds one, since a fork cannot use a GPU
#: its parent initialised
GPU_FILES = ("/dev/nvidia", "/dev/kfd", "/dev/dri/")
#: other prefixes in place of :data:`GPU_FILES`, comma-separated (tests name a file the
#: template holds); the template drops it before it forks
ENV_SPARE_GPU_FILES = "EVENTBUS_SPARE_GPU_FILES"
#: set by the agent for ``--warm-spares cuda`` (launcher/recovery/spares.py; the value is the local
#: rank); the spare drops it before the script
ENV_SPARE_CUDA_DEVICE = "EVENTBUS_SPARE_CUDA_DEVICE"
#: what a spare imports while it waits: what a DDP worker imports before its first step
#: (torch 1-2 s here; ``DistributedDataParallel``'s first construction touches
#: ``torch._dynamo``, another 0.8 s and some 800 modules)
WARM_MODULES = ("torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo")
#: the modules to import instead of :data:`WARM_MODULES`, comma-separated (tests set it
#: to warm up at once); the spare drops it before the script
ENV_SPARE_MODULES = "EVENTBUS_SPARE_MODULES"
#: "1": warm up at the lowest priority from the start (the workers train already); the
#: spare drops it before the script
ENV_SPARE_LOW = "EVENTBUS_SPARE_LOW"


def _read_assignment(fd: int) -> dict[str, Any] | None:
    """The one JSON line on ``fd`` (None at end of file), then the pipe closed."""
    chunks = []
    with os.fdopen(fd, "rb", closefd=True) as pipe:
        while True:
            chunk = pipe.read(65536)
            if not chunk:
                break
            chunks.append(chunk)
            if chunk.endswith(b"\n"):
                break
    text = b"".join(chunks).decode("utf-8", "replace").strip()
    if not text:
        return None
    found = json.loads(text)
    return found if isinstance(found, dict) else None


def _cuda_context(local_rank: str | None) -> int | None:
    """``--warm-spares cuda``: make the CUDA context on the local rank's device now (the
    device the script's ``torch.cuda.set_device(LOCAL_RANK)`` names; modulo the devices
    seen), so the worker's first CUDA call does not pay for it. The device index, or None
    where none was asked, torch has no CUDA, or it failed (the spare waits without one:
    the worker makes its own, as a fresh one does)."""
    if local_rank is None or not local_rank.isdigit():
        return None
    try:
        import torch

        count = torch.cuda.device_count()
        if count < 1:
            return None
        index = int(local_rank) % count
        # The context and the allocator's first block, on that device only. No
        # set_device(): the script's current device must be a fresh process's (device 0
        # until it sets one), and torch's device guard puts the current device back
        # without making a context on device 0.
        torch.zeros(1, device=f"cuda:{index}")
        return index
    except Exception as exc:  # a spare that cannot make it still waits: used without one
        print(f"eventbus: the warm spare of local rank {local_rank} made no CUDA context "
              f"({type(exc).__name__}: {exc}); its worker makes its own", file=sys.stderr)
        return None


def _warm_up(done: int, lower: bool, modules: tuple[str, ...]) -> None:
    """The warm-up thread: the imports (at the lowest priority with ``lower``), then one
    byte on ``done``."""
    try:
        if lower:
            yielding.lower_this_thread()
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception:  # a spare that cannot warm up still waits: it is used cold
                break
        import eventbus.app.worker  # noqa: F401  (the bootstrap's imports)
    finally:  # the main thread stopped reading it when the assignment came first
        with contextlib.suppress(OSError), os.fdopen(done, "wb") as f:
            f.write(b"1")


def _wait(fd: int, low: bool) -> tuple[threading.Thread, bool]:
    """Warm up (at the lowest priority from the start with ``low``; the agent may lower it
    later) until the warm-up ends or the pipe is readable (an assignment, or its end of
    file), whichever comes first; then back to the worker's priority. The warm-up
    thread, and whether the assignment came before it ended."""
    group = yielding.GroupNice(original=0)  # a new session's autogroup is at 0
    if low:
        group.lower()
    done_read, done_write = os.pipe()
    raisable = yielding.can_raise()
    lower = low and raisable
    listed = os.environ.pop(ENV_SPARE_MODULES, None)
    modules = WARM_MODULES if listed is None else tuple(filter(None, listed.split(",")))
    warm = threading.Thread(target=_warm_up, args=(done_write, lower, modules),
                            name="eventbus-spare-warm-up", daemon=True)
    warm.start()
    try:
        readable = select.select([fd, done_read], [], [])[0]
    finally:
        os.close(done_read)
    yielding.GroupNice(original=0).restore()  # lowered here or by the agent
    if raisable:  # the warm-up thread, if still running, and the threads it started
        yielding.raise_threads()
    return warm, done_read not in readable


def _become(assignment: dict[str, Any]) -> int:
    """Become the worker ``assignment`` names: its environment, cwd and argv, then the
    bootstrap; its exit code."""
    import eventbus.app.worker as bootstrap  # imported by the warm-up

    env, argv, cwd = assignment.get("env"), assignment.get("argv"), assignment.get("cwd")
    if not isinstance(env, dict) or not isinstance(argv, list):
        print("eventbus: the spare worker got a bad assignment; exiting", file=sys.stderr)
        return 2
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in env.items()})
    if isinstance(cwd, str) and cwd != os.getcwd():
        os.chdir(cwd)
    from eventbus.context import refresh_context

    refresh_context()  # the job context was read from the spare's environment at import
    return bootstrap.main([str(a) for a in argv])


def _reseed() -> None:
    """What a fresh process seeds from the OS at import, seeded anew in a fork: NumPy's
    global generator (torch imports NumPy; Python's ``random`` is reseeded by Python at
    the fork), so that the spares, and the restarts on them, never share a sequence."""
    numpy_random = sys.modules.get("numpy.random")
    seed = getattr(numpy_random, "seed", None)
    if callable(seed):
        with contextlib.suppress(Exception):
            seed()


def _forked(fd: int, request: dict[str, Any]) -> int:
    """A spare forked by the template (its own session already): the CUDA context if
    asked, then the assignment on ``fd``; its exit code."""
    _reseed()
    visible = request.get("cuda_visible")
    if isinstance(visible, str):  # CUDA reads it once, at its first call: set it before
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
    cuda = request.get("cuda")
    _cuda_context(cuda if isinstance(cuda, str) else None)
    assignment = _read_assignment(fd)
    if assignment is None:  # thrown away: nothing of its own to finish, and an
        sys.stdout.flush()  # interpreter ending with torch loaded takes 0.4 s of CPU
        sys.stderr.flush()
        os._exit(0)
    return _become(assignment)


def _fork() -> int:
    """``os.fork()``. Python 3.12+ warns of a fork with threads: importing torch leaves
    one where OpenBLAS may use more than one thread (NumPy's OpenBLAS thread server, idle
    on a condition variable; OpenBLAS's own fork handlers take care of it), as in every
    DataLoader worker forked from a training script. The filter is the caller's again in
    both processes once it returns."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return os.fork()


def _fork_spare(sock: socket.socket, fd: int, request: dict[str, Any]) -> int:
    """Fork a spare that waits on ``fd``, through a middle process that exits at once, so
    that the spare is an orphan the agent (a child subreaper meanwhile) adopts: it is then
    the agent's child, as a spare it started itself would be. The spare's pid (-1: the
    fork failed). In the spare this never returns: it exits with its worker's code."""
    read, write = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    middle = _fork()
    if middle == 0:
        pid = -1
        with contextlib.suppress(OSError):
            pid = os.fork()
        if pid == 0:  # the spare
            os.close(read)
            os.close(write)
            sock.close()
            os.setsid()
            sys.exit(_forked(fd, request))
        with contextlib.suppress(OSError):
            os.write(write, str(pid).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        text = pipe.read()
    os.waitpid(middle, 0)  # the spare is the agent's once the middle has exited
    return int(text) if text.strip().lstrip(b"-").isdigit() else -1


def _gpu_held(prefixes: tuple[str, ...]) -> str | None:
    """What makes this process's forks unable to use a GPU, or None: a GPU device file it
    holds open (the driver was initialised: ``cuInit`` opens them), or torch's CUDA
    initialised."""
    with contextlib.suppress(OSError):
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/self/fd/{fd}")
                if target.startswith(prefixes):
                    return target
    cuda = getattr(sys.modules.get("torch"), "cuda", None)
    with contextlib.suppress(Exception):
        if cuda is not None and cuda.is_initialized():
            return "torch's CUDA, initialised"
    return None


def _serve_forks(fd: int, low: bool) -> int:
    """The template: warm up once, then fork one spare for each request on the socket
    ``fd`` (one message: a JSON object, with the read end of the spare's pipe attached),
    and answer each with ``{"pid": N}``. Ends at the socket's end of file (the agent closed
    it or is gone). Where its imports initialised a GPU (:func:`_gpu_held`), it forks
    nothing and answers each request with ``{"pid": -1, "error": ...}``: the agent then
    starts each spare by itself."""
    warm, _ = _wait(fd, low)
    warm.join()  # no thread of ours left when it forks
    listed = os.environ.pop(ENV_SPARE_GPU_FILES, None)
    held = _gpu_held(GPU_FILES if listed is None else tuple(filter(None, listed.split(","))))
    sock = socket.socket(fileno=fd)
    while True:
        try:
            message, fds, _flags, _address = socket.recv_fds(sock, 65536, 1)
        except OSError:
            message, fds = b"", []
        if not message:  # nothing of its own to finish (an interpreter ending with torch
            sys.stdout.flush()  # loaded takes 0.4 s of CPU)
            sys.stderr.flush()
            os._exit(0)
        try:
            request = json.loads(message)
        except ValueError:
            request = None
        answer: dict[str, Any] = {"pid": -1}
        if held is not None:
            answer["error"] = f"the template holds {held}: a fork could not use the GPU"
        elif fds and isinstance(request, dict):
            answer["pid"] = _fork_spare(sock, fds[0], request)
        for passed in fds:
            os.close(passed)
        with contextlib.suppress(OSError):  # the agent gone: the next read ends it
            sock.sendall(json.dumps(answer).encode())


def main() -> int:
    """Warm up, wait for the assignment, become the worker (or, started as the template,
    fork the spares)."""
    template = os.environ.pop(ENV_SPARE_TEMPLATE_FD, None)
    low = os.environ.pop(ENV_SPARE_LOW, None) == "1"
    if template is not None:
        if not template.isdigit():
            print(f"eventbus: the spare template got a bad {ENV_SPARE_TEMPLATE_FD}",
                  file=sys.stderr)
            return 2
        return _serve_forks(int(template), low)
    try:
        fd = int(os.environ.pop(ENV_SPARE_FD))
    except (KeyError, ValueError):
        print("eventbus: the spare worker was started without its pipe "
              f"({ENV_SPARE_FD}); nothing to do", file=sys.stderr)
        return 2
    warm, early = _wait(fd, low)
    cuda = os.environ.pop(ENV_SPARE_CUDA_DEVICE, None)
    if early:
        assignment = _read_assignment(fd)
        if assignment is None:  # thrown away while it warmed up: no need to finish
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        warm.join()
    else:
        # the context, once made, stays: the script's own CUDA calls find it
        _cuda_context(cuda)
        assignment = _read_assignment(fd)
        if assignment is None:
            return 0  # thrown away
    return _become(assignment)


if __name__ == "__main__":
    sys.exit(main())
