"""A reactor's STOP on one node reaches every node: a key in the job's long-lived c10d store.

Without it, the other agents see only that their workers lost their peers: they restart,
find the rendezvous closed, and exit 1, so a scheduler retries a job that a reactor said
must not be retried. With it (docs/run.md, "Job health", several nodes):

* the agent whose reactor STOPs sets ``eventbus/stop/<run id>`` to the reason, then, on its
  way out, waits up to :data:`STOP_ACK_TIMEOUT_S` for every other agent's acknowledgement
  (its process may host the store: leaving at once could take the key with it);
* every agent of a job with several nodes watches the key from a thread, every
  :data:`STOP_POLL_S`; one that sees it acknowledges, stops its workers at its next monitor
  round (SIGTERM, SIGKILL after the stall grace) and ends with ``--stop-exit-code`` too,
  also when its rendezvous was closed under it.

So each agent ends within about ``STOP_POLL_S + --monitor-interval + 5 s`` (the grace) of
the STOP, and the STOP node within ``STOP_ACK_TIMEOUT_S`` more at worst.

A STOP on one node usually ends the other nodes' workers too (they lose their peers), so
another node's agent may be about to restart when the key is set: before it restarts, an
agent looks for the key for up to :data:`RESTART_GRACE_S` (:meth:`StopSignal.wait_remote`),
and stops instead of restarting if it appears (seen without it under load: a node
restarted once, then stopped).

That look ends early when every other node of the group decided to restart the same
attempt: each agent about to restart sets ``eventbus/stop/<run id>/restart/<attempt>/<group
rank>`` first, and one that finds the others' keys there knows no STOP can come for that
attempt (a node that STOPs sets no restart key). A restart of several nodes then waits for
the slowest node's decision, not a whole second; a node that decides nothing (its workers
still healthy, or it is gone) leaves the look at its full length, as before.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from eventbus.store_client import connect_store

__all__ = ["RESTART_GRACE_S", "RESTART_POLL_S", "STOP_ACK_TIMEOUT_S", "STOP_POLL_S",
           "StopSignal"]

logger = logging.getLogger("eventbus")

#: how often every agent looks for another node's STOP
STOP_POLL_S = 0.5
#: how long the STOP node waits for the others to acknowledge before it exits
STOP_ACK_TIMEOUT_S = 10.0
#: how long an agent about to restart its group looks for another node's STOP first
RESTART_GRACE_S = 1.0
#: how often it looks meanwhile (the STOP key, and the other nodes' restart keys)
RESTART_POLL_S = 0.02


class StopSignal:
    """One agent's view of the job-wide STOP key, on its own client of the store."""

    def __init__(self, *, host: str, port: int, run_id: str, group_rank: int,
                 group_world_size: int) -> None:
        self.host, self.port = host, port
        self.key = f"eventbus/stop/{run_id}"
        self.group_rank = group_rank
        self.group_world_size = group_world_size
        #: the reason another node stopped the job, once seen
        self.remote: str | None = None
        self.announced = False
        #: restarts whose look ended early: every other node had decided to restart
        self.agreed = 0
        self._lock = threading.Lock()
        self._client: Any = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="eventbus-stop-watch",
                                        daemon=True)

    def _store(self) -> Any:
        if self._client is None:
            self._client = connect_store(self.host, self.port, timeout=5.0)
        return self._client

    def start(self) -> None:
        """Watch for another node's STOP (idempotent)."""
        if not self._thread.is_alive() and not self._done.is_set():
            self._thread.start()

    def _ack_key(self, rank: int) -> str:
        return f"{self.key}/ack/{rank}"

    def _look(self) -> bool:
        """One look at the key (with the lock held): True once it is set (``remote`` then
        holds its reason, and this node acknowledged it)."""
        store = self._store()
        if not store.check([self.key]):
            return False
        reason = store.get(self.key).decode("utf-8", "replace")
        if not self.announced:
            self.remote = reason
        store.set(self._ack_key(self.group_rank), b"1")
        return True

    def _watch(self) -> None:
        while not self._done.wait(STOP_POLL_S):
            try:
                with self._lock:
                    if not self._look():
                        continue
                return
            except Exception as exc:  # the store is gone: the job is ending anyway
                logger.debug("eventbus: STOP watch: %s", exc)
                return

    def _restart_key(self, attempt: int, rank: int) -> str:
        return f"{self.key}/restart/{attempt}/{rank}"

    def wait_remote(self, timeout: float = RESTART_GRACE_S, *,
                    attempt: int | None = None) -> str | None:
        """Look for another node's STOP now, and every :data:`RESTART_POLL_S` for up to
        ``timeout`` seconds (the agent, before it restarts ``attempt``): its reason, or
        None. With ``attempt``, this node's restart key is set first, and the look ends
        as soon as every other node's is there (:attr:`agreed` counts those looks)."""
        deadline = time.monotonic() + timeout
        others: list[str] = []
        if attempt is not None and self.group_world_size > 1:
            others = [self._restart_key(attempt, r) for r in range(self.group_world_size)
                      if r != self.group_rank]
            try:
                with self._lock:
                    self._store().set(self._restart_key(attempt, self.group_rank), b"1")
            except Exception as exc:  # the store is gone: the look below says so
                logger.debug("eventbus: restart key: %s", exc)
        while self.remote is None and not self.announced:
            try:
                with self._lock:
                    if self._look():
                        break
                    if others and self._store().check(others):
                        self.agreed += 1
                        break
            except Exception as exc:  # the store is gone: no STOP can be read from it
                logger.debug("eventbus: STOP look: %s", exc)
                break
            if time.monotonic() >= deadline:
                break
            time.sleep(RESTART_POLL_S)
        return self.remote

    def announce(self, reason: str) -> None:
        """Tell the other nodes that this node's reactor stopped the job."""
        self.announced = True
        try:
            with self._lock:
                self._store().set(self.key, reason.encode("utf-8"))
        except Exception:
            logger.exception("eventbus: cannot tell the other nodes about the STOP; they "
                             "will end when their workers lose their peers")

    def wait_for_acks(self, timeout: float = STOP_ACK_TIMEOUT_S) -> bool:
        """After :meth:`announce`: wait until every other node acknowledged (True) or
        ``timeout`` passed (False)."""
        others = [self._ack_key(r) for r in range(self.group_world_size)
                  if r != self.group_rank]
        deadline = time.monotonic() + timeout
        while True:
            try:
                with self._lock:
                    if self._store().check(others):
                        return True
            except Exception:
                return False
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)

    def close(self) -> None:
        """Stop watching."""
        self._done.set()
