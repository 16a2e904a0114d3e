"""The judge: which ranks are stalled (and who holds them up), which are stragglers, and what
a worker ended by SIGABRT was doing. Torch-free, with an injectable clock: a unit test
drives it with heartbeats alone (tests/test_judge.py).

It reads the watches (:mod:`eventbus.app.health.watches`: what every event told the
agent) and runs the culprit analysis (:mod:`eventbus.app.health.culprit`) over the
ranks' latest heartbeats. The agent asks it once per monitor tick and acts on its verdict
(stacks, flight-recorder dumps, reactors, stopping the group); the rules are in
docs/run.md, "Job health":

* group rank 0 judges the whole job: it sees every node's heartbeats and names the
  culprits; the other agents act on their own ranks only :data:`JUDGE_GRACE_S` after the
  timeout, when group rank 0 has not (its restart normally reaches them first);
* a stall is published for its culprits, never for ranks that only wait on them; a view
  older than a culprit's next heartbeat, or a rank whose heartbeats stopped (its script
  is likely ending), is not judged until the grace ends;
* silence is not enough: a culprit is stalled only when its evidence
  (:mod:`eventbus.app.health.evidence`, from its heartbeats) says it waits: in a collective,
  blocked, spinning, or unresponsive. A busy rank (its stack moves), one that saves,
  loads or compiles is never stalled, and while one is, ranks waiting in a collective
  are not stalled either (they may wait for it). A rank waiting for data is reported
  (``Verdict.report_only``), once per silence, and not restarted unless a reactor asks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import attrs

from eventbus.app.health import culprit
from eventbus.app.health import evidence
from eventbus.app.health.evidence import Evidence
from eventbus.app.health.watches import Stall
from eventbus.app.health.watches import StallWatch
from eventbus.app.health.watches import StragglerWatch
from eventbus.app.heap import no_collection
from eventbus.events import WorkerSlow
from eventbus.events import WorkerStalled

__all__ = [
    "BEATS_STOPPED_S",
    "JUDGE_GRACE_S",
    "SLOW_CHECK_S",
    "Judge",
    "Verdict",
]

logger = logging.getLogger("eventbus")

#: a node other than group rank 0 acts on its own stalled ranks only this many seconds
#: after their timeout (group rank 0 judges the job; its restart normally comes first)
JUDGE_GRACE_S = 15.0
#: a rank whose latest heartbeat is older than this has stopped sending them (its progress
#: thread sends an idle beat every 2 s while it lives): its script is likely ending
BEATS_STOPPED_S = 3.5
#: how often the stragglers are looked for (the monitor ticks faster)
SLOW_CHECK_S = 1.0


@attrs.frozen
class Verdict:
    """A stall found: the culprit analysis, the ranks to report stalled, and every rank of
    the attempt the verdict covers (they are not judged again in the attempt).

    ``evidence``: each stalled rank's. ``report_only``: every stalled rank waits for data
    (reported; no restart unless a reactor asks). ``silences``: each stalled rank's silence
    and timeout when it was judged, the figures ``WORKER_STALLED`` reports (a heartbeat
    that arrives while the stacks are taken dates the last progress by its arrival, a
    transport poll later than it was: the silence read again would be shorter than the
    one the verdict rests on)."""

    analysis: culprit.Analysis
    stalled: tuple[int, ...]
    ranks: tuple[int, ...]
    evidence: Mapping[int, Evidence] = attrs.field(factory=dict)
    report_only: bool = False
    silences: Mapping[int, tuple[float, float]] = attrs.field(factory=dict)


class Judge:
    """Stall and straggler verdicts over the watches, for one agent.

    ``is_judge``: whether this agent judges the whole job (group rank 0, or one node).
    """

    def __init__(self, stall: StallWatch | None, straggler: StragglerWatch | None, *,
                 clock: Callable[[], float] = time.monotonic,
                 judge_grace_s: float = JUDGE_GRACE_S,
                 beats_stopped_s: float = BEATS_STOPPED_S) -> None:
        self.stall = stall
        self.straggler = straggler
        self.judge_grace_s = float(judge_grace_s)
        self.beats_stopped_s = float(beats_stopped_s)
        self._clock = clock
        self._next_slow_check = 0.0
        #: stalled ranks reported, all attempts
        self.stalls = 0
        #: (attempt, rank) -> when the silence began that was reported as waiting for data
        #: (reported once per silence)
        self._data_reported: dict[tuple[int, int], float] = {}

    # -- stalls ----------------------------------------------------------------------------
    def ranks_to_watch(self, attempt: int, live: Iterable[int], *, is_judge: bool) -> set[int]:
        """The ranks a stall may be found among: this node's live ones, and with the job
        view (``is_judge``) every rank whose clock started."""
        ranks = set(live)
        if is_judge and self.stall is not None:
            ranks.update(self.stall.ranks(attempt))
        return ranks

    def overdue(self, attempt: int, ranks: Iterable[int]) -> list[Stall]:
        """The ranks past their timeout, not yet reported (none without a stall watch)."""
        if self.stall is None:
            return []
        with no_collection():
            return self.stall.overdue(attempt, ranks)

    def patient(self, overdue: Sequence[Stall], live: Iterable[int]) -> list[Stall]:
        """For an agent that does not judge the job: the overdue ranks of its own that are
        past the timeout by :data:`JUDGE_GRACE_S` too (group rank 0 did not act)."""
        if not overdue:
            return []
        grace = self.judge_grace_s + max(s.timeout_s for s in overdue)
        own = set(live)
        return [s for s in overdue if s.silent_s > grace and s.rank in own]

    def verdict(self, attempt: int, overdue: Sequence[Stall], *, is_judge: bool,
                ranks: Iterable[int]) -> Verdict | None:
        """The stall, or None when there is none to report yet.

        The ranks to report: the analysis's culprits (when the heartbeats name them), else
        the overdue ranks that wait in no collective, else every overdue rank (the
        collective itself makes no progress). None when every culprit has not started yet
        (a slow start: never a stall, as before the first event), while the view is older
        than a culprit's next heartbeat, or while a rank's heartbeats stopped (within the
        grace). An agent that does not judge (``is_judge`` False) reports only ranks that
        wait in no collective."""
        watch = self.stall
        if watch is None or not overdue:
            return None
        with no_collection():
            found = self._analyze(attempt, overdue, local_only=not is_judge)
            if found is None:
                return None
            analysis, stalled = found
            return self._weigh(attempt, analysis, stalled, tuple(sorted(set(ranks))))

    def evidence_of(self, attempt: int, rank: int) -> Evidence:
        """What ``rank`` is doing by its latest heartbeat (:func:`evidence.classify`)."""
        watch = self.stall
        assert watch is not None
        beat = watch.beat(attempt, rank)
        silent = watch.silent_s(attempt, rank)
        return evidence.classify(
            beat[0].data if beat is not None else None,
            silent_s=silent if silent is not None else 0.0,
            timeout_s=watch.timeout_for(attempt, rank),
            beat_age_s=beat[1] if beat is not None else None,
            beats_stopped_s=self.beats_stopped_s)

    def _weigh(self, attempt: int, analysis: culprit.Analysis, candidates: Sequence[int],
               ranks: tuple[int, ...]) -> Verdict | None:
        """The verdict on the analysis's candidates, by their evidence: those that wait
        (a collective, blocked, spinning, unresponsive) are stalled; those waiting for
        data are reported when no rank stalls; busy, saving, loading and compiling ranks
        never are. A rank waiting in a collective is not stalled while any rank of the
        attempt is busy, saves, loads, compiles or waits for data (it may wait for that
        one)."""
        watch = self.stall
        assert watch is not None
        weighed = {rank: self.evidence_of(attempt, rank) for rank in candidates}
        silences = {rank: (watch.silent_s(attempt, rank) or 0.0,
                           watch.timeout_for(attempt, rank)) for rank in candidates}
        stalling = [r for r in candidates if weighed[r].stalls]
        if any(weighed[r].waiting_on == "collective" for r in stalling) and \
                self._someone_works(attempt, set(watch.beats(attempt)) - set(stalling)):
            stalling = [r for r in stalling if weighed[r].waiting_on != "collective"]
        if stalling:
            return Verdict(analysis, tuple(stalling), ranks,
                           {r: weighed[r] for r in stalling},
                           silences={r: silences[r] for r in stalling})
        waiting = [r for r in candidates if weighed[r].reported
                   and not self._data_seen(attempt, r)]
        if waiting:
            return Verdict(analysis, tuple(waiting), ranks,
                           {r: weighed[r] for r in waiting}, report_only=True,
                           silences={r: silences[r] for r in waiting})
        return None

    def _someone_works(self, attempt: int, others: Iterable[int]) -> bool:
        """Whether any of ``others`` made progress within its timeout, or is busy, saves,
        loads, compiles or waits for data (a rank that just came back from a long
        evaluation has no idle evidence yet: it progresses, so the ranks waiting for it in
        a collective are about to be released)."""
        watch = self.stall
        assert watch is not None
        for rank in others:
            silent = watch.silent_s(attempt, rank)
            if silent is None or silent <= watch.timeout_for(attempt, rank):
                return True
            if not self.evidence_of(attempt, rank).stalls:
                return True
        return False

    def _silence_began(self, attempt: int, rank: int) -> float:
        watch = self.stall
        assert watch is not None
        return self._clock() - (watch.silent_s(attempt, rank) or 0.0)

    def _data_seen(self, attempt: int, rank: int) -> bool:
        """Whether this silence of ``rank`` was already reported as waiting for data."""
        began = self._data_reported.get((attempt, rank))
        return began is not None and abs(began - self._silence_began(attempt, rank)) < 1.0

    def reported(self, attempt: int, verdict: Verdict) -> None:
        """The verdict is published: none of its ranks is judged again in the attempt (a
        report of ranks waiting for data: not in the same silence)."""
        if verdict.report_only:
            for rank in verdict.stalled:
                self._data_reported[(attempt, rank)] = self._silence_began(attempt, rank)
            return
        if self.stall is not None:
            self.stall.mark_reported(attempt, verdict.ranks)
        self.stalls += len(verdict.stalled)

    def _analyze(self, attempt: int, overdue: Sequence[Stall], *,
                 local_only: bool) -> tuple[culprit.Analysis, list[int]] | None:
        watch = self.stall
        assert watch is not None
        beats = watch.beats(attempt)
        members = watch.members
        progress = [p for rank, (beat, age) in beats.items()
                    for p in [culprit.progress_of(beat, age_s=age,
                                                  members=members(attempt, rank))]
                    if p is not None]
        try:
            analysis = culprit.analyze(progress)
        except Exception:  # the analysis must never cost the stall
            logger.exception("eventbus: the culprit analysis failed; reporting the silent "
                             "ranks")
            analysis = culprit.Analysis((), (), None, False,
                                        "the culprit analysis failed (see the agent's log)")
        started = set(watch.ranks(attempt))
        # A rank whose heartbeats stopped (its progress thread ends when the script does;
        # the interpreter's exit may take seconds) is likelier ending than hung: not judged
        # on a view that old until JUDGE_GRACE_S past the timeout (a rank hung in C code
        # that holds the GIL sends no heartbeats either).
        grace = self.judge_grace_s + max(s.timeout_s for s in overdue)
        patient = max(s.silent_s for s in overdue) < grace
        gone = {r for r, (_, age) in beats.items() if age > self.beats_stopped_s}
        if patient and gone:
            return None

        def late(rank: int) -> bool:
            silent = watch.silent_s(attempt, rank)
            return silent is not None and silent > watch.timeout_for(attempt, rank)

        if analysis.culprit_ranks and not local_only:
            named = [r for r in analysis.culprit_ranks if r in started]
            # a culprit still progressing is a view older than its next heartbeat
            return (analysis, named) if named and any(late(r) for r in named) else None
        waiting = {p.rank for p in progress
                   if any(st.completed < st.enqueued for st in p.pgs.values())}
        silent = [s.rank for s in overdue]
        stalled = [r for r in silent if r not in waiting and r not in analysis.waiting_ranks]
        if local_only:
            return (analysis, stalled) if stalled else None  # never a waiting rank
        longest = max(s.silent_s for s in overdue)
        if not stalled:
            if watch.ended(attempt):
                return None  # they wait for a rank whose script ended: the job's end
            if any(not late(r) for r in set(beats) | started):
                return None  # another rank progresses: the waiting rank's view is stale
            stalled = silent
            if analysis.collective is None and waiting:
                analysis = attrs.evolve(analysis, diagnosis=(
                    f"{culprit.format_ranks(silent)} made no progress for {longest:.1f} s, "
                    "each waiting in a collective that no other rank's heartbeat shows "
                    "missing (the collective itself, or a rank that sends no heartbeats)"))
        elif analysis.collective is None:
            where = {p.rank: p.where for p in progress if p.where}
            places = "; ".join(f"rank {r} is at {where[r]}" for r in stalled if r in where)
            analysis = attrs.evolve(analysis, diagnosis=(
                f"{culprit.format_ranks(stalled)} made no progress for {longest:.1f} s "
                f"({analysis.diagnosis})" + (f"; {places}" if places else "")))
        return analysis, stalled

    def stalled_events(self, attempt: int, verdict: Verdict, *,
                       live: Mapping[int, tuple[int, int]], stacks: Mapping[int, str],
                       dump_dir: str | None = None,
                       judged_by: str | None = None) -> list[WorkerStalled]:
        """``WORKER_STALLED`` for each stalled rank of ``verdict``: the analysis's facts,
        the rank's stack first and its peers' after (``stacks``: this node's ranks, by the
        stack dump; another node's rank has the stack of its latest heartbeat).

        ``live``: this node's live ranks, rank -> (local rank, pid)."""
        watch = self.stall
        assert watch is not None
        analysis = verdict.analysis
        beats = watch.beats(attempt)

        def stack_of(rank: int) -> str:
            if rank in live:
                return stacks.get(rank, "")
            beat = beats.get(rank)
            text = beat[0].data.get("stack") if beat is not None and beat[0].data else None
            return text if isinstance(text, str) else (
                "(no stack: the rank runs on another node and its heartbeats carry none)")

        every = sorted(set(verdict.ranks) | set(beats))
        events = []
        for rank in verdict.stalled:
            local_rank, pid = live.get(rank, (None, None))
            silent, timeout = verdict.silences.get(rank, (
                watch.silent_s(attempt, rank) or 0.0, watch.timeout_for(attempt, rank)))
            beat = beats.get(rank)
            data: dict[str, Any] = {
                "attempt": attempt,
                "culprit_ranks": list(analysis.culprit_ranks or verdict.stalled),
                "waiting_ranks": list(analysis.waiting_ranks),
                "collective": (analysis.collective.as_data()
                               if analysis.collective is not None else None),
                "diagnosis": analysis.diagnosis, "mismatch": analysis.mismatch,
                "matcher": analysis.matcher, "stack": stack_of(rank),
                "peer_stacks": {str(r): stack_of(r) for r in every if r != rank}}
            where = beat[0].data.get("where") if beat is not None and beat[0].data else None
            if isinstance(where, str):
                data["where"] = where
            weighed = verdict.evidence.get(rank)
            if weighed is not None:
                data.update(waiting_on=weighed.waiting_on, doing=weighed.doing,
                            evidence=dict(weighed.facts))
            if dump_dir is not None:
                data["fr_dump_dir"] = dump_dir
            if judged_by is not None:
                data["judged_by"] = judged_by
            events.append(WorkerStalled(
                worker_id=rank, silent_s=round(silent, 3),
                timeout_s=timeout, worker_local_rank=local_rank,
                worker_pid=pid, data=data))
        return events

    # -- a worker ended by SIGABRT ---------------------------------------------------------
    def abort_diagnosis(self, attempt: int, rank: int) -> dict[str, Any]:
        """Where a worker ended by SIGABRT was by its last heartbeat, what its peers wait
        in, and gloo's way of ending a size mismatch (docs/run.md, "Job health"); empty
        when its heartbeats show no process group."""
        if self.stall is None:
            return {}
        beats = self.stall.beats(attempt)
        members = self.stall.members
        progress = {p.rank: p for r, (b, age) in beats.items()
                    for p in [culprit.progress_of(b, age_s=age, members=members(attempt, r))]
                    if p is not None}
        dead = progress.get(rank)
        if dead is None or not dead.pgs:
            return {}
        analysis = culprit.analyze(progress.values())
        pg, state = min(dead.pgs.items(), key=lambda kv: culprit.pg_order(kv[0]))
        text = (f"rank {rank} ended by SIGABRT after collective #{state.completed} of "
                f"process group {pg} (its last heartbeat)")
        if analysis.collective is not None:
            text += f"; {analysis.diagnosis}"
        text += ("; on gloo a collective whose sizes differ between ranks aborts the "
                 "receiving rank this way (\"Received data size doesn't match expected "
                 "size\"): compare the ranks' next collective in the flight-recorder dumps")
        out: dict[str, Any] = {"diagnosis": text}
        if analysis.collective is not None:
            out["collective"] = analysis.collective.as_data()
        return out

    # -- stragglers ------------------------------------------------------------------------
    def stragglers(self, attempt: int) -> list[WorkerSlow]:
        """``WORKER_SLOW`` for each straggler of ``attempt``, looked for at most every
        :data:`SLOW_CHECK_S` (each rank reported at most once per the watch's interval)."""
        watch = self.straggler
        if watch is None:
            return []
        now = self._clock()
        if now < self._next_slow_check:
            return []
        self._next_slow_check = now + SLOW_CHECK_S
        events = []
        for slow in watch.check(attempt):
            data: dict[str, Any] = {"attempt": attempt, "slow_factor": watch.factor,
                                    "basis": slow.basis}
            if slow.basis == "compute_s":  # lock-step: the time outside collectives
                data.update(compute_s=slow.step_time_s,
                            median_compute_s=slow.median_step_time_s)
            events.append(WorkerSlow(
                worker_id=slow.rank, factor=round(slow.factor, 3),
                step_time_s=slow.step_time_s, median_step_time_s=slow.median_step_time_s,
                step=slow.step, data=data))
        return events

    def new_attempt(self, attempt: int) -> None:
        """The group restarts as ``attempt``: the watches drop what older attempts left
        (up to ``attempt`` included: a membership change keeps the number, and the stopped
        workers' state must not stall the new ones)."""
        for watch in (self.stall, self.straggler):
            if watch is not None:
                watch.forget_before(attempt + 1)
        self._data_reported = {k: v for k, v in self._data_reported.items()
                               if k[0] > attempt}
