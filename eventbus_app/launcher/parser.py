"""The command line of ``eventbus run``: torchrun's parser with eventbus's own options
first, a usage error a person reads at once, and abbreviations written out before SCRIPT
only (:mod:`.cli.abbrev`). What the options do is :mod:`.command`'s (the job's assembly)
and the agent's.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Sequence
from typing import NoReturn

from eventbus.app.launcher.cli import abbrev
from eventbus.app.launcher.cli import options
from eventbus.app.launcher.decisions import exit_codes
from eventbus.app.launcher.hosts.book import DEFAULT_EVICT_AFTER

__all__ = ["USAGE", "build_parser"]


#: the usage line of ``eventbus run`` (its --help and every usage error start with it)
USAGE = "%(prog)s [options] SCRIPT ..."


class _RunParser(argparse.ArgumentParser):
    """torchrun's parser, with a usage error a person reads at once: the usage line, the
    error, a pointer to ``--help`` (torchrun's own prints its 25-line usage first).
    Abbreviated options are written out before SCRIPT only (:mod:`.abbrev`)."""

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None,
                         ) -> tuple[argparse.Namespace, list[str]]:
        words = abbrev.expand(self, sys.argv[1:] if args is None else args)
        return super().parse_known_args(words, namespace)

    def error(self, message: str) -> NoReturn:
        if "required: SCRIPT" in message:
            message = ("no SCRIPT to run: name the training script after the options, e.g. "
                       "eventbus run --standalone --nproc-per-node 2 train.py")
        elif message.startswith("unrecognized arguments:"):
            message += _option_hint(self, message.partition(":")[2].split())
        self.exit(2, f"{self.format_usage()}{self.prog}: error: {message}\n"
                     f"Run '{self.prog} --help' for the options (eventbus's own first, then "
                     "torchrun's).\n")


def _option_hint(parser: argparse.ArgumentParser, words: Sequence[str]) -> str:
    """`` (did you mean --stall-timeout?)`` for a misspelt option, else ``""``."""
    known = [o for action in parser._actions for o in action.option_strings]
    for word in words:
        if word.startswith("-"):
            close = difflib.get_close_matches(word.partition("=")[0], known, n=1)
            if close:
                return f" (did you mean {close[0]}?)"
    return ""


def _eventbus_first(parser: argparse.ArgumentParser,
                    group: argparse._ArgumentGroup) -> argparse.ArgumentParser:
    """``--help`` in reading order: ``-h`` and eventbus's own options first, then SCRIPT
    and ARGS, then torchrun's options under their own heading."""
    torchrun = parser._optionals
    torchrun.title = "torchrun options (unchanged)"
    parser._positionals.title = "the script"
    for action in list(torchrun._group_actions):
        if action.dest == "help":
            torchrun._group_actions.remove(action)
            group._group_actions.insert(0, action)
    for action in parser._positionals._group_actions:
        if action.dest == "training_script":
            action.metavar = "SCRIPT"
        elif action.dest == "training_script_args":
            action.metavar = "ARGS"
            action.help = action.help or "the script's own arguments, passed to it unchanged"
    parser._action_groups = [group, parser._positionals, torchrun,
                             *(g for g in parser._action_groups
                               if g not in (group, parser._positionals, torchrun))]
    return parser


def _parse_alert_after(text: str) -> float | None:
    """``--alert-after``: :func:`eventbus.app.sinks.stuck.parse_alert_after`."""
    from eventbus.app.sinks.stuck import parse_alert_after

    return parse_alert_after(text)


def build_parser() -> argparse.ArgumentParser:
    """torchrun's parser with the eventbus options added (first in ``--help``)."""
    from torch.distributed.run import get_args_parser

    torchrun_parser = get_args_parser()
    parser = _RunParser(
        # argparse's abbreviations off: it would look the script's own options after
        # SCRIPT up too, and refuse one that is a prefix of two of ours (--bad-host) as
        # ambiguous; _RunParser writes abbreviations out before SCRIPT instead (abbrev.py)
        prog="eventbus run", usage=USAGE, parents=[torchrun_parser], add_help=False,
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=exit_codes.table_text() + "\n(docs/run.md, 'Exit codes')",
        description="torchrun with the event bus attached: every torchrun option works "
                    "unchanged; eventbus's own options come first, torchrun's follow.")
    group = parser.add_argument_group("eventbus options")
    group.add_argument(
        "--events-jsonl", metavar="PATH", default=None,
        help="append every event that reaches the agent's bus to PATH, one JSON line each")
    group.add_argument(
        "--reactor", metavar="MODULE:ATTR", action="append", default=[],
        help="a callable (event) -> Decision | None consulted on each failed worker's "
             "WORKER_EXIT and each WORKER_STALLED (a class is instantiated without "
             "arguments); repeatable")
    group.add_argument(
        "--log-events", action="store_true",
        help="log every event on the agent's console (eventbus.get_logging_handler())")
    group.add_argument(
        "--sink", metavar="NAME:ARG", action="append", default=[],
        help="send the events to a sink: tensorboard:DIR, otlp:URL, prometheus:PORT, "
             "webhook:URL, mlflow:TRACKING_URI, wandb:PROJECT, or an 'eventbus.sinks' entry "
             "point; repeatable (docs/sinks.md)")
    group.add_argument(
        "--alert-after", metavar="SECONDS|off", type=_parse_alert_after, default=None,
        help="when no rank made a step for SECONDS and no verdict explains it (detection "
             "off, a hang the judge cannot call), publish JOB_STUCK with the ranks' last "
             "places, which every alerting sink (webhook, wandb) sends, and JOB_UNSTUCK when "
             "progress resumes (default: off; docs/sinks.md, 'A stuck job')")
    group.add_argument(
        "--stall-timeout", metavar="SECONDS|auto|off", type=options.parse_stall_timeout,
        default="auto",
        help="a live worker that makes no progress (collectives, optimizer steps, recorded "
             "events) for SECONDS and whose heartbeats show it waiting (in a collective, "
             "blocked, spinning) is stalled: WORKER_STALLED for the culprit rank with a "
             "diagnosis and its stack, reactors decide, the group restarts; a busy rank, a "
             "checkpoint save or load and a compile are never stalls, a rank waiting for "
             "data is reported, not restarted; "
             f"auto: max({options.AUTO_FLOOR_S:g} s, {options.AUTO_FACTOR:g} x the longest "
             "interval seen between the worker's events); off: no stall detection. "
             "Default: auto (docs/run.md, 'Job health')")
    group.add_argument(
        "--stall-auto-floor", metavar="SECONDS", type=options.parse_stall_auto_floor,
        default=options.AUTO_FLOOR_S,
        help=f"--stall-timeout auto never goes below SECONDS (default "
             f"{options.AUTO_FLOOR_S:g}); lower it for jobs whose every quiet period is short")
    group.add_argument(
        "--warm-spares", metavar="on|off|cuda", type=options.parse_warm_spares, default=None,
        help="keep one spare worker process per local rank, interpreter started and torch "
             "imported, that becomes the worker of the next attempt on a restart; cuda: "
             "each spare also makes its CUDA context on its local device while it waits "
             f"(default: ${options.ENV_WARM_SPARES}, else on; docs/run.md, 'Warm spares')")
    group.add_argument(
        "--slow-factor", metavar="FACTOR|off", type=options.parse_slow_factor,
        default=options.DEFAULT_SLOW_FACTOR,
        help="WORKER_SLOW when a rank's recent step time (METRIC step), or its compute time "
             "between collectives, is FACTOR x its "
             f"peers' median (default {options.DEFAULT_SLOW_FACTOR:g}; off disables)")
    group.add_argument(
        "--progress", metavar="SOURCES", type=options.parse_progress,
        default=options.PROGRESS_SOURCES,
        help="what counts as a worker's progress, sampled with no change to the script: "
             "off, or a comma list of collectives (torch's flight recorder), steps (the "
             "optimizer's step hook), events (what the script records); default: all three")
    group.add_argument(
        "--stop-exit-code", metavar="N", type=options.parse_stop_exit_code,
        default=options.DEFAULT_STOP_EXIT_CODE,
        help="exit code when a reactor's STOP ended the job (default "
             f"{options.DEFAULT_STOP_EXIT_CODE}: not torchrun's 1, so that a scheduler can "
             "tell 'do not retry' from an ordinary failure)")
    group.add_argument(
        "--drain-signals", metavar="SIGNALS", type=options.parse_drain_signals,
        default=options.DEFAULT_DRAIN_SIGNALS,
        help="signals that drain the whole job instead of killing it (PREEMPTING to every "
             "rank; eventbus.preemption.should_stop() true at one step everywhere): a comma "
             f"list or off (default {','.join(options.DEFAULT_DRAIN_SIGNALS)})")
    group.add_argument(
        "--drain-grace", metavar="SECONDS", type=options.parse_drain_grace,
        default=options.DEFAULT_DRAIN_GRACE_S,
        help="seconds the workers get to save and stop after a drain signal; then they get "
             f"the signal, and SIGKILL {options.STALL_STOP_GRACE_S:g} s later (default "
             f"{options.DEFAULT_DRAIN_GRACE_S:g})")
    group.add_argument(
        "--drain-exit-code", metavar="N", type=options.parse_drain_exit_code,
        default=options.DEFAULT_DRAIN_EXIT_CODE,
        help=f"exit code of a drained job (default {options.DEFAULT_DRAIN_EXIT_CODE}, "
             "EX_TEMPFAIL: retry later; not 0, 1 nor --stop-exit-code)")
    group.add_argument(
        "--drain-signal-window", metavar="SECONDS", type=options.parse_signal_window,
        default=options.DEFAULT_SIGNAL_WINDOW_S,
        help="copies of a drain signal within this many seconds of the drain's start are "
             "one drain (a scheduler signals every node and every worker at once); a later "
             "one is a second signal and cuts the grace short (default "
             f"{options.DEFAULT_SIGNAL_WINDOW_S:g})")
    group.add_argument(
        "--requeue", metavar="auto|off", type=options.parse_requeue, default="auto",
        help="under SLURM, a drained job requeues itself with scontrol requeue where the "
             "job allows it (Requeue=1), and a bad-host exit requeues it without the node; "
             "off: never (default auto; docs/preemption.md, 'Under SLURM')")
    group.add_argument(
        "--evict-after", metavar="N", type=options.parse_evict_after,
        default=DEFAULT_EVICT_AFTER,
        help="a node whose ranks had N host faults in this job (SIGSEGV, SIGBUS, SIGILL, an "
             "OOM kill, CUDA/NCCL/ECC hardware errors, a hang's culprit, a persistent "
             "straggler; never a Python exception) leaves it: HOST_EVICTED, and this agent "
             "exits with --bad-host-exit-code while the others go on (--nnodes MIN:MAX); "
             f"0 or off: never (default {DEFAULT_EVICT_AFTER}; docs/run.md, 'Bad hosts')")
    group.add_argument(
        "--host-ledger", metavar="PATH|URL|off", default=None,
        help="where this agent records its host's outcome per attempt, across jobs: a SQLite "
             "file or postgresql://...; off: nowhere (default: $EVENTBUS_HOST_LEDGER, else "
             "~/.local/state/eventbus/hosts.sqlite; docs/hosts.md). Never fails or delays "
             "the job")
    group.add_argument(
        "--exclude-bad-hosts", action="store_true",
        help="refuse to start, before the rendezvous, with --bad-host-exit-code when this "
             "host's score in the ledger is over --bad-host-threshold (`eventbus hosts`)")
    group.add_argument(
        "--bad-host-threshold", metavar="X", type=options.parse_bad_host_threshold,
        default=None,
        help="the score over which --exclude-bad-hosts refuses a host (default: that of "
             "`eventbus hosts`, docs/hosts.md)")
    group.add_argument(
        "--bad-host-exit-code", metavar="N", type=options.parse_exit_code,
        default=exit_codes.DEFAULT_BAD_HOST_EXIT_CODE,
        help="exit code of an agent whose host was evicted or refused (default "
             f"{exit_codes.DEFAULT_BAD_HOST_EXIT_CODE}: requeue on other hosts)")
    group.add_argument(
        "--hang-exit-code", metavar="N", type=options.parse_exit_code,
        default=exit_codes.DEFAULT_HANG_EXIT_CODE,
        help="exit code when the restarts were spent on hangs: the last attempt ended by a "
             f"stall verdict (default {exit_codes.DEFAULT_HANG_EXIT_CODE})")
    group.add_argument(
        "--ui", metavar="[HOST:]PORT", default=None,
        help="serve a live job page from the agent of group rank 0 at http://HOST:PORT/ "
             "(host 127.0.0.1 unless given; port 0: a free one; the address is printed); "
             "another host requires a token (docs/seeing-the-job.md)")
    group.add_argument(
        "--ui-token", metavar="TOKEN", default=None,
        help="the token the job page requires (default: $EVENTBUS_UI_TOKEN, else none on "
             "127.0.0.1 and a generated one, printed, on any other host)")
    return _eventbus_first(parser, group)
