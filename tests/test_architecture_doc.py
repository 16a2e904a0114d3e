"""docs/architecture.md names every module of the four folders, and only those.

The page has one section per folder, headed with the folder in backticks (``## The core:
`eventbus/` ``), whose tables name the modules by their path inside that folder in the
first column (```launcher/agent.py` ``) and say what each is for in the second. The tree
is read at run time with ``os.walk``, which does not follow the checkout's links
(eventbus/publishers, eventbus/subscribers, eventbus/app), so each module counts once,
under its own folder.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path

from tests.conftest import ROOT

PAGE = ROOT / "docs" / "architecture.md"

#: the repository folders of the four layers (pyproject.toml's package-dir)
FOLDERS = ("eventbus", "publishers", "subscribers", "eventbus_app")

#: the files that are modules: Python sources, the C extension's source, its type stub
MODULE_SUFFIXES = (".py", ".c", ".pyi")

_HEADING = re.compile(r"^## .*?`(?P<folder>[\w.]+)/`", re.M)
_ROW = re.compile(r"^\|(?P<first>[^|\n]*)\|(?P<second>[^|\n]*)\|", re.M)
_PATH = re.compile(r"`([\w./]+\.(?:py|c|pyi))`")


def _tree() -> set[str]:
    """Every module file of the four folders, as ``folder/path``."""
    found: set[str] = set()
    for folder in FOLDERS:
        top = ROOT / folder
        for directory, subdirs, files in os.walk(top):  # links to folders are not entered
            subdirs[:] = sorted(d for d in subdirs
                                if d != "__pycache__" and not d.startswith("."))
            for name in files:
                path = Path(directory) / name
                if name.endswith(MODULE_SUFFIXES) and not path.is_symlink():
                    found.add(f"{folder}/{path.relative_to(top).as_posix()}")
    return found


def _sections(text: str) -> dict[str, str]:
    """Folder -> the text of the section headed with it (to the next ``## `` heading)."""
    headings = list(_HEADING.finditer(text))
    sections: dict[str, str] = {}
    for heading in headings:
        end = text.find("\n## ", heading.end())
        body = text[heading.end():] if end < 0 else text[heading.end():end]
        sections[heading["folder"]] = sections.get(heading["folder"], "") + body
    return sections


def _documented(text: str) -> tuple[list[str], list[str]]:
    """The modules the page names (``folder/path``, in page order, repeats kept), and the
    rows whose role is empty."""
    named: list[str] = []
    no_role: list[str] = []
    for folder, body in _sections(text).items():
        for row in _ROW.finditer(body):
            paths = _PATH.findall(row["first"])
            named += [f"{folder}/{path}" for path in paths]
            if paths and not row["second"].strip():
                no_role += [f"{folder}/{path}" for path in paths]
    return named, no_role


def test_every_module_of_the_tree_is_named_once_with_a_role() -> None:
    """Each module file under the four folders has a row in docs/architecture.md, in the
    section of its folder, with what it is for; no row names a file that is gone."""
    named, no_role = _documented(PAGE.read_text(encoding="utf-8"))
    tree = _tree()
    problems: list[str] = []
    missing = sorted(tree - set(named))
    if missing:
        problems.append("not named (add a row to the table of its folder's section): "
                        + ", ".join(missing))
    stale = sorted(set(named) - tree)
    if stale:
        problems.append("named but not in the tree (renamed or removed? fix the row): "
                        + ", ".join(stale))
    twice = sorted(path for path, count in Counter(named).items() if count > 1)
    if twice:
        problems.append("named more than once: " + ", ".join(twice))
    if no_role:
        problems.append("a row with no role: " + ", ".join(sorted(no_role)))
    assert not problems, "docs/architecture.md: " + "; ".join(problems)


def test_each_folder_has_its_section() -> None:
    """The page has one section per folder of the four layers, so a module cannot be
    documented under another folder's name."""
    sections = _sections(PAGE.read_text(encoding="utf-8"))
    assert sorted(sections) == sorted(FOLDERS), (
        f"docs/architecture.md: sections for {sorted(sections)}, expected one per folder "
        f"{sorted(FOLDERS)} (a `## ...` heading with the folder in backticks, e.g. "
        "`eventbus/`)")


def test_the_layout_section_matches_the_checkout_links() -> None:
    """The "Layout" section is there, and the links it defends are in the checkout: each
    of eventbus/publishers, eventbus/subscribers, eventbus/app points at its folder."""
    text = PAGE.read_text(encoding="utf-8")
    assert re.search(r"^## Layout\b", text, re.M), "docs/architecture.md has no Layout section"
    for link, target in (("publishers", "publishers"), ("subscribers", "subscribers"),
                         ("app", "eventbus_app")):
        path = ROOT / "eventbus" / link
        assert path.is_symlink(), f"eventbus/{link} is not a link (git core.symlinks off?)"
        assert os.path.normpath(os.readlink(path)) == os.path.join("..", target)
        assert f"`eventbus/{link}`" in text and f"`../{target}`" in text


def test_the_tree_reader_sees_what_it_must() -> None:
    """The walk finds modules at every depth and the C source, once each: the check above
    cannot pass by reading nothing."""
    tree = _tree()
    assert {"eventbus/bus.py", "eventbus/_speedups.c", "subscribers/queued.py",
            "eventbus_app/cli.py"} <= tree
    assert any(p.startswith("eventbus_app/") and p.count("/") == 2 for p in tree)
    assert not any(p.startswith(("eventbus/publishers/", "eventbus/subscribers/",
                                 "eventbus/app/")) for p in tree)
