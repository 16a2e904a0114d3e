"""``tensorboard:DIR``: one TensorBoard run per rank, ``DIR/rank<r>/``.

Each number in a ``METRIC``'s ``data`` is a scalar whose tag is its key, at the event's
``step`` (a per-rank counter when it has none), with the event's wall time. The attempt a
rank's metrics belong to is the scalar ``eventbus/attempt``, so a restart is a step in that
curve; failures, stalls, restarts and the job's end are text under the tag ``eventbus``,
each its sentence (:func:`eventbus.app.sinks.base.sink_text`; a restart and the end in
every rank's run). Events with no rank go to ``DIR/agent/``.
Written with ``torch.utils.tensorboard.SummaryWriter`` (the ``tensorboard`` extra).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from eventbus.app.sinks.base import EventSink
from eventbus.app.sinks.base import SinkArgumentError
from eventbus.app.sinks.base import attempt_of
from eventbus.app.sinks.base import is_stall
from eventbus.app.sinks.base import numbers_of
from eventbus.app.sinks.base import rank_of
from eventbus.app.sinks.base import require_extra
from eventbus.app.sinks.base import sink_text
from eventbus.events import Event
from eventbus.subscribers.queued import QueueSettings

__all__ = ["TensorBoardSink"]

#: the tag of the text entries (failures, stalls, restarts, the end)
TEXT_TAG = "eventbus"
#: the scalar that records which attempt each rank's metrics belong to
ATTEMPT_TAG = "eventbus/attempt"


class TensorBoardSink(EventSink):
    """``TensorBoardSink(DIR)``: see the module docstring."""

    kind = "tensorboard"

    def __init__(self, logdir: str | os.PathLike[str], *,
                 settings: QueueSettings | None = None, flush_secs: float = 5.0) -> None:
        logdir = os.fspath(logdir)
        if not logdir:
            raise SinkArgumentError("tensorboard: DIR is empty; e.g. --sink tensorboard:runs/tb")
        require_extra("tensorboard", "tensorboard", "tensorboard", "torch.utils.tensorboard")
        self.logdir = logdir
        self.flush_secs = flush_secs
        self._writers: dict[str, Any] = {}
        self._steps: dict[str, int] = {}     # run -> last step written
        self._attempts: dict[str, int] = {}  # run -> attempt of the last metric
        super().__init__(label=logdir, settings=settings)

    def _writer(self, run: str) -> Any:
        writer = self._writers.get(run)
        if writer is None:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(log_dir=os.path.join(self.logdir, run),
                                   flush_secs=int(max(1, self.flush_secs)))
            self._writers[run] = writer
        return writer

    def write(self, events: Sequence[Event]) -> None:
        for event in events:
            kind = str(event.type)
            if kind == "METRIC":
                self._metric(event)
            elif (kind == "WORKER_EXIT" and event.is_failure) or is_stall(event):
                run = self._run_of(rank_of(event))
                self._text(run, sink_text(event), event)
            elif kind == "WORKER_RESTART" or (kind == "AGENT_EXIT" and event.is_failure):
                for run in list(self._writers) or [self._run_of(None)]:
                    self._text(run, sink_text(event), event)
        for writer in self._writers.values():
            writer.flush()

    @staticmethod
    def _run_of(rank: int | None) -> str:
        return "agent" if rank is None else f"rank{rank}"

    def _metric(self, event: Event) -> None:
        numbers = numbers_of(event.data)
        if not numbers:
            return
        run = self._run_of(event.rank)
        step = getattr(event, "step", None)
        if not isinstance(step, int):
            step = self._steps.get(run, -1) + 1
        self._steps[run] = step
        writer = self._writer(run)
        attempt = attempt_of(event)
        if self._attempts.get(run) != attempt:
            self._attempts[run] = attempt
            writer.add_scalar(ATTEMPT_TAG, attempt, step, walltime=event.timestamp)
        for key, value in numbers.items():
            writer.add_scalar(key, value, step, walltime=event.timestamp)

    def _text(self, run: str, text: str, event: Event) -> None:
        self._writer(run).add_text(TEXT_TAG, text, self._steps.get(run, 0),
                                   walltime=event.timestamp)

    def shutdown(self) -> None:
        for writer in self._writers.values():
            writer.close()
