"""``eventbus run``: torchrun with the bus attached.

This module is torch-free; :mod:`eventbus.launcher.agent` (the agent) imports torch.

Agent plugins
-------------
Code that must run inside the agent process (the store receiver that brings worker events
to the agent's bus, say) registers a factory::

    from eventbus.launcher import register_agent_plugin

    class MyPlugin:
        def after_rendezvous(self, info: RendezvousInfo) -> Mapping[str, str]:
            ...  # start or re-arm what the new attempt needs
            return {"MY_VAR": "value"}          # added to the workers' environment
        def before_exit(self, *, timeout: float) -> None:
            ...  # drain within timeout; the agent publishes AGENT_EXIT afterwards

    register_agent_plugin(MyPlugin)

Lifecycle, per agent process (one ``eventbus run``):

* each factory is called once, when the agent is built (before the first rendezvous);
  a factory that raises is reported and skipped;
* ``after_rendezvous(info)`` runs after every completed rendezvous (first start, every
  restart, every membership change), before that attempt's workers start. The mapping it
  returns is put into the agent's ``os.environ``, which every worker of that attempt (and
  later ones, unless a later call overrides a key) inherits;
* ``before_exit(timeout=...)`` runs once, after the last worker group stopped and before
  ``AGENT_EXIT`` is published, whatever the outcome (success, failure, STOP, a signal);
* optional: ``drain(timeout=...)``, if the plugin defines it, runs when the monitor has
  found failed workers and before their ``WORKER_EXIT`` is published and the reactors
  decide, so that what those workers sent before they died (a NaN loss, say) is on the
  bus first. Budget: :data:`FAILURE_DRAIN_TIMEOUT_S` per plugin.

A plugin method that raises is reported on the ``eventbus`` logger and never fails the
job. Plugins run in the agent's monitor thread: they must not block for long.

Modules listed in :data:`BUILTIN_PLUGIN_MODULES` are imported by the launcher before the
agent is built; they register their factories at import time.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Protocol
from typing import runtime_checkable

import attrs

from eventbus.bus import Bus

__all__ = [
    "BUILTIN_PLUGIN_MODULES",
    "FAILURE_DRAIN_TIMEOUT_S",
    "AgentPlugin",
    "PluginFactory",
    "RendezvousInfo",
    "agent_plugin_factories",
    "main",
    "register_agent_plugin",
    "unregister_agent_plugin",
]


@attrs.frozen(kw_only=True)
class RendezvousInfo:
    """What a plugin learns after each rendezvous of the agent.

    ``store_host:store_port`` is a c10d ``TCPStore`` that outlives restarts of the worker
    group and is reachable from every node of the job: with the c10d rendezvous backend
    (``--standalone``, ``--rdzv-backend c10d``) the rendezvous store at the rendezvous
    endpoint (its real port, also when the endpoint asked for port 0); with the static
    backend the agents' store at ``--master-addr:--master-port``. Connect your own client
    to it (never block on a client shared with the rendezvous), and namespace keys by
    ``run_id`` and ``restart_count``: the store keeps them across attempts.
    """

    #: host of the long-lived c10d TCPStore (see the class docstring)
    store_host: str
    #: its real port
    store_port: int
    #: the job's run id (``--rdzv-id``; a uuid with ``--standalone``)
    run_id: str
    #: this agent's (node's) rank among the agents
    group_rank: int
    #: the number of agents (nodes) in this rendezvous
    group_world_size: int
    #: the attempt the workers about to start belong to (``TORCHELASTIC_RESTART_COUNT``)
    restart_count: int
    #: workers on this node (``--nproc-per-node``)
    local_world_size: int
    #: total workers in the job
    world_size: int
    #: global ranks of this node's workers, by local rank
    global_ranks: tuple[int, ...]
    #: the agent's bus: publish what arrives from workers here
    bus: Bus
    #: ``MASTER_ADDR:MASTER_PORT`` the workers of this attempt get (their own store)
    master_addr: str | None = None
    master_port: int | None = None


@runtime_checkable
class AgentPlugin(Protocol):
    """Something that runs inside the agent; see the module docstring for the lifecycle."""

    def after_rendezvous(self, info: RendezvousInfo) -> Mapping[str, str]:
        """Called after each rendezvous; returns env vars to add for the workers."""
        ...

    def before_exit(self, *, timeout: float) -> None:
        """Called once before the agent publishes ``AGENT_EXIT``; finish within ``timeout``."""
        ...


PluginFactory = Callable[[], AgentPlugin]

#: the budget of an optional ``plugin.drain(timeout=...)`` when workers failed, in seconds
FAILURE_DRAIN_TIMEOUT_S = 0.5

#: modules the launcher imports before building the agent; each registers its plugin
#: factories at import time (a module that is not installed is skipped)
BUILTIN_PLUGIN_MODULES: tuple[str, ...] = ("publishers.store_receiver",)

_factories: list[PluginFactory] = []
_lock = threading.Lock()


def register_agent_plugin(factory: PluginFactory) -> PluginFactory:
    """Register ``factory`` (a class or a function returning an :class:`AgentPlugin`).

    Every agent built afterwards in this process calls it once. Registering the same
    factory twice has no effect. Returns ``factory``, so it works as a decorator.
    """
    if not callable(factory):
        raise TypeError(f"register_agent_plugin() takes a callable returning an AgentPlugin, "
                        f"got {type(factory).__name__}")
    with _lock:
        if factory not in _factories:
            _factories.append(factory)
    return factory


def unregister_agent_plugin(factory: PluginFactory) -> None:
    """Forget ``factory``; unknown factories are ignored."""
    with _lock:
        if factory in _factories:
            _factories.remove(factory)


def agent_plugin_factories() -> list[PluginFactory]:
    """The registered factories, in registration order."""
    with _lock:
        return list(_factories)


def main(argv: Sequence[str] | None = None) -> int:
    """``eventbus run [--events-jsonl PATH] [--reactor MODULE:ATTR]... [--log-events]
    <torchrun options> SCRIPT [ARGS]``; returns the exit code."""
    # The command line (and torch) load only when the command runs.
    cli = importlib.import_module("eventbus.launcher.cli")
    return int(cli.main(argv))
