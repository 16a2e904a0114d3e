"""What the agent decides when a worker fails, and how the job ends.

* :mod:`.failures`: the failed workers, in the order they failed, each one's ``WORKER_EXIT``;
* :mod:`.decider`: the reactors asked, their answers applied (STOP, RESTART, torchrun's
  policy), the job's end (state, exit code, cause, reason);
* :mod:`.exit_codes`: the exit codes of ``eventbus run`` as one table.

Torch-free; reads the drain through a protocol of its own, so the drain sits above it.
"""
