"""What ``eventbus run --ui`` costs the agent per event, and what a page's refresh costs.

The agent publishes every event that reaches it (the store receiver's thread for the
workers' events, the monitor thread for its own) on its bus; ``--ui`` adds one subscriber,
:class:`eventbus.app.ui.state.JobState`. Timed here, on a private bus: ``bus.publish(event)``
of pre-built events from a 64-rank job (``METRIC`` with a step, ``WORKER_PROGRESS``
heartbeats, alternating ranks), wall time per event over batches, median of interleaved
rounds:

* ``--ui off``: the bus with one no-op subscriber (the agent always has some: the health
  watch, the JSONL recorder);
* ``--ui on``: the same plus the job state, its folder thread running (the bus only
  appends the event to the state's pending deque; the folding into the summaries happens
  on the folder's thread, which competes for the interpreter but is not this thread);
* ``--ui on, 50 open pages``: the same with the server running and 50 stream clients
  connected and reading (their threads compete with the publisher for the interpreter);
* for scale, ``one --sink (queue enqueue)``: the no-op subscriber plus a
  :class:`~eventbus.subscribers.queued.QueuedSink` in front of a no-op backend, what each
  ``--sink`` adds.

``ns/event`` is the publishing thread's CPU time (``time.thread_time``: on a shared
machine the time other processes take lands on no case); ``wall ns/event`` is wall time,
which for the 50-pages case includes the pages' threads holding the interpreter.

The view's side, on its own threads: folding the events into the summaries (``fold()`` of a
batch, CPU time per event), and one ``snapshot()`` of the 64-rank state as JSON (built at
most once per 0.25 s whatever the number of pages).
"""

from __future__ import annotations

import socket
import statistics
import threading
import time
from typing import Any

__all__ = ["run"]

RANKS = 64


def _events(n: int) -> list[Any]:
    from eventbus.events import Event

    t = time.time()
    out = []
    for i in range(n):
        rank = i % RANKS
        context = {"rank": rank, "world_size": RANKS, "local_world_size": 8,
                   "group_rank": rank // 8, "run_id": "bench", "restart_count": 0,
                   "hostname": f"node-{rank // 8}", "pid": 1000 + rank}
        if i % 8 == 7:
            raw = {"type": "WORKER_PROGRESS", "timestamp": t, "worker_id": rank, "step": i,
                   "collectives": i * 3, "idle_s": 0.1, "data": {"where": "train.py:10"},
                   "context": context}
        else:
            raw = {"type": "METRIC", "timestamp": t, "step": i // RANKS,
                   "data": {"loss": 1.0 / (1 + i), "lr": 0.001}, "context": context}
        out.append(Event.from_dict(raw))
    return out


def _reader(port: int, stop: threading.Event) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"GET /api/stream HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        while not stop.is_set():
            try:
                if not sock.recv(65536):
                    return
            except OSError:
                return


def run(*, quick: bool = False) -> dict[str, Any]:
    """``rows``: per case the median ns per published event; the snapshot's cost."""
    from eventbus.app.ui.server import UIServer
    from eventbus.app.ui.server import dumps
    from eventbus.app.ui.state import JobState
    from eventbus.bus import ALL
    from eventbus.bus import Bus
    from eventbus.subscribers.queued import QueuedSink

    rounds = 3 if quick else 15
    batch = 2_000 if quick else 20_000
    events = _events(batch)

    def noop(event: Any) -> None:
        pass

    def timed(bus: Bus) -> tuple[float, float]:
        publish = bus.publish
        c0, t0 = time.thread_time(), time.perf_counter()
        for event in events:
            publish(event)
        return ((time.thread_time() - c0) / batch * 1e9,
                (time.perf_counter() - t0) / batch * 1e9)

    off = Bus("bench-ui-off")
    off.subscribe(ALL, on_event=noop)
    on = Bus("bench-ui-on")
    on.subscribe(ALL, on_event=noop)
    on_state = JobState().start()
    on.subscribe(ALL, on_event=on_state)
    sink_bus = Bus("bench-ui-sink")
    sink_bus.subscribe(ALL, on_event=noop)
    sink = QueuedSink(lambda batch: None, name="bench-ui-sink")
    sink_bus.subscribe(ALL, on_event=sink)
    pages = Bus("bench-ui-pages")
    pages.subscribe(ALL, on_event=noop)
    page_state = JobState()
    pages.subscribe(ALL, on_event=page_state)
    server = UIServer(page_state, "127.0.0.1", 0).start()
    stop = threading.Event()
    readers = [threading.Thread(target=_reader, args=(server.port, stop), daemon=True)
               for _ in range(50)]
    for reader in readers:
        reader.start()
    # all 50 connected before the timing (bounded: a loaded machine starts threads slowly)
    deadline = time.monotonic() + 60
    while server.streams < 50 and time.monotonic() < deadline:
        time.sleep(0.01)
    opened = server.streams
    cases = {"--ui off": off, "--ui on": on, "--ui on, 50 open pages": pages,
             "one --sink (queue enqueue)": sink_bus}
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    try:
        for r in range(rounds):
            names = list(cases)
            for name in names[r % len(names):] + names[:r % len(names)]:
                samples[name].append(timed(cases[name]))
        # a page whose reader thread the machine starved long enough has its write time out
        # and its stream end (the server's rule for a stuck browser): counted, not hidden
        streams = server.streams
        pushes = server.pushes
    finally:
        stop.set()
        server.close(timeout=1.0)
        on_state.stop()
        sink.close(timeout=5.0)
    cpu = {name: statistics.median(v[0] for v in values) for name, values in samples.items()}
    wall = {name: statistics.median(v[1] for v in values) for name, values in samples.items()}
    base = cpu["--ui off"]
    rows = [{"case": name, "ns/event": ns, "added ns/event": ns - base,
             "wall ns/event": wall[name]} for name, ns in cpu.items()]
    folds = []
    for _ in range(rounds):
        state = JobState()
        for event in events:
            state(event)
        c0 = time.thread_time()
        state.fold()
        folds.append((time.thread_time() - c0) / batch * 1e9)
    snaps = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        dumps(page_state.snapshot())
        snaps.append((time.perf_counter() - t0) * 1e3)
    return {"rows": rows, "events per round": batch, "rounds": rounds,
            "streams open": opened, "streams open at the end": streams,
            "pushes to the pages": pushes,
            "fold on the view's thread (ns/event)": statistics.median(folds),
            "snapshot of 64 ranks as JSON (ms, reader thread)": statistics.median(snaps)}
