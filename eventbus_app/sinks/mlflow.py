"""``mlflow:TRACKING_URI``: one MLflow run per job.

With ``MlflowClient(TRACKING_URI)`` (the ``mlflow`` extra, ``mlflow-skinny``): the run is
created in the experiment ``eventbus`` (or ``$MLFLOW_EXPERIMENT_NAME``) at the first event,
tagged ``eventbus.run_id``, ``eventbus.nodes`` and ``eventbus.ranks`` (the job's world size)
and named after the run id. Each number in a ``METRIC``'s ``data`` is logged with its
``step`` as ``rank<r>/<key>`` (``<key>`` for an event with no rank); failures, stalls and
restarts are counted as the metrics ``eventbus/failures``, ``eventbus/stalls`` and
``eventbus/attempt``. ``AGENT_EXIT`` sets the run's status: FINISHED when the job
succeeded, FAILED otherwise (a sink closed without one, the agent killed: KILLED), and the
tag ``eventbus.end``: how the job ended, its sentence (``the job was stopped (exit code 3):
...``, :func:`eventbus.app.sentences.sentence`).

``TRACKING_URI`` may be empty (``--sink mlflow``) to use ``$MLFLOW_TRACKING_URI``, or
``env:NAME``; the sink's name and messages show it without ``user:password@`` and query.

A ``file:`` URI is a local file store, which MLflow 3 only opens with
``MLFLOW_ALLOW_FILE_STORE=true``: the sink sets it (unless set) for such a URI, since
``mlflow-skinny`` has no SQLAlchemy for a ``sqlite:`` store. Calls to the tracking store
run on the sink's thread; a slow store costs dropped events, never a slow ``record()``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from eventbus.app.sentences import sentence
from eventbus.app.sinks.base import EventSink
from eventbus.app.sinks.base import SinkArgumentError
from eventbus.app.sinks.base import attempt_of
from eventbus.app.sinks.base import is_stall
from eventbus.app.sinks.base import numbers_of
from eventbus.app.sinks.base import redact_uri
from eventbus.app.sinks.base import require_extra
from eventbus.app.sinks.base import resolve_target
from eventbus.events import Event
from eventbus.subscribers.queued import QueueSettings

__all__ = ["MlflowSink"]

#: metrics sent in one ``log_batch`` at most (MLflow's own limit is 1000)
_BATCH = 1000


class MlflowSink(EventSink):
    """``MlflowSink(TRACKING_URI)``: see the module docstring."""

    kind = "mlflow"

    def __init__(self, tracking_uri: str, *, settings: QueueSettings | None = None,
                 experiment: str | None = None) -> None:
        tracking_uri, origin = resolve_target("mlflow", tracking_uri,
                                              default_env="MLFLOW_TRACKING_URI")
        if not tracking_uri or ":" not in tracking_uri:
            raise SinkArgumentError(f"mlflow: {redact_uri(tracking_uri)!r} is not a tracking "
                                    "URI; e.g. --sink mlflow:file:///tmp/mlruns or "
                                    "--sink mlflow:http://mlflow.example:5000 (or set "
                                    "MLFLOW_TRACKING_URI and give --sink mlflow)")
        require_extra("mlflow", "mlflow", "mlflow.tracking")
        if tracking_uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self.tracking_uri = tracking_uri
        self.experiment = experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME", "eventbus")
        self.client: Any = MlflowClient(tracking_uri=tracking_uri)
        #: the MLflow run id, once the first event created the run
        self.mlflow_run_id: str | None = None
        self._failures = 0
        self._stalls = 0
        self._ended = False
        shown = redact_uri(tracking_uri)
        super().__init__(label=f"{origin}={shown}" if origin else shown, settings=settings,
                         target=tracking_uri)

    def _mlflow_run(self, event: Event) -> str:
        if self.mlflow_run_id is None:
            found = self.client.get_experiment_by_name(self.experiment)
            experiment_id = (found.experiment_id if found is not None
                             else self.client.create_experiment(self.experiment))
            ctx = event.context
            tags = {"eventbus.run_id": ctx.run_id or ""}
            if ctx.world_size:
                tags["eventbus.ranks"] = str(ctx.world_size)
                if ctx.local_world_size:
                    tags["eventbus.nodes"] = str(max(1, ctx.world_size // ctx.local_world_size))
            run = self.client.create_run(experiment_id, tags=tags,
                                         start_time=int(event.timestamp * 1000),
                                         run_name=ctx.run_id or None)
            self.mlflow_run_id = run.info.run_id
        return self.mlflow_run_id

    def write(self, events: Sequence[Event]) -> None:
        from mlflow.entities import Metric

        metrics: list[Any] = []
        tags: dict[str, str] = {}
        status: str | None = None
        run_id: str | None = None
        for event in events:
            run_id = self._mlflow_run(event)
            kind = str(event.type)
            millis = int(event.timestamp * 1000)
            ctx = event.context
            if ctx.world_size and ctx.local_world_size and event.rank is None:
                tags["eventbus.ranks"] = str(ctx.world_size)
                tags["eventbus.nodes"] = str(max(1, ctx.world_size // ctx.local_world_size))
            if kind == "METRIC":
                step = getattr(event, "step", None)
                prefix = "" if event.rank is None else f"rank{event.rank}/"
                for key, value in numbers_of(event.data).items():
                    metrics.append(Metric(f"{prefix}{key}", value, millis,
                                          step if isinstance(step, int) else 0))
            elif kind == "WORKER_EXIT" and event.is_failure:
                self._failures += 1
                metrics.append(Metric("eventbus/failures", self._failures, millis,
                                      attempt_of(event)))
            elif is_stall(event):
                self._stalls += 1
                metrics.append(Metric("eventbus/stalls", self._stalls, millis,
                                      attempt_of(event)))
            elif kind == "WORKER_RESTART":
                metrics.append(Metric("eventbus/attempt", attempt_of(event), millis,
                                      attempt_of(event)))
            elif kind == "AGENT_EXIT":
                status = "FAILED" if event.is_failure else "FINISHED"
                tags["eventbus.state"] = str(getattr(event, "state", ""))
                tags["eventbus.end"] = sentence(event)
        if run_id is None:
            return
        for start in range(0, len(metrics), _BATCH):
            self.client.log_batch(run_id, metrics=metrics[start:start + _BATCH])
        for tag, text in tags.items():
            self.client.set_tag(run_id, tag, text)
        if status is not None:
            self.client.set_terminated(run_id, status, end_time=int(time.time() * 1000))
            self._ended = True

    def shutdown(self) -> None:
        if self.mlflow_run_id is not None and not self._ended:
            self.client.set_terminated(self.mlflow_run_id, "KILLED")
