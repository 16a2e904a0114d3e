"""eventbus.publishers.torchelastic: torch's own event records reach the bus as typed events."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
from torch.distributed.elastic import events as torch_events
from torch.distributed.elastic.events import handlers as torch_handlers

import eventbus
from eventbus import EventType
from eventbus.publishers import install_torchelastic_bridge
from eventbus.publishers.torchelastic import SOURCE
from eventbus.publishers.torchelastic import TorchelasticBridge
from eventbus.publishers.torchelastic import torchelastic_event
from eventbus.publishers.torchelastic import uninstall_torchelastic_bridge
from eventbus.subscribers.log_handler import EventLoggingHandler
from eventbus.testing import capture_events
from tests.conftest import subprocess_env


@pytest.fixture(autouse=True)
def _restore_torch_registries() -> Iterator[None]:
    """Every test leaves torch's destination registry and events loggers as it found them."""
    handlers = dict(torch_handlers._log_handlers)
    loggers = dict(torch_events._events_loggers)
    yield
    for destination in ("eventbus", "other", "job"):
        uninstall_torchelastic_bridge(destination)
    torch_handlers._log_handlers.clear()
    torch_handlers._log_handlers.update(handlers)
    torch_events._events_loggers.clear()
    torch_events._events_loggers.update(loggers)


def _status(state: str, source: str = "WORKER", *, rank: int | None = 1, exit_code: Any = None,
            raw_error: str | None = None, duration_ms: float | None = None,
            pid: int | None = None) -> torch_events.Event:
    """A torchelastic.worker.status record shaped exactly as torch 2.13's agent builds it
    (SimpleElasticAgent._construct_event): per-worker values in 1-tuples inside a nested
    JSON string."""
    md: dict[str, Any] = {"group_world_size": 1, "entry_point": "python"}
    if source == "WORKER":
        md.update(local_rank=(rank,), role_rank=(rank,), role_world_size=(2,),
                  exit_code=(exit_code,), worker_pid=(pid,))
    metadata = {
        "run_id": "job-1", "global_rank": rank if source == "WORKER" else None,
        "group_rank": 0, "worker_id": "4242" if source == "WORKER" else None,
        "role": "default", "hostname": "node-a", "state": state, "total_run_time": 0,
        "rdzv_backend": "c10d", "raw_error": raw_error, "metadata": json.dumps(md),
        "agent_restarts": 1, "duration_ms": duration_ms,
    }
    return torch_events.Event(f"torchelastic.worker.status.{state}",
                              source=torch_events.EventSource[source], metadata=metadata)


def test_install_registers_a_destination_and_is_idempotent() -> None:
    """install puts one bridge under the destination; calling it again returns that bridge."""
    bridge = install_torchelastic_bridge()
    assert isinstance(bridge, logging.Handler)
    assert torch_handlers.get_logging_handler("eventbus") is bridge
    assert install_torchelastic_bridge() is bridge
    logger = torch_events._get_or_create_logger("eventbus")
    assert logger.handlers.count(bridge) == 1


def test_uninstall_restores_torch_registry() -> None:
    """uninstall removes the destination and gives dynamic_rendezvous its NullHandler back."""
    install_torchelastic_bridge()
    assert uninstall_torchelastic_bridge() is True
    assert "eventbus" not in torch_handlers._log_handlers
    assert isinstance(torch_handlers._log_handlers["dynamic_rendezvous"], logging.NullHandler)
    assert uninstall_torchelastic_bridge() is False


@pytest.mark.parametrize(("destination", "error"), [
    ("console", ValueError), ("null", ValueError), ("dynamic_rendezvous", ValueError),
    ("", ValueError), (3, TypeError),
])
def test_bad_destination_is_refused(destination: Any, error: type[Exception]) -> None:
    """torch's own destination names, empty and non-string names are refused, naming the arg."""
    with pytest.raises(error, match="destination"):
        install_torchelastic_bridge(destination)


def test_worker_start_from_real_record() -> None:
    """torch's record(START) arrives as WORKER_START with the global rank, local rank, pid."""
    install_torchelastic_bridge()
    with capture_events() as got:
        torch_events.record(_status("START", rank=1), "eventbus")
    # what the bridge published (a thread an earlier test left may publish on the default
    # bus meanwhile: CI's fast run caught one event more, once)
    (event,) = [e for e in got if e.data.get("source") == SOURCE]
    assert event.type is EventType.WORKER_START
    assert (event.worker_id, event.worker_local_rank, event.worker_pid) == (1, 1, 4242)
    assert event.data["source"] == SOURCE
    assert event.data["torchelastic_name"] == "torchelastic.worker.status.START"
    assert (event.run_id, event.group_rank, event.restart_count) == ("job-1", 0, 1)
    assert event.world_size == 2


def test_worker_failed_carries_exit_code_rank_and_message() -> None:
    """FAILED -> WORKER_EXIT with the exit code parsed from the nested metadata JSON, a failure."""
    install_torchelastic_bridge()
    error = json.dumps({"message": {"message": "RuntimeError: boom",
                                    "extraInfo": {"timestamp": "1"}}})
    with capture_events(EventType.WORKER_EXIT) as got:
        torch_events.record(_status("FAILED", rank=1, exit_code=3, raw_error=error,
                                    pid=777), "eventbus")
    (event,) = got
    assert (event.worker_id, event.exit_code, event.worker_pid) == (1, 3, 777)
    assert event.message == "RuntimeError: boom"
    assert event.signal is None
    assert event.is_failure


def test_worker_killed_by_signal_names_the_signal() -> None:
    """A negative exit code (torch's signal convention) gives WORKER_EXIT.signal."""
    install_torchelastic_bridge()
    with capture_events(EventType.WORKER_EXIT) as got:
        torch_events.record(_status("FAILED", rank=0, exit_code=-9), "eventbus")
    assert (got[0].exit_code, got[0].signal) == (-9, "SIGKILL")


def test_an_unnamed_signal_is_named_as_the_launcher_names_it() -> None:
    """A signal number with no name gives signal "SIG<n>" (eventbus.signal_name), not None."""
    install_torchelastic_bridge()
    with capture_events(EventType.WORKER_EXIT) as got:
        torch_events.record(_status("FAILED", rank=0, exit_code=-1000), "eventbus")
    assert (got[0].exit_code, got[0].signal) == (-1000, "SIG1000")
    assert got[0].signal == eventbus.signal_name(-1000)


def test_succeeded_and_terminated_workers() -> None:
    """SUCCEEDED -> exit 0 (not a failure); TERMINATED (agent's SIGTERM) -> -15, SIGTERM."""
    install_torchelastic_bridge()
    with capture_events(EventType.WORKER_EXIT) as got:
        torch_events.record(_status("SUCCEEDED", rank=0), "eventbus")
        torch_events.record(_status("TERMINATED", rank=1), "eventbus")
    ok, stopped = got
    assert (ok.worker_id, ok.exit_code, ok.is_failure) == (0, 0, False)
    assert (stopped.worker_id, stopped.exit_code, stopped.signal) == (1, -15, "SIGTERM")
    assert stopped.is_failure


def test_agent_rendezvous_record_becomes_rendezvous_with_duration() -> None:
    """The agent's per-round RENDEZVOUS record -> RENDEZVOUS(SUCCEEDED, duration_s)."""
    install_torchelastic_bridge()
    with capture_events(EventType.RENDEZVOUS) as got:
        torch_events.record(_status("RENDEZVOUS", "AGENT", duration_ms=1500.0), "eventbus")
    (event,) = got
    assert (event.state, event.duration_s, event.is_failure) == ("SUCCEEDED", 1.5, False)


def test_agent_rendezvous_recorded_while_an_exception_propagates_is_failed() -> None:
    """The agent records the round in a finally: a propagating exception marks it FAILED."""
    install_torchelastic_bridge()
    with capture_events(EventType.RENDEZVOUS) as got, pytest.raises(RuntimeError):
        try:
            raise RuntimeError("rendezvous timed out")
        finally:
            torch_events.record(_status("RENDEZVOUS", "AGENT", duration_ms=10.0),
                                "eventbus")
    (event,) = got
    assert event.state == "FAILED"
    assert event.message == "RuntimeError: rendezvous timed out"
    assert event.is_failure


def test_agent_failed_record_becomes_agent_exit_and_succeeded_stays_generic() -> None:
    """Agent FAILED (run() raised) -> AGENT_EXIT(FAILED); agent SUCCEEDED (run() returned,
    whatever the workers did) stays a TORCHELASTIC record."""
    install_torchelastic_bridge()
    tb = "Traceback (most recent call last):\n  File \"x\", line 1\nRendezvousError: bad\n"
    with capture_events() as got:
        torch_events.record(_status("SUCCEEDED", "AGENT"), "eventbus")
        torch_events.record(_status("FAILED", "AGENT", raw_error=tb), "eventbus")
    returned, failed = got
    assert (returned.type, returned.name, returned.source) == (
        EventType.TORCHELASTIC, "torchelastic.worker.status.SUCCEEDED", "AGENT")
    assert (failed.type, failed.state, failed.reason, failed.is_failure) == (
        EventType.AGENT_EXIT, "FAILED", "RendezvousError: bad", True)


def test_unknown_names_are_kept_as_generic_events() -> None:
    """A record with no typed counterpart arrives as TORCHELASTIC with its metadata, not lost."""
    install_torchelastic_bridge()
    with capture_events() as got:
        torch_events.record(torch_events.Event("my.custom", torch_events.EventSource.WORKER,
                                               metadata={"k": 1, "s": "v"}), "eventbus")
        torch_events.record(_status("ASSIGN_WORKER_RANKS", "AGENT", duration_ms=2.0),
                            "eventbus")
    assert [e.type for e in got] == [EventType.TORCHELASTIC, EventType.TORCHELASTIC]
    custom, assign = got
    assert (custom.name, custom.source, custom.data["k"], custom.data["s"]) == (
        "my.custom", "WORKER", 1, "v")
    assert assign.name == "torchelastic.worker.status.ASSIGN_WORKER_RANKS"
    assert assign.data["duration_ms"] == 2.0


@pytest.mark.parametrize("payload", [
    "not json at all",
    "[1, 2]",
    json.dumps({"name": "torchelastic.worker.status.START", "source": "WORKER",
                "metadata": {"global_rank": "not-a-rank", "metadata": "{broken"}}),
    json.dumps({"name": "torchelastic.worker.status.FAILED", "source": "WORKER",
                "metadata": {"global_rank": 1, "metadata": json.dumps({"exit_code": ["x"]})}}),
    json.dumps({"name": 5, "source": None, "metadata": None}),
])
def test_malformed_records_are_kept_not_raised(payload: str) -> None:
    """Malformed or odd records never raise and still produce an event marked as bridged."""
    event = torchelastic_event(payload)
    assert event.data["source"] == SOURCE
    json.loads(event.to_json())


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20)
_NAMES = st.sampled_from([f"torchelastic.worker.status.{s}" for s in (
    "START", "SUCCEEDED", "FAILED", "TERMINATED", "RENDEZVOUS", "X")]) | st.text()


@settings(max_examples=150, deadline=None)
@given(name=_NAMES, source=st.sampled_from(["WORKER", "AGENT", "", "??"]) | _JSON,
       metadata=st.dictionaries(st.sampled_from(
           ["global_rank", "metadata", "raw_error", "duration_ms", "run_id", "group_rank",
            "agent_restarts", "worker_id", "role"]) | st.text(), _JSON, max_size=6),
       nested=st.dictionaries(st.sampled_from(["local_rank", "exit_code", "worker_pid",
                                               "role_world_size"]), _JSON, max_size=4),
       rdzv=st.booleans())
def test_any_record_shape_converts_without_raising(name: Any, source: Any,
                                                   metadata: dict[str, Any],
                                                   nested: dict[str, Any], rdzv: bool) -> None:
    """Property: whatever torch-shaped JSON arrives, the conversion returns an event that
    encodes, marked as bridged."""
    if "metadata" not in metadata:
        metadata["metadata"] = json.dumps(nested)
    payload: dict[str, Any] = {"name": name, "source": source, "metadata": metadata}
    if rdzv:
        payload["node_state"] = "FAILED" if nested else "RUNNING"
    event = torchelastic_event(json.dumps(payload))
    assert event.data["source"] == SOURCE
    assert json.loads(event.to_json())["type"] == str(event.type)


def test_a_torch_key_named_source_does_not_hide_the_mark() -> None:
    """A record whose metadata has its own "source" keeps it as torch_source."""
    event = torchelastic_event({"name": "x", "source": "AGENT",
                                "metadata": {"source": "mine"}})
    assert (event.data["source"], event.data["torch_source"]) == (SOURCE, "mine")


def test_records_from_many_threads_all_arrive() -> None:
    """4 threads x 200 torch records (the agent and the keep-alive thread record
    concurrently): all 800 published, in each thread's order."""
    bridge = install_torchelastic_bridge()
    got: list[eventbus.Event] = []
    lock = threading.Lock()

    def keep(event: eventbus.Event) -> None:
        with lock:
            got.append(event)

    eventbus.get_default_bus().subscribe(EventType.WORKER_START, on_event=keep)

    def work(t: int) -> None:
        for i in range(200):
            torch_events.record(_status("START", rank=t * 1000 + i), "eventbus")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert bridge.published == 800 and bridge.failed == 0
    for t in range(4):
        ranks = [e.worker_id for e in got if e.worker_id // 1000 == t]
        assert ranks == [t * 1000 + i for i in range(200)]


def test_a_failing_subscriber_or_bus_never_reaches_torch(caplog: pytest.LogCaptureFixture) -> None:
    """Even a strict bus whose subscriber raises: torch's record() returns, the bridge counts it."""
    strict = eventbus.Bus("strict", strict=True)

    def explode(event: eventbus.Event) -> None:
        raise RuntimeError("subscriber bug")

    strict.subscribe(eventbus.ALL, on_event=explode)
    bridge = install_torchelastic_bridge("other", bus=strict)
    with caplog.at_level(logging.ERROR, logger="eventbus"):
        for _ in range(3):
            torch_events.record(_status("START"), "other")  # must not raise
    assert (bridge.published, bridge.failed) == (0, 3)
    reports = [r for r in caplog.records if "torchelastic bridge" in r.getMessage()]
    assert len(reports) == 1  # rate-limited
    assert reports[0].exc_info is not None


def test_install_on_another_bus_than_the_installed_one_is_refused(bus: eventbus.Bus) -> None:
    """A destination publishes on one bus; re-installing it for another bus says so."""
    install_torchelastic_bridge("other", bus=bus)
    with pytest.raises(ValueError, match="already publishes"):
        install_torchelastic_bridge("other", bus=eventbus.Bus("else"))


def test_torch_docstring_style_handler_info_with_event_object() -> None:
    """get_logging_handler(dest).info(event) (torch's docstring usage) logs the dataclass."""
    bridge = install_torchelastic_bridge()
    with capture_events() as got:
        record = logging.LogRecord("x", logging.INFO, "p", 0, _status("START", rank=0), None,
                                   None)
        bridge.handle(record)
    assert got[0].type is EventType.WORKER_START


def test_dynamic_rendezvous_records_are_bridged() -> None:
    """torch's construct_and_record_rdzv_event: FAILED -> RENDEZVOUS(FAILED), others generic."""
    install_torchelastic_bridge()
    with capture_events() as got:
        torch_events.construct_and_record_rdzv_event(
            run_id="job-1", message="join timed out", node_state=torch_events.NodeState.FAILED)
        torch_events.construct_and_record_rdzv_event(
            run_id="job-1", message="heartbeat", node_state=torch_events.NodeState.RUNNING)
    # what other threads of this test process publish meanwhile (a progress watch an
    # earlier test left running beats every 2 s) is not the bridge's
    failed, running = [e for e in got
                       if e.type in (EventType.RENDEZVOUS, EventType.TORCHELASTIC)]
    assert (failed.type, failed.state, failed.message) == (
        EventType.RENDEZVOUS, "FAILED", "join timed out")
    assert failed.run_id == "job-1"
    assert (running.type, running.source, running.data["node_state"]) == (
        EventType.TORCHELASTIC, "dynamic_rendezvous", "RUNNING")


def test_rendezvous_records_can_be_left_off() -> None:
    """rendezvous_records=False keeps torch's NullHandler, so torch builds no such records."""
    install_torchelastic_bridge(rendezvous_records=False)
    assert isinstance(torch_handlers._log_handlers["dynamic_rendezvous"], logging.NullHandler)
    with capture_events() as got:
        torch_events.construct_and_record_rdzv_event(
            run_id="r", message="m", node_state=torch_events.NodeState.FAILED)
    assert got == []


def test_loglevel_warning_does_not_silence_the_bridge() -> None:
    """LOGLEVEL=WARNING drops torch's own event records, but not the bridge's (subprocess)."""
    code = textwrap.dedent("""
        import json
        from torch.distributed.elastic import events
        from eventbus.publishers import install_torchelastic_bridge
        from eventbus.testing import capture_events
        ev = events.Event("torchelastic.worker.status.START", events.EventSource.WORKER,
                          metadata={"global_rank": 0, "metadata": "{}"})
        plain = events._get_or_create_logger("null").isEnabledFor(20)  # torch's own logger
        install_torchelastic_bridge()
        with capture_events() as got:
            events.record(ev, "eventbus")
        print(json.dumps({"plain_enabled": plain, "bridged": [str(e.type) for e in got]}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=subprocess_env(LOGLEVEL="WARNING"), timeout=120, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"plain_enabled": False, "bridged": ["WORKER_START"]}


def test_bridged_events_are_logged_by_the_event_logging_handler(bus: eventbus.Bus) -> None:
    """torch record -> bridge -> bus -> EventLoggingHandler: one ERROR line for a failure."""
    sink = io.StringIO()
    handler = EventLoggingHandler(stream=sink, fmt="%(levelname)s %(message)s")
    handler.attach(bus)
    install_torchelastic_bridge("other", bus=bus)
    torch_events.record(_status("FAILED", rank=1, exit_code=3), "other")
    (line,) = sink.getvalue().splitlines()
    assert line.startswith("ERROR WORKER_EXIT worker_id=1 exit_code=3 ")
    assert '"source": "torchelastic"' in line


def test_bridge_repr_counts() -> None:
    """repr shows the destination and the published/failed counters."""
    bridge = install_torchelastic_bridge()
    torch_events.record(_status("START"), "eventbus")
    assert isinstance(bridge, TorchelasticBridge)
    assert "'eventbus'" in repr(bridge) and "published=1" in repr(bridge)


# -- a real torchrun job -------------------------------------------------------------------

LAUNCHER = """
import json, sys
import eventbus
from eventbus.publishers import get_default_event_publisher, install_torchelastic_bridge
from torch.distributed import run

install_torchelastic_bridge()  # before torchrun parses --event-log-handler eventbus
handler = eventbus.get_logging_handler()
handler.set_stream(sys.stdout)
handler.set_format("LOG %(levelname)s %(message)s")
out = open(sys.argv[1], "w")

def keep(event):
    out.write(json.dumps({"type": str(event.type), "fields": event.fields(),
                          "source": event.data.get("source"),
                          "restart": event.restart_count}) + "\\n")
    out.flush()

get_default_event_publisher().subscribe_all(on_event=keep)
try:
    run.main(sys.argv[2:])
finally:
    out.close()
"""

WORKER = """
import os, sys
rank = int(os.environ["RANK"])
if rank == int(sys.argv[1]):
    sys.exit(int(sys.argv[2]))
"""


def _run_job(tmp_path: Path, fail_rank: int, exit_code: int,
             **env: str) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
    launcher = tmp_path / "launch.py"
    worker = tmp_path / "worker.py"
    launcher.write_text(LAUNCHER)
    worker.write_text(WORKER)
    events_file = tmp_path / "events.jsonl"
    args = [sys.executable, str(launcher), str(events_file),
            "--standalone", "--nproc-per-node", "2", "--max-restarts", "0",
            "--monitor-interval", "0.1", "--event-log-handler", "eventbus",
            str(worker), str(fail_rank), str(exit_code)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=180, check=False,
                          env=subprocess_env(**env), cwd=tmp_path)
    lines = events_file.read_text().splitlines() if events_file.exists() else []
    return proc, [json.loads(line) for line in lines]


@pytest.mark.slow
def test_real_torchrun_job_publishes_typed_events(tmp_path: Path) -> None:
    """torchrun --event-log-handler eventbus: 2 WORKER_START, RENDEZVOUS, 2 WORKER_EXIT(0)."""
    proc, got = _run_job(tmp_path, fail_rank=-1, exit_code=0, LOGLEVEL="WARNING")
    assert proc.returncode == 0, proc.stderr[-3000:]
    kinds = [e["type"] for e in got]
    print("bridged:", kinds)
    assert all(e["source"] == "torchelastic" for e in got)
    assert kinds.count("RENDEZVOUS") >= 1
    starts = sorted(e["fields"]["worker_id"] for e in got if e["type"] == "WORKER_START")
    exits = sorted((e["fields"]["worker_id"], e["fields"]["exit_code"])
                   for e in got if e["type"] == "WORKER_EXIT")
    assert starts == [0, 1]
    assert exits == [(0, 0), (1, 0)]
    assert "AGENT_EXIT" not in kinds  # torch's agent SUCCEEDED record: run() returned
    assert any(e["fields"].get("name") == "torchelastic.worker.status.SUCCEEDED" for e in got)
    assert kinds.index("RENDEZVOUS") < kinds.index("WORKER_START") < kinds.index("WORKER_EXIT")
    # the default logging handler printed the same events, one line each
    logged = [line for line in proc.stdout.splitlines() if line.startswith("LOG ")]
    assert sum(" WORKER_EXIT worker_id=" in line for line in logged) == 2


@pytest.mark.slow
def test_real_torchrun_job_failure_reports_rank_and_exit_code(tmp_path: Path) -> None:
    """Rank 1 exits 3: WORKER_EXIT(1, 3) at ERROR; rank 0 stopped by SIGTERM or done."""
    proc, got = _run_job(tmp_path, fail_rank=1, exit_code=3)
    assert proc.returncode != 0
    exits = {e["fields"]["worker_id"]: e["fields"] for e in got if e["type"] == "WORKER_EXIT"}
    print("worker exits:", exits)
    assert exits[1]["exit_code"] == 3
    assert exits[0]["exit_code"] in (0, -15)  # rank 0 may finish before the agent stops it
    assert exits[0]["exit_code"] == 0 or exits[0]["signal"] == "SIGTERM"
    logged = [line for line in proc.stdout.splitlines() if line.startswith("LOG ")]
    assert any(line.startswith("LOG ERROR WORKER_EXIT worker_id=1 exit_code=3") for line in logged)
