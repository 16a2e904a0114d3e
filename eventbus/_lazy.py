"""Public names that load on first use (PEP 562), for the packages' ``__init__`` modules.

``import eventbus.publishers`` or ``import eventbus.subscribers`` alone then costs nothing
beyond eventbus: a worker that only records never pays for the logging bridge or the torch
bridge.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Mapping

__all__ = ["lazy_exports"]


def lazy_exports(package: str, names: Mapping[str, str], public: Iterable[str]
                 ) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``: ``names`` maps each lazy public
    name to the module defining it; a name loaded once is kept in the package's globals."""

    def __getattr__(name: str) -> object:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *public})

    return __getattr__, __dir__
