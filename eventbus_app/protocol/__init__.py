"""The conversations between eventbus's processes, one module each, used by both ends.

* :mod:`eventbus.app.protocol.agent_worker`: the agent and its workers (the environment
  variables the agent sets, their one grammar, the request and dump files).

The worker-to-agent event stream over the c10d store is the core's
:mod:`eventbus.wire`; the job-wide STOP between agents is
:mod:`eventbus.app.launcher.drain.stop_signal` (both of its ends are agents).
"""
