"""The drain's SLURM rules (eventbus/app/launcher/slurm/control.py and drain/slurm.py)
with a fake ``scontrol``/``squeue``: the grace fitted to KillWait and the time limit, the
drain ahead of the time limit, the requeue of a drained job and of a bad host's, and
nothing at all outside SLURM."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from types import SimpleNamespace

import pytest

from eventbus.app.launcher.drain import slurm as drain_slurm
from eventbus.app.launcher.drain.slurm import TIME_LIMIT
from eventbus.app.launcher.drain.slurm import SlurmDrain
from eventbus.app.launcher.drain.state import Drain
from eventbus.app.launcher.slurm import control as sc

END = "2030-01-01T12:00:00"
END_EPOCH = time.mktime(time.strptime(END, "%Y-%m-%dT%H:%M:%S"))


class FakeSlurm:
    """``scontrol`` and ``squeue`` as SLURM 22.05 answers them; every call kept."""

    def __init__(self, *, requeue: str = "1", end: str = END, kill_wait: int = 30,
                 excluded: str = "(null)", fail: Sequence[str] = ()) -> None:
        self.job = {"JobId": "4242", "JobState": "RUNNING", "Requeue": requeue, "EndTime": end,
                    "ExcNodeList": excluded, "RestartCnt": "0"}
        self.kill_wait = kill_wait
        self.fail = set(fail)
        self.calls: list[tuple[str, ...]] = []

    def __call__(self, argv: Sequence[str], timeout: float) -> str:
        call = tuple(argv)
        self.calls.append(call)
        assert timeout == sc.CALL_TIMEOUT_S
        if any(word in self.fail for word in call[:2]):
            raise OSError("failed")
        if call[:3] == ("scontrol", "show", "job"):
            return " ".join(f"{k}={v}" for k, v in self.job.items()) + "\n"
        if call[:3] == ("scontrol", "show", "config"):
            return (f"Configuration data as of 2026-12-05T18:00:00\nKillOnBadExit = 0\n"
                    f"KillWait                = {self.kill_wait} sec\n")
        if call[0] == "squeue":
            return self.job["EndTime"] + "\n"
        if call[:2] in (("scontrol", "requeue"), ("scontrol", "update")):
            return ""
        raise AssertionError(call)


def _slurm(fake: FakeSlurm, **env: str) -> sc.Slurm:
    return sc.Slurm({"SLURM_JOB_ID": "4242", **env}, runner=fake,
                    which=lambda name: f"/usr/bin/{name}", clock=lambda: END_EPOCH - 600)


def test_outside_slurm_nothing_is_asked() -> None:
    fake = FakeSlurm()
    assert not sc.Slurm({}, runner=fake).present()
    assert not sc.Slurm({"SLURM_JOB_ID": "1"}, runner=fake, which=lambda n: None).present()
    assert sc.requeue_after(sc.Slurm({}, runner=fake), drained=True, announced=True,
                            bad_host=None, mode="auto") is None
    assert fake.calls == []


def test_the_answers_are_read() -> None:
    slurm = _slurm(FakeSlurm(kill_wait=45))
    assert slurm.kill_wait() == 45.0
    assert slurm.end_time() == END_EPOCH
    assert slurm.requeueable()
    assert _slurm(FakeSlurm(end="Unknown")).end_time() is None
    assert _slurm(FakeSlurm(), SLURM_RESTART_COUNT="2").restart_count == 2


def test_a_failing_command_is_no_answer() -> None:
    slurm = _slurm(FakeSlurm(fail=["show", "squeue"]))
    assert slurm.kill_wait() is None and slurm.end_time() is None and not slurm.requeueable()


def test_the_grace_fits_killwait_after_sigterm_and_the_time_limit_after_usr1() -> None:
    assert sc.fit_grace(20, "SIGTERM", kill_grace_s=5, kill_wait_s=60,
                        seconds_to_end=None) == (20, None)
    grace, line = sc.fit_grace(20, "SIGTERM", kill_grace_s=5, kill_wait_s=15,
                               seconds_to_end=None)
    assert grace == 15 - 5 - sc.EXIT_MARGIN_S and line is not None
    assert "KillWait (15 s)" in line and "this drain's grace is 7 s" in line
    # SIGUSR1 (--signal=USR1@N): KillWait does not bound it, the job's end does
    assert sc.fit_grace(20, "SIGUSR1", kill_grace_s=5, kill_wait_s=15,
                        seconds_to_end=None) == (20, None)
    grace, line = sc.fit_grace(20, "SIGUSR1", kill_grace_s=5, kill_wait_s=15,
                               seconds_to_end=18)
    assert grace == 10 and line is not None and "time limit" in line
    assert sc.fit_grace(20, "SIGTERM", kill_grace_s=5, kill_wait_s=2,
                        seconds_to_end=None)[0] == 1.0  # at least 1 s


def test_a_drained_job_is_requeued_by_its_announcer_where_slurm_allows_it() -> None:
    fake = FakeSlurm()
    line = sc.requeue_after(_slurm(fake), drained=True, announced=True, bad_host=None,
                            mode="auto", stop_step=407)
    assert line == "job 4242 requeued: it resumes from the checkpoint of step 407"
    assert fake.calls[-1] == ("scontrol", "requeue", "4242")
    for kwargs in ({"announced": False, "mode": "auto"}, {"announced": True, "mode": "off"}):
        other = FakeSlurm()
        assert sc.requeue_after(_slurm(other), drained=True, bad_host=None,
                                **kwargs) is None  # type: ignore[arg-type]
        assert other.calls == []


def test_a_cancelled_job_is_not_requeued() -> None:
    """scancel sends SIGTERM: the job drains, and stays cancelled."""
    fake = FakeSlurm()
    fake.job["JobState"] = "CANCELLED"
    line = sc.requeue_after(_slurm(fake), drained=True, announced=True, bad_host=None,
                            mode="auto")
    assert line == "job 4242 is CANCELLED: not requeued"
    assert all(call[1] != "requeue" for call in fake.calls)


def test_a_drain_with_no_stop_step_is_not_requeued() -> None:
    """Signalled before the first step (no checkpoint): a requeue would only repeat it."""
    fake = FakeSlurm()
    line = sc.requeue_after(_slurm(fake), drained=True, announced=True, bad_host=None,
                            mode="auto", stop_step=None)
    assert line is not None and "agreed no stop step" in line
    assert all(call[1] != "requeue" for call in fake.calls)


def test_a_job_without_requeue_is_not_requeued_and_says_how() -> None:
    fake = FakeSlurm(requeue="0")
    line = sc.requeue_after(_slurm(fake), drained=True, announced=True, bad_host=None,
                            mode="auto", stop_step=5)
    assert line is not None and "sbatch --requeue" in line
    assert all(call[1] != "requeue" for call in fake.calls)


def test_a_bad_host_is_excluded_then_the_job_requeued_within_the_bound() -> None:
    fake = FakeSlurm(excluded="node7")
    line = sc.requeue_after(_slurm(fake), drained=False, announced=False, bad_host="node3",
                            mode="auto")
    assert line is not None and "without node3" in line
    assert ("scontrol", "update", "JobId=4242", "ExcNodeList=node7,node3") in fake.calls
    assert fake.calls[-1] == ("scontrol", "requeue", "4242")
    spent = FakeSlurm()
    line = sc.requeue_after(
        _slurm(spent, SLURM_RESTART_COUNT=str(sc.MAX_BAD_HOST_REQUEUES)), drained=False,
        announced=False, bad_host="node3", mode="auto")
    assert line is not None and "not requeued" in line
    assert all(call[1] not in ("requeue", "update") for call in spent.calls)


def test_parse_requeue_names_the_choices() -> None:
    assert sc.parse_requeue(" Off ") == "off"
    with pytest.raises(ValueError, match="auto or off"):
        sc.parse_requeue("yes")


def test_the_time_limit_drains_the_job_ahead_of_it() -> None:
    """The end 15 s away, grace 10 s, kill grace 5 s (18 s needed with the agents' exit):
    the drain starts at once, as the time limit (never a second signal), with the grace
    that fits (15 - 5 - 3 = 7 s)."""
    fake = FakeSlurm()
    clock = [END_EPOCH - 15]
    slurm = sc.Slurm({"SLURM_JOB_ID": "4242"}, runner=fake, which=lambda n: "/bin/x",
                     clock=lambda: clock[0])
    began = threading.Event()
    drain = Drain(grace_s=10.0, kill_grace_s=5.0, on_begin=lambda d: began.set())
    watch = SlurmDrain(drain, slurm=slurm)
    watch.start()
    try:
        assert began.wait(5.0)
        assert drain.signal == TIME_LIMIT and drain.reason() == "the time limit on this node"
        assert 6.0 <= drain.seconds_left() <= 7.0
    finally:
        watch.close()


def test_no_time_limit_no_drain() -> None:
    drain = Drain(grace_s=10.0)
    watch = SlurmDrain(drain, slurm=_slurm(FakeSlurm(end="Unknown")))
    watch.start()
    assert watch._thread is not None
    watch._thread.join(5.0)
    assert not drain.active and watch.kill_wait_s == 30.0


def _node(store: object, node: int, drain: Drain, fake: FakeSlurm) -> SimpleNamespace:
    """What ``requeue_after_job`` reads of an ``EventAgent``: a drained node's agent with
    its notice board on the real store (two nodes)."""
    from eventbus.app.launcher.drain.notices import NoticeBoard
    from eventbus.app.plugins import RendezvousInfo
    from eventbus.bus import Bus

    board = NoticeBoard()
    board.after_rendezvous(RendezvousInfo(
        store_host="127.0.0.1", store_port=store.port, run_id="4242",  # type: ignore[attr-defined]
        group_rank=node, group_world_size=2, restart_count=0, local_world_size=1,
        world_size=2, global_ranks=(node,), bus=Bus(f"agent{node}")))
    return SimpleNamespace(evicted=False, drain=drain, plugins=[board],
                           draining=SimpleNamespace(announced=node == 0),
                           slurm_drain=SlurmDrain(drain, slurm=_slurm(fake)))


def test_the_requeue_waits_until_every_node_ended_its_drain() -> None:
    """Two nodes on a real TCPStore: the announcing node's agent ends first; its
    ``scontrol requeue`` (which kills every process of the job) comes only once the
    other node recorded its drain's end, 0.3 s later."""
    torch_dist = pytest.importorskip("torch.distributed")
    import datetime

    store = torch_dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                timeout=datetime.timedelta(seconds=10))
    fake = FakeSlurm()
    agents = []
    for node in (0, 1):
        drain = Drain(signals_=(), grace_s=10.0, kill_grace_s=5.0)
        drain.begin("SIGUSR1", origin=0, local=node == 0)
        drain.stop_step = 407
        agents.append(_node(store, node, drain, fake))
    ended: list[float] = []

    def other_node() -> None:
        time.sleep(0.3)
        ended.append(time.monotonic())
        drain_slurm.requeue_after_job([agents[1]])  # not the announcer: no requeue

    thread = threading.Thread(target=other_node)
    thread.start()
    try:
        drain_slurm.requeue_after_job([agents[0]])
        requeued = time.monotonic()
    finally:
        thread.join(5.0)
        for agent in agents:
            agent.plugins[0].before_exit(timeout=1.0)
    assert ended and requeued >= ended[0], (ended, requeued)
    assert [c for c in fake.calls if c[1] == "requeue"] == [("scontrol", "requeue", "4242")]
    assert agents[0].plugins[0].drains_ended() == 2


def test_the_wait_for_the_other_nodes_is_bounded_and_ends_with_the_store() -> None:
    clock = [0.0]
    counts = iter([1, 1, 1, 2])
    assert drain_slurm.wait_for_drains(lambda: next(counts), 2, 5.0, clock=lambda: clock[0],
                                       sleep=lambda s: None) is None
    line = drain_slurm.wait_for_drains(
        lambda: 1, 3, 5.0, clock=lambda: clock[0],
        sleep=lambda s: clock.__setitem__(0, clock[0] + s))
    assert line == ("2 of 3 nodes had not ended their drain within 5 s of this one's "
                    "end: the job is requeued all the same")
    assert 5.0 <= clock[0] <= 5.2, clock
    # the store gone (its host's agent ended): nothing left to wait for
    assert drain_slurm.wait_for_drains(lambda: None, 2, 5.0) is None
