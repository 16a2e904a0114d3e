"""``eventbus run [--events-jsonl PATH] [--reactor MODULE:ATTR]... [--log-events]
<torchrun options> SCRIPT [ARGS]``.

The job's assembly: the command line read (:mod:`.parser`: torchrun's own parser with
eventbus's options first), the bus, its sinks and reactors set up, and torchrun's own
launch path (``torch.distributed.run.run``) with the agent swapped for
:class:`eventbus.app.launcher.agent.EventAgent`. Exit code: 0 when the job
succeeded, 1 when it failed, as torchrun; ``--stop-exit-code`` (default 3) when a reactor's
STOP ended it.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from eventbus.app.launcher.cli import console
from eventbus.app.launcher.cli import options
from eventbus.app.launcher.decisions import exit_codes
from eventbus.app.launcher.drain.slurm import requeue_after_job
from eventbus.app.launcher.parser import build_parser
from eventbus.app.launcher.slurm import environment as slurm
from eventbus.app.plugins import AgentPlugin
from eventbus.bus import ALL
from eventbus.bus import get_default_bus
from eventbus.errors import did_you_mean
from eventbus.subscribers.jsonl import JsonlRecorder

__all__ = ["build_parser", "load_reactor", "main"]

logger = logging.getLogger("eventbus")

#: how long the JSONL recorder may take to write what is still queued at the end
RECORDER_CLOSE_TIMEOUT_S = 10.0


def _exit_codes(args: argparse.Namespace) -> dict[str, int]:
    """The run's exit codes by outcome (exit_codes.EXIT_CODES's names), as given."""
    return {"success": 0, "failure": 1, "stop": int(args.stop_exit_code),
            "hang": int(args.hang_exit_code), "drain": int(args.drain_exit_code),
            "bad_host": int(args.bad_host_exit_code)}


def _defined_callable(owner: object, name: str) -> bool:
    """A callable attribute that ``owner`` defines (an instance, or a function or class
    of its own module), not one it imported."""
    value = getattr(owner, name, None)
    if not callable(value):
        return False
    if isinstance(value, type) or inspect.isroutine(value):
        return getattr(value, "__module__", None) == getattr(owner, "__name__", None)
    return True


def load_reactor(spec: str) -> Any:
    """The reactor named by ``MODULE:ATTR`` (``ATTR`` may be dotted; a class is
    instantiated without arguments). Raises ``ValueError`` naming the problem."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--reactor {spec!r}: expected MODULE:ATTR, e.g. "
                         "--reactor my_reactors:stop_on_oom")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does, for the console script
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"--reactor {spec!r}: cannot import module {module_name!r} ({exc}); "
                         "is it on PYTHONPATH?") from exc
    owner = module_name
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            names = [n for n in dir(target) if not n.startswith("_")]
            callables = [n for n in names if _defined_callable(target, n)]
            listed = ", ".join(callables[:12]) + (", ..." if len(callables) > 12 else "")
            raise ValueError(
                f"--reactor {spec!r}: {owner!r} has no attribute {part!r}"
                f"{did_you_mean(part, names)}"
                + (f"; its callables: {listed}" if callables else "")) from None
        owner = f"{owner}.{part}"
    if isinstance(target, type):
        try:
            target = target()
        except TypeError as exc:
            raise ValueError(f"--reactor {spec!r}: the class cannot be built without "
                             f"arguments ({exc}); point at an instance instead") from exc
    if not callable(target):
        raise ValueError(f"--reactor {spec!r}: {type(target).__name__} is not callable; a "
                         "reactor is a callable (event) -> Decision | None")
    return target


def _ui_plugin(parser: argparse.ArgumentParser, args: argparse.Namespace, bus: Any) -> Any:
    """The job page's plugin of ``--ui`` (a bad address or token is a usage error)."""
    from eventbus.app.ui import UIPlugin
    from eventbus.app.ui import parse_address
    from eventbus.app.ui import resolve_token

    try:
        address = parse_address(args.ui)
        token, generated = resolve_token(address.host, args.ui_token)
    except ValueError as exc:
        parser.error(str(exc))
    return UIPlugin(bus, address, token, show_token=generated)


def main(argv: Sequence[str] | None = None, *,
         plugins: Sequence[AgentPlugin] | None = None,
         raise_child_failure: bool = False) -> int:
    """Run the job; returns the exit code (0 success, 1 failure).

    ``plugins``: the agent's plugins, exactly these (default:
    :func:`eventbus.app.launcher.agent.default_plugins`); a launcher script of your own
    adds one with ``main(argv, plugins=[*default_plugins(), MyPlugin()])``.
    ``raise_child_failure``: a failed job raises torch's ``ChildFailedError`` instead of
    returning 1, as ``torch.distributed.run.main`` does (:mod:`.torch_main`); eventbus's
    own outcomes (stop, hang, drain, bad host) still return their codes.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.run import run as torchrun_run

    from eventbus.app.launcher.agent import event_agent
    from eventbus.app.launcher.group.log_dir import JobLogDir

    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv),
                             namespace=slurm.unset_namespace())
    try:  # under srun: --nnodes, the rendezvous and its id from SLURM (docs/slurm.md)
        derived = slurm.fill_args(parser, args)
    except slurm.SlurmUsageError as exc:
        parser.error(str(exc))
    if derived is not None:
        console.write(derived)
    if slurm.export_node_name() is not None:
        from eventbus.context import refresh_context

        refresh_context()
    clash = exit_codes.clashes(_exit_codes(args))
    if clash is not None:
        parser.error(clash)
    if args.exclude_bad_hosts and _refuse_bad_host(args):
        return int(args.bad_host_exit_code)
    try:
        reactors = [load_reactor(spec) for spec in args.reactor]
    except ValueError as exc:
        parser.error(str(exc))
    bus = get_default_bus()
    recorder = None
    # the job's goodput as its events arrive: the sinks' gauges and the run's last line
    from eventbus.app.readers.goodput import GoodputTracker

    tracker = GoodputTracker()
    subscriptions = [bus.subscribe(ALL, on_event=tracker.observe)]
    # Built before the job, so that a bad --sink is a usage error (docs/sinks.md).
    sinks: list[Any] = []
    sink_plugin: Any = None  # the sinks and --alert-after's watch
    if args.sink or args.alert_after is not None:
        from eventbus.app.sinks import SinkError
        from eventbus.app.sinks import SinksPlugin
        from eventbus.app.sinks import make_sink

        try:
            for spec in args.sink:
                sinks.append(make_sink(spec))
        except SinkError as exc:
            from eventbus.app.sinks import close_sinks

            close_sinks(sinks, timeout=1.0)
            parser.error(str(exc))
        sink_plugin = SinksPlugin(bus, sinks, alert_after=args.alert_after)
        for sink in sinks:
            if hasattr(sink, "goodput_source"):
                sink.goodput_source = lambda: tracker.result(until=time.time())
        from eventbus.app.launcher.agent import default_plugins

        plugins = [*(default_plugins() if plugins is None else plugins), sink_plugin]
    ui_plugin = None
    if args.ui is not None:
        ui_plugin = _ui_plugin(parser, args, bus)
        from eventbus.app.launcher.agent import default_plugins

        plugins = [*(default_plugins() if plugins is None else plugins), ui_plugin]
        ui_plugin.plugins = list(plugins)
    elif args.ui_token is not None:
        parser.error("--ui-token: give --ui [HOST:]PORT too (the token guards the job page)")
    if args.events_jsonl:
        try:
            recorder = JsonlRecorder(args.events_jsonl)
        except OSError as exc:
            parser.error(f"--events-jsonl {args.events_jsonl!r}: {exc}")
        subscriptions.append(bus.subscribe(ALL, on_event=recorder))
    if args.log_events:
        import eventbus

        handler = eventbus.get_logging_handler()
        if handler.level == logging.NOTSET:
            handler.setLevel(logging.INFO)
    warm_spares = args.warm_spares
    if warm_spares is None:
        try:
            warm_spares = options.parse_warm_spares(
                os.environ.get(options.ENV_WARM_SPARES, "on"))
        except argparse.ArgumentTypeError as exc:
            parser.error(f"${options.ENV_WARM_SPARES}: {exc}")
    if warm_spares == "cuda" and not _cuda_seen():
        console.write("--warm-spares cuda: torch sees no CUDA device on this node; the "
                      "spares wait without a CUDA context")
    agents: list[Any] = []
    # without --log-dir: the workers' error files in a folder removed at the end
    log_dir = JobLogDir.for_job(args)
    try:
        with event_agent(bus=bus, reactors=reactors, plugins=plugins,
                         stall_timeout=args.stall_timeout, slow_factor=args.slow_factor,
                         stall_auto_floor_s=args.stall_auto_floor,
                         progress=",".join(args.progress) or "off",
                         stop_exit_code=args.stop_exit_code,
                         drain_signals=args.drain_signals, drain_grace_s=args.drain_grace,
                         drain_exit_code=args.drain_exit_code,
                         drain_signal_window_s=args.drain_signal_window,
                         requeue=args.requeue,
                         warm_spares=warm_spares, evict_after=args.evict_after,
                         host_ledger=args.host_ledger,
                         bad_host_exit_code=args.bad_host_exit_code) as agents:
            # torchrun's own error handling: the failure table and the root cause's error
            # file copied to the launcher's TORCHELASTIC_ERROR_FILE.
            record(torchrun_run)(args)
        if any(agent.evicted for agent in agents):  # in a drain too: requeue elsewhere
            return int(args.bad_host_exit_code)
        if any(agent.drain.active for agent in agents):
            return int(args.drain_exit_code)
    except ChildFailedError as exc:
        if any(agent.evicted for agent in agents):
            return int(args.bad_host_exit_code)
        if any(agent.drain.active for agent in agents):
            return int(args.drain_exit_code)
        if raise_child_failure and not any(agent.stopped_by_reactor or agent.ended_by_hang
                                           for agent in agents):
            raise
        print(str(exc), file=sys.stderr)
        if any(agent.stopped_by_reactor for agent in agents):
            return int(args.stop_exit_code)
        if any(agent.ended_by_hang for agent in agents):
            console.write(f"the restarts were spent on hangs: exit {args.hang_exit_code}")
            return int(args.hang_exit_code)
        return 1
    except Exception as exc:
        if any(agent.evicted for agent in agents):  # this host left the job (eviction.py)
            return int(args.bad_host_exit_code)
        if any(agent.drain.active for agent in agents):
            print(f"eventbus: the drained job's launcher ended with {type(exc).__name__}: "
                  f"{exc}", file=sys.stderr)
            return int(args.drain_exit_code)
        # e.g. the rendezvous closed under this node after another node's STOP
        if not any(agent.stopped_by_reactor for agent in agents):
            raise
        print(f"eventbus: the job was stopped by a reactor ({type(exc).__name__}: {exc})",
              file=sys.stderr)
        return int(args.stop_exit_code)
    finally:
        for sub in subscriptions:
            sub.cancel()
        if recorder is not None and not recorder.close(timeout=RECORDER_CLOSE_TIMEOUT_S):
            print(f"eventbus: {args.events_jsonl}: not every event was written "
                  f"({recorder.stats()})", file=sys.stderr)
        elif recorder is not None and recorder.lines_lost:
            # a full or read-only disk cost lines: the job's end says how many
            print(f"eventbus: {args.events_jsonl}: {recorder.lines_lost} lines were lost "
                  f"to failed writes (last error: {recorder.write_error or 'none now'}); "
                  f"{recorder.lines_written} written", file=sys.stderr)
        if sink_plugin is not None:  # closed within SINKS_CLOSE_TIMEOUT_S in all
            sink_plugin.close()
        if ui_plugin is not None:  # the open pages get the final state first
            ui_plugin.close(timeout=1.0)
        _goodput_line(tracker)
        if log_dir is not None:  # after the failure table and the error file's copy
            log_dir.close()
        requeue_after_job(agents)  # under SLURM: last, as it ends the job's processes
    return 0


def _refuse_bad_host(args: argparse.Namespace) -> bool:
    """``--exclude-bad-hosts``: whether this host scores over the threshold in the host
    ledger, said in one line. A ledger that cannot be read in time refuses nothing: the job
    is never held by it."""
    from eventbus.app.launcher.hosts.host_ledger import host_score
    from eventbus.app.launcher.hosts.score import DEFAULT_BAD_HOST_THRESHOLD
    from eventbus.context import current_context

    host = current_context().hostname
    threshold = args.bad_host_threshold if args.bad_host_threshold is not None \
        else DEFAULT_BAD_HOST_THRESHOLD
    if str(args.host_ledger).lower() == "off":
        console.write("--exclude-bad-hosts with --host-ledger off: no history to check; "
                      "starting")
        return False
    score = host_score(args.host_ledger, host)
    if score is None:
        console.write(f"--exclude-bad-hosts: the host ledger could not be read; {host} "
                      "starts")
        return False
    if score <= threshold:
        return False
    console.write(f"{host} scores {score:.2f} in the host ledger (over "
                  f"--bad-host-threshold {threshold:g}): refusing to start here (exit "
                  f"{args.bad_host_exit_code}: requeue on other hosts); eventbus hosts says why")
    return True


def _goodput_line(tracker: Any) -> None:
    """The run's last ``eventbus:`` line: the goodput and the biggest cause (docs/goodput.md;
    on group rank 0 the whole job's, elsewhere this node's view)."""
    try:
        result = tracker.result()
    except Exception:  # a figure must never cost the run its exit code
        logging.getLogger("eventbus").exception("eventbus: the goodput figure failed")
        return
    if result is not None and result.wall_s > 0:
        console.write(result.sentence() + " (eventbus goodput FILE for the table)")


def _cuda_seen() -> bool:
    """Whether torch sees a CUDA device here (without making a context in the agent)."""
    import torch

    try:
        return bool(torch.cuda.device_count() > 0)
    except Exception:
        return False
