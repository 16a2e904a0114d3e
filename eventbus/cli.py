"""The ``eventbus`` command: ``run`` (torchrun with the bus attached), ``trace``, ``plot``,
``tail``. Each subcommand's module is imported only when it runs, so ``eventbus --help``
stays fast and torch-free."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

__all__ = ["main"]

#: subcommand -> (module, function, one-line help). The function takes argv (list[str]) and
#: returns an exit code.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "run": ("eventbus.launcher", "main", "torchrun with the bus attached"),
    "trace": ("subscribers.trace", "main", "events JSONL -> Chrome trace JSON (Perfetto)"),
    "plot": ("subscribers.timeline", "main", "events JSONL -> timeline PNG"),
    "tail": ("subscribers.tail", "main", "follow an events JSONL file, one line per event"),
}


def _usage() -> str:
    lines = ["usage: eventbus COMMAND [ARGS...]", "", "commands:"]
    for name, (_, _, help_text) in COMMANDS.items():
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
    module_name, function_name, _ = COMMANDS[command]
    module = importlib.import_module(module_name)
    code = getattr(module, function_name)(rest)
    return int(code or 0)
