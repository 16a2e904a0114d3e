"""How `make test` splits the fast suite: a parallel pass (``pytest -n 2``) of everything
not marked ``serial``, then the ``serial`` tests alone, collected from the Makefile's
``SERIAL_TESTS`` only. A module that holds a serial test and is missing from that list
would run in neither pass."""

from __future__ import annotations

import re

from tests.conftest import ROOT


def _makefile_list(name: str) -> set[str]:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    match = re.search(rf"^{name} := ((?:[^\n]*\\\n)*[^\n]*)$", text, re.M)
    assert match, f"no {name} in the Makefile"
    return set(match.group(1).replace("\\\n", " ").split())


def test_every_module_with_a_serial_test_is_in_serial_tests() -> None:
    marker = re.compile(r"^(?:@pytest\.mark\.serial|pytestmark = pytest\.mark\.serial)", re.M)
    marked = {path.relative_to(ROOT).as_posix() for path in (ROOT / "tests").rglob("test_*.py")
              if marker.search(path.read_text(encoding="utf-8"))}
    assert marked == _makefile_list("SERIAL_TESTS")
