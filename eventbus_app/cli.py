"""The ``eventbus`` command: ``run`` (torchrun with the bus attached), ``trace``, ``plot``,
``tail``, ``view``, ``goodput``, ``hosts``. Each subcommand's module is imported only when it
runs, so ``eventbus --help`` stays fast and torch-free."""

from __future__ import annotations

import sys
from collections.abc import Callable
from collections.abc import Sequence

__all__ = ["COMMANDS", "main"]


def _run(argv: list[str]) -> int:
    from eventbus.app.launcher.command import main as run_main

    return run_main(argv)


def _trace(argv: list[str]) -> int:
    from eventbus.app.readers.trace import main as trace_main

    return trace_main(argv)


def _plot(argv: list[str]) -> int:
    from eventbus.app.readers.timeline import main as plot_main

    return plot_main(argv)


def _tail(argv: list[str]) -> int:
    from eventbus.app.readers.tail import main as tail_main

    return tail_main(argv)


def _goodput(argv: list[str]) -> int:
    from eventbus.app.readers.goodput import main as goodput_main

    return goodput_main(argv)


def _hosts(argv: list[str]) -> int:
    from eventbus.app.launcher.hosts.report import main as hosts_main

    return hosts_main(argv)


def _view(argv: list[str]) -> int:
    from eventbus.app.ui.view import main as view_main

    return view_main(argv)


#: subcommand -> (function taking argv and returning an exit code, one-line help)
COMMANDS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "run": (_run, "torchrun with the bus attached"),
    "trace": (_trace, "events JSONL -> Chrome trace JSON (Perfetto)"),
    "plot": (_plot, "events JSONL -> timeline PNG"),
    "tail": (_tail, "follow an events JSONL file, one line per event"),
    "view": (_view, "the job view in a browser for an events JSONL file, followed live"),
    "goodput": (_goodput, "events JSONL -> where the job's time went (goodput, badput)"),
    "hosts": (_hosts, "the host ledger: bad hosts by score, for people and schedulers"),
}


def _usage() -> str:
    lines = ["usage: eventbus COMMAND [ARGS...]", "", "commands:"]
    for name, (_, help_text) in COMMANDS.items():
        lines.append(f"  {name:<8}{help_text}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m eventbus`` and the ``eventbus`` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        print(f"eventbus: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    function, _ = COMMANDS[command]
    return int(function(rest) or 0)
