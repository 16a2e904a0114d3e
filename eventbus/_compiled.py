"""The compiled hot path (eventbus/_speedups.c), when it was built and is not disabled.

``speedups`` is the module or None. Everything it does, the pure-Python code does too,
with the same results and errors: it takes only the common case and hands anything else
back. ``EVENTBUS_PURE_PYTHON=1`` in the environment disables it (tests run both paths).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

speedups: ModuleType | None = None
if os.environ.get("EVENTBUS_PURE_PYTHON", "") in ("", "0"):
    try:  # by name: a submodule import of the package would be a cycle through __init__
        speedups = importlib.import_module("eventbus._speedups")
    except ImportError:  # not built (no C compiler where it was installed): pure Python
        speedups = None
