"""Job health: what a silent rank is doing, who holds a stalled job up, and the stacks.

Torch-free, and below the worker, the readers and the launcher (docs/architecture.md):

* :mod:`.stacks`: the one reading of a Python stack dump (the script's frame, the top
  frames, eventbus's own threads marked), shared by the console, the tail and the page;
* :mod:`.evidence`: what a silent rank is doing, from the evidence its heartbeats carry
  (a collective, a save, data, busy, blocked, spinning);
* :mod:`.watches`: each worker's progress as the agent sees it (stalls, stragglers);
* :mod:`.culprit`: who holds a stalled job up, from each rank's latest collective;
* :mod:`.judge`: the verdict over the three: which ranks are stalled, which are slow;
* :mod:`.probes`: what the agent asks of a stalled group's processes (stacks, dumps).

The launcher's :mod:`eventbus.app.launcher.job_health` wires them into the agent.
"""
