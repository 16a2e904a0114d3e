"""The compiled hot path (eventbus/_speedups.c), when it was built and is not disabled.

``speedups`` is the module or None. Everything it does, the pure-Python code does too,
with the same results and errors: it takes only the common case and hands anything else
back. ``EVENTBUS_PURE_PYTHON=1`` in the environment disables it (tests run both paths).

A free-threaded interpreter (PEP 703, ``python3.13t``) runs the pure-Python path: the
compiled code relies on the GIL (it reads and writes a sink's state between calls that a
GIL makes atomic), so setup.py does not build it there and, should a module built for
such an interpreter be present anyway, it is not imported (:func:`compiled_refused`).
"""

from __future__ import annotations

import importlib
import os
import sys
import sysconfig
from types import ModuleType


def free_threaded() -> bool:
    """Whether this interpreter is a free-threaded build (``Py_GIL_DISABLED``) running
    without its GIL (``python3.13t -X gil=1`` runs with it: then the build still is one)."""
    if not sysconfig.get_config_var("Py_GIL_DISABLED"):
        return False
    is_gil_enabled = getattr(sys, "_is_gil_enabled", None)
    return not (is_gil_enabled is not None and is_gil_enabled())


def compiled_refused(*, pure_python: str, gil_disabled: bool) -> str | None:
    """Why the compiled path is not used, or None when it may be imported.

    ``pure_python``: the value of ``EVENTBUS_PURE_PYTHON`` ("" when unset);
    ``gil_disabled``: :func:`free_threaded`.
    """
    if pure_python not in ("", "0"):
        return "EVENTBUS_PURE_PYTHON is set"
    if gil_disabled:
        return "a free-threaded interpreter: eventbus/_speedups.c relies on the GIL"
    return None


#: why ``speedups`` is None where it is (None: it was allowed; see ``speedups`` then)
refused: str | None = compiled_refused(pure_python=os.environ.get("EVENTBUS_PURE_PYTHON", ""),
                                       gil_disabled=free_threaded())
speedups: ModuleType | None = None
if refused is None:
    try:  # by name: a submodule import of the package would be a cycle through __init__
        speedups = importlib.import_module("eventbus._speedups")
    except ImportError:  # not built (no C compiler where it was installed): pure Python
        speedups = None
