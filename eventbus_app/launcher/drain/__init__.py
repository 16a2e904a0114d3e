"""The drain: a scheduler's signal ends the job with every rank's checkpoint, not a kill,
and a reactor's STOP reaches every node.

* :mod:`.state`: one agent's drain (the signals caught, the deadline, its line);
* :mod:`.monitor`: the drain as the agent runs it, tick by tick;
* :mod:`.notices`: the job-wide notice log (another node's drain heard, this one's told);
* :mod:`.stop_signal` and :mod:`.remote_stop`: the job-wide STOP through the job's store.
"""
