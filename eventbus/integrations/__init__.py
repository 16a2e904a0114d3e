"""Trainer integrations: one callback per trainer that drains on preemption and records.

* :mod:`eventbus.integrations.lightning`: ``EventbusCallback`` for Lightning
  (``lightning.pytorch``, or ``pytorch_lightning`` where only that is installed);
  ``pip install 'eventbus[lightning]'``.
* :mod:`eventbus.integrations.transformers`: ``EventbusCallback`` for the Hugging Face
  ``transformers.Trainer``; ``pip install 'eventbus[transformers]'``.

Each callback calls :func:`eventbus.preemption.should_stop` once per optimizer step with the
trainer's global step; when it says so (a drain under ``eventbus run``, the same step on
every rank) the trainer saves a checkpoint its own way at that step, which it resumes from,
and stops. Along the way the callback records the trainer's logged metrics as ``METRIC``
events and each checkpoint the trainer saves as ``CHECKPOINT_SAVED`` (path, step, epoch and
the seconds the save took). A failure of eventbus inside a hook is logged once (logger
``eventbus``) and never reaches the trainer.

This package imports nothing; import the module of your trainer::

    from eventbus.integrations.lightning import EventbusCallback
    trainer = lightning.pytorch.Trainer(callbacks=[EventbusCallback()])
"""
