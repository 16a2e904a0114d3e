"""The worker's error file: an uncaught exception recorded as torch's ``@record`` records
it, for a script that does not use ``@record``.

Torch's agent gives every worker a path in ``TORCHELASTIC_ERROR_FILE`` and, when the worker
fails, reads the JSON there (``torch.distributed.elastic.multiprocessing.errors``'s
``ProcessFailure``): ``{"message": {"message": "TYPE: TEXT", "extraInfo":
{"py_callstack": TRACEBACK, "timestamp": "SECONDS"}}}``. That message becomes
``WORKER_EXIT.message``, what reactors such as the README's ``oom_is_fatal`` read, and the
"error" of torchrun's failure table. Torch writes the file only for a script whose entry
function carries ``@record``; the worker bootstrap writes it for every script, in the same
format, so an unchanged script's failure carries its message too.

Torch-free, and silent: the worker's stderr and exit code stay exactly those of
``python SCRIPT``.
"""

from __future__ import annotations

import json
import os
import time
import traceback
import types

__all__ = ["ENV_ERROR_FILE", "error_file_data", "record_uncaught"]

#: the variable torch's agent sets to each worker's error file path
ENV_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"


def error_file_data(exc: BaseException, tb: types.TracebackType | None) -> dict[str, object]:
    """What torch's ``@record`` writes for ``exc``: the message ``TYPE: TEXT`` (the type's
    plain name, as torch names it), the traceback, the time in whole seconds."""
    return {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(type(exc), exc, tb)),
                "timestamp": str(int(time.time())),
            },
        }
    }


def record_uncaught(exc: BaseException, tb: types.TracebackType | None,
                    environ: os._Environ[str] | dict[str, str] | None = None) -> str | None:
    """Write ``exc`` to the worker's error file; returns the path written, or None.

    Nothing is written outside torch's agent (no ``TORCHELASTIC_ERROR_FILE``), nor over a
    file already there (the script's own ``@record`` wrote it: its message stays). The
    file appears whole or not at all (written aside, then renamed): a worker stopped
    while writing leaves no torn file for torch's reader. Never raises.
    """
    env = os.environ if environ is None else environ
    path = env.get(ENV_ERROR_FILE, "")
    if not path:
        return None
    try:
        if os.path.exists(path) and os.path.getsize(path) > 0:
            return None
        text = json.dumps(error_file_data(exc, tb), default=str)
        aside = f"{path}.{os.getpid()}.tmp"
        with open(aside, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(aside, path)
        return path
    except Exception:  # a failing error file must not change the worker's exit
        return None
