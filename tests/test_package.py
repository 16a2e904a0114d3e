"""The packages themselves: light imports, explicit public names."""

from __future__ import annotations

import subprocess
import sys

import pytest

import eventbus
import publishers
import subscribers
from tests.conftest import subprocess_env


def test_import_does_not_pull_in_torch() -> None:
    """import eventbus, publishers, subscribers loads no torch, numpy nor orjson (and prints
    its import time)."""
    code = ("import sys, time; t = time.perf_counter(); import eventbus, publishers, "
            "subscribers; ms = (time.perf_counter() - t) * 1000; "
            "print(f'{ms:.1f}', 'torch' in sys.modules, 'numpy' in sys.modules, "
            "'orjson' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=subprocess_env(), timeout=60, check=True).stdout.split()
    print(f"import eventbus, publishers, subscribers: {out[0]} ms")
    assert out[1:] == ["False", "False", "False"]  # orjson: on the first batch


@pytest.mark.parametrize("module", [eventbus, publishers, subscribers])
def test_all_is_sorted_and_complete(module: object) -> None:
    """__all__ is sorted, names only what exists, and every public attribute is in it."""
    names = module.__all__  # type: ignore[attr-defined]
    assert names == sorted(names)
    for name in names:
        assert hasattr(module, name), name
    import types

    public = {n for n, v in vars(module).items()
              if not n.startswith("_") and not isinstance(v, types.ModuleType)
              and n not in {"annotations", "TYPE_CHECKING"}}
    assert public <= set(names), sorted(public - set(names))


def test_python_dash_m_eventbus_help_works() -> None:
    """python -m eventbus --help lists the subcommands."""
    out = subprocess.run([sys.executable, "-m", "eventbus", "--help"], capture_output=True,
                         text=True, env=subprocess_env(), timeout=60, check=True).stdout
    for command in ("run", "trace", "plot", "tail"):
        assert command in out
