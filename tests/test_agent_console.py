"""The agent's decisions as a person sees them: the reactor contract (Decision values and
None are the only answers) and the one ``eventbus:`` console line per failure, stall,
straggler, restart decision and STOP. A real EventAgent (torch's agent, not started)
decides on real events; its console is the process's real stderr."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

import pytest

pytest.importorskip("torch")

from torch.distributed.elastic.agent.server import api as agent_api

import eventbus
from eventbus import Decision
from eventbus.app.health import stacks
from eventbus.app.launcher.agent import EventAgent
from tests.conftest import keep_agent_environment

SUBSCRIBERS_DIR = stacks.own_roots()[0]

#: a faulthandler dump as a stalled worker writes it: the forwarder's thread, a thread of
#: the script's, then the main thread (faulthandler lists the newest thread first)
STACK = f'''Thread 0x00007f0000000003 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 324 in wait
  File "{SUBSCRIBERS_DIR}queued.py", line 210 in _run
  File "/usr/lib/python3.11/threading.py", line 982 in run
  File "/usr/lib/python3.11/threading.py", line 1045 in _bootstrap_inner
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Thread 0x00007f0000000002 (most recent call first):
  File "/job/loader.py", line 7 in fetch
  File "/usr/lib/python3.11/threading.py", line 982 in run
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007f0000000001 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/distributed/c10d.py", line 2501 in all_reduce
  File "/job/train.py", line 18 in main
  File "/job/train.py", line 30 in <module>
  File "{SUBSCRIBERS_DIR}worker/__init__.py", line 335 in _run_path
  File "<frozen runpy>", line 88 in _run_code
'''


@pytest.fixture(autouse=True)
def _agent_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """EventAgent's _init_health exports EVENTBUS_PROGRESS, TORCH_FR_BUFFER_SIZE, ... for
    its workers: put them back after each test."""
    keep_agent_environment(monkeypatch)


def _agent(reactors: Sequence[Any] = (), *, max_restarts: int = 2) -> EventAgent:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

    handler = StaticTCPRendezvous("localhost", 0, 0, 1, "run-console", 5)
    spec = agent_api.WorkerSpec(role="default", local_world_size=2, rdzv_handler=handler,
                                entrypoint="true", max_restarts=max_restarts)
    # no log folder: DefaultLogsSpecs() would make a torchelastic_* one in $TMPDIR, and
    # these agents start no worker
    return EventAgent(spec, DefaultLogsSpecs(log_dir=os.devnull),
                      bus=eventbus.Bus("console-test"), plugins=[],
                      torch_records=False, reactors=reactors, stop_exit_code=7)


def _failure(rank: int = 1, code: int = 3, **kwargs: Any) -> eventbus.WorkerExit:
    return eventbus.WorkerExit(worker_id=rank, exit_code=code, data={"attempt": 0}, **kwargs)


def _lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("eventbus:")]


# -- the reactor contract --------------------------------------------------------------


@pytest.mark.parametrize("answer", ["stop", "STOP", True, 1, Decision])
def test_an_answer_that_is_no_decision_is_one_reactor_error(
        answer: object, caplog: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A reactor returning the string "stop", True, ...: reported once as a reactor error
    naming what it returned and what is accepted, no traceback, no "raised"; it counts as
    no decision (the job restarts, it does not stop)."""
    def reactor(event: object) -> object:
        return answer

    agent = _agent([reactor])
    with caplog.at_level(logging.ERROR, logger="eventbus"):
        agent._decide([_failure()])
        agent._decide([_failure(rank=0)])
    assert not agent.stopped_by_reactor
    assert agent.reactor_errors == 2
    reports = [r for r in caplog.records if "reactor" in r.getMessage()]
    assert len(reports) == 1, [r.getMessage() for r in reports]  # once per reactor
    (report,) = reports
    text = report.getMessage()
    assert "reactor error" in text and repr(answer)[:40] in text
    assert "eventbus.Decision.STOP, eventbus.Decision.RESTART or None" in text
    assert "raised" not in text and report.exc_info is None
    if answer in ("stop", "STOP"):
        assert "did you mean eventbus.Decision.STOP?" in text
    # the decision line: no STOP, torchrun's policy
    lines = _lines(capsys.readouterr().err)
    assert lines[0] == ("eventbus: rank 1 failed (exit code 3); restarting the group as "
                        "attempt 1 (1 restart left)")


def test_two_instances_of_one_reactor_class_are_reported_each(
        caplog: pytest.LogCaptureFixture) -> None:
    """The once-per-reactor report is per reactor object: two instances of one class
    (same name) answering wrongly are two reports, each still once."""
    class Wrong:
        def __call__(self, event: object) -> object:
            return "stop"

    agent = _agent([Wrong(), Wrong()])
    with caplog.at_level(logging.ERROR, logger="eventbus"):
        agent._decide([_failure()])
        agent._decide([_failure(rank=0)])
    assert agent.reactor_errors == 4
    reports = [r for r in caplog.records if "reactor error" in r.getMessage()]
    assert len(reports) == 2, [r.getMessage() for r in reports]


@pytest.mark.parametrize(("answer", "stops"), [(Decision.STOP, True),
                                               (Decision.RESTART, False), (None, False)])
def test_decisions_and_none_are_the_answers(answer: Decision | None, stops: bool,
                                            caplog: pytest.LogCaptureFixture) -> None:
    """Decision.STOP, Decision.RESTART and None are accepted without a report."""
    agent = _agent([lambda event: answer])
    with caplog.at_level(logging.WARNING, logger="eventbus"):
        agent._decide([_failure()])
    assert agent.stopped_by_reactor is stops
    assert agent.reactor_errors == 0
    assert not [r for r in caplog.records if "reactor" in r.getMessage()]


def test_a_reactor_that_raises_is_logged_with_its_traceback(
        caplog: pytest.LogCaptureFixture) -> None:
    """Raising is the one case logged as "raised", with the traceback; no decision."""
    def broken(event: object) -> Decision:
        raise RuntimeError("reactor bug")

    agent = _agent([broken])
    with caplog.at_level(logging.ERROR, logger="eventbus"):
        agent._decide([_failure()])
    (report,) = [r for r in caplog.records if "raised" in r.getMessage()]
    assert report.exc_info is not None and "reactor bug" in str(report.exc_info[1])
    assert agent.reactor_errors == 1 and not agent.stopped_by_reactor


# -- the console lines -----------------------------------------------------------------


def test_stop_line_names_the_culprit_and_the_reactor(
        capsys: pytest.CaptureFixture[str]) -> None:
    """One line: the failed rank, its message, the STOP and who sent it."""
    def fatal(event: object) -> Decision:
        return Decision.STOP

    agent = _agent([fatal])
    agent._decide([_failure(message="Traceback (most recent call last):\n  File ...\n"
                                    "torch.OutOfMemoryError: CUDA out of memory")])
    (line,) = _lines(capsys.readouterr().err)
    assert line.startswith("eventbus: rank 1 failed (exit code 3: torch.OutOfMemoryError: "
                           "CUDA out of memory); STOP from ")
    assert "fatal: stopping the job (exit code 7; 2 restarts left unused)" in line


def test_restart_lines_count_the_restarts_down(capsys: pytest.CaptureFixture[str]) -> None:
    """A reactor's RESTART is named; with none left the line says the job fails."""
    agent = _agent([lambda event: Decision.RESTART], max_restarts=1)
    agent._decide([_failure(signal="SIGKILL", code=-9)])
    (line,) = _lines(capsys.readouterr().err)
    assert line.startswith("eventbus: rank 1 failed (signal SIGKILL); RESTART from ")
    assert line.endswith("restarting the group as attempt 1 (0 restarts left)")
    agent._remaining_restarts = 0  # what torch's loop did for that restart
    agent._decide([_failure()])
    (line,) = _lines(capsys.readouterr().err)
    assert line.endswith("but no restart is left (--max-restarts 1): the job fails")


def test_no_reactor_no_restart_left(capsys: pytest.CaptureFixture[str]) -> None:
    """Two failures, no restart left: both ranks' sentences, then "the job fails"."""
    agent = _agent(max_restarts=0)
    agent._decide([_failure(), _failure(rank=2, code=-9, signal="SIGKILL")])
    (line,) = _lines(capsys.readouterr().err)
    assert line == ("eventbus: rank 1 failed (exit code 3); rank 2 failed (signal SIGKILL); "
                    "no restart is left (--max-restarts 0): the job fails")


def test_stall_line_then_its_stack_main_thread_first(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A stall: one eventbus: line with where the rank is, then its stack on several
    lines: the main thread first, the script's other thread, eventbus's thread last and
    marked, with its top frame only."""
    agent = _agent()
    stall = eventbus.WorkerStalled(worker_id=1, silent_s=5.23, timeout_s=5.0,
                                   data={"attempt": 0, "stack": STACK})
    agent._decide([stall])
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert lines[0] == ("eventbus: rank 1 stalled for 5.2 s (train.py:18); restarting the "
                        "group as attempt 1 (1 restart left)")
    assert _lines(err) == [lines[0]]
    body = "\n".join(lines[1:])
    main = body.index("Current thread 0x00007f0000000001")
    loader = body.index("Thread 0x00007f0000000002")
    own = body.index(f"Thread 0x00007f0000000003 (most recent call first): "
                     f"{stacks.EVENTBUS_MARK}")
    assert main < loader < own
    assert 'File "/job/train.py", line 18 in main' in body
    # eventbus's thread: the frame that tells which one it is, not threading's wait
    marked = body.split(stacks.EVENTBUS_MARK)[1]
    assert 'queued.py", line 210 in _run' in marked and "in wait" not in marked
    assert "... 4 more frames" in marked
    # the main thread ends at the script's <module>: the bootstrap's frames are left out
    assert "_run_path" not in body and "frozen runpy" not in body
    assert all(line.startswith("    ") or not line for line in lines[1:])


def test_stall_line_prefers_the_workers_where_and_diagnosis(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A stall's line names the worker's own data["where"], and its diagnosis follows."""
    agent = _agent()
    agent._decide([eventbus.WorkerStalled(
        worker_id=3, silent_s=61.0, data={"where": "model.py:7 in forward",
                                          "diagnosis": "rank 3 never entered all_reduce #5"})])
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("eventbus: rank 3 stalled for 61.0 s (model.py:7 in forward); ")
    assert lines[1] == "    rank 3 never entered all_reduce #5"


def test_straggler_line(capsys: pytest.CaptureFixture[str]) -> None:
    """WORKER_SLOW published by the agent prints its line; one forwarded from elsewhere
    (another process's context) does not."""
    agent = _agent()
    agent.bus.publish(eventbus.WorkerSlow(worker_id=2, factor=2.6, step_time_s=0.41,
                                          median_step_time_s=0.16, step=120))
    other = eventbus.JobContext(pid=1)
    agent.bus.publish(eventbus.WorkerSlow(worker_id=5, factor=3.0, step_time_s=0.3,
                                          median_step_time_s=0.1, context=other))
    (line,) = _lines(capsys.readouterr().err)
    assert line == ("eventbus: rank 2 is slow at step 120: step time 0.41 s, 2.6 x its "
                    "peers' median 0.16 s (reported only; no restart)")


def test_a_restart_through_the_rendezvous_names_no_cause_it_cannot_know(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A restart that reaches this node through the rendezvous (no failure of its own):
    another node restarted the group or nodes joined; the line says so neutrally, and the
    WORKER_RESTART reason too. (torch's own restart, which stops and re-forms the group,
    is left out here.)"""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from eventbus.app.launcher import agent as agent_module

    monkeypatch.setattr(LocalElasticAgent, "_restart_workers", lambda self, group: None)
    monkeypatch.setattr(agent_module, "set_context", lambda **kwargs: None)
    agent = _agent()
    restarts: list[eventbus.Event] = []
    agent.bus.subscribe(eventbus.EventType.WORKER_RESTART, on_event=restarts.append)
    agent._restart_workers(agent._worker_group)
    (line,) = _lines(capsys.readouterr().err)
    assert line == ("eventbus: the group re-forms through the rendezvous as attempt 0 "
                    "(another node restarted it, or nodes joined; this uses no restart; "
                    "2 restarts left)")
    assert "new nodes" not in line
    (restart,) = restarts
    assert isinstance(restart, eventbus.WorkerRestart)
    assert restart.reason == "membership change: the group re-forms through the rendezvous"
    assert restart.cause == eventbus.Cause.MEMBERSHIP


def test_straggler_line_names_the_compute_time_basis(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A lock-step straggler (basis compute_s) is judged on its compute time between
    collectives, and its line says so instead of "step time"."""
    agent = _agent()
    agent.bus.publish(eventbus.WorkerSlow(worker_id=1, factor=3.1, step_time_s=0.62,
                                          median_step_time_s=0.2, step=40,
                                          data={"basis": "compute_s"}))
    (line,) = _lines(capsys.readouterr().err)
    assert line == ("eventbus: rank 1 is slow at step 40: compute time between collectives "
                    "0.62 s, 3.1 x its peers' median 0.2 s (reported only; no restart)")


def test_agent_environment_is_put_back() -> None:
    """keep_agent_environment: what an in-process agent exported is gone afterwards."""
    assert "EVENTBUS_PROGRESS" not in os.environ
    with pytest.MonkeyPatch.context() as mp:
        keep_agent_environment(mp)
        _agent()
        assert os.environ["EVENTBUS_PROGRESS"]
    assert "EVENTBUS_PROGRESS" not in os.environ


def test_where_of_skips_torch_and_the_standard_library() -> None:
    """where_of names the script's innermost frame, not torch's nor eventbus's."""
    assert stacks.where_of(STACK) == "train.py:18"
    assert stacks.where_of("no stack: the worker did not answer") is None


#: a heartbeat's stack (eventbus.app.worker.where.format_stacks): traceback's format,
#: innermost call last, with source lines; the main thread first, eventbus's own marked
HEARTBEAT_STACK = f'''Thread 0x7f0000000001 "MainThread" (main), most recent call last:
  File "<frozen runpy>", line 88, in _run_code
  File "{SUBSCRIBERS_DIR}worker/__init__.py", line 335, in _run_path
    exec(code, globals)
  File "/job/train.py", line 30, in <module>
    main()
  File "/job/train.py", line 18, in main
    dist.all_reduce(t)
  File "/venv/lib/python3.11/site-packages/torch/distributed/c10d.py", line 2501, in all_reduce
    work = group.allreduce([tensor], opts)

Thread 0x7f0000000003 "eventbus-progress" (eventbus's own), most recent call last:
  File "/usr/lib/python3.11/threading.py", line 1002, in _bootstrap
    self._bootstrap_inner()
  File "{SUBSCRIBERS_DIR}queued.py", line 210, in _run
    item = self._queue.get()
... (cut)
'''


def test_a_heartbeats_stack_reads_like_a_faulthandler_dump() -> None:
    """A remote culprit's stack comes from its heartbeat in traceback's format: where_of
    finds the script's frame, the main thread comes first with its frames innermost first
    (source lines and the bootstrap left out), eventbus's thread is marked."""
    assert stacks.where_of(HEARTBEAT_STACK) == "train.py:18"
    lines = stacks.stack_lines(HEARTBEAT_STACK)
    assert lines[0] == 'Thread 0x7f0000000001 "MainThread" (main) (most recent call first):'
    assert lines[1].strip().startswith('File "/venv/lib/python3.11/site-packages/torch/')
    assert lines[2:4] == ['  File "/job/train.py", line 18 in main',
                          '  File "/job/train.py", line 30 in <module>']
    assert not any("dist.all_reduce(t)" in line for line in lines)
    own = next(i for i, line in enumerate(lines) if "0x7f0000000003" in line)
    assert lines[own].endswith(stacks.EVENTBUS_MARK) and own > 4
    assert lines[own + 1].endswith("line 210 in _run")
    assert stacks.stack_lines(HEARTBEAT_STACK, full=True)[-1] == "... (cut)"


def test_a_real_heartbeat_stack_names_the_callers_line() -> None:
    """format_stacks() of this very process: where_of names this test's line."""
    import threading

    from eventbus.app.worker import where

    stop = threading.Event()
    helper = threading.Thread(target=stop.wait, name="eventbus-test-thread", daemon=True)
    helper.start()
    try:
        text = where.format_stacks(); line = sys._getframe().f_lineno  # noqa: E702
    finally:
        stop.set()
        helper.join(timeout=5)
    assert stacks.where_of(text) == f"test_agent_console.py:{line}"
    threads = stacks.format_stack(text)
    assert threads[0].is_main
    assert any(t.ident == hex(helper.ident or 0) and stacks.EVENTBUS_MARK in t.header
               for t in threads)


def test_full_stack_keeps_every_frame() -> None:
    """full=True keeps every frame; the short form cuts eventbus's thread to its top."""
    full = stacks.stack_lines(STACK, full=True)
    assert sum(1 for line in full if line.strip().startswith("File ")) == 13
    short = stacks.stack_lines(STACK)
    assert "  ... 4 more frames" in short
