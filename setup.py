"""The one build step pyproject.toml cannot say without an experimental table: the
compiled hot path of record() and of a queued sink's enqueue (eventbus/_speedups.c).

Optional: where no C compiler is at hand the build goes on without it, and eventbus runs
its pure-Python path, with the same behaviour (docs/performance.md gives the cost).
Not built at all for a free-threaded interpreter (``Py_GIL_DISABLED``, PEP 703): the
compiled code relies on the GIL, so there eventbus runs its pure-Python path
(eventbus/_compiled.py does not import the module there either).
"""

import sysconfig

from setuptools import Extension
from setuptools import setup


def ext_modules(gil_disabled: object) -> list[Extension]:
    """The compiled modules for an interpreter whose ``Py_GIL_DISABLED`` is ``gil_disabled``."""
    if gil_disabled:
        return []
    return [Extension("eventbus._speedups", ["eventbus/_speedups.c"], optional=True)]


setup(ext_modules=ext_modules(sysconfig.get_config_var("Py_GIL_DISABLED")))
