"""Lightning: drain on preemption, record metrics and checkpoints.

::

    from eventbus.integrations.lightning import EventbusCallback

    trainer = lightning.pytorch.Trainer(callbacks=[EventbusCallback()], ...)
    trainer.fit(model, ckpt_path="last")   # or the drain checkpoint's path

:class:`EventbusCallback` does three things, on every rank:

* **Drains.** After each optimizer step (``on_train_batch_end`` where the global step moved)
  it calls :func:`eventbus.preemption.should_stop` with ``trainer.global_step``. When that
  says stop (a drain under ``eventbus run``: the same step on every rank), every rank calls
  ``trainer.save_checkpoint`` to ``<dir>/preempted-step=<global_step>.ckpt`` and sets
  ``trainer.should_stop``; ``trainer.fit(model, ckpt_path=that path)`` resumes at that step.
  ``<dir>`` is ``dirpath`` if given, else the folder of the trainer's ``ModelCheckpoint``,
  else ``<default_root_dir>/checkpoints``. (Lightning does not stop before ``min_steps`` /
  ``min_epochs``: leave them unset for a job that may be preempted.)
* **Records metrics.** At each logging step (``log_every_n_steps``) the trainer's
  ``logged_metrics``, numeric scalars only (tensors as floats), as a ``METRIC`` event with
  ``step=trainer.global_step``; at the end of a training epoch and of a validation run the
  logged metrics that changed since (epoch-level and validation metrics).
* **Records checkpoints.** Each ``trainer.save_checkpoint`` of this trainer (its
  ``ModelCheckpoint`` saves, the drain's, the user's own) as ``CHECKPOINT_SAVED`` with
  ``path``, ``step``, ``epoch`` and ``duration_s``, the seconds the call took, recorded once
  per save, on global rank 0; the drain's carries ``data={"preempted": True}``. The callback
  wraps ``save_checkpoint`` on the trainer instance from ``setup`` to ``teardown``.

A failure of eventbus inside a hook is logged once on the ``eventbus`` logger and never
reaches the trainer; the trainer's own errors (a failing save) are not caught.

Importing this module needs ``lightning`` (or ``pytorch_lightning``):
``pip install 'eventbus[lightning]'``.
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import TYPE_CHECKING
from typing import Any

import eventbus
from eventbus import preemption
from eventbus.integrations._common import HookFailures
from eventbus.integrations._common import scalars

__all__ = ["EventbusCallback"]

_INSTALL = ("eventbus.integrations.lightning needs Lightning (lightning.pytorch or "
            "pytorch_lightning): pip install 'eventbus[lightning]'")


def _import_lightning() -> Any:
    """``lightning.pytorch``, else ``pytorch_lightning``; an ImportError naming the extra
    where neither is installed (a broken installation raises its own error)."""
    try:
        import lightning.pytorch  # type: ignore[import-not-found, unused-ignore]

        return lightning.pytorch
    except ModuleNotFoundError as exc:
        if exc.name not in ("lightning", "lightning.pytorch"):
            raise
    try:
        import pytorch_lightning  # type: ignore[import-not-found, unused-ignore]

        return pytorch_lightning
    except ModuleNotFoundError as exc:
        if exc.name != "pytorch_lightning":
            raise
        raise ImportError(_INSTALL, name=exc.name) from exc


if TYPE_CHECKING:
    import lightning.pytorch as pl  # type: ignore[import-not-found, unused-ignore]
else:
    pl = _import_lightning()

logger = logging.getLogger("eventbus")

#: the name of the drain's checkpoint file in its folder
DRAIN_CHECKPOINT = "preempted-step={step}.ckpt"


class _TimedSave:
    """Stands in for ``trainer.save_checkpoint`` on one trainer: calls the trainer's own
    and reports the path and the seconds it took to the callback."""

    def __init__(self, original: Any, callback: EventbusCallback, trainer: pl.Trainer) -> None:
        self.original = original
        self.callback = callback
        self.trainer = trainer

    def __call__(self, filepath: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        result = self.original(filepath, *args, **kwargs)
        self.callback._saved(self.trainer, filepath, time.perf_counter() - started)
        return result


class EventbusCallback(pl.Callback):  # type: ignore[misc, unused-ignore]
    """Drains the trainer on preemption and records its metrics and checkpoints (see the
    module's documentation). ``dirpath``: the folder of the drain's checkpoint, by default
    the trainer's checkpoint folder."""

    def __init__(self, dirpath: str | os.PathLike[str] | None = None) -> None:
        super().__init__()
        self.dirpath = None if dirpath is None else os.fspath(dirpath)
        #: the path of the drain's checkpoint, once saved
        self.drain_checkpoint: str | None = None
        self._last_step: int | None = None
        self._last_metrics: dict[str, int | float] = {}
        self._draining = False
        self._failed = HookFailures("Lightning")

    # -- the hooks ----------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        try:
            self._last_step = None
            current = trainer.save_checkpoint
            original = current.original if isinstance(current, _TimedSave) else current
            timed = _TimedSave(original, self, trainer)
            trainer.save_checkpoint = timed  # type: ignore[method-assign, unused-ignore]
        except Exception:
            self._failed("setup")

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        try:
            current = vars(trainer).get("save_checkpoint")
            if isinstance(current, _TimedSave) and current.callback is self:
                del vars(trainer)["save_checkpoint"]  # the class's method again
        except Exception:
            self._failed("teardown")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._last_step:  # accumulating gradients: no optimizer step
            return
        self._last_step = step
        try:
            stop = preemption.should_stop(step=step)
        except Exception:
            self._failed("on_train_batch_end")
            stop = False
        try:
            every = getattr(trainer, "log_every_n_steps", 50)  # set by the trainer
            if stop or (every > 0 and step % every == 0):
                self._record_metrics(trainer, only_changed=False)
        except Exception:
            self._failed("on_train_batch_end")
        if stop:
            self._drain(trainer, step)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        try:
            self._record_metrics(trainer, only_changed=True)
        except Exception:
            self._failed("on_train_epoch_end")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        try:
            if not trainer.sanity_checking:
                self._record_metrics(trainer, only_changed=True)
        except Exception:
            self._failed("on_validation_end")

    # -- the work -----------------------------------------------------------------------

    def _drain(self, trainer: pl.Trainer, step: int) -> None:
        """Save at this step the trainer's way, on every rank, and stop. The save's own
        errors are the trainer's: they are not caught."""
        path = os.path.join(self._folder(trainer), DRAIN_CHECKPOINT.format(step=step))
        self._draining = True
        try:
            trainer.save_checkpoint(path)
        finally:
            self._draining = False
        self.drain_checkpoint = path
        trainer.should_stop = True

    def _folder(self, trainer: pl.Trainer) -> str:
        if self.dirpath is not None:
            return self.dirpath
        try:
            folder = getattr(trainer.checkpoint_callback, "dirpath", None)
        except Exception:
            folder = None
        if folder:
            return str(os.fspath(folder))
        return os.path.join(os.fspath(trainer.default_root_dir), "checkpoints")

    def _saved(self, trainer: pl.Trainer, filepath: Any, seconds: float) -> None:
        """One ``save_checkpoint`` of the trainer returned: record it (global rank 0)."""
        try:
            if not trainer.is_global_zero:
                return
            eventbus.record(
                eventbus.EventType.CHECKPOINT_SAVED,
                path=str(os.fspath(filepath)),
                step=int(trainer.global_step),
                epoch=int(trainer.current_epoch),
                duration_s=max(0.0, float(seconds)),
                data={"preempted": True} if self._draining else {},
            )
        except Exception:
            self._failed("save_checkpoint")

    def _record_metrics(self, trainer: pl.Trainer, *, only_changed: bool) -> None:
        metrics = scalars(trainer.logged_metrics)
        if only_changed:
            last = self._last_metrics
            metrics = {key: value for key, value in metrics.items()
                       if key not in last or not _same(last[key], value)}
        if not metrics:
            return
        self._last_metrics.update(metrics)
        eventbus.record(eventbus.EventType.METRIC, step=int(trainer.global_step), data=metrics)



def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))
