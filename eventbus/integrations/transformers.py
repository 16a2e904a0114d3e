"""Hugging Face ``transformers.Trainer``: drain on preemption, record metrics and checkpoints.

::

    from eventbus.integrations.transformers import EventbusCallback

    trainer = transformers.Trainer(..., callbacks=[EventbusCallback()])
    trainer.train(resume_from_checkpoint=True)   # the newest checkpoint-N under output_dir

:class:`EventbusCallback` does three things, on every rank:

* **Drains.** In ``on_step_end`` (once per optimizer step) it calls
  :func:`eventbus.preemption.should_stop` with ``state.global_step``. When that says stop (a
  drain under ``eventbus run``: the same step on every rank) it sets
  ``control.should_save`` and ``control.should_training_stop``: the Trainer writes its own
  ``<output_dir>/checkpoint-<global_step>`` (model, optimizer, scheduler, RNG and trainer
  state, whatever ``save_strategy`` says) and stops; ``trainer.train(resume_from_checkpoint=
  that folder)`` resumes at that step.
* **Records metrics.** Each ``on_log``: the logs' numeric scalars (tensors as floats) as a
  ``METRIC`` event with ``step=state.global_step``.
* **Records checkpoints.** Each ``on_save`` (the periodic saves, the drain's) as
  ``CHECKPOINT_SAVED`` with ``path=<output_dir>/checkpoint-<global_step>``, ``step``,
  ``epoch`` (the 0-based epoch the save fell in) and ``duration_s``: the seconds from the
  decision to save (``on_step_end`` or ``on_epoch_end`` with ``control.should_save`` set,
  or the end of the evaluation that preceded it) to ``on_save``; recorded by the world's
  process zero. The drain's carries ``data={"preempted": True}``.

A failure of eventbus inside a hook is logged once on the ``eventbus`` logger and never
reaches the trainer.

Importing this module needs ``transformers`` (and the Trainer needs ``accelerate``):
``pip install 'eventbus[transformers]'``.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING
from typing import Any

import eventbus
from eventbus import preemption
from eventbus.integrations._common import HookFailures
from eventbus.integrations._common import scalars

__all__ = ["EventbusCallback"]

_INSTALL = ("eventbus.integrations.transformers needs transformers: "
            "pip install 'eventbus[transformers]'")


def _import_transformers() -> Any:
    """The ``transformers.trainer_callback`` module; an ImportError naming the extra where
    transformers is not installed (a broken installation raises its own error)."""
    try:
        import transformers.trainer_callback  # type: ignore[import-not-found, unused-ignore]

        return transformers.trainer_callback
    except ModuleNotFoundError as exc:
        if exc.name not in ("transformers", "transformers.trainer_callback"):
            raise
        raise ImportError(_INSTALL, name=exc.name) from exc


if TYPE_CHECKING:
    from transformers.trainer_callback import TrainerCallback  # type: ignore[import-not-found, unused-ignore]
    from transformers.trainer_callback import TrainerControl  # type: ignore[import-not-found, unused-ignore]
    from transformers.trainer_callback import TrainerState  # type: ignore[import-not-found, unused-ignore]
    from transformers.training_args import TrainingArguments  # type: ignore[import-not-found, unused-ignore]
else:
    _found = _import_transformers()
    TrainerCallback = _found.TrainerCallback
    TrainerControl = _found.TrainerControl
    TrainerState = _found.TrainerState
    TrainingArguments = _found.TrainingArguments
    del _found

logger = logging.getLogger("eventbus")

#: the Trainer's name for a checkpoint folder (transformers.trainer_utils.PREFIX_CHECKPOINT_DIR)
CHECKPOINT_FOLDER = "checkpoint-{step}"


class EventbusCallback(TrainerCallback):  # type: ignore[misc, unused-ignore]
    """Drains the Trainer on preemption and records its metrics and checkpoints (see the
    module's documentation)."""

    def __init__(self) -> None:
        super().__init__()
        #: the path of the drain's checkpoint, once saved
        self.drain_checkpoint: str | None = None
        #: ``time.perf_counter()`` when the Trainer decided to save, until ``on_save``
        self._save_started: float | None = None
        self._drain_step: int | None = None
        self._failed = HookFailures("transformers")

    def on_step_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> TrainerControl:
        try:
            stop = preemption.should_stop(step=state.global_step)
        except Exception:
            self._failed("on_step_end")
            stop = False
        if stop:
            control.should_save = True
            control.should_training_stop = True
            self._drain_step = state.global_step
        # the DefaultFlowCallback ran first: should_save says whether a save follows
        self._save_started = time.perf_counter() if control.should_save else None
        return control

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState,
                     control: TrainerControl, **kwargs: Any) -> TrainerControl:
        if control.should_save:
            self._save_started = time.perf_counter()
        return control

    def on_evaluate(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> TrainerControl:
        # a save that follows an evaluation (save_strategy "best" decides only now)
        self._save_started = time.perf_counter()
        return control

    def on_save(self, args: TrainingArguments, state: TrainerState,
                control: TrainerControl, **kwargs: Any) -> TrainerControl:
        started, self._save_started = self._save_started, None
        try:
            step = int(state.global_step)
            path = os.path.join(os.fspath(args.output_dir or "trainer_output"),
                                CHECKPOINT_FOLDER.format(step=step))
            preempted = self._drain_step == step
            if preempted:
                self.drain_checkpoint = path
            if state.is_world_process_zero:
                epoch = state.epoch
                eventbus.record(
                    eventbus.EventType.CHECKPOINT_SAVED,
                    path=path,
                    step=step,
                    epoch=None if epoch is None else max(0, math.ceil(epoch) - 1),
                    duration_s=(None if started is None
                                else max(0.0, time.perf_counter() - started)),
                    data={"preempted": True} if preempted else {},
                )
        except Exception:
            self._failed("on_save")
        return control

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: Mapping[str, object] | None = None, **kwargs: Any) -> TrainerControl:
        try:
            metrics = scalars(logs or {})
            if metrics:
                eventbus.record(eventbus.EventType.METRIC, step=int(state.global_step),
                                data=metrics)
        except Exception:
            self._failed("on_log")
        return control

