"""The agent plugin API of ``eventbus run``: what a plugin learns after each rendezvous
(:class:`RendezvousInfo`), what it implements (:class:`AgentPlugin`), and how plugins
are found (:func:`entry_point_plugins`). Torch-free; the agent
(:mod:`eventbus.app.launcher.agent`) and the sinks (:mod:`eventbus.app.sinks`) both build on
it, and neither imports the other for it.

Code that must run inside the agent process (the store transport that brings worker events
to the agent's bus, say) is an :class:`AgentPlugin`::

    class MyPlugin:
        def after_rendezvous(self, info: RendezvousInfo) -> Mapping[str, str]:
            ...  # start or re-arm what the new attempt needs
            return {"MY_VAR": "value"}          # added to the workers' environment
        def before_exit(self, *, timeout: float) -> None:
            ...  # drain within timeout; the agent publishes AGENT_EXIT afterwards

Plugins reach the agent in one of two ways, never by a module name in a string:

* passed explicitly: ``EventAgent(..., plugins=[MyPlugin()])`` or
  ``event_agent(plugins=[...])``; an explicit list is exactly the agent's plugins;
* found through the entry-point group :data:`PLUGIN_ENTRY_POINT_GROUP`
  (``eventbus.agent_plugins``) of installed distributions, each entry point naming a
  factory called without arguments::

      [project.entry-points."eventbus.agent_plugins"]
      my_plugin = "my_package.plugins:MyPlugin"

  Without an explicit list the agent runs the built-in store transport plus one plugin per
  entry point (:func:`eventbus.app.launcher.agent.default_plugins`).

Lifecycle, per agent process (one ``eventbus run``):

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

A plugin method that raises, and an entry point that fails to load or to build, is
reported on the ``eventbus`` logger and never fails the job. Plugins run in the agent's
monitor thread: they must not block for long.
"""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Mapping
from collections.abc import MutableMapping
from typing import Protocol
from typing import runtime_checkable

import attrs

from eventbus.bus import Bus

__all__ = [
    "FAILURE_DRAIN_TIMEOUT_S",
    "PLUGIN_ENTRY_POINT_GROUP",
    "AgentPlugin",
    "PluginFactory",
    "RendezvousInfo",
    "after_rendezvous",
    "before_exit",
    "drain",
    "entry_point_plugins",
    "plugin_name",
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

#: the entry-point group of third-party agent plugins (each names a factory)
PLUGIN_ENTRY_POINT_GROUP = "eventbus.agent_plugins"

logger = logging.getLogger("eventbus")


def entry_point_plugins(group: str = PLUGIN_ENTRY_POINT_GROUP) -> list[AgentPlugin]:
    """One plugin per entry point of ``group`` in the installed distributions, in name
    order. An entry point that cannot be loaded or built is reported and skipped."""
    plugins: list[AgentPlugin] = []
    for entry in sorted(importlib.metadata.entry_points(group=group), key=lambda e: e.name):
        try:
            factory = entry.load()
            plugins.append(factory())
        except Exception:
            logger.exception("agent plugin entry point %r (%s) failed to load; the plugin is "
                             "skipped", entry.name, entry.value)
    return plugins


# -- the lifecycle, as the agent runs it: a plugin's error never fails the job ----------


def plugin_name(plugin: object) -> str:
    """module.qualname of a plugin's class (or of a function, a reactor, a factory)."""
    name = getattr(plugin, "__qualname__", None) or type(plugin).__qualname__
    module = getattr(plugin, "__module__", None) or type(plugin).__module__
    return f"{module}.{name}"


def after_rendezvous(plugins: Iterable[AgentPlugin], info: RendezvousInfo,
                     environ: MutableMapping[str, str]) -> None:
    """Each plugin's ``after_rendezvous(info)``, in order; what it returns goes into
    ``environ`` (the agent's ``os.environ``, which the attempt's workers inherit). A plugin
    that raises, or returns anything but ``str -> str``, is reported and skipped."""
    for plugin in plugins:
        try:
            env = plugin.after_rendezvous(info)
            for key, value in (env or {}).items():
                if not isinstance(key, str) or not isinstance(value, str):
                    raise TypeError(f"after_rendezvous() must return str -> str env vars, "
                                    f"got {key!r}: {value!r}")
                environ[key] = value
        except Exception:
            logger.exception("agent plugin %s raised in after_rendezvous",
                             plugin_name(plugin))


def drain(plugins: Iterable[AgentPlugin], *,
          timeout: float = FAILURE_DRAIN_TIMEOUT_S) -> None:
    """Each plugin's optional ``drain(timeout=...)`` (before failures are decided on: what
    the failed workers sent first goes on the bus first)."""
    for plugin in plugins:
        method = getattr(plugin, "drain", None)
        if not callable(method):
            continue
        try:
            method(timeout=timeout)
        except Exception:
            logger.exception("agent plugin %s raised in drain", plugin_name(plugin))


def before_exit(plugins: Iterable[AgentPlugin], *, timeout: float) -> None:
    """Each plugin's ``before_exit(timeout=...)``, once, before ``AGENT_EXIT``."""
    for plugin in plugins:
        try:
            plugin.before_exit(timeout=timeout)
        except Exception:
            logger.exception("agent plugin %s raised in before_exit", plugin_name(plugin))

