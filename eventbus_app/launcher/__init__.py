"""``eventbus run``: torchrun with the bus attached, and the agent's plugins.

This module is torch-free; :mod:`eventbus.app.launcher.agent` (the agent) imports torch,
:mod:`eventbus.app.launcher.command` is the ``run`` command line.

Agent plugins (:class:`~eventbus.app.plugins.AgentPlugin`) are in
:mod:`eventbus.app.plugins`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from eventbus.app.plugins import AgentPlugin

__all__ = ["main"]


def main(argv: Sequence[str] | None = None, *,
         plugins: Sequence[AgentPlugin] | None = None) -> int:
    """``eventbus run [--events-jsonl PATH] [--reactor MODULE:ATTR]... [--log-events]
    <torchrun options> SCRIPT [ARGS]``; returns the exit code. ``plugins``: see
    :func:`eventbus.app.launcher.command.main`."""
    # The command line (and torch) load only when the command runs.
    from eventbus.app.launcher.command import main as run_main

    return run_main(argv, plugins=plugins)
