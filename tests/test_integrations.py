"""The trainer integrations (eventbus.integrations): real trainers, on CPU, one process.

Each trainer's tests skip where it is not installed; the import tests run everywhere.
Tiny models built from code, tiny random data, everything under tmp_path: nothing is
downloaded.
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import eventbus
from eventbus import preemption
from eventbus.testing import capture_events
from eventbus.testing import drain

CHECKPOINT_SAVED = eventbus.EventType.CHECKPOINT_SAVED
METRIC = eventbus.EventType.METRIC


@pytest.fixture(autouse=True)
def _forget_the_drain() -> Iterator[None]:
    yield
    preemption.reset()


def _warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records
            if r.name == "eventbus" and r.levelno >= logging.WARNING]


# -- importing without the trainer ------------------------------------------------------


def _forget(monkeypatch: pytest.MonkeyPatch, module: str) -> None:
    """Make ``module`` import afresh in this test; the test's undo puts back what was."""
    package, _, name = module.rpartition(".")
    monkeypatch.setattr(importlib.import_module(package), name, None, raising=False)
    monkeypatch.setitem(sys.modules, module, None)
    monkeypatch.delitem(sys.modules, module)


@pytest.mark.parametrize(("module", "missing", "extra"), [
    ("eventbus.integrations.lightning",
     ("lightning", "lightning.pytorch", "pytorch_lightning"), "eventbus[lightning]"),
    ("eventbus.integrations.transformers",
     ("transformers", "transformers.trainer_callback"), "eventbus[transformers]"),
])
def test_import_without_the_trainer_names_the_extra(
        monkeypatch: pytest.MonkeyPatch, module: str, missing: tuple[str, ...],
        extra: str) -> None:
    importlib.import_module("eventbus.integrations")  # the package itself imports nothing
    for name in missing:
        monkeypatch.setitem(sys.modules, name, None)  # None: "not installed" to import
    _forget(monkeypatch, module)
    with pytest.raises(ImportError) as raised:
        importlib.import_module(module)
    assert f"pip install '{extra}'" in str(raised.value)


def test_lightning_falls_back_to_pytorch_lightning(monkeypatch: pytest.MonkeyPatch) -> None:
    """With only ``pytorch_lightning`` installed, the callback is one of its callbacks."""
    pytorch_lightning = pytest.importorskip("pytorch_lightning")
    monkeypatch.setitem(sys.modules, "lightning", None)
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)
    _forget(monkeypatch, "eventbus.integrations.lightning")
    fallback = importlib.import_module("eventbus.integrations.lightning")
    assert issubclass(fallback.EventbusCallback, pytorch_lightning.Callback)


# -- Lightning --------------------------------------------------------------------------


def _lightning() -> Any:
    """What the tests use of lightning.pytorch (skip without it), with the test's module
    and a recorder of the global steps."""
    pl = pytest.importorskip("lightning.pytorch")
    import torch

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.05)

        def train_dataloader(self) -> Any:
            generator = torch.Generator().manual_seed(0)
            data = torch.utils.data.TensorDataset(torch.randn(64, 4, generator=generator),
                                                  torch.randn(64, 1, generator=generator))
            return torch.utils.data.DataLoader(data, batch_size=4)  # 16 steps an epoch

    class Steps(pl.Callback):
        """The global step at the start of each training batch."""

        def __init__(self) -> None:
            self.seen: list[int] = []

        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            self.seen.append(trainer.global_step)

    return SimpleNamespace(Trainer=pl.Trainer, ModelCheckpoint=pl.callbacks.ModelCheckpoint,
                           Tiny=Tiny, Steps=Steps)


def _trainer(pl: Any, tmp_path: Path, *callbacks: Any, **options: Any) -> Any:
    settings: dict[str, Any] = {
        "accelerator": "cpu", "devices": 1, "max_steps": 10, "logger": False,
        "enable_checkpointing": False, "enable_progress_bar": False,
        "enable_model_summary": False, "default_root_dir": tmp_path,
        "num_sanity_val_steps": 0,
    }
    settings.update(options)
    return pl.Trainer(callbacks=list(callbacks), **settings)


def test_lightning_drain_saves_stops_and_resumes(tmp_path: Path) -> None:
    from eventbus.integrations.lightning import EventbusCallback

    pl = _lightning()
    callback = EventbusCallback()
    trainer = _trainer(pl, tmp_path, callback)
    with capture_events(CHECKPOINT_SAVED) as saved, drain(stop_at=4):
        trainer.fit(pl.Tiny())
    path = tmp_path / "checkpoints" / "preempted-step=4.ckpt"
    assert trainer.global_step == 4  # not max_steps
    assert path.is_file()
    assert callback.drain_checkpoint == str(path)
    assert [(e.path, e.step, e.epoch, e.data.get("preempted")) for e in saved] == [
        (str(path), 4, 0, True)]
    assert saved[0].duration_s is not None and saved[0].duration_s >= 0
    # the save is the trainer's own again once it is done
    assert "save_checkpoint" not in vars(trainer)

    steps = pl.Steps()
    resumed = _trainer(pl, tmp_path, EventbusCallback(), steps)
    resumed.fit(pl.Tiny(), ckpt_path=str(path))
    assert steps.seen[0] == 4
    assert resumed.global_step == 10


def test_lightning_records_metrics_and_the_trainers_own_checkpoints(tmp_path: Path) -> None:
    from eventbus.integrations.lightning import EventbusCallback

    pl = _lightning()
    folder = tmp_path / "ck"
    checkpoints = pl.ModelCheckpoint(dirpath=folder, every_n_train_steps=3,
                                               save_top_k=-1)
    trainer = _trainer(pl, tmp_path, EventbusCallback(), checkpoints, max_steps=6,
                       enable_checkpointing=True, log_every_n_steps=2)
    with capture_events(METRIC) as metrics, capture_events(CHECKPOINT_SAVED) as saved:
        trainer.fit(pl.Tiny())
    assert trainer.global_step == 6
    at_log_steps = [e for e in metrics if e.step in (2, 4, 6)]
    assert [e.step for e in at_log_steps][:3] == [2, 4, 6]
    for event in at_log_steps:
        assert type(event.data["train_loss"]) is float
    assert [(Path(e.path).name, e.step) for e in saved] == [
        ("epoch=0-step=3.ckpt", 3), ("epoch=0-step=6.ckpt", 6)]
    assert all(Path(e.path).is_file() and e.duration_s is not None and e.duration_s >= 0
               for e in saved)


def test_lightning_drain_goes_to_the_trainers_checkpoint_folder(tmp_path: Path) -> None:
    from eventbus.integrations.lightning import EventbusCallback

    pl = _lightning()
    folder = tmp_path / "ck"
    callback = EventbusCallback()
    trainer = _trainer(pl, tmp_path, callback, pl.ModelCheckpoint(dirpath=folder),
                       enable_checkpointing=True)
    with drain(stop_at=2):
        trainer.fit(pl.Tiny())
    assert callback.drain_checkpoint == str(folder / "preempted-step=2.ckpt")
    assert (folder / "preempted-step=2.ckpt").is_file()

    override = tmp_path / "elsewhere"
    callback = EventbusCallback(dirpath=override)
    with drain(stop_at=1):
        _trainer(pl, tmp_path, callback).fit(pl.Tiny())
    assert (override / "preempted-step=1.ckpt").is_file()


def test_lightning_survives_a_failing_eventbus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    from eventbus.integrations.lightning import EventbusCallback

    pl = _lightning()

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("eventbus is broken")

    monkeypatch.setattr(eventbus, "record", broken)
    trainer = _trainer(pl, tmp_path, EventbusCallback(), log_every_n_steps=1)
    with caplog.at_level(logging.DEBUG, logger="eventbus"), drain(stop_at=3):
        trainer.fit(pl.Tiny())
    assert trainer.global_step == 3  # the drain still stops and saves
    assert (tmp_path / "checkpoints" / "preempted-step=3.ckpt").is_file()
    warned = _warnings(caplog)
    assert len(warned) == 1 and "eventbus is broken" in repr(warned[0].exc_info)

    def broken_stop(step: int | None = None) -> bool:
        raise RuntimeError("should_stop is broken")

    monkeypatch.setattr(preemption, "should_stop", broken_stop)
    trainer = _trainer(pl, tmp_path, EventbusCallback(), max_steps=5)
    trainer.fit(pl.Tiny())
    assert trainer.global_step == 5


# -- transformers -----------------------------------------------------------------------


@pytest.fixture
def hf(monkeypatch: pytest.MonkeyPatch) -> Any:
    """transformers (skip without it), offline, and no reporting integrations."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    return pytest.importorskip("transformers")


class _Tokens:
    """A tiny random token dataset, a torch map-style dataset by protocol."""

    def __init__(self, size: int = 64, length: int = 16) -> None:
        import torch

        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 64, (size, length), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def _hf_trainer(hf: Any, tmp_path: Path, *callbacks: Any, **options: Any) -> Any:
    config = hf.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=32,
                           bos_token_id=0, eos_token_id=0)
    settings: dict[str, Any] = {
        "output_dir": str(tmp_path / "out"), "max_steps": 8,
        "per_device_train_batch_size": 4, "report_to": "none", "use_cpu": True,
        "save_strategy": "no", "logging_steps": 2, "disable_tqdm": True,
        "dataloader_num_workers": 0, "seed": 0,
    }
    settings.update(options)
    return hf.Trainer(model=hf.GPT2LMHeadModel(config), args=hf.TrainingArguments(**settings),
                      train_dataset=_Tokens(), callbacks=list(callbacks))


def test_transformers_drain_saves_stops_and_resumes(hf: Any, tmp_path: Path) -> None:
    from eventbus.integrations.transformers import EventbusCallback

    callback = EventbusCallback()
    trainer = _hf_trainer(hf, tmp_path, callback)  # save_strategy "no": the drain saves
    with capture_events(CHECKPOINT_SAVED) as saved, drain(stop_at=3):
        trainer.train()
    path = tmp_path / "out" / "checkpoint-3"
    assert trainer.state.global_step == 3  # not max_steps
    assert (path / "trainer_state.json").is_file()
    assert callback.drain_checkpoint == str(path)
    assert [(e.path, e.step, e.data.get("preempted")) for e in saved] == [(str(path), 3, True)]
    assert saved[0].duration_s is not None and saved[0].duration_s >= 0

    class FirstStep(hf.TrainerCallback):
        def __init__(self) -> None:
            self.steps: list[int] = []

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.steps.append(state.global_step)

    first = FirstStep()
    resumed = _hf_trainer(hf, tmp_path, EventbusCallback(), first)
    resumed.train(resume_from_checkpoint=str(path))
    assert first.steps[0] == 4  # the resumed run began at step 3
    assert resumed.state.global_step == 8


def test_transformers_records_metrics_and_periodic_checkpoints(hf: Any, tmp_path: Path) -> None:
    from eventbus.integrations.transformers import EventbusCallback

    trainer = _hf_trainer(hf, tmp_path, EventbusCallback(), max_steps=4, logging_steps=1,
                          save_strategy="steps", save_steps=2)
    with capture_events(METRIC) as metrics, capture_events(CHECKPOINT_SAVED) as saved:
        trainer.train()
    assert trainer.state.global_step == 4
    losses = [(e.step, type(e.data["loss"])) for e in metrics if "loss" in e.data]
    assert losses == [(1, float), (2, float), (3, float), (4, float)]
    out = tmp_path / "out"
    assert [(e.path, e.step, e.epoch) for e in saved] == [
        (str(out / "checkpoint-2"), 2, 0), (str(out / "checkpoint-4"), 4, 0)]
    for event in saved:
        assert Path(event.path).is_dir()
        assert event.duration_s is not None and event.duration_s >= 0
        assert "preempted" not in event.data


def test_transformers_survives_a_failing_eventbus(hf: Any, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    from eventbus.integrations.transformers import EventbusCallback

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("eventbus is broken")

    monkeypatch.setattr(eventbus, "record", broken)
    trainer = _hf_trainer(hf, tmp_path, EventbusCallback(), logging_steps=1)
    with caplog.at_level(logging.DEBUG, logger="eventbus"), drain(stop_at=2):
        trainer.train()
    assert trainer.state.global_step == 2  # the drain still stops and saves
    assert (tmp_path / "out" / "checkpoint-2" / "trainer_state.json").is_file()
    warned = _warnings(caplog)
    assert len(warned) == 1 and "eventbus is broken" in repr(warned[0].exc_info)

    def broken_stop(step: int | None = None) -> bool:
        raise RuntimeError("should_stop is broken")

    monkeypatch.setattr(preemption, "should_stop", broken_stop)
    trainer = _hf_trainer(hf, tmp_path, EventbusCallback(), max_steps=3)
    trainer.train()
    assert trainer.state.global_step == 3
