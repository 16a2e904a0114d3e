"""The bootstrap's save watch (eventbus_app/worker/saves.py) on stand-in modules: a save
noted with its start, end, path and size; a failed one noted as such and re-raised; an
asynchronous one when its future completes; wrapped once; what nobody saves costs
nothing."""

from __future__ import annotations

import concurrent.futures
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from eventbus.app.worker.saves import MAX_PENDING
from eventbus.app.worker.saves import SaveWatch


@pytest.fixture
def fake_torch(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.SimpleNamespace]:
    calls: list[Any] = []

    def save(obj: Any, f: Any) -> None:
        calls.append(obj)
        if obj == "boom":
            raise OSError("disk full")
        Path(f).write_bytes(b"x" * 1000)

    torch = types.ModuleType("torch")
    torch.save = save  # type: ignore[attr-defined]
    dcp = types.ModuleType("torch.distributed.checkpoint")
    pool = concurrent.futures.ThreadPoolExecutor(1)
    dcp.save = lambda state, checkpoint_id=None: None  # type: ignore[attr-defined]
    dcp.async_save = lambda state, checkpoint_id=None: pool.submit(  # type: ignore[attr-defined]
        lambda: None)
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "torch.distributed.checkpoint", dcp)
    yield types.SimpleNamespace(torch=torch, dcp=dcp, calls=calls)
    pool.shutdown(wait=True)


def test_a_save_is_noted_with_its_times_and_size(fake_torch: Any, tmp_path: Path) -> None:
    times = iter([10.0, 10.5, 20.0, 20.25])
    watch = SaveWatch(clock=lambda: next(times))
    assert not watch.armed and not watch.take()
    watch.arm()
    watch.arm()  # again: wraps nothing twice
    assert watch.armed
    fake_torch.torch.save({"w": 1}, str(tmp_path / "a.pt"))
    with pytest.raises(OSError, match="disk full"):
        fake_torch.torch.save("boom", str(tmp_path / "b.pt"))
    assert watch.waiting
    first, failed = watch.take()
    assert first == {"kind": "torch.save", "start": 10.0, "end": 10.5, "ok": True,
                     "path": str(tmp_path / "a.pt"), "bytes": 1000}
    assert failed["ok"] is False and failed["bytes"] is None and failed["end"] == 20.25
    assert not watch.take() and len(fake_torch.calls) == 2


def test_dcp_saves_and_an_async_save_when_it_completes(fake_torch: Any) -> None:
    watch = SaveWatch()
    watch.arm()
    fake_torch.dcp.save({}, checkpoint_id="/ckpt/step-10")
    future = fake_torch.dcp.async_save({}, checkpoint_id="/ckpt/step-20")
    future.result(timeout=10)
    for _ in range(100):
        if watch.noted == 2:
            break
        import time
        time.sleep(0.01)
    kinds = sorted((s["kind"], s["path"]) for s in watch.take())
    assert kinds == [("dcp.async_save", "/ckpt/step-20"), ("dcp.save", "/ckpt/step-10")]


def test_between_two_heartbeats_the_list_is_bounded(fake_torch: Any, tmp_path: Path) -> None:
    watch = SaveWatch()
    watch.arm()
    for i in range(MAX_PENDING + 5):
        fake_torch.torch.save(i, str(tmp_path / "c.pt"))
    assert len(watch.take()) == MAX_PENDING and watch.overflow == 5
    assert watch.noted == MAX_PENDING + 5


def test_a_real_dcp_save_is_one_save_with_its_folders_size(tmp_path: Path) -> None:
    """torch.distributed.checkpoint.save (no process group) writes through torch.save
    itself: one save is noted, the DCP one, with its folder's bytes."""
    torch = pytest.importorskip("torch")
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    save, dcp_save, dcp_async = torch.save, dcp.save, dcp.async_save
    watch = SaveWatch()
    try:
        watch.arm()
        dcp.save({"w": torch.zeros(1000)}, checkpoint_id=str(tmp_path / "step-1"))
        (noted,) = watch.take()
        assert noted["kind"] == "dcp.save" and noted["ok"]
        assert noted["bytes"] >= 4000 and noted["path"] == str(tmp_path / "step-1")
    finally:
        torch.save, dcp.save, dcp.async_save = save, dcp_save, dcp_async


def test_a_newer_watch_keeps_the_saves_from_an_older_one_that_arms_again(
        fake_torch: Any, tmp_path: Path) -> None:
    """Two watches in one process (a progress watch left by an earlier test, say): the
    older one's later arm() (its every tick) does not take the saves back."""
    older, newer = SaveWatch(), SaveWatch()
    older.arm()
    newer.arm()
    older.arm()  # the older watch's next tick
    fake_torch.torch.save(1, str(tmp_path / "d.pt"))
    assert len(newer.take()) == 1 and not older.take()


def test_a_save_carries_the_step_its_end_saw_and_goodput_prefers_it(fake_torch: Any,
                                                                     tmp_path: Path) -> None:
    """The save's step is the step counter as the save ends, not the step of the heartbeat
    that carries it (which goes out up to a tick and a beat later): goodput's wasted steps
    count from it (a real job: tests/test_goodput_jobs.py)."""
    from eventbus.app.readers import goodput

    steps = [30]
    watch = SaveWatch(step=lambda: steps[0])
    watch.arm()
    fake_torch.torch.save({"w": 1}, str(tmp_path / "a.pt"))
    steps[0] = 43  # the beat that carries it goes out 13 steps later
    (save,) = watch.take()
    assert save["step"] == 30
    beat = goodput.Record(type="WORKER_PROGRESS", timestamp=save["end"] + 1.0,
                          fields={"step": 43}, data={"saves": [save]},
                          context={"rank": 0, "restart_count": 0})
    ((start, end, step, attempt),) = goodput._saves([beat])
    assert (start, end, step, attempt) == (save["start"], save["end"], 30, 0)
    unstepped = {k: v for k, v in save.items() if k != "step"}  # an older worker's note
    older = goodput.Record(type="WORKER_PROGRESS", timestamp=save["end"] + 1.0,
                           fields={"step": 43}, data={"saves": [unstepped]},
                           context={"rank": 0, "restart_count": 0})
    assert goodput._saves([older])[0][2] == 43
