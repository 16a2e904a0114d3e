"""``eventbus run`` called the way ``torch.distributed.run.main`` is called from Python.

``torch.distributed.run.main(args)`` returns None when the job succeeded and raises
``ChildFailedError`` when it failed; :func:`eventbus.app.launcher.command.main` returns an
exit code. :func:`main` is the first kind: a drop-in for code (and tests) that call
torchrun's ``main``, e.g. with ``torch.distributed.run.main = torch_main.main``.

eventbus's own outcomes have no torchrun counterpart: a job stopped by a reactor, ended by
hangs, drained or whose host was evicted raises ``SystemExit`` with its exit code
(docs/run.md, "Exit codes").

Torch-free to import; the call imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["main"]


def main(args: Sequence[str] | None = None) -> None:
    """Run the job as ``eventbus run ARGS``: None when it succeeded; ``ChildFailedError``
    when it failed (torch's error file and failure table as torchrun's); ``SystemExit``
    with the code of eventbus's other outcomes; a usage error is ``SystemExit(2)`` as in
    torchrun."""
    from eventbus.app.launcher.command import main as run_main

    code = run_main(args, raise_child_failure=True)
    if code != 0:
        raise SystemExit(code)
