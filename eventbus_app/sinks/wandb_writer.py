"""The W&B sink's writer process: ``python -m eventbus.app.sinks.wandb_writer``.

Why a process of its own: W&B's client starts a service process, installs exit hooks and
waits for its uploads at interpreter exit, and puts a service token in the environment
that the agent's next workers would inherit. In the agent, any of that could hold up the
job's end or reach into its workers; here it holds up only this process, which the agent
(:class:`eventbus.app.sinks.wandb.WandbSink`) feeds through a pipe and stops when its
close budget runs out.

It reads one JSON object a line on stdin, each an operation the sink made (the content is
decided there; this process only calls W&B):

* ``init`` (``project``, ``id``, ``config``, ``init_timeout``): ``wandb.init(id=...,
  resume="allow")``, console capture off, W&B's own output silent, W&B's wait for its
  server ``init_timeout`` unless ``$WANDB_INIT_TIMEOUT`` says; ``eventbus/step`` is the x
  axis of every metric. A failed init is tried again at the next operation once
  :data:`INIT_RETRY_S` passed; operations meanwhile are lost, and reported so;
* ``log`` (``row``), ``rows`` (``rows``: the events table's new rows), ``table`` (log the
  table), ``summary`` (``values``), ``alert`` (``title``, ``text``, ``level``),
  ``preempting`` (``run.mark_preempting()``);
* ``end`` (``exit_code``): ``run.finish``, then exit. End of input without it (the agent
  died): the run finishes with exit code 1.

It answers one JSON object a line on stdout: ``{"status": ...}``, ``{"started": {"id",
"url", "dir", "resumed", "offline"}}``, ``{"delivered": n}`` and ``{"lost": n, "reason":
...}`` (``n``: the events an operation carried), ``{"finished": true}``. SIGINT and
SIGTERM are ignored (a drain's signal to the process group must not cut the run short):
it ends at ``end``, at the end of its input, or when the agent kills it.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import time
from typing import Any

from eventbus.app.sinks.base import failure_reason

__all__ = ["INIT_RETRY_S", "main"]

#: a failed ``wandb.init`` is tried again after this many seconds, at the next operation
INIT_RETRY_S = 60.0

#: the events table's columns (the sink's ``TABLE_COLUMNS``)
_COLUMNS = ["time", "rank", "host", "type", "sentence"]


def _report(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


class _Writer:
    """The run and what it needs, between operations."""

    def __init__(self) -> None:
        self.wandb: Any = None
        self.run: Any = None
        self.init_op: dict[str, Any] | None = None
        self.tried_at: float | None = None
        self.failed = "no init operation"
        self.rows: list[list[Any]] = []

    def ready(self) -> bool:
        """The run is open, or was just opened; False while it cannot be."""
        if self.run is not None:
            return True
        if self.init_op is None:
            return False
        if self.tried_at is not None and time.monotonic() - self.tried_at < INIT_RETRY_S:
            return False
        self.tried_at = time.monotonic()
        op = self.init_op
        _report({"status": "connecting to W&B"})
        try:
            if self.wandb is None:
                self.wandb = importlib.import_module("wandb")
            wandb = self.wandb
            options: dict[str, Any] = {"console": "off", "silent": True}
            if not os.environ.get("WANDB_INIT_TIMEOUT"):  # W&B's own variable wins
                options["init_timeout"] = float(op.get("init_timeout") or 90.0)
            settings = wandb.Settings(**options)
            run = wandb.init(project=op["project"], id=op["id"], resume="allow",
                             settings=settings)
            run.config.update(op.get("config") or {}, allow_val_change=True)
            run.define_metric("eventbus/step")
            run.define_metric("*", step_metric="eventbus/step")
        except Exception as exc:
            self.failed = f"run not started: {failure_reason(exc)}"
            _report({"status": self.failed})
            return False
        self.run = run
        _report({"started": {"id": run.id, "url": _url(run), "dir": run.dir,
                             "resumed": bool(getattr(run, "resumed", False)),
                             "offline": bool(getattr(run, "offline", False))}})
        return True

    def apply(self, op: dict[str, Any]) -> None:
        kind = op.get("op")
        run = self.run
        if kind == "log":
            run.log(op["row"])
        elif kind == "rows":
            self.rows.extend(op.get("rows") or [])
        elif kind == "table":
            if self.rows:
                table = self.wandb.Table(columns=_COLUMNS, data=list(self.rows))
                run.log({"eventbus/events": table})
        elif kind == "summary":
            run.summary.update(op.get("values") or {})
        elif kind == "alert":
            level = self.wandb.AlertLevel(op.get("level") or "INFO")
            run.alert(title=str(op["title"]), text=str(op["text"]), level=level,
                      wait_duration=1)
        elif kind == "preempting":
            run.mark_preempting()

    def finish(self, exit_code: int | None) -> None:
        if self.run is None:
            return
        try:
            self.run.finish(exit_code=exit_code)
        except Exception as exc:
            _report({"status": f"finish failed: {failure_reason(exc)}"})
        else:
            _report({"finished": True})


def _url(run: Any) -> str | None:
    try:
        url = run.url
    except Exception:  # offline runs have none; some versions raise for it
        return None
    return str(url) if url else None


def main() -> int:
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, signal.SIG_IGN)
    writer = _Writer()
    for line in sys.stdin.buffer:
        try:
            op = json.loads(line)
        except ValueError:
            continue
        if not isinstance(op, dict):
            continue
        kind = op.get("op")
        n = int(op.get("n") or 0)
        if kind == "init":
            writer.init_op = op
            writer.ready()
            continue
        if kind == "end":
            code = op.get("exit_code")
            writer.finish(code if isinstance(code, int) else None)
            return 0
        if not writer.ready():
            if n:
                _report({"lost": n, "reason": writer.failed})
            continue
        try:
            writer.apply(op)
        except Exception as exc:
            if n:
                _report({"lost": n, "reason": failure_reason(exc)})
            continue
        if n:
            _report({"delivered": n})
    writer.finish(1)  # no end: the agent is gone
    return 0


if __name__ == "__main__":
    sys.exit(main())
