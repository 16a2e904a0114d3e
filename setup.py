"""The one build step pyproject.toml cannot say without an experimental table: the
compiled hot path of record() and of a queued sink's enqueue (eventbus/_speedups.c).

Optional: where no C compiler is at hand the build goes on without it, and eventbus runs
its pure-Python path, with the same behaviour (docs/performance.md gives the cost).
"""

from setuptools import Extension
from setuptools import setup

setup(ext_modules=[Extension("eventbus._speedups", ["eventbus/_speedups.c"], optional=True)])
