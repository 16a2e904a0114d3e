"""The workers' log folder when ``--log-dir`` is not given: made by the command, removed at
its end unless it holds logs the user asked for.

Without ``--log-dir``, torch's launcher makes ``$TMPDIR/torchelastic_<random>`` for every
run and leaves it there: each worker's error file is in it, and its output with
``--redirects`` or ``--tee``. A node that runs jobs for months fills its ``/tmp`` with
them. ``eventbus run`` makes that folder itself, with the same name, and hands it to torch
as the log folder (the same layout within), so it knows the folder it owns. At the end of
the command, once the failure table was printed and the root cause's error file copied
(torch's ``record``), the folder is removed, unless it holds what the user may still read:
a worker's error file (the failure table names it as ``error_file:``), or the logs
``--redirects`` or ``--tee`` asked for. Then it stays: the logs named in one console line,
an error file by the failure table (docs/run.md, "What a job leaves behind").

A folder the user named (``--log-dir``), or a ``--logs-specs`` of the user's own, is the
user's: never touched. Torch-free.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

from eventbus.app.launcher.cli import console

__all__ = ["JobLogDir", "asks_for_logs"]

#: the prefix torch's launcher gives the folder it makes (``DefaultLogsSpecs``)
PREFIX = "torchelastic_"
#: the name of a worker's error file in it (torch's ``<log dir>/<run>/attempt_<A>/<rank>/``)
ERROR_FILE = "error.json"


def asks_for_logs(*settings: str) -> bool:
    """Whether torchrun's ``--redirects`` / ``--tee`` values (``0``-``3``, or
    ``RANK:VALUE,...``) send any rank's output to files. A value torch will refuse counts as
    asking (torch says why; nothing is removed meanwhile)."""
    for setting in settings:
        for part in str(setting).split(","):
            value = part.rpartition(":")[2].strip()
            try:
                if int(value) != 0:
                    return True
            except ValueError:
                return True
    return False


class JobLogDir:
    """The log folder this command made (``path``); ``keep``: it is to hold the workers'
    output (``--redirects``/``--tee``)."""

    def __init__(self, path: str, *, keep: bool) -> None:
        self.path = path
        self.keep = keep

    @classmethod
    def for_job(cls, args: argparse.Namespace) -> JobLogDir | None:
        """Make the folder and set ``args.log_dir`` to it, when the user gave neither
        ``--log-dir`` nor ``--logs-specs``; else None (torch's or the user's choice)."""
        if args.log_dir or getattr(args, "logs_specs", None) is not None:
            return None
        try:
            path = tempfile.mkdtemp(prefix=PREFIX)
        except OSError:
            return None  # torch's own attempt says why
        args.log_dir = path
        return cls(path, keep=asks_for_logs(args.redirects, args.tee))

    def close(self) -> None:
        """The command's end: the folder removed, or kept when it holds the logs asked for
        (named in a console line) or a worker's error file (named by the failure table).
        A folder without any file (no worker started, none failed) is removed either way.
        Never raises."""
        files = [name for _, _, names in os.walk(self.path) for name in names]
        if self.keep and files:
            console.write(f"the workers' logs are kept in {self.path} (--redirects/--tee "
                          "without --log-dir)")
            return
        if ERROR_FILE in files:  # the failure table named it (``error_file:``): no line
            return
        shutil.rmtree(self.path, ignore_errors=True)
