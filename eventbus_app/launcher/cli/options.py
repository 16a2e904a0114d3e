"""The options of ``eventbus run`` that are eventbus's own job-health settings: their
defaults and their parsers (each a usage error that says what is expected).

Torch-free; :mod:`eventbus.app.launcher.command` builds the parser with them, and the
agent takes the parsed values (docs/run.md, "Job health").
"""

from __future__ import annotations

import argparse
import math
import signal as signals
from typing import Literal

from eventbus.app.health.watches import AUTO_FACTOR
from eventbus.app.health.watches import AUTO_FLOOR_S
from eventbus.app.health.watches import DEFAULT_SLOW_FACTOR
from eventbus.app.protocol import agent_worker
from eventbus.app.protocol import drain_signals
from eventbus.app.protocol.agent_worker import PROGRESS_SOURCES

__all__ = [
    "DEFAULT_DRAIN_EXIT_CODE",
    "DEFAULT_DRAIN_GRACE_S",
    "DEFAULT_DRAIN_SIGNALS",
    "AUTO_FACTOR",
    "AUTO_FLOOR_S",
    "ENV_WARM_SPARES",
    "DEFAULT_PROGRESS",
    "DEFAULT_SIGNAL_WINDOW_S",
    "DEFAULT_SLOW_FACTOR",
    "DEFAULT_STOP_EXIT_CODE",
    "PROGRESS_SOURCES",
    "STALL_STOP_GRACE_S",
    "drain_signal_names",
    "parse_bad_host_threshold",
    "parse_drain_exit_code",
    "parse_evict_after",
    "parse_exit_code",
    "parse_drain_grace",
    "parse_drain_signals",
    "parse_progress",
    "parse_requeue",
    "parse_signal_window",
    "parse_on_off",
    "parse_warm_spares",
    "parse_slow_factor",
    "parse_stall_auto_floor",
    "parse_stall_timeout",
    "parse_stop_exit_code",
]

#: ``--stop-exit-code`` default: not 1 (torchrun's ordinary failure, which schedulers
#: retry), not 2 (a usage error), below 126 (the shell's) and 128 (killed by a signal);
#: Kubeflow's ``restartPolicy: ExitCode`` treats 1-127 as permanent: "do not retry"
DEFAULT_STOP_EXIT_CODE = 3
# ``--drain-signals``, ``--drain-grace``, ``--drain-exit-code``: the drain's options
#: what schedulers send before they take a node (Kubernetes and SLURM's end: SIGTERM;
#: SLURM's ``--signal=USR1@120``: SIGUSR1)
DEFAULT_DRAIN_SIGNALS = ("SIGTERM", "SIGUSR1")
#: seconds the workers get to stop by themselves (Kubernetes' default termination grace
#: is 30 s: 20 s of drain, the kill grace and the agents' exit fit in it)
DEFAULT_DRAIN_GRACE_S = 20.0
#: sysexits' EX_TEMPFAIL: not 0 (success), 1 (failure) nor the STOP code (3)
DEFAULT_DRAIN_EXIT_CODE = 75

#: ``--drain-signal-window`` (protocol/drain_signals.py)
DEFAULT_SIGNAL_WINDOW_S = drain_signals.DEFAULT_SIGNAL_WINDOW_S
#: a stalled group is stopped by SIGTERM, then SIGKILL after this many seconds (a worker
#: blocked in a C call, a collective say, never runs its Python SIGTERM handler)
STALL_STOP_GRACE_S = 5.0


#: ``--progress`` default: all of :data:`PROGRESS_SOURCES`
DEFAULT_PROGRESS = agent_worker.format_progress(PROGRESS_SOURCES)


def _number_or(text: str, keyword: str | None, *, above: float, what: str) -> float | None:
    """A finite number > ``above``, or None for ``keyword``; anything else is a usage error
    that says what is expected."""
    if keyword is not None and text.strip().lower() == keyword:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= above:
        expected = what if keyword is None else f"{what} or {keyword!r}"
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def parse_stall_timeout(text: str) -> float | Literal["auto"] | None:
    """``--stall-timeout``: seconds > 0 (finite), ``auto`` (the default) or ``off``
    (None: no stall detection)."""
    if text.strip().lower() == "off":
        return None
    value = _number_or(text, "auto", above=0, what="'off', seconds > 0")
    return "auto" if value is None else value


def parse_stall_auto_floor(text: str) -> float:
    """``--stall-auto-floor``: seconds > 0 (finite)."""
    value = _number_or(text, None, above=0, what="seconds > 0")
    assert value is not None  # no keyword: a number or a usage error
    return value


#: the default of ``--warm-spares`` where the command line does not say (on, off)
ENV_WARM_SPARES = "EVENTBUS_WARM_SPARES"


#: ``--warm-spares`` values: ``cuda`` is ``on``, and each spare makes its CUDA context on
#: its local device while it waits (docs/run.md, "Warm spares")
WARM_SPARES = ("on", "off", "cuda")


def parse_warm_spares(text: str) -> str:
    """``--warm-spares``: ``on``, ``off`` or ``cuda`` (any case); anything else is a usage
    error that names the three."""
    word = text.strip().lower()
    if word in WARM_SPARES:
        return word
    raise argparse.ArgumentTypeError(f"expected 'on', 'off' or 'cuda', got {text!r}")


def parse_on_off(text: str) -> bool:
    """``on`` or ``off`` (any case): True or False; anything else is a usage error."""
    word = text.strip().lower()
    if word in ("on", "off"):
        return word == "on"
    raise argparse.ArgumentTypeError(f"expected 'on' or 'off', got {text!r}")


def parse_slow_factor(text: str) -> float | None:
    """``--slow-factor``: a number > 1, or ``off`` (None)."""
    return _number_or(text, "off", above=1, what="a factor > 1")


def parse_progress(text: str) -> tuple[str, ...]:
    """``--progress``: the grammar of the workers' ``EVENTBUS_PROGRESS``
    (:func:`eventbus.app.protocol.agent_worker.parse_progress`: ``off``, ``all``, or a comma
    list of ``collectives``, ``steps``, ``events``; empty: all), its ``ValueError`` a usage
    error. Returns the sources in their canonical order."""
    try:
        return agent_worker.parse_progress(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} {exc}") from None


def parse_stop_exit_code(text: str) -> int:
    """``--stop-exit-code``: an int from 1 to 125 (0 would say "succeeded")."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an exit code 1-125, got {text!r}") from None
    if not 1 <= value <= 125:
        raise argparse.ArgumentTypeError(f"expected an exit code 1-125, got {text!r}")
    return value


def parse_drain_signals(text: str) -> tuple[str, ...]:
    """``--drain-signals``: a comma list of signal names, or ``off``."""
    try:
        return drain_signal_names(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _seconds(text: str, example: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds (e.g. {example}), got "
                                         f"{text!r}") from None


def parse_drain_grace(text: str) -> float:
    """``--drain-grace``: seconds, > 0 (finite)."""
    value = _seconds(text, "20 or 90.5")
    if not 0 < value < 86_400:
        raise argparse.ArgumentTypeError(f"expected seconds above 0 and below a day, got "
                                         f"{text!r}")
    return value


def parse_signal_window(text: str) -> float:
    """``--drain-signal-window``: seconds, 0 or more (0: every later copy escalates)."""
    value = _seconds(text, "3 or 0.5")
    if not 0 <= value <= 600:
        raise argparse.ArgumentTypeError(f"expected seconds from 0 to 600, got {text!r}")
    return value


def parse_requeue(text: str) -> str:
    """``--requeue``: auto or off."""
    from eventbus.app.launcher.slurm.control import parse_requeue as parse

    try:
        return parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_drain_exit_code(text: str) -> int:
    """``--drain-exit-code``: an int from 2 to 255 (0 says "succeeded", 1 "failed")."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an exit code 2-255, got {text!r}") from None
    if not 2 <= value <= 255:
        raise argparse.ArgumentTypeError(f"expected an exit code 2-255 (0 says succeeded, 1 "
                                         f"failed), got {text!r}")
    return value



def parse_exit_code(text: str) -> int:
    """``--bad-host-exit-code``, ``--hang-exit-code``: an int from 2 to 255 (0 says
    "succeeded", 1 "failed")."""
    return parse_drain_exit_code(text)


def parse_evict_after(text: str) -> int:
    """``--evict-after``: host faults on one node before it leaves the job, an int >= 1,
    or 0 / ``off`` (counted and recorded, never evicted)."""
    if text.strip().lower() == "off":
        return 0
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count of host faults (e.g. 2), or 0 or "
                                         f"'off' to never evict; got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a count >= 1, or 0 or 'off'; got {text!r}")
    return value


def parse_bad_host_threshold(text: str) -> float:
    """``--bad-host-threshold``: a host's score above which ``--exclude-bad-hosts``
    refuses it; a number > 0."""
    value = _number_or(text, None, above=0, what="a score > 0 (e.g. 1.0)")
    assert value is not None
    return value


def drain_signal_names(text: str) -> tuple[str, ...]:
    """``--drain-signals``: a comma list of signal names (``SIGTERM``, ``TERM``, ``usr1``)
    or ``off``. Raises ``ValueError`` naming a bad one."""
    text = text.strip()
    if text.lower() in ("off", "none", ""):
        return ()
    out: list[str] = []
    for token in text.split(","):
        name = token.strip().upper()
        if not name:
            continue
        if not name.startswith("SIG"):
            name = "SIG" + name
        if name in ("SIGKILL", "SIGSTOP"):
            raise ValueError(f"{token.strip()!r} cannot be caught; use SIGTERM, SIGUSR1, "
                             "SIGUSR2, SIGINT, SIGHUP or SIGQUIT")
        if not isinstance(getattr(signals, name, None), int) or name.startswith("SIG_"):
            raise ValueError(f"{token.strip()!r} is not a signal name (e.g. SIGTERM,SIGUSR1)")
        if name not in out:
            out.append(name)
    return tuple(out)
