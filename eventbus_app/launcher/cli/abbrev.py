"""Abbreviated options of ``eventbus run``, before SCRIPT only.

torchrun accepts any unique prefix of its long options (argparse's ``allow_abbrev``):
``--redirect=3`` is ``--redirects=3``, ``--nproc 2`` is ``--nproc-per-node 2``. argparse
looks every ``-``-word of the command line up that way, the script's own arguments after
SCRIPT included, so a script option that is a prefix of two launcher options
(``train.py --bad-host``) would end the run as "ambiguous" before the script got it.
``eventbus run``'s parser therefore has abbreviations off, and :func:`expand` writes each
abbreviation out in full before the parser sees the command line, up to SCRIPT (or
``--``): nothing after it is touched.

Torch-free: :mod:`eventbus.app.launcher.command` calls it from its parser.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence

__all__ = ["expand"]

#: a word argparse takes for a value, not an option, although it starts with "-"
_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


def _is_option(word: str) -> bool:
    """Whether argparse would take ``word`` for an option (not ``-``, not ``-3``)."""
    return word.startswith("-") and word != "-" and not _NEGATIVE_NUMBER.match(word)


def _resolve(parser: argparse.ArgumentParser,
             name: str) -> tuple[argparse.Action | None, str]:
    """The action ``name`` names and its full option string: itself when exact, else the
    one action whose long options start with it. Several actions: argparse's usage error
    ("ambiguous option: ... could match ..."). None: no option of the parser's (argparse
    reports it as unrecognized)."""
    known = parser._option_string_actions
    if name in known:
        return known[name], name
    if not name.startswith("--") or len(name) < 3:
        return None, name
    # one entry per action: --nproc-per-node and --nproc_per_node are one option
    matches: dict[int, tuple[argparse.Action, str]] = {}
    for option, action in known.items():
        if option.startswith(name):
            matches.setdefault(id(action), (action, option))
    if len(matches) > 1:
        listed = ", ".join(option for _, option in matches.values())
        parser.error(f"ambiguous option: {name} could match {listed}")
    if matches:
        return next(iter(matches.values()))
    return None, name


def _values_taken(action: argparse.Action | None, words: Sequence[str], at: int) -> int:
    """How many of ``words[at:]`` an option of ``action`` written without ``=`` takes as
    its values (argparse's count for the nargs the launcher's options use)."""
    if action is None:
        return 0
    nargs = action.nargs
    if nargs is None or nargs == "?":
        taken = 1 if at < len(words) and not _is_option(words[at]) else 0
        return taken
    if isinstance(nargs, int):
        return nargs
    return 0


def expand(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """``argv`` with each abbreviated option before SCRIPT written out in full
    (``--redirect=3`` -> ``--redirects=3``); every word from SCRIPT (the first word that is
    not an option nor an option's value) or ``--`` on is left as it is. An ambiguous prefix
    before SCRIPT is a usage error (``parser.error``)."""
    words = list(argv)
    at = 0
    while at < len(words):
        word = words[at]
        if word == "--" or not _is_option(word):
            break  # SCRIPT: the rest is the script's
        name, eq, value = word.partition("=") if word.startswith("--") else (word, "", "")
        action, full = _resolve(parser, name)
        if full != name:
            words[at] = full + eq + value
        at += 1
        if not eq:
            at += _values_taken(action, words, at)
    return words
