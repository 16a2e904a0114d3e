"""Slurm's hostlist notation, both ways: ``node[3,17-18],gpu-a1``.

``sbatch --exclude`` takes a list of names in which a run of numbered hosts is one
bracket: ``node[3,17-18]`` is ``node3``, ``node17`` and ``node18``. A bracket keeps the
numbers' width when they are zero-padded: ``node[007-009]`` is ``node007`` ... ``node009``,
while ``node[9-10]`` is ``node9`` and ``node10``. :func:`compress` only joins hosts that
read back the same (same prefix before the trailing number; same padding, where a number
without a leading zero joins the padded ones of its own width), so
``expand(compress(hosts))`` is the set of ``hosts``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["HostlistError", "compress", "expand"]

_NUMBERED = re.compile(r"^(.*?)(\d+)$")
_BRACKET = re.compile(r"^(?P<prefix>[^\[\]]*)\[(?P<ranges>[^\[\]]+)\](?P<suffix>[^\[\]]*)$")


class HostlistError(ValueError):
    """A hostlist that does not parse."""


def compress(hosts: Iterable[str]) -> str:
    """The hosts in hostlist notation, groups in order of their prefix."""
    plain: set[str] = set()
    numbered: dict[str, list[str]] = {}
    for host in set(hosts):
        match = _NUMBERED.match(host)
        if match is None or "[" in host or "]" in host:
            plain.add(host)
        else:
            numbered.setdefault(match[1], []).append(match[2])
    parts: list[tuple[str, str]] = [(host, host) for host in plain]
    for prefix, digits in numbered.items():
        for width, numbers in _by_width(digits).items():
            parts.append((prefix, _group(prefix, sorted(numbers), width)))
    return ",".join(text for _, text in sorted(parts))


def _by_width(digits: list[str]) -> dict[int, list[int]]:
    """The numbers by the width they keep: a zero-padded one its length, others 0. A number
    without a leading zero joins the padded group of its own length when there is one."""
    padded = {len(d) for d in digits if len(d) > 1 and d.startswith("0")}
    groups: dict[int, list[int]] = {}
    for d in digits:
        width = len(d) if len(d) in padded else 0
        groups.setdefault(width, []).append(int(d))
    return groups


def _group(prefix: str, numbers: list[int], width: int) -> str:
    if len(numbers) == 1:
        return f"{prefix}{numbers[0]:0{width}d}"
    runs: list[list[int]] = []
    for number in numbers:
        if runs and number == runs[-1][-1] + 1:
            runs[-1].append(number)
        else:
            runs.append([number])
    ranges = [f"{run[0]:0{width}d}" if len(run) == 1 else
              f"{run[0]:0{width}d}-{run[-1]:0{width}d}" for run in runs]
    return f"{prefix}[{','.join(ranges)}]"


def expand(hostlist: str) -> list[str]:
    """``node[3,17-18],gpu-a1`` -> ``["node3", "node17", "node18", "gpu-a1"]``."""
    hosts: list[str] = []
    for item in _split(hostlist):
        match = _BRACKET.match(item)
        if match is None:
            if "[" in item or "]" in item:
                raise HostlistError(f"{item!r}: one bracket of numbers per name")
            hosts.append(item)
            continue
        for part in match["ranges"].split(","):
            low, _, high = part.partition("-")
            if not low.isdigit() or (high and not high.isdigit()):
                raise HostlistError(f"{item!r}: {part!r} is not a number nor a range")
            width = len(low) if low.startswith("0") and len(low) > 1 else 0
            for number in range(int(low), int(high or low) + 1):
                hosts.append(f"{match['prefix']}{number:0{width}d}{match['suffix']}")
    return hosts


def _split(hostlist: str) -> list[str]:
    """The comma-separated items, commas inside brackets kept."""
    items: list[str] = []
    depth, start = 0, 0
    for i, char in enumerate(hostlist):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            items.append(hostlist[start:i])
            start = i + 1
    items.append(hostlist[start:])
    return [item.strip() for item in items if item.strip()]
