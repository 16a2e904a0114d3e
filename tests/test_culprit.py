"""The culprit analysis (eventbus_app/health/culprit.py) on synthetic heartbeats, and the
health watches fed WORKER_PROGRESS heartbeats (eventbus_app/health/watches.py): progress
only when a heartbeat advanced, silence from idle_s, auto learning from the reported
intervals, and the straggler found from compute time in lock-step training."""

from __future__ import annotations

import time
from typing import Any

import pytest

import eventbus
from eventbus import JobContext
from eventbus.app.health import culprit
from eventbus.app.health import watches
from eventbus.app.launcher.cli import options


def _beat(rank: int, *, enq: int, comp: int, idle_s: float = 0.0, step: int | None = None,
          pending: dict[str, Any] | None = None, where: str | None = None,
          ranks: tuple[int, ...] = (0, 1), attempt: int = 0, **data: Any
          ) -> eventbus.WorkerProgress:
    payload: dict[str, Any] = {"pgs": {"0": {"enqueued": enq, "completed": comp,
                                             "ranks": list(ranks), "name": "0"}}, **data}
    if pending is not None:
        payload["pending"] = {"0": pending}
    if where is not None:
        payload["where"] = where
    return eventbus.WorkerProgress(worker_id=rank, step=step, collectives=comp, idle_s=idle_s,
                                   data=payload,
                                   context=JobContext(rank=rank, restart_count=attempt))


def _pending(seq: int, op: str = "all_reduce", sizes: Any = None,
             dtypes: Any = None) -> dict[str, Any]:
    return {"seq": seq, "op": op, "sizes": sizes if sizes is not None else [[337]],
            "dtypes": dtypes if dtypes is not None else ["Float"], "state": "scheduled"}


def _progress(*beats: eventbus.WorkerProgress, age_s: float = 0.0
              ) -> list[culprit.RankProgress]:
    out = [culprit.progress_of(b, age_s=age_s) for b in beats]
    assert all(p is not None for p in out)
    return [p for p in out if p is not None]


def test_the_rank_that_has_not_entered_the_collective_is_the_culprit() -> None:
    """Rank 0 waits in all_reduce #26; rank 1 is still at #25: rank 1 is named, rank 0
    waits, and the sentence says who, which collective, how long, and where."""
    found = culprit.analyze(_progress(
        _beat(0, enq=26, comp=25, idle_s=5.0, pending=_pending(26)),
        _beat(1, enq=25, comp=25, idle_s=5.0, where="plain_train.py:18 in spin"), age_s=0.2))
    assert found.culprit_ranks == (1,) and found.waiting_ranks == (0,)
    assert not found.mismatch
    assert found.collective == culprit.Collective(pg="0", seq=26, op="all_reduce",
                                                  sizes=[[337]], dtypes=["Float"])
    assert found.diagnosis == ("rank 1 has not entered all_reduce #26 of process group 0, "
                               "which rank 0 has waited in for 5.2 s; rank 1 is at "
                               "plain_train.py:18 in spin")


@pytest.mark.parametrize("use_torch", [True, False])
def test_an_op_mismatch_names_the_odd_rank(use_torch: bool) -> None:
    """The same sequence number, all_reduce on rank 0 and broadcast on rank 1: a mismatch,
    decided by torch's flight-recorder analyzer where it is there, by the fields without."""
    found = culprit.analyze(_progress(
        _beat(0, enq=26, comp=25, idle_s=6.0, pending=_pending(26)),
        _beat(1, enq=26, comp=25, idle_s=6.0, pending=_pending(26, "broadcast"),
              where="plain_train.py:70 in main")), use_torch=use_torch)
    assert found.mismatch and found.culprit_ranks == (1,) and found.waiting_ranks == (0,)
    assert found.diagnosis.startswith("collective mismatch at #26 of process group 0: "
                                      "rank 0 is in all_reduce")
    assert "rank 1 is in broadcast" in found.diagnosis
    assert found.matcher == ("torch" if use_torch and culprit.matcher() == "torch"
                             else "builtin")


@pytest.mark.parametrize("use_torch", [True, False])
def test_a_size_or_dtype_mismatch_is_a_mismatch(use_torch: bool) -> None:
    found = culprit.analyze(_progress(
        _beat(0, enq=9, comp=8, pending=_pending(9, sizes=[[337]])),
        _beat(1, enq=9, comp=8, pending=_pending(9, sizes=[[338]]))), use_torch=use_torch)
    assert found.mismatch and found.culprit_ranks == (1,)
    assert "[[338]]" in found.diagnosis
    dtypes = culprit.analyze(_progress(
        _beat(0, enq=9, comp=8, pending=_pending(9)),
        _beat(1, enq=9, comp=8, pending=_pending(9, dtypes=["Double"])),
        _beat(2, enq=9, comp=8, pending=_pending(9), ranks=(0, 1, 2))), use_torch=use_torch)
    assert dtypes.mismatch and dtypes.culprit_ranks == (1,)
    assert dtypes.waiting_ranks == (0, 2)


def test_matching_ranks_in_flight_are_no_stall() -> None:
    """Every rank in the same collective with the same fields (a slow collective, not a
    hang), or every rank done: nobody is named."""
    same = culprit.analyze(_progress(_beat(0, enq=5, comp=4, pending=_pending(5)),
                                     _beat(1, enq=5, comp=4, pending=_pending(5))))
    assert same.culprit_ranks == () and not same.mismatch
    done = culprit.analyze(_progress(_beat(0, enq=5, comp=5), _beat(1, enq=5, comp=5)))
    assert done.culprit_ranks == () and "no rank waits" in done.diagnosis
    assert "cannot be named" in culprit.analyze([]).diagnosis


def test_the_root_culprit_across_process_groups() -> None:
    """Rank 0 waits in group 0 for rank 1; rank 1 waits in sub-group 1 for rank 2, which
    waits nowhere: rank 2 is the culprit, ranks 0 and 1 wait."""
    def beat(rank: int, pgs: dict[str, Any]) -> culprit.RankProgress:
        return culprit.RankProgress(rank=rank, silent_s=4.0, pgs={
            pg: culprit.PgState(*v) for pg, v in pgs.items()})
    found = culprit.analyze([
        beat(0, {"0": (8, 7, (0, 1, 2))}),
        beat(1, {"0": (7, 7, (0, 1, 2)), "1": (3, 2, (1, 2))}),
        beat(2, {"0": (7, 7, (0, 1, 2)), "1": (2, 2, (1, 2))}),
    ])
    assert found.culprit_ranks == (2,) and found.waiting_ranks == (0, 1)
    assert found.diagnosis.startswith("rank 2 has not entered collective #3 of process "
                                      "group 1")


def test_64_ranks_are_analyzed_fast_and_described_compactly() -> None:
    """64 simulated ranks: one culprit, 63 waiting ranks written as ranges; well under
    100 ms (benchmarks/bench_health.py measures it)."""
    beats = [_beat(r, enq=100 if r != 17 else 99, comp=99, idle_s=3.0,
                   pending=_pending(100) if r != 17 else None, ranks=tuple(range(64)))
             for r in range(64)]
    progress = _progress(*beats)
    started = time.perf_counter()
    found = culprit.analyze(progress)
    assert time.perf_counter() - started < 5.0  # a hang guard, not a timing assertion
    assert found.culprit_ranks == (17,) and len(found.waiting_ranks) == 63
    assert "which ranks 0-16, 18-63 have waited in for up to 3.0 s" in found.diagnosis


def test_format_ranks() -> None:
    assert culprit.format_ranks([3]) == "rank 3"
    assert culprit.format_ranks([0, 1]) == "ranks 0, 1"
    assert culprit.format_ranks([0, 1, 2, 5, 7, 8]) == "ranks 0-2, 5, 7, 8"


def test_progress_of_skips_malformed_fields() -> None:
    beat = eventbus.WorkerProgress(worker_id=2, idle_s=1.0, data={
        "pgs": {"0": "junk", "1": {"enqueued": "x", "completed": 3}},
        "pending": {"0": {"op": "gloo:broadcast"}, "1": {"seq": 4, "op": "gloo:all_reduce"}},
        "where": 5})
    prog = culprit.progress_of(beat, age_s=0.5)
    assert prog is not None and prog.silent_s == pytest.approx(1.5)
    assert set(prog.pgs) == {"1"} and prog.pgs["1"].enqueued == -1
    assert set(prog.pending) == {"1"} and prog.pending["1"].op == "all_reduce"
    assert prog.where is None
    assert culprit.progress_of(eventbus.EpochEnd(epoch=1)) is None


# -- the watches fed heartbeats ------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_idle_beats_are_not_progress_and_idle_s_dates_the_silence() -> None:
    """A heartbeat that advanced is progress; an idle beat is not, and its idle_s says
    when the rank last progressed (agent's clock: arrival - idle_s)."""
    clock = Clock()
    watch = watches.StallWatch(5.0, clock=clock)
    watch.observe(_beat(0, enq=10, comp=10))
    clock.now += 2
    watch.observe(_beat(0, enq=10, comp=10, idle_s=2.0))  # idle
    clock.now += 2
    watch.observe(_beat(0, enq=10, comp=10, idle_s=4.0))  # idle
    assert watch.silent_s(0, 0) == pytest.approx(4.0)
    assert watch.overdue(0, [0]) == []
    clock.now += 1.5
    (stall,) = watch.overdue(0, [0])
    assert stall.silent_s == pytest.approx(5.5)
    # an advanced heartbeat resets the silence to its idle_s
    watch.observe(_beat(0, enq=11, comp=11, idle_s=0.3))
    assert watch.silent_s(0, 0) == pytest.approx(0.3)
    assert watch.beats(0)[0][0].data["pgs"]["0"]["enqueued"] == 11


def test_idle_beats_before_any_progress_start_no_clock() -> None:
    """A slow start (no collective, no step yet) is never a stall; other events still
    count as before."""
    clock = Clock()
    watch = watches.StallWatch(1.0, clock=clock)
    for i in range(5):
        watch.observe(_beat(0, enq=0, comp=0, idle_s=2.0 * i))
        clock.now += 2
    assert watch.overdue(0, [0]) == [] and watch.ranks(0) == []
    assert watch.beats(0)[0][0].idle_s == 8.0  # the analysis still sees it
    watch.observe(_beat(0, enq=1, comp=0, idle_s=0.1))
    assert watch.ranks(0) == [0]


def test_auto_learns_from_the_reported_step_and_collective_intervals() -> None:
    """--stall-timeout auto: 5 x the longest interval, also the heartbeats' step_time_s and
    compute_s + wait_s (progress far apart within one heartbeat window)."""
    clock = Clock()
    watch = watches.StallWatch("auto", auto_floor_s=1.0, clock=clock)
    watch.observe(_beat(0, enq=1, comp=1, step=1, step_time_s=3.0))
    assert watch.timeout_for(0, 0) == pytest.approx(15.0)
    watch.observe(_beat(1, enq=1, comp=1, compute_s=2.0, wait_s=2.5))
    assert watch.timeout_for(0, 1) == pytest.approx(22.5)
    clock.now += 10  # the next progress 10 s later (an advanced heartbeat)
    watch.observe(_beat(1, enq=2, comp=2))
    assert watch.timeout_for(0, 1) == pytest.approx(50.0)


def _lockstep(watch: watches.StragglerWatch, compute: dict[int, float], beats: int) -> None:
    for _ in range(beats):
        interval = max(compute.values()) + 0.01
        for rank, c in compute.items():
            watch.observe(_beat(rank, enq=1, comp=1, compute_s=c, wait_s=interval - c))


def test_the_consistently_late_rank_is_the_straggler_from_compute_time() -> None:
    """Lock-step training: both ranks step at the slow one's pace, no step_time_s; the rank
    whose time outside collectives is long gets WORKER_SLOW, its peer none."""
    clock = Clock()
    watch = watches.StragglerWatch(2.0, clock=clock)
    _lockstep(watch, {0: 0.02, 1: 0.27}, beats=5)
    (slow,) = watch.check(0)
    assert slow.rank == 1 and slow.basis == "compute_s" and slow.step is None
    assert slow.step_time_s == pytest.approx(0.27)
    assert slow.median_step_time_s == pytest.approx(0.02)
    assert watch.check(0) == []  # rate-limited


def test_balanced_or_tiny_compute_times_are_never_slow() -> None:
    watch = watches.StragglerWatch(2.0, clock=Clock())
    _lockstep(watch, {0: 0.02, 1: 0.025}, beats=5)
    assert watch.check(0) == []
    tiny = watches.StragglerWatch(2.0, clock=Clock())
    _lockstep(tiny, {0: 0.001, 1: 0.01}, beats=5)  # 10x, but 9 ms: noise
    assert tiny.check(0) == []
    few = watches.StragglerWatch(2.0, clock=Clock())
    _lockstep(few, {0: 0.02, 1: 0.5}, beats=2)  # too few heartbeats to call it consistent
    assert few.check(0) == []


def test_the_observer_feeds_heartbeats_to_both_watches() -> None:
    """The agent's one subscriber hands each heartbeat to the stall watch (both ranks seen)
    and to the straggler watch (the rank with the long compute time is late)."""
    clock = Clock()
    stall, straggler = watches.StallWatch(5.0, clock=clock), watches.StragglerWatch(2.0)
    observe = watches.observer(stall, straggler)
    assert observe is not None
    for _ in range(4):
        for rank, c in ((0, 0.02), (1, 0.3)):
            observe(_beat(rank, enq=1, comp=1, compute_s=c, wait_s=0.01))
    observe(eventbus.Metric(step=None, data={}, context=JobContext(rank=0, restart_count=0)))
    assert stall.ranks(0) == [0, 1] and set(stall.beats(0)) == {0, 1}
    assert [s.rank for s in straggler.check(0)] == [1]


def test_a_rank_whose_script_has_ended_is_never_stalled() -> None:
    """The last heartbeat of a worker whose script returned says so (data['exiting']): a
    slow interpreter exit after it is no stall."""
    clock = Clock()
    watch = watches.StallWatch(2.0, clock=clock)
    watch.observe(_beat(0, enq=39, comp=38))
    watch.observe(_beat(1, enq=50, comp=50, exiting=True))
    clock.now += 10
    assert [s.rank for s in watch.overdue(0, [0, 1])] == [0]


def test_a_rank_whose_heartbeat_does_not_say_is_no_culprit() -> None:
    """A rank that has entered no collective yet (collectives == 0, no groups) holds the
    others up; one whose heartbeat has no groups and no count (recorder off, or its groups
    destroyed at its end) is unknown, never named."""
    waiting = _beat(0, enq=1, comp=0, pending=_pending(1))
    not_yet = eventbus.WorkerProgress(worker_id=1, step=0, collectives=0, idle_s=9.0,
                                      data={"where": "train.py:5 in load"})
    found = culprit.analyze(_progress(waiting, not_yet))
    assert found.culprit_ranks == (1,) and found.waiting_ranks == (0,)
    ended = eventbus.WorkerProgress(worker_id=1, step=60, collectives=None, data={})
    assert culprit.analyze(_progress(waiting, ended)).culprit_ranks == ()


def test_a_rank_whose_process_groups_are_gone_is_ending() -> None:
    clock = Clock()
    watch = watches.StallWatch(2.0, clock=clock)
    watch.observe(_beat(1, enq=50, comp=50))
    watch.observe(eventbus.WorkerProgress(worker_id=1, step=60, collectives=None, data={},
                                          context=JobContext(rank=1, restart_count=0)))
    clock.now += 10
    assert watch.overdue(0, [1]) == []
    assert watch.ended(0) == [1]


def test_the_health_benchmark_times_the_culprit_analysis_of_64_ranks() -> None:
    """benchmarks/bench_health.py's culprit figure runs (its 64 simulated ranks name rank
    17, and a mismatch); no time is asserted here."""
    from benchmarks import bench_health

    figures = bench_health.culprit_cost(repeats=1)
    assert set(figures) == {"analyze, one culprit", "analyze, a mismatch",
                            "progress_of x ranks (the agent's input)"}
    assert all(ms > 0 for ms in figures.values())


def test_the_progress_option_parses_and_refuses_bad_sources() -> None:
    """--progress: off, all, or a comma list of the three sources (canonical order); any
    other word is a usage error naming the option and the valid values."""
    import argparse

    from eventbus.app.launcher.command import build_parser

    assert options.parse_progress("off") == ()
    assert options.parse_progress("all") == options.PROGRESS_SOURCES
    assert options.parse_progress("steps, collectives") == ("collectives", "steps")
    with pytest.raises(argparse.ArgumentTypeError, match="names 'gpu', which is no "):
        options.parse_progress("steps,gpu")
    parser = build_parser()
    assert parser.parse_args(["x.py"]).progress == options.PROGRESS_SOURCES
    assert parser.parse_args(["--progress", "events", "x.py"]).progress == ("events",)


def test_a_bad_progress_value_is_a_usage_error_naming_the_sources(
        capsys: pytest.CaptureFixture[str]) -> None:
    """--progress gpus: exit 2, the option and the valid sources named (in-process)."""
    from eventbus.app.launcher.command import build_parser

    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--progress", "gpus", "x.py"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--progress" in err and "collectives, steps, events" in err


@pytest.mark.slow  # the real command, its torch import included: ~2.5 s on 2 cores
def test_a_bad_progress_value_stops_eventbus_run_naming_the_option() -> None:
    import subprocess
    import sys

    from tests.launcher_helpers import ROOT
    from tests.launcher_helpers import job_env

    done = subprocess.run([sys.executable, "-m", "eventbus", "run", "--progress", "gpus",
                           "x.py"], capture_output=True, text=True, env=job_env(), cwd=ROOT,
                          timeout=120, check=False)
    assert done.returncode == 2
    assert "--progress" in done.stderr and "collectives, steps, events" in done.stderr


def test_members_sent_once_are_remembered_for_the_analysis() -> None:
    """A heartbeat carries a group's members only now and then: the stall watch keeps the
    last it got per rank, and the analysis still finds the member that never entered
    the collective from later heartbeats that carry none."""
    watch = watches.StallWatch(5.0)
    for rank in (0, 1):  # the first beats carry the members
        watch.observe(_beat(rank, enq=10, comp=10, ranks=(0, 1, 2)))
    for rank in (0, 1):  # later ones do not: both ranks wait in #11
        watch.observe(eventbus.WorkerProgress(
            worker_id=rank, collectives=10, idle_s=0.0,
            data={"pgs": {"0": {"enqueued": 11, "completed": 10, "name": "0"}},
                  "pending": {"0": _pending(11)}},
            context=JobContext(rank=rank, restart_count=0)))
    # rank 2 has sent heartbeats but entered no process group yet (still loading data)
    watch.observe(eventbus.WorkerProgress(worker_id=2, collectives=0, idle_s=5.0,
                                          data={"where": "x.py:3"},
                                          context=JobContext(rank=2, restart_count=0)))
    assert dict(watch.members(0, 1)) == {"0": [0, 1, 2]}
    beats = watch.beats(0)
    progress = [culprit.progress_of(b, age_s=age, members=watch.members(0, r))
                for r, (b, age) in beats.items()]
    assert all(p is not None and list(p.pgs["0"].ranks) == [0, 1, 2]
               for p in progress if p is not None and p.rank != 2)
    analysis = culprit.analyze([p for p in progress if p is not None])
    assert analysis.culprit_ranks == (2,)  # named from the members its peers sent once
    bare = culprit.progress_of(beats[1][0])
    assert bare is not None and list(bare.pgs["0"].ranks) == []


def test_peers_median_from_one_sort_equals_the_median_of_the_others() -> None:
    """The straggler rule's peers' median (one sort for every rank) against
    statistics.median of each rank's peers, with ties, odd and even counts."""
    import random
    import statistics

    rng = random.Random(7)
    for n in range(2, 40):
        values = sorted(rng.choice([rng.random(), 0.5, 1.0]) for _ in range(n))
        for i in range(n):
            assert watches._median_without(values, i) == pytest.approx(
                statistics.median(values[:i] + values[i + 1:]))
