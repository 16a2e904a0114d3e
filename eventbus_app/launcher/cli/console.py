"""The agent's console: one ``eventbus:`` line on stderr for every failure, stall,
straggler, restart decision and STOP, with or without ``--log-events``.

A person at a terminal sees, for each decision, the rank that caused it, what happened to
it, and what the agent does next::

    eventbus: rank 1 failed (exit code 3); restarting the group as attempt 1 (1 restart left)
    eventbus: rank 1 stalled for 5.2 s (train.py:18); restarting the group as attempt 1
    (2 restarts left)   [one line on the console]
        File "train.py", line 18 in main
        ...

What happened to a rank is its event's sentence (:func:`eventbus.app.sentences.sentence`,
the words the page, the webhook and the plot use too). A stall's stack follows its line,
indented, on several lines: the culprit's main thread first, eventbus's own threads last
and marked, each with its top frame only (:func:`eventbus.app.health.stacks.stack_lines`).
Torch-free.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from collections.abc import Sequence
from typing import TextIO

from eventbus.app.health.stacks import stack_lines
from eventbus.app.sentences import sentence
from eventbus.events import Event
from eventbus.events import WorkerSlow
from eventbus.events import WorkerStalled

__all__ = [
    "PREFIX",
    "culprits_text",
    "indented",
    "slow_line",
    "stall_detail_lines",
    "write",
]

#: how every console line of the agent starts
PREFIX = "eventbus: "


def write(line: str, *, stream: TextIO | None = None) -> None:
    """``eventbus: LINE`` (and the indented lines after a newline) on stderr, at once."""
    out = stream if stream is not None else sys.stderr
    text = line if line.startswith(PREFIX) else PREFIX + line
    try:
        out.write(text.rstrip("\n") + "\n")
        out.flush()
    except (OSError, ValueError):  # a closed or broken stderr must not fail the agent
        pass


# -- the lines -------------------------------------------------------------------------


def culprits_text(events: Sequence[Event]) -> str:
    """The sentence of the first event (the rank that caused the decision), and the other
    ranks in one clause: the second's sentence, or how many more and which."""
    first = sentence(events[0])
    others = list(events[1:])
    if not others:
        return first
    if len(others) == 1:
        return f"{first}; {sentence(others[0])}"
    ranks = ", ".join(str(getattr(e, "worker_id", "?")) for e in others)
    return f"{first}; {len(others)} more ranks too ({ranks})"


def slow_line(event: WorkerSlow) -> str:
    """The straggler's line (reporting only: no decision follows)."""
    return f"{sentence(event)} (reported only; no restart)"


def stall_detail_lines(event: WorkerStalled, seen: set[str] | None = None) -> list[str]:
    """The lines under a stall's line: the diagnosis (unless in ``seen``), then the
    culprit's stack."""
    seen = set() if seen is None else seen
    lines: list[str] = []
    diagnosis = event.data.get("diagnosis")
    if isinstance(diagnosis, str) and diagnosis and diagnosis not in seen:
        seen.add(diagnosis)  # one diagnosis may name several stalled ranks
        lines.append(diagnosis)
    stack = event.data.get("stack")
    if isinstance(stack, str) and stack.strip():
        lines.append(f"rank {event.worker_id}'s stack (main thread first):")
        lines.extend("  " + line if line else "" for line in stack_lines(stack))
    return lines


def indented(lines: Iterable[str], indent: str = "    ") -> str:
    """``lines`` as one text, each line but the empty ones indented."""
    return "\n".join(indent + line if line else "" for line in lines)
