"""``wandb:PROJECT``: the whole job as one Weights & Biases run, kept across restarts and
requeues, with an alert for each decision a person must see.

People watch their training in W&B; what eventbus knows about the job (failures, stalls
and their culprits, restarts, drains, bad hosts, goodput) belongs in that run, said once,
the way the rest of eventbus says it (:mod:`eventbus.app.sentences`).

**One run per job.** Its id is :func:`wandb_run_id` of the job's run id (torchrun's
``--rdzv-id``; ``$WANDB_RUN_ID`` overrides it), and it is opened with ``resume="allow"``:
every attempt of this ``eventbus run`` writes into it (the attempt is the logged value
``eventbus/attempt``), and a drained job that the scheduler starts again with the same
run id resumes it. The workers get the id as ``$EVENTBUS_WANDB_RUN_ID`` (and the project
as ``$EVENTBUS_WANDB_PROJECT``), so the script's own ``wandb.init`` can name the same run.
Entity, run name and tags are W&B's own variables (``WANDB_ENTITY``, ``WANDB_NAME``,
``WANDB_TAGS``), read by W&B itself.

**What goes in** (the content is made here, on the sink's queue thread):

* each ``METRIC`` number as ``rank<r>/<key>``, and for a key every rank reported at a step,
  their mean as ``<key>``; the x axis ``eventbus/step`` is the ``METRIC``'s ``step``;
* the job's events (not ``METRIC``, heartbeats nor torch's ``TORCHELASTIC`` records) as
  the table ``eventbus/events``
  (time, rank, host, type, sentence), logged again at most every
  :data:`TABLE_REFRESH_S` and at the end, at most :data:`TABLE_MAX_ROWS` rows;
* the job's goodput so far as summary values (``eventbus/goodput_ratio``,
  ``eventbus/badput_s/<cause>``, ...), at most every :data:`SUMMARY_EVERY_S`;
* one ``wandb.alert`` per decision: a failure with the restart or the end it caused, a
  stall with its culprit, a drain, an evicted host, ``JOB_STUCK``/``JOB_UNSTUCK``
  (``--alert-after``) and the job's end. The text is the event's sentence naming the rank
  with its host (``rank 1 on node-17 failed (exit code 3: ...)``).

**Never in the way.** W&B runs in a child process of the agent (``python -m
eventbus.app.sinks.wandb_writer``), fed JSON lines through a pipe by the sink's queue
thread: the agent never imports W&B (no exit hook, no console capture, no service token
in the workers' environment), and a W&B that cannot be reached, or hangs, fills the pipe,
then the sink's bounded queue, and costs dropped, counted events. The child reports what
it delivered and lost; at the end it gets the sink's close budget to finish the run and
is stopped when the budget runs out (what it had not written is counted as dropped; the
run's local files are left for ``wandb sync``).
"""

from __future__ import annotations

import collections
import datetime
import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import re
import secrets
import sys
import threading
import time
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

from eventbus.app.sentences import job_outcome
from eventbus.app.sentences import sentence
from eventbus.app.sentences import stopped_by_agent
from eventbus.app.sinks.base import SINK_QUEUE
from eventbus.app.sinks.base import EventSink
from eventbus.app.sinks.base import MissingExtraError
from eventbus.app.sinks.base import SinkArgumentError
from eventbus.app.sinks.base import attempt_of
from eventbus.app.sinks.base import numbers_of
from eventbus.app.sinks.base import rank_of
from eventbus.app.sinks.base import resolve_target
from eventbus.app.sinks.base import sink_text
from eventbus.app.sinks.wandb_process import WriterProcess
from eventbus.events import Event
from eventbus.subscribers.queued import QueueSettings

__all__ = [
    "DECISION_WAIT_S",
    "ENV_PROJECT",
    "ENV_RUN_ID",
    "SUMMARY_EVERY_S",
    "TABLE_COLUMNS",
    "TABLE_MAX_ROWS",
    "TABLE_REFRESH_S",
    "WANDB_CLOSE_TIMEOUT_S",
    "WANDB_MIN_VERSION",
    "WandbSink",
    "wandb_run_id",
]

logger = logging.getLogger("eventbus")

#: the oldest W&B the sink is tested against (the extra's pin)
WANDB_MIN_VERSION = (0, 17)
#: what the workers find in their environment: the W&B run id and project of the job
ENV_RUN_ID = "EVENTBUS_WANDB_RUN_ID"
ENV_PROJECT = "EVENTBUS_WANDB_PROJECT"
#: the events table is logged again at most this often (each log is a new W&B artifact)
TABLE_REFRESH_S = 60.0
#: rows of the events table at most (W&B's ``Table.MAX_ROWS``); the rest are counted
TABLE_MAX_ROWS = 10_000
TABLE_COLUMNS = ("time", "rank", "host", "type", "sentence")
#: the goodput summary values are updated at most this often (and at the end)
SUMMARY_EVERY_S = 5.0
#: a failure or stall waits this long for the agent's decision before it alerts alone
DECISION_WAIT_S = 30.0
#: the close budget: the child gets what the queue leaves of it to finish the run
WANDB_CLOSE_TIMEOUT_S = 10.0
#: W&B's own wait for its server at ``wandb.init`` (its default is 90 s)
INIT_TIMEOUT_S = 30.0
#: what the table leaves out besides the metrics: torch's own records, a dozen an attempt
_NOT_IN_TABLE = frozenset({"TORCHELASTIC"})
#: steps whose mean waits for its last ranks, at most (the oldest is forgotten)
_MEANS_PENDING = 256
#: an id W&B accepts as it is (W&B forbids ``/ \\ # ? % :``; this is stricter)
_SAFE_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: torchrun's ``--rdzv-id`` when none is given: not a job's own id
_NO_RUN_ID = "none"


def wandb_run_id(run_id: str) -> str:
    """The W&B run id of the job whose run id (``--rdzv-id``) is ``run_id``: ``run_id``
    itself when it is made of letters, digits, ``_`` and ``-`` and at most 64 long (a
    uuid, a Slurm job id, ``llama-7b-0412``), else those characters of it (others become
    ``-``) cut to 47, ``-``, and the first 16 hex digits of its SHA-256."""
    if _SAFE_ID.fullmatch(run_id):
        return run_id
    slug = re.sub(r"[^A-Za-z0-9_-]", "-", run_id)[:47]
    return f"{slug}-{hashlib.sha256(run_id.encode()).hexdigest()[:16]}"


def _check_extra() -> None:
    """The ``wandb`` extra is installed (without importing W&B here: the child does)."""
    try:
        found = importlib.util.find_spec("wandb")
    except (ImportError, ValueError):
        found = None
    if found is None:
        raise MissingExtraError("the wandb sink needs the 'wandb' extra (No module named "
                                "'wandb'): pip install 'eventbus[wandb]'")
    try:
        version = importlib.metadata.version("wandb")
    except importlib.metadata.PackageNotFoundError:
        return
    parts = tuple(int(p) for p in re.findall(r"\d+", version)[:2])
    if parts < WANDB_MIN_VERSION:
        raise MissingExtraError(f"the wandb sink needs wandb >= "
                                f"{'.'.join(map(str, WANDB_MIN_VERSION))}, found {version}: "
                                "pip install 'eventbus[wandb]'")


def _time(timestamp: float) -> str:
    """``2026-12-03T13:26:13.342Z``: an event's time in the table."""
    moment = datetime.datetime.fromtimestamp(timestamp, tz=datetime.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


class WandbSink(EventSink):
    """``WandbSink(PROJECT)``: see the module docstring.

    ``python``: the interpreter of the writer process; ``clock``: the sink's clock (for
    the refresh rates and the decision wait)."""

    kind = "wandb"

    def __init__(self, project: str, *, settings: QueueSettings | None = None,
                 table_refresh_s: float = TABLE_REFRESH_S,
                 summary_every_s: float = SUMMARY_EVERY_S,
                 init_timeout_s: float = INIT_TIMEOUT_S,
                 python: str = sys.executable,
                 clock: Callable[[], float] = time.monotonic) -> None:
        project, origin = resolve_target("wandb", project, default_env="WANDB_PROJECT")
        if not project or re.search(r"[/\\#?%:]", project) or len(project) > 128:
            raise SinkArgumentError(f"wandb: {project!r} is not a W&B project name (at most "
                                    "128 characters, none of / \\ # ? % :); e.g. --sink "
                                    "wandb:my-project (the entity is $WANDB_ENTITY)")
        _check_extra()
        self.project = project
        self.table_refresh_s = table_refresh_s
        self.summary_every_s = summary_every_s
        self.init_timeout_s = init_timeout_s
        self.python = python
        self.clock = clock
        #: a callable returning the job's goodput so far, or None: set by ``eventbus run``
        self.goodput_source: Callable[[], Any] | None = None
        #: the W&B run id, once known (:meth:`run_id_for`)
        self.wandb_id: str | None = None
        self._id_lock = threading.Lock()
        self._close_deadline: float | None = None
        # the content's state (the queue thread's alone)
        self._step: dict[int | None, int] = {}  # a rank's own counter for METRICs without step
        self._last_step: int | None = None
        self._means: collections.OrderedDict[tuple[int, int], dict[str, dict[int, float]]] = \
            collections.OrderedDict()
        self._rows = 0
        self._rows_left_out = 0
        self._table_dirty = False
        self._table_at: float | None = None
        self._summary_at: float | None = None
        self._pending: list[tuple[float, Event]] = []  # failures and stalls, undecided
        self._exit_code: int | None = None
        self._last_tick = 0.0
        self._held: list[Event] | None = None  # events before the rendezvous, if holding
        self._released = threading.Event()
        super().__init__(label=f"{origin}={project}" if origin else project,
                         settings=settings or SINK_QUEUE.with_options(
                             {"close_timeout": WANDB_CLOSE_TIMEOUT_S}))
        #: the writer process: the pipe, its reports and their counts (wandb_process.py)
        self._writer = WriterProcess(python, name=str(self.name), failed=self._writer_failed)

    def _writer_failed(self, reason: str, n: int) -> None:
        self.delivery_failed(reason, n, what="W&B")

    @property
    def run_info(self) -> dict[str, Any]:
        """What the writer said of the run once it started: id, url, dir, resumed,
        offline (empty before)."""
        return self._writer.run_info

    # -- the run id -------------------------------------------------------------------------
    def run_id_for(self, run_id: str | None) -> str:
        """The W&B run id of this job (fixed on first use): ``$WANDB_RUN_ID``, else
        :func:`wandb_run_id` of the job's run id, else (torchrun's ``none``: no id of the
        job's own) a new one, which a requeue cannot find again."""
        with self._id_lock:
            if self.wandb_id is None:
                given = os.environ.get("WANDB_RUN_ID", "").strip()
                if given:
                    self.wandb_id = given
                elif run_id and run_id != _NO_RUN_ID:
                    self.wandb_id = wandb_run_id(run_id)
                else:
                    self.wandb_id = f"eventbus-{secrets.token_hex(6)}"
                    logger.warning("sink %s: the job has no run id of its own (give "
                                   "--rdzv-id): the W&B run %s is new, a requeue will not "
                                   "resume it", self.name, self.wandb_id)
            return self.wandb_id

    def hold_until_rendezvous(self) -> None:
        """Make no run before :meth:`release` (``SinksPlugin`` calls both): under ``eventbus
        run`` only group rank 0's agent writes the run, and which node that is, the
        rendezvous says. What arrives meanwhile is held (up to the queue's bound) and
        written after the release; on the other nodes it is never written."""
        if self._held is None:
            self._held = []

    def release(self) -> None:
        """This agent is group rank 0's: the held events go out with the next batch."""
        self._released.set()

    def worker_env(self, run_id: str) -> dict[str, str]:
        """What the workers find in their environment (``SinksPlugin`` adds it)."""
        return {ENV_RUN_ID: self.run_id_for(run_id), ENV_PROJECT: self.project}

    # -- on the caller's thread -------------------------------------------------------------
    def __call__(self, event: Event) -> None:
        """Enqueue what the run shows; a heartbeat only as a tick, every
        ``summary_every_s`` at most (it keeps the goodput summary live on a quiet job)."""
        if str(event.type) == "WORKER_PROGRESS":
            now = self.clock()
            if now - self._last_tick < self.summary_every_s:
                return
            self._last_tick = now
        super().__call__(event)

    # -- on the queue's thread --------------------------------------------------------------
    def write(self, events: Sequence[Event]) -> None:
        if self._held is not None:
            if not self._released.is_set():
                room = self.settings.max_events - len(self._held)
                self._held.extend(events[:max(0, room)])
                if len(events) > room:
                    self.count_lost("held before the rendezvous: too many", len(events) - room)
                return
            events, self._held = [*self._held, *events], None
        if not events:
            return
        ops: list[dict[str, Any]] = []
        if not self._writer.started:
            first = next((e for e in events if e.context.run_id), events[0])
            ops.append(self._init_op(first))
        now = self.clock()
        rows: dict[tuple[int, int], dict[str, Any]] = {}
        table: list[list[Any]] = []
        for event in events:
            kind = str(event.type)
            if kind == "WORKER_PROGRESS":
                continue  # a tick: the summary below
            if kind in _NOT_IN_TABLE:
                continue
            if kind == "METRIC":
                self._metric(event, rows)
            else:
                table.append(self._table_row(event))
                ops.extend(self._alerts(event, now))
        for (attempt, step), row in rows.items():
            n = row.pop("_n")
            ops.append({"op": "log", "row": {**row, "eventbus/step": step,
                                             "eventbus/attempt": attempt}, "n": n})
        if table:
            kept = table[:max(0, TABLE_MAX_ROWS - self._rows)]
            self._rows += len(kept)
            self._rows_left_out += len(table) - len(kept)
            self._table_dirty = self._table_dirty or bool(kept)
            ops.append({"op": "rows", "rows": kept, "n": len(table)})
        ops.extend(self._undecided(now))
        ended = any(str(e.type) == "AGENT_EXIT" and e.context.group_rank in (None, 0)
                    for e in events)
        if self._table_dirty and (ended or self._table_at is None
                                  or now - self._table_at >= self.table_refresh_s):
            self._table_at = now
            self._table_dirty = False
            ops.append({"op": "table"})
        if ended or self._summary_at is None or now - self._summary_at >= self.summary_every_s:
            self._summary_at = now
            summary = self._summary()
            if summary:
                ops.append({"op": "summary", "values": summary})
        self._writer.send(ops)

    def _init_op(self, event: Event) -> dict[str, Any]:
        ctx = event.context
        config: dict[str, Any] = {"eventbus/run_id": ctx.run_id}
        if ctx.world_size:
            config["eventbus/ranks"] = ctx.world_size
            if ctx.local_world_size:
                config["eventbus/nodes"] = max(1, ctx.world_size // ctx.local_world_size)
        for name in ("max_restarts", "nproc_per_node"):
            value = getattr(event, name, None)
            if isinstance(value, int):
                config[f"eventbus/{name}"] = value
        return {"op": "init", "project": self.project, "id": self.run_id_for(ctx.run_id),
                "config": config, "init_timeout": self.init_timeout_s, "n": 0}

    def _metric(self, event: Event, rows: dict[tuple[int, int], dict[str, Any]]) -> bool:
        """Put a ``METRIC``'s numbers in the row of its attempt and step; False if it has
        none."""
        numbers = numbers_of(event.data)
        if not numbers:
            return False
        rank = event.rank
        step = getattr(event, "step", None)
        if not isinstance(step, int) or isinstance(step, bool):
            step = self._step.get(rank, -1) + 1  # a per-rank counter, as TensorBoard's
        self._step[rank] = step
        self._last_step = step if self._last_step is None else max(self._last_step, step)
        attempt = attempt_of(event)
        row = rows.setdefault((attempt, step), {"_n": 0})
        row["_n"] += 1
        prefix = "" if rank is None else f"rank{rank}/"
        for key, value in numbers.items():
            row[f"{prefix}{key}"] = value
        world = event.context.world_size
        if rank is None or not world or world < 2:
            return True
        pending = self._means.setdefault((attempt, step), {})
        self._means.move_to_end((attempt, step))
        while len(self._means) > _MEANS_PENDING:
            self._means.popitem(last=False)
        for key, value in numbers.items():
            seen = pending.setdefault(key, {})
            seen[rank] = value
            if len(seen) == world:  # every rank reported the key at this step
                row[key] = sum(seen.values()) / world
                del pending[key]
        if not pending:
            self._means.pop((attempt, step), None)
        return True

    def _table_row(self, event: Event) -> list[Any]:
        return [_time(event.timestamp), rank_of(event), event.context.hostname or "",
                str(event.type), sentence(event)]

    # -- the alerts -------------------------------------------------------------------------
    def _alert(self, event: Event, text: str, level: str) -> dict[str, Any]:
        title = f"eventbus [attempt {attempt_of(event)}]: {sentence(event, short=True)}"
        rank = rank_of(event)
        if rank is not None and str(event.type) in ("WORKER_EXIT", "WORKER_STALLED"):
            title = f"eventbus [attempt {attempt_of(event)}]: rank {rank} " + \
                sentence(event, short=True)
        return {"op": "alert", "title": title[:200], "text": text, "level": level, "n": 0}

    def _alerts(self, event: Event, now: float) -> list[dict[str, Any]]:
        kind = str(event.type)
        if kind == "WORKER_EXIT":
            if event.is_failure and not stopped_by_agent(event):
                self._pending.append((now, event))
            return []
        if kind == "WORKER_STALLED":
            self._pending.append((now, event))
            return []
        if kind == "WORKER_RESTART":
            attempt = attempt_of(event)
            ops = self._decided(sentence(event, short=True))
            ops.append({"op": "log", "row": {"eventbus/attempt": attempt,
                                             "eventbus/step": self._last_step or 0},
                        "n": 0})
            return ops
        if kind == "PREEMPTING":
            return [self._alert(event, sink_text(event, host=True), "WARN"),
                    {"op": "preempting", "n": 0}]
        if kind == "HOST_EVICTED":
            return [self._alert(event, sink_text(event, host=True), "ERROR")]
        if kind == "JOB_STUCK":
            return [self._alert(event, sink_text(event, host=True), "WARN")]
        if kind == "JOB_UNSTUCK":
            return [self._alert(event, sink_text(event, host=True), "INFO")]
        if kind == "AGENT_EXIT" and event.context.group_rank in (None, 0):
            ops = self._decided(sentence(event, short=True))
            outcome = job_outcome(event)
            code = getattr(event, "exit_code", None)
            self._exit_code = code if isinstance(code, int) else (0 if outcome == "succeeded"
                                                                  else 1)
            level = {"succeeded": "INFO", "preempted": "WARN"}.get(outcome, "ERROR")
            ops.append(self._alert(event, sink_text(event, host=True), level))
            ops.append({"op": "summary", "n": 0, "values": {
                "eventbus/end": sentence(event), "eventbus/outcome": outcome,
                "eventbus/attempt": attempt_of(event)}})
            return ops
        return []

    def _decided(self, decision: str | None) -> list[dict[str, Any]]:
        """One alert for the failures and stalls waiting for this decision: the first,
        with the decision, and how many more there were."""
        pending, self._pending = self._pending, []
        if not pending:
            return []
        first = pending[0][1]
        text = sink_text(first, decision=decision, host=True)
        if len(pending) > 1:
            others = ", ".join(f"rank {rank_of(e)}" for _, e in pending[1:6])
            text += f" (and {len(pending) - 1} more: {others}"
            text += ", ...)" if len(pending) > 6 else ")"
        return [self._alert(first, text, "ERROR")]

    def _undecided(self, now: float) -> list[dict[str, Any]]:
        """Failures and stalls that waited :data:`DECISION_WAIT_S` for a decision alert
        without one."""
        if self._pending and now - self._pending[0][0] >= DECISION_WAIT_S:
            return self._decided(None)
        return []

    def _summary(self) -> dict[str, Any]:
        values: dict[str, Any] = {}
        source = self.goodput_source
        try:
            result = source() if source is not None else None
        except Exception:  # a figure must never cost the events
            logger.exception("sink %s: the goodput figure failed", self.name)
            result = None
        if result is not None:
            values["eventbus/goodput_ratio"] = round(float(result.goodput_ratio), 4)
            values["eventbus/goodput_s"] = round(float(result.goodput_s), 3)
            values["eventbus/wall_s"] = round(float(result.wall_s), 3)
            for cause, seconds in result.badput_s.items():
                values[f"eventbus/badput_s/{cause}"] = round(float(seconds), 3)
        if self._rows_left_out:
            values["eventbus/events_not_in_table"] = self._rows_left_out
        return values

    # -- the writer process -----------------------------------------------------------------
    def close(self, timeout: float | None = None) -> bool:
        """True when W&B wrote every event in time (not only when the queue emptied)."""
        budget = self.settings.close_timeout if timeout is None else timeout
        self._close_deadline = time.monotonic() + budget
        delivered = super().close(timeout)
        sent, written, _ = self._writer.counts()
        return delivered and written == sent

    def shutdown(self) -> None:
        """End the run (the failures still undecided alert first), within what the close
        budget left; a writer still busy then is stopped. What it had not written by then
        is counted as dropped."""
        deadline = self._close_deadline or time.monotonic() + WANDB_CLOSE_TIMEOUT_S
        if self._held and self._released.is_set():  # released, and no batch came since
            self.write([])
        if not self._writer.spawned:
            return
        ops = self._decided("the agent's decision was not seen")
        ops.append({"op": "end", "exit_code": self._exit_code, "n": 0})
        if self._table_dirty:
            ops.insert(0, {"op": "table"})
        missing = self._writer.finish(ops, deadline)
        if missing:
            self.count_lost(f"not written by W&B before the close ({self._writer.status})",
                            missing)

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        sent, written, lost = self._writer.counts()
        out.update(sent=sent, written=written, lost=lost)
        out["wandb_id"] = self.wandb_id
        out["writer"] = self._writer.status
        return out
