"""Host faults: the failures that point at the machine, not at the script.

A node whose hardware goes bad fails again on every attempt, and each restart spends the
budget on the same machine. Evicting it needs a verdict that a healthy script's bug never
earns, so the rule below is narrow and in one place, torch-free, and tested as a table
(tests/test_host_faults.py). :func:`host_fault` answers with the fault's kind, or None:

==============  =========================================================================
``signal``      the worker died of SIGSEGV, SIGBUS or SIGILL (not sent by the agent)
``oom``         the worker died of SIGKILL that the agent did not send, while the kernel's
                OOM killer killed in the agent's memory cgroup (its ``oom_kill`` count rose)
``ecc``         an ECC error in the failure's message (uncorrectable, row remapping)
``cuda``        a CUDA error that a script cannot cause (launch failure, a GPU lost or
                fallen off the bus, an Xid, an NVLink error, CUDA's "unknown error")
``nccl``        NCCL or the network card failing (a system error, an InfiniBand/ibverbs or
                socket transport error)
``hang``        the rank was the culprit of a hang: stalled while it was not waiting in a
                collective (``blocked``, ``spinning``, ``unresponsive``, ``silent``:
                the rank that never entered the collective its peers wait in)
``straggler``   the rank was reported slow :data:`STRAGGLER_STREAK` times in a row
``reactor``     a reactor said so (:func:`mark_host_fault`)
``lost``        the node left the rendezvous without a word (dead, cut off): recorded for
                it by the next round's group rank 0 (lost.py), never by :func:`host_fault`
==============  =========================================================================

Never a host fault: a Python exception of the script (``RuntimeError``, ``ValueError``,
``torch.OutOfMemoryError``: a batch too large for the device is the script's), a CUDA
device-side assert or an illegal memory access (usually an indexing bug), a collective
timeout of a rank that waited for a peer (the victim of another's fault), a culprit stuck
inside a collective (a mismatch between ranks is the script's), an exit the
agent caused (SIGTERM/SIGKILL of a stop), a SIGKILL with no OOM kill seen (a person's
``kill -9``), a rank that waits for data (storage, not the node).

What the rule cannot tell apart, said in docs/run.md ("Bad hosts"): a C extension that
segfaults on every machine looks like a bad host on each of them (eviction needs
``--evict-after`` faults on the same node, so it moves from node to node rather than
emptying the job); a NIC that fails makes its peers' NCCL see errors too (the failure that
came first on each node is classified; the others of the same attempt are not).
"""

from __future__ import annotations

import re
import signal as signals
import threading
from collections.abc import Mapping
from typing import Any

import attrs

__all__ = [
    "KINDS",
    "LOST",
    "STRAGGLER_STREAK",
    "Failure",
    "host_fault",
    "kinds_said",
    "mark_host_fault",
    "take_mark",
]


#: every kind :func:`host_fault` returns, in the order of the module docstring's table
KINDS = ("signal", "oom", "ecc", "cuda", "nccl", "hang", "straggler", "reactor")
#: the kind of a node lost without a word: recorded for it by another node (lost.py),
#: never returned by :func:`host_fault`
LOST = "lost"

#: successive ``WORKER_SLOW`` reports of one rank that make it a persistent straggler
STRAGGLER_STREAK = 3

_HARDWARE_SIGNALS = frozenset({signals.SIGSEGV, signals.SIGBUS, signals.SIGILL})

#: what a stalled rank was doing that makes it the culprit rather than a victim
_CULPRIT_WAITS = frozenset({"blocked", "spinning", "unresponsive", "silent"})

_NOT_HARDWARE = re.compile(
    r"out of memory|OutOfMemoryError|device-side assert|illegal memory access"
    r"|Watchdog caught collective operation timeout|Timed out waiting|timed out after",
    re.IGNORECASE)

#: the kind first, then its patterns; searched in this order (an ECC error is also a CUDA
#: error, and says more)
_MESSAGES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("ecc", re.compile(
        r"\bECC\b|uncorrectable|row remap|CUDA_ERROR_ECC|DBE|double.bit", re.IGNORECASE)),
    ("cuda", re.compile(
        r"unspecified launch failure|fallen off the bus|GPU is lost|\bXid\b|NVLink"
        r"|CUDA error: unknown error|CUDA_ERROR_LAUNCH_FAILED|cudaErrorLaunchFailure"
        r"|CUDA error: the launch timed out|CUDA_ERROR_HARDWARE_STACK_ERROR"
        r"|CUDA error: an illegal instruction", re.IGNORECASE)),
    ("nccl", re.compile(
        r"ncclSystemError|NCCL error.*(?:unhandled system error|remote process exited"
        r" or there was a network error)|NET/IB|ibv_\w+|IBV_WC_|transport retry counter"
        r"|local catastrophic error|Connection reset by peer.*NCCL", re.IGNORECASE | re.DOTALL)),
)


@attrs.frozen
class Failure:
    """What the agent knows of one worker's failure or stall.

    ``exit_code``: the worker's exit code (negative: the signal that ended it, as
    torchelastic reports it; None for a stall). ``message``: the error file's message and
    traceback, or the stall's stack. ``by_agent``: the agent itself sent the signal (a
    stop). ``oom_kills``: how many times the OOM killer killed in the agent's memory cgroup
    during the attempt. ``stalled``/``waiting_on``/``culprit``: a stall verdict, what the
    rank waited on (``data["waiting_on"]``) and whether it is the culprit.
    ``slow_streak``: its successive ``WORKER_SLOW`` reports. ``marked``: a reactor's mark.
    ``first``: the first failure of its node in the attempt (messages count there only).
    """

    exit_code: int | None = None
    message: str = ""
    by_agent: bool = False
    oom_kills: int = 0
    stalled: bool = False
    waiting_on: str | None = None
    culprit: bool = False
    slow_streak: int = 0
    marked: str | None = None
    first: bool = True


def _signal_of(exit_code: int | None) -> int | None:
    if exit_code is None:
        return None
    if exit_code < 0:
        return -exit_code
    if 128 < exit_code < 128 + 65:  # a shell's report of a signal
        return exit_code - 128
    return None


def host_fault(failure: Failure) -> str | None:
    """The kind of host fault ``failure`` is (one of :data:`KINDS`), or None: the table of
    the module docstring, in its order of precedence (a reactor's mark first)."""
    if failure.marked:
        return failure.marked if failure.marked in KINDS else "reactor"
    if failure.stalled:
        if failure.culprit and failure.waiting_on in _CULPRIT_WAITS:
            return "hang"
        return None
    if failure.slow_streak >= STRAGGLER_STREAK:
        return "straggler"
    signum = _signal_of(failure.exit_code)
    if signum is not None and not failure.by_agent:
        if signum in _HARDWARE_SIGNALS:
            return "signal"
        if signum == signals.SIGKILL and failure.oom_kills > 0:
            return "oom"
    if not failure.first or not failure.message or failure.by_agent:
        return None
    for kind, pattern in _MESSAGES:
        if pattern.search(failure.message) and not (
                kind != "ecc" and _NOT_HARDWARE.search(failure.message)
                and not _hardware_wins(failure.message)):
            return kind
    return None


def _hardware_wins(message: str) -> bool:
    """A message that names both a hardware cause and an ordinary one (an Xid logged next
    to a collective timeout) is the hardware's."""
    return bool(re.search(r"\bXid\b|fallen off the bus|GPU is lost|ncclSystemError",
                          message, re.IGNORECASE))


# -- a reactor's mark ------------------------------------------------------------------------

_marks: dict[int, str] = {}
_marks_lock = threading.Lock()


def mark_host_fault(event: Any, kind: str = "reactor") -> None:
    """Called by a reactor with the ``WORKER_EXIT`` or ``WORKER_STALLED`` it was given: the
    failure counts against the worker's host (``data["host_fault"]`` is ``kind``, one of
    :data:`KINDS`; ``reactor`` by default). The reactor still returns its decision."""
    if kind not in KINDS:
        raise ValueError(f"mark_host_fault: kind must be one of {', '.join(KINDS)}; got "
                         f"{kind!r}")
    with _marks_lock:
        _marks[id(event)] = kind


def take_mark(event: Any) -> str | None:
    """The mark a reactor put on ``event`` (the agent's call, once the reactors ran)."""
    with _marks_lock:
        return _marks.pop(id(event), None)


def kinds_said(faults: Mapping[str, int]) -> str:
    """The eviction's reason for people: ``{"signal": 2, "nccl": 1}`` -> ``"2 signal,
    nccl"``."""
    return ", ".join(f"{n} {kind}" if n > 1 else kind for kind, n in faults.items() if n)
