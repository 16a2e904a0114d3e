"""Two agents whose ranks end apart: one node's rank finishes cleanly, the other node's
rank fails with no restart left. torch keeps the finished node in its exit barrier for
``exit_barrier_timeout`` (300 s) waiting for a node that ended FAILED and never comes;
``eventbus run``'s failed node checks in on its way out (launcher/group/exit_barrier.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import subprocess_env
from tests.reliability.matrix import free_port

SCRIPT = """\
import os, sys, time
import torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 1:
    time.sleep(1.5)
    sys.exit(3)
print("rank 0 done", flush=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_finished_node_does_not_wait_out_the_barrier_for_a_failed_one(
        tmp_path: Path) -> None:
    """Node 0's rank ends 0 at once, node 1's ends 3 1.5 s later (--max-restarts 0): node 0
    exits 0 within seconds of node 1's exit 1, not after torch's 300 s barrier; its
    ``AGENT_EXIT`` says SUCCEEDED."""
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    port = free_port()
    procs = {}
    for node in (0, 1):
        procs[node] = subprocess.Popen(
            [sys.executable, "-m", "eventbus", "run",
             "--events-jsonl", str(tmp_path / f"node{node}.jsonl"), "--nnodes", "2",
             "--nproc-per-node", "1", "--rdzv-backend", "c10d",
             "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "exit-barrier",
             "--max-restarts", "0", "--monitor-interval", "0.1", str(script)],
            env=subprocess_env(LOGLEVEL="INFO"), cwd=tmp_path, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
    ended: dict[int, float] = {}
    deadline = time.monotonic() + 150
    try:
        while len(ended) < 2 and time.monotonic() < deadline:
            for node, proc in procs.items():
                if node not in ended and proc.poll() is not None:
                    ended[node] = time.monotonic()
            time.sleep(0.05)
    finally:
        outputs = {}
        for node, proc in procs.items():
            if proc.poll() is None:
                proc.kill()
            outputs[node] = proc.communicate(timeout=30)[1][-4000:]
    exits = {}
    for node in (0, 1):
        lines = [json.loads(line) for line in
                 (tmp_path / f"node{node}.jsonl").read_text().splitlines() if line.strip()]
        rdzv = [d for d in lines if d["type"] == "RENDEZVOUS" and d["state"] == "SUCCEEDED"]
        (agent_exit,) = [d for d in lines if d["type"] == "AGENT_EXIT"]
        exits[rdzv[-1]["data"]["group_rank"]] = (node, agent_exit)
    finished, _ = exits[0]
    failed, _ = exits[1]
    assert len(ended) == 2, outputs
    assert procs[finished].returncode == 0 and procs[failed].returncode == 1, outputs
    assert exits[0][1]["state"] == "SUCCEEDED", exits[0][1]
    # torch's barrier alone would hold the finished node until 300 s after its ranks ended
    assert ended[finished] - ended[failed] < 30, (ended, outputs[finished])
    assert "Done waiting for other agents" in outputs[finished], outputs[finished]
