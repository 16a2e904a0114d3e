"""Sinks: events leave the agent for TensorBoard, OpenTelemetry, Prometheus, MLflow, a
webhook, Weights & Biases.

``eventbus run --sink NAME:ARG`` (repeatable) builds one sink per option with
:func:`make_sink` and subscribes it to every event on the agent's bus; the same objects
work in a single process::

    eventbus.publishers.get_default_event_publisher().subscribe_all(on_event=TensorBoardSink("tb"))

Every sink is a :class:`~eventbus.app.sinks.base.EventSink`, i.e. a bounded
:class:`~eventbus.subscribers.queued.QueuedSink`: a slow or dead backend costs dropped, counted
events and never slows ``record()`` nor the agent's monitor. ``NAME`` is a built-in
(:data:`BUILTIN_SINKS`) or the name of an entry point of the group
:data:`SINK_ENTRY_POINT_GROUP` (``eventbus.sinks``), whose target is called with ``ARG``
and returns the subscriber. See docs/sinks.md.

The :class:`SinksPlugin` also runs ``--alert-after``'s :class:`~eventbus.app.sinks.stuck.
StuckWatch` on the same bus: what it publishes (``JOB_STUCK``, ``JOB_UNSTUCK``) reaches
every sink like any other event.
"""

from __future__ import annotations

import importlib.metadata
import logging
import sys
import threading
import time
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import Any

from eventbus.app.plugins import RendezvousInfo
from eventbus.app.sinks.base import SINK_CLOSE_TIMEOUT_S
from eventbus.app.sinks.base import EventSink
from eventbus.app.sinks.base import MissingExtraError
from eventbus.app.sinks.base import SinkArgumentError
from eventbus.app.sinks.base import redact_text
from eventbus.app.sinks.base import redact_uri
from eventbus.bus import ALL
from eventbus.bus import Bus
from eventbus.errors import did_you_mean

if TYPE_CHECKING:
    from eventbus.app.sinks.stuck import StuckWatch

__all__ = [
    "BUILTIN_SINKS",
    "ENV_DEFAULTS",
    "SINKS_CLOSE_TIMEOUT_S",
    "SINK_CLOSE_TIMEOUT_S",
    "SINK_ENTRY_POINT_GROUP",
    "EventSink",
    "MissingExtraError",
    "SinkArgumentError",
    "SinkError",
    "SinksPlugin",
    "close_sinks",
    "make_sink",
]

logger = logging.getLogger("eventbus")

#: the entry-point group of third-party sinks: name -> a callable (ARG) -> subscriber
SINK_ENTRY_POINT_GROUP = "eventbus.sinks"

#: the budget of closing every sink of a run together, at the end of ``eventbus run``
SINKS_CLOSE_TIMEOUT_S = 10.0

# Each built-in's module is imported only when its sink is asked for (a backend's extra
# may be missing, and `--help` stays fast): a function per sink, not a module-name string.
def _mlflow(arg: str) -> Any:
    from eventbus.app.sinks.mlflow import MlflowSink

    return MlflowSink(arg)


def _otlp(arg: str) -> Any:
    from eventbus.app.sinks.otlp import OtlpSink

    return OtlpSink(arg)


def _prometheus(arg: str) -> Any:
    from eventbus.app.sinks.prometheus import PrometheusSink

    return PrometheusSink(arg)


def _tensorboard(arg: str) -> Any:
    from eventbus.app.sinks.tensorboard import TensorBoardSink

    return TensorBoardSink(arg)


def _wandb(arg: str) -> Any:
    from eventbus.app.sinks.wandb import WandbSink

    return WandbSink(arg)


def _webhook(arg: str) -> Any:
    from eventbus.app.sinks.webhook import WebhookSink

    return WebhookSink(arg)


#: built-in sink name -> a function (ARG) -> the sink, importing its module on first use
BUILTIN_SINKS: dict[str, Callable[[str], Any]] = {
    "mlflow": _mlflow,
    "otlp": _otlp,
    "prometheus": _prometheus,
    "tensorboard": _tensorboard,
    "wandb": _wandb,
    "webhook": _webhook,
}


class SinkError(ValueError):
    """``--sink NAME:ARG`` cannot be built; the message names the sink and the fix."""


def _factory(name: str) -> Callable[[str], Any]:
    builtin = BUILTIN_SINKS.get(name)
    if builtin is not None:
        return builtin
    for entry in importlib.metadata.entry_points(group=SINK_ENTRY_POINT_GROUP):
        if entry.name == name:
            try:
                loaded: Callable[[str], Any] = entry.load()
            except Exception as exc:
                raise SinkError(f"--sink {name}: the entry point {entry.value!r} failed to "
                                f"load ({type(exc).__name__}: {exc})") from exc
            return loaded
    known = sorted({*BUILTIN_SINKS, *(e.name for e in
                                      importlib.metadata.entry_points(
                                          group=SINK_ENTRY_POINT_GROUP))})
    hint = did_you_mean(name.lower(), known)
    raise SinkError(f"--sink {name}: unknown sink{hint}; the sinks are {', '.join(known)} "
                    f"(others register under the entry-point group {SINK_ENTRY_POINT_GROUP!r})")


#: sinks whose ARG may be left out: the environment variable their library reads instead
ENV_DEFAULTS = {"otlp": "OTEL_EXPORTER_OTLP_ENDPOINT", "mlflow": "MLFLOW_TRACKING_URI",
                "wandb": "WANDB_PROJECT"}


def _shown(name: str, arg: str) -> str:
    """``NAME:ARG`` fit to print: a webhook's URL without its path (its credential), any
    other URI without ``user:password@`` and query."""
    return f"{name}:{redact_uri(arg, keep_path=name != 'webhook')}" if arg else name


def make_sink(spec: str) -> Any:
    """The subscriber ``--sink NAME:ARG`` names (``ARG`` may contain colons).

    Raises :class:`SinkError` naming the sink and the fix: an unknown name, a malformed
    ``ARG``, a missing optional extra, a third-party factory that fails.
    """
    name, sep, arg = spec.partition(":")
    if not name or (not sep and name not in ENV_DEFAULTS):
        raise SinkError(f"--sink {_shown(name, arg)!r}: expected NAME:ARG, e.g. --sink "
                        "tensorboard:runs/tb (ARG may be env:VARIABLE; " +
                        ", ".join(ENV_DEFAULTS) + " may leave it out to read " +
                        " / ".join(f"${v}" for v in ENV_DEFAULTS.values()) + ")")
    factory = _factory(name)
    shown = _shown(name, arg)
    try:
        sink = factory(arg)
    except MissingExtraError as exc:
        raise SinkError(f"--sink {name}: {exc}") from exc
    except SinkArgumentError as exc:
        raise SinkError(f"--sink {shown!r}: {redact_text(str(exc))}") from exc
    except Exception as exc:
        raise SinkError(f"--sink {shown!r}: the sink could not be built "
                        f"({type(exc).__name__}: {redact_text(str(exc))})") from exc
    if not callable(sink):
        raise SinkError(f"--sink {name}: {type(sink).__name__} is not callable; a sink's "
                        "factory returns a subscriber, a callable (event) -> None")
    return sink


def close_sinks(sinks: Sequence[Any], *, timeout: float = SINKS_CLOSE_TIMEOUT_S) -> bool:
    """Close ``sinks`` side by side, returning within ``timeout`` (each gets at most its
    own default budget too). True when every sink delivered everything in time."""
    deadline = time.monotonic() + timeout
    results: dict[int, bool] = {}

    def close_one(index: int, sink: Any) -> None:
        own = getattr(getattr(sink, "settings", None), "close_timeout", SINK_CLOSE_TIMEOUT_S)
        try:
            results[index] = bool(sink.close(timeout=min(timeout, own)))
        except Exception:
            logger.exception("closing sink %r failed", sink)
            results[index] = False

    threads = []
    for index, sink in enumerate(sinks):
        if callable(getattr(sink, "close", None)):
            thread = threading.Thread(target=close_one, args=(index, sink), daemon=True,
                                      name=f"eventbus-close-sink-{index}")
            thread.start()
            threads.append((index, thread))
    for _, thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    late = [index for index, _ in threads if index not in results]
    if late:
        logger.warning("%d sink(s) did not close within %.1f s: %s", len(late), timeout,
                       redact_text(", ".join(repr(sinks[i]) for i in late)))
    return not late and all(results.values())


class SinksPlugin:
    """The sinks of one ``eventbus run``: subscribed to every event on the agent's ``bus``
    from the start (``AGENT_START`` included), kept on the agent of group rank 0 (the one
    with the job-wide view), closed at the first rendezvous on any other node.

    An :class:`eventbus.app.plugins.AgentPlugin`; :meth:`close` runs after the agent
    published ``AGENT_EXIT`` (so the sinks see the outcome), within
    :data:`SINKS_CLOSE_TIMEOUT_S`.

    ``alert_after``: seconds (``--alert-after``) for a
    :class:`~eventbus.app.sinks.stuck.StuckWatch` on ``bus``, started now, stopped with
    the sinks (on group rank 0) or at the first rendezvous (elsewhere). After each
    rendezvous the workers' environment gets what a sink's ``worker_env(run_id)`` returns
    (the W&B sink: the run's id), on every node. A sink with ``hold_until_rendezvous()``
    is told so now and ``release()``-d at the first rendezvous on group rank 0 (the W&B
    sink makes its one run there only).
    """

    def __init__(self, bus: Bus, sinks: Sequence[Any], *,
                 close_timeout: float = SINKS_CLOSE_TIMEOUT_S,
                 alert_after: float | None = None) -> None:
        self.sinks = list(sinks)
        self.close_timeout = close_timeout
        for sink in self.sinks:  # a sink that must know its node first (W&B's run)
            hold = getattr(sink, "hold_until_rendezvous", None)
            if callable(hold):
                hold()
        self._subscriptions = [bus.subscribe(ALL, on_event=sink) for sink in self.sinks]
        self.watch: StuckWatch | None = None
        if alert_after is not None:
            from eventbus.app.sinks.stuck import StuckWatch

            self.watch = StuckWatch(bus, alert_after)
        self._decided = False
        self._closed = False

    def after_rendezvous(self, info: RendezvousInfo) -> Mapping[str, str]:
        env: dict[str, str] = {}
        for sink in self.sinks:
            worker_env = getattr(sink, "worker_env", None)
            if callable(worker_env):
                env.update(worker_env(info.run_id))
        if not self._decided:
            self._decided = True
            if info.group_rank != 0:
                logger.info("sinks run on the agent of group rank 0; this node's (group rank "
                            "%d) are closed", info.group_rank)
                self.close(timeout=1.0)
            else:
                for sink in self.sinks:
                    release = getattr(sink, "release", None)
                    if callable(release):
                        release()
        return env

    def before_exit(self, *, timeout: float) -> None:
        """Nothing: the sinks close after ``AGENT_EXIT`` (see :meth:`close`)."""

    def close(self, *, timeout: float | None = None) -> bool:
        """Unsubscribe and close every sink within ``timeout`` (default
        ``close_timeout``); drops are reported on stderr. True if all was delivered."""
        if self._closed:
            return True
        self._closed = True
        if self.watch is not None:
            self.watch.close()
        for sub in self._subscriptions:
            sub.cancel()
        started = time.monotonic()
        budget = self.close_timeout if timeout is None else timeout
        ok = close_sinks(self.sinks, timeout=budget)
        for sink in self.sinks:
            stats = getattr(sink, "stats", None)
            raw = stats() if callable(stats) else {}
            dropped = dict(raw.get("dropped") or {})
            if raw.get("failed"):
                dropped["backend raised"] = raw["failed"]
            if dropped:
                why = "; ".join(f"{n} {reason}" for reason, n in sorted(
                    dropped.items(), key=lambda item: -item[1]))
                name = redact_text(str(getattr(sink, "name", sink)))
                print(f"eventbus: sink {name} dropped {sum(dropped.values())} events: "
                      f"{redact_text(why)}", file=sys.stderr)
        logger.info("sinks closed in %.2f s (budget %.1f s)", time.monotonic() - started,
                    budget)
        return ok
