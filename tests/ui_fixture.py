"""Synthetic events files for the job view.

:func:`write_64_rank_job`: a 64-rank job (8 nodes x 8): attempt 0 ends with rank 37's CUDA
out-of-memory error and a restart; in attempt 1 rank 12 is a straggler and rank 50 stalls
in an all_reduce the others wait in. The file ends with the job still running, its last
events ``now``. What the page's screenshot in docs/ shows.

:func:`write_large_job`: a job of 8,192 ranks (1,024 nodes x 8) beating its
``WORKER_PROGRESS`` heartbeats, one rank stalled: the page and ``/api/state`` at scale
(tests/test_ui_scale.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eventbus.context import JobContext
from eventbus.encoding import event_line
from eventbus.events import AgentStart
from eventbus.events import WorkerProgress
from eventbus.events import WorkerStalled
from eventbus.events import WorkerStart

__all__ = ["LARGE_RANKS", "RANKS", "write_64_rank_job", "write_large_job"]

RANKS = 64
NODES = 8

_TRACEBACK = """Traceback (most recent call last):
  File "train.py", line 88, in <module>
    main()
  File "train.py", line 71, in main
    loss = model(batch).loss
  File "torch/nn/modules/module.py", line 1773, in _wrapped_call_impl
    return self._call_impl(*args, **kwargs)
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 5; 79.15 GiB total \
capacity; 76.02 GiB already allocated)"""

_STACK = """Thread 0x7f3a2c1ff740 (most recent call first) [main]:
  File "torch/distributed/distributed_c10d.py", line 2806 in all_reduce
  File "train.py", line 64 in sync_grads
  File "train.py", line 73 in main
  File "train.py", line 88 in <module>
Thread 0x7f3a1e7fc640 [eventbus: progress watch]:
  File "eventbus_app/worker/progress.py", line 120 in _run"""


def _line(kind: str, t: float, ctx: dict[str, Any], data: dict[str, Any] | None = None,
          **fields: Any) -> str:
    context = {"rank": None, "local_rank": None, "group_rank": None, "world_size": RANKS,
               "local_world_size": 8, "role": "default", "run_id": "llm-pretrain-7b",
               "restart_count": 0, "hostname": "gpu-node-0", "pid": 1000, **ctx}
    return json.dumps({"type": kind, "timestamp": t, **fields, "data": data or {},
                       "context": context})


def write_64_rank_job(path: Path, now: float) -> None:
    """Write the job's events to ``path``; its last events are at ``now``."""
    t0 = now - 300.0
    out: list[str] = []

    def agent(node: int, attempt: int) -> dict[str, Any]:
        return {"group_rank": node, "restart_count": attempt, "hostname": f"gpu-node-{node}",
                "pid": 900 + node}

    def worker(rank: int, attempt: int) -> dict[str, Any]:
        node = rank // 8
        return {"rank": rank, "local_rank": rank % 8, "group_rank": node,
                "restart_count": attempt, "hostname": f"gpu-node-{node}",
                "pid": 10_000 + attempt * 100 + rank}

    out.append(_line("AGENT_START", t0, {"hostname": "gpu-node-0", "pid": 900},
                     entrypoint="train.py", max_restarts=3, nproc_per_node=8))
    out.append(_line("RENDEZVOUS", t0 + 2, agent(0, 0), state="SUCCEEDED", name="c10d",
                     duration_s=1.9))
    for rank in range(RANKS):
        out.append(_line("WORKER_START", t0 + 2.5, agent(rank // 8, 0), worker_id=rank,
                         worker_local_rank=rank % 8, worker_pid=10_000 + rank))
    for step in range(0, 120, 20):
        for rank in range(RANKS):
            out.append(_line("METRIC", t0 + 10 + step * 0.8 + rank * 0.001,
                             worker(rank, 0), {"loss": 3.2 - step * 0.004}, step=step))
    fail_at = t0 + 110
    out.append(_line("WORKER_EXIT", fail_at, agent(4, 0), {"attempt": 0}, worker_id=37,
                     exit_code=1, worker_local_rank=5, worker_pid=10_037,
                     message=_TRACEBACK))
    for rank in range(RANKS):
        if rank != 37:
            out.append(_line("WORKER_EXIT", fail_at + 0.4, agent(rank // 8, 0),
                             {"attempt": 0, "stopped_by_agent": True}, worker_id=rank,
                             exit_code=-15, signal="SIGTERM", worker_local_rank=rank % 8,
                             worker_pid=10_000 + rank))
    out.append(_line("WORKER_RESTART", fail_at + 1, agent(0, 1), attempt=1, restarts_left=2,
                     reason="rank 37 exited with code 1 (torch.OutOfMemoryError: CUDA out "
                            "of memory)"))
    t1 = fail_at + 4
    for rank in range(RANKS):
        out.append(_line("WORKER_START", t1, agent(rank // 8, 1), worker_id=rank,
                         worker_local_rank=rank % 8, worker_pid=10_100 + rank))
    last_step = 0
    for step in range(100, 460, 20):
        for rank in range(RANKS):
            if rank == 50 and step > 380:
                continue
            lag = 1.9 if rank == 12 else 1.0
            t = t1 + 8 + (step - 100) * 0.45 * lag + rank * 0.002
            if t > now - 1:
                continue
            out.append(_line("METRIC", t, worker(rank, 1), {"loss": 2.7 - step * 0.002},
                             step=step if rank != 12 else step * 10 // 19))
            last_step = max(last_step, step)
    out.append(_line("WORKER_SLOW", now - 60, agent(1, 1), worker_id=12, factor=1.9,
                     step_time_s=0.86, median_step_time_s=0.45, step=180))
    for rank in range(RANKS):
        beat = {"where": "train.py:64 in sync_grads"} if rank != 50 else {
            "where": "train.py:64 in sync_grads", "stack": _STACK}
        out.append(_line("WORKER_PROGRESS", now - 0.5 - (rank % 7) * 0.1, worker(rank, 1),
                         beat, worker_id=rank, step=last_step if rank != 50 else 380,
                         collectives=4000 + last_step, idle_s=0.2 if rank != 50 else 41.0))
    out.append(_line("WORKER_STALLED", now - 2, agent(6, 1), {
        "stack": _STACK,
        "diagnosis": "Rank 50 has not entered all_reduce #4381 on the default group that "
                     "the other 63 ranks wait in: it is the culprit; its main thread is in "
                     "train.py:64 sync_grads.",
        "culprit_ranks": [50], "waiting_ranks": [r for r in range(RANKS) if r != 50],
        "collective": {"pg": "0", "op": "all_reduce", "seq": 4381, "sizes": [[4096, 4096]],
                       "dtypes": ["Float"]}},
        worker_id=50, silent_s=41.0, timeout_s=30.0, worker_local_rank=2,
        worker_pid=10_150))
    out.sort(key=lambda line: json.loads(line)["timestamp"])
    path.write_text("\n".join(out) + "\n")


#: the ranks of :func:`write_large_job`'s job (1,024 nodes x 8)
LARGE_RANKS = 8192


def write_large_job(path: Path, now: float, *, ranks: int = LARGE_RANKS, beats: int = 12,
                    stalled: int = 4242) -> int:
    """Write a ``ranks``-rank job's events to ``path``, ending at ``now`` with the job
    running: its start, each rank's ``WORKER_START`` and ``beats`` ``WORKER_PROGRESS``
    heartbeats (two seconds apart), except that rank ``stalled`` stops beating halfway
    and is reported stalled. Each rank's events are eventbus's own classes encoded as
    ``eventbus run --events-jsonl`` writes them (a beat's time, step and collectives
    changed on its rank's first encoded beat: 100,000 classes built would take seconds).
    Returns how many events were written."""
    t0 = now - beats * 2.0 - 6.0

    def agent(node: int) -> JobContext:
        return JobContext(group_rank=node, world_size=ranks, local_world_size=8,
                          role="default", run_id="large", restart_count=0,
                          hostname=f"node-{node}", pid=900 + node)

    def worker(rank: int) -> JobContext:
        return JobContext(rank=rank, local_rank=rank % 8, group_rank=rank // 8,
                          world_size=ranks, local_world_size=8, role="default",
                          run_id="large", restart_count=0, hostname=f"node-{rank // 8}",
                          pid=10_000 + rank)

    lines = [AgentStart(entrypoint="train.py", max_restarts=3, nproc_per_node=8,
                        timestamp=t0, data={}, context=agent(0)).to_json()]
    lines.extend(WorkerStart(worker_id=rank, worker_local_rank=rank % 8,
                             worker_pid=10_000 + rank, timestamp=t0 + 1.0, data={},
                             context=agent(rank // 8)).to_json() for rank in range(ranks))
    beat = [WorkerProgress(worker_id=rank, step=0, collectives=0, idle_s=0.1,
                           timestamp=t0, data={"where": "train.py:64 in sync_grads"},
                           context=worker(rank)).to_dict() for rank in range(ranks)]
    for number in range(beats):
        for rank in range(ranks):
            if rank == stalled and number >= beats // 2:
                continue
            lines.append(event_line({**beat[rank], "timestamp": t0 + 4.0 + 2.0 * number
                                     + rank * 1e-5, "step": 10 * number,
                                     "collectives": 1000 + number}))
    silent = 2.0 * (beats - beats // 2) + 1.0
    lines.append(WorkerStalled(
        worker_id=stalled, silent_s=silent, timeout_s=silent - 2.0, worker_pid=10_000 + stalled,
        worker_local_rank=stalled % 8, timestamp=now - 0.5,
        data={"diagnosis": f"Rank {stalled} has made no progress for {silent:.0f} s while "
                           f"the other {ranks - 1} ranks wait in all_reduce.",
              "culprit_ranks": [stalled],
              "waiting_ranks": [r for r in range(ranks) if r != stalled]},
        context=agent(stalled // 8)).to_json())
    path.write_text("\n".join(lines) + "\n")
    return len(lines)
