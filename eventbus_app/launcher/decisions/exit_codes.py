"""The exit codes of ``eventbus run``: one table, for ``--help``, docs/run.md and the
scheduler that decides what to do next.

A scheduler acts on the code alone: run the job again now, later, elsewhere, or never.
So each outcome has its own code, each is settable (``--stop-exit-code``,
``--drain-exit-code``, ``--bad-host-exit-code``, ``--hang-exit-code``), and two outcomes
given one code is a usage error (:func:`clashes`). Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

__all__ = [
    "DEFAULT_BAD_HOST_EXIT_CODE",
    "DEFAULT_HANG_EXIT_CODE",
    "EXIT_CODES",
    "ExitCode",
    "clashes",
    "table_text",
]

#: ``--bad-host-exit-code`` default: beside the drain's 75 (EX_TEMPFAIL): run it again,
#: elsewhere
DEFAULT_BAD_HOST_EXIT_CODE = 76
#: ``--hang-exit-code`` default: the restarts were spent on hangs (``timeout``'s 124)
DEFAULT_HANG_EXIT_CODE = 124


@attrs.frozen
class ExitCode:
    """One row: the option that sets it (None: fixed), its default, what happened, and
    what a scheduler should do."""

    option: str | None
    default: int
    outcome: str
    then: str
    #: the outcome in a few words, for a usage error ("a drained job")
    short: str = ""


#: name -> row, in the order of the table
EXIT_CODES: Mapping[str, ExitCode] = {
    "success": ExitCode(None, 0, "every worker finished (or this node waited, a spare, and "
                        "the job ended without it)", "nothing", "a job that succeeded"),
    "failure": ExitCode(None, 1, "a worker failed and the restarts are spent, or the "
                        "launcher failed", "look at the failure; retry if it may pass",
                        "a failed job"),
    "stop": ExitCode("--stop-exit-code", 3, "a reactor's STOP ended the job",
                     "do not retry", "a stopped job"),
    "hang": ExitCode("--hang-exit-code", DEFAULT_HANG_EXIT_CODE,
                     "the restarts were spent on hangs (the last attempt ended by a stall "
                     "verdict)", "look at the culprits; retry elsewhere if a host is named",
                     "a job that hung"),
    "drain": ExitCode("--drain-exit-code", 75, "drained: every rank saved and stopped "
                      "after a drain signal (preemption)", "requeue", "a drained job"),
    "bad_host": ExitCode("--bad-host-exit-code", DEFAULT_BAD_HOST_EXIT_CODE,
                         "this node's host was evicted (--evict-after host faults; during a "
                         "drain too) or refused (--exclude-bad-hosts)",
                         "requeue on other hosts",
                         "a bad host"),
}


def clashes(codes: Mapping[str, int]) -> str | None:
    """A usage error's text when two outcomes of ``codes`` (name -> code) share a code,
    naming both options; None when every code is distinct."""
    seen: dict[int, str] = {}
    for name, code in codes.items():
        if code in seen:
            first, second = seen[code], name
            return (f"{_named(second)} {code} is {_named(first)} too: a scheduler could not "
                    f"tell {EXIT_CODES[second].short} from {EXIT_CODES[first].short}; give "
                    "them different codes")
        seen[code] = name
    return None


def _named(name: str) -> str:
    option = EXIT_CODES[name].option
    return option if option is not None else f"the {name} code"


def table_text(codes: Mapping[str, int] | None = None) -> str:
    """The table for ``--help``: one line per outcome, its code (``codes`` overrides the
    defaults), the option that sets it, and what to do."""
    lines = ["exit codes:"]
    for name, row in EXIT_CODES.items():
        code = (codes or {}).get(name, row.default)
        option = f" ({row.option})" if row.option else ""
        lines.append(f"  {code:>3}  {row.outcome}{option}; then: {row.then}")
    return "\n".join(lines)
