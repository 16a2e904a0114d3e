"""The mark that says an event points at the machine, not at the script.

An agent that tells a host fault (:func:`eventbus.app.launcher.hosts.faults.host_fault`)
puts its kind under :data:`HOST_FAULT_KEY` in the ``data`` of the ``WORKER_EXIT`` or
``WORKER_STALLED`` it publishes. Every agent's eviction reads it, from its own bus and from
the job's notice log, and so does the host ledger built from events files (``eventbus hosts
--from``): one key, written by one end and read by the others.
"""

from __future__ import annotations

__all__ = ["HOST_FAULT_KEY"]

#: the key of ``WORKER_EXIT.data`` / ``WORKER_STALLED.data`` that names the kind
HOST_FAULT_KEY = "host_fault"
