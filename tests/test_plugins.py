"""The agent plugins' lifecycle (eventbus_app/plugins.py) without an agent: each step runs
every plugin in order, and a plugin that raises or answers wrongly is reported and costs
only itself."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import pytest

import eventbus
from eventbus.app import plugins
from eventbus.app.plugins import RendezvousInfo


def _info() -> RendezvousInfo:
    return RendezvousInfo(store_host="127.0.0.1", store_port=1, run_id="r", group_rank=0,
                          group_world_size=1, restart_count=0, local_world_size=1,
                          world_size=1, global_ranks=(0,), bus=eventbus.Bus("plugins-test"))


class Recorder:
    def __init__(self, env: Mapping[object, object] | None = None,
                 fail: bool = False) -> None:
        self.env = env or {}
        self.fail = fail
        self.calls: list[str] = []

    def after_rendezvous(self, info: RendezvousInfo) -> Mapping[str, str]:
        self.calls.append("after_rendezvous")
        if self.fail:
            raise RuntimeError("boom")
        return self.env  # type: ignore[return-value]

    def before_exit(self, *, timeout: float) -> None:
        self.calls.append(f"before_exit {timeout}")
        if self.fail:
            raise RuntimeError("boom")

    def drain(self, *, timeout: float) -> None:
        self.calls.append(f"drain {timeout}")
        if self.fail:
            raise RuntimeError("boom")


def test_each_plugin_runs_and_a_raising_one_costs_only_itself(
        caplog: pytest.LogCaptureFixture) -> None:
    """A plugin that raises in any step is logged with its name; the next still runs."""
    broken, good = Recorder(fail=True), Recorder(env={"A": "1"})
    environ: dict[str, str] = {}
    with caplog.at_level(logging.ERROR, logger="eventbus"):
        plugins.after_rendezvous([broken, good], _info(), environ)
        plugins.drain([broken, good], timeout=0.25)
        plugins.before_exit([broken, good], timeout=2.0)
    assert good.calls == ["after_rendezvous", "drain 0.25", "before_exit 2.0"]
    assert environ == {"A": "1"}
    reports = [r.getMessage() for r in caplog.records]
    assert [m.rsplit(" ", 1)[-1] for m in reports] == [
        "after_rendezvous", "drain", "before_exit"]
    assert all("test_plugins.Recorder" in m for m in reports)


def test_a_plugin_returning_a_non_string_variable_is_reported(
        caplog: pytest.LogCaptureFixture) -> None:
    """after_rendezvous must return str -> str: a bad pair is reported, the earlier pairs
    of that plugin and the other plugins' are kept."""
    environ: dict[str, str] = {}
    with caplog.at_level(logging.ERROR, logger="eventbus"):
        plugins.after_rendezvous([Recorder(env={"A": "1", "B": 2}), Recorder(env={"C": "3"})],
                                 _info(), environ)
    assert environ == {"A": "1", "C": "3"}
    (record,) = caplog.records
    assert record.exc_info is not None and "str -> str" in str(record.exc_info[1])


def test_drain_is_optional() -> None:
    """A plugin without drain() is skipped by the drain step."""
    class NoDrain:
        def after_rendezvous(self, info: RendezvousInfo) -> Mapping[str, str]:
            return {}

        def before_exit(self, *, timeout: float) -> None:
            pass

    plugins.drain([NoDrain()])
