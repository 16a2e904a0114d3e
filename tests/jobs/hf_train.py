"""A Hugging Face ``Trainer`` job for tests/test_integrations_jobs.py: a tiny GPT-2 built
from its config (nothing downloaded) on random tokens, DDP over gloo on CPU, with
``eventbus.integrations.transformers.EventbusCallback``.

Run it under ``eventbus run --nproc-per-node 2`` (or torchrun): the Trainer (accelerate)
takes the ranks from the torchelastic environment and starts no processes of its own.

Environment (all optional):

- ``OUT`` (default ``.``): the folder of the files below; the Trainer's ``output_dir`` is
  ``<OUT>/hf`` (the drain's checkpoint is ``<OUT>/hf/checkpoint-<S>``);
- ``MAX_STEPS`` (default 100000), ``STEP_S`` (default 0.02: a sleep at each step's start);
- ``READY_AT`` (default 10): each rank writes ``ready_rank<R>`` once its global step reaches it;
- ``EVENTBUS_CALLBACK=off``: without eventbus's callback (the script unchanged);
- ``RESUME``: a checkpoint folder to resume from (``trainer.train(resume_from_checkpoint=)``);
- ``EVAL_S``: an evaluation of about that many seconds (``EVAL_BATCHES`` batches, default
  20, each ``EVAL_S / EVAL_BATCHES`` s of forward passes) every ``EVAL_EVERY`` (default 20)
  steps; unset: none. The Trainer gathers the loss across ranks after every batch: with
  ``EVAL_BATCHES=1`` the ranks are silent (no collective, no step) for the whole ``EVAL_S``,
  as in a generation-based evaluation whose batches are long;
- ``SAMPLE_S``: after each evaluation, rank 0 alone writes samples for that many seconds
  (forward passes, in an ``on_evaluate`` callback, as people do to look at generations)
  while the other ranks go on to the next step and wait for it in DDP's all_reduce.

Files: ``pid_rank<R>`` (the worker's pid, first thing); ``ready_rank<R>``;
``end_rank<R>.json`` when ``train`` returns: ``global_step``, ``start_step`` (the global step
at the first step's start: the steps already taken), ``first_end_step`` (the global step at
that step's end), the world size and process index the Trainer saw, and the pid;
``samples_rank0`` (the global step) once rank 0 wrote its samples (``SAMPLE_S``).
"""

import json
import os
import time
from pathlib import Path
from typing import Any

OUT = Path(os.environ.get("OUT", "."))
RANK = os.environ.get("RANK", "0")
(OUT / f"pid_rank{RANK}").write_text(str(os.getpid()))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

#: EVENTBUS_CALLBACK=off: the script as its user wrote it, with no eventbus call at all
#: (what `eventbus run` still watches: heartbeats, stalls, drains by signal)
CALLBACKS: list[Any] = []
if os.environ.get("EVENTBUS_CALLBACK", "on") != "off":
    from eventbus.integrations.transformers import EventbusCallback

    CALLBACKS.append(EventbusCallback())

MAX_STEPS = int(os.environ.get("MAX_STEPS", "100000"))
STEP_S = float(os.environ.get("STEP_S", "0.02"))
READY_AT = int(os.environ.get("READY_AT", "10"))
EVAL_S = float(os.environ.get("EVAL_S", "0"))
EVAL_BATCHES = int(os.environ.get("EVAL_BATCHES", "20"))
SAMPLE_S = float(os.environ.get("SAMPLE_S", "0"))


class SlowEval(transformers.Trainer):
    """Each evaluation batch takes EVAL_S / EVAL_BATCHES s of forward passes."""

    def prediction_step(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        deadline = time.monotonic() + EVAL_S / EVAL_BATCHES
        with torch.no_grad():
            while time.monotonic() < deadline:
                model(input_ids=inputs["input_ids"])
        return super().prediction_step(model, inputs, *args, **kwargs)


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Random token rows; the labels are the inputs (the model shifts them)."""

    def __init__(self, size: int = 400_000, length: int = 16) -> None:
        self.size, self.length = size, length

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, Any]:
        generator = torch.Generator().manual_seed(index)  # no 400k-row tensor in memory
        ids = torch.randint(0, 64, (self.length,), generator=generator)
        return {"input_ids": ids, "labels": ids}


class Probe(transformers.TrainerCallback):
    """The global step at the first step, ``ready_rank<R>`` at READY_AT, the step's sleep."""

    def __init__(self) -> None:
        self.start_step: int | None = None
        self.first_end_step: int | None = None
        self.ready = False

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.start_step is None:
            self.start_step = state.global_step
        time.sleep(STEP_S)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.first_end_step is None:
            self.first_end_step = state.global_step
        if not self.ready and state.global_step >= READY_AT:
            self.ready = True
            (OUT / f"ready_rank{args.process_index}").write_text(str(state.global_step))


class Samples(transformers.TrainerCallback):
    """Rank 0 alone runs SAMPLE_S s of forward passes after each evaluation."""

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        model = kwargs["model"]
        ids = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(0))
        deadline = time.monotonic() + SAMPLE_S
        with torch.no_grad():
            while time.monotonic() < deadline:
                model(input_ids=ids)
        (OUT / "samples_rank0").write_text(str(state.global_step))


def main() -> None:
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64,
                                     n_positions=32, bos_token_id=0, eos_token_id=0)
    args = transformers.TrainingArguments(
        output_dir=str(OUT / "hf"), max_steps=MAX_STEPS, per_device_train_batch_size=4,
        use_cpu=True, report_to=[], save_strategy="no", logging_steps=5,
        ddp_backend="gloo", ddp_find_unused_parameters=False, dataloader_num_workers=0,
        disable_tqdm=True, seed=0,
        eval_strategy="steps" if EVAL_S > 0 else "no",
        eval_steps=int(os.environ.get("EVAL_EVERY", "20")), per_device_eval_batch_size=4,
        prediction_loss_only=True)
    probe = Probe()
    trainer = SlowEval(model=transformers.GPT2LMHeadModel(config), args=args,
                       train_dataset=Tokens(),
                       callbacks=[*CALLBACKS, probe, *([Samples()] if SAMPLE_S > 0 else [])],
                       eval_dataset=Tokens(size=EVAL_BATCHES * 4 * 2) if EVAL_S > 0 else None)
    trainer.train(resume_from_checkpoint=os.environ.get("RESUME") or None)
    end = {"global_step": trainer.state.global_step, "start_step": probe.start_step,
           "first_end_step": probe.first_end_step, "world_size": args.world_size,
           "process_index": args.process_index, "pid": os.getpid()}
    (OUT / f"end_rank{args.process_index}.json").write_text(json.dumps(end))


if __name__ == "__main__":
    main()
