"""Warm spares: one waiting worker process per local rank, used by the next attempt.

A restart used to pay, on every rank, for a new interpreter, the bootstrap and
``import torch`` (1-2 s here, 2-10 s on a GPU node) before the script's first line. The
agent keeps a spare per local rank instead (eventbus_app/worker/spare.py): started with the
worker's environment less what changes per attempt (:data:`PER_ATTEMPT`), it imports
torch and waits on a pipe. When torch's process context starts the next attempt's
workers, :meth:`SparePool.popen` hands it the spare of that local rank, which gets the
worker's whole environment, argv and cwd and runs the script as the bootstrap does.

A spare is used only when it is alive, was started by this pool for the same interpreter
and cwd, and its environment equals the worker's on every variable but :data:`PER_ATTEMPT`
(a changed variable means a stale spare: it is thrown away and the worker starts fresh, as
it would without spares). One that cannot read its assignment (its end of the pipe closed
since it was found alive) is thrown away and ended too, and its worker starts fresh. A
worker whose output goes to files (``--redirects``, ``--tee``, ``--log-dir`` with
redirects) or whose command is wrapped (NUMA binding) starts fresh.
Spares are asked for once the attempt's workers are started (:meth:`SparePool.fill`, from
the agent's monitor); those used are replaced for the attempt after. With ``template``
(the agent's default) they are forked by one template process per agent that imports
once (template.py): the first fill starts it, and the pool takes in each spare it forked
as its answer comes (:meth:`SparePool.service`, every monitor tick; a restart waits for a
spare not forked yet). Without it, or where it cannot be had, each spare is started and
imports by itself. Thrown-away spares read the end of their pipe and exit; the pool ends
them all, and the template, at the agent's end.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import time
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

from eventbus.app.launcher.recovery.template import Adopted
from eventbus.app.launcher.recovery.template import Answer
from eventbus.app.launcher.recovery.template import Template
from eventbus.app.launcher.recovery.template import adopted_by_me
from eventbus.app.launcher.recovery.template import set_subreaper
from eventbus.app.launcher.recovery.template import subreaper_state
from eventbus.app.worker.spare import ENV_SPARE_CUDA_DEVICE
from eventbus.app.worker.spare import ENV_SPARE_LOW
from eventbus.app.worker.yielding import demote
from eventbus.app.worker.yielding import promote

__all__ = ["PER_ATTEMPT", "SPARE_MODULE", "Spare", "SparePool", "interpreter_options",
           "serving", "worker_argv"]

logger = logging.getLogger("eventbus")

SPARE_MODULE = "eventbus.app.worker.spare"
#: variables whose value changes from one attempt to the next (torch's agent sets them per
#: worker and attempt); any other difference makes a spare stale
PER_ATTEMPT = frozenset({
    "RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
    "WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_SIGNALS_TO_HANDLE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "CUDA_VISIBLE_DEVICES", "NCCL_ASYNC_ERROR_HANDLING",
})
#: and these prefixes: the agent's own per-attempt settings (dump folders, store keys)
PER_ATTEMPT_PREFIXES = ("EVENTBUS_", "TORCHELASTIC_")


def _base(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items()
            if k not in PER_ATTEMPT and not k.startswith(PER_ATTEMPT_PREFIXES)}


class Spare:
    """One waiting spare: its process, the pipe's write end, what it was started with."""

    def __init__(self, proc: subprocess.Popen[bytes] | Adopted, pipe: int, *,
                 base: dict[str, str],
                 executable: str, cwd: str, started: float, cuda: bool = False,
                 cuda_visible: str | None = None) -> None:
        self.proc = proc
        #: whether it makes a CUDA context while it waits, and the ``CUDA_VISIBLE_DEVICES``
        #: it makes it under (CUDA reads it once: a worker with another is not this spare's)
        self.cuda = cuda
        self.cuda_visible = cuda_visible
        self.pipe = pipe
        self.base = base
        self.executable = executable
        self.cwd = cwd
        self.started = started

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def stale_for(self, executable: str, env: Mapping[str, str], cwd: str) -> str | None:
        """Why this spare cannot be the worker started with these (None: it can)."""
        if not self.alive:
            return f"it died (exit code {self.proc.returncode})"
        if executable != self.executable:
            return f"the interpreter changed ({self.executable} -> {executable})"
        if cwd != self.cwd:
            return "the working directory changed"
        if self.cuda and env.get("CUDA_VISIBLE_DEVICES") != self.cuda_visible:
            return ("CUDA_VISIBLE_DEVICES changed: the spare's CUDA context is under "
                    f"{self.cuda_visible!r}")
        new = _base(env)
        if new != self.base:
            changed = sorted(k for k in set(new) | set(self.base)
                             if new.get(k) != self.base.get(k))
            return f"the environment changed ({', '.join(changed[:5])})"
        return None

    def assign(self, env: Mapping[str, str], argv: Sequence[str], cwd: str) -> None:
        """Make it the worker: its environment, argv and cwd, over the pipe. Raises
        ``OSError`` when the spare cannot read it (its end of the pipe is closed: it died
        or closed it since it was found alive); the pipe is closed either way."""
        line = json.dumps({"env": dict(env), "argv": list(argv), "cwd": cwd}) + "\n"
        data = line.encode()
        with contextlib.suppress(OSError):  # its warm-up, if not done, at the worker's priority
            promote(self.proc.pid)
        try:
            while data:
                data = data[os.write(self.pipe, data):]
        finally:
            self._close_pipe()

    def _close_pipe(self) -> None:
        """Close the pipe's write end once: a number closed twice may be another file's."""
        pipe, self.pipe = self.pipe, -1
        if pipe >= 0:
            with contextlib.suppress(OSError):
                os.close(pipe)

    def discard(self, timeout: float = 2.0) -> None:
        """Close its pipe (it exits by itself), and end it if it does not within
        ``timeout`` seconds."""
        self._close_pipe()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=timeout)
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, 9)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=2)


class SparePool:
    """The spares of one agent, one per local rank."""

    def __init__(self, *, enabled: bool = True, cuda: bool = False,
                 clock: Callable[[], float] = time.monotonic,
                 spawn: Callable[..., subprocess.Popen[bytes]] = subprocess.Popen,
                 discard_timeout: float = 2.0, template: bool = False,
                 template_wait: float = 60.0) -> None:
        self.enabled = enabled
        #: the spares are forked by one template process that imports torch once
        #: (template.py); False: each spare is started and imports by itself (also where
        #: the template cannot be used: no fork, no child subreaper)
        self.template = enabled and template and hasattr(os, "fork") and \
            hasattr(socket, "send_fds")
        #: how long a restart waits for the template's spares before its workers start fresh
        self.template_wait = template_wait
        self._template: Template | None = None
        #: whether this pool made the process a child subreaper (while a request is out)
        self._reaping = False
        #: how long a spare thrown away may take to exit by itself before it is killed
        self.discard_timeout = discard_timeout
        #: ``--warm-spares cuda``: each spare makes its CUDA context on its local device
        self.cuda = enabled and cuda
        self._clock = clock
        self._spawn = spawn
        self._spares: dict[int, Spare] = {}
        #: spares used, thrown away (and why), started
        self.used = 0
        self.started = 0
        self.discarded: list[str] = []

    def __len__(self) -> int:
        return len(self._spares)

    def fill(self, workers: Mapping[int, tuple[str, Sequence[str], Mapping[str, str]]], *,
             low: bool = False) -> int:
        """Start a spare for each local rank that has none: ``workers`` maps a local rank to
        the (interpreter, interpreter options, environment) its worker was started with;
        ``low``: they warm up at the lowest priority from the start (the workers train).
        Returns how many were started."""
        if not self.enabled:
            return 0
        if self.template:
            return self._fill_from_template(workers, low=low)
        count = 0
        for local_rank, (executable, options, env) in sorted(workers.items()):
            spare = self._spares.get(local_rank)
            if spare is not None and spare.alive:
                continue
            if spare is not None:
                self.discarded.append(f"local rank {local_rank}: it died")
            try:
                self._spares[local_rank] = self._start(local_rank, executable, options, env,
                                                       low=low)
            except OSError as exc:
                logger.warning("eventbus: no warm spare for local rank %d (%s); its next "
                               "worker starts fresh", local_rank, exc)
                self._spares.pop(local_rank, None)
                continue
            count += 1
        return count

    def _start(self, local_rank: int, executable: str, options: Sequence[str],
               env: Mapping[str, str], *, low: bool = False) -> Spare:
        read, write = os.pipe()
        os.set_inheritable(read, True)
        base = _base(env)
        spare_env = {**base, "EVENTBUS_SPARE_FD": str(read)}
        if low:
            spare_env[ENV_SPARE_LOW] = "1"
        visible = env.get("CUDA_VISIBLE_DEVICES")
        if self.cuda:
            spare_env[ENV_SPARE_CUDA_DEVICE] = str(local_rank)
            if visible is not None:
                spare_env["CUDA_VISIBLE_DEVICES"] = visible
        try:
            proc = self._spawn([executable, *options, "-m", SPARE_MODULE], env=spare_env,
                               pass_fds=(read,), start_new_session=True)
        except BaseException:
            os.close(write)
            raise
        finally:
            os.close(read)
        os.set_inheritable(write, False)
        self.started += 1
        return Spare(proc, write, base=base, executable=executable, cwd=os.getcwd(),
                     started=self._clock(), cuda=self.cuda, cuda_visible=visible)

    # -- the template (template.py) ----------------------------------------------------
    def _fill_from_template(self, workers: Mapping[int, tuple[str, Sequence[str],
                                                               Mapping[str, str]]], *,
                            low: bool) -> int:
        """Ask the template for a spare of each local rank that has none and none asked
        (the template started first, or anew where its interpreter, options, environment
        or cwd are no longer the workers'). Where it cannot be had, the spares start each
        by itself from now on. How many were asked."""
        self.service()
        asked = {rank for rank, _w, _v in self._template.pending} if self._template else set()
        wanted = {}
        for local_rank, launch in sorted(workers.items()):
            spare = self._spares.get(local_rank)
            if local_rank in asked or (spare is not None and spare.alive):
                continue
            if spare is not None:
                self.discarded.append(f"local rank {local_rank}: it died")
                self._spares.pop(local_rank)
            wanted[local_rank] = launch
        if not wanted:
            return 0
        executable, options, env = wanted[min(wanted)]
        key = (executable, tuple(options), _base(env), os.getcwd())
        try:
            template = self._template_for(key, low=low)
            state = subreaper_state()  # True already (set by this pool, or by another)
            if state is None or (not state and not set_subreaper(True)):
                raise OSError("this process cannot be a child subreaper (Linux 3.4+)")
            self._reaping = self._reaping or not state
            for local_rank, (_exe, _options, worker_env) in sorted(wanted.items()):
                visible = worker_env.get("CUDA_VISIBLE_DEVICES") if self.cuda else None
                template.request(local_rank, cuda=str(local_rank) if self.cuda else None,
                                 cuda_visible=visible)
        except OSError as exc:
            logger.info("eventbus: no spare template (%s); each warm spare starts by "
                        "itself", exc)
            self.template = False
            self._close_template()
            return self.fill(workers, low=low)
        return len(wanted)

    def _template_for(self, key: tuple[str, tuple[str, ...], dict[str, str], str], *,
                      low: bool) -> Template:
        template = self._template
        if template is not None and template.alive and template.key == key:
            return template
        self._close_template()
        executable, options, base, _cwd = key
        self._template = Template.start(executable, options, base, low=low,
                                        spawn=self._spawn, module=SPARE_MODULE)
        return self._template

    def service(self, timeout: float = 0.0) -> None:
        """Take in the spares the template forked (within ``timeout`` seconds, 0: those
        already answered); no longer a child subreaper once none is asked."""
        template = self._template
        refused: list[Answer] = []
        if template is not None and template.pending:
            for answer in template.answers(timeout):
                if answer.error is not None:
                    refused.append(answer)
                    os.close(answer.write)
                else:
                    self._adopt(answer, template)
        if template is not None and refused:
            self._without_template(template, refused)
            template = None
        if self._reaping and (template is None or not template.pending):
            set_subreaper(False)
            self._reaping = False

    def _without_template(self, template: Template, refused: list[Answer]) -> None:
        """The template forks nothing (``refused``'s error): from now on each spare starts
        by itself, those refused at once."""
        logger.info("eventbus: %s; each warm spare starts by itself", refused[0].error)
        self.template = False
        self._template = None
        executable, options, base, _cwd = template.key
        asked = refused + [Answer(r, -1, w, v) for r, w, v in template.pending]
        template.close(0.0)
        workers = {a.local_rank: (executable, options, {**base, **(
            {"CUDA_VISIBLE_DEVICES": a.visible} if a.visible is not None else {})})
            for a in asked}
        self.fill(workers)

    def _adopt(self, answer: Answer, template: Template) -> None:
        local_rank, pid, write, visible, _error = answer
        executable, options, base, cwd = template.key
        if pid <= 0 or not adopted_by_me(pid):
            os.close(write)  # a spare that is not this process's child reads its end
            why = "the template could not fork it" if pid <= 0 else "it was not adopted"
            self.discarded.append(f"local rank {local_rank}: {why}")
            return
        args = [executable, *options, "-m", SPARE_MODULE]
        self._spares[local_rank] = Spare(Adopted(pid, args), write, base=base,
                                         executable=executable, cwd=cwd,
                                         started=self._clock(), cuda=self.cuda,
                                         cuda_visible=visible)
        self.started += 1

    def _close_template(self) -> None:
        template, self._template = self._template, None
        if template is not None:
            template.close(self.discard_timeout)
        self.service()

    def take(self, local_rank: int, executable: str, env: Mapping[str, str],
             cwd: str) -> Spare | None:
        """The spare of ``local_rank`` if it can be this worker (removed from the pool);
        None otherwise (a stale or dead one is thrown away, and said why). A spare the
        template has not forked yet is waited for, up to :attr:`template_wait` seconds,
        the template put back at the worker's priority meanwhile."""
        template = self._template
        if template is not None and any(r == local_rank for r, _w, _v in template.pending):
            with contextlib.suppress(OSError):
                promote(template.proc.pid)
            self.service(self.template_wait)
        else:
            self.service()
        spare = self._spares.pop(local_rank, None)
        if spare is None:
            return None
        why = spare.stale_for(executable, env, cwd)
        if why is not None:
            self.discarded.append(f"local rank {local_rank}: {why}")
            logger.info("eventbus: the warm spare of local rank %d is not used: %s",
                        local_rank, why)
            spare.discard(self.discard_timeout)
            return None
        self.used += 1
        return spare

    def demote(self) -> None:
        """Every spare to the lowest priority (the workers train now): see
        eventbus_app/worker/yielding.py."""
        for spare in self._spares.values():
            if spare.alive:
                with contextlib.suppress(OSError):
                    demote(spare.proc.pid)
        if self._template is not None and self._template.alive:
            with contextlib.suppress(OSError):  # still warming up, or idle: no matter
                demote(self._template.proc.pid)

    def unusable(self, local_rank: int, spare: Spare, error: OSError) -> None:
        """A spare taken for ``local_rank`` could not be given its worker (``error``): it is
        not used but thrown away and ended, and the worker starts fresh."""
        self.used -= 1
        why = f"it could not take its worker ({error})"
        self.discarded.append(f"local rank {local_rank}: {why}")
        logger.info("eventbus: the warm spare of local rank %d is not used: %s", local_rank,
                    why)
        spare.discard(self.discard_timeout)

    def close(self, timeout: float = 2.0) -> None:
        """End every spare (the agent's end): their pipes closed at once, so that they exit
        by themselves together; those still running after ``timeout`` are killed."""
        spares, self._spares = list(self._spares.values()), {}
        template, self._template = self._template, None
        if template is not None:  # killed at once: it forks no spare now, and an
            template.close(0.0)   # interpreter that imported torch takes 0.3 s to end
        self.service()
        for spare in spares:
            spare._close_pipe()
        deadline = self._clock() + timeout
        for spare in spares:
            with contextlib.suppress(subprocess.TimeoutExpired):
                spare.proc.wait(timeout=max(0.0, deadline - self._clock()))
            if spare.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(spare.proc.pid, 9)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    spare.proc.wait(timeout=2)


def interpreter_options(args: Sequence[str]) -> tuple[str, ...]:
    """The interpreter's own options in front of ``-m eventbus.app.worker`` (``-u``, ``-W
    x``, ``-X y``) of a bootstrapped worker's arguments; empty when there is none."""
    out = list(args)
    for i in range(len(out) - 1):
        if out[i] == "-m" and out[i + 1] == "eventbus.app.worker":
            return tuple(out[:i])
    return ()


def worker_argv(args: Sequence[str]) -> list[str] | None:
    """What follows ``-m eventbus.app.worker`` (the bootstrap's argv); None when the
    worker is not started through the bootstrap."""
    out = list(args)
    for i in range(len(out) - 1):
        if out[i] == "-m" and out[i + 1] == "eventbus.app.worker":
            return out[i + 2:]
    return None


@contextlib.contextmanager
def serving(pool: SparePool,
            launched: dict[int, tuple[str, tuple[str, ...], dict[str, str]]]) -> Iterator[None]:
    """While torch's process context starts the workers: each worker that can be a spare
    is one, and every bootstrapped worker's launch (interpreter, its options, environment)
    is noted in ``launched`` by local rank (what :meth:`SparePool.fill` starts spares
    with). Torch's ``get_subprocess_handler`` is replaced meanwhile, on this thread's
    start only (the agent starts workers from one thread)."""
    from torch.distributed.elastic.multiprocessing import api
    from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

    original = getattr(api, "get_subprocess_handler", None)
    if original is None:  # another torch: workers start as torch starts them
        yield
        return

    class Handler(SubprocessHandler):
        def __init__(self, entrypoint: str, args: tuple[Any, ...], env: dict[str, str],
                     stdout: str | None, stderr: str | None, local_rank_id: int,
                     **kwargs: Any) -> None:
            self._entry, self._args = entrypoint, tuple(str(a) for a in args)
            super().__init__(entrypoint, args, env, stdout, stderr, local_rank_id, **kwargs)

        def _popen(self, args: tuple[Any, ...], env: dict[str, str]) -> Any:
            argv = worker_argv(self._args)
            plain = tuple(args) == (self._entry, *self._args)  # no NUMA wrapper
            if argv is not None and plain:
                options = interpreter_options(self._args)
                launched[self.local_rank_id] = (self._entry, options, dict(env))
                if self._stdout is None and self._stderr is None:
                    spare = pool.take(self.local_rank_id, self._entry, env, os.getcwd())
                    if spare is not None:
                        try:
                            spare.assign(env, argv, os.getcwd())
                        except OSError as exc:
                            pool.unusable(self.local_rank_id, spare, exc)
                        else:
                            return spare.proc
            return super()._popen(args, env)

    def handler(*args: Any, **kwargs: Any) -> Any:
        return Handler(*args, **kwargs)

    name = "get_subprocess_handler"  # torch's module attribute, replaced and put back
    setattr(api, name, handler)
    try:
        yield
    finally:
        setattr(api, name, original)
