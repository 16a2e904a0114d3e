"""A Lightning DDP job for tests/test_integrations_jobs.py: a Linear model on random data,
``strategy="ddp"`` on CPU (gloo) with ``eventbus.integrations.lightning.EventbusCallback``.

Run it under ``eventbus run --nproc-per-node 2`` (or torchrun): Lightning detects the
torchelastic environment and uses its ranks; it starts no processes of its own.

Environment (all optional):

- ``OUT`` (default ``.``): the folder of the files below and the trainer's
  ``default_root_dir`` (the drain's checkpoint goes to ``<OUT>/checkpoints``);
- ``MAX_STEPS`` (default 100000), ``STEP_S`` (default 0.02: a sleep in each training step);
- ``READY_AT`` (default 10): each rank writes ``ready_rank<R>`` once its global step reaches it;
- ``EVENTBUS_CALLBACK=off``: without eventbus's callback (the script unchanged);
- ``CKPT``: a checkpoint to resume from (``trainer.fit(ckpt_path=CKPT)``);
- ``VAL_S``: a validation epoch of about that many seconds of forward passes (20 batches,
  no collective until its end) every ``VAL_EVERY`` (default 20) training steps, once
  (``limit_val_batches``); unset: no validation.

Files: ``pid_rank<R>`` (the worker's pid, first thing); ``ready_rank<R>``;
``end_rank<R>.json`` when ``fit`` returns: ``global_step``, ``start_step`` (the global step at
the first training batch's start: the steps already taken), ``first_end_step`` (the global
step after that batch), the cluster environment's class name, the trainer's world size and
ranks, and the pid.
"""

import json
import os
import time
from pathlib import Path
from typing import Any

OUT = Path(os.environ.get("OUT", "."))
RANK = os.environ.get("RANK", "0")
(OUT / f"pid_rank{RANK}").write_text(str(os.getpid()))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402

#: EVENTBUS_CALLBACK=off: the script as its user wrote it, with no eventbus call at all
#: (what `eventbus run` still watches: heartbeats, stalls, drains by signal)
CALLBACKS: list[Any] = []
if os.environ.get("EVENTBUS_CALLBACK", "on") != "off":
    from eventbus.integrations.lightning import EventbusCallback

    CALLBACKS.append(EventbusCallback())

MAX_STEPS = int(os.environ.get("MAX_STEPS", "100000"))
STEP_S = float(os.environ.get("STEP_S", "0.02"))
READY_AT = int(os.environ.get("READY_AT", "10"))
VAL_S = float(os.environ.get("VAL_S", "0"))
VAL_BATCHES = 20


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        time.sleep(STEP_S)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        """VAL_S / VAL_BATCHES seconds of forward passes: a long validation epoch."""
        x, y = batch
        deadline = time.monotonic() + VAL_S / VAL_BATCHES
        with torch.no_grad():
            while time.monotonic() < deadline:
                loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def val_dataloader(self) -> Any:
        generator = torch.Generator().manual_seed(1)
        data = torch.utils.data.TensorDataset(torch.randn(400, 8, generator=generator),
                                              torch.randn(400, 1, generator=generator))
        return torch.utils.data.DataLoader(data, batch_size=4)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> Any:
        generator = torch.Generator().manual_seed(0)
        size = 400_000  # 50000 steps an epoch per rank: the job runs for minutes
        data = torch.utils.data.TensorDataset(torch.randn(size, 8, generator=generator),
                                              torch.randn(size, 1, generator=generator))
        # Lightning puts a DistributedSampler in (2 ranks: half the data each)
        return torch.utils.data.DataLoader(data, batch_size=4)


class Probe(pl.Callback):
    """The global step at the first batch, and ``ready_rank<R>`` at READY_AT."""

    def __init__(self) -> None:
        self.start_step: int | None = None
        self.first_end_step: int | None = None
        self.ready = False

    def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
        if self.start_step is None:
            self.start_step = trainer.global_step

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if self.first_end_step is None:
            self.first_end_step = trainer.global_step
        if not self.ready and trainer.global_step >= READY_AT:
            self.ready = True
            (OUT / f"ready_rank{trainer.global_rank}").write_text(str(trainer.global_step))


def main() -> None:
    probe = Probe()
    trainer = pl.Trainer(
        accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "2")),
        strategy="ddp", num_nodes=1, max_steps=MAX_STEPS, logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(OUT),
        log_every_n_steps=5, num_sanity_val_steps=0, callbacks=[*CALLBACKS, probe],
        limit_val_batches=VAL_BATCHES if VAL_S > 0 else 0,
        val_check_interval=int(os.environ.get("VAL_EVERY", "20")) if VAL_S > 0 else None)
    trainer.fit(Tiny(), ckpt_path=os.environ.get("CKPT") or None)
    env = getattr(trainer.strategy, "cluster_environment", None)  # the DDP strategy's
    end = {"global_step": trainer.global_step, "start_step": probe.start_step,
           "first_end_step": probe.first_end_step, "environment": type(env).__name__,
           "world_size": trainer.world_size, "global_rank": trainer.global_rank,
           "local_rank": trainer.local_rank, "pid": os.getpid()}
    (OUT / f"end_rank{trainer.global_rank}.json").write_text(json.dumps(end))


if __name__ == "__main__":
    main()
