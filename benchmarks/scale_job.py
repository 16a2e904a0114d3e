"""The simulated job of benchmarks/bench_scale.py: its heartbeats, as a worker's progress
watch makes them and the real encoder writes them, and the process that pushes them.

A job of ``ranks`` ranks, 8 per node, one data-parallel process group (the world): every
rank beats once a second at its own offset in the second (uniformly spread). Group rank 0's
agent is measured (bench_scale.py); this plays everyone else: every other node's agent
pushes what its job forwarder would push to its node queue (kind ``"n"``, on the
forwarder's 50 ms flush grid, its own phase), and group rank 0's own 8 workers push to
their worker queues (kind ``"w"``, 20 ms grid) and ring the agent's doorbell. Each push
carries the beats that came in since the one before.

The heartbeat is the progress watch's (``eventbus_app/worker/progress.py``, ``_beat``):
``WORKER_PROGRESS`` with ``step``, ``collectives``, ``idle_s`` and ``data`` holding
``sources``, ``pgs`` (per process group: ``enqueued``, ``completed``, the group's member
ranks and its name), ``compute_s``, ``wait_s``, ``intervals`` and ``step_time_s``: its one
group being the world, each beat lists all the job's ranks, as the watch sends them.

The real encoder takes about 0.4 ms for an 8,192-rank beat, more than the simulator can
pay 8,192 times a second beside the agent on two cores, so each push is cut from a
template (:class:`BeatTemplate`): the real :class:`~eventbus.wire.BatchEncoder`'s output
for one heartbeat and for an empty push, with the counters, timestamp, context index and
sequence number spliced in, checked against the encoder byte for byte before the
simulator starts (:meth:`BeatTemplate.check`).
"""

from __future__ import annotations

import json
import math
import random
import re
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["RANKS_PER_NODE", "BeatTemplate", "beat_data", "context_of", "live_template",
           "simulate", "stalled_beats"]

RANKS_PER_NODE = 8
#: the forwarders' flush intervals: a node agent's job forwarder, a worker's forwarder
NODE_FLUSH_S = 0.05
WORKER_FLUSH_S = 0.02
#: the simulated training: steps and world-group collectives per second
STEPS_PER_S = 5
COLLECTIVES_PER_S = 50
#: the job's run id, and the store's host
RUN_ID = "scale"
HOST = "127.0.0.1"


# -- the heartbeat, as the worker's progress watch makes it ---------------------------------

def beat_data(members: Sequence[int], *, enqueued: int, completed: int,
              pending: dict[str, Any] | None = None, where: str | None = None,
              compute_s: float = 0.0182, wait_s: float = 0.0018, intervals: int = 50,
              step_time_s: float = 0.2) -> dict[str, Any]:
    """A heartbeat's ``data`` as ``ProgressWatch._beat`` builds it (in its key order) for a
    rank whose one process group, ``"0"``, has ``members``."""
    from eventbus.app.protocol.agent_worker import PROGRESS_SOURCES

    data: dict[str, Any] = {"sources": list(PROGRESS_SOURCES)}
    data["pgs"] = {"0": {"enqueued": enqueued, "completed": completed,
                         "ranks": list(members), "name": "0"}}
    data["compute_s"] = compute_s
    data["wait_s"] = wait_s
    data["intervals"] = intervals
    if pending:
        data["pending"] = pending
    data["step_time_s"] = step_time_s
    if where is not None:
        data["where"] = where
    return data


def context_of(rank: int, ranks: int) -> Any:
    """The context a worker of global ``rank`` in a job of ``ranks`` ranks records with."""
    from eventbus.context import JobContext

    node = rank // RANKS_PER_NODE
    return JobContext(rank=rank, local_rank=rank % RANKS_PER_NODE, group_rank=node,
                      world_size=ranks, local_world_size=RANKS_PER_NODE, role="default",
                      run_id=RUN_ID, restart_count=0, hostname=f"node{node:05d}",
                      pid=10_000 + rank % RANKS_PER_NODE)


#: values spliced into a template: each is written where the encoder wrote its sentinel
_SENTINELS = {"worker_id": 987654321001, "step": 987654321002, "collectives": 987654321003,
              "enqueued": 987654321004, "completed": 987654321005, "context": 987654321006}
_SENTINEL_TS = 987654321.0625
_SENTINEL_SEQ = 987654321007
_FIELD = re.compile("|".join([*map(str, _SENTINELS.values()), re.escape(repr(_SENTINEL_TS))]))
_BY_TEXT = {**{str(v): k for k, v in _SENTINELS.items()}, repr(_SENTINEL_TS): "timestamp"}
_DUMPS = json.JSONEncoder(allow_nan=False, separators=(",", ":"), check_circular=False).encode


class BeatTemplate:
    """Pushes of the wire format carrying heartbeats, cut from the real encoder's output.

    ``data`` is the heartbeat's ``data`` with :data:`_SENTINELS` ``enqueued``/``completed``
    where they vary (or fixed values), ``idle_s`` its idle time; :meth:`push` returns the
    bytes the encoder writes for a batch of such beats. :meth:`check` proves it, and
    raises where the encoder writes anything else.
    """

    def __init__(self, data: dict[str, Any], *, idle_s: float = 0.05, ranks: int) -> None:
        from eventbus.events import WorkerProgress
        from eventbus.wire import BatchEncoder

        self.data = data
        self.idle_s = idle_s
        self.ranks = ranks
        sample = WorkerProgress(worker_id=_SENTINELS["worker_id"], step=_SENTINELS["step"],
                                collectives=_SENTINELS["collectives"], idle_s=idle_s,
                                data=data, context=context_of(0, ranks),
                                timestamp=_SENTINEL_TS)
        ((value, _),) = BatchEncoder(kind="w", rank=0).encode([sample])
        text = value.decode("utf-8")
        entry = text[text.index('"ev":[') + len('"ev":['):-2]
        # the entry's context is its index in the batch's "ctx" list: a sentinel too
        entry = entry.replace('"context":0', f'"context":{_SENTINELS["context"]}', 1)
        self._parts: list[str] = []
        self._fields: list[str] = []
        at = 0
        for found in _FIELD.finditer(entry):
            self._parts.append(entry[at:found.start()])
            self._fields.append(_BY_TEXT[found.group()])
            at = found.end()
        self._parts.append(entry[at:])
        self._contexts: dict[int, str] = {}
        self._heads: dict[tuple[str, int], tuple[str, str, str]] = {}
        self.entry_bytes = len(entry) - sum(len(str(v)) for v in _SENTINELS.values())

    def head(self, encoder: Any) -> tuple[str, str, str]:
        """The push's text around its sequence number and its contexts, for ``encoder``'s
        sender (written by the encoder itself, for an empty push)."""
        key = (encoder.kind, encoder.rank)
        head = self._heads.get(key)
        if head is None:
            from eventbus.wire import BatchEncoder

            probe = BatchEncoder(kind=encoder.kind, rank=encoder.rank, sender=encoder.sender)
            probe.seq = _SENTINEL_SEQ
            ((value, _),) = probe.encode([])
            text = value.decode("utf-8")
            before, after = text.split(str(_SENTINEL_SEQ))
            middle, rest = after.split('"ctx":[]', 1)
            tail = rest[:-len("[]}")]  # ',"end":false,"ev":'
            head = self._heads[key] = (before, middle + '"ctx":[', '],' + tail[1:] + "[")
        return head

    def context_json(self, rank: int) -> str:
        text = self._contexts.get(rank)
        if text is None:
            text = self._contexts[rank] = _DUMPS(context_of(rank, self.ranks).to_dict())
        return text

    def push(self, encoder: Any, beats: Sequence[tuple[int, float, int, int, int, int]]
             ) -> bytes:
        """The push ``encoder`` writes for ``beats``, each ``(rank, timestamp, step,
        collectives, enqueued, completed)``, numbered from ``encoder.seq`` (advanced)."""
        before, middle, after = self.head(encoder)
        contexts = []
        entries = []
        parts, fields = self._parts, self._fields
        for index, (rank, stamp, step, collectives, enqueued, completed) in enumerate(beats):
            contexts.append(self.context_json(rank))
            values = {"worker_id": rank, "step": step, "collectives": collectives,
                      "enqueued": enqueued, "completed": completed, "context": index,
                      "timestamp": stamp}
            out = [parts[0]]
            for name, part in zip(fields, parts[1:], strict=True):
                value = values[name]
                out.append(repr(value) if name == "timestamp" else str(value))
                out.append(part)
            entries.append("".join(out))
        text = (f"{before}{encoder.seq}{middle}{','.join(contexts)}{after}"
                f"{','.join(entries)}]}}")
        encoder.seq += len(beats)
        return text.encode("utf-8")

    def end(self, encoder: Any) -> bytes:
        """The sender's end marker, as the encoder writes it (``encode([], end=True)``)."""
        before, middle, after = self.head(encoder)
        text = f"{before}{encoder.seq}{middle}{after}]}}".replace(
            '"end":false', '"end":true', 1)
        return text.encode("utf-8")

    def check(self, *, kind: str = "n", rank: int = 1) -> None:
        """Raise unless :meth:`push` and :meth:`end` write what the encoder writes for
        real events of the same values (a 3-beat batch of ``rank``'s node, numbered from
        41, then its end marker)."""
        from eventbus.events import WorkerProgress
        from eventbus.wire import BatchEncoder

        ranks = [rank * RANKS_PER_NODE + i for i in (0, 3, 5)] if kind == "n" else [rank]
        beats = [(r, 1.7e9 + 0.123456 * i, 7 + i, 350 + i, 351 + i, 350 + i)
                 for i, r in enumerate(ranks)]
        events = []
        for r, stamp, step, collectives, enqueued, completed in beats:
            data = _respliced(self.data, enqueued, completed)
            events.append(WorkerProgress(worker_id=r, step=step, collectives=collectives,
                                         idle_s=self.idle_s, data=data,
                                         context=context_of(r, self.ranks),
                                         timestamp=stamp))
        real = BatchEncoder(kind=kind, rank=rank)  # type: ignore[arg-type]
        real.seq = 41
        ours = BatchEncoder(kind=kind, rank=rank, sender=real.sender)  # type: ignore[arg-type]
        ours.seq = 41
        want = [value for value, _ in real.encode(events)]
        want += [value for value, _ in real.encode([], end=True)]
        got = [self.push(ours, beats), self.end(ours)]
        if got != want:
            raise RuntimeError("the simulator's pushes differ from the encoder's: "
                               f"{got[0][:300]!r}... != {want[0][:300]!r}...")


def _respliced(data: dict[str, Any], enqueued: int, completed: int) -> dict[str, Any]:
    """``data`` with the group's sentinel counters replaced by these values."""
    out = dict(data)
    pgs = {}
    for pg, given in data["pgs"].items():
        info = dict(given)
        if info["enqueued"] == _SENTINELS["enqueued"]:
            info["enqueued"] = enqueued
        if info["completed"] == _SENTINELS["completed"]:
            info["completed"] = completed
        pgs[pg] = info
    out["pgs"] = pgs
    return out


def live_template(ranks: int, *, members: bool) -> BeatTemplate:
    """The healthy training heartbeat of a ``ranks``-rank job (``members``: the world
    group's member list in each beat, as the progress watch sends it)."""
    return BeatTemplate(beat_data(range(ranks) if members else (),
                                  enqueued=_SENTINELS["enqueued"],
                                  completed=_SENTINELS["completed"]), ranks=ranks)


# -- the simulator process -----------------------------------------------------------------

Push = tuple[float, str, int, tuple[int, ...]]


def _schedule(ranks: int, seed: int = 1, period: float = 1.0
              ) -> tuple[list[Push], list[float]]:
    """One beat interval (``period`` seconds) of the job's pushes, ``(time in it, kind, node
    or rank, the ranks whose beats it carries)``, sorted, and each rank's offset in it.
    Every rank beats at its own offset; a node's agent pushes on its forwarder's 50 ms grid
    (its own phase), group rank 0's workers each on a 20 ms grid."""
    rng = random.Random(seed)
    offsets = [rng.random() * period for _ in range(ranks)]
    out: list[Push] = []
    for node in range(ranks // RANKS_PER_NODE):
        members = range(node * RANKS_PER_NODE, (node + 1) * RANKS_PER_NODE)
        if node == 0:  # group rank 0's own workers: their forwarders, the doorbell
            for r in members:
                phase = rng.random() * WORKER_FLUSH_S
                tick = phase + math.ceil((offsets[r] - phase) / WORKER_FLUSH_S) * WORKER_FLUSH_S
                out.append((tick, "w", r, (r,)))
            continue
        phase = rng.random() * NODE_FLUSH_S
        by_tick: dict[float, list[int]] = {}
        for r in members:
            k = math.ceil((offsets[r] - phase) / NODE_FLUSH_S)
            by_tick.setdefault(phase + k * NODE_FLUSH_S, []).append(r)
        out += [(tick, "n", node, tuple(sorted(rs, key=lambda r: offsets[r])))
                for tick, rs in by_tick.items()]
    out.sort()
    return out, offsets


def simulate(port: int, ranks: int, seconds: float, warmup: float,
             members: bool, period: float = 1.0) -> dict[str, Any]:
    """The simulator process: pushes the job's heartbeats, one per rank every ``period``
    seconds (the interval the agent sets for the job's size), for ``seconds`` (warm-up
    included) from the agent's go, then every sender's end marker; returns its figures.

    Started as soon as the agent's store listens: it builds and checks its pushes while
    the agent sets up, then reads the agent's doorbell key (``scale/bell``) at the go."""
    from eventbus.store_client import connect_store
    from eventbus.wire import BatchEncoder
    from eventbus.wire import namespace
    from eventbus.wire import node_key
    from eventbus.wire import worker_key

    client = connect_store(HOST, port, timeout=60.0)
    prefix = namespace(RUN_ID, 0)
    template = live_template(ranks, members=members)
    template.check(kind="n", rank=1)
    template.check(kind="w", rank=3)
    schedule, offsets = _schedule(ranks, period=period)
    encoders = {("n", node): BatchEncoder(kind="n", rank=node)
                for node in range(1, ranks // RANKS_PER_NODE)}
    encoders.update({("w", r): BatchEncoder(kind="w", rank=r) for r in range(RANKS_PER_NODE)})
    keys = {("n", node): node_key(prefix, node) for node in range(1, ranks // RANKS_PER_NODE)}
    keys.update({("w", r): worker_key(prefix, r) for r in range(RANKS_PER_NODE)})
    for encoder in encoders.values():
        template.head(encoder)
    for r in range(ranks):
        template.context_json(r)
    ring = {r: worker_key(prefix, r).encode("utf-8") for r in range(RANKS_PER_NODE)}
    client.set("scale/ready", "1")
    client.wait(["scale/go"])
    t0 = float(client.get("scale/go").decode())
    bell = client.get("scale/bell").decode("utf-8")
    cpu0 = time.process_time()
    lags: list[float] = []
    stamps: list[float] = []
    pushes: list[float] = []
    end = t0 + seconds
    push = client.queue_push
    clock, sleep = time.time, time.sleep
    for cycle in range(math.ceil(seconds / period)):
        if client.check(["scale/stop"]):  # the agent fell behind: its window has ended
            end = float(client.get("scale/stop").decode())
            break
        base = t0 + cycle * period
        for tick, kind, who, rs in schedule:
            due = base + tick
            ahead = due - clock()
            if ahead > 0.0002:
                sleep(ahead)
            step = STEPS_PER_S * (cycle + 1)
            done = COLLECTIVES_PER_S * (cycle + 1)
            batch = [(r, base + offsets[r], step, done, done, done) for r in rs]
            encoder = encoders[(kind, who)]
            push(keys[(kind, who)], template.push(encoder, batch))
            if kind == "w":
                push(bell, ring[who])
            lags.append(clock() - due)
            pushes.append(due)
            stamps.extend(b[1] for b in batch)
    cpu = time.process_time() - cpu0
    elapsed = min(clock(), end) - t0
    for (kind, who), encoder in encoders.items():
        push(keys[(kind, who)], template.end(encoder))
    lags.sort()
    return {"pushes/s": sum(1 for t in pushes if t < end) / elapsed,
            "beats/s": sum(1 for t in stamps if t < end) / elapsed,
            "beats in window": sum(1 for t in stamps if t0 + warmup <= t < end),
            "window end": end,
            "lag p50 ms": lags[len(lags) // 2] * 1e3 if lags else 0.0,
            "lag p99 ms": lags[int(len(lags) * 0.99)] * 1e3 if lags else 0.0,
            "cpu %": cpu / max(clock() - t0, 1e-9) * 100, "t0": t0,
            "entry bytes": template.entry_bytes}


def stalled_beats(ranks: int, *, members: bool = True) -> tuple[list[Any], int]:
    """Every rank's latest heartbeat at a stall, decoded by the receiver's decoder from
    node pushes: all wait in all_reduce #K+1 of the world group, except the culprit (a rank
    on another node), which has not entered it. Returns (events, the culprit's rank)."""
    from eventbus.wire import BatchDecoder
    from eventbus.wire import BatchEncoder

    k = 4_000
    culprit_rank = ranks // 2 + 3
    group = range(ranks) if members else ()
    pending = {"0": {"seq": k + 1, "op": "allreduce", "sizes": [[4096, 1024]],
                     "dtypes": ["Float"], "state": "started"}}
    waiting = BeatTemplate(beat_data(group, enqueued=k + 1, completed=k, pending=pending),
                           idle_s=300.0, ranks=ranks)
    late = BeatTemplate(beat_data(group, enqueued=k, completed=k, where="train.py:57 in "
                                  "load_batch"), idle_s=300.0, ranks=ranks)
    decoder = BatchDecoder()
    events: list[Any] = []
    stamp = time.time()
    for node in range(ranks // RANKS_PER_NODE):
        encoder = BatchEncoder(kind="n", rank=node)
        for r in range(node * RANKS_PER_NODE, (node + 1) * RANKS_PER_NODE):
            template = late if r == culprit_rank else waiting
            value = template.push(encoder, [(r, stamp, 800, k, k, k)])
            batch = decoder.batch(value, kind="n", rank=node)
            decoder.publish_all(batch.entries, batch.contexts, events.append,
                                _refuse)
    return events, culprit_rank


def _refuse(reason: str) -> None:
    raise RuntimeError(f"the decoder refused a simulated beat: {reason}")
