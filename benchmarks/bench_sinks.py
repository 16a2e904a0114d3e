"""What each sink sustains for ``METRIC`` events, and what it adds on the agent's thread.

Per round, ``batch`` METRIC events (two numbers each, rank 0 and 1 alternating, steps
increasing) are handed to the sink as the bus would (``sink(event)``, the enqueue), then
the sink is flushed. The enqueue's wall time per event is the cost on the publishing
thread (the agent's monitor thread in ``eventbus run``); events over the time until the
flush returned is what the backend sustains. Medians of the rounds. Backends are local:
TensorBoard writes to a temporary folder, OTLP posts to an HTTP receiver on 127.0.0.1 in
this process (it answers 200 at once), MLflow writes to a local file store.
"""

from __future__ import annotations

import http.server
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["run"]


class _Ok(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def _events(n: int, start: int) -> list[Any]:
    from eventbus.events import Event

    t = time.time()
    return [Event.from_dict({
        "type": "METRIC", "timestamp": t, "step": start + i // 2,
        "data": {"loss": 1.0 / (1 + i), "lr": 0.001},
        "context": {"rank": i % 2, "world_size": 2, "local_world_size": 2,
                    "run_id": "bench", "restart_count": 0, "hostname": "h", "pid": 1}})
        for i in range(n)]


def _measure(make: Callable[[], Any], *, rounds: int, batch: int) -> dict[str, float]:
    sink = make()
    enqueue_ns: list[float] = []
    per_s: list[float] = []
    try:
        for r in range(rounds):
            events = _events(batch, r * batch)
            t0 = time.perf_counter()
            for event in events:
                sink(event)
            t1 = time.perf_counter()
            sink.flush(600.0)
            t2 = time.perf_counter()
            enqueue_ns.append((t1 - t0) / batch * 1e9)
            per_s.append(batch / (t2 - t0))
        dropped = sum(sink.stats()["dropped"].values())
    finally:
        sink.close(timeout=30.0)
    return {"events/s": statistics.median(per_s),
            "enqueue ns/event": statistics.median(enqueue_ns), "dropped": float(dropped)}


def run(*, quick: bool = False) -> dict[str, Any]:
    """``rows``: sink -> events/s sustained, enqueue ns per event, drops."""
    from eventbus.app.sinks.mlflow import MlflowSink
    from eventbus.app.sinks.otlp import OtlpSink
    from eventbus.app.sinks.tensorboard import TensorBoardSink
    from eventbus.subscribers.queued import QueuedSink

    rounds = 2 if quick else 5
    batch = 200 if quick else 5_000
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Ok)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    rows: dict[str, dict[str, float]] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            makers: dict[str, Callable[[], Any]] = {
                "QueuedSink, no-op backend (reference)": lambda: QueuedSink(
                    lambda events: None, max_events=20_000),
                "tensorboard": lambda: TensorBoardSink(Path(tmp, "tb")),
                "otlp": lambda: OtlpSink(url, export_interval=0.5),
                "mlflow": lambda: MlflowSink(Path(tmp, "mlruns").as_uri()),
            }
            for name, make in makers.items():
                # MLflow's file store writes one file append per metric: fewer events.
                size = max(100, batch // 5) if name == "mlflow" else batch
                rows[name] = _measure(make, rounds=rounds, batch=size)
    finally:
        server.shutdown()
        server.server_close()
    return {"rows": rows, "rounds": rounds, "batch": batch}
