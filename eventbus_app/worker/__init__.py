"""The worker side of ``eventbus run``: the bootstrap each worker is started through.

The agent starts every worker as ``python -u -m eventbus.app.worker SCRIPT ARGS...`` (or
``... -m eventbus.app.worker -m MODULE ARGS...`` for torchrun's ``-m`` form) instead of
``python -u SCRIPT ARGS...``. The bootstrap:

1. reads the launcher's ``EVENTBUS_*`` variables (:func:`attach`), each checked on its
   own: a bad one is one warning on stderr that names it and says the fix, and the script
   runs without the part it configures;
2. attaches the store forwarder, so that the script's events reach the agent, and
   installs the exit hooks that flush it (:mod:`eventbus.subscribers.worker_exit`);
3. starts the ear for the job-wide notices (:mod:`eventbus.app.worker.notices`:
   ``PREEMPTING`` and its peers' failures, on the default bus; the drain's agreement);
4. arms the stall watch's stack dump (:mod:`eventbus.app.worker.stack_dump`) and, with
   the forwarder or ``EVENTBUS_PROGRESS``, the progress watch
   (:mod:`eventbus.app.worker.progress`: heartbeats from torch's collectives and optimizer
   steps, with no call in the script);
5. runs the script as ``__main__``, as ``python SCRIPT`` would: the same ``sys.argv``,
   the same ``sys.path[0]``, the same exit code, and an uncaught exception printed by
   ``sys.excepthook`` with the script's own frames, exit code 1; under torch's agent the
   exception is also written to the worker's error file, as torch's ``@record`` writes it
   (:mod:`eventbus.app.worker.error_file`), so ``WORKER_EXIT.message`` carries it.

So a script that never imports eventbus gets the worker side too, and ``import eventbus``
itself stays inert. A program torchrun starts with ``--no-python`` is not run through the
bootstrap: if it is a Python program, have it call :func:`attach` first (or start its
Python part as ``python -m eventbus.app.worker SCRIPT``); anything else records nothing.
"""

from __future__ import annotations

import builtins
import io
import logging
import os
import sys
import types
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from importlib.machinery import SourceFileLoader
from typing import Any
from typing import TypeVar

import attrs

from eventbus.app.protocol.agent_worker import ENV_FR_DUMP_DIR
from eventbus.app.protocol.agent_worker import ENV_PROGRESS
from eventbus.app.protocol.agent_worker import ENV_STACK_DIR
from eventbus.app.protocol.agent_worker import ENV_STACK_SIGNAL
from eventbus.app.protocol.agent_worker import PROGRESS_SOURCES
from eventbus.app.protocol.agent_worker import parse_progress
from eventbus.app.protocol.notices import ENV_NOTICE_FROM
from eventbus.app.protocol.notices import ENV_NOTICES
from eventbus.app.worker.drain_signals import install as take_drain_signals
from eventbus.app.worker.error_file import record_uncaught
from eventbus.app.worker.marks import worker_marks
from eventbus.app.worker.process_groups import install as end_process_groups_at_exit
from eventbus.app.worker.progress import start_progress_watch
from eventbus.app.worker.stack_dump import arm_stack_dump
from eventbus.app.worker.stack_dump import parse_stack_signal
from eventbus.bus import get_default_bus
from eventbus.context import ATTEMPT_ENV
from eventbus.exit_ledger import ENV_LEDGER_DIR
from eventbus.wire import ENV_BELL
from eventbus.wire import ENV_PREFIX
from eventbus.wire import ENV_STORE

__all__ = [
    "BOOTSTRAP_MODULE",
    "WorkerSide",
    "attach",
    "bootstrap_args",
    "main",
    "run_attached",
]

logger = logging.getLogger("eventbus")

#: what the agent puts after ``python -u -m`` in each worker's command line
BOOTSTRAP_MODULE = "eventbus.app.worker"

_T = TypeVar("_T")

#: torch's variable for the worker's global rank (set by torchrun for every worker)
ENV_RANK = "RANK"


@attrs.frozen
class WorkerSide:
    """What :func:`attach` started in this process, and the warnings it gave."""

    #: the forwarder ships this process's events to the agent
    forwarding: bool = False
    #: the path the stack dump writes to, when armed
    stack_file: str | None = None
    #: the progress watch's sources, when it runs
    progress: tuple[str, ...] = ()
    #: the job-wide notices are heard (or will be, once the script imports torch)
    notices: bool = False
    #: one line per bad variable, as logged
    warnings: tuple[str, ...] = ()


# -- the launcher's variables, one check each -------------------------------------------


def _decimal(text: str) -> bool:
    # ASCII digits only: str.isdigit() also takes superscript digits, which int() refuses
    return text.isascii() and text.isdecimal() and len(text) <= 10


def _plain_key(value: str) -> str:
    # A key as the launcher writes it ("eventbus/<run id>/<attempt>"): printable, bounded,
    # no "..": an inherited value that is none of these is not the agent's.
    if not (0 < len(value) <= 512 and value.isprintable() and ".." not in value.split("/")):
        raise ValueError("is not a store key (printable, at most 512 characters, no '..')")
    return value


def _store_address(value: str) -> tuple[str, int]:
    host, sep, port_text = value.rpartition(":")
    if not sep or not host or not _decimal(port_text) or not 0 < int(port_text) < 65_536:
        raise ValueError("is not HOST:PORT with a port from 1 to 65535")
    if not host.isprintable() or len(host) > 255:
        raise ValueError("does not name a host")
    return host, int(port_text)


def _rank(value: str) -> int:
    if not _decimal(value.strip()) or int(value) >= 2**31:
        raise ValueError("is not a rank (an int from 0)")
    return int(value)


def _agent_folder(value: str) -> str:
    # The folders the agent names for the stack dump and the flight-recorder dumps: an
    # absolute directory this worker can write.
    if not os.path.isabs(value):
        raise ValueError("is not an absolute path")
    if not os.path.isdir(value):
        raise ValueError("is not a directory")
    if not os.access(value, os.W_OK | os.X_OK):
        raise ValueError(f"is not a directory this worker (uid {os.getuid()}) can write")
    return value


def _ledger_dir(value: str) -> str:
    # The agent names an absolute directory it created (".../eventbus-ledgers-*/
    # attempt-<n>"); anything else is not the agent's, and a worker must not drop files
    # there.
    if not (0 < len(value) <= 4096 and value.isprintable() and os.path.isabs(value)):
        raise ValueError("is not an absolute path")
    head, name = os.path.split(os.path.normpath(value))
    if not (name.startswith("attempt-")
            and os.path.basename(head).startswith("eventbus-ledgers-")):
        raise ValueError("is not an agent's ledger directory (.../eventbus-ledgers-*/"
                         "attempt-N)")
    if not os.path.isdir(value):
        raise ValueError("does not exist")
    return value


#: the fix of a bad variable the agent sets
_FROM_AGENT = ("the agent of `eventbus run` sets it; unset it to run the script without "
               "the agent")


def _read(env: Mapping[str, str], name: str, check: Callable[[str], Any],
          consequence: str, notes: list[str], fix: str = _FROM_AGENT) -> Any:
    """``check(env[name])``; on a bad value, one warning naming the variable, its value,
    what is wrong, the fix, and what the worker does without it; then None."""
    value = env.get(name, "")
    try:
        return check(value)
    except (ValueError, OSError) as exc:
        shown = value if len(value) <= 200 else value[:200] + "..."
        note = f"eventbus: {name}={shown!r} {exc}" + (f"; {fix}" if fix else "")
        note += f". {consequence}"
        logger.warning("%s", note)
        notes.append(note)
        return None


def _forward(env: Mapping[str, str], notes: list[str]) -> bool:
    local = "This worker's events stay in this process."
    address = _read(env, ENV_STORE, _store_address, local, notes)
    if address is None:
        return False
    prefix = _read(env, ENV_PREFIX, _plain_key, local, notes)
    if prefix is None:
        return False
    rank = _read(env, ENV_RANK, _rank, local, notes,
                 fix="torchrun sets it to each worker's global rank")
    if rank is None:
        return False
    ledger_dir = bell = None
    if env.get(ENV_LEDGER_DIR):
        ledger_dir = _read(env, ENV_LEDGER_DIR, _ledger_dir,
                           "This worker leaves no exit ledger.", notes)
    if env.get(ENV_BELL):
        bell = _read(env, ENV_BELL, _plain_key,
                     "This worker's events reach the agent at its next poll.", notes)
    from eventbus.subscribers.store_forwarder import attach_worker_forwarder
    from eventbus.subscribers.worker_exit import install_exit_hooks

    host, port = address
    attach_worker_forwarder(host=host, port=port, prefix=prefix, rank=rank,
                            ledger_dir=ledger_dir, bell=bell)
    install_exit_hooks()
    return True


def _count(value: str) -> int:
    if not _decimal(value.strip()):
        raise ValueError("is not a count (an int from 0)")
    return int(value)


def _notices(env: Mapping[str, str], notes: list[str]) -> bool:
    deaf = "This worker hears no job-wide notices (PREEMPTING, its peers' failures)."
    address = _read(env, ENV_STORE, _store_address, deaf, notes)
    root = _read(env, ENV_NOTICES, _plain_key, deaf, notes) if address else None
    start_after = _read(env, ENV_NOTICE_FROM, _count, deaf, notes) if root else None
    if address is None or root is None or start_after is None:
        return False
    from eventbus.app.worker import notices

    def optional(name: str) -> int | None:
        text = env.get(name, "")
        return int(text) if _decimal(text) else None

    host, port = address
    notices.start(host=host, port=port, root=root, start_after=start_after,
                  rank=optional(ENV_RANK), world_size=optional("WORLD_SIZE"),
                  attempt=_first(optional(ATTEMPT_ENV), optional("TORCHELASTIC_RESTART_COUNT")))
    return True


def _first(*values: int | None) -> int | None:
    return next((v for v in values if v is not None), None)


def _stack_dump(env: Mapping[str, str], notes: list[str]) -> str | None:
    without = "A stall of this worker is reported without its stack."
    directory = _read(env, ENV_STACK_DIR, _agent_folder, without, notes)
    if directory is None:
        return None
    # None for "off" too: the script uses the signal itself, and the agent sends nothing
    signum = _read(env, ENV_STACK_SIGNAL, parse_stack_signal, without, notes, fix="")
    if signum is None:
        return None
    path: str | None = _read(env, ENV_STACK_DIR, lambda d: arm_stack_dump(d, signum),
                             without, notes, fix="give this worker a directory it can write "
                             f"there, or set {ENV_STACK_SIGNAL}=off")
    return path


def _progress_sources(env: Mapping[str, str], notes: list[str]) -> tuple[str, ...]:
    # the one grammar the agent writes (agent_worker.format_progress); its message says
    # what is accepted
    sources: tuple[str, ...] | None = _read(
        env, ENV_PROGRESS, parse_progress, "The progress watch uses all three.", notes,
        fix="")
    return PROGRESS_SOURCES if sources is None else sources


def _progress(env: Mapping[str, str], notes: list[str]) -> tuple[str, ...]:
    sources = _progress_sources(env, notes)
    if not sources:
        return ()
    dump_dir = None
    if env.get(ENV_FR_DUMP_DIR):
        dump_dir = _read(env, ENV_FR_DUMP_DIR, _agent_folder,
                         "This worker writes no flight-recorder dump at a stall.", notes)
    rank_text = env.get(ENV_RANK, "")
    rank = int(rank_text) if _decimal(rank_text) else None
    start_progress_watch(sources, dump_dir=dump_dir, rank=rank)
    return sources


def attach(environ: Mapping[str, str] | None = None) -> WorkerSide:
    """Start the worker side that the launcher's environment describes: the forwarder
    (with ``EVENTBUS_AGENT_STORE``), the stack dump (with ``EVENTBUS_STACK_DIR``) and the
    progress watch (with the forwarder or ``EVENTBUS_PROGRESS``, unless that is ``off``).
    Where none is set this does nothing.

    Never raises: a bad variable is one warning on the ``eventbus`` logger (stderr, when
    logging is not configured yet) naming it and the fix; an unexpected failure is one
    warning too. Calling it again attaches nothing twice.
    """
    env = os.environ if environ is None else environ
    notes: list[str] = []
    forwarding = bool(env.get(ENV_STORE)) and bool(_guarded("forwarder", _forward, env, notes))
    stack_file = _guarded("stack dump", _stack_dump, env, notes) if env.get(ENV_STACK_DIR) \
        else None
    progress = (_guarded("progress watch", _progress, env, notes) or ()) \
        if forwarding or env.get(ENV_PROGRESS) else ()
    hearing = bool(_guarded("notices", _notices, env, notes)) if env.get(ENV_NOTICES) \
        else False
    return WorkerSide(forwarding=forwarding, stack_file=stack_file, progress=progress,
                      notices=hearing, warnings=tuple(notes))


def _guarded(part: str, start: Callable[[Mapping[str, str], list[str]], _T],
             env: Mapping[str, str], notes: list[str]) -> _T | None:
    try:
        return start(env, notes)
    except Exception as exc:  # never out of the bootstrap: the script must run
        note = (f"eventbus: the worker's {part} did not start ({type(exc).__name__}: "
                f"{exc}); the script runs without it")
        logger.warning("%s", note)
        notes.append(note)
        return None


# -- the command line the agent writes ---------------------------------------------------


def bootstrap_args(args: Sequence[str]) -> tuple[str, ...]:
    """The interpreter arguments of a worker started through the bootstrap, from those
    torchrun builds (``-u SCRIPT ...`` or ``-u -m MODULE ...``): the interpreter's own
    options stay first (``-W`` and ``-X`` with their values), ``-m eventbus.app.worker``
    follows them."""
    out = list(args)
    i = 0
    while i < len(out) and out[i].startswith("-") and out[i] != "-" \
            and not out[i].startswith("--"):
        letters = out[i][1:]
        for j, letter in enumerate(letters):
            if letter in "cm":  # the code or the module: the bootstrap's to run
                if j:  # "-uc CODE": the bootstrap goes between -u and -c
                    out[i:i + 1] = ["-" + letters[:j], "-" + letters[j:]]
                    i += 1
                return _with_bootstrap(out, i)
            if letter in "WX":  # a value: the rest of this argument, or the next one
                i += 1 if j < len(letters) - 1 else 2
                break
        else:
            i += 1
    return _with_bootstrap(out, i)


def _with_bootstrap(args: list[str], i: int) -> tuple[str, ...]:
    if args[i:i + 2] == ["-m", BOOTSTRAP_MODULE] or args[i:i + 1] in (["-"], []):
        return tuple(args)  # already bootstrapped, a script on stdin, or nothing to run
    return (*args[:i], "-m", BOOTSTRAP_MODULE, *args[i:])


def run_attached(function: Callable[..., Any], *args: Any) -> Any:
    """Call ``function(*args)`` after :func:`attach`: the bootstrap of a worker whose
    entry point is a Python function (torchrun's ``--run-path``, ``elastic_launch`` with
    a callable)."""
    attach()
    return function(*args)


# -- running the script as __main__ ------------------------------------------------------

_USAGE = ("usage: python -m eventbus.app.worker SCRIPT [ARGS...]\n"
          "       python -m eventbus.app.worker -m MODULE [ARGS...]\n"
          "       python -m eventbus.app.worker -c CODE [ARGS...]")


def _safe_path() -> bool:
    # -P (3.11+), or -I, which implies it (3.10 has isolated but no safe_path flag)
    return bool(getattr(sys.flags, "safe_path", False) or sys.flags.isolated)


def _set_path0(entry: str) -> None:
    # `python -m eventbus.app.worker` put the working directory first; `python SCRIPT`
    # would have put ``entry`` there. Under -P or -I neither puts anything.
    if not _safe_path():
        sys.path[0] = entry


def _run_path(path: str, argv: list[str]) -> None:
    sys.argv[:] = argv
    if not os.path.isfile(path):
        import runpy  # a directory or zip file with a __main__.py, as `python PATH` runs

        if not _safe_path():
            del sys.path[0]  # run_path puts PATH first itself
        runpy.run_path(path, run_name="__main__")
        return
    full = os.path.abspath(path)
    # `python SCRIPT` puts the script's real directory first and runs it as a fresh
    # __main__ module whose __file__ is absolute.
    _set_path0(os.path.dirname(os.path.realpath(path)))
    namespace = _fresh_main(__file__=full, __loader__=SourceFileLoader("__main__", full))
    with io.open_code(full) as f:
        source = f.read()
    exec(compile(source, full, "exec", dont_inherit=True), namespace)


def _fresh_main(**attributes: Any) -> dict[str, Any]:
    main = types.ModuleType("__main__")
    main.__dict__.update(__builtins__=builtins, __cached__=None, __spec__=None,
                         __package__=None, **attributes)
    sys.modules["__main__"] = main
    return main.__dict__


def _run_code(code: str, argv: list[str]) -> None:
    # `python -c CODE ARGS`: sys.argv[0] is "-c", and sys.path[0] the empty string.
    sys.argv[:] = argv
    _set_path0("")
    exec(compile(code, "<string>", "exec", dont_inherit=True),
         _fresh_main(__loader__=None))


def _run_module(name: str, argv: list[str]) -> None:
    import runpy

    sys.argv[:] = argv
    _fresh_main(__loader__=None)
    # What `python -m NAME` itself calls: it runs the module in the real __main__ (which
    # stays after it returns, for atexit and threads), sets sys.argv[0] to its file, and
    # says "No module named ..." or "... cannot be directly executed" in one line, exit 1.
    run_as_main = getattr(runpy, "_run_module_as_main", None)
    if run_as_main is None:  # not seen in 3.10-3.13; the public near-equivalent
        runpy.run_module(name, run_name="__main__", alter_sys=True)
        return
    run_as_main(name, True)


def _script_traceback(tb: types.TracebackType | None) -> types.TracebackType | None:
    """``tb`` without the bootstrap's frames in front of the script's (None when the
    script never ran: a syntax error prints without a traceback, as python's). runpy's
    frames stay, as in the traceback of ``python -m``."""
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return tb


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m eventbus.app.worker SCRIPT ARGS...`` (or ``-m MODULE``, ``-c CODE``): attach,
    then run the script as ``__main__``. Returns the exit code ``python SCRIPT`` would
    have (``SystemExit`` and ``KeyboardInterrupt`` pass through as they would)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["-h"], ["--help"]):
        print(_USAGE)
        return 0
    if not args or (args[0] in ("-m", "-c") and len(args) < 2):
        print(_USAGE, file=sys.stderr)
        return 2
    if args[0] not in ("-m", "-c") and not os.path.exists(args[0]):
        print(f"{sys.executable}: can't open file {os.path.abspath(args[0])!r}: "
              "[Errno 2] No such file or directory", file=sys.stderr)
        return 2
    # a scheduler's drain signal to this worker is handed to the drain (drain_signals.py);
    # first, so that the exit hooks' SIGTERM handler chains to it
    take_drain_signals()
    attach()
    # the restart anatomy's marks: torch imported, the process group ready, the
    # checkpoint loads, the first step (an optimizer's, or the first METRIC step the
    # script records); then the script's first line
    worker_marks.install()
    worker_marks.watch_metric_steps(get_default_bus())
    # the script's process groups end before the interpreter does (a failing script leaves
    # gloo's threads running into finalization, where they abort the worker)
    end_process_groups_at_exit()
    worker_marks.note("script")
    try:
        if args[0] == "-m":
            _run_module(args[1], args[1:])
        elif args[0] == "-c":
            _run_code(args[1], ["-c", *args[2:]])
        else:
            _run_path(args[0], args)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:
        # What the interpreter does with an uncaught exception, minus our own frames:
        # sys.excepthook prints it (a script's own hook included), exit code 1.
        tb = _script_traceback(exc.__traceback__)
        exc = exc.with_traceback(tb)
        # for torch's agent, as its @record would: WORKER_EXIT.message with no script change
        record_uncaught(exc, tb)
        sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, tb
        if sys.version_info >= (3, 12):
            sys.last_exc = exc
        sys.excepthook(type(exc), exc, tb)
        return 1
    return 0
