"""A network partition between two nodes of a real ``eventbus run`` job (issue 25, item 4).

Two agents, each in a network namespace of its own joined by a veth pair (made and removed
by the test, as root): node A at 10.231.7.1 serves the rendezvous store
(``--rdzv-endpoint``), node B at 10.231.7.2 reaches it over the link. Once both workers
record, the link drops every packet both ways for 20 s, then carries them again: a root
``pfifo`` queue of 0 packets on both ends of the pair drops whatever is sent (this kernel
has no ``netem`` and this machine no iptables). Silent loss, as across a failed switch:
TCP connections live on and retransmit, new ones wait for an answer that never comes.

Measured and asserted:

* no worker's ``record()`` is slowed by the partition past the bound docs/guarantees.md
  gives (0.5 s: the full-collection pause of a loaded machine; the figure is printed);
* the job goes on, or if torch's rendezvous ends it, it ends with a reason on stderr;
* node B's worker events reach node B's agent late, or are reported lost there
  (``EVENTS_LOST``), with delivered + reported == the worker's own count of the record()
  calls that returned.

Skips, saying why, where namespaces cannot be made (not root, no ``ip``/``tc``, no
``pfifo`` qdisc).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from collections.abc import Iterator
from pathlib import Path

import pytest
from launcher_helpers import JOBS
from launcher_helpers import job_env

from eventbus.subscribers.jsonl import read_jsonl

pytestmark = pytest.mark.slow

CUT_S = 20.0
#: the bound docs/guarantees.md gives a record() call under a partition
RECORD_BOUND_S = 0.5
ADDR = {"a": "10.231.7.1", "b": "10.231.7.2"}
PORT = 29471


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=20)


@pytest.fixture
def netns() -> Iterator[dict[str, str]]:
    """Two namespaces joined by a veth pair, up, addressed; removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (ip netns add)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            pytest.skip(f"`{tool}` is not installed (iproute2)")
    tag = f"{os.getpid() % 100000}"
    names = {"a": f"ebpa{tag}", "b": f"ebpb{tag}"}
    devs = {"a": f"ebva{tag}", "b": f"ebvb{tag}"}
    made: list[str] = []
    try:
        for side in ("a", "b"):
            _ip("netns", "add", names[side])
            made.append(names[side])
        _ip("link", "add", devs["a"], "type", "veth", "peer", "name", devs["b"])
        for side in ("a", "b"):
            _ip("link", "set", devs[side], "netns", names[side])
            _ip("-n", names[side], "addr", "add", f"{ADDR[side]}/24", "dev", devs[side])
            _ip("-n", names[side], "link", "set", "lo", "up")
            _ip("-n", names[side], "link", "set", devs[side], "up")
        # the cut's qdisc must be there before the job starts: probe it (add, then remove)
        subprocess.run(["tc", "-n", names["a"], "qdisc", "add", "dev", devs["a"], "root",
                        "pfifo", "limit", "0"], check=True, capture_output=True, timeout=20)
        subprocess.run(["tc", "-n", names["a"], "qdisc", "del", "dev", devs["a"], "root"],
                       check=True, capture_output=True, timeout=20)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        for name in made:
            with contextlib.suppress(Exception):
                _ip("netns", "del", name)
        err = getattr(exc, "stderr", "") or ""
        pytest.skip(f"cannot make network namespaces here: {exc} {str(err).strip()[:200]}")
    try:
        yield {"ns_a": names["a"], "ns_b": names["b"], "dev_a": devs["a"], "dev_b": devs["b"]}
    finally:
        for name in made:
            with contextlib.suppress(Exception):
                _ip("netns", "del", name)  # removes the veth pair with it


def _cut(net: dict[str, str], *, on: bool) -> None:
    for side in ("a", "b"):
        ns, dev = net[f"ns_{side}"], net[f"dev_{side}"]
        cmd = (["qdisc", "add", "dev", dev, "root", "pfifo", "limit", "0"] if on
               else ["qdisc", "del", "dev", dev, "root"])
        subprocess.run(["tc", "-n", ns, *cmd], check=True, capture_output=True, timeout=20)


def test_a_20s_partition_of_node_b_from_the_store(
    tmp_path: Path, netns: dict[str, str], figure: Callable[[int | str, str], None],
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    env = job_env()
    env["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    procs: dict[str, subprocess.Popen[str]] = {}
    cut_at: list[float] = []
    restored_at: list[float] = []
    # 2 s of recording before the cut, the cut, 6 s after it
    seconds = 2.0 + CUT_S + 6.0
    for side in ("a", "b"):
        cmd = ["ip", "netns", "exec", netns[f"ns_{side}"], sys.executable, "-m", "eventbus",
               "run", "--events-jsonl", str(tmp_path / f"events-{side}.jsonl"),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{ADDR['a']}:{PORT}",
               "--rdzv-id", "partition", "--nnodes", "2", "--nproc-per-node", "1",
               "--monitor-interval", "0.1", "--max-restarts", "0",
               "--local-addr", ADDR[side],
               # torch finds the store's host by hostname, the same in both namespaces
               "--rdzv-conf", f"is_host={int(side == 'a')}",
               str(JOBS / "partition_loop.py"), "--out", str(out), "--seconds", str(seconds)]
        with open(tmp_path / f"agent-{side}.log", "w") as log:
            procs[side] = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=log,
                                           stderr=subprocess.STDOUT, text=True,
                                           start_new_session=True)

    def partition() -> None:
        deadline = time.monotonic() + 150
        while len(list(out.glob("rank*.pid"))) < 2:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs.values()):
                return
            time.sleep(0.1)
        time.sleep(2.0)
        _cut(netns, on=True)
        cut_at.append(time.time())
        time.sleep(CUT_S)
        _cut(netns, on=False)
        restored_at.append(time.time())

    cutter = threading.Thread(target=partition, daemon=True)
    cutter.start()
    outputs: dict[str, tuple[int, str]] = {}
    stopped_a = False
    try:
        procs["b"].wait(timeout=240)
        # If torch's rendezvous ended node B, node A's agent waits for it at torch's exit
        # barrier (300 s, not a torchrun option, in a C++ wait that defers SIGTERM's
        # handler): once A's worker is done, stop A, by SIGKILL if SIGTERM is not enough.
        deadline = time.monotonic() + 120
        while procs["a"].poll() is None and time.monotonic() < deadline:
            if procs["b"].returncode != 0 and len(list(out.glob("rank*.json"))) == 2:
                time.sleep(5.0)
                if procs["a"].poll() is None:
                    stopped_a = True
                    os.killpg(procs["a"].pid, signal.SIGTERM)
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        procs["a"].wait(timeout=10)
                    if procs["a"].poll() is None:
                        os.killpg(procs["a"].pid, signal.SIGKILL)
                break
            time.sleep(0.2)
        procs["a"].wait(timeout=60)
    finally:
        for side, proc in procs.items():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
            outputs[side] = (proc.returncode,
                             (tmp_path / f"agent-{side}.log").read_text(errors="replace"))
        cutter.join(CUT_S + 10)
        with contextlib.suppress(Exception):
            _cut(netns, on=False)
    assert cut_at and restored_at, {s: o[1][-3000:] for s, o in outputs.items()}

    results = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
    events_b = list(read_jsonl(tmp_path / "events-b.jsonl"))
    # node B's worker: one whose events, or losses, its agent (node B's JSONL) reports
    senders = {res.get("sender"): rank for rank, res in results.items()}
    nodes_b_ranks = {e["context"].get("rank") for e in events_b if e["type"] == "EPOCH_END"}
    nodes_b_ranks |= {senders.get(e.get("source")) for e in events_b
                      if e["type"] == "EVENTS_LOST"}
    rc = {side: o[0] for side, o in outputs.items()}
    lines = [f"job exit codes {rc}" + (" (A stopped by the test after B ended)"
                                      if stopped_a else "") + f"; link cut {CUT_S:g} s"]
    for rank, res in sorted(results.items()):
        during = cut_at[0] <= res["slowest_at"] <= restored_at[0] + 1
        lines.append(f"rank {rank}: recorded {res['recorded']}, errors {res['errors']}, slowest "
                     f"record() {res['slowest_s'] * 1000:.1f} ms "
                     f"({'in' if during else 'outside'} the cut), over 100 ms "
                     f"{res['over_100ms']}, bus events {res['bus_events']}, queue given "
                     f"{res.get('given')}, forwarder lost {res.get('lost')}")
    # Node B's worker: delivered to node B's agent + reported lost there == recorded.
    assert len(nodes_b_ranks - {None}) == 1, sorted(nodes_b_ranks)
    (rank_b,) = nodes_b_ranks - {None}
    res_b = results[rank_b]
    # every event of that worker: its context names its rank (the agent's own have none)
    delivered = sum(1 for e in events_b if e["type"] != "EVENTS_LOST"
                    and e["context"].get("rank") == rank_b)
    reported: dict[str, int] = {}
    for e in events_b:
        if e["type"] == "EVENTS_LOST" and e.get("source") == res_b.get("sender"):
            reported[e["reason"]] = reported.get(e["reason"], 0) + e["count"]
    lines.append(f"node B (rank {rank_b}): given to its queue {res_b['given']}, delivered "
                 f"{delivered}, reported lost {sum(reported.values())} {reported}")
    for side, (code, stderr) in outputs.items():
        if code != 0:
            tail = [ln for ln in stderr.splitlines() if ln.strip()][-3:]
            lines.append(f"node {side.upper()} ended {code}: {' | '.join(tail)[-600:]}")
    figure("partition", "; ".join(lines))
    for res in results.values():
        assert res["errors"] == 0
        assert res["slowest_s"] < RECORD_BOUND_S, lines
    # The truth: every event the worker's forwarder was given (its queue's own count, read
    # in the worker); the script's counting subscriber saw all but the few the bootstrap
    # recorded before the script ran.
    assert 0 <= res_b["given"] - res_b["bus_events"] <= 5, lines
    assert delivered + sum(reported.values()) == res_b["given"], lines
    for side, (code, stderr) in outputs.items():
        # the job goes on (0), or torch's rendezvous ended it and said why
        assert code == 0 or "Rendezvous" in stderr or "rendezvous" in stderr, \
            (side, stderr[-3000:])
