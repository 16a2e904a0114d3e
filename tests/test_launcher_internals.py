"""Pins the private torch internals the launcher relies on, and the agent's own machinery.

If one of these fails after a torch upgrade, eventbus.app.launcher.agent needs attention
before anything else: the end-to-end tests would fail in less obvious ways.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from torch.distributed.elastic.agent.server import api as agent_api
from torch.distributed.elastic.agent.server import local_elastic_agent
from torch.distributed.elastic.events import handlers
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.distributed.elastic.rendezvous import dynamic_rendezvous
from torch.distributed.launcher import api as launcher_api

import eventbus
from eventbus import Decision
from eventbus.app.launcher.agent import _ERROR_FILE_ERRORS
from eventbus.app.launcher.agent import RELIABLE_RESTARTS_ENV
from eventbus.app.launcher.agent import EventAgent
from eventbus.app.launcher.agent import event_agent
from eventbus.app.launcher.group.processes import peek_exit
from eventbus.subscribers.jsonl import read_jsonl
from tests.conftest import keep_agent_environment
from tests.launcher_helpers import ROOT
from tests.launcher_helpers import run_command

HOOKED = {
    # method: its parameters after self, as the agent calls/overrides them
    "run": ["role"],
    "_rendezvous": ["worker_group"],
    "_start_workers": ["worker_group"],
    "_monitor_workers": ["worker_group"],
    "_restart_workers": ["worker_group"],
}


@pytest.mark.parametrize("name", sorted(HOOKED))
def test_hooked_agent_methods_exist_with_the_same_signature(name: str) -> None:
    """Each method EventAgent overrides exists on LocalElasticAgent with the same params."""
    method = getattr(local_elastic_agent.LocalElasticAgent, name)
    params = [p for p in inspect.signature(method).parameters if p != "self"]
    assert params == HOOKED[name], f"torch changed {name}{inspect.signature(method)}"


def test_monitor_loop_uses_remaining_restarts_and_restart_workers() -> None:
    """STOP works by zeroing _remaining_restarts, which _invoke_run reads before each
    restart; WORKER_RESTART hooks _restart_workers, which _invoke_run calls."""
    source = inspect.getsource(agent_api.SimpleElasticAgent._invoke_run)
    assert "self._remaining_restarts > 0" in source
    assert "self._restart_workers(self._worker_group)" in source
    assert "self._monitor_workers(self._worker_group)" in source
    assert "_remaining_restarts" in inspect.getsource(agent_api.SimpleElasticAgent.__init__)
    start = inspect.getsource(local_elastic_agent.LocalElasticAgent._start_workers)
    assert "restart_count = spec.max_restarts - self._remaining_restarts" in start
    assert "self._pcontext = start_processes(" in start


def test_launch_agent_builds_the_agent_by_its_module_level_name() -> None:
    """event_agent() swaps torch.distributed.launcher.api.LocalElasticAgent, the name
    launch_agent() constructs; and restores it afterwards."""
    assert "LocalElasticAgent" in launcher_api.launch_agent.__code__.co_names
    original = launcher_api.LocalElasticAgent  # type: ignore[attr-defined]
    with event_agent() as built:
        swapped = launcher_api.LocalElasticAgent  # type: ignore[attr-defined]
        assert issubclass(swapped, EventAgent) and built == []
    assert launcher_api.LocalElasticAgent is original  # type: ignore[attr-defined]


def test_process_failure_and_event_destinations_keep_their_shape() -> None:
    """ProcessFailure(local_rank, pid, exitcode, error_file) and the handler registry."""
    failure = ProcessFailure(local_rank=1, pid=123, exitcode=-9, error_file="<N/A>")
    assert failure.signal_name() == "SIGKILL" and failure.error_file == "<N/A>"
    assert isinstance(handlers._log_handlers, dict) and "null" in handlers._log_handlers


def test_reliable_restarts_switch_is_read_by_the_c10d_handler() -> None:
    """The env var the agent sets is the one torch's dynamic rendezvous reads."""
    source = inspect.getsource(dynamic_rendezvous.DynamicRendezvousHandler)
    assert f'"{RELIABLE_RESTARTS_ENV}"' in source


def test_peek_reads_an_exit_without_reaping_it() -> None:
    """waitid(WNOWAIT) sees a child's exit code and signal; Popen still reaps them."""
    exits = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    sleeps = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert peek_exit(sleeps.pid) is None
        deadline = time.monotonic() + 30
        while peek_exit(exits.pid) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert peek_exit(exits.pid) == 3
        assert exits.wait(10) == 3  # not reaped by the peek
        sleeps.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 30
        while peek_exit(sleeps.pid) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert peek_exit(sleeps.pid) == -signal.SIGKILL
        assert sleeps.wait(10) == -signal.SIGKILL
        assert peek_exit(exits.pid) is None  # reaped: unknown, not an error
    finally:
        sleeps.kill()
        sleeps.wait(10)


def _fake_distribution(root: Path, entry_points: str, module: str) -> None:
    """A distribution installed in ``root`` as importlib.metadata finds real ones."""
    info = root / "eventbus_test_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: eventbus-test-plugin\n"
                                   "Version: 1.0\n")
    (info / "entry_points.txt").write_text(entry_points)
    (root / "eventbus_test_plugin.py").write_text(module)


def test_plugins_are_found_through_entry_points(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    """An installed distribution's `eventbus.agent_plugins` entry point becomes an agent
    plugin (its factory called without arguments); one that fails to load is reported by
    name and skipped, never fatal; default_plugins() is the store transport plus those."""
    from eventbus.app.launcher.agent import default_plugins
    from eventbus.app.launcher.transport.store import StoreTransport
    from eventbus.app.plugins import PLUGIN_ENTRY_POINT_GROUP
    from eventbus.app.plugins import entry_point_plugins

    _fake_distribution(
        tmp_path,
        f"[{PLUGIN_ENTRY_POINT_GROUP}]\ngood = eventbus_test_plugin:Plugin\n"
        "broken = eventbus_test_plugin:Missing\n",
        "class Plugin:\n"
        "    def after_rendezvous(self, info):\n        return {}\n"
        "    def before_exit(self, *, timeout):\n        pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with caplog.at_level("ERROR", logger="eventbus"):
        plugins = entry_point_plugins()
    assert [type(p).__name__ for p in plugins] == ["Plugin"]
    assert "'broken'" in caplog.text and "eventbus_test_plugin:Missing" in caplog.text
    defaults = default_plugins()
    assert isinstance(defaults[0], StoreTransport)
    assert [type(p).__name__ for p in defaults[1:]] == ["NoticeBoard", "Plugin"]


_PLUGIN_LAUNCHER = '''
import json, sys
from torch.distributed import TCPStore
from eventbus.app.launcher import main
from eventbus.app.launcher.agent import default_plugins

class Plugin:
    def __init__(self):
        self.log = open(sys.argv[1], "a")
    def after_rendezvous(self, info):
        # The store must be reachable with a client of our own and outlive restarts.
        client = TCPStore(info.store_host, info.store_port, is_master=False,
                          use_libuv=True, timeout=__import__("datetime").timedelta(seconds=30))
        client.set(f"plugin/{info.run_id}/{info.restart_count}", "seen")
        earlier = [client.check([f"plugin/{info.run_id}/{a}"])
                   for a in range(info.restart_count)]
        self.info = info
        self.log.write(json.dumps({"attempt": info.restart_count, "port": info.store_port,
                                   "ranks": list(info.global_ranks), "earlier": earlier,
                                   "world": info.world_size, "nodes": info.group_world_size,
                                   "bus": info.bus.name}) + "\\n")
        self.log.flush()
        return {"EVENTBUS_TEST_PLUGIN": f"attempt-{info.restart_count}"}
    def before_exit(self, *, timeout):
        # the agent moved its heap out of the collector's way after the first rendezvous
        frozen = __import__("gc").get_freeze_count() > 0
        self.log.write(json.dumps({"exit": timeout, "frozen": frozen}) + "\\n")
        self.log.close()
    def drain(self, *, timeout):
        # stands for "what the failed worker sent before it died"
        self.info.bus.record("METRIC", data={"drained_within": timeout})

sys.exit(main(sys.argv[2:], plugins=[*default_plugins(), Plugin()]))
'''


@pytest.mark.slow  # a real 2-worker job with a restart
def test_agent_plugin_sees_every_rendezvous_and_feeds_worker_env(tmp_path: Path) -> None:
    """A plugin passed to the launcher gets the long-lived store after each rendezvous
    (reachable, keys kept across the restart), its env vars reach that attempt's workers,
    its drain runs before a failure is published, and before_exit runs once at the end,
    with the agent's heap frozen out of the collector's way."""
    log = tmp_path / "plugin.jsonl"
    out = tmp_path / "out"
    out.mkdir()
    job = ROOT / "tests" / "jobs" / "gloo_fail_once.py"
    done = run_command(
        [sys.executable, "-c", _PLUGIN_LAUNCHER, str(log),
         "--events-jsonl", str(tmp_path / "events.jsonl"), "--standalone",
         "--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.1",
         str(job), "--out", str(out), "--env-var", "EVENTBUS_TEST_PLUGIN"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    import json

    entries = [json.loads(line) for line in log.read_text().splitlines()]
    assert [e.get("attempt") for e in entries[:2]] == [0, 1]
    assert entries[0]["ranks"] == [0, 1] and entries[0]["world"] == 2
    assert entries[0]["nodes"] == 1 and entries[0]["bus"] == "default"
    assert entries[0]["port"] > 0 and entries[1]["port"] == entries[0]["port"]
    assert entries[1]["earlier"] == [True]
    assert entries[2:] == [{"exit": 5.0, "frozen": True}]
    kinds = [(e["type"], e.get("exit_code")) for e in read_jsonl(tmp_path / "events.jsonl")
             if e["type"] in ("METRIC", "WORKER_EXIT")]
    assert kinds.index(("METRIC", None)) < kinds.index(("WORKER_EXIT", 3))
    for attempt in (0, 1):
        for rank in (0, 1):
            env_seen = (out / f"attempt{attempt}_rank{rank}.env").read_text()
            assert env_seen == f"attempt-{attempt}"


@pytest.mark.slow  # a real 2-worker job through torch's elastic_launch
@pytest.mark.parametrize("peek", [True, False], ids=["peek", "no-waitid"])
def test_event_agent_python_api_with_elastic_launch(tmp_path: Path, peek: bool,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """event_agent() + torch's own elastic_launch: the reactor gets the typed WorkerExit on
    the given bus and its STOP fails the launch with restarts left; without the waitid peek
    the failure comes from torch's result and the survivor it stopped is not mistaken for
    a failure of its own."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig
    from torch.distributed.launcher.api import elastic_launch

    import eventbus
    import eventbus.testing
    from eventbus import Bus
    from eventbus import Decision
    from eventbus import WorkerExit
    from eventbus.context import _holder

    if not peek:
        monkeypatch.setattr("eventbus.app.launcher.agent.peek_exit", lambda pid: None)
    keep_agent_environment(monkeypatch)  # the in-process agents export their workers' settings
    monkeypatch.setenv(RELIABLE_RESTARTS_ENV, "1")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    saved_context = _holder.value
    bus = Bus("python-api")
    seen: list[WorkerExit] = []

    def reactor(event: WorkerExit) -> Decision:
        seen.append(event)
        return Decision.STOP

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, run_id="api-test",
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0",
                          max_restarts=2, monitor_interval=0.1,
                          logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path / "logs")))
    out = tmp_path / "out"
    out.mkdir()
    job = str(ROOT / "tests" / "jobs" / "gloo_fail_once.py")
    try:
        with eventbus.testing.capture_events(bus=bus) as events, \
                event_agent(bus=bus, reactors=[reactor]) as agents, \
                pytest.raises(ChildFailedError):
            elastic_launch(config, sys.executable)("-u", job, "--out", str(out))
    finally:
        _holder.value = saved_context
    assert len(agents) == 1 and agents[0].attempt == 0
    assert [(e.worker_id, e.exit_code) for e in seen][:1] == [(1, 3)]
    for event in seen[1:]:  # the survivor may crash on its own (gloo: peer gone)
        assert event.worker_id == 0 and event.exit_code != -signal.SIGTERM
    for event in events:
        if isinstance(event, WorkerExit) and event.exit_code == -signal.SIGTERM:
            assert event.data.get("stopped_by_agent") is True
    assert isinstance(seen[0], WorkerExit) and seen[0].context.run_id == "api-test"
    assert not list(out.glob("attempt1_*"))
    # torch's event registry is given back: no bridge left behind in this process
    assert handlers._log_handlers.get("eventbus-agent") is None
    assert isinstance(handlers._log_handlers["dynamic_rendezvous"], logging.NullHandler)
    # (torch's rendezvous records of the shutdown may follow AGENT_EXIT)
    types = [str(e.type) for e in events if str(e.type) != "TORCHELASTIC"]
    assert types[0] == "AGENT_START" and types[-1] == "AGENT_EXIT"
    assert "WORKER_RESTART" not in types


def test_torch_raises_on_a_torn_error_file(tmp_path: Path) -> None:
    """Pin: torch's ProcessFailure raises (JSONDecodeError) on an error file cut by a kill,
    and that error is one the agent's monitor catches to rebuild the failure itself."""
    torn = tmp_path / "error.json"
    torn.write_text('{"message": {"message": "RuntimeError: conn')
    with pytest.raises(_ERROR_FILE_ERRORS):
        ProcessFailure(local_rank=0, pid=1, exitcode=-15, error_file=str(torn))


def test_stop_reason_survives_an_error_raised_on_the_way_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A reactor STOPs, then torch's run raises (as it did on a torn error file): AGENT_EXIT
    still carries --stop-exit-code and the STOP's reason, the error named after it."""
    keep_agent_environment(monkeypatch)
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

    class RaisesAfterStop(EventAgent):
        def _invoke_run(self, role: str = "default") -> agent_api.RunResult:
            self._decide([eventbus.WorkerExit(worker_id=1, exit_code=3)])
            raise json.JSONDecodeError("Expecting value", "", 0)

    handler = StaticTCPRendezvous("localhost", 0, 0, 1, "run-stop", 5)
    spec = agent_api.WorkerSpec(role="default", local_world_size=1, rdzv_handler=handler,
                                entrypoint="true", max_restarts=2)
    bus = eventbus.Bus("stop-reason")
    exits: list[eventbus.Event] = []
    bus.subscribe(eventbus.EventType.AGENT_EXIT, on_event=exits.append)
    agent = RaisesAfterStop(spec, DefaultLogsSpecs(log_dir=os.devnull), bus=bus, plugins=[],
                            torch_records=False, reactors=[lambda event: Decision.STOP],
                            stop_exit_code=7)
    with pytest.raises(json.JSONDecodeError):
        agent.run()
    (agent_exit,) = exits
    assert isinstance(agent_exit, eventbus.AgentExit)
    assert agent_exit.exit_code == 7 and agent_exit.state == "FAILED"
    assert agent_exit.reason is not None
    assert agent_exit.reason.startswith("rank 1 failed (exit code 3); STOP from ")
    assert "JSONDecodeError" in agent_exit.reason


def test_an_agent_about_to_restart_sees_a_stop_set_during_its_grace() -> None:
    """Another node's STOP set while this node is about to restart (its workers lost their
    peers to that STOP) is seen within RESTART_GRACE_S, and acknowledged; with no STOP,
    wait_remote gives up after its timeout (under load, a node used to restart once
    before its 0.5 s poll saw the key: tests/reliability/test_job_health.py)."""
    import datetime
    import threading

    from torch.distributed import TCPStore

    from eventbus.app.launcher.drain.stop_signal import RESTART_GRACE_S
    from eventbus.app.launcher.drain.stop_signal import StopSignal

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=10))
    signal_ = StopSignal(host="127.0.0.1", port=store.port, run_id="grace", group_rank=0,
                         group_world_size=2)
    try:
        assert signal_.wait_remote(0.2) is None
        setter = threading.Timer(0.3, store.set, args=(signal_.key, b"rank 3 exited 3"))
        setter.start()
        assert signal_.wait_remote(RESTART_GRACE_S * 5) == "rank 3 exited 3"
        setter.join(5)
        assert store.check([f"{signal_.key}/ack/0"])  # the STOP node's wait ends
    finally:
        signal_.close()
